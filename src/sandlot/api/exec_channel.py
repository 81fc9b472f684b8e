"""The remote client's exec channel: one-shot execs over one WebSocket to
``sandlot serve`` (``WS /v1/exec``), many at once, each a message out and a
message back, matched by id.

Why not one HTTP request per exec: an exec of ``true`` takes a few milliseconds
in the box, and an HTTP request (parsing, routing, validation, a new answer
each time) costs about as much again; a frame on an open WebSocket costs a
tenth of it. The channel opens on the first exec and stays open; a server
without it (an older one) is asked over HTTP from then on.

An exec whose answer has not come when the channel closes raises ConnectionLost:
it may have run, so it is not sent again (as an HTTP request cut off mid-way).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ..errors import ConnectionLost, Forbidden, NotFound, ProtocolError, from_dict


class ChannelUnavailable(Exception):
    """The server offers no exec channel, or this exec was not sent on it (ask over HTTP)."""


class ExecChannel:
    def __init__(self, connect: Callable[[], Awaitable[ClientConnection]], url: str) -> None:
        self._connect = connect  # opens the WebSocket (the client's headers, TLS, timeouts)
        self._url = url
        self._ws: ClientConnection | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._opening = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self.offered = True  # False once the server said it has no channel

    async def call(self, box: str, body: dict[str, Any]) -> dict[str, Any]:
        """The answer of one exec (the REST route's), or the error it raised."""
        ws = await self._open()
        call_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answer
        try:
            try:
                await ws.send(json.dumps({**body, "id": call_id, "box": box}))
            except ConnectionClosed:
                if not answer.done():  # not sent, and the channel gave no reason: ask over HTTP
                    raise ChannelUnavailable("the channel closed before the exec was sent") from None
            message = await answer
        finally:
            self._pending.pop(call_id, None)
        if "error" in message:
            raise from_dict(message["error"])
        result = message.get("result")
        if not isinstance(result, dict):
            raise ProtocolError(f"{self._url}: an exec channel answer without a result")
        return result

    async def _open(self) -> ClientConnection:
        async with self._opening:
            if self._ws is not None:
                return self._ws
            if not self.offered:
                raise ChannelUnavailable("the server has no exec channel")
            try:
                ws = await self._connect()
            except (NotFound, Forbidden):  # a server from before the channel (no such WebSocket route)
                self.offered = False
                raise ChannelUnavailable("the server has no exec channel") from None
            self._ws = ws
            self._reader = asyncio.ensure_future(self._read(ws))
            return ws

    async def _read(self, ws: ClientConnection) -> None:
        failure: Exception = ConnectionLost(
            f"{self._url}: the exec channel closed before the answer came; the command may have run"
        )
        try:
            async for text in ws:
                try:
                    message = json.loads(text)
                    call_id = message["id"]
                except (ValueError, KeyError, TypeError):
                    failure = ProtocolError(f"{self._url}: the exec channel sent a message out of protocol")
                    break
                if call_id is None:  # the server ended the channel (a key it refused), and says why
                    error = message.get("error")
                    failure = from_dict(error) if isinstance(error, dict) else failure
                    break
                waiting = self._pending.get(call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(message)
        except ConnectionClosed as e:  # say how: a keepalive that timed out, a server that stopped...
            failure = ConnectionLost(
                f"{self._url}: the exec channel closed before the answer came ({e}); the command may have run"
            )
        finally:
            if self._ws is ws:
                self._ws = None
            for waiting in self._pending.values():
                if not waiting.done():
                    waiting.set_exception(failure)
            await ws.close()

    async def aclose(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
