"""A box's row in the state store (``BoxRecord``), and what can be read of the rows
without the store.

``sandlot ls`` is the command scripts run most, and its cost is nearly all the start
of a process: the store (``core.store``) brings the event loop, threads and every
table's code with it. So the rows are decoded here, from a module that imports
neither, and ``settled_boxes`` lists them read-only when nothing about them needs
recovery (a VM that died, an owner that died mid-operation...). Where something does,
or the store's schema is not this code's, it answers None and the caller takes the
store's own path, which recovers, migrates and writes as always.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import pids
from ..pids import VMRef
from .state import BoxState

# The store's schema version (``PRAGMA user_version``: ``core.store.MIGRATIONS``'s
# length): rows of any other are read by the store, which migrates them first.
SCHEMA_VERSION = 17
# The engines whose ``alive`` is ``pids.vm_alive`` (``Engine.alive``, not overridden):
# a quick listing asks it of their rows itself; a row of another engine goes to the store.
PID_ENGINES = frozenset({"qemu", "gvisor"})
JSON_COLUMNS = ("options", "labels", "boot", "ports", "op", "drives", "recording")


@dataclass(frozen=True, slots=True)
class BoxRecord:
    id: str
    name: str
    state: str
    options: dict[str, Any]  # the box's spec (``BoxSpec.to_options``)
    created_at: float
    updated_at: float
    image_ref: str | None = None
    image_digest: str | None = None
    rootfs: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    engine: str = "qemu"
    vm_pid: int | None = None
    vm_start: str | None = None
    owner_pid: int | None = None  # the process running the operation in progress
    owner_start: str | None = None
    ephemeral: bool = False  # removed when its holder dies (a ``with`` block)
    holder_pid: int | None = None  # the process whose ``with`` block holds an ephemeral box
    holder_start: str | None = None
    reason: str | None = None  # why it crashed, or why an operation was undone
    started_at: float | None = None
    stopped_at: float | None = None
    disk: str | None = None  # the top layer of its disk (layers/<id>.qcow2)
    origin: str | None = None  # the snapshot it was started from (fork, template)
    machine_id: str | None = None
    boot: dict[str, Any] = field(default_factory=dict)  # the engine's Boot.record of its VM
    ports: list[list[Any]] = field(default_factory=list)  # published ports as bound: address, host, guest
    suspended: str | None = None  # the snapshot holding its suspended state
    op: dict[str, Any] | None = None  # what an operation in progress needs recovery to know
    # one per named volume it mounts, in its spec's order: {"volume": id, "serial", "top":
    # the layer it writes, "holds": it writes the volume back when it is removed}
    drives: list[dict[str, Any]] = field(default_factory=list)
    # the flight recorder's policy while it records the box (``core.recorder.Policy``)
    recording: dict[str, Any] | None = None

    @property
    def vm(self) -> VMRef | None:
        if self.vm_pid is None or self.vm_start is None:
            return None
        return VMRef(self.vm_pid, self.vm_start)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def box_of_row(r: sqlite3.Row) -> BoxRecord:
    d = dict(r)
    for c in JSON_COLUMNS:
        d[c] = json.loads(d[c]) if d[c] is not None else None
    d["ephemeral"] = bool(d["ephemeral"])
    return BoxRecord(**d)


def pool_vm(rec: BoxRecord) -> bool:
    """A warm pool's VM: no box (yet), so no listing shows it."""
    return bool(rec.options.get("pool"))


def unheld(rec: BoxRecord) -> bool:
    """An ephemeral box (a ``with`` block's) whose holding process is gone."""
    return rec.ephemeral and not pids.alive(rec.holder_pid, rec.holder_start)


def needs_recovery(rec: BoxRecord, vm_alive: Callable[[BoxRecord], bool]) -> bool:
    """Cheap (no QMP): whether recovery (``core.recovery``) could change anything of
    ``rec``. ``vm_alive``: whether the row's VM still lives (its engine's ``alive``)."""
    state = BoxState(rec.state)
    if pool_vm(rec):  # ready while its VM lives; else only while its filler or claimer does
        if state == BoxState.POOLED:
            return not vm_alive(rec)
        return not pids.alive(rec.owner_pid, rec.owner_start)
    owner_alive = pids.alive(rec.owner_pid, rec.owner_start)
    if unheld(rec) and not (state.transient and owner_alive):
        return True
    if state in (BoxState.CREATED, BoxState.STOPPED, BoxState.CRASHED):
        return False
    if state.transient:
        return not owner_alive
    alive = vm_alive(rec)
    return (state == BoxState.SUSPENDED and alive) or (
        state in (BoxState.RUNNING, BoxState.PAUSED) and not alive
    )


def listed(
    rec: BoxRecord, *, include_stopped: bool, state: str | None, labels: Mapping[str, str] | None
) -> bool:
    """Whether a listing of boxes shows ``rec``: never a warm pool's VM; only running or
    paused boxes unless ``include_stopped``; of ``state`` and carrying ``labels``, if given."""
    if pool_vm(rec):
        return False
    if not include_stopped and rec.state not in (BoxState.RUNNING, BoxState.PAUSED):
        return False
    if state is not None and rec.state != state:
        return False
    return not labels or all(rec.labels.get(k) == v for k, v in labels.items())


STORE_FILE = "sandlot.db"


def store_path(home: Path) -> Path:
    """A home's store: every home that ran a VM has one, so a home without it is one
    that was removed (or moved away)."""
    return home / STORE_FILE


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """The store at ``path`` opened read-only, as the store's own class never opens it
    (that one creates, migrates and sweeps). sqlite3.Error where it cannot be read."""
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        yield conn
    finally:
        conn.close()


def recorded_vms(path: Path) -> dict[str, VMRef | None] | None:
    """The VM each box of the store at ``path`` records (box id: its ``VMRef``): another
    sandlot's home is only looked at. None where it cannot be read."""
    try:
        with read_only(path) as db:
            rows = db.execute("SELECT id, vm_pid, vm_start FROM boxes").fetchall()
    except sqlite3.Error:
        return None
    return {str(box): VMRef(int(pid), str(start)) if pid is not None and start else None
            for box, pid, start in rows}  # fmt: skip


def settled_boxes(home: Path) -> list[BoxRecord] | None:
    """Every box row of ``home``'s store, oldest first, read without the store's class:
    no event loop, no write, no migration. None where the store's own path is needed:
    its schema is another version, a row's engine is not in ``PID_ENGINES``, or
    recovery could change a row (``needs_recovery``)."""
    path = store_path(home)
    if not path.exists():
        return []  # a home without a store has no box (the store's path would make it)
    try:
        with read_only(path) as db:
            db.row_factory = sqlite3.Row
            if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                return None
            rows = db.execute("SELECT * FROM boxes ORDER BY created_at").fetchall()
    except sqlite3.Error:
        return None
    records = [box_of_row(r) for r in rows]
    for rec in records:
        if rec.engine not in PID_ENGINES or needs_recovery(rec, lambda r: pids.vm_alive(r.vm, r.id)):
            return None
    return records
