"""The ``steps`` table: a recorded box's timeline (``core.recorder`` writes it).

One row per step an agent took through sandlot (an exec, a process that ended, a
code cell, a file write, a tool call), numbered from 1 per box, with what ran, how it
ended, and the id of the checkpoint (a snapshot of kind ``step``) of the state the
step left, while it is kept. The rows outlive their checkpoints: retention drops old
checkpoints, not the history of what ran. A box's rows go with its row
(``BoxStore.delete``); a checkpoint's removal clears its step's ``snapshot_id`` in the
same transaction (``BoxStore.delete_snapshot``).

These functions take the store as their first argument, as ``BoxStore``'s methods do,
so that ``AsyncStore.call`` runs them on the store's thread, typed.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidArgument, StepNotFound
from .store import BoxStore


@dataclass(frozen=True, slots=True)
class StepRecord:
    box_id: str
    seq: int
    kind: str  # exec, process, code, files, tool, or a name the caller gave (``box.step``)
    what: dict[str, Any]  # argv, cell or tool call (no secret values: env names only)
    result: dict[str, Any]  # exit_code, signal, error...
    started_at: float
    ended_at: float
    snapshot_id: str | None = None  # the checkpoint of the state it left, while kept
    name: str | None = None  # a named step is kept whatever the retention
    files: dict[str, Any] | None = None  # its diff's summary, once asked for

    @property
    def duration(self) -> float:
        return self.ended_at - self.started_at

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "kind": self.kind, "what": self.what, "result": self.result,
            "started_at": self.started_at, "ended_at": self.ended_at, "duration": round(self.duration, 6),
            "checkpoint": self.snapshot_id, "name": self.name, "files": self.files,
        }  # fmt: skip


def _row(r: sqlite3.Row) -> StepRecord:
    d = dict(r)
    return StepRecord(
        box_id=d["box_id"], seq=d["seq"], kind=d["kind"], what=json.loads(d["what"]),
        result=json.loads(d["result"]), started_at=d["started_at"], ended_at=d["ended_at"],
        snapshot_id=d["snapshot_id"], name=d["name"], files=json.loads(d["files"]) if d["files"] else None,
    )  # fmt: skip


def add_step(store: BoxStore, step: StepRecord) -> StepRecord:
    """Append ``step`` to its box's timeline: its ``seq`` is the next one, whatever it says."""
    with store.transaction() as db:
        last_sql = "SELECT COALESCE(MAX(seq), 0) FROM steps WHERE box_id = ?"
        (last,) = db.execute(last_sql, (step.box_id,)).fetchone()
        db.execute(
            "INSERT INTO steps (box_id, seq, kind, what, result, started_at, ended_at, snapshot_id, name) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (step.box_id, last + 1, step.kind, json.dumps(step.what, default=str),
             json.dumps(step.result, default=str), step.started_at, step.ended_at, step.snapshot_id,
             step.name),
        )  # fmt: skip
    return replace(step, seq=last + 1)


def steps(
    store: BoxStore, box_id: str, *, after: int = 0, before: int | None = None, limit: int | None = None
) -> list[StepRecord]:
    """The box's steps after ``after`` (and before ``before``), oldest first (at most ``limit``)."""
    sql = "SELECT * FROM steps WHERE box_id = ? AND seq > ? AND seq < ? ORDER BY seq"
    args: list[Any] = [box_id, after, before if before is not None else 2**62]
    if limit is not None:
        sql += " LIMIT ?"
        args.append(limit)
    with store.reading() as db:
        return [_row(r) for r in db.execute(sql, args).fetchall()]


def step(store: BoxStore, box_id: str, seq: int) -> StepRecord:
    """Step ``seq`` of the box (StepNotFound if it has none such)."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise InvalidArgument(f"a step is a number from 1, not {seq!r}")
    with store.reading() as db:
        rows = db.execute("SELECT * FROM steps WHERE box_id = ? AND seq = ?", (box_id, seq)).fetchall()
    if not rows:
        raise StepNotFound(f"the box's timeline has no step {seq}")
    return _row(rows[0])


def last_result(store: BoxStore, box_id: str, key: str) -> Any:
    """What the box's last step's result holds under ``key`` (None: no step, or not that)."""
    with store.reading() as db:
        row = db.execute(
            "SELECT result FROM steps WHERE box_id = ? ORDER BY seq DESC LIMIT 1", (box_id,)
        ).fetchone()
    return json.loads(row[0]).get(key) if row else None


def set_files(store: BoxStore, box_id: str, seq: int, files: dict[str, Any]) -> None:
    """Keep the summary of a step's diff, computed once."""
    with store.transaction() as db:
        sql = "UPDATE steps SET files = ? WHERE box_id = ? AND seq = ?"
        db.execute(sql, (json.dumps(files), box_id, seq))


def set_name(store: BoxStore, box_id: str, seq: int, name: str | None) -> StepRecord:
    """Name a step (kept whatever the retention), or take its name back (None)."""
    with store.transaction() as db:
        if name is not None:
            clash = db.execute(
                "SELECT seq FROM steps WHERE box_id = ? AND name = ? AND seq != ?", (box_id, name, seq)
            ).fetchone()
            if clash:
                raise InvalidArgument(f"step {clash[0]} of the box is already named {name!r}")
        cur = db.execute("UPDATE steps SET name = ? WHERE box_id = ? AND seq = ?", (name, box_id, seq))
        if cur.rowcount == 0:
            raise StepNotFound(f"the box's timeline has no step {seq}")
    return step(store, box_id, seq)


def by_name(store: BoxStore, box_id: str, name: str) -> StepRecord:
    with store.reading() as db:
        rows = db.execute("SELECT * FROM steps WHERE box_id = ? AND name = ?", (box_id, name)).fetchall()
    if not rows:
        raise StepNotFound(f"the box's timeline has no step named {name!r}")
    return _row(rows[0])


def expired(
    store: BoxStore, box_id: str, *, keep_last: int | None, older_than: float | None
) -> list[StepRecord]:
    """The steps whose checkpoints retention lets go: those with one, not named, and past
    the last ``keep_last`` or ended before ``older_than`` (a time)."""
    if keep_last is None and older_than is None:
        return []
    with store.reading() as db:
        rows = db.execute(
            "SELECT * FROM steps WHERE box_id = ? AND snapshot_id IS NOT NULL AND name IS NULL "
            "ORDER BY seq DESC",
            (box_id,),
        ).fetchall()
    out = []
    for i, r in enumerate(rows):
        s = _row(r)
        if (keep_last is not None and i >= keep_last) or (older_than is not None and s.ended_at < older_than):
            out.append(s)
    return out
