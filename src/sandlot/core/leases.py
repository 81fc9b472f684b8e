"""Leases: how a server knows that the remote client of a ``with`` block still lives.

A local ``with sandlot.Box(...)`` box is removed when its process dies, since the
store records that process (its holder). A server cannot see its clients' processes,
so a box a remote client makes for a ``with`` block holds a lease instead: the
client renews it while it lives (``api/http.py``'s ``LeaseKeeper``, from a thread of
its own), and a server of the home removes the box once it lapses
(``server/app.py``), and audits why. Leases live in the store, beside the box, so
a server's restart keeps them; a server that starts gives every lease one whole
length from then, so that clients whose renewals failed while no server ran are not
taken for dead.

A lease runs for ``seconds``: the box's own (``lease=`` at creation), else its key's
(``sandlot keys create --lease``), else the server's (``sandlot serve --lease``, 60 s).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from .store import BoxStore

DEFAULT = 60.0
SHORTEST, LONGEST = 10.0, 7 * 24 * 3600.0


@dataclass(frozen=True)
class Lease:
    box_id: str
    seconds: float
    until: float  # the box is removed after this time unless the lease is renewed
    key_id: str | None = None
    key_name: str | None = None
    namespace: str | None = None
    created_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"box": self.box_id, "seconds": self.seconds, "expires_at": self.until}


def check_seconds(seconds: object, what: str = "lease", *, shortest: float = SHORTEST) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise InvalidArgument(f"{what} is a number of seconds, not {seconds!r}")
    if not shortest <= seconds <= LONGEST:
        raise InvalidArgument(f"{what} must be {shortest:.0f} s to {LONGEST:.0f} s, not {seconds}")
    return float(seconds)


def grant(store: BoxStore, box_id: str, seconds: float, *, key_id: str | None = None,
          key_name: str | None = None, namespace: str | None = None,
          shortest: float = SHORTEST) -> Lease:  # fmt: skip
    """Give box ``box_id`` a lease of ``seconds``, from now (``shortest``: the least it may
    be; a lease a client renews is 10 s or more, a timer such as E2B's timeout shorter)."""
    now = time.time()
    seconds = check_seconds(seconds, shortest=shortest)
    lease = Lease(box_id, seconds, now + seconds, key_id, key_name, namespace, now)
    store.put_lease({k: getattr(lease, k) for k in Lease.__dataclass_fields__})
    return lease


def renew(store: BoxStore, box_ids: list[str], *, namespace: str | None = None) -> list[Lease]:
    """Renew the leases of these boxes that have not lapsed (and, with ``namespace``,
    only those of that namespace); the leases renewed."""
    wanted = list(dict.fromkeys(box_ids))
    if namespace is not None:
        wanted = [r["box_id"] for r in store.lease_rows(wanted) if r["namespace"] == namespace]
    if not wanted:
        return []
    return [Lease(**r) for r in store.renew_leases(wanted, time.time())]


def lapsed(store: BoxStore, now: float | None = None) -> list[Lease]:
    """The leases that ran out, oldest first."""
    at = time.time() if now is None else now
    return [Lease(**r) for r in store.lease_rows() if r["until"] < at]


def of(store: BoxStore, box_id: str) -> Lease | None:
    rows = store.lease_rows([box_id])
    return Lease(**rows[0]) if rows else None


def give_time(store: BoxStore) -> int:
    """At a server's start: every lease runs at least one whole length from now."""
    return store.extend_leases(time.time())


def drop(store: BoxStore, box_id: str) -> None:
    store.drop_lease(box_id)
