"""Saved states on disk: ``snapshots/<id>/`` holds what the engine saved (memory
and devices) beside the snapshot's row; the frozen disk layer is in ``layers/``.

Crash safety: a state is written into ``snapshots/.tmp-<id>/`` and renamed into
place when complete, and its row is committed only after the rename, so a
reader never sees half a snapshot. Whatever a crash leaves unreferenced is
deleted by ``sweep``.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import pids
from ..config import fsync_dir
from . import chunks, layers
from .manifest import Manifest
from .store import BoxRecord, BoxStore

ORPHAN_AGE = layers.ORPHAN_AGE


def snapshot_dir(home: Path, snap_id: str) -> Path:
    return home / "snapshots" / snap_id


def new_id() -> str:
    return secrets.token_hex(6)


@contextmanager
def writing(home: Path, snap_id: str) -> Iterator[Path]:
    """A directory to write a saved state into; renamed to ``snapshot_dir`` (and
    synced) when the block ends without an error, deleted otherwise."""
    final = snapshot_dir(home, snap_id)
    tmp = final.parent / f".tmp-{snap_id}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_dir(tmp)
        tmp.rename(final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_files(home: Path, snap_id: str) -> None:
    shutil.rmtree(snapshot_dir(home, snap_id), ignore_errors=True)


def drop(home: Path, store: BoxStore, snap_id: str, *, collect: bool = True) -> None:
    """Delete a saved state: its row (and its chunks' counts), then its files; then
    (``collect``) the chunks no state lists any more."""
    store.delete_snapshot(snap_id)
    remove_files(home, snap_id)
    if collect:
        chunks.ChunkStore(home).collect(store)


def box_sizes(rec: BoxRecord, store: BoxStore) -> tuple[int, int]:
    """(size, logical_size) of a box (``contract.BoxOut``): the bytes its own disk layers
    take (those its snapshots froze are theirs) and, suspended, its saved state's."""
    disk = 0
    for top in (rec.disk, *(d.get("top") for d in rec.drives)):
        if top:
            with contextlib.suppress(OSError):  # (a box being removed)
                disk += Path(top).stat().st_blocks * 512
    stored = logical = 0
    if rec.suspended:
        snap = store.find_snapshot(rec.suspended)
        if snap is not None:
            stored = snap.size
            logical = int(snap.options.get("logical_bytes", snap.size))
    return disk + stored, disk + logical


def sizes(home: Path, snap_id: str, manifest: Manifest | None, frozen: Path | None) -> dict[str, int]:
    """What a state just saved added to the home (``stored_bytes``: the chunks it did not
    find there, its manifest, the files of its directory and the disk layer it froze)
    and what it holds (``logical_bytes``: its memory that is not zeros, its devices' state
    and the data of that layer)."""
    files = dir_size(snapshot_dir(home, snap_id))
    disk = 0
    if frozen is not None:
        with contextlib.suppress(OSError):
            disk = frozen.stat().st_blocks * 512
    if manifest is None:
        return {"stored_bytes": files + disk, "logical_bytes": files + disk, "disk_bytes": disk}
    state = manifest.added + len(manifest.encode()) + files
    return {"stored_bytes": state + disk, "logical_bytes": manifest.logical + disk, "disk_bytes": disk}


def dir_size(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for f in path.iterdir():
            with contextlib.suppress(OSError):
                total += f.stat().st_blocks * 512
    return total


def drop_automatic_templates(home: Path, store: BoxStore, image_digests: set[str]) -> None:
    """The automatic templates of images that are gone (those no box was started from)."""
    for snap in store.snapshots(kind="template"):
        automatic = snap.name is None and snap.options.get("image_digest") in image_digests
        if automatic and not store.children(snap.id):
            drop(home, store, snap.id, collect=False)
    layers.gc(home, store)
    chunks.ChunkStore(home).collect(store)


def reclaim_abandoned(home: Path, store: BoxStore) -> None:
    """A fork's own snapshot goes with its last child; one whose fork died before any
    child was made (its owner is gone, no box came from it) is removed here."""
    for s in store.snapshots(kind="snapshot"):
        owner = s.options.get("owner")
        if not s.options.get("auto") or not isinstance(owner, list) or len(owner) != 2:
            continue
        if pids.alive(owner[0], owner[1]) or store.children(s.id):
            continue
        drop(home, store, s.id)


def sweep(home: Path, store: BoxStore) -> None:
    """Delete what crashes left behind: unfinished snapshot directories, directories
    without a row, states of suspensions that never committed, unreferenced layers."""
    now = time.time()
    reclaim_abandoned(home, store)
    snaps = {s.id: s for s in store.snapshots()}
    boxes = store.list()
    suspended = {b.suspended for b in boxes}
    pending = {b.op.get("snapshot") for b in boxes if b.op}
    for s in list(snaps.values()):
        if s.kind == "suspend" and s.id not in suspended and now - s.created_at > ORPHAN_AGE:
            drop(home, store, s.id, collect=False)
            del snaps[s.id]
    root = home / "snapshots"
    if root.is_dir():
        for d in root.iterdir():
            with contextlib.suppress(OSError):
                if d.name in snaps:  # a preparation for forks cut short leaves work files
                    for f in d.glob(".*"):
                        if f.name != ".materialize.lock" and now - f.stat().st_mtime > ORPHAN_AGE:
                            shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink()
                    continue
                if d.name in pending or now - d.stat().st_mtime < ORPHAN_AGE:
                    continue
                shutil.rmtree(d, ignore_errors=True)
    layers.gc(home, store, min_age=ORPHAN_AGE)
    chunks.ChunkStore(home).collect(store, orphans=True)
