"""The fleet's directory: which box lives on which node, in what state, where its
replica is, and which boxes were lost with their node.

One detached actor (``sandlot-directory`` in namespace ``sandlot``) holds it on the
head node and writes it to ``$SANDLOT_HOME/fleet/directory.json`` of that node after
every change, so a restarted actor (Ray restarts it, ``max_restarts=-1``) starts
from what it knew. It is a cache of the truth, not the truth: each node's own store
says what boxes it has, and ``reconcile`` makes the directory agree with the nodes
that answer, so nothing in it claims a box no node has. A dead head node takes the
Ray cluster (its GCS) and the directory with it; the nodes' stores keep their boxes,
and a new head's directory adopts them again from the nodes on first ``list()``.

The class is plain Python (the client wraps it with ``ray.remote``), so its rules
are tested without a cluster.
"""

from __future__ import annotations

import builtins
import copy
import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..config import atomic_write, default_home
from ..errors import BoxNotFound, InvalidArgument

Record = dict[str, Any]
LOST = "lost"
NAME = "sandlot-directory"  # the directory actor's name in the sandlot namespace


def reconcile(
    records: Mapping[str, Record],
    alive: Iterable[str],
    seen: Mapping[str, Iterable[Mapping[str, Any]]],
    now: float,
) -> dict[str, Record]:
    """The directory made to agree with the nodes.

    ``alive``: the sandlot nodes Ray reports alive; ``seen``: what each node that
    answered has (the summaries of its boxes). A box whose node is dead is marked
    ``lost`` with the node and the time it was first found so (its replica, on a
    live node, stays for ``recover``). A box its live node does not have is
    dropped. A box a node has that the directory does not know is adopted, and a
    lost one a node has again (its host came back with its home) is found there.
    A replica on a dead node is forgotten."""
    alive = set(alive)
    out: dict[str, Record] = {}
    for box_id, rec in records.items():
        rec = copy.deepcopy(dict(rec))
        replica = rec.get("replica")
        if replica and replica.get("node") not in alive:
            rec["replica"] = None
        node = rec.get("node")
        if node not in alive:
            if rec.get("state") != LOST:
                rec["lost"] = {"node": node, "at": now, "state": rec.get("state")}
                rec["state"] = LOST
            out[box_id] = rec
            continue
        if node not in seen:  # alive but did not answer: keep what was known
            out[box_id] = rec
            continue
        have = {b["id"]: b for b in seen[node]}
        if box_id not in have:
            continue  # the node no longer has it (removed, or never finished): nothing claims it
        rec.update({k: v for k, v in have[box_id].items() if k not in ("id", "node", "created_at")})
        rec["lost"] = None
        out[box_id] = rec
    for node, boxes in seen.items():
        if node not in alive:
            continue
        for b in boxes:
            known = out.get(b["id"])
            if known is None:
                out[b["id"]] = new_record(b, node, now, adopted=True)
            elif known["state"] == LOST:  # its host came back (as a new Ray node) with its home
                known.update(node=node, state=b.get("state"), lost=None, reservation=None)
    return out


def new_record(summary: Mapping[str, Any], node: str, now: float, **extra: Any) -> Record:
    """A directory record of a box a node reported (its description, ``contract.BoxOut``:
    id, name, labels, state, cpus, memory_mib...)."""
    rec: Record = {
        **{k: v for k, v in summary.items() if k not in ("node", "created_at")},
        "id": summary["id"],
        "name": summary["name"],
        "labels": dict(summary.get("labels") or {}),
        "state": summary.get("state"),
        "cpus": summary.get("cpus"),
        "memory_mib": summary.get("memory_mib"),
        "node": node,
        "reservation": None,
        "replicas": 0,
        "replica": None,
        "lost": None,
        "created_at": summary.get("created_at") or now,
    }
    rec.update(extra)
    return rec


def find(records: Mapping[str, Record], key: str) -> Record:
    """The record of the box with this id, name or unique id prefix."""
    if key in records:
        return records[key]
    by_name = [r for r in records.values() if r["name"] == key]
    if len(by_name) == 1:
        return by_name[0]
    prefixed = [r for r in records.values() if r["id"].startswith(key)] if len(key) >= 4 else []
    if len(by_name) > 1 or len(prefixed) > 1:
        raise InvalidArgument(f"{key!r} names more than one box of the fleet; use its id")
    if prefixed:
        return prefixed[0]
    raise BoxNotFound(f"no box {key!r} in the fleet", box=key)


class Directory:
    """The directory's state and its persistence (the body of the directory actor)."""

    def __init__(self, path: str | None = None) -> None:
        # by default in the home of the node it runs on (the head's)
        self.path = Path(path) if path else default_home() / "fleet" / "directory.json"
        self.records: dict[str, Record] = {}
        if self.path.exists():
            self.records = json.loads(self.path.read_text())["boxes"]

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"version": 1, "boxes": self.records}
        atomic_write(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())

    def all(self) -> builtins.list[Record]:
        return sorted(self.records.values(), key=lambda r: (r.get("created_at") or 0, r["id"]))

    def get(self, key: str) -> Record:
        return find(self.records, key)

    def put(self, rec: Record) -> Record:
        rec = {**self.records.get(rec["id"], {}), **rec, "updated_at": time.time()}
        self.records[rec["id"]] = rec
        self._save()
        return rec

    def update(self, box_id: str, changes: Mapping[str, Any]) -> Record | None:
        if box_id not in self.records:
            return None
        return self.put({**self.records[box_id], **changes})

    def remove(self, box_id: str) -> Record | None:
        rec = self.records.pop(box_id, None)
        self._save()
        return rec

    def reconcile(
        self, alive: builtins.list[str], seen: dict[str, builtins.list[dict[str, Any]]]
    ) -> tuple[builtins.list[Record], builtins.list[str]]:
        """The records after ``reconcile``, and the reservations no box holds any more
        (of boxes dropped or lost), for the caller to give back to Ray."""
        before = self.records
        self.records = reconcile(before, alive, seen, time.time())
        if self.records != before:
            self._save()
        return self.all(), released(before, self.records)

    def release(self, box_id: str) -> builtins.list[str]:
        """Forget a box; the reservations no other box holds."""
        before = dict(self.records)
        self.remove(box_id)
        return released(before, self.records)


def held(records: Mapping[str, Record]) -> set[str]:
    return {r["reservation"] for r in records.values() if r.get("reservation") and r.get("state") != LOST}


def released(before: Mapping[str, Record], after: Mapping[str, Record]) -> builtins.list[str]:
    """Reservations held before and by no box now (a fork's children share one)."""
    return sorted(held(before) - held(after))
