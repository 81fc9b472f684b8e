"""Metrics of many boxes at once, for faces that export them (``sandlot serve``'s
Prometheus ``/metrics``): each box of the home with its newest sample
(``core.metrics``), and what its bounded records folded, dropped and refused
(``bounded``: the home's keeper's counts, with this process's own). One box's history
is ``box.metrics()``."""

from __future__ import annotations

import os
from typing import Any

from .. import records
from ..core.metrics import latest_samples
from ..core.runtime import Runtime
from ..core.store import BoxStore
from .box import AsyncBox

# (box id, "" for the home's): record: what: how many, since the box began
Bounded = dict[str, dict[str, dict[str, int]]]


async def latest(home: str | os.PathLike[str] | None = None) -> list[tuple[AsyncBox, dict[str, Any] | None]]:
    """Every box of the home, oldest first, with its newest sample (None: never sampled)."""
    samples = await Runtime.for_home(home).db.call(latest_samples)
    return [(b, samples.get(b.id)) for b in await AsyncBox.list(home=home)]


async def bounded(home: str | os.PathLike[str] | None = None) -> Bounded:
    """What each box's bounded records folded, dropped or refused (the store's counts,
    which the home's keeper and the store write), with what this process bounded itself
    (a cell's output, a watch's events, a desktop's screen: ``records.TALLY``)."""
    stored = await Runtime.for_home(home).db.call(BoxStore.records)
    out: Bounded = {
        box: {record: dict(r["counts"]) for record, r in recs.items()} for box, recs in stored.items()
    }
    for (record, what, box), n in records.TALLY.snapshot().items():
        counts = out.setdefault(box, {}).setdefault(record, {})
        counts[what] = counts.get(what, 0) + n
    return out


__all__ = ["Bounded", "bounded", "latest"]
