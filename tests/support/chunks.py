"""Where a saved state's chunks are (``core/chunks.py``), for tests that damage one."""

from __future__ import annotations

from pathlib import Path

from sandlot.core.chunks import ChunkStore
from sandlot.core.manifest import Manifest
from sandlot.core.runtime import Runtime
from sandlot.core.store import BoxStore


def memory_chunks(snap_id: str, home: Path | str | None = None) -> list[Path]:
    """The chunk files of a saved state's memory: its images' (QEMU), in their order, or
    else its streams' (gVisor's checkpoint: the sandbox's memory and kernel state)."""
    where = Runtime.for_home(home).home
    data = BoxStore(where / "sandlot.db").state_manifest(snap_id)
    assert data is not None, f"saved state {snap_id} is no chunks"
    store, m = ChunkStore(where), Manifest.decode(data)
    found = [d for img in m.images for d in img.digests if d is not None]
    return [store.path(d) for d in found or [d for s in m.streams for d in s.digests]]


def state_bytes(snap_id: str, home: Path | str | None = None) -> bytes:
    """Everything a saved state of chunks holds, uncompressed: its memory images and its
    streams, one after the other (for a search of what the guest had)."""
    where = Runtime.for_home(home).home
    data = BoxStore(where / "sandlot.db").state_manifest(snap_id)
    assert data is not None, f"saved state {snap_id} is no chunks"
    store, m = ChunkStore(where), Manifest.decode(data)
    digests = [d for img in m.images for d in img.digests if d is not None]
    digests += [d for s in m.streams for d in s.digests]
    return b"".join(store.get(d, snap_id) for d in digests)
