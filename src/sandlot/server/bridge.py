"""Ports of boxes through the server: HTTP and WebSocket to a guest port, a raw
TCP connection over a WebSocket, and signed preview URLs.

Every connection goes into the box through ``AsyncBox.connect`` (the agent's
relay, ``api/bridge.py``): the port needs no publishing and the box no network.
What an app in a box serves is served on the content listener alone, never on the
API's origin (``server/origins.py``):

- ``/v1/boxes/{box}/ports/{port}/{path}``: HTTP (any method, streamed both ways)
  and WebSocket, authenticated by an API key like every ``/v1`` route.
- ``/p/{token}/{path}``: the same, authenticated by the signed, expiring token a
  key holder made (``POST /v1/boxes/{box}/previews``, on the API), for browsers and
  apps that carry no key. Every request checks the token's signature and its row in
  the store (``core/previews.py``), so a preview whose key is revoked, or that is
  revoked itself, or whose box is removed, ends at once on every server of the
  home; a WebSocket or a response still streaming through it is cut within
  ``PREVIEW_RECHECK`` seconds.
- ``WS /v1/boxes/{box}/tcp/{port}``: a raw connection (binary frames both ways),
  what the remote client's ``box.connect(port)`` uses; on the API (it carries no page).
- ``{port}-{box}.{domain}`` (``sandlot serve --port-domain DOMAIN``; ``HostRoutes``):
  the same at the root path, for apps that need one, with a key, or with a
  preview token given once as ``?sandlot_token=`` and then kept in a cookie of
  that host only.

HTTP goes with ``Connection: close`` to the guest (one connection per request)
and hop-by-hop headers, and a sandlot key, are not passed on. What the app answers
comes back without what would reach past the app: a cookie for other hosts or
paths, a service worker's wider scope, an order to clear the origin's data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlencode

import h11
from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse, StreamingResponse
from starlette.datastructures import Headers, QueryParams
from starlette.requests import cookie_parser
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from ..api import access
from ..api.access import MAX_PREVIEW_TTL, Preview
from ..api.box import AsyncBox
from ..api.contract import error_message
from ..api.loop import cancel_and_reap
from ..errors import (
    BoxNotFound,
    Forbidden,
    GuestOSError,
    InvalidArgument,
    NotFound,
    PortUnreachable,
    RequestError,
    SandlotError,
    Unsupported,
)
from . import origins
from .e2b import E2B_PORTS
from .e2b import PREFIX as E2B_PREFIX
from .origins import HOST_ROUTE
from .routes import answered_here, box_for, ws_box
from .state import KEY_SUBPROTOCOL, ServerState, accept_websocket, app_subprotocols, error_response

router = APIRouter()  # /p/...: previews, authenticated by their signature
v1 = APIRouter()  # under /v1, authenticated by a key

HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
              b"trailer", b"transfer-encoding", b"upgrade", b"host", b"x-api-key"}  # fmt: skip
# Through a path route or a preview an app answers on the content listener's origin, which
# the apps of every box share: it may not widen a service worker's scope past its own path,
# nor clear the origin's storage or cookies (Clear-Site-Data).
NOT_FROM_APPS = {b"service-worker-allowed", b"clear-site-data"}
SERVER_COOKIES = "sandlot"  # the prefix of the names of the server's own cookies (TOKEN_COOKIE)
RESPONSE_HEAD_TIMEOUT = 300.0  # seconds the app in the box may take to start answering
READ_CHUNK = 256 << 10
PREVIEW_RECHECK = 1.0  # seconds between checks that a preview still lives, while it streams
Until = Callable[[], Awaitable[None]]  # returns when a connection through a preview must end
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


# -- preview tokens (core/previews.py) ------------------------------------------------------


async def check_preview(server: ServerState, token: str) -> Preview:
    return await asyncio.to_thread(access.check_preview, token, server.home)


async def _until_ended(server: ServerState, token: str) -> None:
    """Return once the preview of ``token`` has ended (revoked, expired, its box gone)."""
    while True:
        await asyncio.sleep(PREVIEW_RECHECK)
        try:
            await check_preview(server, token)
        except SandlotError:
            return


# -- host-based routes ----------------------------------------------------------------------

TOKEN_PARAM = "sandlot_token"
TOKEN_COOKIE = "sandlot_preview"


class HostRoutes:
    """ASGI: requests to ``{port}-{box}.{domain}`` go to that port of the box at the
    root path. Each becomes the request of a path route (``/v1/boxes/{box}/ports/
    {port}/...`` with a key, ``/p/{token}/...`` with a preview cookie), so it is
    authenticated, limited and audited as those are. ``{box}`` is the box's id (or
    a lower-case name: host names have no case); a preview cookie is taken only
    on the host of its own box id and port."""

    def __init__(self, app: Any, state: ServerState, domain: str) -> None:
        self.app = app
        self.state = state
        self.pattern = origins.port_host_pattern(domain)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        m = self.pattern.match(headers.get("host", "").lower())
        if m is None:
            await self.app(scope, receive, send)
            return
        port, box = m.group(1), m.group(2)
        if scope["type"] == "http" and int(port) in E2B_PORTS:
            # E2B's SDKs reach envd and the code interpreter at {port}-{sandbox}.{domain}:
            # served by sandlot itself (server/e2b), which the sandbox's token authenticates
            path = E2B_PREFIX + scope["path"]
            extra = [(b"e2b-sandbox-id", box.encode()), (b"e2b-sandbox-port", port.encode())]
            ours = (b"e2b-sandbox-id", b"e2b-sandbox-port")
            kept = [(k, v) for k, v in scope["headers"] if k.lower() not in ours]
            scope = {**scope, "path": path, "raw_path": path.encode(), "headers": kept + extra,
                     HOST_ROUTE: True}  # fmt: skip
            await self.app(scope, receive, send)
            return
        query = QueryParams(scope.get("query_string", b"").decode("latin-1"))
        try:
            if TOKEN_PARAM in query and scope["type"] == "http":
                await self._keep_token(scope, query, port, box, send)
                return
            token = cookie_parser(headers.get("cookie", "")).get(TOKEN_COOKIE)
            if token is not None:
                self._check_token(token, port, box)
        except SandlotError as e:
            if scope["type"] == "http":
                await error_response(e)(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        path = scope["path"]
        inner = f"/p/{token}{path}" if token else f"/v1/boxes/{box}/ports/{port}{path}"
        scope = {**scope, "path": inner, "raw_path": inner.encode(), HOST_ROUTE: True}
        await self.app(scope, receive, send)

    def _check_token(self, token: str, port: str, box: str) -> None:
        """The token's signature, expiry and target (the /p/ route it goes on to reads its row)."""
        _, box_id, token_port = access.preview_target(token, self.state.home)
        if (box_id, token_port) != (box, int(port)):
            raise Forbidden(f"this preview is for port {token_port} of box {box_id}, not this host")

    async def _keep_token(
        self, scope: MutableMapping[str, Any], query: QueryParams, port: str, box: str, send: Any
    ) -> None:
        """Answer ``?sandlot_token=`` with the same URL without it, and the token as a
        cookie of this host (so the app's own links and requests carry it)."""
        token = query[TOKEN_PARAM]
        self._check_token(token, port, box)
        await check_preview(self.state, token)  # no cookie for a preview that has ended
        rest = urlencode([(k, v) for k, v in query.multi_items() if k != TOKEN_PARAM])
        location = scope["path"] + (f"?{rest}" if rest else "")
        secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
        cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax{secure}"
        await send({"type": "http.response.start", "status": 307,
                    "headers": [(b"location", location.encode()), (b"set-cookie", cookie.encode()),
                                (b"content-length", b"0")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b""})


def _prefix(request: Request | WebSocket, path_prefix: str) -> str:
    """Where the app in the box is mounted, as the client sees it."""
    return "" if request.scope.get(HOST_ROUTE) else path_prefix


# -- HTTP -----------------------------------------------------------------------------------


def _headers_for_box(request: Request, port: int, prefix: str) -> list[tuple[bytes, bytes]]:
    out = [(b"host", f"localhost:{port}".encode())]
    for k, v in request.headers.raw:
        lk = k.lower()
        if lk in HOP_BY_HOP or (lk == b"authorization" and v.lower().startswith(b"bearer sk-sl-")):
            continue
        if lk == b"sec-websocket-protocol" and KEY_SUBPROTOCOL.encode() in v:
            continue
        out.append((k, v))
    client = request.client.host if request.client else ""
    out += [(b"x-forwarded-host", request.headers.get("host", "").encode("latin-1")),
            (b"x-forwarded-proto", request.url.scheme.encode()),
            (b"x-forwarded-for", client.encode()),
            (b"x-forwarded-prefix", prefix.encode()),
            (b"connection", b"close")]  # fmt: skip
    has_body = "transfer-encoding" in request.headers or request.method in ("POST", "PUT", "PATCH")
    if has_body and "content-length" not in request.headers:
        out.append((b"transfer-encoding", b"chunked"))
    return out


async def proxy_http(request: Request, box: AsyncBox, port: int, path: str, prefix: str,
                     until: Until | None = None) -> Response:  # fmt: skip
    """Send ``request`` to ``port`` in ``box`` and stream the answer back (cut short
    when ``until()`` returns)."""
    sock = await _connect(box, port)
    reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
    conn = h11.Connection(h11.CLIENT)
    target = "/" + path + (f"?{request.url.query}" if request.url.query else "")

    async def send(event: Any) -> None:
        data = conn.send(event)
        if data:
            writer.write(data)
            await writer.drain()

    try:
        await send(h11.Request(method=request.method, target=target.encode(),
                               headers=_headers_for_box(request, port, prefix)))  # fmt: skip
        async for chunk in request.stream():
            if chunk:
                await send(h11.Data(data=chunk))
        await send(h11.EndOfMessage())
        head = await asyncio.wait_for(_next_event(conn, reader), RESPONSE_HEAD_TIMEOUT)
        if not isinstance(head, h11.Response):
            raise PortUnreachable(f"port {port} in box {box.name} did not answer with HTTP", box=box.name)
    except TimeoutError:
        writer.close()
        why = f"port {port} in box {box.name} did not answer within {RESPONSE_HEAD_TIMEOUT:.0f}s"
        raise PortUnreachable(why, box=box.name) from None
    except (h11.ProtocolError, OSError) as e:
        writer.close()
        why = f"port {port} in box {box.name} broke the HTTP exchange: {e}"
        raise PortUnreachable(why, box=box.name) from None

    async def body() -> AsyncIterator[bytes]:
        cut = asyncio.ensure_future(_close_when(until(), writer)) if until else None
        try:
            while True:
                event = await _next_event(conn, reader)
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return
        except (h11.ProtocolError, OSError):
            return  # the app broke off (or the preview ended): the client sees a short body
        finally:
            if cut is not None:
                cut.cancel()
            writer.close()

    response = StreamingResponse(body(), status_code=head.status_code)
    response.raw_headers = []
    for k, v in head.headers:
        name = bytes(k).lower()
        if name in HOP_BY_HOP or name in NOT_FROM_APPS:
            continue
        value = app_cookie(bytes(v), prefix) if name == b"set-cookie" else bytes(v)
        if value is not None:
            response.raw_headers.append((bytes(k), value))
    return response


def app_cookie(value: bytes, prefix: str) -> bytes | None:
    """A cookie an app in a box set, kept to that app: for this host alone (no ``Domain``:
    on a port host it would reach the other boxes' hosts, and the API's where they share
    a parent), and on a path route under the route's own path (cookies are not kept apart
    by port: the API's host would get them); None for one of the server's own names.
    ``prefix``: where the app is mounted ("" on a host of its own)."""
    text = value.decode("latin-1")
    first, _, rest = text.partition(";")
    if first.strip().lower().startswith(SERVER_COOKIES):
        return None
    kept, path = [first.strip()], "/"
    for attr in rest.split(";"):
        name = attr.split("=", 1)[0].strip().lower()
        if name == "domain" or not attr.strip():
            continue
        if name == "path":
            path = attr.split("=", 1)[1].strip() if "=" in attr else "/"
            continue
        kept.append(attr.strip())
    if prefix and not (path == prefix or path.startswith(prefix + "/")):
        path = prefix + (path if path.startswith("/") else "/")
    kept.append(f"Path={path}")
    return "; ".join(kept).encode("latin-1")


async def _close_when(ended: Awaitable[None], writer: asyncio.StreamWriter) -> None:
    await ended
    writer.close()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ_CHUNK))
            continue
        return event


async def _connect(box: AsyncBox, port: int) -> socket.socket:
    try:
        return await box.connect(port)
    except GuestOSError as e:
        raise PortUnreachable(f"port {port} in box {box.name}: {e.guest_message}", box=box.name) from None


# -- WebSocket -----------------------------------------------------------------------------


async def proxy_websocket(ws: WebSocket, box: AsyncBox, port: int, path: str,
                          until: Until | None = None) -> None:  # fmt: skip
    """Open a WebSocket to ``port`` in ``box`` (with the client's subprotocols), then
    accept the client's and pass messages both ways until either side closes, or
    ``until()`` returns (then the client's closes with 1008, policy violation)."""
    query = ws.url.query
    protocols = app_subprotocols([str(p) for p in ws.scope.get("subprotocols") or []])  # the client's
    try:
        sock = await _connect(box, port)
        inner = await ws_connect(f"ws://localhost:{port}/{path}" + (f"?{query}" if query else ""),
                                 sock=sock, subprotocols=[Subprotocol(p) for p in protocols] or None,
                                 open_timeout=30, max_size=None, compression=None)  # fmt: skip
    except (SandlotError, InvalidHandshake, OSError, TimeoutError) as e:
        err = e if isinstance(e, SandlotError) else PortUnreachable(
            f"port {port} in box {box.name} refused the WebSocket: {_handshake_reason(e)}")  # fmt: skip
        await accept_websocket(ws)
        await ws.send_json(error_message(err))
        await ws.close(1011)
        return
    await accept_websocket(ws, inner.subprotocol)
    await _splice(ws, inner, until)


def _handshake_reason(e: BaseException) -> str:
    if isinstance(e, InvalidStatus):
        return f"HTTP {e.response.status_code}"
    return str(e) or type(e).__name__


async def _splice(ws: WebSocket, inner: ClientConnection, until: Until | None) -> None:
    async def outward() -> None:
        async for msg in inner:
            if isinstance(msg, bytes):
                await ws.send_bytes(msg)
            else:
                await ws.send_text(msg)

    async def inward() -> None:
        async for msg in _from_client(ws):
            await inner.send(msg)

    ended = asyncio.ensure_future(until()) if until else None
    await _first_to_end(outward(), inward(), *([ended] if ended else []))
    with contextlib.suppress(Exception):
        await inner.close()
    with contextlib.suppress(Exception):
        await ws.close(1008 if ended is not None and ended.done() and not ended.cancelled() else 1000)


async def _from_client(ws: WebSocket) -> AsyncIterator[bytes | str]:
    """The client's messages, binary or text, until it goes away."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        if msg.get("bytes") is not None:
            yield msg["bytes"]
        elif msg.get("text") is not None:
            yield msg["text"]


async def _first_to_end(*coros: Any) -> None:
    """Run the coroutines until one ends (or fails); cancel the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_reap(tasks)


async def raw_tcp(ws: WebSocket, box: AsyncBox, port: int) -> None:
    """A raw connection: binary frames both ways; ``{"type": "eof"}`` from the client
    is a half close; the server says ``{"type": "connected"}`` once the port answered."""
    try:
        sock = await box.connect(port)  # a refusal goes to the client as the guest's error, as locally
    except SandlotError as e:
        await ws.send_json(error_message(e))
        await ws.close(1011)
        return
    reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
    await ws.send_json({"type": "connected"})

    async def outward() -> None:
        while data := await reader.read(READ_CHUNK):
            await ws.send_bytes(data)
        await ws.send_json({"type": "eof"})
        await asyncio.Event().wait()  # the client may still send: it closes when done

    async def inward() -> None:
        async for msg in _from_client(ws):
            if isinstance(msg, bytes):
                writer.write(msg)
                await writer.drain()
            else:  # {"type": "eof"}: nothing more to the box
                if _control_type(msg) != "eof":
                    await ws.send_json(
                        error_message(RequestError("a raw connection takes binary frames and eof"))
                    )
                    return
                if writer.can_write_eof():
                    writer.write_eof()

    with contextlib.suppress(WebSocketDisconnect, ConnectionClosed, OSError):
        await _first_to_end(outward(), inward())
    writer.close()
    with contextlib.suppress(Exception):
        await ws.close(1000)


# -- routes ---------------------------------------------------------------------------------


def _server(request: Request | WebSocket) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def _preview_box(request: Request | WebSocket, token: str) -> tuple[AsyncBox, int]:
    server = _server(request)
    preview = await check_preview(server, token)
    try:
        return await AsyncBox.get(preview.box_id, home=server.home), preview.port
    except BoxNotFound:
        gone = f"the box of this preview URL is gone ({preview.box_id})"
        raise BoxNotFound(gone, box=preview.box_id) from None


@router.api_route("/p/{token}/{path:path}", methods=METHODS, include_in_schema=False)
async def preview_http(request: Request, token: str, path: str) -> Response:
    box, port = await _preview_box(request, token)
    return await proxy_http(request, box, port, path, _prefix(request, f"/p/{token}"),
                            lambda: _until_ended(_server(request), token))  # fmt: skip


@router.get("/p/{token}", include_in_schema=False)
async def preview_root(request: Request) -> Response:
    return RedirectResponse(request.url.path + "/", status_code=307)


@router.websocket("/p/{token}/{path:path}")
async def preview_ws(ws: WebSocket, token: str, path: str) -> None:
    try:
        box, port = await _preview_box(ws, token)
    except SandlotError as e:
        await accept_websocket(ws)
        await ws.send_json(error_message(e))
        await ws.close(1008)
        return
    await proxy_websocket(ws, box, port, path, lambda: _until_ended(_server(ws), token))


async def port_http(request: Request, box: str, port: int, path: str) -> Response:
    """HTTP to ``port`` in the box (streamed both ways)."""
    b = await box_for(request, box)
    return await proxy_http(request, b, _port(port), path, _prefix(request, f"/v1/boxes/{box}/ports/{port}"))


for _method in METHODS:  # a route per method: each its own OpenAPI operation
    v1.add_api_route("/boxes/{box}/ports/{port}/{path:path}", port_http, methods=[_method], tags=["ports"],
                     name=f"port_http_{_method.lower()}")  # fmt: skip


@v1.get("/boxes/{box}/ports/{port}", include_in_schema=False)
async def port_root(request: Request) -> Response:
    """The app's root is ``.../ports/{port}/``: relative links resolve under it."""
    return RedirectResponse(request.url.path + "/", status_code=307)


@v1.websocket("/boxes/{box}/ports/{port}/{path:path}")
async def port_ws(ws: WebSocket, box: str, port: int, path: str) -> None:
    """A WebSocket to ``port`` in the box."""
    found = await ws_box(ws, box, accept=False)
    if found is not None:
        await proxy_websocket(ws, found[2], _port(port), path)


@v1.websocket("/boxes/{box}/tcp/{port}")
async def tcp_ws(ws: WebSocket, box: str, port: int) -> None:
    """A raw TCP connection to ``port`` in the box (``box.connect`` of the remote client)."""
    found = await ws_box(ws, box)
    if found is not None:
        await raw_tcp(ws, found[2], _port(port))


@answered_here("box.preview_url")
async def make_preview(request: Request, box: AsyncBox, params: Any) -> dict[str, Any]:
    """``box.preview_url``: a signed URL to ``port`` in the box that works without a key
    until it expires, or its key or it is revoked, or the box is removed."""
    if params.ttl > MAX_PREVIEW_TTL:
        raise InvalidArgument(f"ttl must be at most {MAX_PREVIEW_TTL} seconds, not {params.ttl}")
    server = _server(request)
    if params.at_host and not server.settings.port_domain:
        raise Unsupported(
            "preview_url(at_host=True): this server has no --port-domain, so a port has no host "
            "of its own; its preview is a path of the content port (at_host=False)",
            transport="http",
        )
    caller = request.state.caller
    preview, token = await asyncio.to_thread(
        access.make_preview, box.id, params.port, math.ceil(params.ttl), key_id=caller.key_id,
        key_name=caller.key_name, namespace=caller.namespace, home=server.home)  # fmt: skip
    request.state.audit = {"preview": preview.id, "port": preview.port, "expires_at": preview.expires_at}
    base = content_base(request)
    out: dict[str, Any] = {"url": f"{base}/p/{token}/", "port": params.port, "expires_at": preview.expires_at,
                           "id": preview.id}  # fmt: skip
    domain = server.settings.port_domain
    if domain:  # the same preview at the root path of the box's own host
        at_host = origins.port_host_origin(base, domain, params.port, box.id)
        out["host_url"] = f"{at_host}/?{TOKEN_PARAM}={token}"
        if params.at_host:
            out["url"] = out["host_url"]
    return out


def content_base(request: Request) -> str:
    """The content listener's origin, as the client of ``request`` reaches the server."""
    return origins.content_base(_server(request).settings, request.url.scheme, request.headers.get("host"))


@v1.get("/previews", tags=["ports"])
async def list_previews(request: Request, box: str | None = None, live: bool = True) -> dict[str, Any]:
    """The preview URLs the caller may see (its namespace's), oldest first: of one box, and
    the live ones only unless ``live`` is false (then those ended in the last week too)."""
    caller = request.state.caller
    box_id = (await box_for(request, box)).id if box is not None else None
    found = await asyncio.to_thread(access.list_previews, box=box_id, namespace=caller.namespace, live=live,
                                    home=_server(request).home)  # fmt: skip
    return {"previews": [p.to_json() for p in found]}


@v1.delete("/previews/{preview}", status_code=204, tags=["ports"])
async def revoke_preview(request: Request, preview: str) -> Response:
    """End a preview URL now, on every server of the home (404 if the caller may not see it)."""
    caller = request.state.caller
    home = _server(request).home
    try:
        found = await asyncio.to_thread(access.get_preview, preview, home)
    except NotFound:
        found = None
    if found is None or (caller.namespace is not None and found.namespace != caller.namespace):
        raise NotFound(f"no preview {preview}")
    request.state.box_id = found.box_id
    request.state.audit = {"preview": preview}
    await asyncio.to_thread(access.end_previews, preview=preview, why="revoked", home=home)
    return Response(status_code=204)


def _control_type(text: str) -> str | None:
    try:
        msg = json.loads(text)
    except ValueError:
        return None
    kind = msg.get("type") if isinstance(msg, dict) else None
    return kind if isinstance(kind, str) else None


def _port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise RequestError(f"{port} is not a TCP port (1..65535)")
    return port
