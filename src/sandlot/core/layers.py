"""Disk layers: a box's disk is a chain of qcow2 files in ``layers/``, or (engines
whose box root is an overlay: gvisor) a chain of layer directories ``layers/<id>.dir``
(each one's ``upper`` a lower layer of the overlay above it, down to the image root).

The image's ext4 base is at the bottom, the box's writable *top* layer above.
A snapshot freezes the top (the box goes on writing to a new layer on top of
it); a fork gives each child a new top on the frozen layer; a rollback gives
the box a new top on the snapshot's layer. Layers are never copied and never
rewritten once frozen, so each of these costs a qcow2 header of a few hundred bytes.

A layer is referenced by the rows that name it: a box's ``disk``, a pending
operation's ``op.disk``, a snapshot's ``layer``, and everything below those.
``gc`` deletes the rest, once a crash's leftovers are old enough to be sure no
row is about to name them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import SavedStateError
from ..images.rootfs import qcow2_backing_file, write_qcow2_overlay
from .store import BoxRecord, BoxStore, SnapshotRecord

ORPHAN_AGE = 60.0  # seconds before an unreferenced file may be a crash's leftover


def layers_dir(home: Path) -> Path:
    return home / "layers"


def new_path(home: Path, suffix: str = ".qcow2") -> Path:
    d = layers_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{secrets.token_hex(8)}{suffix}"


DIR_SUFFIX = ".dir"  # a layer directory: the disk of engines whose box root is an overlay
RAW_SUFFIX = ".raw"  # the bottom of a named volume's chain: its empty filesystem


def make_dir_layer(path: Path, base: Path, parent: Path | None = None) -> None:
    """An empty layer directory over ``parent`` (a frozen layer directory) or straight
    over ``base`` (an unpacked image root): ``upper/`` and ``work/`` for the overlay,
    ``base`` and ``parent`` naming what lies below. Made beside and renamed, so a crash
    leaves either nothing or a whole layer."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "upper").mkdir()
    (tmp / "work").mkdir()
    (tmp / "base").write_text(str(base))
    if parent is not None:
        (tmp / "parent").write_text(str(parent))
    os.rename(tmp, path)


def dir_base(layer: Path) -> Path:
    """The image root at the bottom of a layer directory's chain."""
    try:
        return Path((layer / "base").read_text().strip())
    except OSError as exc:
        raise SavedStateError(f"the layer {layer} names no base: {exc}") from exc


def dir_parent(layer: Path) -> Path | None:
    """The frozen layer directory right below ``layer`` (None: the image root is)."""
    try:
        return Path((layer / "parent").read_text().strip())
    except FileNotFoundError:
        return None


def new_layer(home: Path, backing: Path, size: int | None = None, backing_format: str = "qcow2") -> Path:
    """An empty layer on ``backing``: qcow2 (written directly, ``write_qcow2_overlay``:
    the backing is never opened, as it may be open in a running VM), or a layer
    directory over a layer directory."""
    if backing.suffix == DIR_SUFFIX:
        path = new_path(home, DIR_SUFFIX)
        make_dir_layer(path, dir_base(backing), backing)
        return path
    path = new_path(home)
    write_qcow2_overlay(path, backing, backing_format, virtual_size(backing) if size is None else size)
    return path


def chain(top: Path) -> list[Path]:
    """``top`` and every file below it, down to the base (a layer directory's chain
    ends above its image root, which the image store keeps)."""
    out = [top]
    seen = {top}
    while True:
        if top.suffix == DIR_SUFFIX:
            below = dir_parent(out[-1])
            backing = str(below) if below is not None else None
        else:
            backing = qcow2_backing_file(out[-1])
        if not backing:
            return out
        p = Path(backing)
        if p in seen or len(out) > 1000:
            raise SavedStateError(f"the disk chain of {top} loops")
        seen.add(p)
        out.append(p)


def chains(tops: Iterable[Path]) -> list[Path]:
    """Every file of the chains under ``tops`` (a top whose chain cannot be read: itself)."""
    out: list[Path] = []
    for top in tops:
        try:
            out += chain(top)
        except (SavedStateError, OSError):
            out.append(top)
    return out


def virtual_size(path: Path) -> int:
    with open(path, "rb") as f:
        header = f.read(32)
    return int.from_bytes(header[24:32], "big")


def box_tops(box: BoxRecord) -> list[Path]:
    """The tops a box's row names: its disk's and its drives', and those of an operation
    in progress (a rollback's new ones)."""
    op = box.op or {}
    names = [box.disk, op.get("disk"), *(d.get("top") for d in box.drives), *(op.get("drives") or ())]
    return [Path(n) for n in names if n]


def snapshot_layers(snap: SnapshotRecord) -> list[Path]:
    """A snapshot's frozen layers: its disk's, then its drives' in their order."""
    return [Path(snap.layer), *(Path(p) for p in snap.options.get("drives") or ())]


def referenced(
    boxes: Iterable[BoxRecord], snapshots: Iterable[SnapshotRecord], volumes: Iterable[Path] = ()
) -> list[Path]:
    """The tops that rows name (each keeps its whole chain)."""
    tops = [top for b in boxes for top in box_tops(b)]
    tops += [layer for s in snapshots for layer in snapshot_layers(s)]
    return tops + list(volumes)


def gc(home: Path, store: BoxStore, *, min_age: float = ORPHAN_AGE, also: Iterable[Path] = ()) -> None:
    """Delete layers no box, snapshot or volume of ``store`` reaches. ``also``: unreferenced
    layers to delete now, whatever their age (a removed box's top)."""
    d = layers_dir(home)
    if not d.is_dir():
        return
    keep: set[Path] = set()
    # boxes first: a box removed meanwhile may have handed its tops to a volume, read after
    for top in referenced(store.list(), store.snapshots(), store.volume_layers()):
        with contextlib.suppress(SavedStateError, OSError):
            keep.update(chain(top))
    now = time.time()
    forced = set(also)
    for pattern in ("*.qcow2", f"*{RAW_SUFFIX}", f"*{DIR_SUFFIX}", f".*{DIR_SUFFIX}.tmp"):
        for f in d.glob(pattern):
            if f in keep:
                continue
            with contextlib.suppress(OSError):
                if f in forced or now - f.stat().st_mtime > min_age:
                    if f.is_dir():
                        shutil.rmtree(f)
                    else:
                        f.unlink()
