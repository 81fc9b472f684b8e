"""Processes the server holds for WebSocket clients: their output is read into a
bounded buffer whatever the clients do, so a client may drop and reattach (by
process id, from the offsets it has) without a byte lost or sent twice while
the buffer holds it; what fell out of it is reported as a gap.

Every process is started with ``keep=<its id>``, so a server started after this
one died (or was stopped) takes it over (``ProcessTable.take_over``): the box
still holds the output not yet taken, and clients reattach by the same id. What
the dead server had taken and not sent on is a gap."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import Field, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..api.box import AsyncBox
from ..api.process import AsyncProcess, ExecResult
from ..errors import RequestError, SandlotError
from .models import Strict, error_json

STDOUT, STDERR = 1, 2
BUFFER_BYTES = 4 << 20  # per stream: what a client that comes back late can still get
FRAME_BYTES = 256 << 10
KEEP_EXITED_S = 600.0  # an exited process stays reattachable this long
MAX_HELD = 4096
HEADER = struct.Struct(">BQ")


class SpawnIn(Strict):
    type: str = Field(pattern="^spawn$")
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    tty: bool = False
    stdin: bool = True
    rows: int = Field(default=24, ge=1, le=10000)
    cols: int = Field(default=80, ge=1, le=10000)


class Ring:
    """The newest ``limit`` bytes of a stream, addressed by their offset in the stream."""

    def __init__(self, limit: int = BUFFER_BYTES) -> None:
        self.limit = limit
        self.data = bytearray()
        self.start = 0  # the offset of data[0]
        self.ended = False

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    def append_at(self, offset: int, chunk: bytes) -> None:
        """Add the bytes at ``offset`` of the stream (past the end: what lay between is lost)."""
        if offset > self.end:
            self.data.clear()
            self.start = offset
        self.data += chunk
        if len(self.data) > self.limit:
            drop = len(self.data) - self.limit
            del self.data[:drop]
            self.start += drop

    def read_from(self, offset: int, most: int = FRAME_BYTES) -> tuple[int, bytes]:
        """(the offset the bytes start at, at most ``most`` bytes from ``offset`` on);
        the start is past ``offset`` when the ring no longer holds those bytes."""
        at = max(offset, self.start)
        i = at - self.start
        return at, bytes(self.data[i : i + most])


def new_process_id() -> str:
    return uuid.uuid4().hex[:16]


class HeldProcess:
    def __init__(self, box: AsyncBox, proc: AsyncProcess, process_id: str) -> None:
        self.id = process_id
        self.box_id = box.id
        self.proc = proc
        self.tty = proc.tty
        self.rings = {STDOUT: Ring(), STDERR: Ring()}
        self.result: ExecResult | None = None
        self.error: SandlotError | None = None
        self.exited_at: float | None = None
        self.clients = 0
        self._tick = asyncio.Event()
        self._task = asyncio.ensure_future(self._pump())

    def _notify(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """The event the next append or the exit sets. Take it *before* reading the
        rings: what is appended after the read then still wakes the waiter."""
        return self._tick

    async def _read(self, stream: int) -> None:
        source = self.proc.stdout if stream == STDOUT else self.proc.stderr
        async for chunk in source:
            self.rings[stream].append_at(source.offset - len(chunk), chunk)
            self._notify()
        self.rings[stream].ended = True

    async def _pump(self) -> None:
        try:
            await asyncio.gather(self._read(STDOUT), self._read(STDERR))
            self.result = await self.proc.result()
        except SandlotError as e:
            self.error = e
        finally:
            self.exited_at = time.monotonic()
            self._notify()

    def on_done(self, callback: Callable[[HeldProcess], None]) -> None:
        self._task.add_done_callback(lambda _t: callback(self))

    @property
    def done(self) -> bool:
        return self.exited_at is not None

    def describe(self) -> dict[str, Any]:
        r = self.result
        return {
            "id": self.id,
            "pid": self.proc.pid,
            "argv": list(self.proc.argv),
            "tty": self.tty,
            "exit_code": None if r is None else r.exit_code,
            "clients": self.clients,
            "stdout": self.rings[STDOUT].end,
            "stderr": self.rings[STDERR].end,
        }

    def exit_message(self) -> dict[str, Any]:
        if self.error is not None:
            return error_message(self.error)
        r = self.result
        assert r is not None
        return {"type": "exit", "exit_code": r.exit_code, "signal": r.signal, "oom_killed": r.oom_killed}


class ProcessTable:
    """Every process the server holds, by id."""

    def __init__(self) -> None:
        self.held: dict[str, HeldProcess] = {}

    def check_room(self) -> None:
        """Refuse a new process when the table is full (exited ones are pruned first)."""
        self._prune()
        if len(self.held) >= MAX_HELD:
            raise RequestError(f"the server holds {MAX_HELD} processes already; reattach or wait for some")

    def _prune(self) -> None:
        now = time.monotonic()
        for pid, h in list(self.held.items()):
            if h.exited_at is not None and now - h.exited_at > KEEP_EXITED_S and not h.clients:
                del self.held[pid]

    def of_box(self, box_id: str) -> list[HeldProcess]:
        self._prune()
        return [h for h in self.held.values() if h.box_id == box_id]

    def get(self, box_id: str, process_id: str) -> HeldProcess | None:
        h = self.held.get(process_id)
        return h if h is not None and h.box_id == box_id else None

    async def take_over(self, box: AsyncBox, on_exit: Callable[[HeldProcess], None]) -> int:
        """Hold the processes a dead server of this home held in ``box``; how many."""
        taken = await box.taken_over()
        for proc in taken:
            held = HeldProcess(box, proc, proc.key or new_process_id())
            self.held[held.id] = held
            held.on_done(on_exit)
        return len(taken)


def error_message(err: SandlotError) -> dict[str, Any]:
    """A stream's error message: the routes' error shape under ``"type": "error"``."""
    return {"type": "error", "error": error_json(err)}


def out_of_protocol(why: str) -> dict[str, Any]:
    return error_message(RequestError(why))


async def spawn(ws: WebSocket, box: AsyncBox, table: ProcessTable,
                on_exit: Callable[[HeldProcess], None]) -> None:  # fmt: skip
    """The first message asks for a process: start it, then serve it."""
    try:
        first = json.loads(await asyncio.wait_for(ws.receive_text(), 30.0))
        req = SpawnIn.model_validate(first)
    except (ValueError, ValidationError, KeyError, TypeError, TimeoutError) as e:
        await ws.send_json(out_of_protocol(f"the first message must be a spawn request: {e}"))
        await ws.close(1008)
        return
    process_id = new_process_id()
    try:
        table.check_room()
        proc = await box.spawn(*req.argv, env=req.env, cwd=req.cwd, user=req.user, tty=req.tty,
                               rows=req.rows, cols=req.cols, stdin=req.stdin, keep=process_id)  # fmt: skip
    except SandlotError as e:
        await ws.send_json(error_message(e))
        await ws.close(1011)
        return
    held = HeldProcess(box, proc, process_id)
    table.held[held.id] = held
    held.on_done(on_exit)
    await ws.send_json({"type": "started", "id": held.id, "pid": proc.pid})
    await serve(ws, held, {STDOUT: 0, STDERR: 0})


async def serve(ws: WebSocket, held: HeldProcess, offsets: dict[int, int]) -> None:
    """Send ``held``'s output from ``offsets`` on and take the client's stdin and
    control messages, until the process exits or the client goes away (which
    leaves the process running)."""
    held.clients += 1
    reader = asyncio.ensure_future(_from_client(ws, held))
    try:
        writer = asyncio.ensure_future(_to_client(ws, held, offsets))
        done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        for t in (reader, writer):
            if t not in done:
                t.cancel()
            with contextlib.suppress(BaseException):
                await t
    finally:
        held.clients -= 1


async def _to_client(ws: WebSocket, held: HeldProcess, offsets: dict[int, int]) -> None:
    while True:
        changed = held.changed()
        sent = False
        for stream, ring in held.rings.items():
            at, data = ring.read_from(offsets[stream])
            if at > offsets[stream]:
                await ws.send_json({"type": "gap", "stream": stream, "from": offsets[stream], "to": at})
                offsets[stream] = at
            if data:
                await ws.send_bytes(HEADER.pack(stream, at) + data)
                offsets[stream] = at + len(data)
                sent = True
        if sent:
            continue
        if held.done and all(offsets[s] >= r.end for s, r in held.rings.items()):
            await ws.send_json(held.exit_message())
            await ws.close(1000)
            return
        await changed.wait()


async def _from_client(ws: WebSocket, held: HeldProcess) -> None:
    proc = held.proc
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if (data := msg.get("bytes")) is not None:
                if not data or data[0] != 0:
                    await _refuse(ws, "a binary frame from the client must be [0][stdin bytes]")
                    return
                if not held.done:
                    await proc.write_stdin(data[1:])
                continue
            try:
                ctl = json.loads(msg.get("text") or "")
                kind = ctl["type"]
                if kind == "stdin_eof":
                    await proc.close_stdin()
                elif kind == "signal":
                    await proc.kill(int(ctl["signal"]), group=bool(ctl.get("group", True)))
                elif kind == "resize":
                    await proc.resize(int(ctl["rows"]), int(ctl["cols"]))
                elif kind == "ping":
                    await ws.send_json({"type": "pong"})
                else:
                    raise ValueError(f"unknown message type {kind!r}")
            except (ValueError, KeyError, TypeError) as e:
                await _refuse(ws, f"a message out of protocol: {e}")
                return
            except SandlotError as e:
                if not held.done:  # a signal or stdin that raced the exit is no error
                    await ws.send_json(error_message(e))
    except WebSocketDisconnect:
        return


async def _refuse(ws: WebSocket, why: str) -> None:
    with contextlib.suppress(Exception):
        await ws.send_json(out_of_protocol(why))
        await ws.close(1008)
