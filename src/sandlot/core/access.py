"""API keys and the audit trail of ``sandlot serve``.

A key reads ``sk-sl-<id>-<secret>``: the id (8 hex digits) names its row in the
store's ``keys`` table, the secret (32 random bytes, URL-safe base64) proves it.
The store keeps only a scrypt hash of the secret under a salt of its own; the key
itself is shown once, when it is made, and never written anywhere.

``KeyVerifier`` checks the keys a server is presented. The first success of a key
costs one scrypt (tens of milliseconds, on purpose); later ones a sha256 and a
look-up. Its row is read again at most once a second, so a revocation by any
process takes effect within a second; ``last_used_at`` is written at most once
a minute, off the caller's thread.

``AuditLog`` records what a server did, off the request's path: ``record``
queues an entry and a thread of its own writes what is queued in batches (one
transaction each), then prunes entries past their age or past the newest
``max_rows``. ``read_audit`` reads them back.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import Any

from ..errors import InvalidArgument, NotFound, Unauthorized
from . import leases, previews
from .store import BoxStore, insert_row, insert_sql

log = logging.getLogger("sandlot.access")

# Labels the server stamps on the boxes a key makes: the key's namespace, and the key.
# Boxes of one namespace may reach each other (``box:NAME:PORT``); no others may.
NAMESPACE_LABEL = "sandlot.namespace"
KEY_LABEL = "sandlot.key"

KEY_PREFIX = "sk-sl-"
KEY_RE = re.compile(r"sk-sl-([0-9a-f]{8})-([A-Za-z0-9_-]{43})")  # token_urlsafe(32) is 43 characters
# The same key in the form E2B's SDKs are given (``e2b_`` and hex), for its E2B-compatible
# face: the id's 8 hex digits, then the secret as 64 (``sandlot keys create --e2b``).
E2B_KEY_PREFIX = "e2b_"
E2B_KEY_RE = re.compile(r"e2b_([0-9a-f]{8})([0-9a-f]{64})")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SCRYPT_N, SCRYPT_R, SCRYPT_P, SCRYPT_LEN = 2**14, 8, 1, 32
SALT_BYTES, SECRET_BYTES = 16, 32

# What an audit entry's detail never holds (it is for what was asked, not what was said),
# and how much of a long string or list it keeps.
DETAIL_FORBIDDEN = frozenset({"stdin", "stdout", "stderr", "output", "secrets"})
DETAIL_MAX_STR, DETAIL_MAX_ITEMS = 1024, 256


def _scrypt(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=SCRYPT_LEN)


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InvalidArgument(f"invalid {what} {value!r}: 1-64 letters, digits, '_', '.' or '-'")
    return value


def check_namespace(value: object) -> str:
    """A namespace as a key (or a fleet's driver) names it: 1-64 letters, digits, '_', '.', '-'."""
    return _check_name("namespace", value)


def visible(namespace: str | None, labels: Mapping[str, str] | None) -> bool:
    """Whether what has these labels (a box, its snapshots, its events) is the namespace's:
    to a caller of no namespace, everything is. One rule for ``sandlot serve``'s keys and a
    fleet's namespaced drivers."""
    return namespace is None or (labels or {}).get(NAMESPACE_LABEL) == namespace


def own_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    """A box's labels that are its own, not sandlot's (``sandlot.``): what the boxes started
    from its snapshot inherit, before they are stamped for whoever starts them."""
    return {k: v for k, v in (labels or {}).items() if not k.startswith("sandlot.")}


def stamped(
    namespace: str | None, labels: Mapping[str, str] | None, *, admin: bool = False
) -> dict[str, str]:
    """The labels of a box a caller of ``namespace`` makes: its own, and the namespace's. The
    ``sandlot.`` labels are sandlot's: only an admin (a caller of no namespace on a fleet)
    sets them itself."""
    out = dict(labels or {})
    if not admin and any(k.startswith("sandlot.") for k in out):
        raise InvalidArgument("labels starting with 'sandlot.' are sandlot's own")
    if namespace is not None:
        out[NAMESPACE_LABEL] = namespace
    return out


# -- keys ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quotas:
    """What the boxes of a key's namespace (or of the key, without one) may take in
    all: a number of boxes, MiB of memory, GB of disk; and its named volumes: how many,
    and GB of disk volumes in all (a key with that quota makes no shared volume, which
    has no size to count). ``awake``: how many of its boxes may be awake (a VM up) at
    once (``core/awake.py``). None is no limit."""

    boxes: int | None = None
    memory_mib: int | None = None
    disk_gb: int | None = None
    volumes: int | None = None
    volume_gb: int | None = None
    awake: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidArgument(f"quota {f.name} must be a positive integer or None, not {value!r}")

    def to_json(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Quotas:
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


NO_QUOTAS = Quotas()


@dataclass(frozen=True)
class ApiKey:
    """A key as the store knows it: everything but its secret."""

    id: str
    name: str
    namespace: str | None
    admin: bool
    quotas: Quotas
    created_at: float
    last_used_at: float | None = None
    revoked_at: float | None = None
    lease: float | None = None  # seconds the leases of its remote ``with`` boxes run (core/leases.py)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "namespace": self.namespace,
            "admin": self.admin,
            "quotas": self.quotas.to_json(),
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "revoked_at": self.revoked_at,
            "lease": self.lease,
        }


def _key(row: dict[str, Any]) -> ApiKey:
    return ApiKey(
        id=row["id"],
        name=row["name"],
        namespace=row["namespace"],
        admin=bool(row["admin"]),
        quotas=Quotas.from_json(json.loads(row["quotas"] or "{}")),
        created_at=row["created_at"],
        last_used_at=row["last_used_at"],
        revoked_at=row["revoked_at"],
        lease=row.get("lease"),
    )


def create_key(
    store: BoxStore,
    name: str,
    *,
    namespace: str | None = None,
    admin: bool = False,
    quotas: Quotas = NO_QUOTAS,
    lease: float | None = None,
    e2b: bool = False,
) -> tuple[ApiKey, str]:
    """Make a key: its record, and the key itself (returned this once, stored nowhere).
    ``lease``: how long the leases of the boxes its remote ``with`` blocks make run.
    ``e2b``: the key in E2B's form (``e2b_`` and hex), for E2B's SDKs; it works
    everywhere a sandlot key does."""
    _check_name("key name", name)
    if lease is not None:
        lease = leases.check_seconds(lease)
    if namespace is not None:
        check_namespace(namespace)
    if not isinstance(admin, bool):
        raise InvalidArgument(f"admin is True or False, not {admin!r}")
    if not isinstance(quotas, Quotas):
        raise InvalidArgument(f"quotas must be a Quotas, not {quotas!r}")
    secret = secrets.token_hex(SECRET_BYTES) if e2b else secrets.token_urlsafe(SECRET_BYTES)
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(secret, salt)
    for _ in range(16):  # 8 hex digits: a clash is one in four billion per key
        key = ApiKey(secrets.token_hex(4), name, namespace, admin, quotas, time.time(), lease=lease)
        row = {"id": key.id, "name": name, "namespace": namespace, "admin": int(admin), "salt": salt,
               "hash": digest, "quotas": json.dumps(quotas.to_json()),
               "created_at": key.created_at, "lease": lease}  # fmt: skip
        if insert_key(store, row):
            return key, f"{E2B_KEY_PREFIX}{key.id}{secret}" if e2b else f"{KEY_PREFIX}{key.id}-{secret}"
    raise RuntimeError("no free key id after 16 tries")  # pragma: no cover


def list_keys(store: BoxStore) -> list[ApiKey]:
    """Every key, oldest first; revoked ones too (``revoked_at`` set)."""
    return [_key(r) for r in key_rows(store)]


def quotas_of(store: BoxStore, key_id: str) -> Quotas | None:
    """The quotas of the key with this id, None where there is none (or it was revoked:
    its boxes are bound by nothing it says any more)."""
    row = key_row(store, key_id)  # by id (a name that is another key's id is that key)
    if row is None or row["revoked_at"] is not None:
        return None
    return _key(row).quotas


def revoke_key(store: BoxStore, name_or_id: str) -> ApiKey:
    """End a key now and for good (by name, or id). Revoking it again changes nothing."""
    if not isinstance(name_or_id, str) or not name_or_id:
        raise InvalidArgument(f"a key name or id is needed, not {name_or_id!r}")
    row = find_key(store, name_or_id)
    if row is not None:
        row = _revoke(store, row["id"], time.time())
    if row is None:
        raise NotFound(f"no API key {name_or_id!r}")
    return _key(row)


@dataclass(frozen=True, slots=True)
class _Row:
    key: ApiKey
    salt: bytes
    hash: bytes
    read_at: float  # time.monotonic() before it was read


class KeyVerifier:
    """Checks presented keys against the store, for a server. Thread-safe.

    A successful scrypt is remembered (by the sha256 of the key presented), so later
    requests with that key cost a hash and a look-up; a failure is never remembered.
    The key's row is read again once it is ``row_ttl`` seconds old, so another
    process's revocation takes effect within that time."""

    def __init__(self, store: BoxStore, *, row_ttl: float = 1.0, touch_every: float = 60.0) -> None:
        self._store = store
        self._row_ttl = row_ttl
        self._touch_every = touch_every
        self._lock = threading.Lock()
        self._ok: dict[bytes, bytes] = {}  # sha256(key presented) -> the stored hash it matched
        self._rows: dict[str, _Row] = {}  # key id -> its row, as last read
        self._touched: dict[str, float] = {}  # key id -> when we last wrote its last_used_at
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def verify(self, presented: str) -> ApiKey:
        """The key ``presented`` is, if it is a live key of this store; else Unauthorized."""
        key_id, secret, digest = self._parse(presented)
        row = self._row(key_id)
        if row is None:
            raise Unauthorized("invalid API key")
        if row.key.revoked_at is not None:
            raise Unauthorized("API key revoked")
        with self._lock:
            known = self._ok.get(digest)
        if known is None or not hmac.compare_digest(known, row.hash):
            if not hmac.compare_digest(_scrypt(secret, row.salt), row.hash):
                raise Unauthorized("invalid API key")
            with self._lock:
                self._ok[digest] = row.hash
        self._touch(row.key)
        return row.key

    def cached(self, presented: str) -> ApiKey | None:
        """The key, if ``presented`` verified before and its row is fresh and live: no
        I/O and no scrypt, so an event loop may call it. None means: call ``verify``."""
        try:
            key_id, _, digest = self._parse(presented)
        except Unauthorized:
            return None
        now = time.monotonic()
        with self._lock:
            row = self._rows.get(key_id)
            known = self._ok.get(digest)
        if row is None or known is None or now - row.read_at >= self._row_ttl:
            return None
        if row.key.revoked_at is not None or not hmac.compare_digest(known, row.hash):
            return None
        self._touch(row.key)
        return row.key

    async def verify_async(self, presented: str) -> ApiKey:
        """``verify`` for an event loop: a cache hit on the loop, anything else (a
        store read, a scrypt) on a thread."""
        key = self.cached(presented)
        if key is None:
            key = await asyncio.to_thread(self.verify, presented)
        return key

    async def live_async(self, key_id: str) -> bool:
        """Whether the key ``key_id`` is there and not revoked (its row as fresh as
        ``verify``'s): for what a key made that outlives its requests, such as the access
        tokens of the sandboxes of the E2B face. The row is read on a thread."""
        with self._lock:
            row = self._rows.get(key_id)
        if row is None or time.monotonic() - row.read_at >= self._row_ttl:
            row = await asyncio.to_thread(self._row, key_id)
        return row is not None and row.key.revoked_at is None

    def invalidate(self, key_id: str | None = None) -> None:
        """Forget what is cached of one key (or of all): its row is read again next time."""
        with self._lock:
            if key_id is None:
                self._rows.clear()
            else:
                self._rows.pop(key_id, None)

    def close(self) -> None:
        """Wait for pending ``last_used_at`` writes; later successes write none."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- inside --------------------------------------------------------------------------

    @staticmethod
    def _parse(presented: str) -> tuple[str, str, bytes]:
        m = None
        if isinstance(presented, str) and len(presented) <= 256:
            m = (E2B_KEY_RE if presented.startswith(E2B_KEY_PREFIX) else KEY_RE).fullmatch(presented)
        if m is None:
            raise Unauthorized("malformed API key")
        return m[1], m[2], hashlib.sha256(presented.encode()).digest()

    def _row(self, key_id: str) -> _Row | None:
        now = time.monotonic()
        with self._lock:
            row = self._rows.get(key_id)
        if row is not None and now - row.read_at < self._row_ttl:
            return row
        raw = key_row(self._store, key_id)
        if raw is None:  # only rows that exist are kept: a guess costs no memory
            with self._lock:
                self._rows.pop(key_id, None)
            return None
        row = _Row(_key(raw), raw["salt"], raw["hash"], now)
        with self._lock:
            kept = self._rows.get(key_id)
            if kept is None or kept.read_at <= now:  # a slower reader never puts back an older row
                self._rows[key_id] = row
        return row

    def _touch(self, key: ApiKey) -> None:
        now = time.time()
        with self._lock:
            last = max(self._touched.get(key.id, 0.0), key.last_used_at or 0.0)
            if self._closed or now - last < self._touch_every:
                return
            self._touched[key.id] = now
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandlot-keys")
            pool = self._pool
        with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
            pool.submit(self._write_touch, key.id, now)

    def _write_touch(self, key_id: str, at: float) -> None:
        try:
            _touch_row(self._store, key_id, at)
        except Exception as exc:  # a busy or closed store: the next use tries again
            log.debug("last_used_at of key %s not written: %s", key_id, exc)
            with self._lock:
                self._touched.pop(key_id, None)


# -- the audit trail ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AuditEntry:
    """One request a server answered: who (key), what (action, box), how it ended
    (HTTP status, error code), how long it took, and for an exec its argv and exit
    code (``detail``). Never stdin, output or secret values."""

    action: str  # "POST /v1/boxes/{box}/exec", or a name ("exec")
    status: int  # the HTTP status answered
    at: float = field(default_factory=time.time)
    key_id: str | None = None
    key_name: str | None = None
    namespace: str | None = None
    box: str | None = None
    error: str | None = None  # the error's code
    duration: float = 0.0  # seconds
    detail: dict[str, Any] = field(default_factory=dict)
    id: int | None = None  # its row, once written

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_row(self) -> dict[str, Any]:
        """Its columns in the store (``id`` is the store's to give)."""
        out = self.to_json()
        del out["id"]
        out["detail"] = json.dumps(_clip(self.detail), default=str)
        return out


def _clip(value: Any, depth: int = 0) -> Any:
    """A detail bounded in size, without the fields it must not hold."""
    if isinstance(value, str):
        more = len(value) - DETAIL_MAX_STR
        return value if more <= 0 else f"{value[:DETAIL_MAX_STR]}…(+{more})"
    if depth > 4:
        return "…"
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items() if str(k) not in DETAIL_FORBIDDEN]
        return {k: _clip(v, depth + 1) for k, v in items[:DETAIL_MAX_ITEMS]}
    if isinstance(value, list | tuple):
        out = [_clip(v, depth + 1) for v in value[:DETAIL_MAX_ITEMS]]
        if len(value) > DETAIL_MAX_ITEMS:
            out.append(f"…(+{len(value) - DETAIL_MAX_ITEMS})")
        return out
    return value


def _entry(row: dict[str, Any]) -> AuditEntry:
    return AuditEntry(**{**row, "detail": json.loads(row["detail"] or "{}")})


def read_audit(
    store: BoxStore,
    *,
    box: str | None = None,
    key: str | None = None,
    since: float | None = None,
    limit: int = 1000,
) -> list[AuditEntry]:
    """The newest ``limit`` entries that match, newest last: ``box`` the box column
    exactly, ``key`` a key's name or id, ``since`` a time (seconds since the epoch)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive integer, not {limit!r}")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
        raise InvalidArgument(f"since is a time in seconds since the epoch, not {since!r}")
    return [_entry(r) for r in audit_rows(store, box=box, key=key, since=since, limit=limit)]


class AuditLog:
    """Writes audit entries on a thread of its own; ``record`` never waits for the disk.

    Entries queued while a batch is written go in the next batch, one transaction
    each. After a write, at most once every ``prune_interval`` seconds, entries
    older than ``max_age_days`` and all but the newest ``max_rows`` are deleted.
    A store that cannot be written is tried three times a batch; an entry that
    cannot be written, or is recorded past ``max_pending`` queued or after
    ``close``, is counted in ``dropped`` (and logged)."""

    def __init__(
        self,
        store: BoxStore,
        *,
        max_age_days: float = 30,
        max_rows: int = 100_000,
        prune_interval: float = 60.0,
        max_pending: int = 100_000,
        batch_size: int = 1000,
        close_store: bool = False,
    ) -> None:
        if max_age_days <= 0 or max_rows < 1 or max_pending < 1 or batch_size < 1:
            raise InvalidArgument("max_age_days, max_rows, max_pending and batch_size must be positive")
        self._store = store
        self._max_age = max_age_days * 86400.0
        self._max_rows = max_rows
        self._prune_interval = prune_interval
        self._max_pending = max_pending
        self._batch_size = batch_size
        self._close_store = close_store
        self._cond = threading.Condition()
        self._queue: deque[AuditEntry] = deque()
        self._enqueued = 0  # entries accepted so far
        self._settled = 0  # of those, entries written or given up on
        self._closing = False
        self._last_prune: float | None = None
        self.written = 0  # entries written
        self.batches = 0  # transactions that wrote them
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="sandlot-audit", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # what is queued when the program ends is written

    def record(self, entry: AuditEntry) -> None:
        """Queue an entry for writing (returns at once)."""
        with self._cond:
            if self._closing or len(self._queue) >= self._max_pending:
                self.dropped += 1
                why = "the log is closed" if self._closing else f"{self._max_pending} entries wait already"
                log.warning("audit entry %s dropped: %s", entry.action, why)
                return
            self._queue.append(entry)
            self._enqueued += 1
            self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every entry recorded so far is written (False: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while self._settled < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def prune(self) -> int:
        """Delete entries past their age or past the newest ``max_rows`` now; how many."""
        n = _prune_audit(self._store, before=time.time() - self._max_age, keep=self._max_rows)
        self._last_prune = time.monotonic()
        return n

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (waiting up to ``timeout``) and end the writer thread."""
        atexit.unregister(self.close)
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._close_store and not self._thread.is_alive():
            self._store.close()
            self._close_store = False

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                n = min(len(self._queue), self._batch_size)
                batch = [self._queue.popleft() for _ in range(n)]
            self._write(batch)
            due = self._last_prune is None or time.monotonic() - self._last_prune >= self._prune_interval
            if due:
                try:
                    self.prune()
                except Exception as exc:
                    self._last_prune = time.monotonic()
                    log.warning("audit entries not pruned: %s", exc)
            with self._cond:
                self._settled += len(batch)
                self._cond.notify_all()

    def _write(self, batch: list[AuditEntry]) -> None:
        try:
            rows = [e.to_row() for e in batch]
        except Exception as exc:  # a malformed entry: keep the thread, and say so
            self._drop(batch, exc)
            return
        for attempt in range(3):
            try:
                insert_audit(self._store, rows)
            except Exception as exc:
                if attempt == 2:
                    self._drop(batch, exc)
                    return
                time.sleep(0.25 * 2**attempt)
            else:
                with self._cond:
                    self.written += len(batch)
                    self.batches += 1
                return

    def _drop(self, batch: list[AuditEntry], exc: BaseException) -> None:
        with self._cond:
            self.dropped += len(batch)
        log.error("%d audit entries could not be written: %s", len(batch), exc)


__all__ = [
    "KEY_PREFIX",
    "ApiKey",
    "AuditEntry",
    "AuditLog",
    "KeyVerifier",
    "Quotas",
    "create_key",
    "list_keys",
    "read_audit",
    "revoke_key",
]


# -- the ``keys`` and ``audit`` tables: functions that take the store first, as
# ``BoxStore``'s methods do, so that ``AsyncStore.call`` runs them on the store's thread


def insert_key(store: BoxStore, row: dict[str, Any]) -> bool:
    """Add a key's row; False (nothing written) if its id is taken. A taken name
    raises InvalidArgument."""
    with store.transaction() as db:
        if db.execute("SELECT 1 FROM keys WHERE name = ?", (row["name"],)).fetchone():
            raise InvalidArgument(f"an API key named {row['name']!r} already exists")
        if db.execute("SELECT 1 FROM keys WHERE id = ?", (row["id"],)).fetchone():
            return False
        insert_row(db, "keys", row)
    return True


def key_row(store: BoxStore, key_id: str) -> dict[str, Any] | None:
    with store.reading() as db:
        row = db.execute("SELECT * FROM keys WHERE id = ?", (key_id,)).fetchone()
    return dict(row) if row else None


def find_key(store: BoxStore, name_or_id: str) -> dict[str, Any] | None:
    """By name, else by id."""
    with store.reading() as db:
        row = db.execute("SELECT * FROM keys WHERE name = ?", (name_or_id,)).fetchone()
        if row is None:
            row = db.execute("SELECT * FROM keys WHERE id = ?", (name_or_id,)).fetchone()
    return dict(row) if row else None


def key_rows(store: BoxStore) -> list[dict[str, Any]]:
    with store.reading() as db:
        rows = db.execute("SELECT * FROM keys ORDER BY created_at, name").fetchall()
    return [dict(r) for r in rows]


def _revoke(store: BoxStore, key_id: str, at: float) -> dict[str, Any] | None:
    """Mark a key revoked (a revoked key keeps its first revocation time), and end its
    live previews at that same time, in the same transaction."""
    with store.transaction() as db:
        if db.execute(
            "UPDATE keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (at, key_id)
        ).rowcount:
            previews.end_in(db, previews.KEY_REVOKED, at, key_id=key_id)
        row = db.execute("SELECT * FROM keys WHERE id = ?", (key_id,)).fetchone()
    return dict(row) if row else None


def _touch_row(store: BoxStore, key_id: str, at: float) -> None:
    with store.transaction() as db:
        db.execute(
            "UPDATE keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?", (at, key_id)
        )


def insert_audit(store: BoxStore, rows: list[dict[str, Any]]) -> None:
    """Append audit entries, all in one transaction."""
    if rows:
        with store.transaction() as db:
            db.executemany(insert_sql("audit", rows[0]), rows)


def _prune_audit(store: BoxStore, *, before: float, keep: int) -> int:
    """Delete audit entries older than ``before`` and all but the newest ``keep``;
    the number deleted."""
    with store.transaction() as db:
        n: int = db.execute("DELETE FROM audit WHERE at < ?", (before,)).rowcount
        n += db.execute(
            "DELETE FROM audit WHERE id IN "
            "(SELECT id FROM audit ORDER BY at DESC, id DESC LIMIT -1 OFFSET ?)",
            (max(keep, 0),),
        ).rowcount
    return n


def audit_rows(
    store: BoxStore, *, box: str | None = None, key: str | None = None, since: float | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:  # fmt: skip
    """Audit entries, newest last: the last ``limit`` of those that match."""
    sql = "SELECT * FROM audit WHERE 1=1"
    args: list[Any] = []
    if box is not None:
        sql += " AND box = ?"
        args.append(box)
    if key is not None:
        sql += " AND (key_name = ? OR key_id = ?)"
        args += [key, key]
    if since is not None:
        sql += " AND at >= ?"
        args.append(since)
    with store.reading() as db:
        rows = db.execute(sql + " ORDER BY at DESC, id DESC LIMIT ?", [*args, max(limit, 0)]).fetchall()
    return [dict(r) for r in reversed(rows)]
