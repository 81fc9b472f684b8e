"""The remote client's exec channel against a small WebSocket server speaking its
protocol (the real server's side is tested in tests/vm/test_server.py): answers
matched by id in any order, the channel's end failing what is still waiting,
a refused key, and the fall back to HTTP where a server has no channel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

import sandlot
from sandlot.api.exec_channel import ExecChannel
from sandlot.api.http import HttpBackend

Handler = Callable[[ServerConnection], Awaitable[None]]


@asynccontextmanager
async def channel_server(handler: Handler) -> AsyncIterator[ExecChannel]:
    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        channel = ExecChannel(lambda: connect(f"ws://127.0.0.1:{port}"), "ws://test")
        try:
            yield channel
        finally:
            await channel.aclose()


def result(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": call["id"], "result": {"exit_code": 0, "stdout": " ".join(call["argv"])}}


def test_unit_answers_are_matched_by_id_whatever_their_order() -> None:
    async def reversed_answers(ws: ServerConnection) -> None:
        calls = [json.loads(await ws.recv()) for _ in range(3)]
        for call in reversed(calls):
            await ws.send(json.dumps(result(call)))
        await ws.wait_closed()

    async def main() -> None:
        async with channel_server(reversed_answers) as ch:
            got = await asyncio.gather(*(ch.call("b1", {"argv": ["echo", str(i)]}) for i in range(3)))
            assert [r["stdout"] for r in got] == ["echo 0", "echo 1", "echo 2"]

    asyncio.run(main())


def test_unit_errors_come_back_as_the_same_exceptions() -> None:
    async def refusing(ws: ServerConnection) -> None:
        call = json.loads(await ws.recv())
        error = {"type": "BoxNotFound", "code": "box_not_found", "message": "no box 'x'", "box": "x"}
        await ws.send(json.dumps({"id": call["id"], "error": error}))
        await ws.wait_closed()

    async def main() -> None:
        async with channel_server(refusing) as ch:
            with pytest.raises(sandlot.BoxNotFound, match="no box"):
                await ch.call("x", {"argv": ["true"]})

    asyncio.run(main())


def test_unit_a_closed_channel_fails_what_waits_and_the_next_call_opens_another() -> None:
    opened = []

    async def drop_the_first(ws: ServerConnection) -> None:
        opened.append(ws)
        call = json.loads(await ws.recv())
        if len(opened) == 1:
            await ws.close()  # the exec may have run: its caller must hear of it
            return
        await ws.send(json.dumps(result(call)))
        await ws.wait_closed()

    async def main() -> None:
        async with channel_server(drop_the_first) as ch:
            with pytest.raises(sandlot.ConnectionLost, match="may have run"):
                await ch.call("b1", {"argv": ["true"]})
            assert (await ch.call("b1", {"argv": ["again"]}))["stdout"] == "again"
            assert len(opened) == 2

    asyncio.run(main())


def test_unit_a_refused_key_fails_the_call_with_the_servers_error() -> None:
    async def refuse_key(ws: ServerConnection) -> None:
        await ws.recv()  # (if the refusal comes before the call is sent, it goes over HTTP instead)
        error = {"type": "Unauthorized", "code": "unauthorized", "message": "a valid API key is needed"}
        await ws.send(json.dumps({"id": None, "error": error}))
        await ws.close(1008)

    async def main() -> None:
        async with channel_server(refuse_key) as ch:
            with pytest.raises(sandlot.Unauthorized):
                await ch.call("b1", {"argv": ["true"]})

    asyncio.run(main())


def test_unit_a_server_without_the_channel_is_asked_over_http() -> None:
    asked: list[str] = []

    def http(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"exit_code": 3, "stdout": "", "stderr": ""})

    async def main() -> None:
        client = HttpBackend("http://127.0.0.1:9", api_key="k", transport=httpx.MockTransport(http))

        async def no_such_route() -> Any:
            raise sandlot.Forbidden("403 at the handshake: no WebSocket route /v1/exec")

        client._channel = ExecChannel(no_such_route, "http://127.0.0.1:9")
        for _ in range(2):
            answer = await client._exec("b1", {"argv": ["false"]})
            assert answer["exit_code"] == 3
        assert asked == ["POST /v1/boxes/b1/exec"] * 2
        assert client._channel.offered is False  # asked once, then HTTP only
        await client.aclose()

    asyncio.run(main())
