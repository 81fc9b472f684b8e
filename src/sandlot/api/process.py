"""Results and handles of commands run in a box, shaped like ``subprocess``.

``box.exec(...)`` returns an :class:`ExecResult` (like ``CompletedProcess``);
``box.spawn(...)`` returns a :class:`Process` (like ``Popen``) whose output you
can stream while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal as _signal
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from ..errors import CommandFailed, ConnectionLost, ExecTimeout
from ..protocol.exec import ExitStatus

log = logging.getLogger("sandlot")


@dataclass(frozen=True, slots=True)
class ExecResult:
    """A finished command.

    ``exit_code`` follows the shell: 0..255, or 128+N when killed by signal N
    (``signal`` is then N). ``stdout``/``stderr`` are text (UTF-8, undecodable
    bytes replaced); the exact bytes are in ``stdout_bytes``/``stderr_bytes``.
    """

    argv: tuple[str, ...]
    exit_code: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    signal: int | None = None
    duration: float = 0.0
    pid: int = 0
    oom_killed: bool = False  # the box ran out of memory and the OOM killer ended a process of it

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def returncode(self) -> int:
        """Alias of ``exit_code``, as in ``subprocess``."""
        return self.exit_code

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> ExecResult:
        """Raise CommandFailed unless the command succeeded; return self."""
        if not self.ok:
            how = f"signal {self.signal}" if self.signal else f"exit code {self.exit_code}"
            if self.oom_killed:
                how += ", killed by the out-of-memory killer"
            tail = self.stderr.strip()[-500:]
            raise CommandFailed(
                f"{' '.join(self.argv)!r} failed with {how}" + (f": {tail}" if tail else ""), self
            )
        return self


class OutputStream(Protocol):
    """What a process's stdout or stderr offers: the agent's ``InboundStream`` locally,
    a followed stream for a box elsewhere (``api/follow.py``)."""

    async def read(self) -> bytes:
        """The next chunk, or b"" at the end of the stream."""
        ...

    async def read_all(self) -> bytes:
        """Everything until the end of the stream."""
        ...

    def take_buffered(self) -> bytes:
        """The bytes received and not read yet, taken out of the stream."""
        ...

    @property
    def offset(self) -> int:
        """How far into the stream the bytes read so far reach."""
        ...


class ProcessHandle(Protocol):
    """What ``AsyncProcess`` drives: the agent's ``RemoteProcess`` locally, a process
    the host holds, followed over a link, for a box elsewhere (``api/follow.py``)."""

    @property
    def pid(self) -> int: ...

    @property
    def tty(self) -> bool: ...

    @property
    def stdout(self) -> OutputStream: ...

    @property
    def stderr(self) -> OutputStream: ...

    @property
    def status(self) -> ExitStatus | None: ...

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def signal(self, sig: int, *, group: bool) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...

    async def wait(self) -> ExitStatus:
        """The exit status, once the process has ended; unread output keeps flowing meanwhile."""
        ...

    def detach(self) -> None: ...


def _result(
    argv: tuple[str, ...], status: ExitStatus, out: bytes, err: bytes, t0: float, pid: int
) -> ExecResult:
    return ExecResult(argv, status.exit_code, out, err, status.signal, time.monotonic() - t0, pid,
                      status.oom_killed)  # fmt: skip


class AsyncStream:
    """One output stream of a running process: ``async for chunk in stream``."""

    def __init__(self, inbound: OutputStream) -> None:
        self._in = inbound

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self._in.read():
            yield chunk

    async def read(self) -> bytes:
        """Everything until the stream ends."""
        return await self._in.read_all()

    @property
    def offset(self) -> int:
        """How far into the stream the chunks read so far reach: the offset just past
        the last one (a process taken over from a dead host starts past 0)."""
        return self._in.offset

    async def lines(self) -> AsyncIterator[bytes]:
        """Complete lines (with their newline), the last one possibly without."""
        pending = b""
        async for chunk in self:
            pending += chunk
            *full, pending = pending.split(b"\n")
            for line in full:
                yield line + b"\n"
        if pending:
            yield pending


@dataclass(eq=False)
class AsyncProcess:
    """A command running in a box. Read its streams, feed its stdin, signal it, wait for it."""

    argv: tuple[str, ...]
    _remote: ProcessHandle
    _t0: float = field(default_factory=time.monotonic)
    key: str | None = None  # the ``keep=`` it was started with
    # told once how the process ended, where that is news (``core.events``): a kind
    # ("command_oom", "command_timeout"), a reason and details
    _on_news: Callable[[str, str, dict[str, Any]], Awaitable[None]] | None = None

    @property
    def pid(self) -> int:
        """The process id inside the guest."""
        return self._remote.pid

    @property
    def tty(self) -> bool:
        """It runs on a terminal (``spawn(tty=True)``)."""
        return self._remote.tty

    @property
    def stdout(self) -> AsyncStream:
        return AsyncStream(self._remote.stdout)

    @property
    def stderr(self) -> AsyncStream:
        return AsyncStream(self._remote.stderr)

    @property
    def returncode(self) -> int | None:
        st = self._remote.status
        return None if st is None else st.exit_code

    async def write_stdin(self, data: bytes | str) -> None:
        await self._remote.write_stdin(data.encode() if isinstance(data, str) else data)

    async def close_stdin(self) -> None:
        await self._remote.close_stdin()

    async def kill(self, sig: int = _signal.SIGKILL, *, group: bool = True) -> None:
        """Signal the process; by default its whole process group (each command runs in its own)."""
        await self._remote.signal(sig, group=group)

    async def send_signal(self, sig: int) -> None:
        """Signal only the process itself, as ``Popen.send_signal`` does."""
        await self._remote.signal(sig, group=False)

    async def resize(self, rows: int, cols: int) -> None:
        """Change the terminal size (processes started with ``tty=True``)."""
        await self._remote.resize(rows, cols)

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit and return the exit code. Unread output keeps
        flowing into memory meanwhile, so waiting can never deadlock.
        On ``timeout`` the process is killed and ExecTimeout raised."""
        status = await self._wait_status(timeout)
        return status.exit_code

    async def _tell(self, kind: str, reason: str, **detail: Any) -> None:
        tell, self._on_news = self._on_news, None
        if tell is not None:
            try:
                await tell(kind, reason, {"argv": list(self.argv), "pid": self.pid, **detail})
            except Exception as exc:  # the command's result matters more than its news
                log.warning("could not record that %r %s: %s", self.argv, reason, exc)

    async def _wait_status(self, timeout: float | None) -> ExitStatus:
        try:
            status = await asyncio.wait_for(self._remote.wait(), timeout)
        except TimeoutError:
            await self.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._remote.wait(), 10.0)
            await self._tell("command_timeout", f"ran past its {timeout:g}s timeout and was killed",
                             timeout=timeout)  # fmt: skip
            raise ExecTimeout(
                f"{' '.join(self.argv)!r} ran past its {timeout}s timeout and was killed",
                self._remote.stdout.take_buffered(),
                self._remote.stderr.take_buffered(),
            ) from None
        if status.oom_killed:
            await self._tell("command_oom", "the OOM killer ended a process of it: the box ran out of memory",
                             exit_code=status.exit_code, signal=status.signal)  # fmt: skip
        return status

    async def result(self, timeout: float | None = None) -> ExecResult:
        """Wait, then return an ExecResult holding the output not yet read."""
        status = await self._wait_status(timeout)
        return _result(
            self.argv,
            status,
            self._remote.stdout.take_buffered(),
            self._remote.stderr.take_buffered(),
            self._t0,
            self.pid,
        )

    def detach(self) -> None:
        """Stop following the process; it keeps running in the box, its output is dropped."""
        self._remote.detach()


StdinSource = bytes | str | IO[bytes] | AsyncIterable[bytes] | None


async def feed(proc: AsyncProcess, stdin: StdinSource) -> None:
    """Send ``stdin`` to the process, then close it. A process that exits first is not an error."""
    with contextlib.suppress(ConnectionLost):
        if isinstance(stdin, str):
            await proc.write_stdin(stdin.encode())
        elif isinstance(stdin, bytes | bytearray | memoryview):
            await proc.write_stdin(bytes(stdin))
        elif hasattr(stdin, "read"):
            while chunk := await asyncio.to_thread(stdin.read, 256 * 1024):  # type: ignore[union-attr]
                await proc.write_stdin(chunk)
        elif stdin is not None:
            async for chunk in stdin:
                await proc.write_stdin(chunk)
        await proc.close_stdin()


async def feed_and_wait(proc: AsyncProcess, stdin: StdinSource, timeout: float | None) -> ExecResult:
    """Send ``stdin`` to a process as it reads it, close it, and wait for the process's result."""
    feeder = asyncio.ensure_future(feed(proc, stdin))
    try:
        return await proc.result(timeout)
    finally:
        if not feeder.done():
            feeder.cancel()
        with contextlib.suppress(BaseException):
            await feeder
