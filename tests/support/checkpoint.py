"""What a gVisor checkpoint image holds, readable, for tests that look for a string in a
saved state (a secret's value must be nowhere in one; the placeholder the box holds
must be found, so that the search is known to work): the image's state inflated, read
as the engine reads it when it keeps a checkpoint as chunks (``engine/gvisor/checkpoint.py``
says how the image is framed)."""

from __future__ import annotations

import io
from pathlib import Path

from sandlot.engine.gvisor import checkpoint


def plain_state(image: Path) -> bytes:
    """The state a gVisor checkpoint image holds, every chunk inflated and joined.
    ``checkpoint.NotFramed`` (a ValueError) where it is not framed as runsc writes it."""
    state = io.BytesIO()
    with open(image, "rb") as f:
        checkpoint.split(f, state)
    return state.getvalue()
