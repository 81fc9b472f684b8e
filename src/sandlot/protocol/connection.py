"""Host side of the agent protocol: one connection, many channels.

A generic machine in the style of ``qemu.qmp.protocol``: connect, handshake,
a reader task that routes frames to channels, flow-controlled streams, and
reconnection. Exec and files are thin services on top (``exec.py``,
``files.py``); they never touch the socket directly.

Reconnection keeps channels alive: the agent retains every byte the host has
not acknowledged, so after the socket is replaced (the host reconnects, or a VM
was restored behind a new socket) each channel asks for a resend from the
offsets it has and nothing is lost or duplicated.

A *later* host process can take a session over: a connection made with the
session token of a host that died finds that host's channels still live in the
agent (``orphans``) and may ``adopt`` them. An adopted stream starts at whatever
offset the agent resends from, which only the first frame tells.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from ..errors import AgentTimeout, ConnectionLost, GuestOSError, ProtocolError, Unsupported, guest_os_error
from . import wire
from .wire import Fields, Frame, T, Tag

log = logging.getLogger("sandlot.protocol")


@contextlib.contextmanager
def newer_agent_needed(cannot: str, to: str) -> Iterator[None]:
    """An agent older than the operation answers ENOSYS: say what it ``cannot`` do, and
    what to do about it (restart the box) ``to`` do it."""
    try:
        yield
    except GuestOSError as e:
        if e.errno != errno.ENOSYS:
            raise
        raise Unsupported(
            f"this box's agent cannot {cannot} ({e}): it runs an older sandlot's agent; "
            f"restart the box (or start one from a new snapshot) to {to}"
        ) from None


Connector = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

DEFAULT_REQUEST_TIMEOUT = 30.0
HELLO_RETRY = 1.0
# A HELLO answered later than this set the guest's clock that far behind: set it again
CLOCK_SLACK = 0.25
CLOCK_TRIES = 5
# How long a lost connection keeps asking its owner and connecting again while the
# agent's socket is missing or refuses: a VM that another process stops or replaces
# (a rollback) closes its sockets before its process exits, so the owner may still
# see the old VM alive for a moment, and the new VM's socket appears only once it runs.
RECONNECT_PATIENCE = 30.0
RECONNECT_PAUSE = 0.1
# How long the agent of a VM its owner says lives has to answer HELLO once connected
# again (HELLO is sent again each second): a guest just restored, its memory perhaps
# read lazily from the storage tier, on a loaded, emulated host is slow, not gone
RECONNECT_HELLO = 60.0


@dataclass(frozen=True, slots=True)
class AgentInfo:
    protocol_version: int
    agent_version: str
    boot_id: str
    window: int
    max_payload: int
    aslr: int | None = None  # kernel.randomize_va_space in force, where the HELLO asked for one


def error_from_frame(frame: Frame) -> GuestOSError:
    f = Fields(frame.payload)
    err = f.u32(Tag.ERRNO, 0) or 0
    return guest_os_error(err, f.str(Tag.MESSAGE, "") or "")


class OffsetStream:
    """Bytes of one stream addressed by their offset in it, as they arrive: a chunk sent
    again after a reconnection (the agent resending what was not acknowledged, a
    server resending from the offsets a client had) is dropped, so nothing is
    repeated. ``received`` is the offset of the next byte expected, ``offset`` just
    past the last byte read (a reader that comes back later asks from there)."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.received = 0
        self.offset = 0
        self._chunks: deque[tuple[int, bytes]] = deque()  # (offset, bytes): a gap may lie between two
        self._eof = False
        self._event = asyncio.Event()

    def fresh(self, offset: int, data: bytes | memoryview) -> bytes | None:
        """Take the bytes at ``offset``: those not here yet (None if none), queued for reading."""
        end = offset + len(data)
        if offset > self.received:
            raise ProtocolError(f"stream {self.stream} skipped from {self.received} to {offset}")
        if end <= self.received:
            return None  # a resend of bytes already here
        chunk = bytes(data[self.received - offset :])
        self._chunks.append((self.received, chunk))
        self.received = end
        self._event.set()
        return chunk

    @property
    def ready(self) -> bool:
        """Bytes are here to be read."""
        return bool(self._chunks)

    @property
    def ended(self) -> bool:
        return self._eof

    def finish(self) -> None:
        """No more bytes will come."""
        self._eof = True
        self._event.set()

    async def arrival(self) -> None:
        """Wait for the next bytes (or the end)."""
        self._event.clear()
        await self._event.wait()

    def start_at(self, offset: int) -> None:
        """The stream is followed from ``offset`` (what came before it was read elsewhere)."""
        self.received = self.offset = offset

    def take(self) -> bytes:
        start, chunk = self._chunks.popleft()
        self.offset = start + len(chunk)
        return chunk

    def take_buffered(self) -> bytes:
        """The bytes received and not read yet, taken out of the stream."""
        if not self._chunks:
            return b""
        start, last = self._chunks[-1]
        data = b"".join(chunk for _, chunk in self._chunks)
        self._chunks.clear()
        self.offset = start + len(last)
        return data


class InboundStream(OffsetStream):
    """Bytes the agent sends on one stream (stdout, stderr, a file's content).

    Bytes are acknowledged when the consumer takes them, so a consumer that
    stops reading stops the guest process (back-pressure). ``drain()`` switches
    to acknowledging on arrival, keeping the bytes for later reads.
    """

    def __init__(self, channel: Channel, stream: int) -> None:
        super().__init__(stream)
        self._channel = channel
        self._consumed = 0
        self._acked = 0
        self._adopting = False  # taken over: the first frame sets where the stream is
        self._draining = False

    def adopt(self) -> None:
        """This stream was begun by an earlier host: take its offsets from the first frame."""
        self._adopting = True

    def _take_position(self, offset: int) -> None:
        if self._adopting:
            self._adopting = False
            self.start_at(offset)
            self._consumed = self._acked = offset

    def feed(self, offset: int, data: memoryview) -> None:
        self._take_position(offset)
        fresh = self.fresh(offset, data)
        if fresh is not None and self._draining:
            self._consumed += len(fresh)
            self._maybe_ack()

    def feed_eof(self, offset: int) -> None:
        self._take_position(offset)
        if offset != self.received:
            raise ProtocolError(f"stream {self.stream} ended at {offset} but {self.received} bytes arrived")
        self._eof = True
        self._event.set()

    def _maybe_ack(self) -> None:
        if self._consumed - self._acked >= wire.WINDOW // 4 or (
            self._consumed > self._acked and self._consumed == self.received
        ):
            self._acked = self._consumed
            self._channel.send(T.ACK, wire.data_payload(self.stream, self._consumed))

    def drain(self) -> None:
        """Acknowledge everything now and on arrival; bytes stay readable."""
        if not self._draining:
            self._draining = True
            self._consumed = self.received
            self._maybe_ack()

    async def read(self, idle_timeout: float | None = None) -> bytes:
        """Next chunk, or b"" at end of stream. ``idle_timeout`` bounds the wait for it."""
        while not self._chunks:
            if self._eof:
                return b""
            self._channel.raise_if_failed()
            self._event.clear()
            await self._channel.wait_event(self._event, idle_timeout=idle_timeout)
        chunk = self.take()
        if not self._draining:
            self._consumed += len(chunk)
            self._maybe_ack()
        return chunk

    async def read_all(self) -> bytes:
        self.drain()
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)


class OutboundStream:
    """Bytes the host sends on stream 0 (stdin, a file being written), inside the
    agent's window, retained until the agent acknowledges them."""

    def __init__(self, channel: Channel, window: int) -> None:
        self._channel = channel
        self._window = window
        self.sent = 0
        self.acked = 0
        self._retained: deque[tuple[int, bytes]] = deque()
        self._event = asyncio.Event()
        self.closed = False
        self._adopting = False

    def adopt(self) -> None:
        """Begun by an earlier host: the agent's first ACK says how much it took."""
        self._adopting = True

    def on_ack(self, offset: int) -> None:
        if self._adopting:
            self._adopting = False
            self.sent = self.acked = offset
        if offset > self.sent:
            raise ProtocolError(f"agent acknowledged {offset} bytes but only {self.sent} were sent")
        if offset < self.acked:
            # after a reconnection the agent reports where it really is: resend from there
            self.acked = offset
        else:
            self.acked = offset
            while self._retained and self._retained[0][0] + len(self._retained[0][1]) <= offset:
                self._retained.popleft()
        self._event.set()

    def resend_from(self, offset: int) -> None:
        for start, data in self._retained:
            end = start + len(data)
            if end > offset:
                skip = max(0, offset - start)
                self._channel.send(T.DATA, wire.data_payload(wire.STREAM_STDIN, start + skip, data[skip:]))
        if self.closed:
            self._channel.send(T.EOF, wire.data_payload(wire.STREAM_STDIN, self.sent))

    async def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            while self.sent - self.acked >= self._window:
                if self._channel.has_frames:
                    return  # the agent ended the operation; the caller reads why
                self._channel.raise_if_failed()
                self._event.clear()
                await self._channel.wait_event(self._event, idle_timeout=self._channel.conn.request_timeout)
            room = self._window - (self.sent - self.acked)
            n = min(len(view), wire.DATA_CHUNK, room)
            chunk = bytes(view[:n])
            self._retained.append((self.sent, chunk))
            self._channel.send(T.DATA, wire.data_payload(wire.STREAM_STDIN, self.sent, chunk))
            self.sent += n
            view = view[n:]
        await self._channel.conn.drain()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._channel.send(T.EOF, wire.data_payload(wire.STREAM_STDIN, self.sent))
            await self._channel.conn.drain()


class Channel:
    """One operation on the connection. Control frames (not DATA/EOF/ACK) queue
    up for the service that owns the channel."""

    def __init__(self, conn: AgentConnection, channel_id: int) -> None:
        self.conn = conn
        self.id = channel_id
        self._frames: deque[Frame] = deque()
        self._event = asyncio.Event()
        self._failure: BaseException | None = None
        self.inbound: dict[int, InboundStream] = {}
        self.outbound: OutboundStream | None = None
        self.closed = False
        self._failed_ev = asyncio.Event()

    # -- plumbing used by streams and services ---------------------------------------

    def send(self, frame_type: int, payload: bytes = b"") -> None:
        self.conn.send_frame(frame_type, self.id, payload)

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def wait_event(self, event: asyncio.Event, idle_timeout: float | None = None) -> None:
        """Wait for ``event`` or for this channel to fail."""
        if self._failure is not None:
            raise self._failure
        waiter = asyncio.ensure_future(event.wait())
        failed = asyncio.ensure_future(self._failed_ev.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, failed}, timeout=idle_timeout, return_when="FIRST_COMPLETED"
            )
        finally:
            waiter.cancel()
            failed.cancel()
        if self._failure is not None:
            raise self._failure
        if not done:
            raise AgentTimeout(f"agent made no progress on channel {self.id} for {idle_timeout:.0f}s")

    def stream(self, stream: int) -> InboundStream:
        s = self.inbound.get(stream)
        if s is None:
            s = self.inbound[stream] = InboundStream(self, stream)
        return s

    # -- called by the connection's reader -----------------------------------------

    def deliver(self, frame: Frame) -> None:
        if frame.type in (T.DATA, T.EOF, T.ACK):
            stream, offset, data = wire.parse_data(frame.payload)
            if frame.type == T.ACK:
                if stream != wire.STREAM_STDIN or self.outbound is None:
                    return
                self.outbound.on_ack(offset)
            elif frame.type == T.DATA:
                self.stream(stream).feed(offset, data)
            else:
                self.stream(stream).feed_eof(offset)
            return
        self._frames.append(frame)
        self._event.set()
        if self.outbound is not None:
            self.outbound._event.set()  # a writer waiting for window must see an early end

    def fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            self._failed_ev.set()
            self._event.set()
            for s in self.inbound.values():
                s._event.set()
            if self.outbound is not None:
                self.outbound._event.set()

    # -- for services -------------------------------------------------------------

    @property
    def has_frames(self) -> bool:
        """A control frame is waiting (e.g. the agent ended the operation early)."""
        return bool(self._frames)

    async def next_frame(self, timeout: float | None = None) -> Frame:
        """Next control frame. ``timeout`` None waits as long as the channel lives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._frames:
            self.raise_if_failed()
            self._event.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise AgentTimeout(f"agent did not answer on channel {self.id} within {timeout:.0f}s")
            await self.wait_event(self._event, idle_timeout=remaining)
        return self._frames.popleft()

    async def expect(self, *types: int, timeout: float | None = None) -> Frame:
        """Next control frame, which must be one of ``types``; ERROR raises GuestOSError."""
        frame = await self.next_frame(timeout)
        if frame.type == T.ERROR:
            raise error_from_frame(frame)
        if frame.type not in types:
            names = ", ".join(T(t).name for t in types)
            raise ProtocolError(f"expected {names} on channel {self.id}, got 0x{frame.type:02x}")
        return frame

    def resume_payload(self) -> bytes:
        return b"".join(
            wire.tlv(Tag.STREAM_OFFSET, s.stream.to_bytes(4, "little") + s.received.to_bytes(8, "little"))
            for s in self.inbound.values()
        )

    def close(self) -> None:
        """Tell the agent this channel is done (a running process keeps running)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(ConnectionLost):
                self.send(T.CLOSE)
            self.conn._forget(self)


class AgentConnection:
    """A connected, handshaken session with the agent."""

    def __init__(
        self,
        connector: Connector,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        hostname: str | None = None,
        machine_id: str | None = None,
        pids_max: int | None = None,
        aslr: bool | None = None,
        on_lost: Callable[[], Awaitable[BaseException | None]] | None = None,
        token: bytes | None = None,
    ) -> None:
        self._connector = connector
        self.request_timeout = request_timeout
        self._hostname = hostname
        self._machine_id = machine_id
        self._pids_max = pids_max
        self._aslr = aslr
        self._on_lost = on_lost
        self.token = token or secrets.token_bytes(16)  # names this host's session to the agent
        self.orphans: set[int] = set()  # live channels of an earlier host of this session
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._channels: dict[int, Channel] = {}
        self._next_id = 1
        self._control = Channel(self, 0)
        self._closed = False
        self._failure: BaseException | None = None
        self._reconnecting: asyncio.Future[None] | None = None
        self._handshaking = False
        self.info: AgentInfo | None = None
        self.last_used = time.monotonic()  # when a channel last opened or closed
        self.installs = 0  # sockets installed so far: the first connect, then each reconnection

    # -- lifecycle ---------------------------------------------------------------------

    async def connect(self, timeout: float) -> AgentInfo:
        """Connect and handshake within ``timeout`` seconds."""
        reader, writer = await self._connector()
        self._install(reader, writer)
        try:
            return await self._handshake(timeout)
        except BaseException:  # a timeout or a cancel: no reader task left pending behind it
            with contextlib.suppress(Exception):
                await asyncio.shield(self.close())
            raise

    def _install(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self.installs += 1
        self._control = Channel(self, 0)
        self._reader_task = asyncio.create_task(self._read_loop(reader), name="sandlot-agent-reader")

    async def _handshake(self, timeout: float) -> AgentInfo:
        payload = (
            wire.tlv(Tag.VERSION_MIN, wire.PROTOCOL_VERSION)
            + wire.tlv(Tag.VERSION_MAX, wire.PROTOCOL_VERSION)
            + wire.tlv(Tag.SESSION, self.token)
            + wire.tlv(Tag.ENTROPY, os.urandom(64))
        )
        # Every HELLO reseeds the guest's RNG, sets its clock and its identity: after a
        # restore or fork these are what must differ from the saved state.
        if self._hostname:
            payload += wire.tlv(Tag.HOSTNAME, self._hostname)
        if self._machine_id:
            payload += wire.tlv(Tag.MACHINE_ID, self._machine_id)
        if self._pids_max is not None:  # the box's limits, also after a restore or fork
            payload += wire.tlv(Tag.PIDS_MAX, self._pids_max)
        if self._aslr is not None:  # kernel.randomize_va_space: 2 (on) or 0 (off)
            payload += wire.tlv(Tag.ASLR, 2 if self._aslr else 0)
        self._handshaking = True
        try:
            frame, waited = await self._hello(payload, timeout)
        finally:
            self._handshaking = False
        f = Fields(frame.payload)
        version = f.u32(Tag.VERSION, 0)
        if version != wire.PROTOCOL_VERSION:
            raise ProtocolError(
                f"agent chose protocol version {version}, host speaks {wire.PROTOCOL_VERSION}"
            )
        self.info = AgentInfo(
            protocol_version=version,
            agent_version=f.str(Tag.AGENT_VERSION, "") or "",
            boot_id=f.str(Tag.BOOT_ID, "") or "",
            window=f.u32(Tag.WINDOW, wire.WINDOW) or wire.WINDOW,
            max_payload=f.u32(Tag.MAX_PAYLOAD, wire.MAX_PAYLOAD) or wire.MAX_PAYLOAD,
            aslr=(aslr := f.u32(Tag.ASLR)),
        )
        if self._aslr is False and aslr != 0:
            # an agent older than the setting (in a state an earlier sandlot saved), or a
            # kernel without it: the box must not run as if it had what it asked for
            why = "does not know the setting" if aslr is None else f"left kernel.randomize_va_space at {aslr}"
            raise Unsupported(
                "this box cannot turn address-space randomization off (aslr=False): its agent "
                f"{self.info.agent_version or '(unknown version)'} {why}"
            )
        live = {int.from_bytes(v, "little") for v in f.all(Tag.CHANNEL)}
        if f.u32(Tag.RESUMED, 0):
            self.orphans = live - self._channels.keys()  # an earlier host's, not ours
            if live:  # new channels must not take the number of one that lives on
                self._next_id = max(self._next_id, max(live) + 1) & 0xFFFFFFFF
            for ch in list(self._channels.values()):
                if ch.id in live:
                    self.send_frame(T.RESUME, ch.id, ch.resume_payload())
                    if ch.outbound is not None:
                        ch.outbound.resend_from(ch.outbound.acked)
                else:
                    ch.fail(ConnectionLost(f"channel {ch.id} ended while the connection was down"))
                    self._channels.pop(ch.id, None)
        else:
            self.orphans.clear()
            for ch in list(self._channels.values()):
                ch.fail(ConnectionLost("the agent started a new session"))
            self._channels.clear()
        if waited > CLOCK_SLACK:
            # The guest set its clock from a HELLO sent `waited` seconds ago (a VM still
            # restoring its memory on a loaded host answers late): set it again, now.
            await self.set_clock(timeout)
        return self.info

    async def set_clock(self, timeout: float | None = None) -> None:
        """Set the guest's wall clock to the host's, now. An answer later than
        ``CLOCK_SLACK`` says the guest may have set a time that old (a guest starved by
        a loaded host): it is set again, ``CLOCK_TRIES`` times at most."""
        for _ in range(CLOCK_TRIES):
            sent = time.monotonic()
            await self.control(wire.ControlOp.SET_TIME, wire.tlv_u64(Tag.TIME_NS, time.time_ns()), timeout)
            if time.monotonic() - sent <= CLOCK_SLACK:
                return

    async def freeze(self, lease: float) -> None:
        """Stop every command's processes (a save of a box with VMs of its own: no vCPU of
        the guest may be inside a nested VM). They run again on ``thaw``, or on their own
        after ``lease`` seconds of the guest's time, as in a VM restored from the save."""
        await self.control(wire.ControlOp.FREEZE, wire.tlv(Tag.TIMEOUT_MS, round(lease * 1000)))

    async def thaw(self) -> None:
        await self.control(wire.ControlOp.THAW)

    async def control(self, op: wire.ControlOp, payload: bytes = b"", timeout: float | None = None) -> Fields:
        """One control request to the agent."""
        ch = self.open_channel()
        try:
            ch.send(T.CONTROL, wire.tlv(Tag.OP, op) + payload)
            frame = await ch.expect(T.CONTROL_OK, timeout=timeout or self.request_timeout)
            return Fields(frame.payload)
        finally:
            ch.close()

    async def _hello(self, payload: bytes, timeout: float) -> tuple[Frame, float]:
        """Send HELLO (with the time now) until HELLO_ACK arrives; return it and the
        seconds since the first HELLO went. The agent skips everything before a
        HELLO header, so resending recovers from bytes an earlier connection left
        behind (a half frame may swallow one HELLO; the agent drops it after 2 s)."""
        first = time.monotonic()
        deadline = first + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AgentTimeout(f"agent did not answer HELLO within {timeout:.1f}s")
            self.send_frame(T.HELLO, 0, payload + wire.tlv_u64(Tag.TIME_NS, time.time_ns()))
            try:
                while True:
                    frame = await self._control.next_frame(timeout=min(HELLO_RETRY, remaining))
                    if frame.type == T.HELLO_ACK:
                        return frame, time.monotonic() - first
                    if frame.type == T.ERROR:
                        f = Fields(frame.payload)
                        if f.u32(Tag.FRAME_TYPE) == T.HELLO:
                            raise error_from_frame(frame)
                        # an answer to something an earlier connection sent: not ours
            except AgentTimeout:
                continue

    async def reconnect(self, timeout: float = RECONNECT_HELLO) -> AgentInfo:
        """Replace the socket (e.g. after a restore) and resume every channel."""
        await self._drop_transport()
        reader, writer = await self._connector()
        if self._closed:
            # closed while it connected: a socket left open here would hold the port (QEMU
            # serves one host per port) from whoever leases it next
            writer.close()
            raise ConnectionLost("the agent connection was closed")
        self._install(reader, writer)
        return await self._handshake(timeout)

    async def _drop_transport(self) -> None:
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        self._writer = None
        self._reader = None

    def break_transport(self) -> None:
        """Cut the socket at once, as a failing transport would: the connection is
        lost, reconnects and resumes its channels (for tests of that path)."""
        if self._writer is not None:
            self._writer.transport.abort()

    def closing(self) -> None:
        """Mark the connection as being closed on purpose (close() follows)."""
        self._closed = True

    async def close(self) -> None:
        self._closed = True
        await self._drop_transport()
        # a handshake in flight (a reconnection) ends now, not at its HELLO timeout: whoever
        # waits for the reconnection (``follow``, ``wait_ready``) learns of it and connects anew
        self._control.fail(ConnectionLost("connection closed"))
        for ch in list(self._channels.values()):
            ch.fail(ConnectionLost("connection closed"))
        self._channels.clear()

    @property
    def failed(self) -> BaseException | None:
        return self._failure

    @property
    def reconnecting(self) -> bool:
        """Its socket closed and it is connecting again (to a VM that was resumed,
        rolled back or restored): in use, though no channel is open on it."""
        return self._reconnecting is not None

    def is_open(self, channel_id: int) -> bool:
        """The channel is in use on this connection."""
        return channel_id in self._channels

    @property
    def open_channels(self) -> int:
        """Operations in flight on this connection."""
        return len(self._channels)

    # -- frames --------------------------------------------------------------------------

    def send_frame(self, frame_type: int, channel: int, payload: bytes = b"", flags: int = 0) -> None:
        if self._failure is not None:
            raise self._failure
        if self._writer is None or self._writer.is_closing():
            if self._reconnecting is not None or (self._reader_task is not None and not self._closed):
                # dropped now, resent by RESUME after the reconnection; that includes the
                # moment between a transport's break and its reader seeing it, when the
                # reconnection is not under way yet (or ends in a failure every channel gets)
                return
            raise ConnectionLost("not connected to the agent")
        self._writer.write(wire.encode_frame(frame_type, channel, payload, flags))

    async def drain(self) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    def adopt(self, channel_id: int) -> Channel:
        """Take over an orphan: its streams resend what the agent holds unacknowledged."""
        if channel_id not in self.orphans:
            raise ProtocolError(f"channel {channel_id} is no orphan of this session")
        self.orphans.discard(channel_id)
        ch = Channel(self, channel_id)
        self._channels[channel_id] = ch
        for stream in (wire.STREAM_STDOUT, wire.STREAM_STDERR):
            ch.stream(stream).adopt()
        # from offset 0, which the agent takes as "from the oldest byte you hold": what it
        # sent since the last ACK may have gone nowhere (nobody held the port)
        self.send_frame(T.RESUME, channel_id, ch.resume_payload())
        self.last_used = time.monotonic()
        return ch

    def let_go(self, channel_id: int) -> None:
        """An orphan nobody takes over: its process runs on, its output is dropped."""
        if channel_id in self.orphans:
            self.orphans.discard(channel_id)
            self.send_frame(T.CLOSE, channel_id)

    def open_channel(self) -> Channel:
        if self._failure is not None:
            raise self._failure
        if len(self._channels) >= wire.MAX_CHANNELS:
            raise ProtocolError(f"more than {wire.MAX_CHANNELS} operations in flight on one connection")
        while self._next_id == 0 or self._next_id in self._channels or self._next_id in self.orphans:
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        ch = Channel(self, self._next_id)
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        self._channels[ch.id] = ch
        self.last_used = time.monotonic()
        return ch

    def _forget(self, ch: Channel) -> None:
        if self._channels.get(ch.id) is ch:
            del self._channels[ch.id]
            self.last_used = time.monotonic()

    async def ping(self, timeout: float | None = None) -> float:
        """Round trip to the agent, in seconds."""
        ch = self.open_channel()
        try:
            start = time.perf_counter()
            ch.send(T.PING, b"ping")
            await ch.expect(T.PONG, timeout=timeout or self.request_timeout)
            return time.perf_counter() - start
        finally:
            self._forget(ch)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        decoder = wire.FrameDecoder(sync=wire.session_start_headers())
        try:
            while True:
                data = await reader.read(256 * 1024)
                if not data:
                    break
                for frame in decoder.feed(data):
                    self._route(frame)
                if decoder.skipped:
                    log.debug("skipped %d bytes an earlier connection left in the port", decoder.skipped)
                    decoder.skipped = 0
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:
            log.error("agent protocol error: %s", exc)
            self._fail_all(exc)
            return
        except (ConnectionError, OSError) as exc:
            log.debug("agent socket error: %s", exc)
        if not self._closed:
            await self._lost()

    def _route(self, frame: Frame) -> None:
        if frame.channel == 0:
            if self._handshaking:
                self._control.deliver(frame)
            elif frame.type == T.ERROR:
                log.warning("agent reported a session error: %s", Fields(frame.payload).str(Tag.MESSAGE, ""))
            return
        ch = self._channels.get(frame.channel)
        if ch is None:
            return  # late frame for a channel we already closed
        try:
            ch.deliver(frame)
        except ProtocolError as exc:
            ch.fail(exc)

    async def wait_ready(self) -> None:
        """Return once a reconnection in progress (say, to a box being resumed) is over."""
        fut = self._reconnecting
        if fut is not None:
            await asyncio.shield(fut)
        if self._failure is not None:
            raise self._failure

    async def follow(self, since: int, timeout: float) -> None:
        """Return once this connection, whose socket is known to have closed (its VM
        replaced by another: a box resumed from a state another process saved), has
        seen it close and connected again (past ``since`` installs). Until then, a
        channel opened on it goes to the dead socket, and the agent of the new VM never
        hears of it. Its failure if it could not; TimeoutError past ``timeout``."""
        async with asyncio.timeout(timeout):
            while self.installs <= since and self._failure is None:
                fut = self._reconnecting
                if fut is not None:
                    await asyncio.shield(fut)
                else:
                    await asyncio.sleep(0.01)  # the reader has yet to read the end of the socket
        if self._failure is not None:
            raise self._failure

    async def _lost(self) -> None:
        """The socket closed: ask the owner whether the VM still lives, and reconnect."""
        self._reader_task = None
        reason: BaseException | None = None
        loop = asyncio.get_running_loop()
        self._reconnecting = loop.create_future()
        deadline = loop.time() + RECONNECT_PATIENCE
        while self._on_lost is not None:
            try:
                reason = await self._on_lost()
            except Exception as exc:
                reason = exc
            if reason is None and self._closed:  # closed while the owner was asked: never again
                reason = ConnectionLost("the agent connection was closed")
            if reason is not None:
                break
            try:
                await self.reconnect()
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                # the socket is gone or not yet there: ask the owner again which VM to follow
                reason = ConnectionLost(f"could not reconnect to the agent: {exc}")
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(RECONNECT_PAUSE)
                continue
            except Exception as exc:
                reason = ConnectionLost(f"could not reconnect to the agent: {exc}")
                break
            fut, self._reconnecting = self._reconnecting, None
            if fut is not None and not fut.done():
                fut.set_result(None)
            return
        self._fail_all(reason or ConnectionLost("the agent connection closed"))
        done, self._reconnecting = self._reconnecting, None
        if done is not None and not done.done():
            done.set_result(None)

    def _fail_all(self, exc: BaseException) -> None:
        self._failure = exc
        self._control.fail(exc)
        for ch in list(self._channels.values()):
            ch.fail(exc)
