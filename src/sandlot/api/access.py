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
from pathlib import Path

from ..core import access, previews
from ..core.access import (
    KEY_LABEL,
    NAMESPACE_LABEL,
    ApiKey,
    AuditEntry,
    AuditLog,
    KeyVerifier,
    Quotas,
    check_namespace,
    own_labels,
    stamped,
    visible,
)
from ..core.previews import MAX_TTL as MAX_PREVIEW_TTL
from ..core.previews import Preview
from ..core.runtime import Runtime
from ..core.store import BoxStore
from ..errors import NotFound


def create_key(
    name: str,
    *,
    namespace: str | None = None,
    admin: bool = False,
    max_boxes: int | None = None,
    max_memory_mib: int | None = None,
    max_disk_gb: int | None = None,
    lease: float | None = None,
    home: str | os.PathLike[str] | None = None,
    max_volumes: int | None = None,
    max_volume_gb: int | None = None,
    e2b: bool = False,
    max_awake: int | None = None,
) -> tuple[ApiKey, str]:
    """Make an API key: its record and the key itself, which is shown only this once.
    ``e2b``: in E2B's form (``e2b_`` and hex), for E2B's SDKs (docs/e2b.md).
    ``lease``: seconds a box its remote ``with`` block made outlives the client's last
    renewal (api/leases.py; the server's default otherwise). The ``max_`` quotas bound
    what its namespace's boxes and named volumes take in all; ``max_awake``, how many of
    its boxes are awake at once (a wake past it puts the least recently used idle one
    that sleeps anyway to sleep: docs/server.md, "Quotas")."""
    quotas = Quotas(boxes=max_boxes, memory_mib=max_memory_mib, disk_gb=max_disk_gb, volumes=max_volumes,
                    volume_gb=max_volume_gb, awake=max_awake)  # fmt: skip
    store = Runtime.for_home(home).store
    return access.create_key(
        store, name, namespace=namespace, admin=admin, quotas=quotas, lease=lease, e2b=e2b
    )


def list_keys(home: str | os.PathLike[str] | None = None) -> list[ApiKey]:
    """Every API key of the home, oldest first, revoked ones included (``revoked_at`` set)."""
    return access.list_keys(Runtime.for_home(home).store)


def revoke_key(name: str, home: str | os.PathLike[str] | None = None) -> ApiKey:
    """End an API key (by name or id) at once and for good, and the preview URLs it
    made (``previews_ended_with`` counts them); NotFound if there is none."""
    return access.revoke_key(Runtime.for_home(home).store, name)


# -- preview URLs (core/previews.py): signed, expiring, revocable ----------------------------


def _home_dir(home: str | os.PathLike[str] | None) -> Path:
    return Runtime.for_home(home).home


def make_preview(box_id: str, port: int, ttl: float, *, key_id: str | None = None,
                 key_name: str | None = None, namespace: str | None = None,
                 home: str | os.PathLike[str] | None = None) -> tuple[Preview, str]:  # fmt: skip
    """Record a preview URL of ``port`` in a box for ``ttl`` seconds, made by a key (its
    id, name and namespace); its record and its token (the URL's secret, shown once)."""
    rt = Runtime.for_home(home)
    return previews.make_preview(rt.store, rt.home, box_id, port, ttl, key_id=key_id, key_name=key_name,
                                 namespace=namespace)  # fmt: skip


def sandbox_token(box_id: str, purpose: str, home: str | os.PathLike[str] | None = None) -> str:
    """A bearer token good for one box and one ``purpose`` only (``core/previews.py``)."""
    return previews.sandbox_token(_home_dir(home), box_id, purpose)


def preview_target(token: str, home: str | os.PathLike[str] | None = None) -> tuple[str, str, int]:
    """(preview id, box id, port) from a token's signature alone: no store read."""
    return previews.token_target(_home_dir(home), token)


def check_preview(token: str, home: str | os.PathLike[str] | None = None) -> Preview:
    """The live preview of ``token``; Forbidden, saying why (expired, revoked...), otherwise."""
    rt = Runtime.for_home(home)
    return previews.check_token(rt.store, rt.home, token)


def list_previews(
    *,
    box: str | None = None,
    key: str | None = None,
    namespace: str | None = None,
    live: bool = True,
    home: str | os.PathLike[str] | None = None,
) -> list[Preview]:
    """Preview URLs, oldest first: of a box (id), a key (name or id), a namespace; the
    live ones, or also those that ended or expired in the last week (``live=False``)."""
    store = Runtime.for_home(home).store
    return previews.list_previews(
        store, box_id=box, key_id=_key_id(store, key), namespace=namespace, live=live
    )


def end_previews(*, preview: str | None = None, box: str | None = None, key: str | None = None,
                 namespace: str | None = None, why: str = "revoked",
                 home: str | os.PathLike[str] | None = None) -> int:  # fmt: skip
    """End the live preview URLs that match every filter given; how many ended."""
    store = Runtime.for_home(home).store
    return previews.end_previews(store, why, preview_id=preview, box_id=box, key_id=_key_id(store, key),
                                 namespace=namespace)  # fmt: skip


def get_preview(preview: str, home: str | os.PathLike[str] | None = None) -> Preview:
    return previews.get_preview(Runtime.for_home(home).store, preview)


def previews_ended_with(key: ApiKey, home: str | os.PathLike[str] | None = None) -> int:
    """How many preview URLs ended when ``key`` was revoked (0 for a live key)."""
    if key.revoked_at is None:
        return 0
    return previews.ended_with_key(Runtime.for_home(home).store, key.id, key.revoked_at)


def _key_id(store: BoxStore, key: str | None) -> str | None:
    if key is None:
        return None
    row = access.find_key(store, key)
    if row is None:
        raise NotFound(f"no API key {key!r}")
    return str(row["id"])


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
    "MAX_PREVIEW_TTL",
    "NAMESPACE_LABEL",
    "ApiKey",
    "AuditEntry",
    "AuditLog",
    "KeyVerifier",
    "Preview",
    "Quotas",
    "audit_log",
    "audit_writer",
    "check_namespace",
    "check_preview",
    "create_key",
    "end_previews",
    "get_preview",
    "key_verifier",
    "list_keys",
    "list_previews",
    "make_preview",
    "own_labels",
    "preview_target",
    "previews_ended_with",
    "revoke_key",
    "stamped",
    "visible",
]
