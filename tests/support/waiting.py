"""Waiting on a box, polled against a deadline: what a test expects of a running guest
(a counter goes on, orphans are reaped, a resize arrives) is looked for until it is
seen, never read once after a fixed sleep, which a host busy with other test runs
(TCG, two cores) can outlast.

Every deadline scales with the host's measured speed (``scaled``, ``deadline``): a
number of seconds is what the reference host (2 cores, quiet, TCG) needs with room to
spare, and a host that runs a probe N times slower right now is given N times as long.
A fixed number was either too long to catch a hang quickly or too short for a load of
10 on 2 cores, where CI failed on waits and not on faults."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The probe below takes 12 ms on one quiet core of the reference host (measured: the
# fastest of 40 runs while other test runs loaded it); a free core of a faster host is
# counted as the reference's, never as faster (deadlines do not shrink).
REFERENCE_PROBE_S = 0.012
MOST = 12.0  # a host that slow is stuck: a longer wait would only hide a hang
REMEASURE_AFTER = 30.0  # the load of a shared host changes within a test run
_measured: tuple[float, float] | None = None  # (when, factor)


def _probe() -> float:
    t0 = time.perf_counter()
    n = 0
    for i in range(200_000):
        n += i * i
    return time.perf_counter() - t0


def slowdown() -> float:
    """How many times slower than the reference host this one runs now (1 at least):
    the median of a few short probes of one thread's share of a core, which is what a
    guest's emulated CPU and each process of a test get too. ``SANDLOT_TEST_SLOWDOWN``
    fixes it."""
    global _measured
    fixed = os.environ.get("SANDLOT_TEST_SLOWDOWN")
    if fixed:
        return max(1.0, float(fixed))
    now = time.monotonic()
    if _measured is None or now - _measured[0] > REMEASURE_AFTER:
        factor = statistics.median(_probe() for _ in range(7)) / REFERENCE_PROBE_S
        _measured = (now, min(MOST, max(1.0, factor)))
    return _measured[1]


def scaled(seconds: float) -> float:
    """``seconds`` on the reference host, as long as this host needs now."""
    return seconds * slowdown()


def deadline_in(seconds: float) -> float:
    """The ``time.monotonic()`` by which something the reference host does within
    ``seconds`` must have happened here."""
    return time.monotonic() + scaled(seconds)


def wait_for(what: str, probe: Callable[[], T], timeout: float = 60, every: float = 0.3) -> T:
    """``probe()``'s first true answer; an ``AssertionError`` naming ``what`` if none
    comes within ``timeout`` seconds (scaled to the host)."""
    allowed = scaled(timeout)
    until = time.monotonic() + allowed
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > until:
            raise AssertionError(f"{what}: not within {allowed:.0f} s ({timeout} s on the reference host)")
        time.sleep(every)


def goes_past(what: str, read: Callable[[], int], floor: int, timeout: float = 30) -> int:
    """``read()`` once it is above ``floor``: a counter in the guest runs on."""
    return wait_for(f"{what} stayed at {floor}", lambda: (n := read()) > floor and n, timeout, every=0.1)
