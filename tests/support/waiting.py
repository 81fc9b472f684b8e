"""Waiting on a box, polled against a deadline: what a test expects of a running guest
(a counter goes on, orphans are reaped, a resize arrives) is looked for until it is
seen, never read once after a fixed sleep, which a host busy with other test runs
(TCG, two cores) can outlast."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T], timeout: float = 60, every: float = 0.3) -> T:
    """``probe()``'s first true answer; an ``AssertionError`` naming ``what`` if none
    comes within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


def goes_past(what: str, read: Callable[[], int], floor: int, timeout: float = 30) -> int:
    """``read()`` once it is above ``floor``: a counter in the guest runs on."""
    return wait_for(f"{what} stayed at {floor}", lambda: (n := read()) > floor and n, timeout, every=0.1)
