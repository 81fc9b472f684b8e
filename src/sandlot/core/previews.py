"""Preview URLs: signed, expiring, and revocable.

A preview lets a browser or an app without a key reach one port of one box
(``server/bridge.py`` serves it). Its token reads ``<id>.<box>.<port>.<expires>.<sig>``:
the signature (HMAC-SHA256 under ``server/preview.key``, a secret of the home) means
nobody but a server of this home made it, and the id names its row in the store's
``previews`` table, which every request checks. The row ties the preview to the key
that made it, so a preview ends, on every server of the home at once, when:

- it expires;
- it is revoked itself (``end_previews`` by id);
- its key is revoked (the check joins the key's row, so this holds even before
  ``revoke_key`` ends the key's previews by name);
- its box is removed (``BoxStore.delete`` ends them in the same transaction);
- all previews of a namespace, a key or a box are ended at once (``end_previews``).

Tokens of the older form ``<box>.<port>.<expires>.<sig>`` had no row and could not be
revoked: they are refused, with a message that says to make a new one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import home_secret
from ..errors import Forbidden, InvalidArgument, NotFound
from .store import BoxStore, insert_row

MAX_TTL = 7 * 24 * 3600
KEEP_ENDED = 7 * 24 * 3600  # how long an ended or expired preview stays listed
ID_RE = re.compile(r"pv-[0-9a-f]{12}")


@dataclass(frozen=True)
class Preview:
    """A preview URL as the store knows it (not its token, which is shown once)."""

    id: str
    box_id: str
    port: int
    key_id: str | None
    key_name: str | None
    namespace: str | None
    created_at: float
    expires_at: float
    ended_at: float | None = None
    ended_why: str | None = None

    def live(self, now: float | None = None) -> bool:
        return self.ended_at is None and self.expires_at > (time.time() if now is None else now)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "box": self.box_id,
            "port": self.port,
            "key_id": self.key_id,
            "key_name": self.key_name,
            "namespace": self.namespace,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "ended_at": self.ended_at,
            "ended_why": self.ended_why,
            "live": self.live(),
        }


def _preview(row: dict[str, Any]) -> Preview:
    return Preview(**{k: row[k] for k in Preview.__dataclass_fields__})


def _secret(home: Path) -> bytes:
    """The home's preview secret, made on first use."""
    return home_secret(home / "server" / "preview.key")


def _signature(secret: bytes, signed: str) -> str:
    mac = hmac.new(secret, signed.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac[:18]).decode()


def make_preview(
    store: BoxStore,
    home: Path,
    box_id: str,
    port: int,
    ttl: float,
    *,
    key_id: str | None = None,
    key_name: str | None = None,
    namespace: str | None = None,
) -> tuple[Preview, str]:
    """Record a preview of ``port`` in box ``box_id`` for ``ttl`` seconds, made by a key
    (None: a server without keys); its record and its token."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"{port!r} is not a TCP port (1..65535)")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_TTL:
        raise InvalidArgument(f"ttl must be more than 0 and at most {MAX_TTL} seconds, not {ttl!r}")
    now = time.time()
    preview = Preview(
        f"pv-{secrets.token_hex(6)}",
        box_id,
        port,
        key_id,
        key_name,
        namespace,
        now,
        float(int(now + ttl + 0.999)),
    )
    insert(
        store, {k: getattr(preview, k) for k in Preview.__dataclass_fields__}, prune_before=now - KEEP_ENDED
    )
    signed = f"{preview.id}.{box_id}.{port}.{int(preview.expires_at)}"
    return preview, f"{signed}.{_signature(_secret(home), signed)}"


def token_target(home: Path, token: str) -> tuple[str, str, int]:
    """(preview id, box id, port) of a token this home signed and that has not expired,
    read from the token alone (no store); ``check_token`` is the whole check."""
    parts = token.split(".")
    if len(parts) == 4 and parts[1].isdigit():
        raise Forbidden("this preview URL was made by an older sandlot and cannot be revoked; make a new one")
    if len(parts) != 5 or not ID_RE.fullmatch(parts[0]) or not parts[2].isdigit() or not parts[3].isdigit():
        raise Forbidden("this preview URL is malformed")
    preview_id, box_id, port, expires = parts[0], parts[1], int(parts[2]), int(parts[3])
    if not hmac.compare_digest(parts[4], _signature(_secret(home), ".".join(parts[:4]))):
        raise Forbidden("this preview URL's signature is wrong")
    if expires < time.time():
        raise Forbidden(f"this preview URL expired at {_when(expires)}")
    return preview_id, box_id, port


def check_token(store: BoxStore, home: Path, token: str) -> Preview:
    """The live preview ``token`` is; Forbidden, saying why, for any other."""
    preview_id, box_id, port = token_target(home, token)
    row = row_of(store, preview_id)
    if row is None or (row["box_id"], row["port"]) != (box_id, port):
        raise Forbidden("this preview URL is unknown to this home")
    preview = _preview(row)
    if row["key_revoked_at"] is not None:
        raise Forbidden(f"this preview URL ended at {_when(row['key_revoked_at'])}: its API key was revoked")
    if preview.ended_at is not None:
        raise Forbidden(f"this preview URL ended at {_when(preview.ended_at)}: {preview.ended_why}")
    if not preview.live():
        raise Forbidden(f"this preview URL expired at {_when(preview.expires_at)}")
    return preview


def list_previews(
    store: BoxStore,
    *,
    box_id: str | None = None,
    key_id: str | None = None,
    namespace: str | None = None,
    live: bool = True,
) -> list[Preview]:
    """Previews, oldest first, of a box, a key or a namespace; live ones only unless
    ``live`` is False (then ended and expired ones of the last week too)."""
    found = rows(
        store, box_id=box_id, key_id=key_id, namespace=namespace, live_at=time.time() if live else None
    )
    return [_preview(r) for r in found]


def get_preview(store: BoxStore, preview_id: str) -> Preview:
    if not isinstance(preview_id, str) or not ID_RE.fullmatch(preview_id):
        raise InvalidArgument(f"invalid preview id {preview_id!r}: pv- and 12 hex digits")
    row = row_of(store, preview_id)
    if row is None:
        raise NotFound(f"no preview {preview_id}")
    return _preview(row)


def end_previews(store: BoxStore, why: str, **which: str | None) -> int:
    """End the live previews that match every filter given (``preview_id``, ``box_id``,
    ``key_id``, ``namespace``: at least one); how many ended."""
    if not any(v is not None for v in which.values()):
        raise InvalidArgument("say which previews to end: an id, a box, a key or a namespace")
    if which.get("preview_id") is not None:
        get_preview(store, str(which["preview_id"]))
    return end_rows(store, why, time.time(), **which)


def ended_with_key(store: BoxStore, key_id: str, revoked_at: float) -> int:
    """How many previews the revocation of key ``key_id`` (at ``revoked_at``) ended."""
    return sum(
        1
        for p in list_previews(store, key_id=key_id, live=False)
        if p.ended_at == revoked_at and p.ended_why == KEY_REVOKED
    )


# -- the ``previews`` table: functions that take the store first, as ``BoxStore``'s
# methods do, so that ``AsyncStore.call`` runs them on the store's thread

KEY_REVOKED = "its API key was revoked"  # why the previews a key's revocation ended did end


def insert(store: BoxStore, row: dict[str, Any], *, prune_before: float) -> None:
    """Add a preview's row, and drop those that expired or ended before ``prune_before``."""
    with store.transaction() as db:
        db.execute("DELETE FROM previews WHERE COALESCE(ended_at, expires_at) < ?", (prune_before,))
        insert_row(db, "previews", row)


def row_of(store: BoxStore, preview_id: str) -> dict[str, Any] | None:
    """A preview's row, with ``key_revoked_at`` (its key's revocation time, if any)."""
    with store.reading() as db:
        row = db.execute(
            "SELECT p.*, k.revoked_at AS key_revoked_at FROM previews p "
            "LEFT JOIN keys k ON k.id = p.key_id WHERE p.id = ?",
            (preview_id,),
        ).fetchone()
    return dict(row) if row else None


def rows(
    store: BoxStore,
    *,
    box_id: str | None = None,
    key_id: str | None = None,
    namespace: str | None = None,
    live_at: float | None = None,
) -> list[dict[str, Any]]:
    """Previews, oldest first: of a box, a key, a namespace; only those live at
    ``live_at`` (not ended, not expired) when it is given."""
    sql, args = _matching(box_id, key_id, namespace, live_at)
    with store.reading() as db:
        found = db.execute(f"SELECT * FROM previews WHERE {sql} ORDER BY created_at, id", args).fetchall()
    return [dict(r) for r in found]


def end_rows(store: BoxStore, why: str, at: float, **which: str | None) -> int:
    """End the live previews that match (all given filters: ``end_in``'s); how many ended."""
    with store.transaction() as db:
        return end_in(db, why, at, **which)


def end_in(
    db: sqlite3.Connection,
    why: str,
    at: float,
    *,
    preview_id: str | None = None,
    box_id: str | None = None,
    key_id: str | None = None,
    namespace: str | None = None,
) -> int:
    """``end_rows`` in a transaction under way (a key's revocation ends its previews in its own)."""
    sql, args = _matching(box_id, key_id, namespace, at)
    if preview_id is not None:
        sql += " AND id = ?"
        args.append(preview_id)
    n: int = db.execute(
        f"UPDATE previews SET ended_at = ?, ended_why = ? WHERE {sql}", [at, why, *args]
    ).rowcount
    return n


def _matching(
    box_id: str | None, key_id: str | None, namespace: str | None, live_at: float | None
) -> tuple[str, list[Any]]:
    sql = "1=1"
    args: list[Any] = []
    for column, value in (("box_id", box_id), ("key_id", key_id), ("namespace", namespace)):
        if value is not None:
            sql += f" AND {column} = ?"
            args.append(value)
    if live_at is not None:
        sql += " AND ended_at IS NULL AND expires_at > ?"
        args.append(live_at)
    return sql, args


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def sandbox_token(home: Path, box_id: str, purpose: str) -> str:
    """A box's bearer token for ``purpose`` (E2B's envd access token, its traffic token):
    an HMAC of the box id under a secret of the home, so it is never stored, stays the
    same across server restarts, and is good for that box alone."""
    mac = hmac.new(
        home_secret(home / "server" / "sandbox.key"), f"{purpose}:{box_id}".encode(), hashlib.sha256
    )
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")
