"""Diffs: what changed in a box's files between two of its states.

A side of a comparison is a state of a file system that an agent can walk: a
running box now, a snapshot, or the box's image. A snapshot and an image are
brought up for the comparison as boxes of their own (a snapshot's restore is a
fork: its memory is shared copy-on-write, so it costs a small fraction of a cold
boot), held by this process and removed when the comparison ends, or by recovery
if this process dies first. Walking a running state, not reading a disk image,
is what makes the answer exact: a live snapshot's disk lacks what its page cache
held, and a box's disk mid-transaction needs its journal; the box's own kernel
has neither problem.

Each side's agent streams a manifest of its tree (``FS TREE``: type, mode,
owner, size, times, inode, links, device number, link target), on the root's
file system only. The two manifests are compared on the host: a path whose
inode, change time, modification time and size are equal on both sides is the
same file (every state of a box is one ext4 file system's history, whose inode
numbers and change times carry over; the change time cannot be set from user
space), so only the files that differ are read. A 1 GB tree with a few changed
files costs two walks and a few reads.

What a change is:

* ``added``, ``deleted``: a path on one side only. A deleted file and an added
  one with the same inode and content are one ``renamed`` change (``renamed_from``);
* ``modified``: the same path with other content, another type, link target or
  device number, or other permissions or owner (``fields`` names which). A file
  whose content and attributes are equal is no change, whatever its times say.

Text files up to ``text_limit`` bytes on both sides get a unified diff; binary or
larger modified files get their sizes and SHA-256 hashes, as do added and deleted
files up to 1 MiB or ``text_limit`` (a larger one gets its size: reading a whole new
dataset to hash it is rarely what a review of an agent's work wants).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hashlib
import os
import posixpath
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..crashpoints import crash_point
from ..errors import (
    GuestFileNotFoundError,
    GuestNotADirectoryError,
    InvalidArgument,
    ProtocolError,
)
from ..protocol import files as pfiles
from ..protocol.connection import AgentConnection, newer_agent_needed
from ..protocol.wire import FsFlag, FsOp, TreeEntry
from .requests import BoxRequest

if TYPE_CHECKING:
    from .entry import BoxEntry
    from .service import Core

TEXT_LIMIT = 1024 * 1024  # bytes of a text file that still gets a unified diff
READS_AT_ONCE = 8  # files read from each side at the same time
HASH_LIMIT = 1024 * 1024  # an added or deleted file up to this size is read for its hash
DIFFS_LIMIT = 64 * 1024 * 1024  # characters of unified diff one answer holds; later ones are left out
BINARY_SNIFF = 8192  # a NUL byte in these first bytes marks a binary file, as git decides


def kind(mode: int) -> str:
    """A type's name: file, dir, symlink, fifo, socket, char or block."""
    return {
        stat.S_IFREG: "file",
        stat.S_IFDIR: "dir",
        stat.S_IFLNK: "symlink",
        stat.S_IFIFO: "fifo",
        stat.S_IFSOCK: "socket",
        stat.S_IFCHR: "char",
        stat.S_IFBLK: "block",
    }.get(stat.S_IFMT(mode), "unknown")


def check_paths(paths: Sequence[str] | str | None) -> list[str]:
    """The subtrees to compare: absolute, normalized, none inside another ("/" if none)."""
    if paths is None:
        return ["/"]
    if isinstance(paths, str):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        if not isinstance(p, str) or not p.startswith("/") or "\x00" in p:
            raise InvalidArgument(f"paths must be absolute guest paths, not {p!r}")
        out.append(posixpath.normpath(p).replace("//", "/"))
    out = sorted(set(out))
    return [p for p in out if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in out)] or ["/"]


# -- one side ---------------------------------------------------------------------------


@dataclass
class Side:
    """One state being compared: what it is called, and how to reach its agent.
    ``box_id`` is the box whose history it is a state of, made at ``born``;
    ``stable_ino``: its engine keeps inode numbers across a restore (QEMU: the guest's
    own ext4; gVisor numbers them afresh as a restored sandbox looks files up).

    ``connection`` is asked again for each request, never kept: a session that sat
    idle while the other side came up or was walked (a restore on a loaded host takes
    longer than the idle release) has given its port back, and the next request
    connects again."""

    label: str
    connection: Callable[[], Awaitable[AgentConnection]]
    box_id: str | None = None
    born: float | None = None
    stable_ino: bool = True

    async def walk(self, roots: Sequence[str]) -> dict[str, TreeEntry]:
        """Absolute path -> entry, for every root that exists on this side."""
        found: dict[str, TreeEntry] = {}
        for root in roots:
            try:
                entries = await pfiles.tree(await self.connection(), root)
            except GuestNotADirectoryError:  # a file, link or device: its own entry
                entries = await pfiles.tree(await self.connection(), root, self_only=True)
            except GuestFileNotFoundError:
                continue  # not on this side: everything under it is added or deleted
            for e in entries:
                found[posixpath.join(root, e.path) if e.path else root] = e
        return found

    async def chunks(self, path: str) -> AsyncIterator[bytes]:
        _, _, chunks = await pfiles.read_stream(await self.connection(), path)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]


@dataclass
class Content:
    """What was read of one side's file: its hash, and its text if it is small text."""

    sha256: str
    text: str | None


async def read_content(side: Side, path: str, size: int, text_limit: int) -> Content:
    digest = hashlib.sha256()
    keep = bytearray() if size <= text_limit else None
    async for chunk in side.chunks(path):
        digest.update(chunk)
        if keep is not None:
            keep += chunk
            if len(keep) > text_limit:  # grew while being read
                keep = None
    text = None
    if keep is not None and b"\x00" not in keep[:BINARY_SNIFF]:
        with contextlib.suppress(UnicodeDecodeError):
            text = keep.decode("utf-8")
    return Content(digest.hexdigest(), text)


# -- the comparison ---------------------------------------------------------------------


def unchanged(
    a: TreeEntry, b: TreeEntry, *, by_ino: bool = True, trusted_before_ns: int | None = None
) -> bool:
    """Certainly the same file, without reading it: the same change time (which no
    program can set) and the rest. ``trusted_before_ns``: only for a change time before
    it (two boxes' histories that split then can each change a path within one clock
    tick of the guest kernel's timestamps, to the same size). ``by_ino``: the inode too."""
    if trusted_before_ns is not None and a.ctime_ns >= trusted_before_ns:
        return False
    return (
        (a.ino == b.ino or not by_ino)
        and a.ctime_ns == b.ctime_ns
        and a.mtime_ns == b.mtime_ns
        and a.size == b.size
        and a.mode == b.mode
        and a.uid == b.uid
        and a.gid == b.gid
    )


def state(e: TreeEntry, content: Content | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": kind(e.mode),
        "size": e.size,
        "mode": stat.S_IMODE(e.mode),
        "uid": e.uid,
        "gid": e.gid,
        "mtime": e.mtime_ns / 1e9,
    }
    if e.link_target is not None:
        out["target"] = e.link_target
    if stat.S_ISCHR(e.mode) or stat.S_ISBLK(e.mode):
        out["rdev"] = [os.major(e.rdev), os.minor(e.rdev)]
    if content is not None:
        out["sha256"] = content.sha256
    return out


def attribute_fields(a: TreeEntry, b: TreeEntry) -> list[str]:
    fields = []
    if stat.S_IFMT(a.mode) != stat.S_IFMT(b.mode):
        fields.append("type")
    if stat.S_IMODE(a.mode) != stat.S_IMODE(b.mode):
        fields.append("mode")
    if (a.uid, a.gid) != (b.uid, b.gid):
        fields.append("owner")
    if a.link_target != b.link_target:
        fields.append("target")
    if (stat.S_ISCHR(a.mode) or stat.S_ISBLK(a.mode)) and a.rdev != b.rdev:
        fields.append("rdev")
    return fields


def unified(path: str, old: str | None, new: str | None) -> str:
    lines = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        (new or "").splitlines(keepends=True),
        fromfile="/dev/null" if old is None else f"a{path}",
        tofile="/dev/null" if new is None else f"b{path}",
    )
    end = "\n\\ No newline at end of file\n"
    return "".join(line if line.endswith("\n") else line + end for line in lines)


def trusted_before(a: Side, b: Side) -> int | None:
    """Up to when equal metadata prove a file unchanged, in ns (None: always).

    A false match needs both sides to have changed the path after their histories
    split, within one tick of the guest clock, to the same size. States of one box's
    history cannot: one is the earlier (a snapshot), and what the later changed since
    has later times. Two boxes (forks, say) can; their histories split no earlier than
    the older box was made, and a change time before that (less a second's margin) is
    a file both inherited. The image's box is fresh: its changes are made now."""
    if a.box_id is None or b.box_id is None or a.box_id == b.box_id:
        return None
    if a.born is None or b.born is None:
        return 0  # a box that is gone: every path that looks equal is read
    return int((min(a.born, b.born) - 1.0) * 1e9)


async def compare(
    a: Side, b: Side, paths: Sequence[str] | str | None = None, *, text_limit: int = TEXT_LIMIT
) -> dict[str, Any]:
    """Every change from side ``a`` to side ``b`` under ``paths`` (all of ``/`` if none)."""
    roots = check_paths(paths)
    by_ino = a.stable_ino and b.stable_ino
    horizon = trusted_before(a, b)
    if not isinstance(text_limit, int) or text_limit < 0:
        raise InvalidArgument(f"text_limit must be a whole number of bytes, not {text_limit!r}")
    began = time.monotonic()
    ta, tb = await asyncio.gather(a.walk(roots), b.walk(roots))
    walked = time.monotonic() - began
    gate = asyncio.Semaphore(READS_AT_ONCE)

    async def read(side: Side, path: str, e: TreeEntry) -> Content:
        async with gate:
            return await read_content(side, path, e.size, text_limit)

    changes: dict[str, dict[str, Any]] = {}
    reads: list[Awaitable[None]] = []
    budget = [DIFFS_LIMIT]

    def attach(change: dict[str, Any], old: str | None, new: str | None) -> None:
        text = unified(change["path"], old, new)
        if len(text) > budget[0]:
            change["diff_omitted"] = True  # the answer holds its counts, not every patch
            return
        budget[0] -= len(text)
        change["diff"] = text

    def regular(e: TreeEntry | None) -> bool:
        return e is not None and stat.S_ISREG(e.mode)

    async def settle_modified(path: str, ea: TreeEntry, eb: TreeEntry, fields: list[str]) -> None:
        ca, cb = await asyncio.gather(read(a, path, ea), read(b, path, eb))
        if ca.sha256 != cb.sha256:
            fields = ["content", *fields]
        if not fields:
            return  # only its times changed
        change = {"path": path, "status": "modified", "fields": fields,
                  "old": state(ea, ca), "new": state(eb, cb)}  # fmt: skip
        if "content" in fields and ca.text is not None and cb.text is not None:
            attach(change, ca.text, cb.text)
        changes[path] = change

    async def settle_one(path: str, e: TreeEntry, side: Side, status: str) -> None:
        content = await read(side, path, e)
        change = changes[path]
        change["old" if status == "deleted" else "new"] = state(e, content)
        if content.text is not None:
            old, new = (content.text, None) if status == "deleted" else (None, content.text)
            attach(change, old, new)

    only_a = {p: e for p, e in ta.items() if p not in tb}
    only_b = {p: e for p, e in tb.items() if p not in ta}
    # a rename keeps its inode: those pairs are read whatever their size, to tell
    # a rename from a freed inode number given to a new file
    moved = {e.ino for e in only_a.values() if stat.S_ISREG(e.mode) and by_ino} & {
        e.ino for e in only_b.values() if stat.S_ISREG(e.mode)
    }
    for path in sorted(ta.keys() | tb.keys()):
        ea, eb = ta.get(path), tb.get(path)
        if ea is not None and eb is not None:
            same = unchanged(ea, eb, by_ino=by_ino, trusted_before_ns=horizon)
            if same and ea.link_target == eb.link_target and ea.rdev == eb.rdev:
                continue
            fields = attribute_fields(ea, eb)
            if regular(ea) and regular(eb):
                reads.append(settle_modified(path, ea, eb, fields))
            elif fields:
                changes[path] = {"path": path, "status": "modified", "fields": fields,
                                 "old": state(ea), "new": state(eb)}  # fmt: skip
            continue
        status, e, side = ("added", eb, b) if ea is None else ("deleted", ea, a)
        assert e is not None
        changes[path] = {"path": path, "status": status, "old": None, "new": None}
        changes[path]["old" if status == "deleted" else "new"] = state(e)
        if stat.S_ISREG(e.mode) and (e.size <= max(text_limit, HASH_LIMIT) or e.ino in moved):
            reads.append(settle_one(path, e, side, status))
    await asyncio.gather(*reads)
    found = detect_renames(changes, ta, tb) if by_ino else sorted(changes.values(), key=lambda c: c["path"])
    stat_ = summary(found)
    return {
        "a": a.label,
        "b": b.label,
        "paths": roots,
        "changes": found,
        "stat": stat_,
        "walked": {"a": len(ta), "b": len(tb), "seconds": round(walked, 4)},
        "seconds": round(time.monotonic() - began, 4),
    }


def detect_renames(
    changes: dict[str, dict[str, Any]], ta: dict[str, TreeEntry], tb: dict[str, TreeEntry]
) -> list[dict[str, Any]]:
    """A deleted path and an added one holding the same inode and the same content are
    one rename (an inode number a deleted file freed can be reused: the content decides)."""
    deleted = {ta[c["path"]].ino: c for c in changes.values() if c["status"] == "deleted"}
    for c in list(changes.values()):
        if c["status"] != "added":
            continue
        e = tb[c["path"]]
        gone = deleted.get(e.ino)
        if gone is None or gone["path"] not in changes:
            continue
        old, new = gone["old"], c["new"]
        if any(old.get(k) != new.get(k) for k in ("type", "sha256", "target")):
            continue
        del changes[gone["path"]]
        c.pop("diff", None)
        c.update(status="renamed", renamed_from=gone["path"], old=old)
        c["fields"] = [f for f, keys in (("mode", ("mode",)), ("owner", ("uid", "gid")))
                       if any(old[k] != new[k] for k in keys)]  # fmt: skip
    return sorted(changes.values(), key=lambda c: c["path"])


def summary(changes: list[dict[str, Any]]) -> dict[str, int]:
    out = {"added": 0, "deleted": 0, "modified": 0, "renamed": 0, "lines_added": 0, "lines_removed": 0}
    for c in changes:
        out[c["status"]] += 1
        for line in (c.get("diff") or "").splitlines()[2:]:  # past the file's two header lines
            if line.startswith("+"):
                out["lines_added"] += 1
            elif line.startswith("-"):
                out["lines_removed"] += 1
    return out


# -- the sides of a box -----------------------------------------------------------------


def side_key(value: str | None, default: str) -> tuple[str, str]:
    """A side as the wire names it: ``now``, ``image``, ``box:KEY``, ``snapshot:KEY``, or
    a snapshot's id or name -> (kind, key)."""
    text = default if value is None else value
    if not isinstance(text, str) or not text or "\x00" in text:
        raise InvalidArgument(f"a side of a diff is 'now', 'image', 'box:KEY' or a snapshot, not {value!r}")
    if text in ("now", "image"):
        return text, ""
    scheme, sep, key = text.partition(":")
    if sep and scheme in ("box", "snapshot") and key:
        return scheme, key
    return "snapshot", text


async def diff(
    core: Core,
    entry: BoxEntry,
    a: str | None = None,
    b: str | None = None,
    *,
    paths: Sequence[str] | str | None = None,
    text_limit: int = TEXT_LIMIT,
) -> dict[str, Any]:
    """The changes from ``a`` (default: the box's image) to ``b`` (default: the box now)."""
    check_paths(paths)
    kinds = side_key(a, "image"), side_key(b, "now")
    async with contextlib.AsyncExitStack() as held:
        # both at once, each to its end: a side that came up is in ``held`` (removed on the
        # way out) before a failure of the other is raised
        opened = await asyncio.gather(*(open_side(core, entry, k, key, held) for k, key in kinds),
                                      return_exceptions=True)  # fmt: skip
        for failed in opened:
            if isinstance(failed, BaseException):
                raise failed
        sides = [s for s in opened if isinstance(s, Side)]
        crash_point("diff.sides-open")
        with newer_agent_needed("list a file tree", "compare or restore its files"):
            return await compare(sides[0], sides[1], paths, text_limit=text_limit)


async def open_side(
    core: Core, entry: BoxEntry, kind_: str, key: str, held: contextlib.AsyncExitStack
) -> Side:
    ctl = core.controller

    def connection(box: BoxEntry) -> Callable[[], Awaitable[AgentConnection]]:
        return lambda: ctl.connection(box)

    if kind_ in ("now", "box"):
        box = entry if kind_ == "now" else await ctl.find(key)
        await ctl.connection(box)  # it must run: fail before starting the other side
        rec = box.record
        return Side(f"{box.name} now", connection(box), box.id, rec.created_at, box.spec.engine != "gvisor")
    options: dict[str, Any] = {
        "name": f"{entry.name[:50]}-diff-{os.urandom(3).hex()}",  # a name is at most 63 characters
        "labels": {"sandlot.diff-of": entry.id},
    }
    if kind_ == "snapshot":
        snap = await core.live.find_snapshot(key, kinds=("snapshot", "template", "step"))
        (temp,) = await core.live.start_boxes(snap, 1, held_by_me=True, **options)
        held.push_async_callback(ctl.remove, temp, force=True)
        owner = await core.db.find(snap.box_id) if snap.box_id else None
        side = Side(f"snapshot {snap.name or snap.id}", connection(temp), snap.box_id,
                    owner.created_at if owner else None)  # fmt: skip
    else:
        temp = await ctl.create(await image_request(core, entry, options), ephemeral=True)
        held.push_async_callback(ctl.remove, temp, force=True)
        await ctl.start(temp)
        side = Side(f"image {entry.spec.image or entry.spec.rootfs}", connection(temp))
    side.stable_ino = temp.spec.engine != "gvisor"
    return side


async def image_request(core: Core, entry: BoxEntry, options: dict[str, Any]) -> BoxRequest:
    """A box of ``entry``'s image, as that image was when the box was made."""
    spec = entry.spec
    options = {**options, "engine": spec.engine}
    if spec.rootfs is not None:
        return BoxRequest.build(None, {**options, "rootfs": spec.rootfs})
    digest = entry.record.image_digest or spec.image
    image = await asyncio.to_thread(core.rt.images.get, digest) if digest else None
    if image is None:
        raise InvalidArgument(
            f"box {entry.name}'s image ({spec.image or 'none: it came from an imported snapshot'}) "
            "is not here to compare with: compare against one of its snapshots instead"
        )
    return BoxRequest.build(image, options, pull="never")


# -- bringing a path back ---------------------------------------------------------------


async def restore(core: Core, entry: BoxEntry, path: str, snapshot: str) -> dict[str, Any]:
    """Make ``path`` in the running box what it was in ``snapshot``: a file, a link, a
    special file, or a whole tree (what was added under it since is gone), with its
    modes and owners; the rest of the box is left as it is. The snapshot's copy is
    built beside the path, then renamed into place, so the path is never half
    restored. Files hard-linked together in the snapshot come back as copies."""
    (path,) = check_paths([path])
    if path == "/":
        raise InvalidArgument("restore takes a path under /; to bring back the whole box, roll it back")
    ctl = core.controller
    async with contextlib.AsyncExitStack() as held:
        kind_, key = side_key(snapshot, "")
        if kind_ != "snapshot":
            raise InvalidArgument(f"restore takes a snapshot to restore from, not {snapshot!r}")
        await ctl.connection(entry)  # the box must run: fail before starting anything
        src = await open_side(core, entry, "snapshot", key, held)
        source = await src.connection()
        with newer_agent_needed("list a file tree", "compare or restore its files"):
            own = await pfiles.tree(source, path, self_only=True)
        if len(own) != 1:
            raise ProtocolError(f"the agent answered {len(own)} entries for the one path {path}")
        top = own[0]
        entries = await pfiles.tree(source, path) if stat.S_ISDIR(top.mode) else [top]
        # asked for again now: the snapshot's restore may have outlasted the idle release
        here = await ctl.connection(entry)
        parent, name = posixpath.split(path)
        stage = posixpath.join(parent, f".{name[:200]}.sandlot-restore-{os.urandom(4).hex()}")  # NAME_MAX
        copied = Copied()
        try:
            for e in entries:
                await copy_entry(
                    source, here, path, e, posixpath.join(stage, e.path) if e.path else stage, copied
                )
            await swap_into_place(here, stage, path)
        except BaseException:
            with contextlib.suppress(Exception):
                await pfiles.fs_request(here, FsOp.REMOVE, stage, flags=FsFlag.RECURSIVE | FsFlag.MISSING_OK)
            raise
    return {"path": path, "from": src.label, "entries": copied.entries, "bytes": copied.bytes,
            "skipped": copied.skipped}  # fmt: skip


@dataclass
class Copied:
    entries: int = 0
    bytes: int = 0
    skipped: list[str] | None = None


async def copy_entry(
    src: AgentConnection, here: AgentConnection, root: str, e: TreeEntry, to: str, copied: Copied
) -> None:
    owner = f"{e.uid}:{e.gid}"
    perms = stat.S_IMODE(e.mode)
    if stat.S_ISDIR(e.mode):
        await pfiles.fs_request(here, FsOp.MKDIR, to, mode=perms)
    elif stat.S_ISREG(e.mode):
        _, _, chunks = await pfiles.read_stream(src, posixpath.join(root, e.path) if e.path else root)
        copied.bytes += await pfiles.write_stream(here, to, chunks, mode=perms, parents=False, exclusive=True)
    elif stat.S_ISLNK(e.mode):
        await pfiles.fs_request(here, FsOp.SYMLINK, to, target=e.link_target or "")
    elif stat.S_ISFIFO(e.mode) or stat.S_ISCHR(e.mode) or stat.S_ISBLK(e.mode):
        await pfiles.fs_request(here, FsOp.MKNOD, to, mode=e.mode, rdev=e.rdev)
    else:  # a socket belongs to the process that listened on it
        copied.skipped = [*(copied.skipped or []), posixpath.join(root, e.path)]
        return
    await pfiles.fs_request(here, FsOp.CHOWN, to, user=owner, flags=FsFlag.NOFOLLOW)
    if not stat.S_ISLNK(e.mode) and (stat.S_ISDIR(e.mode) or perms & 0o7000):
        await pfiles.fs_request(here, FsOp.CHMOD, to, mode=perms)  # chown clears set-id bits; umask
    copied.entries += 1


async def swap_into_place(here: AgentConnection, stage: str, path: str) -> None:
    """``stage`` becomes ``path``; what ``path`` was is removed."""
    try:
        await pfiles.fs_request(here, FsOp.STAT, path, flags=FsFlag.NOFOLLOW)
    except GuestFileNotFoundError:
        await pfiles.fs_request(here, FsOp.RENAME, stage, path2=path)
        return
    parent, name = posixpath.split(path)
    old = posixpath.join(parent, f".{name[:200]}.sandlot-replaced-{os.urandom(4).hex()}")
    await pfiles.fs_request(here, FsOp.RENAME, path, path2=old)
    try:
        await pfiles.fs_request(here, FsOp.RENAME, stage, path2=path)
    except BaseException:
        await pfiles.fs_request(here, FsOp.RENAME, old, path2=path)
        raise
    await pfiles.fs_request(here, FsOp.REMOVE, old, flags=FsFlag.RECURSIVE | FsFlag.MISSING_OK)
