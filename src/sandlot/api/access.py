"""API keys and the audit trail of ``sandlot serve`` (docs/server.md), for a home.

Quick store calls, so plain functions; ``home`` is a sandlot home as everywhere
(``$SANDLOT_HOME`` by default).

>>> import tempfile, time
>>> from sandlot.api import access
>>> home = tempfile.mkdtemp()
>>> record, key = access.create_key("ci", namespace="team-a", max_boxes=4, home=home)
>>> key.startswith("sk-sl-" + record.id + "-")   # shown this once; the store keeps a hash
True
>>> access.key_verifier(home).verify(key).namespace
'team-a'
>>> [(k.name, k.quotas.boxes) for k in access.list_keys(home)]
[('ci', 4)]
>>> access.revoke_key("ci", home).revoked
True
>>> with access.audit_writer(home) as log:
...     log.record(access.AuditEntry(action="POST /v1/boxes", status=201, key_name="ci", box="b1"))
>>> [(e.action, e.status) for e in access.audit_log(key="ci", since=time.time() - 3600, home=home)]
[('POST /v1/boxes', 201)]
"""

from __future__ import annotations

import os

from ..core import access
from ..core.access import KEY_LABEL, NAMESPACE_LABEL, ApiKey, AuditEntry, AuditLog, KeyVerifier, Quotas
from ..core.runtime import Runtime
from ..core.store import BoxStore


def create_key(
    name: str,
    *,
    namespace: str | None = None,
    admin: bool = False,
    max_boxes: int | None = None,
    max_memory_mib: int | None = None,
    max_disk_gb: int | None = None,
    home: str | os.PathLike[str] | None = None,
) -> tuple[ApiKey, str]:
    """Make an API key: its record and the key itself, which is shown only this once."""
    quotas = Quotas(boxes=max_boxes, memory_mib=max_memory_mib, disk_gb=max_disk_gb)
    store = Runtime.for_home(home).store
    return access.create_key(store, name, namespace=namespace, admin=admin, quotas=quotas)


def list_keys(home: str | os.PathLike[str] | None = None) -> list[ApiKey]:
    """Every API key of the home, oldest first, revoked ones included (``revoked_at`` set)."""
    return access.list_keys(Runtime.for_home(home).store)


def revoke_key(name: str, home: str | os.PathLike[str] | None = None) -> ApiKey:
    """End an API key (by name or id) at once and for good; NotFound if there is none."""
    return access.revoke_key(Runtime.for_home(home).store, name)


def audit_log(
    *,
    box: str | None = None,
    key: str | None = None,
    since: float | None = None,
    limit: int = 1000,
    home: str | os.PathLike[str] | None = None,
) -> list[AuditEntry]:
    """The newest ``limit`` audit entries of a box (id), a key (name or id), since a time; newest last."""
    return access.read_audit(Runtime.for_home(home).store, box=box, key=key, since=since, limit=limit)


def key_verifier(home: str | os.PathLike[str] | None = None) -> KeyVerifier:
    """What a server checks presented keys with (thread-safe; revocations count within a second)."""
    return KeyVerifier(Runtime.for_home(home).store)


def audit_writer(
    home: str | os.PathLike[str] | None = None,
    *,
    max_age_days: float = 30,
    max_rows: int = 100_000,
    prune_interval: float = 60.0,
) -> AuditLog:
    """What a server records audit entries with: written off the caller's thread, on a
    store connection of its own, pruned past ``max_age_days`` or the newest ``max_rows``."""
    return AuditLog(
        BoxStore(Runtime.for_home(home).store.path),
        max_age_days=max_age_days,
        max_rows=max_rows,
        prune_interval=prune_interval,
        close_store=True,
    )


__all__ = [
    "KEY_LABEL",
    "NAMESPACE_LABEL",
    "ApiKey",
    "AuditEntry",
    "AuditLog",
    "KeyVerifier",
    "Quotas",
    "audit_log",
    "audit_writer",
    "create_key",
    "key_verifier",
    "list_keys",
    "revoke_key",
]
