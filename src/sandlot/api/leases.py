"""Leases of the boxes remote ``with`` blocks make (``core/leases.py``), for a home:
what ``sandlot serve`` grants, renews and sweeps.

>>> import tempfile
>>> from sandlot.api import leases
>>> home = tempfile.mkdtemp()
>>> lease = leases.grant("b1", 30, home=home)
>>> [x.box_id for x in leases.renew(["b1", "b2"], home=home)]   # b2 has none
['b1']
>>> leases.lapsed(home=home)
[]
"""

from __future__ import annotations

import os

from ..core import leases
from ..core.leases import DEFAULT, SHORTEST, Lease, check_seconds
from ..core.runtime import Runtime

Home = str | os.PathLike[str] | None


def grant(box_id: str, seconds: float, *, key_id: str | None = None, key_name: str | None = None,
          namespace: str | None = None, home: Home = None, shortest: float = SHORTEST) -> Lease:  # fmt: skip
    """Give a box a lease of ``seconds`` from now, made by a key (its id, name, namespace);
    ``shortest``: the least it may be."""
    return leases.grant(Runtime.for_home(home).store, box_id, seconds, key_id=key_id, key_name=key_name,
                        namespace=namespace, shortest=shortest)  # fmt: skip


def renew(box_ids: list[str], *, namespace: str | None = None, home: Home = None) -> list[Lease]:
    """Renew the leases of these boxes that have not lapsed (of ``namespace``'s boxes only)."""
    return leases.renew(Runtime.for_home(home).store, box_ids, namespace=namespace)


def lapsed(*, home: Home = None) -> list[Lease]:
    """The leases that ran out: their boxes are to be removed."""
    return leases.lapsed(Runtime.for_home(home).store)


def of(box_id: str, *, home: Home = None) -> Lease | None:
    """The lease of a box, if it has one."""
    return leases.of(Runtime.for_home(home).store, box_id)


def give_time(*, home: Home = None) -> int:
    """At a server's start: every lease runs one whole length from now at least."""
    return leases.give_time(Runtime.for_home(home).store)


def drop(box_id: str, *, home: Home = None) -> None:
    """The box no longer has a lease (it is kept until removed)."""
    leases.drop(Runtime.for_home(home).store, box_id)


__all__ = [
    "DEFAULT",
    "SHORTEST",
    "Lease",
    "check_seconds",
    "drop",
    "give_time",
    "grant",
    "lapsed",
    "of",
    "renew",
]
