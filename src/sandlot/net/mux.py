"""The egress port: a VM's guest connections to the egress proxy and the DNS answerer,
carried over one virtio-serial port to the home's egress server, with no process
started per connection.

QEMU's ``guestfwd ... cmd:`` forks QEMU twice for every guest connection (libslirp's
``g_spawn_async``), its main loop waiting for the first child meanwhile: 7-11 ms a
connection under TCG, more than the proxy's own work. A VM of device set "5" has a
port named ``sandlot-egress`` instead, whose host end is a client of this server's
stream socket (QEMU reconnects it every second while none listens). In the guest,
the agent's egress child (``egress.c``) listens on the loopback for each port this side
names, a connect hook sends the guest's TCP connections to the proxy address there,
and it carries each connection it takes as a stream of frames; here each
stream is given to the very helper the VM's ``guestfwd`` would have run, as one end
of a socket pair.

Which box a session is, is the host's word, never the guest's: the peer of the
connection is a QEMU (``SO_PEERCRED``), and its command line names the helpers
(with the box's policy, log and link files) for each port. A guest reaches nothing
here that its ``guestfwd`` would not have reached.

Frames, both ways: ``stream u32, type u8, flags u8, length u16`` (big-endian), then
``length`` bytes. Stream 0 is the session's. ``HELLO`` opens a session: this side's
first (after ``PREAMBLE``), with the ports served (u16 each) after ``MAGIC``; the guest's answer is
``MAGIC`` alone. Until its HELLO, bytes are skipped up to ``MAGIC`` (what a VM wrote
to a host that went away, or to one before a restore). Then the guest ``OPEN``s
streams (the port, u16; ids rising) and sends at once; this side answers ``OPENED``
or ``CLOSE`` with ``REFUSED``, and ignores what came for a refused stream (the guest
kept it, and takes the connection through QEMU's user network: a connection is
slower, never lost); ``DATA`` up to the window the receiver gave (``STREAM_WINDOW``
bytes at first, more with each ``WINDOW`` frame, a u32 of bytes taken, sent once a
quarter of the window was);
``EOF`` ends a direction; a stream both of whose directions ended is gone on both
sides; ``CLOSE`` ends it at once (a reset). A frame that breaks these rules ends the
session: QEMU connects again within a second, and the guest starts over.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import shlex
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .addresses import PROXY_ADDRESS

PORT_NAME = "sandlot-egress"  # the virtio-serial port's name in the guest
MAGIC = b"SLMUX1"
HEADER = struct.Struct(">IBBH")
HELLO, OPEN, OPENED, DATA, EOF, CLOSE, WINDOW = range(1, 8)
REFUSED = 0x1  # CLOSE's flag: the stream was never served
MAX_PAYLOAD = 65535
CHUNK = 32768  # the largest DATA this side sends
STREAM_WINDOW = 256 * 1024  # bytes in flight per stream and direction
MAX_STREAMS = 1024  # live streams per session; past it OPEN is refused
HELLO_TIMEOUT = 10.0  # for the guest's HELLO, after which QEMU connects again
OUT_HIGH = 1 << 20  # bytes queued for the guest past which no stream is read
# ... and past which the session ends: a guest that sends frames and reads none
# (each OPEN, DATA and WINDOW may add an answer of this side's)
OUT_LIMIT = 16 << 20


class MuxError(ValueError):
    """A frame that breaks the protocol: the session ends."""


def frame(stream: int, kind: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(stream, kind, flags, len(payload)) + payload


# Before each HELLO: enough zeros to end any frame the guest was reading when it was
# saved (a VM restored mid-frame reads this session's bytes after that frame's
# first part). Zeros then read as a frame that makes no sense, after which the guest
# looks for the HELLO as it does at first. 64 KiB per session: about a millisecond.
PREAMBLE = bytes(HEADER.size + MAX_PAYLOAD + 1)  # whole zero headers: 8193 of them


def hello(ports: list[int]) -> bytes:
    return frame(0, HELLO, MAGIC + b"".join(struct.pack(">H", p) for p in ports))


# -- who the peer is ----------------------------------------------------------------------


def netdev_options(value: str) -> list[str]:
    """A QEMU option list split at its commas (a doubled comma is a comma)."""
    out, cur, i = [], [], 0
    while i < len(value):
        c = value[i]
        if c == "," and value[i + 1 : i + 2] == ",":
            cur.append(",")
            i += 2
            continue
        if c == ",":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def helpers_of(argv: list[str]) -> dict[int, list[str]]:
    """The helper argv QEMU's ``guestfwd`` runs (through the relay) for each port of the
    proxy address, from a QEMU's command line."""
    out: dict[int, list[str]] = {}
    for prev, arg in itertools.pairwise(argv):
        if prev != "-netdev" or not arg.startswith("user,"):
            continue
        for option in netdev_options(arg):
            head, sep, cmd = option.partition("-cmd:")
            if not sep or not head.startswith(f"guestfwd=tcp:{PROXY_ADDRESS}:"):
                continue
            port = head.rsplit(":", 1)[1]
            try:
                words = shlex.split(cmd)
            except ValueError:
                continue
            if "--" in words and port.isdigit():
                out[int(port)] = words[words.index("--") + 1 :]
    return out


def peer_helpers(conn: socket.socket, names: Path) -> dict[int, list[str]] | None:
    """The helpers of the QEMU at the other end of ``conn``: one of this user's, whose
    command line names ``names`` (this server's socket); None for any other peer."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid() or pid <= 0:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(str(names) in arg for arg in argv):
        return None
    return helpers_of(argv)


# -- a session ---------------------------------------------------------------------------

# What serves a stream: given the host end of its socket pair and the port, True if it
# took it (a thread of its own now serves it), False if it refuses (the guest goes the
# slow way).
Serve = Callable[[socket.socket, int], bool]


@dataclass(slots=True)
class _Stream:
    sock: socket.socket  # this side's end of the pair; the helper has the other
    credit: int = STREAM_WINDOW  # bytes this side may still send
    allowed: int = STREAM_WINDOW  # bytes the guest may still send
    taken: int = 0  # bytes written to the helper, not yet given back as WINDOW
    pending: bytearray = field(default_factory=bytearray)  # from the guest, for the helper
    guest_eof: bool = False  # the guest sent EOF
    shut: bool = False  # ... and the helper's side was shut for writing
    local_eof: bool = False  # the helper's side ended, EOF sent
    events: int = 0  # what the selector waits on it for (0: not registered)


class Session:
    """One VM's port: the frames of its streams, in the calling thread."""

    def __init__(self, conn: socket.socket, ports: list[int], serve: Serve) -> None:
        self.conn = conn
        self.ports = ports
        self.serve = serve
        self.streams: dict[int, _Stream] = {}
        self.highest = 0  # the highest stream id the guest opened
        self.inbuf = bytearray()
        self.out = bytearray(PREAMBLE + hello(ports))
        self.greeted = False
        self.sel = selectors.DefaultSelector()

    def run(self) -> None:
        """Serve until the VM's QEMU goes away or breaks the protocol."""
        self.conn.setblocking(False)
        self.sel.register(self.conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
        deadline = time.monotonic() + HELLO_TIMEOUT
        try:
            while True:
                timeout = None if self.greeted else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return
                for key, events in self.sel.select(timeout):
                    if key.fileobj is self.conn:
                        if events & selectors.EVENT_WRITE and not self._flush():
                            return
                        if events & selectors.EVENT_READ and not self._receive():
                            return
                    else:
                        self._local(key.data, events)
                self._update()
        except MuxError:
            return
        finally:
            for s in self.streams.values():
                s.sock.close()
            self.sel.close()
            self.conn.close()

    # -- the guest's side

    def _flush(self) -> bool:
        try:
            n = self.conn.send(self.out)
        except BlockingIOError:
            return True
        except OSError:
            return False
        del self.out[:n]
        return True

    def _receive(self) -> bool:
        try:
            data = self.conn.recv(262144)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data or len(self.out) > OUT_LIMIT:
            return False
        self.inbuf += data
        if not self.greeted:
            at = self.inbuf.find(MAGIC)
            if at < HEADER.size:
                del self.inbuf[: max(0, len(self.inbuf) - len(MAGIC) - HEADER.size)]
                return True
            del self.inbuf[: at - HEADER.size]
        view = memoryview(self.inbuf)
        used = 0
        while len(view) - used >= HEADER.size:
            stream, kind, flags, length = HEADER.unpack_from(view, used)
            if len(view) - used < HEADER.size + length:
                break
            payload = bytes(view[used + HEADER.size : used + HEADER.size + length])
            used += HEADER.size + length
            self._frame(stream, kind, flags, payload)
        view.release()
        del self.inbuf[:used]
        return True

    def _frame(self, sid: int, kind: int, flags: int, payload: bytes) -> None:
        if not self.greeted:
            if sid != 0 or kind != HELLO or payload != MAGIC:
                raise MuxError("no HELLO")
            self.greeted = True
            return
        if kind == HELLO:
            raise MuxError("a second HELLO")
        if kind == OPEN:
            if sid <= self.highest or len(payload) != 2:
                raise MuxError(f"OPEN of stream {sid}")
            self.highest = sid
            self._open(sid, struct.unpack(">H", payload)[0])
            return
        s = self.streams.get(sid)
        if s is None:
            if sid == 0 or sid > self.highest:
                raise MuxError(f"frame {kind} for stream {sid}, never opened")
            return  # a stream this side ended: the guest had not heard yet
        if kind == DATA:
            if s.guest_eof or len(payload) > s.allowed:
                raise MuxError(f"DATA past the window or EOF of stream {sid}")
            s.allowed -= len(payload)
            s.pending += payload
            self._deliver(sid, s)
        elif kind == EOF:
            s.guest_eof = True
            self._deliver(sid, s)
        elif kind == WINDOW and len(payload) == 4:
            s.credit += struct.unpack(">I", payload)[0]
            if s.credit > 1 << 30:
                raise MuxError(f"WINDOW past bounds on stream {sid}")
        elif kind == CLOSE:
            self._drop(sid, reset=False)
        else:
            raise MuxError(f"frame type {kind} on stream {sid}")

    def _open(self, sid: int, port: int) -> None:
        if port not in self.ports or len(self.streams) >= MAX_STREAMS:
            self.out += frame(sid, CLOSE, flags=REFUSED)
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if not self.serve(theirs, port):
            mine.close()
            theirs.close()
            self.out += frame(sid, CLOSE, flags=REFUSED)
            return
        mine.setblocking(False)
        self.streams[sid] = _Stream(mine, events=selectors.EVENT_READ)
        self.sel.register(mine, selectors.EVENT_READ, sid)
        self.out += frame(sid, OPENED)

    # -- the helpers' side

    def _deliver(self, sid: int, s: _Stream) -> None:
        """Write what the guest sent to the helper, and give the window back."""
        if s.pending:
            try:
                n = s.sock.send(s.pending)
            except BlockingIOError:
                n = 0
            except OSError:
                self._drop(sid, reset=True)
                return
            del s.pending[:n]
            s.taken += n
            # given back in quarters: a sender is never held up by fewer bytes in flight, and
            # a request's few hundred bytes cost the guest no frame of their own
            if s.taken >= STREAM_WINDOW // 4:
                self.out += frame(sid, WINDOW, struct.pack(">I", s.taken))
                s.allowed += s.taken
                s.taken = 0
        if s.guest_eof and not s.pending and not s.shut:
            s.shut = True
            with contextlib.suppress(OSError):
                s.sock.shutdown(socket.SHUT_WR)
        self._maybe_done(sid, s)

    def _local(self, sid: int, events: int) -> None:
        s = self.streams.get(sid)
        if s is None:
            return
        if events & selectors.EVENT_WRITE:
            self._deliver(sid, s)
            if sid not in self.streams:
                return
        if events & selectors.EVENT_READ:
            try:
                data = s.sock.recv(min(CHUNK, s.credit))
            except BlockingIOError:
                return
            except OSError:
                self._drop(sid, reset=True)
                return
            if not data:
                s.local_eof = True
                self.out += frame(sid, EOF)
                self._maybe_done(sid, s)
                return
            s.credit -= len(data)
            self.out += frame(sid, DATA, data)

    def _maybe_done(self, sid: int, s: _Stream) -> None:
        if s.shut and s.local_eof:
            self._drop(sid, reset=False, tell=False)

    def _drop(self, sid: int, *, reset: bool, tell: bool = True) -> None:
        s = self.streams.pop(sid)
        if s.events:
            self.sel.unregister(s.sock)
        s.sock.close()
        if reset and tell:
            self.out += frame(sid, CLOSE)

    def _update(self) -> None:
        """What each socket is waited on for, after a round of events."""
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.out else 0)
        self.sel.modify(self.conn, want)
        busy = len(self.out) >= OUT_HIGH
        for sid, s in self.streams.items():
            events = 0
            if not s.local_eof and s.credit > 0 and not busy:
                events |= selectors.EVENT_READ
            if s.pending:
                events |= selectors.EVENT_WRITE
            if events == s.events:
                continue
            if not events:
                self.sel.unregister(s.sock)
            elif not s.events:
                self.sel.register(s.sock, events, sid)
            else:
                self.sel.modify(s.sock, events, sid)
            s.events = events
