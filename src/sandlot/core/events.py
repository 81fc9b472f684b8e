"""What happened to the boxes of a home: one event model for every state change and
notable happening, kept in the store.

Each event is a row of the store's ``events`` table, written in the same
transaction as the change it tells of (a state written through
``BoxController.transition`` or recovery, a box's row removed), so an event is
never lost and never tells of a change that did not happen, whichever process
made it and however it ended. Happenings that change no row (a command killed by
the OOM killer or its timeout, a request refused by a quota) are rows of their
own. Any process reads them from the store: ``follow`` waits for new ones by
watching the store's ``PRAGMA data_version``, never by asking a server.

An event's ``id`` grows with each event of the home, so it is a cursor: a reader
that kept the last id it saw continues after it (``after=``), as an SSE client's
``Last-Event-ID`` does, and a webhook's delivery does after a restart.

``by`` says who did it: the key of a ``sandlot serve`` request, the idle watchdog,
recovery, or else the process (its pid and command line). Code that acts for
someone says so with ``acting_as``.

The events kept are bounded (``sandlot.records``): the home keeps its newest
``SANDLOT_EVENTS_KEEP`` and each box its newest ``SANDLOT_EVENTS_PER_BOX``, the oldest
going first; a box's happenings that change no row draw on its budget
(``SANDLOT_EVENT_RATE``), past which they are folded into one ``records_dropped`` event
with their count. What was dropped is said in the box's events too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import IN_CREATE, IN_MODIFY, IN_MOVED_TO, drain, inotify
from ..errors import InvalidArgument
from .state import Op

FOLLOW_POLL = 0.05  # seconds between two looks at the store's data_version, without inotify
IDLE_LOOK = 1.0  # with inotify: seconds between two looks while nothing is written
COMMIT_LOOK, COMMIT_WAIT = 0.002, 0.5  # after a write: look this often, this long, for its commit
CONSOLE_TAIL = 4096  # bytes of a crashed box's console an event carries

# Every kind of event, and what it tells of. Documented in docs/events.md.
KINDS: dict[str, str] = {
    "created": "a box was made (from an image, a snapshot, a fork or a warm pool)",
    "started": "a box booted, or was started from a saved state",
    "stopped": "a box stopped (detail.killed: it was killed, not shut down)",
    "paused": "a box's VM was paused",
    "unpaused": "a paused box runs again",
    "suspended": "a box's whole state went to disk (by 'idle': the idle watchdog did it)",
    "resumed": "a suspended box runs again",
    "snapshot": "a snapshot of a running box was taken (detail.snapshot)",
    "rolled_back": "a box went back to a snapshot (detail.snapshot)",
    "forked": "a box was forked (detail.children)",
    "network_changed": "a box's network policy changed",
    "crashed": "a box's VM died or failed to start (reason, detail.console: its console's tail)",
    "failed": "an operation failed and the box went back (detail.op, reason)",
    "recovered": "recovery finished or undid the operation of a process that died (detail.action)",
    "removed": "a box was removed",
    "pulled": "a suspended box came to this home from the storage tier (detail.snapshot)",
    "pushed": "a suspended box went to the storage tier (detail.released: it left this home)",
    "command_oom": "the OOM killer ended a process of a command (detail.argv)",
    "command_timeout": "a command ran past its timeout and was killed (detail.argv, detail.timeout)",
    "quota_refused": "a request was refused by a key's quota (reason)",
    "disk_full": "a disk write of the box met a full host filesystem: the guest is stopped with "
    "the write held (detail.free_bytes, detail.needed_bytes), and its commands refused with NoSpace",
    "disk_room": "the host filesystem has room again: the held write went through, and the guest "
    "runs on (detail.held_s)",
    "wake_failed": "a connection to a published port of a box that wakes on traffic could not wake it, "
    "or the home's port keeper could not hold its ports (detail.port, detail.error; reason says why)",
    "records_dropped": "a record of the box reached its bound: what was folded, dropped or refused "
    "(detail.record, detail.folded, detail.dropped, detail.refused; reason says it in words)",
}

# the event an operation's successful end writes (None: none; removal writes its own)
OP_KINDS: dict[Op, str | None] = {
    Op.CREATE: "created",
    Op.START: "started",
    Op.STOP: "stopped",
    Op.DISCARD: "stopped",
    Op.KILL: "stopped",
    Op.PAUSE: "paused",
    Op.UNPAUSE: "unpaused",
    Op.REMOVE: None,
    Op.SNAPSHOT: "snapshot",
    Op.SUSPEND: "suspended",
    Op.RESUME: "resumed",
    Op.ROLLBACK: "rolled_back",
    Op.NETWORK: "network_changed",
    Op.POOL: None,  # a warm pool's VM is no box of anyone's until it is claimed
    Op.CLAIM: "started",
    Op.CRASH: "crashed",
    Op.LOSE: "crashed",
}


@dataclass(frozen=True, slots=True)
class Draft:
    """An event about to be written: the store adds its id, time, box and state."""

    kind: str
    reason: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    by: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to a box (or, for a quota refusal, to a request)."""

    id: int  # grows with each event of the home: a cursor
    at: float  # Unix time
    kind: str  # one of KINDS
    box_id: str | None
    box_name: str | None
    state: str | None  # the box's state right after it (None: the box is gone)
    reason: str | None
    by: str  # who did it: "key NAME", "idle", "recovery", "process PID (COMMAND)"
    detail: dict[str, Any]
    labels: dict[str, str]  # the box's labels then (a server shows a key only its own namespace's)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        try:
            return cls(**{f.name: data[f.name] for f in fields(cls)})
        except (KeyError, TypeError) as exc:
            raise InvalidArgument(f"not an event: {exc}") from None


_ACTOR: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "sandlot_actor", default=None
)
_process_actor: str | None = None


def actor() -> str:
    """Who acts in this context: what ``acting_as`` set, else this process."""
    global _process_actor
    set_by = _ACTOR.get()
    if set_by:
        return set_by[0]
    if _process_actor is None:
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:3]))
        _process_actor = f"process {os.getpid()} ({command[:80] or 'python'})"
    return _process_actor


@contextlib.contextmanager
def acting_as(who: str, why: str | None = None) -> Iterator[None]:
    """Events written in this block (this task and those it starts) say ``who`` did it,
    and ``why`` where they give no reason of their own."""
    token = _ACTOR.set((who, why))
    try:
        yield
    finally:
        _ACTOR.reset(token)


def draft(kind: str, reason: str | None = None, **detail: Any) -> Draft:
    """An event by whoever acts in this context (``actor``)."""
    set_by = _ACTOR.get()
    return Draft(kind, reason or (set_by[1] if set_by else None), detail, actor())


def since_time(since: float | None) -> float | None:
    """``since`` as the events API takes it: a Unix time, or a negative number of seconds
    before now (``-60``: the last minute)."""
    if since is None:
        return None
    if isinstance(since, bool) or not isinstance(since, int | float) or since != since:
        raise InvalidArgument(f"since must be a Unix time or negative seconds, not {since!r}")
    return time.time() + since if since < 0 else float(since)


def check_after(after: int | None) -> int | None:
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
        raise InvalidArgument(f"after must be an event id (an integer >= 0), not {after!r}")
    return after


Query = tuple[str | None, float | None, int | None]


def query(box: str | None, since: float | None, after: int | None) -> Query:
    """An events query's arguments, checked (InvalidArgument), ``since`` as a Unix time."""
    if box is not None and (not isinstance(box, str) or not box or len(box) > 256):
        raise InvalidArgument(f"box must be a box's id or name, not {box!r}")
    return box, since_time(since), check_after(after)


@contextlib.contextmanager
def _wakeups(directory: Path | None) -> Iterator[asyncio.Event | None]:
    """An event set whenever an entry of ``directory`` is written (a store's WAL, on
    every commit of any process), through inotify; None where that cannot be had."""
    fd = inotify(directory, IN_MODIFY | IN_CREATE | IN_MOVED_TO) if directory is not None else None
    if fd is None:
        yield None
        return
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()

    def wake() -> None:
        drain(fd)
        woke.set()

    loop.add_reader(fd, wake)
    try:
        yield woke
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _until_changed(store: Any, version: int | None, woke: asyncio.Event | None) -> None:
    """Until the store's ``data_version`` is no longer ``version``. A write to the WAL
    wakes this before its commit shows (the commit is fsynced first): from a wakeup on,
    it looks every ``COMMIT_LOOK`` seconds for ``COMMIT_WAIT``, then waits again."""
    loop = asyncio.get_running_loop()
    looking_until = 0.0
    while version is not None and store.version() == version:
        if woke is None:
            await asyncio.sleep(FOLLOW_POLL)
        elif loop.time() < looking_until:
            await asyncio.sleep(COMMIT_LOOK)
        else:
            woke.clear()
            try:
                await asyncio.wait_for(woke.wait(), IDLE_LOOK)
                looking_until = loop.time() + COMMIT_WAIT
            except TimeoutError:
                pass


async def follow(
    store: Any,
    *,
    after: int | None = None,
    since: float | None = None,
    box: str | None = None,
    wait: bool = True,
    batch: int = 500,
) -> AsyncIterator[Event]:
    """The events of ``store`` (an ``AsyncStore``) in order, about the box whose id or
    name is ``box`` (or every box): those after event id ``after`` (and from Unix time
    ``since``; every kept one if neither), then, with ``wait``, each new one as any
    process writes it, until the caller stops. A commit wakes it at once where inotify
    watches the store's directory, else it looks every ``FOLLOW_POLL`` seconds."""
    cursor = check_after(after)
    start = since_time(since)
    with _wakeups(store.directory if wait else None) as woke:
        while True:
            version = store.version()
            rows: list[Event] = await store.events(after=cursor, since=start, box=box, limit=batch)
            for ev in rows:
                cursor = ev.id
                yield ev
            if len(rows) == batch:
                continue
            if not wait:
                return
            # the version was read before the query, so a write since then has changed it (a
            # version of None: the store's watcher is not open yet, or cannot be read now)
            await _until_changed(store, version, woke)
            if version is None:
                await asyncio.sleep(FOLLOW_POLL)
