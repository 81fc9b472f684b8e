"""Admission: a host-wide bound on VMs coming up at once.

A boot or a restore is CPU-bound until the agent answers (about 1.2 s of CPU
for a cold boot under TCG, a few hundred ms for a restore). Started all at
once, fifty of them share the cores fifty ways, each takes fifty times longer,
and their deadlines pass while none is stuck. So sandlot lets only ``slots``
VMs come up at a time on a host, and the others wait in line; a box's boot
deadline starts when it leaves the line, so it measures the box's own
progress, never time spent waiting.

The line: within a process, an ``asyncio.Semaphore`` (first come, first
served). Across processes, ``slots`` lock files under the runtime directory; a
process holding a local turn tries them without blocking, between short
sleeps, so no thread and no event loop is ever blocked. Across processes the
order is not strictly first come first served, but a waiting process retries
every few milliseconds and every holder leaves within one boot deadline.

The bound: ``$SANDLOT_MAX_STARTING``, else twice the host's cores under TCG
(each start is mostly one busy vCPU) and four times under KVM, at least 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from ..config import FLOCK_POLL_MAX, FLOCK_POLL_MIN, try_flock
from ..errors import BoxBusy

QUEUE_TIMEOUT = 600.0  # a start waits this long in line at most


def default_slots(accel: str) -> int:
    env = os.environ.get("SANDLOT_MAX_STARTING")
    if env:
        return max(1, int(env))
    cores = os.cpu_count() or 1
    return max(2, cores * (4 if accel == "kvm" else 2))


class Admission:
    """The line for one event loop of this process, in front of the host's slots."""

    def __init__(self, directory: Path, slots: int) -> None:
        self.directory = directory
        self.slots = slots
        self._local = asyncio.Semaphore(slots)
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def turn(self, timeout: float = QUEUE_TIMEOUT) -> AsyncIterator[float]:
        """Wait for a slot; yields the seconds spent waiting."""
        t0 = time.monotonic()
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout):
                await self._local.acquire()
        except TimeoutError:
            raise BoxBusy(f"no VM could start within {timeout:.0f}s: the host is saturated") from None
        finally:
            self.waiting -= 1
        try:
            fd = await self._host_slot(t0 + timeout)
            try:
                yield time.monotonic() - t0
            finally:
                os.close(fd)
        finally:
            self._local.release()

    async def _host_slot(self, deadline: float) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        delay = FLOCK_POLL_MIN
        first = os.getpid() % self.slots  # spread the first tries of different processes
        while True:
            for i in range(self.slots):
                fd = try_flock(self.directory / f"slot-{(first + i) % self.slots}.lock")
                if fd is not None:
                    return fd
            if time.monotonic() > deadline:
                raise BoxBusy("no VM could start in time: the host is saturated")
            await asyncio.sleep(delay)
            delay = min(delay * 2, FLOCK_POLL_MAX)
