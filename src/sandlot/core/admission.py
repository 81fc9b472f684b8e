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

How long one waits in line: ``QUEUE_TIMEOUT`` for a call that asked for the start,
``$SANDLOT_WAKE_WAIT`` (``WAKE_WAIT``) for a sleeping box woken by traffic or a call
(``waiting_at_most``): a request behind a storm of wakes is answered 503 with a
``Retry-After`` (``BoxBusy``) before its client gives up on it, rather than after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from pathlib import Path

from ..config import FLOCK_POLL_MAX, FLOCK_POLL_MIN, try_flock
from ..errors import BoxBusy

QUEUE_TIMEOUT = 600.0  # a start waits this long in line at most
WAKE_WAIT = 120.0  # a wake, unless $SANDLOT_WAKE_WAIT says otherwise

_line_timeout: ContextVar[float] = ContextVar("sandlot_line_timeout", default=QUEUE_TIMEOUT)


def wake_wait() -> float:
    """How long a wake waits in line: ``$SANDLOT_WAKE_WAIT``, else ``WAKE_WAIT`` seconds."""
    env = os.environ.get("SANDLOT_WAKE_WAIT", "")
    try:
        return max(1.0, float(env)) if env else WAKE_WAIT
    except ValueError:
        return WAKE_WAIT


@contextlib.contextmanager
def waiting_at_most(seconds: float) -> Iterator[None]:
    """Starts within this block (this task and what it awaits) wait this long in line."""
    token = _line_timeout.set(seconds)
    try:
        yield
    finally:
        _line_timeout.reset(token)


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
    async def turn(self, timeout: float | None = None) -> AsyncIterator[float]:
        """Wait for a slot (``timeout`` seconds, else as long as ``waiting_at_most`` says);
        yields the seconds spent waiting."""
        timeout = _line_timeout.get() if timeout is None else timeout
        t0 = time.monotonic()
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout):
                await self._local.acquire()
        except TimeoutError:
            raise self.saturated(timeout) from None
        finally:
            self.waiting -= 1
        try:
            fd = await self._host_slot(t0, timeout)
            try:
                yield time.monotonic() - t0
            finally:
                os.close(fd)
        finally:
            self._local.release()

    def saturated(self, timeout: float) -> BoxBusy:
        return BoxBusy(f"no VM could start within {timeout:.0f}s: the host is saturated "
                       f"({self.slots} start at once; {self.waiting} more wait in this process)")  # fmt: skip

    async def _host_slot(self, t0: float, timeout: float) -> int:
        deadline = t0 + timeout
        self.directory.mkdir(parents=True, exist_ok=True)
        delay = FLOCK_POLL_MIN
        first = os.getpid() % self.slots  # spread the first tries of different processes
        while True:
            for i in range(self.slots):
                fd = try_flock(self.directory / f"slot-{(first + i) % self.slots}.lock")
                if fd is not None:
                    return fd
            if time.monotonic() > deadline:
                raise self.saturated(timeout)
            await asyncio.sleep(delay)
            delay = min(delay * 2, FLOCK_POLL_MAX)
