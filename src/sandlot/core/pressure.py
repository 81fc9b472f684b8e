"""Sleep under memory pressure: when the host runs short of memory, the home's least
recently used idle box among those that sleep anyway is put to sleep.

A box that sleeps when idle (``idle_timeout``) or wakes on traffic (``wake_on_traffic``)
is one its owner said may sleep and wake: asleep, it holds no host memory, and the next
call or connection wakes it where it was. So when the host's available memory
(``MemAvailable``) falls under the low mark, the home's keeper (``core.keeper``, in its
round every second) suspends such a box ahead of its ``idle_timeout``, one at a time:

- the one idle the longest (the agent's time since its last request), so the memory goes
  to the boxes in use rather than to the kernel's OOM killer, which would pick one of
  them and lose what it held;
- never one in use: a command in flight, an open connection through its ports, a request
  in the last ``MIN_IDLE`` seconds. The suspend is called off if a request comes while it
  starts (``if_idle_for``, as the idle watchdog's);
- its ``suspended`` event says who and why: ``by: memory``, with the figures.

A box that never sleeps (neither option) is left alone, whatever the pressure: its owner
did not say it may pause. Every home of the host has its keeper, so each puts one of its
own boxes to sleep a round while the pressure lasts.

The low mark: ``$SANDLOT_MEMORY_LOW_MIB``, else 5% of the host's memory and at least
256 MiB; 0 turns this off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from ..config import meminfo
from ..errors import SandlotError
from .events import acting_as

if TYPE_CHECKING:
    from .entry import BoxEntry
    from .runtime import Runtime
    from .store import AsyncStore, BoxRecord

log = logging.getLogger("sandlot")

MEMORY = "memory"  # who its events say acted
LOOK_EVERY = 2.0  # seconds between two looks at the host's memory
MIN_IDLE = 2.0  # seconds without a request before a box may be put to sleep so
ASK_TIMEOUT = 5.0  # seconds an agent has to say how idle it is
MiB = 1 << 20


class Boxes(Protocol):
    """What this asks of the controller (``core.controller``, which uses this module)."""

    rt: Runtime

    @property
    def db(self) -> AsyncStore: ...

    async def find(self, key: str) -> BoxEntry: ...

    async def refresh(self, entry: BoxEntry) -> BoxRecord: ...

    async def activity(self, entry: BoxEntry, *, as_is: bool = False) -> tuple[int, float]: ...


class Suspends(Protocol):
    """What this asks of live state: ``LiveState.suspend``."""

    async def suspend(self, entry: BoxEntry, *, if_idle_for: float | None = None) -> None: ...


def low_mark(total: int) -> int:
    """The available memory under which boxes are put to sleep, in bytes (0: never)."""
    env = os.environ.get("SANDLOT_MEMORY_LOW_MIB", "")
    with contextlib.suppress(ValueError):
        if env:
            return max(0, int(float(env) * MiB))
    return max(256 * MiB, total // 20)


def may_sleep(rec: BoxRecord) -> bool:
    """Whether the box runs and its owner said it may sleep (it wakes on its own when used)."""
    from .state import BoxState

    sleeps = rec.options.get("idle_timeout") or rec.options.get("wake_on_traffic")
    return bool(sleeps) and rec.state == BoxState.RUNNING and rec.vm is not None


async def least_recently_used(ctl: Boxes, candidates: list[BoxRecord]) -> tuple[BoxRecord, float] | None:
    """Of the candidates, the one idle the longest with nothing in flight (asked of each
    agent at once), and its idle seconds; None where none is idle for ``MIN_IDLE``."""

    async def idle_of(rec: BoxRecord) -> float | None:
        try:
            entry = await ctl.find(rec.id)
            busy, idle = await asyncio.wait_for(ctl.activity(entry), ASK_TIMEOUT)
        except (SandlotError, TimeoutError):
            return None  # gone, or too slow to answer: not the one to choose now
        return idle if busy == 0 and idle >= MIN_IDLE else None

    idles = await asyncio.gather(*(idle_of(r) for r in candidates))
    found = [(idle, rec) for rec, idle in zip(candidates, idles, strict=True) if idle is not None]
    if not found:
        return None
    idle, rec = max(found, key=lambda pair: pair[0])
    return rec, idle


async def put_to_sleep(ctl: Boxes, saved: Suspends, rec: BoxRecord, idle: float, who: str, why: str) -> bool:
    """Suspend a box chosen as idle for ``idle`` seconds, unless a request came since
    (``if_idle_for``); whether it sleeps now. Its events say ``who`` and ``why``."""
    from .state import BoxState

    try:
        entry = await ctl.find(rec.id)
        entry.session.drop()  # this process's connection is not a user
        with acting_as(who, why):
            await saved.suspend(entry, if_idle_for=min(idle, MIN_IDLE))
        return (await ctl.refresh(entry)).state == BoxState.SUSPENDED
    except Exception as exc:  # called off or failed: its event says so
        log.warning("box %s, put to sleep (%s): %s", rec.name, who, exc)
        return False


class Parts(Protocol):
    """What the keeper's watch asks of the core (``core.service.Core``)."""

    @property
    def controller(self) -> Boxes: ...

    @property
    def live(self) -> Suspends: ...


class MemoryWatch:
    """The keeper's look at the host's memory, and the one box it puts to sleep at a time."""

    def __init__(self, core: Parts) -> None:
        self.core = core
        self.looked = -LOOK_EVERY
        self.sleeping: asyncio.Task[bool] | None = None
        self.read = meminfo  # where the figures come from (a test gives its own)

    async def round(self, boxes: list[BoxRecord]) -> None:

        if self.sleeping is not None and not self.sleeping.done():
            return  # the last one first: what it frees is seen before another goes
        if time.monotonic() - self.looked < LOOK_EVERY:
            return
        self.looked = time.monotonic()
        candidates = [r for r in boxes if may_sleep(r)]
        if not candidates:
            return
        figures = await asyncio.to_thread(self.read)
        available, low = figures.get("MemAvailable"), low_mark(figures.get("MemTotal", 0))
        if available is None or available >= low:
            return
        chosen = await least_recently_used(self.core.controller, candidates)
        if chosen is None:
            return
        rec, idle = chosen
        why = (f"the host's memory is low: {available // MiB} MiB available, under {low // MiB} MiB; "
               f"idle for {idle:.0f}s, the longest of the home's boxes that sleep")  # fmt: skip
        sleeping = put_to_sleep(self.core.controller, self.core.live, rec, idle, MEMORY, why)
        self.sleeping = asyncio.create_task(sleeping)
