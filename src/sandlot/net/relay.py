"""Moving bytes between a guest connection and the world: shared by the egress
proxy (``proxy``) and the connections it decrypts to swap secrets in
(``intercept``). Imports nothing heavy: the proxy runs once per connection."""

from __future__ import annotations

import contextlib
import fcntl
import select
import socket
import struct
import time
from collections.abc import Iterator

TCP_CLOSE_WAIT = 8  # the peer has closed its side (Linux's tcp_states.h)
SIOCOUTQ = 0x5411  # bytes not yet acknowledged by the peer
DRAIN_SECONDS = 5.0
FIN_GRACE = 0.02  # how long a guest's own FIN may take to arrive before sandlot's is sent


def _peer_closed_first(sock: socket.socket) -> bool:
    """Whether ``sock`` is TCP and its peer has closed its side (CLOSE_WAIT): then, once
    what was sent is acknowledged, it is set to end with a reset."""
    try:
        if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_CLOSE_WAIT:
            return False
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline:
            if struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, b"\0\0\0\0"))[0] == 0:
                break
            time.sleep(0.002)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        return False
    return True


def _from_slirp(sock: socket.socket) -> bool:
    """Whether ``sock`` is a QEMU VM's guest connection: libslirp hands each one over as
    one end of a TCP pair on the host's loopback (its ``slirp_socketpair_with_oob``). A
    gVisor box's come from its netstack's address."""
    try:
        return str(sock.getpeername()[0]).startswith("127.")
    except (OSError, IndexError):
        return False


def end_guest_output(sock: socket.socket) -> None:
    """Nothing more to send to a guest: a FIN, unless the guest closed its side first;
    then nothing now, and a reset when the connection is closed, so that the guest's
    side ends at once instead of waiting in TIME_WAIT for a minute. A gVisor box's
    netstack cannot save a state holding an endpoint in TIME_WAIT (and ends the
    sandbox trying): see ``sandlot.engine.gvisor.network``. A QEMU VM's TCP state is
    its guest kernel's, saved with it whatever it holds: its connections get their FIN
    at once (the wait below cost every one that the guest reads to its end 20 ms)."""
    if _peer_closed_first(sock):
        return
    if sock.family == socket.AF_INET and not _from_slirp(sock):
        # A FIN of ours that crosses the guest's ends both sides in TIME_WAIT: where the
        # guest is about to close too (a server that closes after its answer, which the
        # client here has just read), its FIN is let arrive first.
        with contextlib.suppress(OSError, ValueError):
            select.select([sock], [], [], FIN_GRACE)
        if _peer_closed_first(sock):
            return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def close_guest(sock: socket.socket) -> None:
    """Close a guest's connection (with a reset where the guest closed first: see
    ``end_guest_output``)."""
    _peer_closed_first(sock)
    sock.close()


@contextlib.contextmanager
def guest_connection(sock: socket.socket) -> Iterator[socket.socket]:
    """``with`` a guest's connection: closed by ``close_guest`` at the end."""
    try:
        yield sock
    finally:
        close_guest(sock)


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides have finished (TLS sockets too: what they
    have decrypted already is not in the kernel's buffer, where select looks).
    ``a`` is the guest's side (``end_guest_output``)."""
    retry: tuple[type[OSError], ...] = (BlockingIOError,)
    tls = [s for s in (a, b) if hasattr(s, "pending")]
    if tls:  # only decrypting connections import ssl: it costs every proxy process 10 ms
        import ssl

        retry += (ssl.SSLWantReadError, ssl.SSLWantWriteError)
    a.setblocking(False)
    b.setblocking(False)
    peer = {a: b, b: a}
    open_ = {a, b}
    while open_:
        readable = [s for s in tls if s in open_ and s.pending()]
        if not readable:
            readable, _, _ = select.select(list(open_), [], [])
        for s in readable:
            try:
                data = s.recv(65536)
            except retry:
                continue
            except OSError:
                data = b""
            if data:
                peer[s].setblocking(True)
                peer[s].sendall(data)
                peer[s].setblocking(False)
            else:
                open_.discard(s)
                if peer[s] is a:
                    end_guest_output(a)
                else:
                    with contextlib.suppress(OSError):
                        b.shutdown(socket.SHUT_WR)


def send_error(sock: socket.socket, status: str, message: str, headers: str = "") -> None:
    """An HTTP error answer (``status``: "403 Forbidden"), after which the connection ends."""
    body = f"sandlot: {message}\n".encode()
    with contextlib.suppress(OSError):
        sock.sendall(
            f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n{headers}".encode()
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
