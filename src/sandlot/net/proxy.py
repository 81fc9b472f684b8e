"""The egress proxy: one guest connection at a time, handed over by QEMU.

QEMU's user networking forwards each connection the guest opens to the proxy
address (``guestfwd ... cmd:``) to the command line ``python -m sandlot.net.proxy
POLICY LOG``, with the connection as descriptors 0-2. The relay in front of it
hands the connection to the home's egress server (``egress``), which runs
``handle_connection`` in a thread; where none takes it the command runs as its
own process (``main``). Either way the policy file is read afresh for each
connection, so a policy change applies to a running box at its next connection.

It speaks what proxy-aware clients send (``HTTPS_PROXY``/``HTTP_PROXY``, which
sandlot sets in every command's environment): ``CONNECT host:port`` and
absolute-form HTTP requests. With ``--transparent PORT`` it serves connections
made straight to the proxy address on PORT (sandlot's DNS answers allowed names
with that address), routed by the TLS server name or the HTTP Host header.

Every decision is made on the host: the name is checked, resolved here, each
address checked, and the checked address is the one connected to. For CONNECT
in allowlist mode, the TLS ClientHello's server name must be allowed too. A
tunnel to a host the box's secrets are for is decrypted to swap them in (see
``intercept``). Decisions are appended to LOG, one JSON line each, through the box's
ledger (``ledger``: the log bounded and folded, and the box's connections limited in
rate and in number, ``--limits``): past a limit the guest is refused at once, with a
``429`` where it asked in HTTP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .boxlink import LinkInfo, open_box_port
from .ledger import HelperOptions, Ledger, Limits
from .policy import (
    Denied,
    IPAddress,
    Policy,
    adopt_guest_connection,
    normalize_host,
    read_policy,
    resolve,
    split_host_port,
    valid_host,
)
from .relay import guest_connection, send_error, splice

if TYPE_CHECKING:
    from .secrets import Vault

HEAD_LIMIT = 16 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 15.0
HELLO_TIMEOUT = 10.0


def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The request head (through the blank line) and whatever followed it."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > HEAD_LIMIT:
            raise Denied("request head too large")
        chunk = sock.recv(4096)
        if not chunk:
            raise Denied("connection closed before a complete request")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def host_and_port(target: str, default_port: int) -> tuple[str, int]:
    try:
        host, port = split_host_port(target)
    except ValueError as exc:
        raise Denied(f"bad target {target!r}: {exc}") from None
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise Denied(f"bad port in {target!r}")
    host = normalize_host(host)
    if not valid_host(host):
        raise Denied(f"bad host in {target!r}")
    return host, int(port) if port else default_port


def parse_request(head: bytes) -> tuple[str, str, int, list[bytes]]:
    """(method, host, port, header lines) of a proxy request."""
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise Denied("malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise Denied(f"unsupported protocol {version!r}")
    if method == "CONNECT":
        host, port = host_and_port(target, 443)
    elif target.lower().startswith("http://"):
        authority = target[7:].split("/", 1)[0].split("@")[-1]
        host, port = host_and_port(authority, 80)
    else:
        raise Denied("not a proxy request (CONNECT host:port or http://host/...)")
    return method, host, port, [line for line in lines[1:] if line]


def client_hello_sni(data: bytes) -> str | None:
    """The server name of a TLS ClientHello (None if absent or not TLS)."""
    try:
        if len(data) < 5 or data[0] != 0x16:  # handshake record
            return None
        body = data[5 : 5 + int.from_bytes(data[3:5], "big")]
        if not body or body[0] != 0x01:  # ClientHello
            return None
        p = 4 + 2 + 32  # header, version, random
        p += 1 + body[p]  # session id
        p += 2 + int.from_bytes(body[p : p + 2], "big")  # cipher suites
        p += 1 + body[p]  # compression methods
        end = p + 2 + int.from_bytes(body[p : p + 2], "big")
        p += 2
        while p + 4 <= min(end, len(body)):
            kind, size = int.from_bytes(body[p : p + 2], "big"), int.from_bytes(body[p + 2 : p + 4], "big")
            if kind == 0:  # server_name: list length, then (type, length, name)
                ext = body[p + 4 : p + 4 + size]
                if len(ext) >= 5 and ext[2] == 0:
                    n = int.from_bytes(ext[3:5], "big")
                    return normalize_host(ext[5 : 5 + n].decode("ascii"))
                return None
            p += 4 + size
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def read_client_hello(sock: socket.socket) -> bytes:
    """The guest's first TLS record (or whatever it sent first), whole if it can be."""
    sock.settimeout(HELLO_TIMEOUT)
    data = b""
    with contextlib.suppress(TimeoutError):
        while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
            chunk = sock.recv(16384)
            if not chunk:
                break
            data += chunk
            if data[0] != 0x16 or len(data) > 65536:
                break
    return data


class Args(NamedTuple):
    """``POLICY LOG [--link FILE] [--limits SPEC] [--transparent PORT | --box NAME PORT]``:
    a proxy request per connection; a connection to the proxy address on PORT itself;
    or one to the address of box NAME on PORT (``--link``: ``boxlink.LinkInfo``;
    ``--limits``: the box's bounds, ``ledger.Limits``, else this process's)."""

    policy: Path
    log: str
    link: Path | None = None
    transparent: int | None = None
    box: tuple[str, int] | None = None
    limits: Limits | None = None

    @classmethod
    def parse(cls, argv: list[str]) -> Args | None:
        opts = HelperOptions.parse(argv[3:]) if len(argv) >= 3 else None
        if opts is None:
            return None
        transparent, box, rest = None, None, opts.rest
        while rest:
            if rest[0] == "--transparent" and len(rest) > 1 and rest[1].isdigit():
                transparent, rest = int(rest[1]), rest[2:]
            elif rest[0] == "--box" and len(rest) > 2 and rest[2].isdigit():
                box, rest = (rest[1], int(rest[2])), rest[3:]
            else:
                return None
        return cls(Path(argv[1]), argv[2], opts.link, transparent, box, opts.limits)

    def ledger(self) -> Ledger:
        return Ledger(Path(self.log), self.limits or Limits.default())


def connect_box(policy: Policy, args: Args, box: str, port: int, entry: dict[str, object]) -> socket.socket:
    """A connection to ``port`` of box ``box``, if the policy allows it (see ``boxlink``)."""
    entry["box"] = box
    if not policy.allows_box(box, port):
        raise Denied(f"port {port} of box {box} is not on this box's allowlist")
    info = LinkInfo.read(args.link) if args.link else None
    if info is None:
        raise Denied("this box's VM was started without a box link: restart it to reach other boxes")
    return open_box_port(info, box, port)


def serve(guest: socket.socket, args: Args, log: list[dict[str, object]]) -> None:
    guest.settimeout(HEAD_TIMEOUT)
    entry: dict[str, object] = {"time": round(time.time(), 3)}
    log.append(entry)
    answered = False  # the guest was told the tunnel is open: a refusal can only close it
    policy_path = args.policy
    try:
        head, rest = read_head(guest)
        method, host, port, headers = parse_request(head)
        entry.update(method=method, host=host, port=port)
        policy = read_policy(policy_path)
        box = policy.box_named(host)
        upstream = None if box is None else connect_box(policy, args, box, port, entry)
    except Denied as exc:
        entry.update(decision="denied", reason=str(exc))
        tell_denied(guest, exc)
        return
    except OSError as exc:
        entry.update(decision="failed", reason=str(exc))
        tell_failed(guest)
        return
    if upstream is None:
        upstream, answered, rest = open_upstream(guest, policy, args, host, port, method, rest, entry)
        if upstream is None:
            return
    entry["decision"] = "allowed"
    with upstream:
        upstream.settimeout(None)
        guest.settimeout(None)
        if method == "CONNECT":
            if not answered:
                guest.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            path = head.split(b" ", 2)[1].decode("ascii")[7:]
            path = "/" + path.split("/", 1)[1] if "/" in path else "/"
            kept = [h for h in headers if not h.lower().startswith((b"proxy-", b"connection:"))]
            # one request per connection: a second one could name another host
            rest = (
                f"{method} {path} HTTP/1.1\r\n".encode()
                + b"\r\n".join([*kept, b"Connection: close"])
                + b"\r\n\r\n"
                + rest
            )
        if rest:
            upstream.sendall(rest)
        splice(guest, upstream)


def open_upstream(
    guest: socket.socket,
    policy: Policy,
    args: Args,
    host: str,
    port: int,
    method: str,
    rest: bytes,
    entry: dict[str, object],
) -> tuple[socket.socket | None, bool, bytes]:
    """(the connection, whether the guest was told the tunnel is open, what the guest
    sent first) for a proxy request to a host outside; None once it was refused
    (the guest was told) or handed to the secrets' interception (served)."""
    answered = False
    policy_path = args.policy
    try:
        ip = resolve(policy, host, port)
        entry["address"] = str(ip)
        vault = secrets_for(policy_path, host, port) if method == "CONNECT" else None
        if vault is not None:
            if rest:
                raise Denied("data sent before the tunnel was open")
            guest.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            answered = True
            swap_secrets(guest, policy_path, host, port, ip, vault, entry)
            return None, True, b""
        if method == "CONNECT" and policy.mode == "allowlist":
            guest.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            hello = rest + read_client_hello(guest)
            answered, rest = True, hello
            sni = client_hello_sni(hello)
            if sni is not None and sni != host and not policy.allows_name(sni, port):
                raise Denied(f"TLS server name {sni} is not on this box's allowlist")
        return socket.create_connection((str(ip), port), timeout=CONNECT_TIMEOUT), answered, rest
    except Denied as exc:
        entry.update(decision="denied", reason=str(exc))
        if not answered:
            tell_denied(guest, exc)
    except OSError as exc:
        entry.update(decision="failed", reason=str(exc))
        if not answered:
            tell_failed(guest)
    return None, answered, rest


def tell_denied(guest: socket.socket, exc: Denied) -> None:
    send_error(guest, "403 Forbidden", f"egress denied: {exc}", "X-Sandlot-Egress: denied\r\n")


def tell_failed(guest: socket.socket) -> None:
    with contextlib.suppress(OSError):
        guest.sendall(b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")


def secrets_for(policy_path: Path, host: str, port: int) -> Vault | None:
    """The box's secrets, if some are for ``host:port`` (the connection is then decrypted)."""
    if not os.path.exists(policy_path.parent / "secrets.json"):  # secrets.SECRETS_FILE
        return None  # most boxes: the secrets module is not even imported
    from .secrets import load_vault

    try:
        vault = load_vault(policy_path.parent)
    except ValueError as exc:
        raise Denied(f"this box's secrets file cannot be read: {exc}") from None
    return vault if vault is not None and vault.for_host(host, port) else None


def swap_secrets(
    guest: socket.socket,
    policy_path: Path,
    host: str,
    port: int,
    ip: IPAddress,
    vault: Vault,
    entry: dict[str, object],
) -> None:
    """Relay HTTPS to a host the box's secrets are for (see ``intercept``)."""
    from . import intercept  # h11 and TLS only for the hosts that need them

    swaps = vault.for_host(host, port)
    entry.update(decision="allowed", secrets=[s.name for s in swaps])
    entry["requests"] = intercept.serve(guest, host, port, str(ip), vault, swaps, policy_path.parent / "tls")


def peek_first(sock: socket.socket) -> bytes:
    """The first TLS record or HTTP request head, left unread in the socket."""
    sock.settimeout(HEAD_TIMEOUT)
    deadline = time.monotonic() + HEAD_TIMEOUT
    while True:
        data = sock.recv(HEAD_LIMIT, socket.MSG_PEEK)
        if not data:
            raise Denied("connection closed before a request")
        if data[0] == 0x16:
            if len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[3:5], "big"):
                return data
        elif b"\r\n\r\n" in data:
            return data
        if len(data) >= HEAD_LIMIT or time.monotonic() > deadline:
            return data
        time.sleep(0.005)  # the rest is on its way


def transparent_target(first: bytes, port: int) -> tuple[str, str]:
    """("TLS" or "HTTP", host) of a connection made straight to a name sandlot's DNS
    answered: the TLS server name, or the HTTP Host header."""
    if first[:1] == b"\x16":
        sni = client_hello_sni(first)
        if not sni:
            raise Denied("TLS without a server name: sandlot routes a connection by it")
        if not valid_host(sni):
            raise Denied(f"bad TLS server name {sni!r}")
        return "TLS", sni
    for line in first.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"host":
            return "HTTP", host_and_port(value.strip().decode("ascii", "replace"), port)[0]
    raise Denied("neither TLS nor an HTTP request with a Host header")


def serve_transparent(guest: socket.socket, args: Args, port: int, log: list[dict[str, Any]]) -> None:
    """A connection to the proxy address on ``port`` itself, not a proxy request:
    routed by the name inside it, checked like a proxy request for that name."""
    entry: dict[str, object] = {"time": round(time.time(), 3), "port": port, "transparent": True}
    log.append(entry)
    kind = "TLS"
    policy_path = args.policy
    try:
        first = peek_first(guest)
        kind, host = transparent_target(first, port)
        entry.update(method=kind, host=host)
        policy = read_policy(policy_path)
        box = policy.box_named(host)
        if box is not None:  # a box named after the VM started: no address of its own
            upstream = connect_box(policy, args, box, port, entry)
            return carry(guest, upstream, entry)
        ip = resolve(policy, host, port)
        entry["address"] = str(ip)
        vault = secrets_for(policy_path, host, port) if kind == "TLS" else None
        if vault is not None:
            swap_secrets(guest, policy_path, host, port, ip, vault, entry)
            return
        upstream = socket.create_connection((str(ip), port), timeout=CONNECT_TIMEOUT)
    except Denied as exc:
        entry.update(decision="denied", reason=str(exc))
        drain(guest)
        if kind == "HTTP":
            tell_denied(guest, exc)
        return
    except OSError as exc:
        entry.update(decision="failed", reason=str(exc))
        return
    carry(guest, upstream, entry)  # what was peeked is still to be read


def serve_box(guest: socket.socket, args: Args, box: str, port: int, log: list[dict[str, Any]]) -> None:
    """A connection to the address sandlot's DNS gave box ``box``, on ``port``."""
    entry: dict[str, object] = {"time": round(time.time(), 3), "port": port, "transparent": True}
    log.append(entry)
    try:
        upstream = connect_box(read_policy(args.policy), args, box, port, entry)
    except (Denied, OSError) as exc:
        entry.update(decision="denied" if isinstance(exc, Denied) else "failed", reason=str(exc))
        drain(guest)  # the guest sees its connection closed
        return
    carry(guest, upstream, entry)


def drain(guest: socket.socket) -> None:
    """Read what the guest already sent (closing on unread data resets the connection)."""
    with contextlib.suppress(OSError):
        guest.setblocking(False)
        while guest.recv(HEAD_LIMIT):
            pass
    guest.setblocking(True)


def carry(guest: socket.socket, upstream: socket.socket, entry: dict[str, object]) -> None:
    entry["decision"] = "allowed"
    with upstream:
        upstream.settimeout(None)
        guest.settimeout(None)
        splice(guest, upstream)


def main(argv: list[str]) -> int:
    """See ``Args``: one connection, handed over by QEMU as descriptors 0-2."""
    if Args.parse(argv) is None:
        return 2
    handle_connection(adopt_guest_connection(), argv)
    return 0


def handle_connection(guest: socket.socket, argv: list[str]) -> None:
    """Serve one guest connection as ``main`` with ``argv`` would (the egress server
    runs this in a thread of its own); the connection is closed at the end."""
    args = Args.parse(argv)
    if args is None:
        guest.close()
        return
    log: list[dict[str, object]] = []
    ledger = args.ledger()
    try:
        with guest_connection(guest):
            if not ledger.admit("conn"):
                rate = ledger.limits.connections
                refuse(
                    guest,
                    args,
                    log,
                    f"more than {rate.per_s:g} new connections a second (burst {rate.burst:g})",
                )
                return
            with ledger.slot() as served:
                if not served:
                    refuse(guest, args, log, f"{ledger.limits.open} connections of this box are open")
                elif args.box is not None:
                    serve_box(guest, args, *args.box, log)
                elif args.transparent is not None:
                    serve_transparent(guest, args, args.transparent, log)
                else:
                    serve(guest, args, log)
    except Exception as exc:  # a broken connection ends it; the log says why
        if log:
            log[-1].setdefault("decision", "failed")
            log[-1].setdefault("reason", f"{type(exc).__name__}: {exc}")
    finally:
        if log:
            with contextlib.suppress(OSError):
                ledger.record(log[-1])


REFUSAL_HEAD_WAIT = 0.25  # seconds a refused proxy request's head may take to arrive


def refuse(guest: socket.socket, args: Args, log: list[dict[str, object]], why: str) -> None:
    """A connection past the box's limits: refused at once. A proxy request hears ``429``,
    once its head is read (briefly waited for: a response to a request not yet read would
    be lost to the reset its unread bytes cause), and the log says what it asked."""
    entry: dict[str, object] = {
        "time": round(time.time(), 3),
        "decision": "refused",
        "reason": f"limit: {why}",
    }
    log.append(entry)
    if args.box is not None:
        entry.update(box=args.box[0], port=args.box[1], transparent=True)
    elif args.transparent is not None:
        entry.update(port=args.transparent, transparent=True)
    else:
        guest.settimeout(REFUSAL_HEAD_WAIT)
        with contextlib.suppress(OSError, Denied):
            head, _ = read_head(guest)
            method, host, port, _ = parse_request(head)
            entry.update(method=method, host=host, port=port)
        send_error(guest, "429 Too Many Requests", f"egress refused: {why}",
                   "X-Sandlot-Egress: refused\r\nRetry-After: 1\r\n")  # fmt: skip
    drain(guest)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
