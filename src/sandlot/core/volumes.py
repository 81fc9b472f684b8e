"""Named volumes: filesystems that live beside boxes, mounted by name.

A volume is an ext4 filesystem in a chain of disk layers (``core.layers``), like a
box's disk: at its bottom an empty filesystem of the volume's size (a sparse raw
file, ``layers/<id>.raw``), above it qcow2 layers, and its *head*, the frozen layer
a box that mounts it next starts from (the ``volumes`` row's ``layer``). A box never
writes a volume's layers: it mounts a *top* of its own over the head (a drive beside
its root disk, found in the guest by its serial), so everything live state does to a
root disk it does to volumes, in the same QEMU transaction:

- a snapshot freezes the tops with the disk (the box goes on over new ones), so a
  restore, a rollback or a fork sees each volume as it was then, and a fork's children
  get copy-on-write tops of their own over the frozen layers: they cost a qcow2 header
  each, whatever the volume holds;
- the box that mounted a volume by name in ``copy`` mode *holds* it: when that box is
  removed, its top becomes the volume's head (in the transaction that deletes the box),
  so the next box that mounts the volume sees what it wrote. One box holds a volume at
  a time; boxes made from snapshots (forks, templates, restores) write private copies;
- ``ro`` mounts are read-only in the guest, over a private top too (the kernel replays
  a journal a holder left unfinished there, never in the volume), and any number of
  boxes have them at once.

The size is the filesystem's: a full volume is ENOSPC in the box, and the host's disk
holds only what was written (every layer is sparse).

A *shared* volume (``create(shared=True)``) is a directory instead (``volumes/<id>``),
which every box that mounts it shares live over virtio-9p, as a host directory given by
path is: what one box writes, the others and the host see at once. It is never part of a
snapshot: a save unmounts it for its length (``BoxController.still``), and a restore, a
rollback or a fork mounts it again as it is then. Its size is the host filesystem's.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..config import tree_bytes
from ..errors import HostSetupError, InvalidArgument, SavedStateError, VolumeInUse, VolumeNotFound, no_space
from . import layers
from .boxrecord import box_of_row
from .option_values import Mount, Volume, is_volume_name
from .spec import BoxSpec
from .store import BoxRecord, BoxStore, SnapshotRecord, insert_row

GiB = 1 << 30
DEFAULT_SIZE_GB = 10
MAX_SIZE_GB = 16 * 1024  # ext4 with 4 KiB blocks and qcow2 both go far beyond; a sanity bound
_LABEL_KEY_MAX = 128


@dataclass(frozen=True, slots=True)
class VolumeInfo:
    """What ``inspect`` says of a volume: its record, the boxes that mount it (and which
    of them holds it), and the bytes its layers take on the host."""

    record: VolumeRecord
    boxes: list[dict[str, str]]  # {"name", "id", "mode", "state"}
    holder: str | None  # the name of the box that writes it back, if any
    host_bytes: int

    def to_json(self) -> dict[str, Any]:
        r = self.record
        return {"id": r.id, "name": r.name, "kind": r.kind, "size": r.size, "size_gb": r.size / GiB,
                "labels": r.labels, "created_at": r.created_at, "holder": self.holder, "boxes": self.boxes,
                "host_bytes": self.host_bytes}  # fmt: skip


def check_name(name: object) -> str:
    if not isinstance(name, str) or not is_volume_name(name):
        raise InvalidArgument(
            f"a volume name is 1 to 63 letters, digits, '_', '.' or '-', starting with a letter or digit, "
            f"not {name!r}"
        )
    return name


def check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise InvalidArgument(f"labels must be a mapping of strings, not {labels!r}")
    out = {}
    for k, v in labels.items():
        if not isinstance(k, str) or not k or len(k) > _LABEL_KEY_MAX or not isinstance(v, str):
            raise InvalidArgument(f"invalid label {k!r}={v!r}")
        out[k] = v
    return out


def check_size(size_gb: object) -> int:
    if isinstance(size_gb, bool) or not isinstance(size_gb, int | float) or not 0 < size_gb <= MAX_SIZE_GB:
        raise InvalidArgument(f"size_gb must be a number above 0 and at most {MAX_SIZE_GB}, not {size_gb!r}")
    size = int(size_gb * GiB) // (1 << 20) * (1 << 20)  # whole MiB
    if size < 16 << 20:
        raise InvalidArgument(f"a volume needs at least 16 MiB (size_gb={size_gb})")
    return size


def make_empty_fs(path: Path, size: int, label: str) -> None:
    """An empty ext4 filesystem of ``size`` bytes in a sparse file. Lazy inode tables:
    the guest mounts with ``noinit_itable``, so they are never zeroed into a layer."""
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    if not os.path.exists(mkfs):
        raise HostSetupError("mkfs.ext4 not found: install e2fsprogs")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
        cmd = [mkfs, "-q", "-F", "-t", "ext4", "-m", "0", "-L", label[:16],
               "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0,nodiscard", str(tmp)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 and "No space left" in proc.stderr:
            raise no_space(path.parent, "the volume's filesystem could not be made")
        if proc.returncode != 0:
            raise HostSetupError(f"mkfs.ext4 failed: {proc.stderr.strip()[-2000:]}")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.rename(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def create(home: Path, store: BoxStore, name: str, size_gb: float | None = None,
           labels: Mapping[str, str] | None = None, *, shared: bool = False) -> VolumeRecord:  # fmt: skip
    """A new, empty volume. Its files are made first and its row written last, so a
    crash leaves no row naming a missing file (``layers.gc`` takes unnamed layers, and
    the next shared volume made, unnamed directories)."""
    check_name(name)
    if not isinstance(shared, bool):
        raise InvalidArgument(f"shared must be True or False, not {shared!r}")
    if shared and size_gb is not None:
        raise InvalidArgument(
            "a shared volume is a directory of the host, with no size of its own: give no size_gb"
        )
    size = 0 if shared else check_size(DEFAULT_SIZE_GB if size_gb is None else size_gb)
    tags = check_labels(labels)
    with contextlib.suppress(VolumeNotFound):
        get_volume(store, name)
        raise InvalidArgument(f"a volume named {name!r} already exists")
    if shared:
        return _create_shared(home, store, name, tags)
    base = layers.new_path(home, layers.RAW_SUFFIX)
    try:
        make_empty_fs(base, size, name)
        head = layers.new_layer(home, base, size, backing_format="raw")
    except BaseException:
        base.unlink(missing_ok=True)
        raise
    rec = VolumeRecord(id=f"vol-{secrets.token_hex(6)}", name=name, size=size, layer=str(head),
                       created_at=time.time(), labels=tags)  # fmt: skip
    try:
        return insert_volume(store, rec)
    except BaseException:
        head.unlink(missing_ok=True)
        base.unlink(missing_ok=True)
        raise


def _create_shared(home: Path, store: BoxStore, name: str, labels: dict[str, str]) -> VolumeRecord:
    top = shared_dir(home)
    top.mkdir(parents=True, exist_ok=True)
    named = {Path(v.layer).name for v in volume_rows(store) if v.kind == "shared"}
    for left in top.iterdir():  # a crash between a removal's row and its files
        if left.name not in named and left.name.startswith("vol-"):
            shutil.rmtree(left, ignore_errors=True)
    rec = VolumeRecord(id=f"vol-{secrets.token_hex(6)}", name=name, size=0, layer="", created_at=time.time(),
                       labels=labels, kind="shared")  # fmt: skip
    where = top / rec.id
    where.mkdir(mode=0o755)
    try:
        return insert_volume(store, replace(rec, layer=str(where)))
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise


def shared_dir(home: Path) -> Path:
    """Where shared volumes keep their files, a directory each."""
    return home / "volumes"


def inspect(store: BoxStore, key: str) -> VolumeInfo:
    rec = get_volume(store, key)
    if rec.kind == "shared":
        users = [
            {"name": b.name, "id": b.id, "mode": "ro" if v[2] else "shared", "state": b.state}
            for b in mounting(store, rec.id)
            for v in b.options.get("volumes", [])
            if v[0] == rec.layer
        ]
        return VolumeInfo(rec, users, None, tree_bytes(Path(rec.layer)))
    boxes, holder, tops = [], None, [Path(rec.layer)]
    for b in mounting(store, rec.id):
        for d, m in zip(b.drives, mounts_of(b), strict=False):
            if d.get("volume") == rec.id:
                boxes.append({"name": b.name, "id": b.id, "mode": m.mode, "state": b.state})
                tops.append(Path(d["top"]))
                if d.get("holds") and rec.holder == b.id:
                    holder = b.name
    return VolumeInfo(rec, boxes, holder, host_bytes(tops))


def host_bytes(tops: list[Path]) -> int:
    """The bytes the chains under ``tops`` take on the host, each file once (sparse
    files: what was written): a volume's own, and the layers boxes write over it."""
    files: set[Path] = set()
    for top in tops:
        with contextlib.suppress(OSError, SavedStateError):
            files.update(layers.chain(top))
    total = 0
    for p in files:
        with contextlib.suppress(OSError):
            total += p.stat().st_blocks * 512
    return total


def remove(home: Path, store: BoxStore, key: str) -> None:
    """Remove a volume, refused while a box mounts it. Snapshots that hold its layers
    keep them (a box started from one has its copy); the rest of its files go now. A
    shared volume's directory goes with it: a snapshot that shared it names it, and a
    box started from one is refused."""
    rec = get_volume(store, key)
    delete_volume(store, rec.id)
    if rec.kind == "shared":
        shutil.rmtree(rec.layer, ignore_errors=True)
        return
    layers.gc(home, store, also=layers.chain(Path(rec.layer)))


def resolve(store: BoxStore, spec: BoxSpec) -> None:
    """The named volumes of a new box, as it mounts them: a disk volume's mode (``copy``
    unless given), and a shared volume's directory, which becomes one of its shares."""
    disks: list[Mount] = []
    for m in spec.mounts:
        vol = get_volume(store, m.volume)
        if vol.kind == "shared":
            if m.mode not in ("", "shared", "ro"):
                raise InvalidArgument(
                    f"volume {m.volume!r} is shared: mount it 'shared' (the default), or 'ro'"
                )
            spec.volumes.append(Volume(vol.layer, m.guest, m.mode == "ro", vol.name))
        elif m.mode == "shared":
            raise InvalidArgument(
                f"volume {m.volume!r} is a filesystem of its own, mounted 'copy' (its default) or 'ro': "
                "a volume that boxes share live is made with sandlot.volume.create(name, shared=True)"
            )
        else:
            disks.append(replace(m, mode=m.mode or "copy"))
    spec.mounts = disks


def mounts_of(box: BoxRecord) -> list[Mount]:
    return [Mount(v, g, mode) for v, g, mode in box.options.get("mounts", [])]


def tops_for(home: Path, store: BoxStore, mounts: list[Mount]) -> list[dict[str, Any]]:
    """The drives of a new box that mounts ``mounts`` by name: a new top over each
    volume's head; those in ``copy`` mode it holds (``BoxStore._hold_volumes``)."""
    drives: list[dict[str, Any]] = []
    try:
        for i, m in enumerate(mounts):
            assert m.mode in ("copy", "ro"), m  # resolved
            vol = get_volume(store, m.volume)
            top = layers.new_layer(home, Path(vol.layer))
            drives.append({"volume": vol.id, "serial": serial(i), "top": str(top), "holds": m.mode == "copy"})
    except BaseException:
        for d in drives:
            Path(d["top"]).unlink(missing_ok=True)
        raise
    return drives


def tops_from(home: Path, snap: SnapshotRecord) -> list[dict[str, Any]]:
    """The drives of a box started from a snapshot: a private top over each of the
    snapshot's frozen layers."""
    saved = snap.options.get("drive_volumes") or []
    drives: list[dict[str, Any]] = []
    try:
        for i, layer in enumerate(snap.options.get("drives") or []):
            top = layers.new_layer(home, Path(layer))
            volume = saved[i] if i < len(saved) else ""
            drives.append({"volume": volume, "serial": serial(i), "top": str(top), "holds": False})
    except BaseException:
        for d in drives:
            Path(d["top"]).unlink(missing_ok=True)
        raise
    return drives


def serial(index: int) -> str:
    """The serial (and QEMU drive id) of a box's ``index``-th volume."""
    return f"sandlot-vol{index}"


# -- the ``volumes`` table: functions that take the store first, as ``BoxStore``'s methods
# do, so that ``AsyncStore.call`` runs them on the store's thread (a box's hold on a
# volume is written with the box's own row: ``BoxStore.insert`` and ``delete``)


@dataclass(frozen=True, slots=True)
class VolumeRecord:
    """A named volume: an ext4 filesystem in a chain of disk layers, or (``kind``
    "shared") a directory that boxes share live."""

    id: str
    name: str
    size: int  # bytes (0: a shared volume, which has the size of the host's filesystem)
    layer: str  # its frozen head: what a box that mounts it next starts from; or its directory
    created_at: float
    labels: dict[str, str] = field(default_factory=dict)
    holder: str | None = None  # the box that writes it back when removed (``copy`` mode)
    kind: str = "disk"  # or "shared"

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _volume_row(r: sqlite3.Row) -> VolumeRecord:
    d = dict(r)
    d["labels"] = json.loads(d["labels"])
    return VolumeRecord(**d)


def _mounts(box: BoxRecord, volume_id: str, volume: sqlite3.Row) -> bool:
    """Whether ``box`` mounts the volume: a top over its layers, or its directory shared."""
    if volume["kind"] == "shared":
        return any(str(v[0]) == volume["layer"] for v in box.options.get("volumes", []))
    return any(d.get("volume") == volume_id for d in box.drives)


def insert_volume(store: BoxStore, rec: VolumeRecord) -> VolumeRecord:
    d = rec.to_json() | {"labels": json.dumps(rec.labels)}
    try:
        with store.transaction() as db:
            insert_row(db, "volumes", d)
    except sqlite3.IntegrityError:
        raise InvalidArgument(f"a volume named {rec.name!r} already exists") from None
    return rec


def volume_rows(store: BoxStore) -> list[VolumeRecord]:
    with store.reading() as db:
        rows = db.execute("SELECT * FROM volumes ORDER BY created_at").fetchall()
    return [_volume_row(r) for r in rows]


def get_volume(store: BoxStore, key: str) -> VolumeRecord:
    """By exact name or id."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"a volume name or id is needed, not {key!r}")
    with store.reading() as db:
        row = db.execute("SELECT * FROM volumes WHERE name = ? OR id = ?", (key, key)).fetchone()
    if row is None:
        raise VolumeNotFound(f"no volume {key!r} (sandlot.volume.create({key!r}) makes one)")
    return _volume_row(row)


def mounting(store: BoxStore, volume_id: str) -> list[BoxRecord]:
    """The boxes that mount a volume, in any mode and state."""
    with store.reading() as db:
        row = db.execute("SELECT layer, kind FROM volumes WHERE id = ?", (volume_id,)).fetchone()
    return [b for b in store.list() if row is not None and _mounts(b, volume_id, row)]


def delete_volume(store: BoxStore, volume_id: str) -> None:
    """Delete a volume's row, refused while any box mounts it (checked in the same
    transaction). Its layers go with the next ``layers.gc`` that no snapshot stops."""
    with store.transaction() as db:
        row = db.execute("SELECT name, layer, kind FROM volumes WHERE id = ?", (volume_id,)).fetchone()
        if row is None:
            return
        boxes = [box_of_row(r) for r in db.execute("SELECT * FROM boxes").fetchall()]
        users = [b.name for b in boxes if _mounts(b, volume_id, row)]
        if users:
            what = f"volume {row['name']!r} is mounted by {', '.join(users)}"
            raise VolumeInUse(f"{what}: remove those boxes first", boxes=users)
        db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))
