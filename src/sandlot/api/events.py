"""What happened to the boxes of this host's home: ``sandlot.events``.

Every state change and notable happening of every box is an ``Event`` kept in the
home's store (``core.events``, docs/events.md), whichever process made it: a
script's ``box.stop()``, a ``sandlot serve`` request, the idle watchdog, recovery
after a crash, a command the OOM killer ended. Reading them needs no server.

>>> import sandlot
>>> for event in sandlot.events(since=-3600, follow=False):        # doctest: +SKIP
...     print(event.id, event.kind, event.box_name, event.state, event.by, event.reason or "")
>>> for event in sandlot.events(box="web"):      # waits for each new one  # doctest: +SKIP
...     if event.kind == "crashed":
...         print(event.reason, event.detail["console"])
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

from ..core import events as core_events
from ..core.events import Event, acting_as
from ..core.events import query as check_query
from ..core.runtime import Runtime
from ..core.store import BoxStore
from . import loop
from .local import LocalBackend


async def events_async(
    *,
    box: str | None = None,
    since: float | None = None,
    after: int | None = None,
    follow: bool = True,
    home: str | os.PathLike[str] | None = None,
) -> AsyncIterator[Event]:
    """The events of this host's home, oldest first: ``box``: of that box (id or name,
    a removed one's too); ``since``: from that Unix time (negative: that many seconds
    ago); ``after``: after that event id, as a reader that kept the last ``Event.id``
    it saw goes on. With ``follow`` (the default), each new event as any process
    writes it, until the caller stops iterating."""
    box, since, after = check_query(box, since, after)
    async for ev in LocalBackend.for_home(home).events(box=box, since=since, after=after, follow=follow):
        yield ev


def events(
    *,
    box: str | None = None,
    since: float | None = None,
    after: int | None = None,
    follow: bool = True,
    home: str | os.PathLike[str] | None = None,
) -> Iterator[Event]:
    """``events_async`` as a plain iterator."""
    return loop.iterate(
        events_async(box=box, since=since, after=after, follow=follow, home=home), prefetch=loop.RECORDS_AHEAD
    )


async def record_refusal(reason: str, labels: dict[str, str], *, home: str | os.PathLike[str] | None) -> None:
    """Keep a "quota_refused" event: a request refused by a key's quota (``labels``: the
    key's namespace, so that its own event streams show it)."""
    store = Runtime.for_home(home).db
    await store.add_event(core_events.draft("quota_refused", reason), labels=labels)


async def claim_delivery(target: str, *, home: str | os.PathLike[str] | None) -> int | None:
    """Become the one process of the home delivering events to ``target`` (a webhook's
    URL) unless a live one is: the id of the last event it got (a new target starts
    with the events written from now on), or None."""
    store = Runtime.for_home(home).db
    start = await store.call(BoxStore.last_event_id)
    cursor: int | None = await store.call(BoxStore.claim_delivery, target, start)
    return cursor


async def mark_delivered(target: str, cursor: int, *, home: str | os.PathLike[str] | None) -> None:
    """``target`` got every event up to id ``cursor``."""
    await Runtime.for_home(home).db.call(BoxStore.delivered, target, cursor)


__all__ = [
    "Event", "acting_as", "check_query", "claim_delivery", "events", "events_async", "mark_delivered",
    "record_refusal",
]  # fmt: skip
