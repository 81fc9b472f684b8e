"""Exec service: start a process in the guest and follow it to its end."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal as _signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConnectionLost, GuestOSError, ProtocolError
from . import wire
from .connection import AgentConnection, Channel, InboundStream, OutboundStream
from .wire import ExecFlag, Fields, SignalFlag, T, Tag

# How long a command waits for a box whose commands are frozen for a save (the agent
# answers EBUSY then): a save's freeze ends with it, or with its lease (10 s of guest time)
FROZEN_WAIT_LIMIT = 60.0


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended: ``exit_code`` follows the shell (128+N when killed by signal N)."""

    exit_code: int
    signal: int | None = None
    core_dumped: bool = False
    oom_killed: bool = False  # the OOM killer killed a process of this command


@dataclass(frozen=True, slots=True)
class ExecRequest:
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    tty: bool = False
    rows: int = 24
    cols: int = 80
    stdin: bool = False
    clear_env: bool = False

    def encode(self) -> bytes:
        parts = [wire.tlv(Tag.ARG, a) for a in self.argv]
        for k, v in (self.env or {}).items():
            parts.append(wire.tlv(Tag.ENV, f"{k}={v}"))
        if self.cwd is not None:
            parts.append(wire.tlv(Tag.CWD, self.cwd))
        if self.user is not None:
            parts.append(wire.tlv(Tag.USER, self.user))
        flags = (
            (ExecFlag.TTY if self.tty else 0)
            | (ExecFlag.STDIN if self.stdin or self.tty else 0)
            | (ExecFlag.CLEAR_ENV if self.clear_env else 0)
        )
        parts.append(wire.tlv(Tag.FLAGS, flags))
        if self.tty:
            parts.append(wire.tlv(Tag.ROWS, self.rows))
            parts.append(wire.tlv(Tag.COLS, self.cols))
        payload = b"".join(parts)
        if len(payload) > wire.MAX_PAYLOAD:
            raise ValueError(f"command line and environment take {len(payload)} bytes; the limit is 1 MiB")
        return payload


class RemoteProcess:
    """A running guest process: its streams, its stdin, and its exit."""

    def __init__(self, conn: AgentConnection, channel: Channel, pid: int, tty: bool, window: int) -> None:
        self._conn = conn
        self._channel = channel
        self.pid = pid
        self.tty = tty
        self.stdout: InboundStream = channel.stream(wire.STREAM_STDOUT)
        self.stderr: InboundStream = channel.stream(wire.STREAM_STDERR)
        self._stdin = OutboundStream(channel, window)
        channel.outbound = self._stdin
        self._status: ExitStatus | None = None
        self._exit_task: asyncio.Task[ExitStatus] | None = None

    @classmethod
    async def start(
        cls, conn: AgentConnection, req: ExecRequest, *, kind: T = T.EXEC, payload: bytes | None = None
    ) -> RemoteProcess:
        """Start the command. While the box's commands are frozen for a save (which
        another process may be making), the agent starts none: asked again, with a
        backoff, until the thaw (a save's freeze lasts at most its lease). ``kind`` and
        ``payload``: another request the agent answers as an exec (an ARCHIVE's)."""
        payload = req.encode() if payload is None else payload
        loop = asyncio.get_running_loop()
        give_up = loop.time() + FROZEN_WAIT_LIMIT
        wait = 0.02
        while True:
            ch = conn.open_channel()
            try:
                ch.send(kind, payload)
                frame = await ch.expect(T.EXEC_STARTED, timeout=conn.request_timeout)
                break
            except GuestOSError as exc:
                ch.close()
                frozen = exc.errno == errno.EBUSY and "frozen for a save" in exc.message
                if not frozen or loop.time() + wait > give_up:
                    raise
            except BaseException:
                ch.close()
                raise
            await asyncio.sleep(wait)
            wait = min(wait * 2, 0.5)
        f = Fields(frame.payload)
        return cls(conn, ch, f.u32(Tag.PID, 0) or 0, req.tty, f.u32(Tag.WINDOW, wire.WINDOW) or wire.WINDOW)

    @classmethod
    def adopt(cls, conn: AgentConnection, channel_id: int, pid: int, tty: bool) -> RemoteProcess:
        """Follow a process that an earlier host of this session started (see
        ``AgentConnection.adopt``): its output from what the agent still holds on."""
        proc = cls(conn, conn.adopt(channel_id), pid, tty, conn.info.window if conn.info else wire.WINDOW)
        proc._stdin.adopt()
        return proc

    @property
    def channel_id(self) -> int:
        return self._channel.id

    @property
    def status(self) -> ExitStatus | None:
        return self._status

    async def write_stdin(self, data: bytes) -> None:
        if self._stdin.closed:
            raise ValueError("stdin is already closed")
        await self._stdin.write(data)

    async def close_stdin(self) -> None:
        await self._stdin.close()

    async def signal(self, sig: int = _signal.SIGKILL, *, group: bool = False) -> None:
        """Send a signal to the process (``group=True``: to its whole process group)."""
        if self._status is not None:
            return
        payload = wire.tlv(Tag.SIGNAL, int(sig)) + wire.tlv(Tag.FLAGS, SignalFlag.GROUP if group else 0)
        with contextlib.suppress(ConnectionLost):
            self._channel.send(T.SIGNAL, payload)
            await self._conn.drain()

    async def resize(self, rows: int, cols: int) -> None:
        if not self.tty:
            raise ValueError("resize needs a process started with tty=True")
        self._channel.send(T.RESIZE, wire.tlv(Tag.ROWS, rows) + wire.tlv(Tag.COLS, cols))
        await self._conn.drain()

    async def _await_exit(self) -> ExitStatus:
        while True:
            frame = await self._channel.next_frame()
            if frame.type == T.EXIT:
                f = Fields(frame.payload)
                sig = f.u32(Tag.SIGNAL)
                oom = bool(f.u32(Tag.OOM_KILLED, 0))
                if sig is not None:
                    status = ExitStatus(128 + sig, sig, bool(f.u32(Tag.CORE_DUMPED, 0)), oom)
                else:
                    status = ExitStatus(f.u32(Tag.EXIT_CODE, 0) or 0, oom_killed=oom)
                self._status = status
                self._channel.close()
                return status
            if frame.type == T.ERROR:
                from .connection import error_from_frame

                raise error_from_frame(frame)
            raise ProtocolError(f"unexpected frame 0x{frame.type:02x} on exec channel {self._channel.id}")

    async def wait(self, *, drain: bool = True) -> ExitStatus:
        """Wait for the exit. ``drain`` keeps unread output flowing (into memory)
        so the process cannot block on a full pipe while we wait."""
        if self._status is not None:
            return self._status
        if drain:
            self.stdout.drain()
            self.stderr.drain()
        if self._exit_task is None:
            self._exit_task = asyncio.ensure_future(self._await_exit())
        return await asyncio.shield(self._exit_task)

    def detach(self) -> None:
        """Stop following the process; it keeps running in the guest."""
        self._channel.close()
