"""Moving bytes between a guest connection and the world: shared by the egress
proxy (``proxy``) and the connections it decrypts to swap secrets in
(``intercept``). Imports nothing heavy: the proxy runs once per connection."""

from __future__ import annotations

import contextlib
import select
import socket


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides have finished (TLS sockets too: what they
    have decrypted already is not in the kernel's buffer, where select looks)."""
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
                with contextlib.suppress(OSError):
                    peer[s].shutdown(socket.SHUT_WR)


def send_error(sock: socket.socket, status: str, message: str, headers: str = "") -> None:
    """An HTTP error answer (``status``: "403 Forbidden"), after which the connection ends."""
    body = f"sandlot: {message}\n".encode()
    with contextlib.suppress(OSError):
        sock.sendall(
            f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n{headers}".encode()
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
