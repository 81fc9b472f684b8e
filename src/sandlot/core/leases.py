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
from .store import BoxStore, insert_row

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
    put_row(store, {k: getattr(lease, k) for k in Lease.__dataclass_fields__})
    return lease


def renew(store: BoxStore, box_ids: list[str], *, namespace: str | None = None) -> list[Lease]:
    """Renew the leases of these boxes that have not lapsed (and, with ``namespace``,
    only those of that namespace); the leases renewed."""
    wanted = list(dict.fromkeys(box_ids))
    if namespace is not None:
        wanted = [r["box_id"] for r in rows(store, wanted) if r["namespace"] == namespace]
    if not wanted:
        return []
    return [Lease(**r) for r in renew_rows(store, wanted, time.time())]


def lapsed(store: BoxStore, now: float | None = None) -> list[Lease]:
    """The leases that ran out, oldest first."""
    at = time.time() if now is None else now
    return [Lease(**r) for r in rows(store) if r["until"] < at]


def of(store: BoxStore, box_id: str) -> Lease | None:
    found = rows(store, [box_id])
    return Lease(**found[0]) if found else None


def give_time(store: BoxStore) -> int:
    """At a server's start: every lease runs at least one whole length from now."""
    return extend_rows(store, time.time())


def drop(store: BoxStore, box_id: str) -> None:
    with store.transaction() as db:
        db.execute("DELETE FROM leases WHERE box_id = ?", (box_id,))


# -- the ``leases`` table: functions that take the store first, as ``BoxStore``'s methods
# do, so that ``AsyncStore.call`` runs them on the store's thread


def put_row(store: BoxStore, row: dict[str, Any]) -> None:
    """Give a box a lease (or replace its lease)."""
    with store.transaction() as db:
        insert_row(db, "leases", row, replace=True)


def rows(store: BoxStore, box_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """The leases of these boxes (of every box: None)."""
    with store.reading() as db:
        if box_ids is None:
            found = db.execute("SELECT * FROM leases ORDER BY until").fetchall()
        else:
            marks = ", ".join("?" for _ in box_ids)
            found = db.execute(f"SELECT * FROM leases WHERE box_id IN ({marks})", box_ids).fetchall()
    return [dict(r) for r in found]


def renew_rows(store: BoxStore, box_ids: list[str], now: float) -> list[dict[str, Any]]:
    """Run the leases of these boxes again from ``now`` (each for its own length),
    unless one has lapsed already; the leases renewed."""
    marks = ", ".join("?" for _ in box_ids)
    with store.transaction(durable=False) as db:  # a lost renewal costs a renewal, not a box
        db.execute(f"UPDATE leases SET until = ? + seconds WHERE until >= ? AND box_id IN ({marks})",
                   [now, now, *box_ids])  # fmt: skip
        found = db.execute(f"SELECT * FROM leases WHERE until >= ? AND box_id IN ({marks})",
                           [now, *box_ids]).fetchall()  # fmt: skip
    return [dict(r) for r in found]


def extend_rows(store: BoxStore, until_at_least: float) -> int:
    """Move every lease that would end before ``until_at_least`` (plus its length) out
    to there: a server that starts gives clients one whole lease to come back."""
    with store.transaction() as db:
        n: int = db.execute("UPDATE leases SET until = ? + seconds WHERE until < ? + seconds",
                            (until_at_least, until_at_least)).rowcount  # fmt: skip
    return n
