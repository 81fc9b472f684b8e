"""The box registry: one SQLite database (WAL) per sandlot home.

Every box is a row; its disk layers live in ``layers/`` and its logs in
``boxes/<id>/``. A row is the truth about what a box *should* be; the VM
process is the truth about what it *is*. Recovery (``core.recovery``) makes the
two agree after crashes, so a kill -9 of any process at any moment leaves
nothing half-existing.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[n]`` takes a
database from version n to n+1 (SQL, or a function for data that moves), and a
database newer than this code is refused rather than misread.

Only the core writes here, and a box's ``state`` only through
``BoxController.transition`` and recovery.

The schema is one; its tables are kept by the modules that own them, each on this
store's one connection and in its transactions (``BoxStore.transaction``,
``BoxStore.reading``), with functions that take the store first so that
``AsyncStore.call`` runs them on the store's thread, typed:

- ``boxes``, ``snapshots``, ``states``, ``events``, ``records``, ``deliveries``: here
  (``BoxStore``): a box's row, its snapshots and its events change together;
- ``volumes``: ``core.volumes`` (a box's hold on one is written with the box's row, here);
- ``chunks``, ``counters``: ``core.chunks`` (a state counts its chunks with its row, here);
- ``tier_places``: ``core.packs``; ``tier_chunks`` and what a push marks: ``core.remote``;
- ``metrics``: ``core.metrics``; ``steps``: ``core.timeline``;
- ``keys``, ``audit``: ``core.access``; ``previews``: ``core.previews``; ``leases``:
  ``core.leases``.

A box's removal deletes its rows of every table in its own transaction (``delete``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from .. import pids, records
from ..config import free_bytes
from ..errors import (
    BoxNotFound,
    InvalidArgument,
    InvalidState,
    NoSpace,
    SnapshotNotFound,
    StoreBusy,
    StoreError,
    VolumeInUse,
    VolumeNotFound,
    no_space,
)
from ..net.policy import BOX_NAME
from .boxrecord import JSON_COLUMNS, SCHEMA_VERSION, BoxRecord, box_of_row
from .events import Draft, Event
from .events import draft as draft_event
from .manifest import digests_of as manifest_digests
from .state import BORN, BoxState, allowed

# Room the store keeps for itself (BoxStore.hold_room): a file of its own, given up when
# a write finds the filesystem full so that the write is tried again and the rows saying
# how an operation ended are written; made again once the filesystem has room.
# (Never space held through the database's own files: a process that closes a descriptor
# of a SQLite file drops SQLite's POSIX locks on it.)
ROOM_FILE = ".sandlot-room"
ROOM_BYTES = 8 << 20
ROOM_EVERY = 256  # commits between two looks at whether the room can be made again
PRUNE_EVERY = 1000  # events written between two prunes of the oldest past the home's bound
BOX_PRUNE_EVERY = 64  # events of one box written between two prunes of its oldest past its bound

# What one connection to the store has seen committed: (SQLite's ``data_version`` on that
# connection, which moves with every other connection's commit and never with its own;
# how many transactions it has committed itself). Equal stamps mean no connection, this
# one included, committed anything between the two reads.
Stamp = tuple[int, int]


_V2_GENERAL_FACTS = ("memory_mib", "cpus", "ports", "network", "accel")


def _v3(db: sqlite3.Connection) -> None:
    """Engine-neutral VM columns, and the per-operation data that hid in private
    option keys (``_machine_id``, ``_kernel``/``_initrd``/``_accel``, ``_ports``,
    ``_suspend``, ``_op``) moved into columns of their own. Snapshot facts get the
    engine-neutral shape ``{"engine", "memory_mib", "cpus", "agent_ports",
    "network", "accel", "engine_facts": {...}}``."""
    for stmt in (
        "ALTER TABLE boxes RENAME COLUMN qemu_pid TO vm_pid",
        "ALTER TABLE boxes RENAME COLUMN qemu_start TO vm_start",
        "ALTER TABLE boxes ADD COLUMN engine TEXT NOT NULL DEFAULT 'qemu'",
        "ALTER TABLE boxes ADD COLUMN machine_id TEXT",
        "ALTER TABLE boxes ADD COLUMN boot TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE boxes ADD COLUMN ports TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE boxes ADD COLUMN suspended TEXT",
        "ALTER TABLE boxes ADD COLUMN op TEXT",
    ):
        db.execute(stmt)
    private = ("_machine_id", "_kernel", "_initrd", "_accel", "_ports", "_suspend", "_op")
    for box_id, raw in db.execute("SELECT id, options FROM boxes").fetchall():
        opts = json.loads(raw)
        boot = {k: opts[f"_{k}"] for k in ("kernel", "initrd", "accel") if opts.get(f"_{k}")}
        op = opts.get("_op")
        op = {"kind": "rollback", **op} if isinstance(op, dict) else None
        kept = {k: v for k, v in opts.items() if k not in private}
        db.execute(
            "UPDATE boxes SET machine_id = ?, boot = ?, ports = ?, suspended = ?, op = ?, options = ? "
            "WHERE id = ?",
            (opts.get("_machine_id"), json.dumps(boot), json.dumps(opts.get("_ports") or []),
             opts.get("_suspend"), json.dumps(op) if op else None, json.dumps(kept), box_id),
        )  # fmt: skip
    for snap_id, raw in db.execute("SELECT id, options FROM snapshots").fetchall():
        opts = json.loads(raw)
        vm = opts.get("vm") or {}
        if "engine" not in vm:
            opts["vm"] = {
                "engine": "qemu",
                "memory_mib": vm.get("memory_mib"),
                "cpus": vm.get("cpus"),
                "agent_ports": vm.get("ports"),
                "network": bool(vm.get("network")),
                "accel": vm.get("accel"),
                # flat, QEMU's: every fact but the general ones is the engine's
                "engine_facts": {
                    k: vm.get(k) for k in ("machine", "qemu_version", "cpu_model", "kernel", "initrd")
                }
                | {k: v for k, v in vm.items() if k not in _V2_GENERAL_FACTS},
            }
        if isinstance(opts.get("box"), dict):
            opts["box"] = {k: v for k, v in opts["box"].items() if k not in private}
        db.execute("UPDATE snapshots SET options = ? WHERE id = ?", (json.dumps(opts), snap_id))


MIGRATIONS: list[str | Callable[[sqlite3.Connection], None]] = [
    """
    CREATE TABLE boxes (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        state TEXT NOT NULL,
        image_ref TEXT,
        image_digest TEXT,
        rootfs TEXT,
        options TEXT NOT NULL,
        labels TEXT NOT NULL DEFAULT '{}',
        qemu_pid INTEGER,
        qemu_start TEXT,
        owner_pid INTEGER,
        owner_start TEXT,
        ephemeral INTEGER NOT NULL DEFAULT 0,
        reason TEXT,
        created_at REAL NOT NULL,
        started_at REAL,
        stopped_at REAL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX boxes_state ON boxes(state);
    """,
    """
    ALTER TABLE boxes ADD COLUMN disk TEXT;
    ALTER TABLE boxes ADD COLUMN origin TEXT;
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        name TEXT,
        kind TEXT NOT NULL,
        box_id TEXT,
        box_name TEXT,
        layer TEXT NOT NULL,
        options TEXT NOT NULL,
        template_key TEXT,
        size INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL
    );
    CREATE INDEX snapshots_box ON snapshots(box_id);
    CREATE INDEX snapshots_key ON snapshots(template_key);
    """,
    _v3,
    # API keys of ``sandlot serve`` (only a salted scrypt hash of each) and its audit trail
    """
    CREATE TABLE keys (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        namespace TEXT,
        admin INTEGER NOT NULL DEFAULT 0,
        salt BLOB NOT NULL,
        hash BLOB NOT NULL,
        quotas TEXT NOT NULL DEFAULT '{}',
        created_at REAL NOT NULL,
        last_used_at REAL,
        revoked_at REAL
    );
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        key_id TEXT,
        key_name TEXT,
        namespace TEXT,
        action TEXT NOT NULL,
        box TEXT,
        status INTEGER NOT NULL,
        error TEXT,
        duration REAL NOT NULL DEFAULT 0,
        detail TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX audit_at ON audit(at);
    CREATE INDEX audit_box ON audit(box);
    CREATE INDEX audit_key_name ON audit(key_name);
    """,
    # the process whose ``with`` block holds an ephemeral box, apart from the owner (the
    # process running the operation in progress): another process's snapshot of the box
    # no longer makes that process its holder
    """
    ALTER TABLE boxes ADD COLUMN holder_pid INTEGER;
    ALTER TABLE boxes ADD COLUMN holder_start TEXT;
    UPDATE boxes SET holder_pid = owner_pid, holder_start = owner_start WHERE ephemeral = 1;
    """,
    # the preview URLs servers signed: each is checked here on every request, so revoking
    # its key (or it, or removing its box) ends it on every server of the home at once.
    # The leases of the boxes remote clients made for ``with`` blocks: a server removes a
    # box whose lease lapsed (its client died). A key may set how long its leases run.
    """
    CREATE TABLE previews (
        id TEXT PRIMARY KEY,
        box_id TEXT NOT NULL,
        port INTEGER NOT NULL,
        key_id TEXT,
        key_name TEXT,
        namespace TEXT,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        ended_at REAL,
        ended_why TEXT
    );
    CREATE INDEX previews_box ON previews(box_id);
    CREATE INDEX previews_key ON previews(key_id);
    CREATE TABLE leases (
        box_id TEXT PRIMARY KEY,
        seconds REAL NOT NULL,
        until REAL NOT NULL,
        key_id TEXT,
        key_name TEXT,
        namespace TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX leases_until ON leases(until);
    ALTER TABLE keys ADD COLUMN lease REAL;
    """,
    # what happened to the boxes (``core.events``): AUTOINCREMENT, so that an id is never
    # used again after the oldest rows are pruned (ids are cursors). And where each of a
    # server's webhooks got to: the last event delivered, and the process delivering.
    """
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        box_id TEXT,
        box_name TEXT,
        state TEXT,
        reason TEXT,
        by TEXT NOT NULL DEFAULT '',
        detail TEXT NOT NULL DEFAULT '{}',
        labels TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_box ON events(box_id, id);
    CREATE INDEX events_at ON events(at);
    CREATE TABLE deliveries (
        target TEXT PRIMARY KEY,
        cursor INTEGER NOT NULL,
        owner_pid INTEGER,
        owner_start TEXT,
        updated_at REAL NOT NULL
    );
    """,
    # each box's sampled metrics (``core.metrics``): one JSON document a sample; and events
    # found by a box's name as fast as by its id
    """
    CREATE TABLE metrics (
        box_id TEXT NOT NULL,
        at REAL NOT NULL,
        sample TEXT NOT NULL
    );
    CREATE INDEX metrics_box ON metrics(box_id, at);
    CREATE INDEX events_name ON events(box_name, id);
    """,
    # named volumes (``core.volumes``): each is a chain of disk layers whose frozen head is
    # ``layer``; ``holder`` the box that writes it back (``copy`` mode). A box's drives: the
    # top layer of each volume it mounts, with the serial the guest finds it by.
    """
    CREATE TABLE volumes (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        size INTEGER NOT NULL,
        layer TEXT NOT NULL,
        holder TEXT,
        labels TEXT NOT NULL DEFAULT '{}',
        created_at REAL NOT NULL
    );
    ALTER TABLE boxes ADD COLUMN drives TEXT NOT NULL DEFAULT '[]';
    """,
    # 9 -> 10: shared volumes, a directory (``layer``) that boxes share live; no size
    "ALTER TABLE volumes ADD COLUMN kind TEXT NOT NULL DEFAULT 'disk'",
    # 10 -> 11: saved states as content-addressed chunks (``core.chunks``): the manifest of
    # each state saved so (its snapshot's id), and how many states list each chunk
    """
    CREATE TABLE states (
        id TEXT PRIMARY KEY,
        manifest BLOB NOT NULL
    );
    CREATE TABLE chunks (
        digest BLOB PRIMARY KEY,
        refs INTEGER NOT NULL,
        stored INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX chunks_dead ON chunks(refs) WHERE refs <= 0;
    """,
    # 11 -> 12: the object-storage tier (``core.tier``): which chunks and states it holds
    """
    ALTER TABLE chunks ADD COLUMN remote INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE states ADD COLUMN pushed INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX chunks_unpushed ON chunks(remote) WHERE remote = 0;
    """,
    # 12 -> 13: what each box's bounded records folded, dropped and refused (``core.keeper``;
    # box "" for the home's), with what the box's events told of it last; and each box's
    # budget of events (``sandlot.records``: a token bucket), with those it folded since
    """
    CREATE TABLE records (
        box_id TEXT NOT NULL,
        record TEXT NOT NULL,
        counts TEXT NOT NULL DEFAULT '{}',
        told TEXT NOT NULL DEFAULT '{}',
        updated_at REAL NOT NULL,
        PRIMARY KEY (box_id, record)
    );
    CREATE TABLE event_budget (
        box_id TEXT PRIMARY KEY,
        tokens REAL NOT NULL,
        at REAL NOT NULL,
        folded TEXT NOT NULL DEFAULT '{}',
        since REAL
    );
    """,
    # 13 -> 14: the home's running totals (the bytes its storage tier was sent and sent back)
    "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    # 14 -> 15: the flight recorder (``core.recorder``, ``core.timeline``): a box's recording
    # policy, and the steps it recorded, each with the checkpoint of the state it left
    """
    ALTER TABLE boxes ADD COLUMN recording TEXT;
    CREATE TABLE steps (
        box_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        what TEXT NOT NULL,
        result TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL NOT NULL,
        snapshot_id TEXT,
        name TEXT,
        files TEXT,
        PRIMARY KEY (box_id, seq)
    );
    CREATE INDEX steps_snapshot ON steps(snapshot_id) WHERE snapshot_id IS NOT NULL;
    """,
    # 15 -> 16: chunks the storage tier holds that no state of this home lists any more
    # (their rows and files gone): a later state listing one again does not send it again
    "CREATE TABLE tier_chunks (digest BLOB PRIMARY KEY) WITHOUT ROWID",
    # 16 -> 17: where the storage tier keeps each chunk this home sent or pulled in a pack
    # (``core.packs``): its pack's hash, offset and length
    """
    CREATE TABLE tier_places (
        digest BLOB PRIMARY KEY,
        pack BLOB NOT NULL,
        offset INTEGER NOT NULL,
        length INTEGER NOT NULL
    ) WITHOUT ROWID;
    """,
]

SNAPSHOT_KINDS = ("snapshot", "template", "suspend", "step")
NAME_RE = BOX_NAME  # one rule for box names: the egress policy's box entries name boxes by it


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    """A saved running state: a frozen disk layer plus the files in snapshots/<id>/."""

    id: str
    kind: str  # snapshot, template, or the state of a suspended box
    layer: str
    options: dict[str, Any]  # "box": the box's spec, "vm": the facts it loads with, ...
    created_at: float
    name: str | None = None
    box_id: str | None = None
    box_name: str | None = None
    template_key: str | None = None
    size: int = 0

    @property
    def facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = self.options["vm"]
        return facts

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


P = ParamSpec("P")
R = TypeVar("R")


def holder_columns(ephemeral: bool) -> dict[str, Any]:
    """The holder columns of a box this process makes or claims: this process if the box
    is ephemeral (a ``with`` block's), else none."""
    pid, start = pids.me() if ephemeral else (None, None)
    return {"holder_pid": pid, "holder_start": start}


def declared(box_id: str, expect: Sequence[str] | None, state: BoxState | str) -> None:
    """A write of a box's state says which states it expects, and each pair is one the
    table of transitions declares (``core.state.allowed``): else ``InvalidState``."""
    if not expect:
        raise InvalidState(f"box {box_id}: a write of its state ({state}) must say which states it expects",
                           box=box_id, state=str(state))  # fmt: skip
    for before in expect:
        if not allowed(before, state):
            ends = sorted(str(after) for after in BoxState if after != before and allowed(before, after))
            why = f"box {box_id}: no declared transition from {before} to {state} (core/state.py)"
            raise InvalidState(why, box=box_id, state=str(before), allowed=ends)


def _known_to_tier(db: sqlite3.Connection, listed: set[bytes]) -> None:
    """Chunks a new state lists that the tier was known to hold (``tier_chunks``): their
    rows say so again, and the tier's list lets them go."""
    if not db.execute("SELECT 1 FROM tier_chunks LIMIT 1").fetchone():
        return
    rows = [(d,) for d in listed]
    db.executemany(
        "UPDATE chunks SET remote = 1 WHERE digest = ? AND remote = 0 "
        "AND EXISTS (SELECT 1 FROM tier_chunks WHERE digest = chunks.digest)",
        rows,
    )
    db.executemany("DELETE FROM tier_chunks WHERE digest = ?", rows)


def born(rec: BoxRecord) -> None:
    """A box's row is made only in a state the table says a box is born in."""
    if rec.state not in BORN:
        raise InvalidState(f"box {rec.id} cannot be made {rec.state}: only {' or '.join(sorted(BORN))}",
                           box=rec.id, state=str(rec.state), allowed=sorted(BORN))  # fmt: skip


def encoded(changes: dict[str, Any]) -> dict[str, Any]:
    """A row's columns (or changes to them) as SQLite takes them: JSON columns as text
    (a NULL ``op`` stays NULL), ``ephemeral`` as an integer."""
    out = dict(changes)
    for c in JSON_COLUMNS:
        if c in out and not (c == "op" and out[c] is None):
            out[c] = json.dumps(out[c])
    if "ephemeral" in out:
        out["ephemeral"] = int(out["ephemeral"])
    return out


def insert_sql(table: str, columns: Iterable[str], *, replace: bool = False) -> str:
    """An INSERT of one row of ``columns`` into ``table``, by named parameters (``:column``);
    one that replaces a row of the same key, if ``replace``."""
    names = list(columns)
    verb = "INSERT OR REPLACE" if replace else "INSERT"
    return f"{verb} INTO {table} ({', '.join(names)}) VALUES ({', '.join(f':{n}' for n in names)})"


def insert_row(db: sqlite3.Connection, table: str, row: Mapping[str, Any], *, replace: bool = False) -> None:
    """``row`` (column -> value) into ``table``."""
    db.execute(insert_sql(table, row, replace=replace), row)


def _event_row(r: sqlite3.Row) -> Event:
    d = dict(r)
    d["detail"] = json.loads(d["detail"])
    d["labels"] = json.loads(d["labels"])
    return Event(**d)


def _snap_row(r: sqlite3.Row) -> SnapshotRecord:
    d = dict(r)
    d["options"] = json.loads(d["options"])
    return SnapshotRecord(**d)


class BoxStore:
    """Blocking access to ``sandlot.db``; async code goes through ``AsyncStore``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._commits = 0
        self._written = threading.local()  # per thread: the stamp of its last transaction
        self._events_written = 0
        self._box_events: dict[str, int] = {}  # per box: events written since its last prune
        self.bounds = records.bounds()
        # how long a write waits for another process's transaction (SQLite's busy timeout)
        self.busy_timeout = float(os.environ.get("SANDLOT_STORE_BUSY_TIMEOUT", "30"))
        try:
            self._db = sqlite3.connect(path, timeout=self.busy_timeout, isolation_level=None,
                                       check_same_thread=False)  # fmt: skip
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a committed transition survives power loss
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            self.hold_room()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreBusy(f"the state database {path} stayed locked by another process for more "
                                f"than {self.busy_timeout:g}s: try again") from exc  # fmt: skip
            raise StoreError(f"the state database {path} cannot be used: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"the state database {path} cannot be used: {exc}") from exc

    def hold_room(self) -> None:
        """Make the store's room (``ROOM_FILE``) if it is not there and the filesystem has
        plenty: best effort."""
        room = self.path.with_name(ROOM_FILE)
        if room.exists():
            return
        with contextlib.suppress(OSError):
            if free_bytes(self.path.parent) < 8 * ROOM_BYTES:
                return
            tmp = room.with_name(f"{ROOM_FILE}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, ROOM_BYTES)
            finally:
                os.close(fd)
            os.replace(tmp, room)

    def give_room(self) -> bool:
        """Give the store's room back to the filesystem, for a write that found it full to
        be tried again; False if there was none to give."""
        try:
            self.path.with_name(ROOM_FILE).unlink()
        except FileNotFoundError:
            return False
        return True

    def in_room(self, method: Callable[Concatenate[BoxStore, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method(self, *args, **kwargs)`` (``method``: one of this class's, as
        ``BoxStore.update``); should it find the filesystem full, again once the room is
        given back (each method is one transaction, rolled back)."""
        try:
            return method(self, *args, **kwargs)
        except NoSpace:
            if not self.give_room():
                raise
            return method(self, *args, **kwargs)

    def _migrate(self) -> None:
        with self._tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {version}; this sandlot knows up to {SCHEMA_VERSION}: "
                    "upgrade sandlot"
                )
            for v in range(version, SCHEMA_VERSION):
                step = MIGRATIONS[v]
                if callable(step):
                    step(db)
                else:
                    for stmt in step.split(";"):
                        if stmt.strip():
                            db.execute(stmt)
                db.execute(f"PRAGMA user_version={v + 1}")

    @contextmanager
    def _tx(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction (BEGIN IMMEDIATE: writers queue up instead of failing).
        ``durable=False``: its commit is not fsynced (WAL with synchronous=NORMAL: it
        survives a crash of any process, not a power loss), for rows a power loss
        makes moot anyway (a warm pool's claim: its VM dies with the host)."""
        with self._reading():
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    # read while this transaction holds the write lock: no other commit can
                    # come between this and ours, so the stamp names what its rows reflect
                    others = self._db.execute("PRAGMA data_version").fetchone()[0]
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # a COMMIT that failed (a full disk) leaves it open
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
                self._commits += 1
                self._written.stamp = (others, self._commits)
                if self._commits % ROOM_EVERY == 0:
                    self.hold_room()
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def transaction(self, *, durable: bool = True) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One transaction (``_tx``), for the modules that own a table of their own
        (``core.timeline``, ``core.access``, ``core.previews``, ``core.leases``): as this
        class's methods write theirs."""
        return self._tx(durable=durable)

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """This connection, held for reads (``_reading``), for the same modules."""
        with self._reading():
            yield self._db

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """This connection, to itself: a lock another process held past the busy timeout
        (``SANDLOT_STORE_BUSY_TIMEOUT``, 30 s) is StoreBusy, not SQLite's own error."""
        with self._lock:
            try:
                yield
            except sqlite3.OperationalError as exc:
                if "full" in str(exc):  # SQLITE_FULL: the filesystem, as a home's limit is
                    raise no_space(self.path.parent, f"the state database {self.path} cannot grow") from exc
                if "locked" in str(exc) or "busy" in str(exc):
                    raise StoreBusy(
                        f"the state database {self.path} stayed locked by another process for more than "
                        f"{self.busy_timeout:g}s; nothing was changed: try again"
                    ) from exc
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def stamp(self) -> Stamp | None:
        """The store's ``Stamp`` now, read without waiting: None while this connection is
        in use on another thread, or another process holds the database in a way that
        a reader would have to wait for."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._db.execute("PRAGMA busy_timeout = 0")
            try:
                others: int = self._db.execute("PRAGMA data_version").fetchone()[0]
            finally:
                self._db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        except sqlite3.Error:
            return None
        finally:
            self._lock.release()
        return others, self._commits

    def written(self) -> Stamp | None:
        """The stamp of the last transaction this thread committed: the rows it wrote or
        read in it are current for as long as ``stamp()`` equals this."""
        found: Stamp | None = getattr(self._written, "stamp", None)
        return found

    def watcher(self) -> sqlite3.Connection:
        """A read-only connection of its own, for ``PRAGMA data_version``: in WAL mode a
        reader never waits for a writer, and a zero timeout makes it fail rather than wait."""
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=0, isolation_level=None,
                             check_same_thread=False)  # fmt: skip
        db.execute("PRAGMA data_version").fetchone()
        return db

    # -- boxes ---------------------------------------------------------------------------

    def insert(self, rec: BoxRecord, *, event: Draft | None = None) -> BoxRecord:
        born(rec)
        d = encoded(rec.to_json())
        try:
            with self._tx() as db:
                insert_row(db, "boxes", d)
                self._hold_volumes(db, rec)
                if event is not None:
                    self._write_events(db, rec, [event])
        except sqlite3.IntegrityError as exc:
            if "name" in str(exc):
                raise InvalidArgument(f"a box named {rec.name!r} already exists") from None
            raise
        return rec

    def get(self, key: str) -> BoxRecord:
        """By exact id, exact name, or an unambiguous id prefix (at least 4 characters)."""
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"a box id or name is needed, not {key!r}")
        with self._reading():
            row = self._db.execute("SELECT * FROM boxes WHERE id = ? OR name = ?", (key, key)).fetchone()
            if row is None and len(key) >= 4 and re.fullmatch(r"[0-9a-f]+", key):
                rows = self._db.execute("SELECT * FROM boxes WHERE id LIKE ?", (key + "%",)).fetchall()
                if len(rows) > 1:
                    raise InvalidArgument(f"box id prefix {key!r} is ambiguous")
                row = rows[0] if rows else None
        if row is None:
            raise BoxNotFound(f"no box {key!r}", box=key)
        return box_of_row(row)

    def find(self, key: str) -> BoxRecord | None:
        try:
            return self.get(key)
        except BoxNotFound:
            return None

    def list(self) -> builtins.list[BoxRecord]:
        with self._reading():
            rows = self._db.execute("SELECT * FROM boxes ORDER BY created_at").fetchall()
        return [box_of_row(r) for r in rows]

    def update(
        self,
        /,
        box_id: str,
        *,
        expect: tuple[str, ...] | None = None,
        expect_pid: int | None = None,
        durable: bool = True,
        event: Draft | Sequence[Draft] | None = None,
        **changes: Any,
    ) -> BoxRecord | None:
        """Change a row; with ``expect``, only if its state is one of those, and with
        ``expect_pid`` only if that is its VM's pid (else None: someone else moved it).
        ``durable=False``: not fsynced (see ``_tx``). ``event``: what the change tells
        of, written in the same transaction (``core.events``)."""
        if "state" in changes:
            declared(box_id, expect, changes["state"])
        changes["updated_at"] = time.time()
        enc = encoded(changes)
        sets = ", ".join(f"{k} = :{k}" for k in enc)
        where = "id = :_id"
        params = {**enc, "_id": box_id}
        if expect:
            where += " AND state IN (" + ", ".join(f":_s{i}" for i in range(len(expect))) + ")"
            params.update({f"_s{i}": str(s) for i, s in enumerate(expect)})
        if expect_pid is not None:
            where += " AND vm_pid = :_pid"
            params["_pid"] = expect_pid
        try:
            with self._tx(durable=durable) as db:
                cur = db.execute(f"UPDATE boxes SET {sets} WHERE {where}", params)
                if cur.rowcount == 0:
                    return None
                row = db.execute("SELECT * FROM boxes WHERE id = ?", (box_id,)).fetchone()
                if "drives" in changes:
                    self._hold_volumes(db, box_of_row(row))
                if event is not None:
                    self._write_events(db, box_of_row(row), [event] if isinstance(event, Draft) else event)
        except sqlite3.IntegrityError as exc:
            if "name" in str(exc):  # a claimed pool VM takes the box's name
                raise InvalidArgument(f"a box named {changes.get('name')!r} already exists") from None
            raise
        return box_of_row(row)

    def template_pool(
        self, key: str, *, by_id: bool, skip: Collection[str] = (), limit: int | None = None
    ) -> tuple[SnapshotRecord | None, builtins.list[BoxRecord]]:
        """A snapshot (by id, else as ``get_snapshot`` finds it) and, if it is a template,
        the ready VMs of its pool (``pooled``): what a claim reads first, in one call."""
        snap = self.find_snapshot(key) if by_id else self.get_snapshot(key)
        if snap is None or snap.kind != "template":
            return snap, []
        return snap, self.pooled(snap.id, skip=skip, limit=limit)

    def pooled(
        self, template_id: str, *, skip: Collection[str] = (), limit: int | None = None
    ) -> builtins.list[BoxRecord]:
        """The ready VMs of a template's warm pool, oldest first (``core.pools``): those
        not in ``skip``, ``limit`` of them at most (a claim decodes only the rows it may
        take, whatever the pool's size)."""
        sql = (
            "SELECT * FROM boxes WHERE state = 'pooled' AND origin = ?"
            " AND json_extract(options, '$.pool') = ?"
        )
        params: list[Any] = [template_id, template_id]
        if skip:
            sql += f" AND id NOT IN ({', '.join('?' * len(skip))})"
            params += list(skip)
        sql += " ORDER BY created_at"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        with self._reading():
            rows = self._db.execute(sql, params).fetchall()
        return [box_of_row(r) for r in rows]

    def delete(self, box_id: str, *, event: Draft | None = None) -> None:
        """Delete a box's row, writing a "removed" event (by ``event.by``, with its
        reason and detail, and the state it was in) if there was one."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM boxes WHERE id = ?", (box_id,)).fetchone()
            if row is not None:
                rec = box_of_row(row)
                said = event or Draft("removed")
                removed = replace(said, kind="removed", detail={"was": rec.state, **said.detail})
                self._write_events(db, replace(rec, state=""), [removed])
                self._release_volumes(db, rec)
            db.execute("DELETE FROM boxes WHERE id = ?", (box_id,))
            db.execute("DELETE FROM leases WHERE box_id = ?", (box_id,))
            db.execute("DELETE FROM metrics WHERE box_id = ?", (box_id,))
            db.execute("DELETE FROM records WHERE box_id = ?", (box_id,))
            db.execute("DELETE FROM event_budget WHERE box_id = ?", (box_id,))
            db.execute("DELETE FROM steps WHERE box_id = ?", (box_id,))
            self._box_events.pop(box_id, None)
            db.execute(
                "UPDATE previews SET ended_at = ?, ended_why = 'its box was removed' "
                "WHERE box_id = ? AND ended_at IS NULL",
                (time.time(), box_id),
            )

    # -- named volumes (``core.volumes``) -----------------------------------------------------

    def _hold_volumes(self, db: sqlite3.Connection, rec: BoxRecord) -> None:
        """Make ``rec`` the writer of the volumes it holds, in the transaction that inserts
        it; refused while another box that still exists writes one."""
        for d in rec.drives:
            if not d.get("holds"):
                continue
            row = db.execute("SELECT name, holder FROM volumes WHERE id = ?", (d["volume"],)).fetchone()
            if row is None:
                raise VolumeNotFound(f"no volume {d['volume']!r} (removed meanwhile?)")
            holder = row["holder"]
            other = db.execute("SELECT name FROM boxes WHERE id = ?", (holder or "",)).fetchone()
            if other is not None and holder != rec.id:
                raise VolumeInUse(
                    f"volume {row['name']!r} is mounted in copy mode by box {other['name']}, which writes it "
                    "back when it is removed: one box at a time does; mount it 'ro', or fork that box",
                    boxes=[other["name"]],
                )
            db.execute("UPDATE volumes SET holder = ? WHERE id = ?", (rec.id, d["volume"]))

    @staticmethod
    def _release_volumes(db: sqlite3.Connection, rec: BoxRecord) -> None:
        """A removed box's volumes in ``copy`` mode keep what it wrote: each one's head
        becomes the box's top layer (its disk, frozen from now on), in the transaction
        that deletes the box. A top that was never made leaves the head as it was."""
        for d in rec.drives:
            if d.get("holds") and d.get("top") and os.path.exists(d["top"]):
                db.execute(
                    "UPDATE volumes SET layer = ?, holder = NULL WHERE id = ? AND holder = ?",
                    (d["top"], d["volume"], rec.id),
                )

    def volume_layers(self) -> builtins.list[Path]:
        """The head of every volume made of layers (each keeps its chain)."""
        with self._reading():
            rows = self._db.execute("SELECT layer FROM volumes WHERE kind = 'disk'").fetchall()
        return [Path(r[0]) for r in rows]

    def children(self, snap_id: str) -> builtins.list[BoxRecord]:
        with self._reading():
            rows = self._db.execute("SELECT * FROM boxes WHERE origin = ?", (snap_id,)).fetchall()
        return [box_of_row(r) for r in rows]

    # -- events (``core.events``) ------------------------------------------------------------

    def _write_events(self, db: sqlite3.Connection, rec: BoxRecord, drafts: Sequence[Draft]) -> None:
        """Write ``drafts`` about ``rec`` (its row as the change left it; state "" once it is
        gone). A warm pool's VM is no box of anyone's until claimed: nothing is written."""
        if rec.options.get("pool"):
            return
        for d in drafts:
            self._insert_event(db, d, rec.id, rec.name, rec.state or None, rec.labels)

    def _insert_event(self, db: sqlite3.Connection, d: Draft, box_id: str | None, box_name: str | None,
                      state: str | None, labels: dict[str, str], *, prune: bool = True) -> None:  # fmt: skip
        db.execute(
            "INSERT INTO events (at, kind, box_id, box_name, state, reason, by, detail, labels) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time(), d.kind, box_id, box_name, state, d.reason, d.by, json.dumps(d.detail),
             json.dumps(labels)),
        )  # fmt: skip
        if not prune:
            return
        self._events_written += 1
        if self._events_written >= PRUNE_EVERY:
            self._events_written = 0
            gone = db.execute(
                "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (self.bounds.events_keep,)
            ).rowcount
            self._count_records(db, "", "events", {"dropped": gone})
        if box_id is not None:
            written = self._box_events[box_id] = self._box_events.get(box_id, 0) + 1
            if written >= BOX_PRUNE_EVERY:
                self._box_events[box_id] = 0
                self._prune_box_events(db, box_id, box_name, state, labels)

    def _prune_box_events(self, db: sqlite3.Connection, box_id: str, box_name: str | None,
                          state: str | None, labels: dict[str, str]) -> None:  # fmt: skip
        """Drop a box's oldest events past its bound, and say so in an event of the box."""
        keep = self.bounds.events_per_box
        gone = db.execute(
            "DELETE FROM events WHERE box_id = ? AND id <= (SELECT id FROM events WHERE box_id = ? "
            "ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (box_id, box_id, keep),
        ).rowcount
        if gone > 0:
            self._count_records(db, box_id, "events", {"dropped": gone})
            why = f"dropped the {gone:,} oldest events of this box: it keeps its newest {keep:,}"
            told = Draft("records_dropped", why + " (SANDLOT_EVENTS_PER_BOX)",
                         {"record": "events", "dropped": gone}, "sandlot")  # fmt: skip
            self._insert_event(db, told, box_id, box_name, state, labels, prune=False)

    def add_event(
        self, event: Draft, box_id: str | None = None, labels: dict[str, str] | None = None
    ) -> bool:
        """Write an event that changes no row (a command killed by the OOM killer, a
        refused request): about ``box_id``'s box as it is now, if given and there, else
        with ``labels`` (a refused request's namespace). A box's such events draw on its
        budget (``SANDLOT_EVENT_RATE``): past it, the event is folded into a count that,
        a ``FOLD_WINDOW`` after the first it holds, the box's next event or
        ``flush_event_folds`` tells as one ``records_dropped`` event. False: folded."""
        with self._tx(durable=False) as db:
            row = db.execute("SELECT * FROM boxes WHERE id = ?", (box_id,)).fetchone() if box_id else None
            if row is None:
                self._insert_event(db, event, box_id, None, None, labels or {})
                return True
            rec = box_of_row(row)
            if not self._spend_event(db, rec, event.kind):
                return False
            self._write_events(db, rec, [event])
            return True

    def _spend_event(self, db: sqlite3.Connection, rec: BoxRecord, kind: str) -> bool:
        """Take one of the box's event budget, telling first what it folded, once it began
        folding a ``FOLD_WINDOW`` ago (so that a box folding all the time is told once a
        window, not once a token); else fold an event of ``kind`` (False)."""
        rate, now = self.bounds.events, time.time()
        if not rate.limited or rec.options.get("pool"):
            return True
        row = db.execute("SELECT * FROM event_budget WHERE box_id = ?", (rec.id,)).fetchone()
        bucket = records.Bucket(row["tokens"], row["at"]) if row else records.Bucket.full(rate, now)
        folded: dict[str, int] = json.loads(row["folded"]) if row else {}
        since = row["since"] if row else None
        took = bucket.take(rate, now)
        if took and folded and now - (since or now) >= records.FOLD_WINDOW:
            self._tell_folded(db, rec, folded, since, now)
            folded, since = {}, None
        elif not took:
            folded[kind] = folded.get(kind, 0) + 1
            since = since or now
            self._count_records(db, rec.id, "events", {"folded": 1})
        db.execute(
            "INSERT OR REPLACE INTO event_budget (box_id, tokens, at, folded, since) VALUES (?, ?, ?, ?, ?)",
            (rec.id, bucket.tokens, bucket.at, json.dumps(folded), since),
        )
        return took

    def _tell_folded(self, db: sqlite3.Connection, rec: BoxRecord, folded: dict[str, int],
                     since: float | None, now: float) -> None:  # fmt: skip
        total = sum(folded.values())
        kinds = ", ".join(f"{n:,} {k}" for k, n in sorted(folded.items()))
        seconds = max(1.0, now - (since or now))
        rate = self.bounds.events
        told = Draft("records_dropped",
                     f"folded {total:,} events of this box in the last {seconds:.0f} s ({kinds}): more than "
                     f"{rate.per_s:g} a second (SANDLOT_EVENT_RATE)",
                     {"record": "events", "folded": total, "kinds": folded, "since": since},
                     "sandlot")  # fmt: skip
        self._write_events(db, rec, [told])

    def flush_event_folds(self, older_than: float = records.FOLD_WINDOW) -> int:
        """Tell the events each box folded, where it began folding them ``older_than``
        seconds ago (the keeper's round: a box that went quiet still hears of them); how
        many boxes were told."""
        now = time.time()
        told = 0
        with self._tx(durable=False) as db:
            rows = db.execute("SELECT * FROM event_budget WHERE folded != '{}' AND since < ?",
                              (now - older_than,)).fetchall()  # fmt: skip
            for b in rows:
                box = db.execute("SELECT * FROM boxes WHERE id = ?", (b["box_id"],)).fetchone()
                if box is not None:
                    self._tell_folded(db, box_of_row(box), json.loads(b["folded"]), b["since"], now)
                    told += 1
                db.execute(
                    "UPDATE event_budget SET folded = '{}', since = NULL WHERE box_id = ?", (b["box_id"],)
                )
        return told

    # -- bounded records (``core.keeper``) ---------------------------------------------------

    def _count_records(self, db: sqlite3.Connection, box_id: str, record: str, add: dict[str, int]) -> None:
        add = {k: n for k, n in add.items() if n > 0}
        if not add:
            return
        row = db.execute(
            "SELECT counts FROM records WHERE box_id = ? AND record = ?", (box_id, record)
        ).fetchone()
        counts: dict[str, int] = json.loads(row[0]) if row else {}
        for k, n in add.items():
            counts[k] = counts.get(k, 0) + n
        db.execute(
            "INSERT INTO records (box_id, record, counts, updated_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (box_id, record) DO UPDATE SET counts = excluded.counts, "
            "updated_at = excluded.updated_at",
            (box_id, record, json.dumps(counts), time.time()),
        )

    def note_records(
        self, box_id: str, record: str, counts: dict[str, int], event: Draft | None = None
    ) -> None:
        """A record's counts as its keeper reads them now (cumulative); with ``event``,
        the box's event that tells of them, written in the same transaction, after which
        they are what the box was told."""
        with self._tx(durable=False) as db:
            box = db.execute("SELECT * FROM boxes WHERE id = ?", (box_id,)).fetchone()
            if box is None:
                return
            told = json.dumps(counts) if event is not None else None
            db.execute(
                "INSERT INTO records (box_id, record, counts, told, updated_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (box_id, record) DO UPDATE SET counts = excluded.counts, "
                "told = COALESCE(?, told), updated_at = excluded.updated_at",
                (box_id, record, json.dumps(counts), told or "{}", time.time(), told),
            )
            if event is not None:
                self._write_events(db, box_of_row(box), [event])

    def records(self, box_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        """Each box's records (box id, "" for the home's: record: ``{"counts", "told"}``)."""
        sql, args = "SELECT * FROM records", builtins.list[str]()
        if box_id is not None:
            sql, args = sql + " WHERE box_id = ?", [box_id]
        with self._reading():
            rows = self._db.execute(sql, args).fetchall()
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for r in rows:
            out.setdefault(r["box_id"], {})[r["record"]] = {"counts": json.loads(r["counts"]),
                                                            "told": json.loads(r["told"])}  # fmt: skip
        return out

    def events(
        self,
        *,
        after: int | None = None,
        since: float | None = None,
        box: str | None = None,
        limit: int = 1000,
    ) -> builtins.list[Event]:
        """Kept events in order: after event id ``after``, at or after Unix time ``since``,
        about the box whose id or name is ``box``; at most ``limit``."""
        where, params = ["1"], builtins.list[Any]()
        if after is not None:
            where.append("id > ?")
            params.append(after)
        if since is not None:
            where.append("at >= ?")
            params.append(since)
        if box is not None:
            where.append("(box_id = ? OR box_name = ?)")
            params += [box, box]
        sql = f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY id LIMIT ?"
        with self._reading():
            rows = self._db.execute(sql, (*params, limit)).fetchall()
        return [_event_row(r) for r in rows]

    def claim_delivery(self, target: str, start_at: int) -> int | None:
        """Become the one process delivering events to ``target`` (a webhook's URL),
        unless a live process is; the cursor to deliver after (a new target starts
        after ``start_at``), or None."""
        me, my_start = pids.me()
        with self._tx() as db:
            row = db.execute("SELECT * FROM deliveries WHERE target = ?", (target,)).fetchone()
            if row is None:
                db.execute("INSERT INTO deliveries VALUES (?, ?, ?, ?, ?)",
                           (target, start_at, me, my_start, time.time()))  # fmt: skip
                return start_at
            held = (row["owner_pid"], row["owner_start"])
            if held != (me, my_start) and pids.alive(*held):
                return None
            db.execute("UPDATE deliveries SET owner_pid = ?, owner_start = ? WHERE target = ?",
                       (me, my_start, target))  # fmt: skip
            return int(row["cursor"])

    def delivered(self, target: str, cursor: int) -> None:
        """``target`` got every event up to id ``cursor``."""
        me, my_start = pids.me()
        with self._tx(durable=False) as db:
            db.execute(
                "UPDATE deliveries SET cursor = ?, updated_at = ? "
                "WHERE target = ? AND owner_pid = ? AND owner_start = ? AND cursor < ?",
                (cursor, time.time(), target, me, my_start, cursor),
            )

    def last_event_id(self) -> int:
        with self._reading():
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return int(row[0]) if row else 0

    # -- snapshots ------------------------------------------------------------------------

    def insert_snapshot(
        self,
        rec: SnapshotRecord,
        *,
        manifest: bytes | None = None,
        stored: dict[bytes, int] | None = None,
        remote: bool = False,
    ) -> SnapshotRecord:
        """Add a snapshot's row; with ``manifest`` (a state saved as chunks), its manifest
        too, and one more state counted for each chunk it lists (``stored``: the size
        of each in the chunk store), all in one transaction. ``remote``: a state pulled
        from the storage tier, which holds its chunks (and the state)."""
        d = rec.to_json()
        d["options"] = json.dumps(d["options"])
        with self._tx() as db:
            if rec.name is not None and rec.kind != "suspend":
                clash = db.execute(
                    "SELECT id FROM snapshots WHERE name = ? AND kind = ? AND box_id IS ?",
                    (rec.name, rec.kind, rec.box_id),
                ).fetchone()
                if clash:
                    owner = f"box {rec.box_name}" if rec.box_id else "this home"
                    raise InvalidArgument(f"{owner} already has a {rec.kind} named {rec.name!r}")
            insert_row(db, "snapshots", d)
            if manifest is not None:
                db.execute(
                    "INSERT INTO states (id, manifest, pushed) VALUES (?, ?, ?)", (rec.id, manifest, remote)
                )
                sizes = stored or {}
                listed = set(manifest_digests(manifest))
                db.executemany(
                    "INSERT INTO chunks (digest, refs, stored, remote) VALUES (?, 1, ?, ?) "
                    "ON CONFLICT(digest) DO UPDATE SET refs = refs + 1,"
                    " remote = MAX(remote, excluded.remote)",
                    [(dg, sizes.get(dg, 0), int(remote)) for dg in listed],
                )
                _known_to_tier(db, listed)
        return rec

    def snapshots(
        self, *, box_id: str | None = None, kind: str | None = None
    ) -> builtins.list[SnapshotRecord]:
        sql, args = "SELECT * FROM snapshots WHERE 1=1", []
        if box_id is not None:
            sql += " AND box_id = ?"
            args.append(box_id)
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        with self._reading():
            rows = self._db.execute(sql + " ORDER BY created_at", args).fetchall()
        return [_snap_row(r) for r in rows]

    def find_snapshot(self, snap_id: str) -> SnapshotRecord | None:
        with self._reading():
            row = self._db.execute("SELECT * FROM snapshots WHERE id = ?", (snap_id,)).fetchone()
        return _snap_row(row) if row else None

    def get_snapshot(self, key: str, *, box_id: str | None = None) -> SnapshotRecord:
        """By id, unambiguous id prefix, or name (of that box's snapshots, or a template)."""
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"a snapshot id or name is needed, not {key!r}")
        with self._reading():
            rows = self._db.execute(
                "SELECT * FROM snapshots WHERE id = ? AND kind != 'suspend'", (key,)
            ).fetchall()
            if not rows:
                q = "SELECT * FROM snapshots WHERE name = ? AND kind != 'suspend'"
                args: builtins.list[Any] = [key]
                if box_id is not None:
                    q += " AND (box_id = ? OR kind = 'template')"
                    args.append(box_id)
                rows = self._db.execute(q, args).fetchall()
            if not rows and len(key) >= 4 and re.fullmatch(r"[0-9a-f]+", key):
                rows = self._db.execute(
                    "SELECT * FROM snapshots WHERE id LIKE ? AND kind != 'suspend'", (key + "%",)
                ).fetchall()
        if not rows:
            raise SnapshotNotFound(f"no snapshot {key!r}")
        if len(rows) > 1:
            owners = ", ".join(sorted({str(dict(r)["box_name"]) for r in rows}))
            raise InvalidArgument(f"snapshot {key!r} is ambiguous (boxes {owners}): use its id")
        return _snap_row(rows[0])

    def update_snapshot(self, /, snap_id: str, **changes: Any) -> None:
        if "options" in changes:
            changes["options"] = json.dumps(changes["options"])
        sets = ", ".join(f"{k} = :{k}" for k in changes)
        with self._tx() as db:
            db.execute(f"UPDATE snapshots SET {sets} WHERE id = :_id", {**changes, "_id": snap_id})

    def delete_snapshot(self, snap_id: str) -> None:
        """Delete a snapshot's row and, for a state saved as chunks, its manifest, with one
        state fewer counted for each chunk it listed (``chunks.ChunkStore.collect`` then
        deletes those no state lists)."""
        with self._tx() as db:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snap_id,))
            db.execute("UPDATE steps SET snapshot_id = NULL WHERE snapshot_id = ?", (snap_id,))
            row = db.execute("DELETE FROM states WHERE id = ? RETURNING manifest", (snap_id,)).fetchone()
            if row is not None:
                db.executemany(
                    "UPDATE chunks SET refs = refs - 1 WHERE digest = ?",
                    [(dg,) for dg in set(manifest_digests(row[0]))],
                )

    def adopt(self, box: BoxRecord, snap: SnapshotRecord, manifest: bytes) -> None:
        """A suspended box another home pushed to the storage tier, made this home's in one
        transaction: its row, its state's row and manifest (the tier holds its chunks)."""
        born(box)
        d = encoded(box.to_json())
        with self._tx() as db:
            try:
                db.execute(f"INSERT INTO boxes ({', '.join(d)}) VALUES ({', '.join(f':{k}' for k in d)})", d)
            except sqlite3.IntegrityError as exc:
                raise InvalidArgument(
                    f"this home has a box named {box.name!r} or with id {box.id} already"
                ) from exc
            s = snap.to_json()
            s["options"] = json.dumps(s["options"])
            db.execute(f"INSERT INTO snapshots ({', '.join(s)}) VALUES ({', '.join(f':{k}' for k in s)})", s)
            db.execute("INSERT INTO states (id, manifest, pushed) VALUES (?, ?, 1)", (snap.id, manifest))
            listed = set(manifest_digests(manifest))
            db.executemany(
                "INSERT INTO chunks (digest, refs, stored, remote) VALUES (?, 1, 0, 1) "
                "ON CONFLICT(digest) DO UPDATE SET refs = refs + 1, remote = 1",
                [(dg,) for dg in listed],
            )
            _known_to_tier(db, listed)
            self._write_events(db, box, [draft_event("pulled", snapshot=snap.id)])

    def state_manifest(self, snap_id: str) -> bytes | None:
        with self._reading():
            row = self._db.execute("SELECT manifest FROM states WHERE id = ?", (snap_id,)).fetchone()
        return bytes(row[0]) if row else None

    def state_ids(self) -> set[str]:
        """The snapshots whose states are chunks (their manifests are rows here)."""
        with self._reading():
            return {r[0] for r in self._db.execute("SELECT id FROM states")}

    def state_manifests(self) -> dict[str, bytes]:
        """Every state saved as chunks: its manifest, by its snapshot's id."""
        with self._reading():
            return {r[0]: bytes(r[1]) for r in self._db.execute("SELECT id, manifest FROM states")}


class AsyncStore:
    """The store for async code: each call runs on the store's own thread, in order,
    so no commit's fsync (nor the first open, which sweeps a crash's leftovers)
    blocks the event loop."""

    def __init__(self, opener: Callable[[], BoxStore], directory: Path | None = None) -> None:
        self._open = opener
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandlot-store")
        self._watch: sqlite3.Connection | None = None
        self._opened: BoxStore | None = None
        self.directory = directory  # where the database and its WAL are (None: not said)

    async def call(
        self, method: Callable[Concatenate[BoxStore, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method(store, *args, **kwargs)`` on the store's thread: ``method`` is one of
        ``BoxStore``'s (``db.call(BoxStore.get, box_id)``), its arguments and result
        typed as that method's."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self._run(method, args, kwargs))

    async def call_unless_full(
        self, method: Callable[Concatenate[BoxStore, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``call``, but never in the room the store keeps for the rows that end operations:
        for what a full disk may go without (a metrics sample, an OOM kill's event)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self._run(method, args, kwargs, room=False))

    def _run(
        self, method: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any], room: bool = True
    ) -> R:
        store = self._open()
        if self._watch is None:
            self._watch = store.watcher()
        self._opened = store
        return store.in_room(method, *args, **kwargs) if room else method(store, *args, **kwargs)

    def version(self) -> int | None:
        """A number that changes whenever any process commits to the store, this one
        included, read without waiting (None if it cannot be read now). Equal numbers
        mean nothing was written between the two reads: ``events.follow`` reads the
        events again only once it moves. (A box's commands go by ``stamp``, under which
        a row this process wrote itself stays current.)"""
        watch = self._watch
        if watch is None:
            return None
        try:
            version: int = watch.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error:
            return None
        return version

    def stamp(self) -> Stamp | None:
        """``BoxStore.stamp``, without waiting (None before the store's first call)."""
        store = self._opened
        return store.stamp() if store is not None else None

    async def get(self, key: str) -> BoxRecord:
        return await self.call(BoxStore.get, key)

    async def find(self, key: str) -> BoxRecord | None:
        return await self.call(BoxStore.find, key)

    async def list(self) -> builtins.list[BoxRecord]:
        return await self.call(BoxStore.list)

    async def insert(self, rec: BoxRecord) -> BoxRecord:
        return await self.call(BoxStore.insert, rec)

    async def update(self, box_id: str, **kw: Any) -> BoxRecord | None:
        return await self.call(BoxStore.update, box_id, **kw)

    async def update_as_seen(self, box_id: str, **kw: Any) -> tuple[BoxRecord | None, Stamp | None]:
        """``update``, and the stamp its transaction saw (``BoxStore.written``): the row
        is current while ``stamp()`` still equals it."""

        def run() -> tuple[BoxRecord | None, Stamp | None]:
            done: BoxRecord | None = self._run(BoxStore.update, (box_id,), kw)
            return done, self._opened.written() if self._opened is not None else None

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    async def delete(self, box_id: str, *, event: Draft | None = None) -> None:
        await self.call(BoxStore.delete, box_id, event=event)

    async def template_pool(
        self, key: str, *, by_id: bool, skip: Collection[str] = (), limit: int | None = None
    ) -> tuple[SnapshotRecord | None, builtins.list[BoxRecord]]:
        return await self.call(BoxStore.template_pool, key, by_id=by_id, skip=skip, limit=limit)

    async def pooled(
        self, template_id: str, *, skip: Collection[str] = (), limit: int | None = None
    ) -> builtins.list[BoxRecord]:
        return await self.call(BoxStore.pooled, template_id, skip=skip, limit=limit)

    async def children(self, snap_id: str) -> builtins.list[BoxRecord]:
        return await self.call(BoxStore.children, snap_id)

    async def insert_snapshot(
        self, rec: SnapshotRecord, *, manifest: bytes | None = None, stored: dict[bytes, int] | None = None
    ) -> SnapshotRecord:
        return await self.call(BoxStore.insert_snapshot, rec, manifest=manifest, stored=stored)

    async def snapshots(self, **kw: Any) -> builtins.list[SnapshotRecord]:
        return await self.call(BoxStore.snapshots, **kw)

    async def find_snapshot(self, snap_id: str) -> SnapshotRecord | None:
        return await self.call(BoxStore.find_snapshot, snap_id)

    async def get_snapshot(self, key: str, *, box_id: str | None = None) -> SnapshotRecord:
        return await self.call(BoxStore.get_snapshot, key, box_id=box_id)

    async def update_snapshot(self, snap_id: str, **changes: Any) -> None:
        await self.call(BoxStore.update_snapshot, snap_id, **changes)

    async def delete_snapshot(self, snap_id: str) -> None:
        await self.call(BoxStore.delete_snapshot, snap_id)

    async def state_manifest(self, snap_id: str) -> bytes | None:
        return await self.call(BoxStore.state_manifest, snap_id)

    async def add_event(
        self,
        event: Draft,
        box_id: str | None = None,
        labels: dict[str, str] | None = None,
        *,
        told: bool = False,
    ) -> bool:
        """``told``: an event that says why a box stopped, written in the store's room
        if the filesystem is full (most events a full disk may go without)."""
        call = self.call if told else self.call_unless_full
        return await call(BoxStore.add_event, event, box_id, labels)

    async def events(self, **kw: Any) -> builtins.list[Event]:
        return await self.call(BoxStore.events, **kw)


def validate_name(name: str, what: str = "box") -> str:
    """``name`` as a name of a ``what`` (a box, a snapshot, a template), or InvalidArgument."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        rule = "1-63 letters, digits, '_', '.' or '-', starting with a letter or digit"
        raise InvalidArgument(f"invalid {what} name {name!r}: {rule}")
    return name


__all__ = [
    "SCHEMA_VERSION",
    "AsyncStore",
    "BoxRecord",
    "BoxStore",
    "SnapshotRecord",
    "StoreError",
    "validate_name",
]
