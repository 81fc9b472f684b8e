"""The home's saved state, as content-addressed chunks (docs/storage.md): what it holds,
what it costs, collecting what no state needs, and an S3-compatible tier under it that
cold state moves to and boxes move between homes through.

>>> import sandlot
>>> report = sandlot.storage.info()            # doctest: +SKIP
>>> report.stored_bytes, report.dedup_ratio    # doctest: +SKIP
(234881024, 5.4)
>>> sandlot.storage.configure("s3://my-bucket/sandlot")             # doctest: +SKIP
>>> sandlot.storage.push("dev")                # a suspended box, whole  # doctest: +SKIP
>>> sandlot.storage.pull("dev")                # on another home        # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from ..core import chunks
from ..core import tier as tiers
from ..core.chunks import LOCK_WAIT, ChunkStore
from ..core.manifest import Manifest
from ..core.remote import PushReport, Remote
from ..core.runtime import Runtime
from ..core.tiergc import TierGcReport
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
    tier: str | None = None  # the storage tier's URL, where one is configured
    remote_chunks: int = 0  # chunks the tier holds (``local_bytes``: what is here)
    remote_bytes: int = 0
    local_bytes: int = 0
    pushed_states: int = 0

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
    """What a collection (or an eviction) freed here, and (``tier``) in the storage tier."""

    chunks: int
    bytes_freed: int
    tier: TierGcReport | None = None


def info(*, home: Home = None) -> StorageReport:
    """The figures of the home's chunk store (``sandlot storage``)."""
    rt = Runtime.for_home(home)
    store = rt.store
    totals = chunks.chunk_totals(store)
    logical = sum(Manifest.decode(data).logical for data in store.state_manifests().values())
    config = tiers.configured(rt.home)
    return StorageReport(
        states=totals["states"], chunks=totals["chunks"], stored_bytes=totals["stored_bytes"],
        unshared_bytes=totals["unshared_bytes"], logical_bytes=logical,
        garbage_chunks=totals["garbage_chunks"], garbage_bytes=totals["garbage_bytes"],
        tier=config.url if config else None, remote_chunks=totals["remote_chunks"],
        remote_bytes=totals["remote_bytes"], local_bytes=ChunkStore(rt.home).local_bytes(),
        pushed_states=totals["pushed_states"],
    )  # fmt: skip


def totals(*, home: Home = None) -> dict[str, int]:
    """The chunk store's figures that cost no manifest read (``info`` without
    ``logical_bytes``), and the bytes sent to and read from the tier so far
    (``tier_sent_bytes``, ``tier_received_bytes``): for a metrics scrape."""
    store = Runtime.for_home(home).store
    return {
        "tier_sent_bytes": 0,
        "tier_received_bytes": 0,
        **chunks.counters(store),
        **chunks.chunk_totals(store),
    }


def gc(*, tier: bool = False, home: Home = None, wait: float = LOCK_WAIT) -> GcReport:
    """Delete the chunks no saved state lists, and those a save cut short left (a minute
    old or more). Waits up to ``wait`` seconds for saves and loads in progress, which
    hold the chunks they use; a collection that could not begin frees nothing.

    ``tier``: collect the storage tier too, which every home sharing it says what it
    holds in: the state manifests no home holds and no box in the tier needs, and the
    chunks none of the rest lists, go (``GcReport.tier``). It waits (``wait`` seconds at
    most) for pushes and pulls under way, and they wait for it."""
    if not wait >= 0:  # NaN too
        raise InvalidArgument(f"wait must be 0 or more seconds, not {wait}")
    rt = Runtime.for_home(home)
    count, freed = ChunkStore(rt.home).collect(rt.store, orphans=True, wait=wait, busy_ok=False)
    if not tier:
        return GcReport(count, freed)
    with Remote.of(rt) as remote:
        return GcReport(count, freed, remote.collect(wait))


def configure(
    url: str | None,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    profile: str | None = None,
    evict_after: float | None = None,
    home: Home = None,
) -> None:
    """Give the home a storage tier (``None``: none), for every process of the home:
    ``url`` is ``s3://BUCKET[/PREFIX]``; credentials come from the standard AWS
    configuration (its environment, ``~/.aws``, ``profile``), ``endpoint_url`` names an
    S3-compatible store other than AWS. ``evict_after`` (seconds): the state of a box
    suspended that long, or of a snapshot that old, keeps only its manifest here once
    the tier has its chunks (``evict``, and the pushes after saves, apply it).
    ``$SANDLOT_STORAGE`` overrides what this writes."""
    rt = Runtime.for_home(home)
    config = None if url is None else tiers.TierConfig(url, endpoint_url, region, profile, evict_after)
    tiers.configure(rt.home, config)


def push(box: str | None = None, *, release: bool = False, home: Home = None) -> PushReport:
    """Send the tier what it lacks: every saved state of the home (``box`` None), or a
    suspended box whole, state and disk, for another home to ``pull`` and resume it.
    ``release``: the box then leaves this home."""
    if box is None and release:
        raise InvalidArgument("release moves one box: name it")
    with Remote.of(Runtime.for_home(home)) as remote:
        return remote.push() if box is None else remote.push_box(box, release=release)


def pull(box: str, *, force: bool = False, home: Home = None) -> Any:
    """Take a box from the tier into this home, suspended, with its id, name, processes and
    files: ``resume()`` (or any command) brings it back. Refused (``BoxElsewhere``)
    while another home holds it, unless ``force`` (that home is known to be gone)."""
    from .sync import Box

    rt = Runtime.for_home(home)
    return Box.get(pull_id(box, force=force, home=rt.home), home=rt.home)


def pull_id(box: str, *, force: bool = False, home: Home = None) -> str:
    """``pull``, for a caller with handles of its own (a fleet's node): the box's id."""
    with Remote.of(Runtime.for_home(home)) as remote:
        return remote.pull_box(box, force=force).id


def tier_url(*, home: Home = None) -> str | None:
    """The home's storage tier, or None (``info`` without its figures)."""
    config = tiers.configured(Runtime.for_home(home).home)
    return config.url if config is not None else None


def evict(older_than: float | None = None, *, home: Home = None) -> GcReport:
    """Keep only the manifest here of cold states (boxes suspended ``older_than`` seconds
    ago or more, snapshots that old; default: the tier's ``evict_after``), once the
    tier has their chunks; a later load brings the chunks back."""
    with Remote.of(Runtime.for_home(home)) as remote:
        after = older_than if older_than is not None else remote.tier.config.evict_after
        if after is None or not after >= 0:
            raise InvalidArgument("evict needs older_than (seconds), or a tier configured with evict_after")
        count, freed = remote.evict(after)
    return GcReport(count, freed)


def boxes(*, home: Home = None) -> list[dict[str, Any]]:
    """The boxes in the home's tier: ``id``, ``name``, ``labels``, ``pushed_at``, ``pushed_by`` and
    ``holder`` (the home that holds it; None: any home may pull it)."""
    return Remote.of(Runtime.for_home(home)).boxes()


def box(box_id: str, *, home: Home = None) -> dict[str, Any] | None:
    """One box of the home's tier by its id, as ``boxes`` lists it; None where it has none."""
    return Remote.of(Runtime.for_home(home)).box(box_id)


__all__ = [
    "GcReport", "PushReport", "StorageReport", "TierGcReport", "box", "boxes", "configure", "evict", "gc",
    "info", "pull", "pull_id", "push", "tier_url", "totals",
]  # fmt: skip
