"""Names for the boxes tests make in the tests' home, which later runs reuse: each test
session's names are its own, so boxes a killed session left behind never make a later
session fail on a name already taken, and two sessions on one machine never meet."""

from __future__ import annotations

import os

SESSION = f"{os.getpid():x}{os.urandom(2).hex()}"


def unique(name: str) -> str:
    """``name`` with this session's mark (still a valid box name: at most 64 characters)."""
    return f"{name}-{SESSION}"
