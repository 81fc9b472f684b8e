"""A process that a host holds for its clients (``sandlot serve``, a fleet node),
followed over a link that may drop: what ``AsyncProcess`` drives for a box that is
not in this process, as the agent's ``RemoteProcess`` is for a local one; and a
watch the host runs, followed over a stream of its messages.

The host reads the process's output into a bounded buffer whatever the client
does (``api/host.py``), so the client reads its link as it comes. The frames are
``api/contract.py``'s: output as ``[stream][offset][bytes]``, control messages as
JSON. If the link drops before the exit, the process is followed again from the
offsets received (the host is tried again for about 30 s if it cannot be
reached), so no byte is lost or repeated while the host's buffer holds it; stdin
written meanwhile waits for the new link. A WebSocket is one link
(``api/http.py``), a Ray stream with actor calls another (``fleet/backend.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ..errors import AgentTimeout, ConnectionLost, ProtocolError, SandlotError
from ..protocol.connection import OffsetStream
from ..protocol.exec import ExitStatus
from .contract import (
    CHUNK,
    STDOUT,
    control,
    decode_control,
    decode_output,
    encode_stdin,
    exit_status,
    file_event,
    raise_if_error,
)
from .fs import FileEvent

# Seconds between tries to reach the host again (about a minute in all): a restarted
# server needs a few seconds to import and listen, and a restart by hand or by a service
# manager on a loaded host takes tens of seconds (half a minute was seen to run out).
REATTACH_DELAYS = (0.1, 0.25, 0.5, 1.0, 2.0, *[3.0] * 19)


class LinkClosed(Exception):
    """The link ended (the host closed it, or it dropped)."""


class Link(Protocol):
    """One connection to a held process: frames from the host, messages to it."""

    async def recv(self) -> str | bytes:
        """The next frame; LinkClosed at the end."""
        ...

    async def send(self, message: str | bytes) -> None:
        """LinkClosed if the link is gone."""
        ...

    async def close(self) -> None: ...


Opener = Callable[[tuple[int, int]], Awaitable[Link]]  # a new link from these offsets of stdout, stderr


class FollowedStream(OffsetStream):
    """One output stream of a followed process. ``lost`` counts the bytes the host's
    buffer no longer held when they were asked for (a ``gap``)."""

    def __init__(self, stream: int) -> None:
        super().__init__(stream)
        self.lost = 0
        self._error: BaseException | None = None

    def gap(self, start: int, end: int) -> None:
        """The host no longer held ``start``..``end``: carry on from ``end``."""
        if end > self.received:
            self.lost += end - max(start, self.received)
            self.received = end

    def end(self, error: BaseException | None = None) -> None:
        if error is not None and self._error is None:
            self._error = error
        self.finish()

    async def read(self) -> bytes:
        """Next chunk, or b"" at the end of the stream (the process's error, if it failed)."""
        while not self.ready:
            if self._error is not None:
                raise self._error
            if self.ended:
                return b""
            await self.arrival()
        return self.take()

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)


class FollowedProcess:
    """A held process, followed over links that ``opener`` makes (``process.ProcessHandle``)."""

    def __init__(
        self, process_id: str, pid: int, tty: bool, opener: Opener, where: str, link: Link | None = None,
        *, offsets: tuple[int, int] = (0, 0),
    ) -> None:  # fmt: skip
        self.id = process_id
        self._pid = pid
        self.tty = tty
        self._opener = opener
        self._where = where
        self._stdout = FollowedStream(1)
        self._stderr = FollowedStream(2)
        self._stdout.start_at(offsets[0])
        self._stderr.start_at(offsets[1])
        self._link = link
        self._status: ExitStatus | None = None
        self._done: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self._done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        self._changed = asyncio.Event()  # set (and replaced) when the link is replaced, and at the end
        self._stdin_closed = False
        self._detached = False
        self.reattached = 0
        self._reader: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        if link is not None:
            self._reader = asyncio.ensure_future(self._read_loop())

    @property
    def pid(self) -> int:
        """The process id inside the guest."""
        return self._pid

    @property
    def stdout(self) -> FollowedStream:
        return self._stdout

    @property
    def stderr(self) -> FollowedStream:
        return self._stderr

    @property
    def status(self) -> ExitStatus | None:
        return self._status

    @property
    def finished(self) -> bool:
        return self._done.done()

    async def connect(self) -> None:
        """Open a link from the offsets received so far and follow it."""
        self._replace(await self._attach())
        self._reader = asyncio.ensure_future(self._read_loop())

    def _replace(self, link: Link) -> None:
        self._link = link
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _attach(self) -> Link:
        return await self._opener((self._stdout.received, self._stderr.received))

    async def _reattach(self) -> Link:
        """A new link after a drop; the host may be restarting, so a failure to reach it
        is tried again for a few seconds (an answer that refuses is final)."""
        for delay in REATTACH_DELAYS:
            try:
                return await self._attach()
            except (ConnectionLost, AgentTimeout):
                await asyncio.sleep(delay)
        return await self._attach()

    # -- reading ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                link = self._link
                assert link is not None
                progressed = False
                try:
                    while True:
                        msg = await link.recv()
                        progressed = True
                        if self._handle(msg):
                            await _close_quietly(link)
                            return
                except LinkClosed:
                    pass
                if self._detached or self._done.done():
                    return
                # the link dropped before the exit: follow again from what arrived
                if not progressed and self.reattached:
                    raise ConnectionLost(f"lost the connection to {self._where} and following process "
                                         f"{self.id} again brought nothing")  # fmt: skip
                self._replace(await self._reattach())
                self.reattached += 1
        except asyncio.CancelledError:
            self._finish(ConnectionLost(f"stopped following process {self.id}"))
            raise
        except SandlotError as e:
            self._finish(e)
        except Exception as e:  # whatever broke, the process's waiters hear of it
            self._finish(ConnectionLost(f"lost process {self.id} on {self._where}: {e}"))

    def _handle(self, msg: str | bytes) -> bool:
        """Take one frame; True at the last one."""
        if isinstance(msg, bytes):
            stream, offset, data = decode_output(msg)
            (self._stdout if stream == STDOUT else self._stderr).fresh(offset, data)
            return False
        ctl = decode_control(msg, self._where)
        kind = ctl["type"]
        raise_if_error(ctl)
        if kind == "exit":
            self._status = exit_status(ctl)
            self._finish(None)
            return True
        if kind == "gap":
            try:
                stream, start, end = int(ctl["stream"]), int(ctl["from"]), int(ctl["to"])
            except (KeyError, TypeError, ValueError):
                raise ProtocolError(f"{self._where}: a malformed gap message: {msg[:100]!r}") from None
            (self._stdout if stream == STDOUT else self._stderr).gap(start, end)
        elif kind == "error":
            raise ProtocolError(f"{self._where}: {msg[:200]}")
        return False  # "pong" and messages of later versions are ignored

    def _finish(self, error: BaseException | None) -> None:
        self._changed.set()  # writers waiting for a new link see the end
        self._stdout.end(error)
        self._stderr.end(error)
        if not self._done.done():
            if error is None and self._status is not None:
                self._done.set_result(self._status)
            else:
                self._done.set_exception(error or ConnectionLost(f"process {self.id} ended without an exit"))
        link = self._link
        if link is not None and error is not None:
            self._closing = asyncio.ensure_future(_close_quietly(link))

    async def wait(self) -> ExitStatus:
        """The exit status; output keeps arriving meanwhile."""
        return await asyncio.shield(self._done)

    # -- writing ------------------------------------------------------------------------------

    async def _send(self, message: str | bytes) -> None:
        for _attempt in (0, 1):
            link, changed = self._link, self._changed
            if self._done.done() or link is None:
                raise ConnectionLost(f"process {self.id} has ended")
            try:
                await link.send(message)
                return
            except LinkClosed:
                await changed.wait()  # the reader follows again, or gives up and ends the process
        raise ConnectionLost(f"lost the connection to {self._where} (process {self.id})")

    async def write_stdin(self, data: bytes) -> None:
        if self._stdin_closed:
            raise ValueError("stdin is already closed")
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            await self._send(encode_stdin(view[i : i + CHUNK]))

    async def close_stdin(self) -> None:
        if self._stdin_closed:
            return
        self._stdin_closed = True
        with contextlib.suppress(ConnectionLost):
            await self._send(control("stdin_eof"))

    async def signal(self, sig: int, *, group: bool = False) -> None:
        """Send a signal to the process (``group=True``: to its whole process group)."""
        if self._done.done():
            return
        with contextlib.suppress(ConnectionLost):
            await self._send(control("signal", signal=int(sig), group=group))

    async def resize(self, rows: int, cols: int) -> None:
        if not self.tty:
            raise ValueError("resize needs a process started with tty=True")
        await self._send(control("resize", rows=int(rows), cols=int(cols)))

    def detach(self) -> None:
        """Stop following the process; it keeps running in the box (the host holds it:
        ``box.attach(id)`` follows it again)."""
        self._detached = True
        if self._reader is not None:
            self._reader.cancel()
        self._finish(ConnectionLost(f"detached from process {self.id}"))


async def _close_quietly(link: Link) -> None:
    with contextlib.suppress(Exception):
        await link.close()


WATCH_BUFFER = 1024  # events read ahead of the caller; beyond them the host (and the box) hold them


class FollowedWatch:
    """A watch the host runs, followed over a stream of its messages (``host.watch_messages``:
    a server's NDJSON answer, a node's Ray stream) read by a task of its own, so that a
    caller's timeout never cuts a message in two. ``receive`` gives the next message
    (None at the stream's end); ``close`` ends the stream, and the host ends the watch."""

    def __init__(self, receive: Callable[[], Awaitable[dict[str, Any] | None]],
                 close: Callable[[], Awaitable[None]], where: str) -> None:  # fmt: skip
        self._receive, self._close, self._where = receive, close, where
        self._events: asyncio.Queue[FileEvent | BaseException | None] = asyncio.Queue(WATCH_BUFFER)
        self._reader: asyncio.Task[None] | None = None
        self._done = False

    async def open(self) -> FollowedWatch:
        try:
            first = await self._message()
            if first is None or first.get("type") != "watching":
                raise ProtocolError(f"{self._where}: a watch began with {first!r:.200}")
        except BaseException:
            await self._close()
            raise
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _message(self) -> dict[str, Any] | None:
        msg = await self._receive()
        if msg is not None:
            raise_if_error(msg)
        return msg

    async def _read(self) -> None:
        item: FileEvent | BaseException | None
        try:
            while (msg := await self._message()) is not None and msg.get("type") != "end":
                if msg.get("type") != "ping":
                    await self._events.put(file_event(msg, self._where))
            item = (
                None if msg is not None else ConnectionLost(f"{self._where}: a watch ended without its end")
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            item = e
        await self._events.put(item)

    async def next(self) -> FileEvent | None:
        if self._done:
            return None
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is None:
            self._done = True
            await self.aclose()
        return item

    async def aclose(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        await self._close()

    async def settle(self, timeout: float) -> bool:
        """A server's or a node's stream sends events as they come: it cannot say."""
        return False
