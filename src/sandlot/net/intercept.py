"""HTTPS to a host a box's secrets are for: decrypted, placeholders swapped in, values masked.

The proxy hands over the guest's connection (a TLS client of ``host``) and the
address it checked. Here: TLS with the guest under a certificate for ``host``
signed by the box's CA; TLS to the real server, verified against the host's
trust store (and a secret's own CA); then HTTP/1.1 request by request (h11 does
the framing on both sides):

* requests: placeholders are replaced in the target, the header values (Basic
  credentials decoded first) and a body of up to ``BODY_LIMIT`` bytes, whose
  Content-Length is set anew; a larger body goes as sent.
* responses: the secret values are masked, same length, in headers and body;
  identity encoding is asked for, so a body can be masked (one that comes
  compressed anyway is passed as it is).
* ``101 Switching Protocols`` (WebSocket): after it, bytes are copied as they are.

ALPN offers the guest only ``http/1.1``, so HTTP/2 clients fall back to it.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Iterator, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

import h11

from .policy import normalize_host, valid_host
from .relay import guest_connection, send_error, splice
from .secrets import Masker, Swap, Vault, make_leaf, swap_in, swap_in_header

BODY_LIMIT = 32 * 1024 * 1024
IDLE_TIMEOUT = 120.0  # a guest connection with no request for this long is closed
UPSTREAM_TIMEOUT = 600.0  # a model's answer may take minutes to start
HANDSHAKE_TIMEOUT = 20.0
CHUNK = 65536


class InterceptError(ConnectionError):
    """Why a decrypted connection ended early (logged by the proxy)."""


def guest_context(vault: Vault, host: str, cache: Path) -> ssl.SSLContext:
    """The TLS server the guest talks to: a certificate for ``host`` from the box's CA,
    made once per host and kept (0600) in ``cache``."""
    if not valid_host(host) or host.startswith("."):  # it names a file
        raise InterceptError(f"bad host name {host!r}")
    cache.mkdir(mode=0o700, exist_ok=True)
    pem = cache / f"{host}.pem"
    if not pem.exists():
        cert, key = make_leaf(host, vault.ca_cert, vault.ca_key)
        tmp = cache / f".{host}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + cert)
        os.rename(tmp, pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pem)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def upstream_context(vault: Vault) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if vault.upstream_ca:
        ctx.load_verify_locations(cadata=vault.upstream_ca)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def serve(guest: socket.socket, host: str, port: int, ip: str, vault: Vault, swaps: Sequence[Swap],
          cache: Path) -> int:  # fmt: skip
    """Relay one intercepted connection until either side ends it; returns the
    number of requests relayed. ``cache``: where leaf certificates are kept."""
    guest.settimeout(HANDSHAKE_TIMEOUT)
    names: list[str] = []
    ctx = guest_context(vault, host, cache)

    def note_name(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        names.append(name or "")

    ctx.sni_callback = note_name
    try:
        g = ctx.wrap_socket(guest, server_side=True)
    except (ssl.SSLError, OSError) as exc:
        raise InterceptError(f"TLS with the box failed (does it trust the box CA?): {exc}") from None
    with guest_connection(g):  # the decrypting socket now owns the guest's descriptor
        if names and normalize_host(names[0]) != host:
            _refuse(g, 421, f"TLS server name {names[0]} is not {host}")
            raise InterceptError(f"TLS server name {names[0]} is not {host}")
        try:
            raw = socket.create_connection((ip, port), timeout=HANDSHAKE_TIMEOUT)
        except OSError as exc:
            _refuse(g, 502, f"cannot connect to {host}: {exc}")
            raise InterceptError(f"cannot connect to {host}: {exc}") from None
        try:
            u = upstream_context(vault).wrap_socket(raw, server_hostname=host)
        except (ssl.SSLError, OSError) as exc:
            raw.close()
            _refuse(g, 502, f"TLS with {host} failed: {exc}")
            raise InterceptError(f"TLS with {host} failed: {exc}") from None
        with u:
            g.settimeout(IDLE_TIMEOUT)
            u.settimeout(UPSTREAM_TIMEOUT)
            return _relay(g, u, swaps)


def _refuse(g: ssl.SSLSocket, status: int, reason: str) -> None:
    send_error(g, f"{status} {HTTPStatus(status).phrase}", reason)


def _next(conn: h11.Connection, sock: ssl.SSLSocket) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        try:
            data = sock.recv(CHUNK)
        except (TimeoutError, ssl.SSLError, ConnectionError):
            data = b""
        conn.receive_data(data)


def _relay(g: ssl.SSLSocket, u: ssl.SSLSocket, swaps: Sequence[Swap]) -> int:
    """HTTP/1.1 request/response cycles; returns how many requests were relayed."""
    gc, uc = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    values = [s.value for s in swaps]
    done = 0
    while True:
        try:
            request = _next(gc, g)
        except h11.RemoteProtocolError as exc:
            raise InterceptError(f"malformed request from the box: {exc}") from None
        if not isinstance(request, h11.Request):
            return done  # the guest closed between requests
        chunks = _body_chunks(gc, g)
        body, complete = _read_body(chunks)
        headers = [(n, swap_in_header(n, v, swaps)) for n, v in request.headers if n not in (b"expect",)]
        if not complete:  # too large to buffer: sent as received, placeholders and all
            u.sendall(_request(uc, request, headers, swaps))
            u.sendall(uc.send(h11.Data(data=body)) or b"")
            for chunk in chunks:  # the rest of it
                u.sendall(uc.send(h11.Data(data=chunk)) or b"")
        else:
            body = swap_in(body, swaps)
            framed = [(n, v) for n, v in headers if n not in (b"content-length", b"transfer-encoding")]
            if body or request.method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
                framed.append((b"content-length", str(len(body)).encode()))
            u.sendall(_request(uc, request, framed, swaps))
            if body:
                u.sendall(uc.send(h11.Data(data=body)) or b"")
        u.sendall(uc.send(h11.EndOfMessage()) or b"")
        done += 1
        if _respond(gc, g, uc, u, values):  # switched protocols: raw bytes from here on
            _copy_raw(g, u, gc.trailing_data[0], uc.trailing_data[0])
            return done
        if h11.MUST_CLOSE in (gc.our_state, uc.our_state, uc.their_state):
            return done
        try:
            gc.start_next_cycle()
            uc.start_next_cycle()
        except h11.LocalProtocolError:
            return done


def _request(uc: h11.Connection, request: h11.Request, headers: list[tuple[bytes, bytes]],
             swaps: Sequence[Swap]) -> bytes:  # fmt: skip
    """The request head for the server; it asks for an uncompressed answer, so
    that a value in it can be masked."""
    headers = [(n, v) for n, v in headers if n != b"accept-encoding"] + [(b"accept-encoding", b"identity")]
    target = swap_in(bytes(request.target), swaps)
    return uc.send(h11.Request(method=request.method, target=target, headers=headers,
                               http_version=request.http_version)) or b""  # fmt: skip


def _read_body(chunks: Iterator[bytes]) -> tuple[bytes, bool]:
    """The request body, whole if it fits in BODY_LIMIT (True), else what was read
    so far (False: the rest is still to come from ``chunks``)."""
    parts: list[bytes] = []
    size = 0
    for chunk in chunks:
        parts.append(chunk)
        size += len(chunk)
        if size > BODY_LIMIT:
            return b"".join(parts), False
    return b"".join(parts), True


def _body_chunks(gc: h11.Connection, g: ssl.SSLSocket) -> Iterator[bytes]:
    """The request body as it arrives (a client that waits for 100 Continue is told to go on)."""
    if gc.they_are_waiting_for_100_continue:
        g.sendall(gc.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
    while True:
        event = _next(gc, g)
        if isinstance(event, h11.EndOfMessage):
            return
        if not isinstance(event, h11.Data):
            raise InterceptError(f"unexpected {type(event).__name__} in a request body")
        yield bytes(event.data)


def _respond(gc: h11.Connection, g: ssl.SSLSocket, uc: h11.Connection, u: ssl.SSLSocket,
             values: Sequence[bytes]) -> bool:  # fmt: skip
    """Relay one response (informational ones first); True if protocols were switched."""
    masker = Masker(values)
    while True:
        try:
            event = _next(uc, u)
        except h11.RemoteProtocolError as exc:
            raise InterceptError(f"malformed response from the server: {exc}") from None
        if isinstance(event, h11.InformationalResponse):
            headers = [(n, masker.mask(v)) for n, v in event.headers]
            g.sendall(gc.send(h11.InformationalResponse(status_code=event.status_code, headers=headers,
                                                        reason=event.reason)) or b"")  # fmt: skip
            if event.status_code == 101:
                return True
            continue
        if not isinstance(event, h11.Response):
            raise InterceptError("the server closed without a response")
        headers = [(n, masker.mask(v)) for n, v in event.headers]
        g.sendall(gc.send(h11.Response(status_code=event.status_code, headers=headers,
                                       reason=event.reason)) or b"")  # fmt: skip
        while True:
            event = _next(uc, u)
            if isinstance(event, h11.Data):
                out = masker.feed(bytes(event.data))
                if out:
                    g.sendall(gc.send(h11.Data(data=out)) or b"")
            elif isinstance(event, h11.EndOfMessage):
                rest = masker.flush()
                if rest:
                    g.sendall(gc.send(h11.Data(data=rest)) or b"")
                g.sendall(gc.send(h11.EndOfMessage()) or b"")
                return False
            else:
                raise InterceptError("the server closed in the middle of a response")


def _copy_raw(g: ssl.SSLSocket, u: ssl.SSLSocket, from_guest: bytes, from_server: bytes) -> None:
    if from_guest:
        u.sendall(from_guest)
    if from_server:
        g.sendall(from_server)
    splice(g, u)
