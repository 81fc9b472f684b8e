"""The ASGI application: authentication, one error shape, body limits and the
audit trail around the routes of ``server/routes.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from ..api.box import take_over_sessions
from ..api.events import acting_as
from ..api.templates import keep_pools_filled_async
from ..errors import Forbidden, RequestError, SandlotError
from ..version import __version__
from . import e2b, origins
from .state import ServerState, Settings, error_response

if TYPE_CHECKING:
    from ..mcp.http import Endpoint

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_LIMIT = 1 << 20  # bytes of a JSON body; uploads stream and have no such limit
STREAMED_BODIES = ("/files/content", "/files/archive", "/snapshots/import")
PREVIEWS = "/p/"
CONSOLE = "/console"
HEALTH = "/health"
OPEN_PATHS = ("/", HEALTH, "/docs", "/openapi.json", "/redoc")  # no key: nothing of a box's
MCP_PATH = "/mcp"


class BodyTooLarge(RequestError):
    status = 413


class BodyTimeout(RequestError):
    code, status = "request_timeout", 408


class Guard:
    """Around every HTTP request: the body limit, the body's idle timeout, the caller,
    and the audit record of each mutating request (after the answer, off its path).
    Around every request and WebSocket: each listener serves only its own paths
    (``server/origins.py``: the API and the console on one, boxes' content on the other),
    and no web page of another origin gets through (``origins.browser_refusal``).

    Time limits: a client that stops sending a request body for ``body_timeout``
    seconds (``Settings``; ``sandlot serve --body-timeout``) gets 408, on every
    route, uploads included; a slow client holds only its own request. What a
    request then does runs under the core's own deadlines: a boot's, the box's
    ``request_timeout`` for each agent call, an exec's ``timeout``.
    Idle keep-alive connections are closed after 30 s (uvicorn)."""

    def __init__(self, app: ASGIApp, state: ServerState, sandboxes: ASGIApp | None = None, *,
                 content: bool = False) -> None:  # fmt: skip
        self.app = app
        self.state = state
        self.sandboxes = sandboxes  # E2B's sandbox requests (server/e2b)
        self.content = content  # the listener of boxes' content, else the API's
        self.allowed = frozenset(state.settings.allow_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        misdirected = self._misdirected(scope, path, headers)
        if isinstance(misdirected, Response):
            await misdirected(scope, receive, send)
            return
        if misdirected is not None:
            await origins.deny(scope, receive, send, misdirected, lambda e: _refusal(path, e))
            return
        foreign = origins.browser_refusal(headers, scope.get("method", "GET"), self.allowed,
                                          api=not self.content)  # fmt: skip
        if foreign is not None:
            await origins.deny(scope, receive, send, Forbidden(foreign), lambda e: _refusal(path, e))
            return
        if scope["type"] == "websocket":  # each WebSocket route checks its key itself
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        scope.setdefault("state", {})
        status_seen: list[int] = [500]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen[0] = message["status"]
            await send(message)

        receive = _timed(receive, self.state.settings.body_timeout)
        query = scope.get("query_string", b"")
        if self.sandboxes is not None and e2b.is_sandbox_request(path, headers, query):
            # a request to an E2B sandbox carries the sandbox's own token, which server/e2b
            # checks; it goes straight there, past the routes of the rest (a millisecond of
            # every command's round trip)
            await self.sandboxes({**scope, "root_path": scope.get("root_path", "") + e2b.PREFIX},
                                 receive, sending)  # fmt: skip
            return
        if path in OPEN_PATHS or path == CONSOLE or path.startswith((PREVIEWS, CONSOLE + "/")):
            # a preview is authenticated by its signature (server/bridge.py), and streamed;
            # the console's files hold no secret (the page asks for a key)
            await self.app(scope, receive, sending)
            return
        try:
            caller = await self.state.caller(headers)
        except SandlotError as e:
            await _refusal(path, e)(scope, receive, send)
            return
        scope["state"]["caller"] = caller
        if not path.endswith(STREAMED_BODIES) and not origins.PORT_PATH.match(path):
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > JSON_LIMIT:
                err = BodyTooLarge(f"the body is over the limit of {JSON_LIMIT} bytes for this route")
                await _refusal(path, err)(scope, receive, send)
                return
            receive = _limited(receive, JSON_LIMIT)
        try:
            with acting_as(f"key {caller.key_name}" if caller.key_name else "server"):
                await self.app(scope, receive, sending)
        finally:
            # an MCP message is not audited itself: each tool call is, as the REST request it becomes
            if scope["method"] not in ("GET", "HEAD", "OPTIONS") and path != MCP_PATH:
                st = scope["state"]
                route = scope.get("route")
                template = getattr(route, "path", path)
                for prefix in ("/v1", e2b.PREFIX):  # the route as its router declared it, under its prefix
                    if path.startswith(prefix + "/") and not template.startswith(prefix):
                        template = prefix + template
                action = f"{scope['method']} {template}"
                box = (scope.get("path_params") or {}).get("box")
                self.state.record(caller, action, st.get("box_id", box), status_seen[0], st.get("error"),
                                  time.monotonic() - t0, st.get("audit"))  # fmt: skip

    def _misdirected(self, scope: Scope, path: str, hdrs: dict[str, str]) -> RequestError | Response | None:
        """Why this listener does not serve ``path`` (None where it does): box content only
        on the content listener, everything else only on the API's. A preview link made
        before the two were apart answers a browser with a redirect to where it is now."""
        if self.content:
            if origins.content_path(path) or scope.get(origins.HOST_ROUTE) or path == HEALTH:
                return None
            why = f"{path} is not served here: this is the listener of boxes' content"
            return origins.Misdirected(why + "; the API and the console have a port of their own")
        if not origins.content_path(path):
            return None
        query = scope.get("query_string", b"").decode("latin-1")
        base = origins.content_base(self.state.settings, scope.get("scheme", "http"), hdrs.get("host"))
        moved = base + path + (f"?{query}" if query else "")
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and path.startswith(PREVIEWS):
            return RedirectResponse(moved, status_code=307)
        return origins.Misdirected(f"boxes' content is never served on the API's origin: {moved}")


def _refusal(path: str, err: SandlotError) -> Response:
    """The answer to a request the guard refuses, in the shape of the face it was for."""
    return e2b.error_response(err) if path.startswith(e2b.PREFIX + "/") else error_response(err)


def _timed(receive: Receive, timeout: float) -> Receive:
    """``receive`` with a deadline on each part of the request body, until its last;
    after that, waits (for the client's disconnect, while a response streams) are not
    limited."""
    body_done = False

    async def receiving() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            async with asyncio.timeout(timeout):
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(f"the request body stalled: no bytes for {timeout:.0f}s") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return receiving


def _limited(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def receiving() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise BodyTooLarge(f"the body is over the limit of {limit} bytes for this route")
        return message

    return receiving


def _mcp_endpoint(settings: Settings, inner: Callable[[], Guard | None]) -> Endpoint | None:
    """The MCP endpoint (``mcp/http.py``) whose tool calls go through ``inner``, the
    guarded app; None where the ``mcp`` package is not installed."""
    try:
        from ..mcp.http import Endpoint
    except ImportError:
        return None

    def app() -> ASGIApp:
        found = inner()
        assert found is not None, "the app is built before the first request"
        return found

    return Endpoint(app, image=settings.mcp_image, limits=settings.mcp_limits)


def create_app(settings: Settings) -> origins.Listeners:
    """The server's ASGI application for one sandlot home: the API's listener and the
    content listener's (``server/origins.py``), by the port each request came in on."""
    from . import bridge, console, leases, webhooks
    from .routes import router

    settings = origins.checked(settings)
    state = ServerState(settings)
    take_over_sessions(settings.home, heir=settings.heir)  # what the last server here held is ours
    guarded: Guard | None = None
    mcp = _mcp_endpoint(settings, lambda: guarded) if settings.mcp else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        taking_over = asyncio.ensure_future(state.take_over_all())
        filling = asyncio.ensure_future(keep_pools_filled_async(home=settings.home))  # warm pools
        sweeping = asyncio.ensure_future(leases.sweep(state))  # boxes of clients that died
        try:
            async with (
                mcp.lifespan() if mcp is not None else contextlib.nullcontext(),
                webhooks.delivering(settings.webhooks, settings.webhook_secret, settings.home),
            ):
                yield
        finally:
            # boxes and their processes run on (a later server takes the processes
            # over): only the server's own work ends here
            taking_over.cancel()
            sweeping.cancel()
            filling.cancel()
            with contextlib.suppress(BaseException):
                await filling  # a VM it was making is removed, not left half made
            state.audit.close()

    api = FastAPI(
        title="sandlot",
        version=__version__,
        description="Embeddable microVM sandboxes over HTTP: see docs/server.md.",
        lifespan=lifespan,
    )
    api.state.server = state

    @api.exception_handler(SandlotError)
    async def sandlot_error(request: Request, exc: SandlotError) -> JSONResponse:
        request.state.error = exc.code
        return error_response(exc)

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        request.state.error = "bad_request"
        return error_response(RequestError("; ".join(parts) or "malformed request"))

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        body = {"type": "RequestError", "code": code, "message": str(exc.detail), "box": None, "state": None}
        return JSONResponse({"error": body}, status_code=exc.status_code)

    @api.get("/health", tags=["server"])
    async def health() -> dict[str, str]:
        """Liveness, without a key."""
        return {"status": "ok", "version": __version__}

    @api.get("/metrics", tags=["server"], response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus' text format: the boxes the key may see, from their newest samples, and
        what their bounded records folded, dropped or refused; for an admin key also the
        home's own records and its chunk store (their figures are every box's)."""
        from ..api.metrics import bounded, latest
        from ..api.storage import totals
        from .prometheus import CONTENT_TYPE, exposition

        caller = request.state.caller
        rows = [({"id": b.id, "name": b.name, "state": b.state}, sample)
                for b, sample in await latest(settings.home) if caller.may_see(b.info["labels"])]  # fmt: skip
        counts = await bounded(settings.home)
        seen = {box["id"] for box, _ in rows} | ({""} if caller.admin else set())
        storage = await asyncio.to_thread(totals, home=settings.home) if caller.admin else None
        mine = {b: c for b, c in counts.items() if b in seen}
        return Response(exposition(rows, mine, storage), media_type=CONTENT_TYPE)

    api.include_router(router, prefix="/v1")
    api.include_router(bridge.v1, prefix="/v1")
    api.include_router(leases.v1, prefix="/v1")
    api.include_router(bridge.router)
    api.include_router(console.pages)
    if mcp is not None:
        api.router.routes.append(Route(MCP_PATH, endpoint=mcp.app, include_in_schema=False))
    face = e2b.E2bFace(state)
    api.mount(e2b.PREFIX, face)
    guarded = Guard(api, state, face)
    content: ASGIApp = Guard(api, state, face, content=True)
    if settings.port_domain:
        content = bridge.HostRoutes(content, state, settings.port_domain)
    layout = origins.Layout.of(settings)
    front = origins.Front(_cors(guarded, settings.allow_origins), layout.api, "the API", error_response,
                          origins.API_HEADERS)  # fmt: skip
    return origins.Listeners(front, origins.Front(content, layout.content, "boxes' content", error_response),
                             settings.content_port, api)  # fmt: skip


def _cors(app: ASGIApp, allowed: tuple[str, ...]) -> ASGIApp:
    """CORS for the origins ``--allow-origin`` names; none without (closed: a page of
    another origin reads no answer of the API)."""
    if not allowed:
        return app
    from starlette.middleware.cors import CORSMiddleware

    headers = ["authorization", "x-api-key", "content-type", "last-event-id"]
    return CORSMiddleware(app, allow_origins=list(allowed), allow_methods=["*"], allow_headers=headers,
                          max_age=600)  # fmt: skip
