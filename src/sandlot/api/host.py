"""The side where the boxes are, for clients elsewhere: what ``sandlot serve`` and a
fleet node do for the boxes of their home, whatever carries the requests (HTTP and
WebSocket, or Ray actor calls).

- ``run``: one operation of ``api/contract.py``'s table, its arguments as JSON in,
  its answer as JSON out, on the local backend.
- ``ProcessTable``: processes held for clients. Each process's output is read into
  a bounded buffer whatever the clients do, so a client may drop and follow it
  again (by process id, from the offsets it has) without a byte lost or sent
  twice while the buffer holds it; what fell out of it is reported as a gap.
  ``frames`` is what a client is sent, ``take_input`` what it sends.
- ``watch_messages``: a watch as the messages a client reads.

Every held process is started with ``keep=<its id>``, so a host started after one
that died takes it over (``ProcessTable.take_over``): the box still holds the
output not yet taken, and clients follow it again by the same id. What the dead
host had taken and not sent on is a gap.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from ..core.options import BY_NAME
from ..errors import InvalidArgument, NotFound, RequestError, SandlotError
from .backend import BoxRef, Cell, Command, SnapshotRef, Write
from .contract import (
    STDERR,
    STDOUT,
    STREAM_BY_KEY,
    Operation,
    Strict,
    control,
    decode_control,
    decode_stdin,
    encode_output,
    error_message,
    exec_json,
    exit_message,
    file_event_json,
    file_json,
    validated,
)
from .files import AsyncFiles, AsyncWatch
from .local import LocalBackend
from .process import AsyncProcess, ExecResult

BUFFER_BYTES = 4 << 20  # per stream: what a client that comes back late can still get
FRAME_BYTES = 256 << 10
KEEP_EXITED_S = 600.0  # an exited process stays reattachable this long
MAX_HELD = 4096
CELL_MESSAGES = 8  # a cell's messages waiting for a client elsewhere
WATCH_HEARTBEAT = 15.0  # seconds of quiet after which a watch stream says it is still there


async def run(backend: LocalBackend, op: Operation, target: BoxRef | SnapshotRef, params: Strict) -> Any:
    """Operation ``op`` on ``target`` with ``params``: its answer as JSON."""
    value = await backend.call(op.scope, op.name, target, params.model_dump())
    kind = op.result.kind
    if kind == "box":
        assert isinstance(target, BoxRef)
        return target.info
    if kind in ("boxes", "snapshots"):
        return op.result.encode([ref.info for ref in value])
    if kind == "snapshot":
        return value.info
    return op.result.encode(value)


async def run_exec(backend: LocalBackend, ref: BoxRef, call: Any) -> dict[str, Any]:
    """A one-shot exec (``contract.ExecIn``): its answer (``contract.exec_json``)."""
    if call.stdin is not None and call.stdin_b64 is not None:
        raise InvalidArgument("give stdin or stdin_b64, not both")
    stdin = call.stdin.encode() if call.stdin is not None else None
    if call.stdin_b64 is not None:
        try:
            stdin = base64.b64decode(call.stdin_b64, validate=True)
        except binascii.Error:
            raise InvalidArgument("stdin_b64 is not base64") from None
    cmd = Command(tuple(call.argv), call.env, call.cwd, call.user, stdin=stdin is not None)
    result = await backend.exec(ref, cmd, stdin, call.timeout)
    return exec_json(result, text=getattr(call, "output", "both") != "b64")


def box_options(wanted: dict[str, Any]) -> dict[str, Any]:
    """``contract.BoxCreate``'s fields (``image``, ``start`` and ``snapshot`` aside) as the
    local backend takes them (each option's ``from_wire``: ports as ``HOST:GUEST`` specs,
    secrets as ``Secret`` objects)."""
    options = {k: v for k, v in wanted.items() if k not in ("image", "start", "snapshot")}
    for name, value in options.items():
        option = BY_NAME.get(name)
        if option is not None and option.from_wire is not None:
            options[name] = option.from_wire(value)
    return options


def arguments(op: Operation, data: Any) -> Strict:
    """A client's JSON arguments as the operation's model (InvalidArgument if they cannot be)."""
    params: Strict = validated(op.params, data if isinstance(data, dict) else {})
    return params


# -- held processes ------------------------------------------------------------------------


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
    def __init__(self, box_id: str, proc: AsyncProcess, process_id: str) -> None:
        self.id = process_id
        self.box_id = box_id
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
        except Exception as e:  # a bug must still end the process for its clients, with a reason
            self.error = SandlotError(f"following the process failed: {type(e).__name__}: {e}")
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

    def last_message(self) -> dict[str, Any]:
        if self.error is not None:
            return error_message(self.error)
        assert self.result is not None
        return exit_message(self.result)

    async def frames(self, offsets: dict[int, int]) -> AsyncIterator[bytes | str]:
        """What a client following from ``offsets`` is sent: its output as it comes (a gap
        where the buffer no longer holds it), then the exit (or the error)."""
        self.clients += 1
        try:
            while True:
                changed = self.changed()
                sent = False
                for stream, ring in self.rings.items():
                    at, data = ring.read_from(offsets[stream])
                    if at > offsets[stream]:
                        yield control("gap", stream=stream, **{"from": offsets[stream], "to": at})
                        offsets[stream] = at
                    if data:
                        yield encode_output(stream, at, data)
                        offsets[stream] = at + len(data)
                        sent = True
                if sent:
                    continue
                if self.done and all(offsets[s] >= r.end for s, r in self.rings.items()):
                    yield json.dumps(self.last_message(), separators=(",", ":"))
                    return
                await changed.wait()
        finally:
            self.clients -= 1

    async def take_input(self, message: bytes | str) -> str | None:
        """A client's frame: stdin bytes, or a control message; the answer to send back
        (a pong), if any. RequestError for a frame out of protocol."""
        proc = self.proc
        if isinstance(message, bytes):
            data = decode_stdin(message)
            if not self.done:
                await proc.write_stdin(data)
            return None
        try:
            ctl = decode_control(message, "a client")
        except SandlotError as e:
            raise RequestError(str(e)) from None
        kind = ctl["type"]
        try:
            if kind == "stdin_eof":
                await proc.close_stdin()
            elif kind == "signal":
                await proc.kill(int(ctl["signal"]), group=bool(ctl.get("group", True)))
            elif kind == "resize":
                await proc.resize(int(ctl["rows"]), int(ctl["cols"]))
            elif kind == "ping":
                return control("pong")
            else:
                raise RequestError(f"a message out of protocol: unknown message type {kind!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise RequestError(f"a message out of protocol: {e}") from None
        except SandlotError:
            if not self.done:  # a signal or stdin that raced the exit is no error
                raise
        return None


class ProcessTable:
    """Every process a host holds, by id. ``on_taken_exit`` is told of the end of each
    process taken over from a host that died."""

    def __init__(
        self, backend: LocalBackend, on_taken_exit: Callable[[HeldProcess], None] | None = None
    ) -> None:
        self.backend = backend
        self.held: dict[str, HeldProcess] = {}
        self.on_taken_exit = on_taken_exit
        self.taking_over: dict[str, asyncio.Lock] = {}

    def check_room(self) -> None:
        """Refuse a new process when the table is full (exited ones are pruned first)."""
        self._prune()
        if len(self.held) >= MAX_HELD:
            raise RequestError(f"{MAX_HELD} processes are held already; reattach or wait for some")

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

    def find(self, box_id: str, process_id: str) -> HeldProcess:
        held = self.get(box_id, process_id)
        if held is None:
            raise NotFound(f"no process {process_id!r} in box {box_id}", box=box_id)
        return held

    async def found(self, ref: BoxRef, process_id: str) -> HeldProcess:
        """A held process of the box, one a dead host held taken over first (NotFound if none)."""
        if self.get(ref.id, process_id) is None:
            await self.take_over(ref)
        return self.find(ref.id, process_id)

    async def listed(self, ref: BoxRef) -> dict[str, Any]:
        """``box.processes``'s answer: the box's held processes, a dead host's taken over first."""
        await self.take_over(ref)
        return {"processes": [h.describe() for h in self.of_box(ref.id)]}

    def hold(
        self,
        box_id: str,
        proc: AsyncProcess,
        process_id: str,
        on_exit: Callable[[HeldProcess], None] | None = None,
    ) -> HeldProcess:
        held = HeldProcess(box_id, proc, process_id)
        self.held[held.id] = held
        if on_exit is not None:
            held.on_done(on_exit)
        return held

    async def spawn(
        self, ref: BoxRef, request: Any, on_exit: Callable[[HeldProcess], None] | None = None
    ) -> HeldProcess:
        """Start ``request`` (a ``contract.SpawnIn``) in the box and hold it."""
        self.check_room()
        process_id = new_process_id()
        fields = request.model_dump(exclude={"type"})
        proc = await self.backend.spawn(ref, Command(tuple(fields.pop("argv")), **fields), keep=process_id)
        return self.hold(ref.id, proc, process_id, on_exit)

    async def take_over(self, ref: BoxRef) -> int:
        """Hold the processes a dead host of this home held in the box (once: takers of one
        box wait their turn); how many."""
        async with self.taking_over.setdefault(ref.id, asyncio.Lock()):
            taken = await self.backend.taken_over(ref)
            for proc in taken:
                self.hold(ref.id, proc, proc.key or new_process_id(), self.on_taken_exit)
            return len(taken)


# -- code cells ---------------------------------------------------------------------------


async def code_messages(backend: LocalBackend, ref: BoxRef, params: Any) -> AsyncIterator[dict[str, Any]]:
    """A cell (``contract.RunCodeIn``) as a client reads it, as it goes: ``{"type":
    "stdout"|"stderr", "text"}``, ``{"type": "result", "result": BUNDLE}``, then one
    ``{"type": "execution", ...}`` or an error message (a CodeTimeout carries the execution
    so far). A client that leaves mid-cell interrupts it."""
    from .code import Callbacks, context_id, result_json

    # a client slower than the cell slows the cell (the callbacks wait for room): nothing of
    # it piles up here
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(CELL_MESSAGES)
    callbacks = Callbacks(
        lambda text: events.put({"type": "stdout", "text": text}),
        lambda text: events.put({"type": "stderr", "text": text}),
        lambda r: events.put({"type": "result", "result": result_json(r)}),
    )

    async def cell() -> None:
        try:
            execution = await backend.run_code(ref, Cell(**params.model_dump()), callbacks)
            await events.put({"type": "execution", "execution": execution.to_dict()})
        except SandlotError as e:
            await events.put(error_message(e))
        finally:
            await events.put(None)

    task = asyncio.ensure_future(cell())
    try:
        while (event := await events.get()) is not None:
            yield event
    finally:
        if not task.done():  # the client left mid-cell
            task.cancel()
            with contextlib.suppress(SandlotError):
                await backend.box_interrupt_code_context(ref, context_id(params.context, params.language))


# -- the streams of api/contract.py's table, by key -----------------------------------------

# What the home that holds a box runs for each stream (``contract.STREAMS``): a server
# stream's frames (bytes, or JSON messages) from its arguments; a client stream's answer
# (JSON) from its arguments and the bytes that come. Every transport serves them from here
# (``server/routes.py``, ``fleet/node.py``), each implementation registered by its key.
Served = Callable[[LocalBackend, BoxRef, Any], AsyncIterator[Any]]
Taken = Callable[[LocalBackend, BoxRef, Any, AsyncIterable[bytes]], Awaitable[Any]]
STREAMED: dict[str, Served] = {}
TAKEN: dict[str, Taken] = {}


def _registrar(kind: str, table: dict[str, Any]) -> Callable[[str], Callable[[Any], Any]]:
    def registering(key: str) -> Callable[[Any], Any]:
        def register(fn: Any) -> Any:
            assert STREAM_BY_KEY[key].kind == kind and key not in table, key
            table[key] = fn
            return fn

        return register

    return registering


serves = _registrar("server", STREAMED)  # register the implementation of a server stream, by key
takes = _registrar("client", TAKEN)  # and of a client stream


@serves("box.follow_logs")
def _follow_logs(backend: LocalBackend, ref: BoxRef, p: Any) -> AsyncIterator[bytes]:
    return backend.follow_logs(ref, p.lines)


@serves("files.read")
def _read(backend: LocalBackend, ref: BoxRef, p: Any) -> AsyncIterator[bytes]:
    return backend.read(ref, p.path, p.offset, p.length)


@serves("files.get_archive")
def _get_archive(backend: LocalBackend, ref: BoxRef, p: Any) -> AsyncIterator[bytes]:
    return backend.get_archive(ref, p.path, follow_symlinks=p.follow_symlinks)


@serves("files.watch")
async def _watch(backend: LocalBackend, ref: BoxRef, p: Any) -> AsyncIterator[dict[str, Any]]:
    async for message in watch_messages(await begun_watch(backend, ref, p)):
        yield message


@serves("box.run_code")
def _run_code(backend: LocalBackend, ref: BoxRef, p: Any) -> AsyncIterator[dict[str, Any]]:
    return code_messages(backend, ref, p)


@takes("files.write")
async def _write(backend: LocalBackend, ref: BoxRef, p: Any, data: AsyncIterable[bytes]) -> Any:
    await backend.write(ref, p.path, data, Write(**p.model_dump(exclude={"path"})))
    return file_json(await AsyncFiles(backend, ref).stat(p.path))


@takes("files.put_archive")
async def _put_archive(backend: LocalBackend, ref: BoxRef, p: Any, data: AsyncIterable[bytes]) -> Any:
    return await backend.put_archive(ref, p.path, data, user=p.user)


# -- watches -------------------------------------------------------------------------------


async def begun_watch(backend: LocalBackend, ref: BoxRef, params: Any) -> AsyncWatch:
    """A watch (``contract.WatchIn``) of the box, begun: a missing path fails here, before
    any message."""
    return await AsyncFiles(backend, ref).watch(params.path, recursive=params.recursive).start()


async def watch_messages(watch: AsyncWatch) -> AsyncIterator[dict[str, Any]]:
    """A begun watch as a client reads it: ``{"type": "watching"}``, then one event a
    message, ``{"type": "ping"}`` after 15 s of quiet, and last ``{"type": "end"}`` (the
    path or the box went away) or an error message. The watch ends with the messages."""
    try:
        yield {"type": "watching", "path": watch.path, "recursive": watch.recursive}
        while True:
            try:
                event = await watch.next_event(WATCH_HEARTBEAT)
            except TimeoutError:
                yield {"type": "ping"}
                continue
            except SandlotError as e:
                yield error_message(e)
                return
            if event is None:
                yield {"type": "end"}
                return
            yield file_event_json(event)
    finally:
        await watch.aclose()  # the client went away, or the watch ended: the box frees it
