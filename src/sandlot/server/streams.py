"""Held processes over WebSocket: a spawn's socket and an attach's carry the frames of
``api/contract.py`` between a client and a process the server holds
(``api/host.py``'s ``ProcessTable``, which keeps its output whatever the client does)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..api.backend import BoxRef
from ..api.contract import STDERR, STDOUT, SpawnIn, error_message
from ..api.host import HeldProcess, ProcessTable
from ..errors import RequestError, SandlotError

SPAWN_REQUEST_TIMEOUT = 30.0


def out_of_protocol(why: str) -> dict[str, object]:
    return error_message(RequestError(why))


async def spawn(
    ws: WebSocket, box: BoxRef, table: ProcessTable, on_exit: Callable[[HeldProcess], None]
) -> None:
    """The first message asks for a process: start it, then serve it."""
    try:
        first = json.loads(await asyncio.wait_for(ws.receive_text(), SPAWN_REQUEST_TIMEOUT))
        req = SpawnIn.model_validate(first)
    except (ValueError, ValidationError, KeyError, TypeError, TimeoutError) as e:
        await ws.send_json(out_of_protocol(f"the first message must be a spawn request: {e}"))
        await ws.close(1008)
        return
    try:
        held = await table.spawn(box, req, on_exit)
    except SandlotError as e:
        await ws.send_json(error_message(e))
        await ws.close(1011)
        return
    await ws.send_json({"type": "started", "id": held.id, "pid": held.proc.pid})
    await serve(ws, held, {STDOUT: 0, STDERR: 0})


async def serve(ws: WebSocket, held: HeldProcess, offsets: dict[int, int]) -> None:
    """Send ``held``'s output from ``offsets`` on and take the client's stdin and
    control messages, until the process exits or the client goes away (which
    leaves the process running)."""
    reader = asyncio.ensure_future(_from_client(ws, held))
    writer = asyncio.ensure_future(_to_client(ws, held, offsets))
    done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
    for t in (reader, writer):
        if t not in done:
            t.cancel()
        with contextlib.suppress(BaseException):
            await t


async def _to_client(ws: WebSocket, held: HeldProcess, offsets: dict[int, int]) -> None:
    async for frame in held.frames(offsets):
        if isinstance(frame, bytes):
            await ws.send_bytes(frame)
        else:
            await ws.send_text(frame)
    await ws.close(1000)


async def _from_client(ws: WebSocket, held: HeldProcess) -> None:
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("bytes")
            try:
                answer = await held.take_input(data if data is not None else msg.get("text") or "")
            except RequestError as e:
                await _refuse(ws, str(e))
                return
            except SandlotError as e:
                await ws.send_json(error_message(e))
                continue
            if answer is not None:
                await ws.send_text(answer)
    except WebSocketDisconnect:
        return


async def _refuse(ws: WebSocket, why: str) -> None:
    with contextlib.suppress(Exception):
        await ws.send_json(out_of_protocol(why))
        await ws.close(1008)
