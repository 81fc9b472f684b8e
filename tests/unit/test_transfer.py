"""Trees moved as ``docker cp`` moves them, both ways, against hostile trees: the box's
side is the real agent's ARCHIVE (its C, run on the host over a socket pair), this
host's side ``api/tarstream.py``. Upload is this host's tree into the agent; download
the agent's tree into this host; each side's unpacking is also fed hostile archives.

In every case nothing outside the destination is read or written, the destination is
whole or as it was, and an error names the entry (``TransferError``)."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import socket
import stat
import tarfile
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.api import tarstream
from sandlot.api.tarstream import Follow, host_tree, unpack
from sandlot.errors import GuestFileNotFoundError, TransferError, Unsupported, from_dict, guest_os_error
from sandlot.protocol import archive as parchive
from sandlot.protocol.connection import AgentConnection

from tests.support.hostagent import connected

SIDES = ("host", "box")
SECRET = b"the-secret-outside-the-tree"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def one(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 100_000):
        yield data[i : i + 100_000]


async def extract(side: str, conn: AgentConnection, chunks: AsyncIterable[bytes], dest: Path) -> Any:
    if side == "host":
        return await unpack(chunks, dest)
    return await parchive.write_tree(conn, str(dest), chunks)


async def collect(chunks: AsyncIterable[bytes]) -> bytes:
    return b"".join([c async for c in chunks])


def snapshot(root: Path) -> dict[str, Any]:
    """Everything under ``root``: each path's type and content or target."""
    out: dict[str, Any] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", p.read_bytes(), stat.S_IMODE(st.st_mode))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))
    return out


def outside(tmp: Path) -> Path:
    """A directory beside every destination, holding a secret: never read, never written."""
    o = tmp / "outside"
    o.mkdir(exist_ok=True)
    (o / "secret").write_bytes(SECRET)
    (o / "passwd").write_text("root:x:0:0\n")
    return o


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None], end: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
        stop = t.offset
    return buf.getvalue() if end else buf.getvalue()[:stop]


def f(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def d(name: str) -> tuple[tarfile.TarInfo, None]:
    t = tarfile.TarInfo(name)
    t.type, t.mode = tarfile.DIRTYPE, 0o755
    return t, None


def sym(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    t = tarfile.TarInfo(name)
    t.type, t.linkname = tarfile.SYMTYPE, target
    return t, None


def hard(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    t = tarfile.TarInfo(name)
    t.type, t.linkname = tarfile.LNKTYPE, target
    return t, None


def hostile(tmp: Path) -> dict[str, tuple[bytes, str]]:
    """Archives each side must refuse, and the entry the refusal must name."""
    out = str(outside(tmp))
    long_part = "x" * 300
    note = tarfile.TarInfo.create_pax_global_header(
        {"SANDLOT.error.path": "src/changing.log", "SANDLOT.error.message": "it changed"}
    )
    return {
        "link-then-file": (tar_of(sym("a", out), f("a/passwd", b"pwned")), "a/passwd"),
        "relative-link-then-file": (tar_of(sym("a", "../outside"), f("a/passwd", b"pwned")), "a/passwd"),
        "link-then-dir-then-file": (tar_of(sym("a", out), d("a/sub"), f("a/sub/x", b"pwned")), "a/sub/"),
        "link-to-itself-then-file": (tar_of(sym("a", "."), f("a/a/x", b"pwned")), "a/a/x"),
        "dir-then-link-over-it": (tar_of(d("a"), sym("a", out), f("a/passwd", b"pwned")), "a"),
        "hardlink-absolute": (tar_of(hard("h", f"{out}/secret")), "h"),
        "hardlink-escaping": (tar_of(hard("h", "../outside/secret")), "h"),
        "hardlink-through-a-link": (tar_of(sym("a", out), hard("h", "a/secret")), "h"),
        "hardlink-to-nothing-before-it": (tar_of(hard("h", "later"), f("later")), "h"),
        "dotdot": (tar_of(f("../evil", b"pwned")), "../evil"),
        "dotdot-inside": (tar_of(d("a"), f("a/../../evil", b"pwned")), "a/../../evil"),
        "absolute": (tar_of(f(f"{out}/evil", b"pwned")), f"{out}/evil"),
        "a-name-too-long-for-the-disk": (tar_of(f("ok"), f(long_part)), long_part),
        "cut-inside-a-file": (tar_of(f("ok"), f("big", bytes(100_000)))[:3000], "big"),
        "no-end-of-archive": (tar_of(f("ok"), f("last"), end=False), "last"),
        "noted-by-its-source": (tar_of(f("ok"), end=False) + note, "src/changing.log"),
    }


def refused(exc: BaseException, entry: str) -> bool:
    return isinstance(exc, TransferError) and exc.entry == entry


# -- links are links, both ways ----------------------------------------------------------------


def tree_with_links(tmp: Path) -> Path:
    o = outside(tmp)
    src = tmp / "src"
    (src / "venv" / "bin").mkdir(parents=True)
    (src / "main.py").write_text("print('main')\n")
    (src / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")  # absolute
    (src / "venv" / "m").symlink_to("../main.py")  # relative, inside
    (src / "secret-link").symlink_to(o / "secret")  # absolute, outside
    (src / "escape").symlink_to("../outside/secret")  # relative, outside
    (src / "etc").symlink_to("/etc")  # a directory, outside
    (src / "dangling").symlink_to("no/such/thing")
    os.link(src / "main.py", src / "hard.py")
    os.mkfifo(src / "fifo")
    return src


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_links_are_carried_as_links_and_never_followed(tmp_path: Path, direction: str) -> None:
    src = tree_with_links(tmp_path)
    dest = tmp_path / "dest"

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            if direction == "upload":
                async with host_tree(src) as (chunks, _report):
                    stream = await collect(chunks)
                await parchive.write_tree(conn, str(dest), one(stream))
            else:
                stream = await collect(parchive.read_tree(conn, str(src)))
                await unpack(one(stream), dest)
            assert SECRET not in stream  # what a link points to outside the tree is never read

    run(go())
    assert os.readlink(dest / "venv" / "bin" / "python") == "/usr/bin/python3"
    assert os.readlink(dest / "venv" / "m") == "../main.py"
    assert os.readlink(dest / "secret-link") == str(tmp_path / "outside" / "secret")
    assert os.readlink(dest / "escape") == "../outside/secret"
    assert os.readlink(dest / "etc") == "/etc" and os.readlink(dest / "dangling") == "no/such/thing"
    assert (dest / "main.py").stat().st_ino == (dest / "hard.py").stat().st_ino  # still one file
    assert stat.S_ISFIFO((dest / "fifo").lstat().st_mode)
    assert (tmp_path / "outside" / "secret").read_bytes() == SECRET


@pytest.mark.parametrize("side", SIDES)
def test_links_are_followed_only_when_asked_and_only_inside_the_tree(tmp_path: Path, side: str) -> None:
    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    (src / "lib" / "real.txt").write_text("inside")
    (src / "lib" / "alias.txt").symlink_to("real.txt")
    (src / "libdir").symlink_to("lib")
    o = outside(tmp_path)

    async def read(follow: bool, exceptions: tuple[str, ...] = ()) -> bytes:
        if side == "host":
            async with host_tree(src, Follow(follow, exceptions)) as (chunks, _):
                return await collect(chunks)
        return await collect(parchive.read_tree(conn, str(src), follow=follow))

    async def go() -> None:
        nonlocal conn
        async with connected(tmp_path) as (conn, _):
            stream = await read(True)
            await unpack(one(stream), tmp_path / "followed")
            (src / "out").symlink_to(o / "secret")
            with pytest.raises(TransferError) as caught:
                await collect(one(await read(True)))
            assert caught.value.entry == "out" and SECRET.decode() not in str(caught.value)
            if side == "host":  # the caller names where a link may lead
                stream = await read(True, (str(o),))
                assert SECRET in stream
            (src / "out").unlink()
            (src / "loop").symlink_to(".")
            with pytest.raises(TransferError) as caught:
                await read(True)
            assert caught.value.entry == "loop"
            (src / "loop").unlink()
            (src / "nowhere").symlink_to("missing")
            with pytest.raises(TransferError) as caught:
                await read(True)
            assert caught.value.entry == "nowhere"

    conn: Any = None
    run(go())
    got = tmp_path / "followed"
    assert (
        not (got / "lib" / "alias.txt").is_symlink() and (got / "lib" / "alias.txt").read_text() == "inside"
    )
    assert (got / "libdir").is_dir() and not (got / "libdir").is_symlink()
    assert (got / "libdir" / "real.txt").read_text() == "inside"


# -- hostile archives: refused by name, nothing written outside, the destination as it was ----------


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("there", [False, True], ids=["new", "merged-into"])
def test_hostile_archives_are_refused_by_name(tmp_path: Path, side: str, there: bool) -> None:
    cases = hostile(tmp_path)
    before_outside = snapshot(tmp_path / "outside")
    failures: list[str] = []

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            for name, (data, entry) in cases.items():
                dest = tmp_path / "dests" / name
                if there:
                    (dest / "keep").mkdir(parents=True)
                    (dest / "keep" / "file").write_text("kept")
                    (dest / "a").mkdir()
                before = snapshot(tmp_path / "dests")
                try:
                    await extract(side, conn, one(data), dest)
                except Exception as e:
                    if not refused(e, entry):
                        failures.append(
                            f"{name}: {type(e).__name__}: {e} (entry {getattr(e, 'entry', None)!r})"
                        )
                else:
                    failures.append(f"{name}: not refused")
                if snapshot(tmp_path / "dests") != before:
                    failures.append(f"{name}: the destination changed: {snapshot(tmp_path / 'dests')}")

    run(go())
    assert not failures, "\n".join(failures)
    assert snapshot(tmp_path / "outside") == before_outside
    assert not (tmp_path / "evil").exists() and not (tmp_path / "dests" / "evil").exists()


@pytest.mark.parametrize("side", SIDES)
def test_a_merge_is_docker_cps_and_never_writes_through_a_link(tmp_path: Path, side: str) -> None:
    o = outside(tmp_path)
    dest = tmp_path / "dest"
    (dest / "dir").mkdir(parents=True)
    (dest / "dir" / "old.txt").write_text("old, kept")
    (dest / "file.txt").write_text("old, replaced")
    (dest / "linked.txt").symlink_to(o / "passwd")  # a file over it replaces the link
    (dest / "linkdir").symlink_to(o)  # a directory over it is refused

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            data = tar_of(d("dir"), f("dir/new.txt", b"new"), f("file.txt", b"new"), f("linked.txt", b"new"))
            await extract(side, conn, one(data), dest)
            before = snapshot(dest)
            for conflict, entry in (
                (tar_of(f("aaa-first", b"x"), d("linkdir"), f("linkdir/passwd", b"pwned")), "linkdir"),
                (tar_of(f("aaa-first", b"x"), f("dir", b"a file over a directory")), "dir"),
                (tar_of(f("aaa-first", b"x"), d("file.txt"), f("file.txt/x", b"y")), "file.txt"),
            ):
                with pytest.raises(TransferError) as caught:
                    await extract(side, conn, one(conflict), dest)
                assert caught.value.entry == entry and caught.value.written is None
                assert snapshot(dest) == before  # refused before anything moved

    run(go())
    assert (dest / "dir" / "old.txt").read_text() == "old, kept" and (
        dest / "dir" / "new.txt"
    ).read_text() == "new"
    assert (dest / "file.txt").read_text() == "new"
    assert not (dest / "linked.txt").is_symlink() and (dest / "linked.txt").read_text() == "new"
    assert (o / "passwd").read_text() == "root:x:0:0\n" and not (o / "x").exists()


@pytest.mark.parametrize("side", SIDES)
def test_modes_times_and_an_archive_of_dot(tmp_path: Path, side: str) -> None:
    """``tar -C dir -c .`` makes ``./`` entries: taken. Modes (a directory that is not
    writable included) and times are kept; set-id bits are not, on this host."""
    ro = tarfile.TarInfo("./ro")
    ro.type, ro.mode, ro.mtime = tarfile.DIRTYPE, 0o555, 1_000_000_000
    x = tarfile.TarInfo("./ro/tool")
    x.mode, x.mtime = 0o4755, 1_000_000_000

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            data = tar_of(d("."), (ro, None), (x, b"#!/bin/sh\n"))
            await extract(side, conn, one(data), tmp_path / "dest")

    run(go())
    ro_st, tool_st = (tmp_path / "dest" / "ro").stat(), (tmp_path / "dest" / "ro" / "tool").stat()
    assert stat.S_IMODE(ro_st.st_mode) == 0o555 and ro_st.st_mtime == 1_000_000_000
    assert stat.S_IMODE(tool_st.st_mode) == (0o755 if side == "host" else 0o4755)
    assert tool_st.st_mtime == 1_000_000_000


# -- sizes and kinds ----------------------------------------------------------------------------


def make_deep(root: Path, depth: int, part: str) -> str:
    """A path of ``depth`` directories named ``part``, longer than PATH_MAX, made by descriptor."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(part, dir_fd=fd)
        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    leaf = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(leaf, b"deep")
    os.close(leaf)
    os.close(fd)
    return "/".join([part] * depth + ["leaf.txt"])


def read_deep(root: Path, rel: str) -> bytes:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    parts = rel.split("/")
    for p in parts[:-1]:
        nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        fd = nxt
    leaf = os.open(parts[-1], os.O_RDONLY, dir_fd=fd)
    try:
        return os.read(leaf, 100)
    finally:
        os.close(leaf)
        os.close(fd)


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_very_long_names_and_many_small_files(tmp_path: Path, direction: str) -> None:
    """(10,000 files: tests/vm/test_files.py, in a box; this host's disk makes files slowly.)"""
    src = tmp_path / "src"
    rel = make_deep(src / "deep", 30, "d" * 200)  # 6 KB: more than PATH_MAX
    (src / "wide").mkdir()
    for i in range(100):
        (src / "wide" / f"{i:03}").mkdir()
        for j in range(20):
            (src / "wide" / f"{i:03}" / f"f{j}").write_bytes(b"%d.%d" % (i, j))
    dest = tmp_path / "dest"

    async def go() -> Any:
        async with connected(tmp_path) as (conn, _):
            if direction == "upload":
                async with host_tree(src) as (chunks, _report):
                    return await parchive.write_tree(conn, str(dest), chunks)
            return await unpack(parchive.read_tree(conn, str(src)), dest)

    report = run(go())
    assert report.bytes == sum(len(b"%d.%d" % (i, j)) for i in range(100) for j in range(20)) + 4
    assert read_deep(dest / "deep", rel) == b"deep"
    assert sum(len(files) for _, _, files in os.walk(dest / "wide")) == 2_000
    assert (dest / "wide" / "042" / "f7").read_bytes() == b"42.7"


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_fifo_is_kept_and_never_opened(tmp_path: Path, direction: str) -> None:
    """A writer waits in open() on the fifo: had the copy opened it, it would be let through."""
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe", 0o640)
    (src / "after.txt").write_text("after")
    waiting = threading.Thread(target=lambda: os.close(os.open(src / "pipe", os.O_WRONLY)), daemon=True)
    waiting.start()
    dest = tmp_path / "dest"

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            if direction == "upload":
                async with host_tree(src) as (chunks, _report):
                    await parchive.write_tree(conn, str(dest), chunks)
            else:
                await unpack(parchive.read_tree(conn, str(src)), dest)

    try:
        run(go())
        time.sleep(0.2)
        assert waiting.is_alive(), "the fifo was opened"
        assert stat.S_ISFIFO((dest / "pipe").lstat().st_mode) and (dest / "after.txt").read_text() == "after"
        assert stat.S_IMODE((dest / "pipe").lstat().st_mode) == 0o640
    finally:
        os.close(os.open(src / "pipe", os.O_RDONLY | os.O_NONBLOCK))
        waiting.join(5)


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_sockets_are_left_out_and_said(tmp_path: Path, direction: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(src / "sock"))

    async def go() -> tuple[Any, ...]:
        async with connected(tmp_path) as (conn, _):
            if direction == "upload":
                async with host_tree(src) as (chunks, sent):
                    await parchive.write_tree(conn, str(tmp_path / "dest"), chunks)
                return tuple(sent.skipped)
            got = await unpack(parchive.read_tree(conn, str(src)), tmp_path / "dest")
            return tuple(got.skipped)

    try:
        skipped = run(go())
    finally:
        listener.close()
    assert [e for e, _why in skipped] == ["sock"] and "socket" in skipped[0][1]
    assert (tmp_path / "dest" / "a.txt").read_text() == "a" and not (tmp_path / "dest" / "sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="device nodes are made by root")
@pytest.mark.parametrize("side", SIDES)
def test_device_nodes_are_made_where_allowed(tmp_path: Path, side: str) -> None:
    dev = tarfile.TarInfo("null")
    dev.type, dev.devmajor, dev.devminor, dev.mode = tarfile.CHRTYPE, 1, 3, 0o666

    async def go() -> Any:
        async with connected(tmp_path) as (conn, _):
            return await extract(side, conn, one(tar_of((dev, None))), tmp_path / "dest")

    report = run(go())
    st = (tmp_path / "dest" / "null").lstat()
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and not report.skipped


def test_device_nodes_are_skipped_with_a_warning_where_they_cannot_be_made(
    tmp_path: Path, monkeypatch
) -> None:
    def no_mknod(*args: Any, **kw: Any) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(tarstream.os, "mknod", no_mknod)
    dev = tarfile.TarInfo("null")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    report = run(unpack(one(tar_of((dev, None), f("b.txt"))), tmp_path / "dest"))
    assert [e for e, _ in report.skipped] == ["null"] and (tmp_path / "dest" / "b.txt").exists()


# -- a tree that changes as it is read --------------------------------------------------------------


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_file_that_shrinks_as_it_is_read_fails_by_name_and_leaves_nothing(
    tmp_path: Path, direction: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    big = src / "zz-big.bin"
    with open(big, "wb") as fh:
        fh.truncate(1 << 30)  # sparse: read for long enough to be cut short
    dest = tmp_path / "dest"

    async def cut(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        first = True
        async for chunk in chunks:
            yield chunk
            if first:
                os.truncate(big, 1000)
                first = False

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            if direction == "upload":
                async with host_tree(src) as (chunks, _report):
                    await parchive.write_tree(conn, str(dest), cut(chunks))
            else:
                await unpack(cut(parchive.read_tree(conn, str(src))), dest)

    with pytest.raises(TransferError) as caught:
        run(go())
    assert caught.value.entry == "zz-big.bin" and "changed" in str(caught.value)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if "sandlot-incoming" in p.name] == []


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_tree_that_changes_as_it_is_read_never_reads_or_writes_outside(
    tmp_path: Path, direction: str
) -> None:
    """A directory swapped for a link to outside and back, files made and removed, while
    copies run: each copy is whole or fails by name, and the secret outside is never in one."""
    o = outside(tmp_path)
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("inside")
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            with_link = src / "d.link"
            with_link.symlink_to(o)
            os.rename(src / "d", src / "d.dir")
            os.rename(with_link, src / "d")  # d is now a link to outside
            os.rename(src / "d", with_link)
            os.rename(src / "d.dir", src / "d")  # and a directory again
            with_link.unlink()
            (src / f"n{i % 50}").write_text("n")
            if i % 7 == 0:
                for p in src.glob("n*"):
                    p.unlink(missing_ok=True)

    async def go() -> list[str]:
        outcomes = []
        async with connected(tmp_path) as (conn, _):
            for k in range(30):
                dest = tmp_path / "dests" / str(k)
                try:
                    if direction == "upload":
                        async with host_tree(src) as (chunks, _report):
                            await parchive.write_tree(conn, str(dest), chunks)
                    else:
                        await unpack(parchive.read_tree(conn, str(src)), dest)
                    outcomes.append("whole")
                except TransferError as e:
                    outcomes.append(f"refused {e.entry}")
                    assert not dest.exists()
        return outcomes

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        outcomes = run(go())
    finally:
        stop.set()
        t.join(10)
    assert "whole" in outcomes
    for dest in (tmp_path / "dests").iterdir():
        got = snapshot(dest)
        assert all(SECRET not in v[1] for v in got.values() if v[0] == "file")
        for rel, v in got.items():  # d is what it was when read: the directory, or a link kept a link
            if rel == "d":
                assert v == ("link", str(o)) or v[0] == "dir"
    assert snapshot(o) == {"secret": ("file", SECRET, 0o644), "passwd": ("file", b"root:x:0:0\n", 0o644)}


# -- the box's agent: what only it can be asked --------------------------------------------------------


def test_a_missing_tree_is_file_not_found_and_a_file_is_not_a_tree(tmp_path: Path) -> None:
    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            with pytest.raises(GuestFileNotFoundError):
                await collect(parchive.read_tree(conn, str(tmp_path / "missing")))
            (tmp_path / "file").write_text("x")
            with pytest.raises(NotADirectoryError):
                await collect(parchive.read_tree(conn, str(tmp_path / "file")))
            with pytest.raises(NotADirectoryError):
                await parchive.write_tree(conn, str(tmp_path / "file"), one(tar_of(f("a"))))
            assert (tmp_path / "file").read_text() == "x"

    run(go())


def test_an_abandoned_upload_leaves_nothing_behind(tmp_path: Path) -> None:
    """The host's stream fails part way (its source refused an entry): the agent clears
    what it unpacked before the error reaches the caller."""

    class Refused(Exception):
        pass

    async def failing() -> AsyncIterator[bytes]:
        yield tar_of(f("a.txt", b"a" * 5000), end=False)
        raise Refused

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            with pytest.raises(Refused):
                await parchive.write_tree(conn, str(tmp_path / "dest"), failing())

    run(go())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("agent-")) == []


def test_an_agent_older_than_archives_is_unsupported_and_says_what_to_do(monkeypatch) -> None:
    async def old_agent(*args: Any, **kw: Any) -> Any:
        raise guest_os_error(errno.ENOSYS, "unknown frame type 0x15")

    monkeypatch.setattr(parchive.RemoteProcess, "start", old_agent)
    with pytest.raises(Unsupported, match="restart the box"):
        run(collect(parchive.read_tree(None, "/src")))  # type: ignore[arg-type]
    with pytest.raises(Unsupported, match="restart the box"):
        run(parchive.write_tree(None, "/dst", one(b"")))  # type: ignore[arg-type]


def test_a_transfer_error_is_the_same_on_every_side_of_a_server() -> None:
    e = TransferError.at("a/b", "refused", side="box", errno=errno.ELOOP, written=["x", "y"])
    again = from_dict({**e.to_dict(), "type": "TransferError"})
    assert isinstance(again, TransferError) and str(again) == str(e)
    assert (again.entry, again.side, again.errno, again.written) == ("a/b", "box", errno.ELOOP, ["x", "y"])
    assert e.status == 422 and e.to_dict()["errno"] == "ELOOP"


def test_the_agents_side_under_asan_and_ubsan(tmp_path: Path) -> None:
    """The agent's ARCHIVE built with ASan and UBSan (fatal): every hostile archive, and a
    tree of every kind read back, an empty directory among them."""
    src = tree_with_links(tmp_path)
    (src / "empty").mkdir()
    cases = hostile(tmp_path)

    async def go() -> None:
        async with connected(tmp_path, kind="sanitize") as (conn, agent):
            for name, (data, entry) in cases.items():
                with pytest.raises(TransferError) as caught:
                    await parchive.write_tree(conn, str(tmp_path / "dests" / name), one(data))
                assert caught.value.entry == entry, (name, caught.value, agent.stderr())
            async with host_tree(src) as (chunks, _report):
                await parchive.write_tree(conn, str(tmp_path / "up"), chunks)
            await unpack(parchive.read_tree(conn, str(tmp_path / "up")), tmp_path / "back")

    run(go())
    assert snapshot(tmp_path / "back") == snapshot(src)
