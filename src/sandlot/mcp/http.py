"""The tools over streamable HTTP, mounted at ``/mcp`` of ``sandlot serve``.

Every tool call goes through the server's own routes, in process: the MCP
endpoint hands the caller's API key to a ``sandlot.connect_async`` client whose
transport is the server's ASGI application (``httpx.ASGITransport``), so a tool
call is checked, namespaced, held to the key's quotas and audited exactly as the
REST request it becomes. The key was checked before the MCP request got here
(the server's guard answers 401 without a valid one)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx
from mcp.server import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager

from ..api.client import AsyncClient
from ..errors import Unauthorized
from ..tools.toolkit import Limits, Toolkit
from .server import build

PATH = "/mcp"
INTERNAL_URL = "http://sandlot.mcp.internal"  # never resolved: requests go to the app in process
KITS_KEPT = 256  # toolkits (one per key) kept between requests

ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


def presented_key(headers: Any) -> str | None:
    """The API key of a request, as the server's guard reads it."""
    key = headers.get("x-api-key")
    if key is None:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else None
    return key or None


class Endpoint:
    """The MCP endpoint of a server: ``app`` (ASGI, for the route), ``lifespan()`` (for
    the server's own). ``inner``: the server's guarded application, which tool calls
    go through; given as a function, since the endpoint is built before it."""

    def __init__(self, inner: Callable[[], ASGIApp], *, image: str | None = None,
                 limits: Limits | None = None) -> None:  # fmt: skip
        self.inner = inner
        self.image = image
        self.limits = limits
        self.kits: OrderedDict[str | None, Toolkit] = OrderedDict()
        self.closing: set[asyncio.Future[None]] = set()  # dropped toolkits closing their desktops
        # stateless: each POST stands alone, so no session outlives the key that opened it
        self.manager = StreamableHTTPSessionManager(app=build(self.toolkit_for), stateless=True,
                                                    json_response=True)  # fmt: skip
        self.app = StreamableHTTPASGIApp(self.manager)

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with self.manager.run():
            try:
                yield
            finally:
                for kit in self.kits.values():
                    await kit.close_desktops()

    async def toolkit_for(self, ctx: ServerRequestContext[Any, Any]) -> Toolkit:
        request = ctx.request
        if request is None:
            raise Unauthorized("no HTTP request carries this MCP message")
        key = presented_key(request.headers)
        kit = self.kits.get(key)
        if kit is None:
            transport = httpx.ASGITransport(app=self.inner(), raise_app_exceptions=False)
            client = AsyncClient(INTERNAL_URL, api_key=key or "", transport=transport, timeout=600)
            kit = self.kits[key] = Toolkit(client, image=self.image, limits=self.limits)
            while len(self.kits) > KITS_KEPT:
                _, dropped = self.kits.popitem(last=False)
                closing = asyncio.ensure_future(dropped.close_desktops())
                self.closing.add(closing)
                closing.add_done_callback(self.closing.discard)
        else:
            self.kits.move_to_end(key)
        return kit
