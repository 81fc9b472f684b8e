"""Saved state in the home's storage tier (``core.tier``, docs/storage.md): pushing the
chunks and manifests of saved states, keeping only the manifest of cold ones here, and
moving a suspended box to another home that shares the tier.

A box moves as what another home needs to resume it, nothing of this home's paths:
its row, its suspended state (a manifest of chunks), and its disk, every file of its
qcow2 chain (its layers and the image's base) as a manifest of chunks too, so that a
base many boxes share is in the tier once; a gVisor box's layer directories and image
root go the same way, each as a tar file (``treefile``). The home that pulls it takes the box's
lease first (a conditional write): of two homes pulling one box, one gets it, and a box
held by a home that did not let it go is refused, naming that home.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import atomic_write, flock_wait
from ..crashpoints import crash_point
from ..engine.base import BootRequest
from ..errors import (
    BoxNotFound,
    CorruptSnapshot,
    InvalidArgument,
    InvalidState,
    SandlotError,
    TierError,
    no_space,
)
from . import boxdoc, layers, packs, snapshots, tiergc, treefile
from .chunks import LOCK_WAIT, TIER_RUN, ChunkStore, add_counters, digest, remove_file
from .manifest import CHUNK, Image, Manifest
from .packs import PackWriter, Place, decode_places, encode_places
from .runtime import Runtime
from .state import BoxState
from .store import BoxRecord, BoxStore, SnapshotRecord
from .tier import Tier, home_id

FILE_RE = re.compile(r"(layers|bases)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


@dataclass(frozen=True, slots=True)
class PushReport:
    chunks: int = 0  # chunks the tier did not hold, sent now
    bytes: int = 0
    states: int = 0  # manifests sent
    files: int = 0  # disk files sent (a box's)
    seconds: float = 0.0


class Remote:
    """One home's use of its storage tier."""

    def __init__(self, rt: Runtime, tier: Tier) -> None:
        self.rt = rt
        self.tier = tier
        self.chunks = ChunkStore(rt.home, rt.store)
        self.me = home_id(rt.home)
        self.lock: tiergc.Lock | None = None  # this home's push lock, while it changes the tier

    @classmethod
    def of(cls, rt: Runtime) -> Remote:
        remote = ChunkStore(rt.home).tier()
        if remote is None:
            raise InvalidState(
                "this home has no storage tier: sandlot.storage.configure('s3://bucket/prefix') "
                "or SANDLOT_STORAGE"
            )
        return cls(rt, remote)

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tally()

    def tally(self) -> None:
        """Add what went to and came from the tier to the home's totals (the metrics')."""
        with contextlib.suppress(SandlotError):  # a figure, never a reason to fail what moved
            add_counters(self.rt.store, self.tier.traffic())

    # -- what the tier holds, as this home tells it ---------------------------------------------

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold a push lock of the tier (no collection runs meanwhile: ``core.tiergc``), having
        forgotten what collections since this home's last look deleted; then say what this
        home holds in the tier. Reentrant."""
        if self.lock is not None:
            yield
            return
        with tiergc.pushing(self.tier, self.me) as lock:
            self.lock = lock
            try:
                tiergc.catch_up(self.tier, self.chunks.root, self.forget)
                yield
                self.declare()
            finally:
                self.lock = None

    def touch(self) -> None:
        if self.lock is not None:
            self.lock.touch()

    def declare(self) -> None:
        """This home's declaration: the states it holds that are in the tier, its boxes."""
        store = self.rt.store
        tiergc.declare(self.tier, self.me, pushed_states(store), (r.id for r in store.list()))

    def forget(self, what: tiergc.Forget) -> None:
        """Forget that the tier holds what a collection deleted from it, and learn where the
        live chunks of the packs it wrote again went (``moved/``; one gone: forget all)."""
        moves = []
        try:  # (a record or a move unreadable: all of it, as for one missing)
            for pack in sorted(what.moved if not what.everything else ()):
                went = packs.moved(self.tier, bytes.fromhex(pack))
                if went is None:
                    raise ValueError(f"moved/{pack} is gone")
                moves.append(went)
        except (ValueError, CorruptSnapshot):
            what = tiergc.Forget(everything=True)
        forget_remote(self.rt.store, chunks=what.chunks, states=what.states, everything=what.everything)
        for places in moves if not what.everything else ():
            packs.add_places(self.rt.store, places)
        sent = _sent_files(self.chunks.root)
        names = sent.get("names", {})
        gone = [rel for rel, name in names.items() if what.everything or name in what.files]
        if gone:
            for rel in gone:
                names.pop(rel, None)
                sent.pop(rel, None)
            atomic_write(self.chunks.root / "files.json", json.dumps(sent).encode())

    def collect(self, wait: float = tiergc.WAIT) -> tiergc.TierGcReport:
        """Delete from the tier what no home and no box needs (``core.tiergc``)."""
        return tiergc.collect(self.tier, self.me, self.declare, wait=wait)

    # -- chunks and states -------------------------------------------------------------------

    def push(self, states: Iterable[str] | None = None) -> PushReport:
        """Send the tier every chunk and manifest it lacks: of ``states`` (snapshot ids),
        or of every state of the home. New chunks go in packs (``core.packs``), each
        state's in the order its manifest lists them; a chunk is marked as the tier's only
        once the pack that holds it is there, so a push cut short sends the rest next
        time. Each state's places go before its manifest: a state the tier lists, a home
        can read."""
        with self.changing():
            return self._push(states)

    def _push(self, states: Iterable[str] | None) -> PushReport:
        t0 = time.monotonic()
        store = self.rt.store
        wanted = list(states) if states is not None else unpushed_states(store)
        with self.chunks.using():
            todo: list[list[bytes]] = []  # each state's new chunks: a state's own packs hold them
            manifests: dict[str, bytes] = {}
            listings: dict[str, list[bytes]] = {}  # each state's chunks, in its manifest's order
            for snap_id in wanted:
                data = store.state_manifest(snap_id)
                if data is None:
                    raise InvalidArgument(
                        f"saved state {snap_id} is not kept as chunks: it cannot go to the tier"
                    )
                manifests[snap_id] = data
                listed = listings[snap_id] = _in_order(Manifest.decode(data, snap_id))
                known = remote_chunks(store, listed)
                if any(d not in known and not self.chunks.path(d).exists() for d in listed):
                    # only in the tier, and this home forgot where (a collection it could
                    # not follow): the state's places, sent with it before, say so again
                    self._learn_places("states", snap_id)
                    known = remote_chunks(store, listed)
                todo.append([d for d in listed if d not in known])
            if states is None:
                todo.append(unpushed_chunks(store))
            # each state's chunks in packs of their own, so that a state removed leaves
            # whole packs to delete, not bits of packs other states still need
            with PackWriter(self.tier, self._sent) as writer:
                for chunks in todo:
                    for d in chunks:
                        if d not in writer.seen and (packed := self._kept(d)) is not None:
                            writer.add(d, packed)
                    writer.flush()
            for snap_id, data in manifests.items():
                places = encode_places(packs.tier_places(store, listings[snap_id]))
                self.tier.put(self.tier.key("places", "states", snap_id), places)
                self.tier.put(self.tier.key("states", snap_id), data)
                mark_pushed(store, state=snap_id)
        return PushReport(writer.chunks, writer.bytes, len(manifests), 0, round(time.monotonic() - t0, 3))

    def _sent(self, places: dict[bytes, Place]) -> None:
        """A pack is in the tier: its chunks are the tier's now."""
        packs.add_places(self.rt.store, places)
        crash_point("remote.mid-push")
        self.touch()

    def _kept(self, d: bytes) -> bytes | None:
        """A chunk as this home keeps it, to send (None: the tier has it as an object of its
        own, as older homes sent chunks, and this home let it go since)."""
        try:
            return self.chunks.path(d).read_bytes()
        except FileNotFoundError:
            if self.tier.exists(self.tier.key("chunks", d.hex())):
                return None
            raise CorruptSnapshot(f"chunk {d.hex()} is in neither this home nor its storage tier") from None

    def evict(self, older_than: float, now: float | None = None) -> tuple[int, int]:
        """Keep only the manifest here of cold states: of boxes suspended ``older_than``
        seconds ago or more, and of snapshots that old (templates stay: boxes start from
        them), as of ``now`` (a time: the default, the present). Their chunks are pushed
        first; a chunk a warm state lists stays. Returns the chunks and bytes this home
        no longer holds."""
        with self.changing():
            return self._evict(older_than, time.time() if now is None else now)

    def _cooling(self) -> Iterator[tuple[str, float | None]]:
        """Each state of chunks, and since when it has been unused (None: it never cools:
        a template, which boxes start from, or the state of a box running)."""
        store = self.rt.store
        suspended = {b.suspended: b for b in store.list() if b.suspended}
        manifests = store.state_ids()
        for s in store.snapshots():
            if s.id not in manifests:
                continue
            box = suspended.get(s.id)
            if s.kind == "template" or (s.kind != "snapshot" and box is None):
                yield s.id, None
            else:
                yield s.id, (box.stopped_at or s.created_at) if box is not None else s.created_at

    def next_cold(self, older_than: float, after: float) -> float | None:
        """When the next state turns cold after ``after`` (the ``now`` an eviction last
        went by: one that turned cold since, while it ran, is due at once); None: none
        will, as things are now."""
        due = [since + older_than for _, since in self._cooling() if since is not None]
        later = [t for t in due if t > after]
        return min(later) if later else None

    def _evict(self, older_than: float, now: float) -> tuple[int, int]:
        rt, store = self.rt, self.rt.store
        manifests = store.state_manifests()
        cold, warm = [], set()
        for snap_id, since in self._cooling():
            if since is not None and now - since >= older_than:
                cold.append(snap_id)
            else:
                warm |= Manifest.decode(manifests[snap_id], snap_id).digests()
        if not cold:
            return 0, 0
        self.push(cold)
        goes = set().union(*(Manifest.decode(manifests[c], c).digests() for c in cold)) - warm
        goes &= remote_chunks(store, goes)
        count = freed = 0
        with self.chunks.collecting():  # nobody reads or counts on a chunk file as it goes
            for d in goes:
                freed_now = remove_file(self.chunks.path(d))
                count, freed = count + (freed_now > 0), freed + freed_now
        for c in cold:  # and the form forks map (all a state of chunks keeps in its directory:
            # what its engine made of them), made again from the chunks when asked for
            directory = snapshots.snapshot_dir(rt.home, c)
            with contextlib.suppress(FileNotFoundError):
                for made in directory.iterdir():
                    if not made.name.startswith(".") and made.is_file():
                        with contextlib.suppress(FileNotFoundError):
                            freed += made.stat().st_size
                            made.unlink()
        return count, freed

    # -- a box moving between homes ----------------------------------------------------------

    def push_box(self, key: str, *, release: bool = False) -> PushReport:
        """Send a suspended box to the tier, whole: its state, its disk's files, its row.
        This home keeps it (and its lease) unless ``release``: then the box leaves this
        home for whichever home pulls it next."""
        t0 = time.monotonic()
        rt = self.rt
        box_id = rt.store.get(key).id
        # one push of a box at a time in this home (the pusher's and a caller's): a push that
        # lets the box go is never followed by another that takes it again
        self.chunks.root.mkdir(parents=True, exist_ok=True)
        fd = flock_wait(self.chunks.root / f".box-{box_id}.lock", LOCK_WAIT, f"the push of box {key}")
        try:
            with self.changing():
                return self._push_box(rt.store.get(box_id), release, t0)
        finally:
            os.close(fd)

    def _push_box(self, rec: BoxRecord, release: bool, t0: float) -> PushReport:
        rt = self.rt
        if rec.state != BoxState.SUSPENDED or not rec.suspended:
            why = f"box {rec.name} is {rec.state}: a box moves through the tier suspended; suspend() it first"
            raise InvalidState(why, box=rec.name, state=rec.state, allowed=["suspended"])
        if rec.drives or rec.options.get("volumes"):
            raise InvalidArgument(f"box {rec.name} mounts volumes or host directories: it cannot move "
                                  "through the tier (its volumes stay on this host)")  # fmt: skip
        snap = rt.store.find_snapshot(rec.suspended)
        if snap is None:
            raise CorruptSnapshot(f"box {rec.name}: its suspended state {rec.suspended} is missing")
        # (asked of the state, not of an engine: a detached pusher knows only the built-in ones)
        if rt.store.state_manifest(snap.id) is None:
            raise InvalidArgument(f"box {rec.name} was suspended before saved states were chunks: resume it "
                                  "and suspend it again to move it")  # fmt: skip
        self.tier.take(rec.id, self.me)
        report = self.push([snap.id])
        disk = Path(rec.disk or "")
        if disk.suffix == layers.DIR_SUFFIX:  # each layer's upper/, then the image root, as trees
            files = [self._push_tree(rt.home, layer, layer / "upper") for layer in _chain(rt.home, disk)]
            base = _within(rt.home, layers.dir_base(disk))
            files.append({**self._push_tree(rt.home, base, base, cached=True), "base": True})
        else:
            files = [self._push_file(rt.home, path) for path in _chain(rt.home, disk)]
        doc = {
            "format": boxdoc.FORMAT, "home": self.me, "pushed_at": time.time(),
            "box": {k: v for k, v in rec.to_json().items() if k in boxdoc.PORTABLE},
            "snapshot": {k: v for k, v in snap.to_json().items() if k != "layer"},
            "disk": files,
        }  # fmt: skip
        self.tier.put(self.tier.key("boxes", f"{rec.id}.json"), json.dumps(doc).encode())
        if release:
            self.tier.release(rec.id, self.me)
            rt.discard_box(rec)
        return replace(report, files=len(files), seconds=round(time.monotonic() - t0, 3))

    def box_pushed(self, rec: BoxRecord) -> bool:
        """Whether the tier holds this suspended box as it is now (its state, pushed by
        this home), so that another home could take it were this one gone."""
        found = self.tier.get(self.tier.key("boxes", f"{rec.id}.json"))
        if found is None:
            return False
        with contextlib.suppress(CorruptSnapshot):
            doc = boxdoc.read(found[0], rec.id)
            return bool(doc["snapshot"]["id"] == rec.suspended and doc["home"] == self.me)
        return False

    def _push_file(self, home: Path, path: Path) -> dict[str, Any]:
        """One file of a disk's chain, as a manifest of its chunks in the tier. A file sent
        before and unchanged since (a base, a frozen layer: none is ever written again)
        is not read again: ``chunks/files.json`` remembers what each was sent as."""
        rel = path.relative_to(home).as_posix()
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, self.tier.config.url]
        name = self._sent_as(rel, stamp)
        if name is None:
            name = self._send_file(path)
            self._remember_sent(rel, stamp, name)
        return {"path": rel, "file": name}

    def _push_tree(self, home: Path, where: Path, tree: Path, *, cached: bool = False) -> dict[str, Any]:
        """A directory of a gVisor box's disk (a layer's ``upper/``, or the image root: its
        path in the home is ``where``) as a tar file's manifest of chunks (``treefile``).
        ``cached``: the tree never changes (an image root), so once sent it is not read
        again."""
        rel = where.relative_to(home).as_posix()
        stamp = ["tree", self.tier.config.url]
        name = self._sent_as(rel, stamp) if cached else None
        if name is None:
            packed = self.chunks.root / f".tree-{os.urandom(4).hex()}.tar"
            try:
                treefile.pack(tree, packed)
                name = self._send_file(packed)
            finally:
                packed.unlink(missing_ok=True)
            if cached:
                self._remember_sent(rel, stamp, name)
        return {"path": rel, "file": name, "tree": True}

    def _sent_as(self, rel: str, stamp: list[Any]) -> str | None:
        sent = _sent_files(self.chunks.root)
        name = sent.get("names", {}).get(rel)
        return str(name) if sent.get(rel) == stamp and name else None

    def _remember_sent(self, rel: str, stamp: list[Any], name: str) -> None:
        sent = _sent_files(self.chunks.root)
        sent[rel] = stamp
        sent.setdefault("names", {})[rel] = name
        atomic_write(self.chunks.root / "files.json", json.dumps(sent).encode())

    def _send_file(self, path: Path) -> str:
        """A file into the tier as a manifest of its chunks (those the tier lacks sent);
        the manifest's name."""
        m = Manifest(engine="file")
        image = Image("file", path.stat().st_size, [])
        with open(path, "rb") as f:
            while data := f.read(CHUNK):
                image.digests.append(None if data.count(0) == len(data) else digest(data))
                if image.digests[-1] is not None:
                    m.logical += len(data)
        m.images.append(image)
        encoded = m.encode()
        name = digest(encoded).hex()
        if not self.tier.exists(self.tier.key("files", name)):
            wanted = [(i, d) for i, d in enumerate(image.digests) if d is not None]
            known = remote_chunks(self.rt.store, {d for _, d in wanted})
            import zstandard

            compress = zstandard.ZstdCompressor(level=3, write_content_size=True).compress
            with PackWriter(self.tier, self._sent) as writer, open(path, "rb") as f:
                for i, d in wanted:
                    if d not in known and d not in writer.seen:
                        self.touch()  # a large disk's file takes a while: the lock must not look dead
                        writer.add(d, compress(os.pread(f.fileno(), CHUNK, i * CHUNK)))
            places = packs.tier_places(self.rt.store, [d for _, d in wanted])
            self.tier.put(self.tier.key("places", "files", name), encode_places(places))
            self.tier.put(self.tier.key("files", name), encoded)
        return name

    def pull_box(self, key: str, *, force: bool = False) -> BoxRecord:
        """Take a box that went through the tier into this home, suspended, with its id,
        name, processes and files (``resume`` it then). Refused (``BoxElsewhere``) while
        another home holds it, unless ``force``: that home is known to be gone. (Under a
        push lock: a collection that found the box taken, and not yet declared by the home
        that took it, would take it for one removed there.)"""
        with self.changing():
            return self._pull_box(key, force)

    def _pull_box(self, key: str, force: bool) -> BoxRecord:
        rt = self.rt
        doc = self._find_box(key)
        box, snap_doc = doc["box"], doc["snapshot"]
        mine = rt.store.find(box["id"])
        if mine is not None:
            if self.tier.holder(box["id"]) == self.me:
                return mine  # it never left
            raise InvalidArgument(f"this home has a box {mine.name} with id {box['id']} already")
        if rt.store.find(box["name"]) is not None:
            raise InvalidArgument(f"this home has a box named {box['name']!r}: remove or rename it first")
        engine = rt.engine(box.get("engine", "qemu"))
        facts = (snap_doc.get("options") or {}).get("vm") or {}
        boot = engine.prepare(BootRequest())
        engine.check_compatible(facts, boot)
        self.tier.take(box["id"], self.me, force=force)
        made: list[Path] = []
        try:
            found = self.tier.get(self.tier.key("states", snap_doc["id"]))
            if found is None:
                raise CorruptSnapshot(
                    f"box {box['name']}: its state {snap_doc['id']} is not in the storage tier"
                )
            manifest = found[0]
            Manifest.decode(manifest, snap_doc["id"])  # checked before anything is written
            self._learn_places("states", snap_doc["id"])
            paths = [(self._pull_tree if f.get("tree") else self._pull_file)(rt.home, f, made)
                     for f in doc["disk"]]  # fmt: skip
            if paths[0].suffix == layers.DIR_SUFFIX:
                _relink(paths)
            else:
                _rebase(paths)
            crash_point("remote.mid-pull")
            options = {**snap_doc["options"], "vm": engine.facts_for_import(facts, boot)}
            snap = SnapshotRecord(**{**snap_doc, "layer": str(paths[0]), "options": options})
            rec = BoxRecord(**{**box, "disk": str(paths[0]), "state": str(BoxState.SUSPENDED),
                               "suspended": snap.id, "updated_at": time.time()})  # fmt: skip
            rt.store.adopt(rec, snap, manifest)
        except BaseException:
            for p in made:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
            with contextlib.suppress(TierError):
                self.tier.release(box["id"], self.me)
            raise
        return rec

    def _learn_places(self, kind: str, name: str) -> None:
        """Where the tier keeps the chunks of a state or file it holds (none said: each
        chunk is an object of its own, as older homes sent them)."""
        found = self.tier.get(self.tier.key("places", kind, name))
        if found is not None:
            packs.add_places(self.rt.store, decode_places(found[0], f"{kind[:-1]} {name}"))

    def _find_box(self, key: str) -> dict[str, Any]:
        if re.fullmatch(r"[0-9a-f]{12}", key):
            found = self.tier.get(self.tier.key("boxes", f"{key}.json"))
            if found is not None:
                return boxdoc.read(found[0], key)
        for name in self.tier.names("boxes"):
            found = self.tier.get(self.tier.key("boxes", name))
            if found is not None:
                doc = boxdoc.read(found[0], name)
                if doc["box"]["name"] == key:
                    return doc
        raise BoxNotFound(f"no box {key!r} in the storage tier {self.tier.config.url}")

    def boxes(self) -> list[dict[str, Any]]:
        """The boxes in the tier: name, id, labels, who holds each, and when it was pushed."""
        out = []
        for name in self.tier.names("boxes"):
            found = self.tier.get(self.tier.key("boxes", name))
            if found is not None:
                out.append(self._listed(boxdoc.read(found[0], name)))
        return out

    def box(self, box_id: str) -> dict[str, Any] | None:
        """One box of the tier by its id, as ``boxes`` lists it (None: the tier has none):
        one read, not a listing of every box."""
        if not re.fullmatch(r"[0-9a-f]{12}", box_id):
            return None
        found = self.tier.get(self.tier.key("boxes", f"{box_id}.json"))
        return None if found is None else self._listed(boxdoc.read(found[0], box_id))

    def _listed(self, doc: dict[str, Any]) -> dict[str, Any]:
        box_id = doc["box"]["id"]
        return {"id": box_id, "name": doc["box"]["name"], "labels": doc["box"].get("labels") or {},
                "pushed_at": doc["pushed_at"], "pushed_by": doc["home"],
                "holder": self.tier.holder(box_id)}  # fmt: skip

    def _pull_file(self, home: Path, entry: dict[str, Any], made: list[Path]) -> Path:
        """A file of a disk's chain from its manifest, whole or not at all; one this home
        has already (a base another box brought) is used as it is."""
        rel, dest = _disk_path(home, entry)
        image = self._file_manifest(rel, entry)
        if dest.exists() and dest.stat().st_size == image.size:
            return dest
        tmp = dest.with_name(f".{dest.name}.pull-{os.urandom(4).hex()}")
        made.append(tmp)
        self._fetch_file(rel, entry, image, tmp)
        os.rename(tmp, dest)
        made[made.index(tmp)] = dest
        return dest

    def _pull_tree(self, home: Path, entry: dict[str, Any], made: list[Path]) -> Path:
        """A directory of a gVisor box's disk from its tar file (``treefile``): a layer
        directory (the tree its ``upper/``; ``base`` and ``parent`` written once all are
        here, ``_relink``), or an image root (``base``), which one this home has already
        is used as it is. Whole or not at all."""
        rel, dest = _disk_path(home, entry)
        if dest.is_dir():  # a frozen layer, or an image root, another box brought
            return dest
        image = self._file_manifest(rel, entry)
        work = dest.with_name(f".{dest.name}.pull-{os.urandom(4).hex()}")
        made.append(work)
        work.mkdir(parents=True)
        packed = work / "tree.tar"
        self._fetch_file(rel, entry, image, packed)
        tree = work / "tree"
        tree.mkdir()
        treefile.unpack(packed, tree)
        packed.unlink()
        if entry.get("base"):
            try:
                os.rename(tree, dest)
            except OSError:
                if not dest.is_dir():
                    raise
                made.remove(work)  # a racing pull's copy of the same root is as good
                shutil.rmtree(work)
                return dest
            shutil.rmtree(work)
        else:
            tree.rename(work / "upper")
            (work / "work").mkdir()
            os.rename(work, dest)
        made[made.index(work)] = dest
        return dest

    def _file_manifest(self, rel: str, entry: dict[str, Any]) -> Image:
        found = self.tier.get(self.tier.key("files", str(entry["file"])))
        if found is None:
            raise CorruptSnapshot(f"the disk file {rel} is not in the storage tier")
        if digest(found[0]).hex() != entry["file"]:
            raise CorruptSnapshot(f"the manifest of disk file {rel} in the storage tier is damaged")
        return Manifest.decode(found[0], rel).image("file")

    def _fetch_file(self, rel: str, entry: dict[str, Any], image: Image, tmp: Path) -> None:
        """A disk file's chunks from the tier into ``tmp``, synced."""
        self._learn_places("files", str(entry["file"]))
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.truncate(image.size)
                wanted = [(i, d) for i, d in enumerate(image.digests) if d is not None]

                def fetch(run: list[tuple[int, bytes]]) -> None:
                    self.touch()
                    got = self.chunks.get_many([(d, image.chunk_size(i)) for i, d in run], rel, keep=False)
                    for (i, _), data in zip(run, got, strict=True):
                        os.pwrite(f.fileno(), data, i * CHUNK)

                runs = [wanted[k : k + TIER_RUN] for k in range(0, len(wanted), TIER_RUN)]
                self.tier.each(fetch, runs)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(
                    tmp.parent, f"the disk file {rel} could not be pulled from the storage tier"
                ) from None
            raise


def _sent_files(root: Path) -> dict[str, Any]:
    """What each disk file was last sent to the tier as (a cache: lost, files are read again)."""
    try:
        found = json.loads((root / "files.json").read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _chain(home: Path, top: Path) -> list[Path]:
    """A box's disk, top first, each file inside the home (else it cannot move)."""
    return [_within(home, f) for f in layers.chain(top)]


def _within(home: Path, f: Path) -> Path:
    """``f``, a file or directory of a disk in this home's layers/ or bases/."""
    rel = f.resolve().relative_to(home.resolve()) if f.resolve().is_relative_to(home.resolve()) else None
    if rel is None or not FILE_RE.fullmatch(rel.as_posix()):
        raise InvalidArgument(f"the disk file {f} is not in this home's layers/ or bases/: it cannot move")
    return f


def _disk_path(home: Path, entry: dict[str, Any]) -> tuple[str, Path]:
    """Where a disk file a box in the tier names goes in this home (refused outside
    layers/ and bases/)."""
    rel = str(entry.get("path", ""))
    if not FILE_RE.fullmatch(rel):
        raise CorruptSnapshot(
            f"a box in the storage tier names a disk file {rel!r} outside layers/ and bases/"
        )
    return rel, home / rel


def _relink(paths: list[Path]) -> None:
    """Point each layer directory pulled at the one below it and at the image root (the
    last of ``paths``), in this home."""
    *tops, base = paths
    for upper, lower in itertools.zip_longest(tops, tops[1:]):
        atomic_write(upper / "base", str(base).encode())
        if lower is None:
            (upper / "parent").unlink(missing_ok=True)
        else:
            atomic_write(upper / "parent", str(lower).encode())


def _rebase(paths: list[Path]) -> None:
    """Point each qcow2 layer at the file below it in this home (their headers name the
    paths of the home that pushed them)."""
    from ..images.rootfs import qcow2_backing_file

    qemu_img = shutil.which("qemu-img")
    if qemu_img is None:
        raise InvalidState("qemu-img not found: install qemu-utils")
    for upper, lower in itertools.pairwise(paths):
        if qcow2_backing_file(upper) == str(lower):
            continue
        fmt = "qcow2" if lower.suffix == ".qcow2" else "raw"
        proc = subprocess.run([qemu_img, "rebase", "-u", "-F", fmt, "-b", str(lower), str(upper)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        if proc.returncode != 0:
            raise CorruptSnapshot(
                f"the disk file {upper.name} could not be pointed at {lower.name}: {proc.stderr}"
            )


def _in_order(m: Manifest) -> list[bytes]:
    """The chunks a manifest lists, each once, in its order (a memory image's by address)."""
    images = (d for image in m.images for d in image.digests if d is not None)
    return list(dict.fromkeys(itertools.chain(images, (d for s in m.streams for d in s.digests))))


# -- what this home knows the tier holds (the ``chunks`` and ``states`` tables' ``remote`` and
# ``pushed`` columns, ``tier_chunks``): functions that take the store first, as ``BoxStore``'s
# methods do, so that ``AsyncStore.call`` runs them


def unpushed_chunks(store: BoxStore, limit: int = 10_000) -> list[bytes]:
    """Chunks some state lists that the storage tier does not hold yet."""
    with store.reading() as db:
        rows = db.execute(
            "SELECT digest FROM chunks WHERE remote = 0 AND refs > 0 LIMIT ?", (limit,)
        ).fetchall()
    return [bytes(r[0]) for r in rows]


def unpushed_states(store: BoxStore) -> list[str]:
    with store.reading() as db:
        return [r[0] for r in db.execute("SELECT id FROM states WHERE pushed = 0")]


def mark_pushed(store: BoxStore, *, chunks: Sequence[bytes] = (), state: str | None = None) -> None:
    """The tier holds these chunks (and this state's manifest) now."""
    with store.transaction() as db:
        db.executemany("UPDATE chunks SET remote = 1 WHERE digest = ?", [(d,) for d in chunks])
        if state is not None:
            db.execute("UPDATE states SET pushed = 1 WHERE id = ?", (state,))


def remote_chunks(store: BoxStore, digests: Collection[bytes]) -> set[bytes]:
    """Which of ``digests`` the tier holds (as far as this home knows: a collection of
    the tier it has not caught up with yet may have deleted some)."""
    out: set[bytes] = set()
    with store.reading() as db:
        for d in digests:
            if db.execute(
                "SELECT 1 FROM chunks WHERE digest = ? AND remote = 1 "
                "UNION ALL SELECT 1 FROM tier_chunks WHERE digest = ? "
                "UNION ALL SELECT 1 FROM tier_places WHERE digest = ?",
                (d, d, d),
            ).fetchone():
                out.add(d)
    return out


def forget_remote(
    store: BoxStore,
    *,
    chunks: Collection[bytes] | None = None,
    states: Collection[str] | None = None,
    everything: bool = False,
) -> None:
    """The tier no longer holds these chunks and states' manifests (a collection of
    the tier deleted them), or any (``everything``): what a push sends again."""
    with store.transaction() as db:
        if everything:
            db.execute("UPDATE chunks SET remote = 0 WHERE remote = 1")
            db.execute("UPDATE states SET pushed = 0 WHERE pushed = 1")
            db.execute("DELETE FROM tier_chunks")
            db.execute("DELETE FROM tier_places")
            return
        db.executemany("UPDATE chunks SET remote = 0 WHERE digest = ?", [(d,) for d in chunks or ()])
        db.executemany("DELETE FROM tier_chunks WHERE digest = ?", [(d,) for d in chunks or ()])
        db.executemany("DELETE FROM tier_places WHERE digest = ?", [(d,) for d in chunks or ()])
        db.executemany("UPDATE states SET pushed = 0 WHERE id = ?", [(i,) for i in states or ()])


def pushed_states(store: BoxStore) -> set[str]:
    with store.reading() as db:
        return {r[0] for r in db.execute("SELECT id FROM states WHERE pushed = 1")}


__all__ = ["PushReport", "Remote"]
