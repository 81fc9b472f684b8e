"""Metrics of many boxes at once, for faces that export them (``sandlot serve``'s
Prometheus ``/metrics``): each box of the home with its newest sample
(``core.metrics``). One box's history is ``box.metrics()``."""

from __future__ import annotations

import os
from typing import Any

from ..core.runtime import Runtime
from .box import AsyncBox


async def latest(home: str | os.PathLike[str] | None = None) -> list[tuple[AsyncBox, dict[str, Any] | None]]:
    """Every box of the home, oldest first, with its newest sample (None: never sampled)."""
    samples = await Runtime.for_home(home).db.call("latest_samples")
    return [(b, samples.get(b.id)) for b in await AsyncBox.list(home=home)]


__all__ = ["latest"]
