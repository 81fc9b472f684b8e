"""A namespace's quota of awake boxes (``Quotas.awake``: ``create_key(max_awake=N)``,
``sandlot keys create --max-awake N``).

A box made through ``sandlot serve`` carries the labels of the key that made it (its
id, and its namespace where the key has one). Where that key has an ``awake`` quota,
its namespace (or the key, without one) has at most that many boxes awake (a VM up,
or coming up) at once, however they come up: a start, a resume, a wake on a call or on
traffic through any face (the server's routes, the E2B face, MCP, a port the home's
port keeper holds).

A box coming up past the quota first puts to sleep the namespace's box idle the
longest among those that sleep anyway (``pressure.may_sleep``: an ``idle_timeout`` or
``wake_on_traffic``), never one in use; its ``suspended`` event says ``by: quota``.
Where none can go, the box stays as it was and its start fails with ``QuotaExceeded``
(``limit``: ``awake``); a wake's caller gets it as a 503 with ``Retry-After``, as the
quota frees a place as soon as one of the boxes sleeps or stops.

The boxes of one namespace come up in turn (a file lock of the home per namespace, from
the count until the VM is up), so two wakes at once cannot both take the last place. A
bring-up takes it inside the box's own lock, around the transition that brings the VM
up (once the box is known to come up: a call for a running box counts nothing).
Boxes taken from a pool come up without it (they are up already, in no namespace,
until claimed); they count for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ..config import flock_within
from ..errors import QuotaExceeded
from .access import KEY_LABEL, NAMESPACE_LABEL, quotas_of
from .admission import wake_wait
from .pressure import Boxes, Suspends, least_recently_used, may_sleep, put_to_sleep

if TYPE_CHECKING:
    from .entry import BoxEntry
    from .store import BoxRecord

QUOTA = "quota"  # who the events of a box put to sleep for its namespace's quota say acted
TRIES = 3  # boxes put to sleep for one start at most (one chosen may be used as it goes)


def scope_of(labels: dict[str, str]) -> tuple[str, str, str] | None:
    """(the id of the key that made the box, the label its quota counts by, its value):
    the namespace's where the key has one, else the key's own; None for a box no key made."""
    key_id = labels.get(KEY_LABEL)
    if not key_id:
        return None
    namespace = labels.get(NAMESPACE_LABEL)
    return (key_id, NAMESPACE_LABEL, namespace) if namespace else (key_id, KEY_LABEL, key_id)


@contextlib.asynccontextmanager
async def room_for(ctl: Boxes, saved: Suspends, entry: BoxEntry) -> AsyncIterator[None]:
    """Around a box coming up: its namespace's turn, and a place under its quota of awake
    boxes (another put to sleep for it, where one can go); ``QuotaExceeded`` where none."""
    scope = scope_of(entry.spec.labels)
    quotas = await asyncio.to_thread(quotas_of, ctl.rt.store, scope[0]) if scope else None
    if scope is None or quotas is None or quotas.awake is None:
        yield
        return
    _, label, value = scope
    digest = hashlib.sha256(f"{label}={value}".encode()).hexdigest()[:16]
    lock = ctl.rt.home / "awake" / f"{digest}.lock"
    lock.parent.mkdir(exist_ok=True)
    fd = await flock_within(lock, wake_wait(), f"the turn of the boxes of {_named(label, value)} to come up")
    try:
        await _make_room(ctl, saved, entry, label, value, quotas.awake)
        yield
    finally:
        os.close(fd)


async def _make_room(
    ctl: Boxes, saved: Suspends, entry: BoxEntry, label: str, value: str, quota: int
) -> None:
    from .state import LIVE

    for _ in range(TRIES + 1):
        awake = [
            r
            for r in await ctl.db.list()
            if r.id != entry.id and r.state in LIVE and _counted(r, label, value)
        ]
        if len(awake) < quota:
            return
        sleepers = [r for r in awake if may_sleep(r)]
        chosen = await least_recently_used(ctl, sleepers) if sleepers else None
        if chosen is None:
            break
        rec, idle = chosen
        why = (f"{_named(label, value)} is at its quota of {quota} awake boxes and box {entry.name} "
               f"comes up; idle for {idle:.0f}s, the longest of its boxes that sleep")  # fmt: skip
        await put_to_sleep(ctl, saved, rec, idle, QUOTA, why)
    raise QuotaExceeded(
        f"the quota of awake boxes of {_named(label, value)} is {quota}: {len(awake)} are awake, and none "
        "is idle and able to sleep (an idle_timeout or wake_on_traffic): stop or suspend one",
        limit="awake", value=quota, box=entry.name,
    )  # fmt: skip


def _named(label: str, value: str) -> str:
    return f"namespace {value}" if label == NAMESPACE_LABEL else f"key {value}"


def _counted(rec: BoxRecord, label: str, value: str) -> bool:
    return not rec.options.get("pool") and (rec.options.get("labels") or {}).get(label) == value
