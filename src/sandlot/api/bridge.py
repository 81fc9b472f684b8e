"""A TCP port inside a box as a socket on the host (``box.connect(port)``).

Locally the agent runs a relay (its own binary in relay mode, ``/proc/1/exe
--relay PORT``: ``guest/agent/relay.c``) as an ordinary command whose stdin and
stdout are the connection, so the bytes go over the agent channel the host
already has: no published port, no network device, whatever the box's network
policy. A box of a server does the same over a WebSocket of the server
(``api/http.py``). Either way the caller gets one end of a socket pair and
sandlot's loop copies between the other end and the box, so the socket works
with anything: blocking code, ``asyncio.open_connection(sock=...)``, an HTTP
client, a database driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..errors import InvalidArgument, guest_os_error
from .loop import cancel_and_reap
from .process import AsyncProcess

RELAY = ("/proc/1/exe", "--relay")  # the agent, in relay mode; /proc/1/exe works from any root
RELAY_CONNECT_FAILED = 111
CHUNK = 256 << 10
ABORT_WAIT = 10.0  # seconds for a killed relay's exit

_bridges: set[asyncio.Task[None]] = set()  # running copies, so they are not collected mid-way


def check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be a TCP port number (1..65535), not {port!r}")
    return port


class Duplex(Protocol):
    """Both directions of one connection into a box."""

    async def read(self) -> bytes:
        """The next bytes from the box; b"" once its side has closed."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def close_write(self) -> None:
        """No more bytes to the box (a half close)."""
        ...

    async def abort(self) -> None:
        """End the connection at once."""
        ...


class RelayDuplex:
    """The relay command's stdout and stdin as a connection."""

    def __init__(self, proc: AsyncProcess) -> None:
        self._proc = proc
        self._out = aiter(proc.stdout)

    async def read(self) -> bytes:
        return await anext(self._out, b"")

    async def write(self, data: bytes) -> None:
        await self._proc.write_stdin(data)

    async def close_write(self) -> None:
        await self._proc.close_stdin()

    async def abort(self) -> None:
        # Its exit read, the agent lets its channel go: a channel left open would count
        # as a command in flight (keeping an idle box awake) for as long as the session.
        if self._proc.returncode is None:
            await self._proc.kill()
        try:
            await asyncio.wait_for(self._proc.wait(), ABORT_WAIT)
        except asyncio.CancelledError:
            self._proc.detach()
            raise
        except Exception:  # the relay, or the link to it, is gone already: nothing left to end
            self._proc.detach()


async def relay_connected(proc: AsyncProcess, port: int | str, timeout: float) -> None:
    """Wait for the relay's word that ``port`` (or a Unix socket's path) answered;
    raise the guest's reason if not."""
    said = b""
    try:
        async with asyncio.timeout(timeout):
            async for chunk in proc.stderr:
                said += chunk
                if said.endswith(b"\n"):
                    break
    except TimeoutError:
        await proc.kill()
        why = f"{_target(port)} in the box did not answer within {timeout}s"
        raise guest_os_error(errno.ETIMEDOUT, why) from None
    if said == b"connected\n":
        return
    code = await proc.wait()
    text = said.decode(errors="replace").strip()
    m = re.match(r"errno (\d+): (.*)", text)
    if code == RELAY_CONNECT_FAILED and m:
        raise guest_os_error(int(m.group(1)), m.group(2))
    raise guest_os_error(
        errno.EIO, f"could not reach {_target(port)} in the box: {text or f'exit code {code}'}"
    )


def _target(port: int | str) -> str:
    return f"port {port}" if isinstance(port, int) else port


async def open_relay(
    spawn: Callable[..., Awaitable[AsyncProcess]], port: int | str, timeout: float
) -> RelayDuplex:
    """A connection to ``port`` on a box's loopback, or to the Unix socket at an
    absolute guest path: the relay started by the box's ``spawn``, once it said
    the far side answered."""
    proc = await spawn(*RELAY, str(port), user="root", stdin=True)
    await relay_connected(proc, port, timeout)
    return RelayDuplex(proc)


def socket_bridge(duplex: Duplex) -> socket.socket:
    """One end of a socket pair whose other end sandlot's loop copies to and from ``duplex``."""
    ours, theirs = socket.socketpair()
    bridge(ours, duplex)
    return theirs


def bridge(ours: socket.socket, duplex: Duplex) -> asyncio.Task[None]:
    """Copy between a connected socket and ``duplex`` on the running loop, both ways,
    until both have finished; then close ``ours`` and end ``duplex``. The task that
    copies ends when the connection has (awaiting it is optional)."""
    loop = asyncio.get_running_loop()
    ours.setblocking(False)

    async def from_box() -> None:
        while chunk := await duplex.read():
            await loop.sock_sendall(ours, chunk)
        ours.shutdown(socket.SHUT_WR)

    async def to_box() -> None:
        while data := await loop.sock_recv(ours, CHUNK):
            await duplex.write(data)
        await duplex.close_write()

    async def copy() -> None:
        tasks = [asyncio.ensure_future(from_box()), asyncio.ensure_future(to_box())]
        try:
            # both directions end on their own; an error in either ends the connection
            for done in asyncio.as_completed(tasks):
                await done
        except (Exception, asyncio.CancelledError):
            pass  # whatever ended it, the connection ends: both sides hear of it below
        finally:
            try:
                await cancel_and_reap(tasks)
            finally:
                ours.close()
                with contextlib.suppress(Exception):
                    await duplex.abort()

    task = asyncio.ensure_future(copy())
    _bridges.add(task)
    task.add_done_callback(_bridges.discard)
    return task


class Forward:
    """A listening socket of this host whose every connection is bridged to a port in a
    box (``serve_forward``). It lives until ``aclose()`` or the end of sandlot's loop."""

    def __init__(self, listener: socket.socket, task: asyncio.Task[None]) -> None:
        self._listener = listener
        self._task = task
        self.address: tuple[str, int] = listener.getsockname()[:2]

    @property
    def closed(self) -> bool:
        return self._task.done()

    async def aclose(self) -> None:
        await cancel_and_reap([self._task])
        self._listener.close()


async def serve_forward(
    spawn: Callable[..., Awaitable[AsyncProcess]],
    port: int,
    *,
    address: str = "127.0.0.1",
    timeout: float = 10.0,
) -> Forward:
    """Listen on ``address`` (an ephemeral port) and bridge each connection to ``port`` on
    the box's loopback through its relay, as ``box.connect`` does: for a browser on this
    host, where a box has no server to sign a preview URL. A connection the box refuses
    is closed at once."""
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(64)
    return Forward(listener, serve_on(listener, lambda: open_relay(spawn, port, timeout)))


def serve_on(
    listener: socket.socket,
    connect: Callable[[], Awaitable[Duplex]],
    refused: Callable[[BaseException], Awaitable[None]] | None = None,
) -> asyncio.Task[None]:
    """Take each connection of a listening socket and bridge it to the duplex ``connect``
    opens for it, each on its own (a slow ``connect`` holds up no other connection). One
    whose duplex cannot be opened is reset (its peer reads ECONNRESET, as from a port
    that refuses it), ``refused`` told why first. The task that accepts runs until cancelled."""
    loop = asyncio.get_running_loop()
    listener.setblocking(False)

    async def one(conn: socket.socket) -> None:
        try:
            duplex = await connect()
        except Exception as exc:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            if refused is not None:
                with contextlib.suppress(Exception):
                    await refused(exc)
            return
        bridge(conn, duplex)

    async def accept() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            task = asyncio.ensure_future(one(conn))
            _bridges.add(task)
            task.add_done_callback(_bridges.discard)

    return asyncio.ensure_future(accept())
