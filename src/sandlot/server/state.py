"""What the server holds while it runs, and who is asking: shared by the app and its routes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from starlette.websockets import WebSocket

from ..api import access
from ..api.box import AsyncBox
from ..api.contract import error_json
from ..api.host import HeldProcess, ProcessTable
from ..api.local import LocalBackend
from ..config import default_home
from ..errors import Forbidden, SandlotError, Unauthorized
from ..tools import Limits

NAMESPACE_LABEL, KEY_LABEL = access.NAMESPACE_LABEL, access.KEY_LABEL


@dataclass(frozen=True)
class Caller:
    """Who is asking: the API key's identity and reach (everything when auth is off)."""

    key_id: str | None = None
    key_name: str | None = None
    namespace: str | None = None
    admin: bool = True
    quotas: Any = None
    lease: float | None = None  # the length of the leases of its remote ``with`` boxes

    @classmethod
    def owner_of(cls, labels: dict[str, str]) -> Caller:
        """The key that made a box, as its labels say: who a call that carries no key of its
        own (an E2B sandbox's, by its token) acts for, in the audit trail and its leases."""
        return cls(labels.get(KEY_LABEL), None, labels.get(NAMESPACE_LABEL), admin=False)

    def may_see(self, labels: dict[str, str]) -> bool:
        return access.visible(self.namespace, labels)

    def require_admin(self, what: str) -> None:
        if not self.admin:
            raise Forbidden(f"{what} needs an admin key")


@dataclass
class Settings:
    home: str | os.PathLike[str] | None = None
    auth: bool = True
    body_timeout: float = 60.0  # seconds a request body may stall before the answer is 408
    port_domain: str | None = None  # {port}-{box}.{port_domain} reaches that port (server/bridge.py)
    # where it listens (server/origins.py): the address, and the port of boxes' content (None:
    # no such listener; their routes are then served nowhere)
    listen_host: str = "127.0.0.1"
    content_port: int | None = None
    content_url: str | None = None  # the content listener's origin as browsers reach it (behind a proxy)
    allow_hosts: tuple[str, ...] = ()  # host names both listeners answer to, beyond loopback's
    allow_origins: tuple[str, ...] = ()  # origins whose pages may call the API (CORS answers them)
    tmp: Path = field(default_factory=lambda: Path(os.environ.get("TMPDIR", "/tmp")))
    mcp: bool = True  # the MCP endpoint at /mcp (when the mcp package is installed)
    mcp_image: str | None = None  # what its create_box boots when a call names no image
    mcp_limits: Limits = field(default_factory=Limits)  # what its tools may create, within the key's quotas
    # whose agent sessions it inherits: a server restarted on the same address takes over
    # what the last one there held, and another server of the home leaves them alone
    heir: str = "serve"
    lease: float = 60.0  # seconds a remote ``with`` block's box outlives its client's last renewal
    webhooks: tuple[str, ...] = ()  # URLs each event of the home is POSTed to (server/webhooks.py)
    webhook_secret: bytes = b""  # what signs their bodies
    # who E2B's calls that name no user run as, where the box's image has that user (else
    # the image's own user): E2B's templates run everything as ``user``
    e2b_user: str | None = "user"
    # what E2B's default templates (``base``, ``code-interpreter-v1``) start from: a sandlot
    # template or snapshot of that name the caller may see, else an image
    e2b_template: str | None = None


class ServerState:
    """What the server holds while it runs: nothing the store does not also know,
    except the processes clients stream (and those survive the server in the box)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.home = settings.home
        self.home_dir = Path(settings.home).expanduser().absolute() if settings.home else default_home()
        # the processes clients started, and those a server of this home that died held
        # (taken over once a box at a time: the take-over at start and a client's may overlap)
        self.processes = ProcessTable(LocalBackend.for_home(settings.home), self.exited_by(None))
        self.handles: dict[str, AsyncBox] = {}  # box id -> its handle (see routes._box)
        # creations of one namespace (or key) run in turn, so two cannot both pass a quota
        self.quota_locks: dict[str, asyncio.Lock] = {}
        self.verifier = access.key_verifier(settings.home) if settings.auth else None
        self.audit = access.audit_writer(settings.home)

    async def caller(self, headers: Any, *, websocket: bool = False) -> Caller:
        """Who presents these headers: a key in ``Authorization: Bearer``, ``X-API-Key``,
        or (a WebSocket's only) the console's key subprotocol."""
        if self.verifier is None:
            return Caller()
        presented = headers.get("x-api-key")
        if presented is None:
            scheme, _, token = (headers.get("authorization") or "").partition(" ")
            presented = token.strip() if scheme.lower() == "bearer" else None
        if presented is None and websocket:
            presented = key_from_subprotocols(headers.get("sec-websocket-protocol"))
        if not presented:
            raise Unauthorized("an API key is needed: Authorization: Bearer <key>")
        key = await self.verifier.verify_async(presented)
        return Caller(key.id, key.name, key.namespace, key.admin, key.quotas, key.lease)

    async def take_over_all(self) -> None:
        """At start: hold what a dead server held in every running box, so their
        output keeps flowing before any client comes back for it."""
        for box in await AsyncBox.list(home=self.home):
            if box.state == "running":
                with contextlib.suppress(SandlotError):
                    await self.processes.take_over(box.ref)

    def exited_by(self, caller: Caller | None) -> Callable[[HeldProcess], None]:
        """What to do when a process ``caller`` started ends: its audit entry
        (a process taken over from a dead server has no caller left)."""

        def exited(held: HeldProcess) -> None:
            r, err = held.result, held.error
            self.record(caller, "spawn", held.box_id, 200 if err is None else err.status,
                        err.code if err else None, 0.0,
                        {"argv": list(held.proc.argv), "exit_code": r.exit_code if r else None})  # fmt: skip

        return exited

    def record(self, caller: Caller | None, action: str, box: str | None, status: int,
               error: str | None, duration: float, detail: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.audit.record(access.AuditEntry(
            key_id=caller.key_id if caller else None, key_name=caller.key_name if caller else None,
            namespace=caller.namespace if caller else None, action=action, box=box, status=status,
            error=error, duration=duration, detail=detail or {},
        ))  # fmt: skip


# A browser cannot give a WebSocket headers: the console offers the subprotocols
# "sandlot" and "sandlot.key.<the key in base64url>", and the server answers "sandlot".
# A header, so never in a URL or a log line; and never passed on to an app in a box.
SUBPROTOCOL = "sandlot"
KEY_SUBPROTOCOL = "sandlot.key."


def key_from_subprotocols(offered: str | None) -> str | None:
    for item in (offered or "").split(","):
        item = item.strip()
        if item.startswith(KEY_SUBPROTOCOL):
            encoded = item[len(KEY_SUBPROTOCOL) :]
            try:
                padded = encoded + "=" * (-len(encoded) % 4)
                return base64.b64decode(padded, altchars=b"-_", validate=True).decode()
            except (ValueError, UnicodeDecodeError):
                raise Unauthorized("the key offered as a WebSocket subprotocol is not base64url") from None
    return None


def our_subprotocol(offered: list[str]) -> str | None:
    """What to accept a WebSocket with: "sandlot" where the client offered it (a client
    that offers subprotocols fails the handshake unless one is chosen)."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


async def accept_websocket(ws: WebSocket, subprotocol: str | None = None) -> None:
    """Accept ``ws`` with ``subprotocol``, else with sandlot's own where it was offered."""
    await ws.accept(subprotocol=subprotocol or our_subprotocol(list(ws.scope.get("subprotocols") or [])))


def app_subprotocols(offered: list[str]) -> list[str]:
    """The subprotocols a client offered, less sandlot's own: what an app in a box sees."""
    return [p for p in offered if p != SUBPROTOCOL and not p.startswith(KEY_SUBPROTOCOL)]


def error_body(err: SandlotError) -> dict[str, Any]:
    return {"error": error_json(err)}


def error_response(err: SandlotError, status: int | None = None) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=status or err.status, headers=err.http_headers())
