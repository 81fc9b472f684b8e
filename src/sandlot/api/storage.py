"""The home's saved state, as content-addressed chunks (docs/storage.md): what it holds,
what it costs, and collecting what no state needs.

>>> import sandlot
>>> report = sandlot.storage.info()            # doctest: +SKIP
>>> report.stored_bytes, report.dedup_ratio    # doctest: +SKIP
(234881024, 5.4)
>>> sandlot.storage.gc()                       # doctest: +SKIP
GcReport(chunks=0, bytes_freed=0)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from ..core.chunks import LOCK_WAIT, ChunkStore
from ..core.manifest import Manifest
from ..core.runtime import Runtime
from ..errors import InvalidArgument

Home = str | os.PathLike[str] | None


@dataclass(frozen=True, slots=True)
class StorageReport:
    """The chunk store of a home.

    ``logical_bytes``: what its saved states hold (memory that is not zeros, and their
    devices' state), counted once per state; ``unshared_bytes``: what they would take
    if each kept its own compressed copy of its chunks; ``stored_bytes``: what they take
    (each chunk once). ``garbage_*``: chunks no state lists, until a collection."""

    states: int
    chunks: int
    stored_bytes: int
    unshared_bytes: int
    logical_bytes: int
    garbage_chunks: int
    garbage_bytes: int

    @property
    def dedup_ratio(self) -> float:
        """How many times over the states' chunks would be kept without sharing."""
        return round(self.unshared_bytes / self.stored_bytes, 2) if self.stored_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        """The states' content against its compressed chunks."""
        return round(self.logical_bytes / self.unshared_bytes, 2) if self.unshared_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "dedup_ratio": self.dedup_ratio, "compression_ratio": self.compression_ratio}


@dataclass(frozen=True, slots=True)
class GcReport:
    chunks: int
    bytes_freed: int


def info(*, home: Home = None) -> StorageReport:
    """The figures of the home's chunk store (``sandlot storage``)."""
    store = Runtime.for_home(home).store
    totals = store.chunk_totals()
    logical = sum(Manifest.decode(data).logical for data in store.state_manifests().values())
    return StorageReport(
        states=totals["states"], chunks=totals["chunks"], stored_bytes=totals["stored_bytes"],
        unshared_bytes=totals["unshared_bytes"], logical_bytes=logical,
        garbage_chunks=totals["garbage_chunks"], garbage_bytes=totals["garbage_bytes"],
    )  # fmt: skip


def totals(*, home: Home = None) -> dict[str, int]:
    """The chunk store's figures that cost no manifest read (``info`` without
    ``logical_bytes``): for a metrics scrape."""
    totals: dict[str, int] = Runtime.for_home(home).store.chunk_totals()
    return totals


def gc(*, home: Home = None, wait: float = LOCK_WAIT) -> GcReport:
    """Delete the chunks no saved state lists, and those a save cut short left (a minute
    old or more). Waits up to ``wait`` seconds for saves and loads in progress, which
    hold the chunks they use; a collection that could not begin frees nothing."""
    if not wait >= 0:  # NaN too
        raise InvalidArgument(f"wait must be 0 or more seconds, not {wait}")
    rt = Runtime.for_home(home)
    count, freed = ChunkStore(rt.home).collect(rt.store, orphans=True, wait=wait, busy_ok=False)
    return GcReport(count, freed)


__all__ = ["GcReport", "StorageReport", "gc", "info", "totals"]
