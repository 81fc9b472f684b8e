"""A gVisor box's network, host side: what QEMU's user networking (libslirp) does
for a VM, for a sandbox whose netstack owns one end of a veth pair in a network
namespace of the box's own (``sandlot.engine.gvisor.network``).

One process per running sandbox, in the host's namespaces, started beside the
``runsc`` that runs the sandbox and ended with it (it watches that process, the
sandbox's parent, which ends when the sandbox does). Its sockets on the box's
side are made in the box's namespace (a socket stays in the namespace it was made
in), so nothing routes from the host's namespace into a box:

- each helper address and port the core names (``listen``: the egress proxy and the
  DNS answerer at ``10.0.2.100``, the proxy's transparent ports, the addresses of
  linked boxes) is a listener there; each connection it takes runs the helper's
  command with the connection as its standard input and output, as QEMU's
  ``guestfwd`` does (the command is the egress relay, which hands it to the home's
  egress server);
- each published port (``publish``) is a listener on the host's loopback; each
  connection it takes is joined to a connection to the box's address and port;
- in ``open`` mode the box's other TCP connections are redirected here (an
  ``iptables`` REDIRECT in the box's namespace) and made from the host to where
  they were going (``10.0.2.2`` being the host's loopback, as with QEMU), and its
  DNS questions to ``10.0.2.3`` go to the host's resolver.

The standard library and ``sandlot.net.relay`` only, as it starts with every
sandbox. The spec is one JSON
argument, so the egress server, which lives while a process names its socket,
sees this one name it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import signal
import socket
import struct
import sys
import threading
from typing import Any

from . import netns
from .addresses import GATEWAY_ADDRESS, GUEST_ADDRESS, RESOLVER_ADDRESS
from .relay import close_guest, splice

SO_ORIGINAL_DST = 80
IP_FREEBIND = 15  # bind to an address the namespace gets a moment later
CHUNK = 1 << 16
UDP_TIMEOUT = 5.0


class Namespaces:
    """The host's network namespace and the box's; sockets made in either."""

    def __init__(self, box_netns: str) -> None:
        self.host = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.box = os.open(box_netns, os.O_RDONLY | os.O_CLOEXEC)

    def box_socket(self, kind: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket of the box's namespace (only this thread enters it, for a moment)."""
        netns.enter(self.box, "the box's namespace")
        try:
            return socket.socket(socket.AF_INET, kind)
        finally:
            netns.enter(self.host, "the host's namespace")


def listener(sock: socket.socket, address: str, port: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
    sock.bind((address, port))
    if kind == socket.SOCK_STREAM:
        sock.listen(128)
    return sock


def pump(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done (``a``, the box's side, ended as
    ``relay.splice`` and ``close_guest`` end a guest's connection), then close both."""
    with contextlib.suppress(OSError):
        splice(a, b)
    close_guest(a)
    b.close()


def serve(sock: socket.socket, handle: Any) -> None:
    def loop() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


RELAY_MESSAGE = 16384  # the relay's own limit (fdrelay.c's MAX_MESSAGE)
RELAY_RECEIPT_TIMEOUT = 5.0


def hand_over(server: str, helper: list[str], conn: socket.socket) -> bool:
    """What the egress relay (``fdrelay.c``) does for a connection, without a process of its
    own: hand the connection and the helper's argv to the home's egress server; True once
    the server took it. A process per connection is what a guest opening connections as
    fast as it can would make the host start otherwise (a gVisor box's flood of box links
    slowed a neighbour's execs to 300 ms)."""
    message = b"".join(a.encode() + b"\0" for a in helper)
    if len(message) > RELAY_MESSAGE:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(RELAY_RECEIPT_TIMEOUT)
        try:
            s.connect(server)
            socket.send_fds(s, [message], [conn.fileno()])
            return s.recv(1) == b"+"
        except OSError:
            return False


def run_command(argv: list[str]) -> Any:
    """A helper run for one connection, as QEMU's ``guestfwd=...-cmd:`` runs it. The egress
    relay's command (``RELAY SOCKET -- HELPER...``) is done here: the connection goes to the
    server, and the relay runs only where the server does not take it (it then runs the
    helper itself)."""
    relayed = len(argv) > 3 and argv[2] == "--"

    def handle(conn: socket.socket) -> None:
        if relayed and hand_over(argv[1], argv[3:], conn):
            conn.close()
            return
        try:
            fd = conn.fileno()
            streams = [(os.POSIX_SPAWN_DUP2, fd, 0), (os.POSIX_SPAWN_DUP2, fd, 1)]
            os.posix_spawnp(argv[0], argv, dict(os.environ), file_actions=streams)
        except OSError as exc:
            print(f"forwarder: {argv[0]}: {exc}", file=sys.stderr, flush=True)
        finally:
            conn.close()

    return handle


def to_box(ns: Namespaces, guest_port: int) -> Any:
    """A published port: a connection to the box's address and port, joined to this one."""

    def handle(conn: socket.socket) -> None:
        inside = ns.box_socket()
        try:
            inside.settimeout(10)
            inside.connect((GUEST_ADDRESS, guest_port))
            inside.settimeout(None)
        except OSError:
            inside.close()
            conn.close()
            return
        pump(inside, conn)

    return handle


def nameserver() -> str:
    """The host's first IPv4 resolver (what a box in open mode asks at 10.0.2.3)."""
    with contextlib.suppress(OSError):
        for line in open("/etc/resolv.conf").read().splitlines():  # noqa: SIM115
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and "." in parts[1]:
                return parts[1]
    return "127.0.0.1"


def outward(conn: socket.socket) -> None:
    """Open mode: a box's connection, made from the host to where it was going."""
    try:
        raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!2xH4s", raw)
        address = socket.inet_ntoa(packed)
        if address == GATEWAY_ADDRESS:  # the host's loopback, as under QEMU
            address = "127.0.0.1"
        elif address == RESOLVER_ADDRESS:
            address = nameserver()
        out = socket.create_connection((address, port), timeout=30)
        out.settimeout(None)
    except OSError:
        conn.close()
        return
    pump(conn, out)


def dns_outward(sock: socket.socket) -> None:
    """Open mode: each question to 10.0.2.3 asked of the host's resolver, the answer sent back."""

    def ask(question: bytes, peer: Any) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as up:
            up.settimeout(UDP_TIMEOUT)
            try:
                up.sendto(question, (nameserver(), 53))
                answer = up.recv(CHUNK)
            except OSError:
                return
        with contextlib.suppress(OSError):
            sock.sendto(answer, peer)

    def loop() -> None:
        while True:
            try:
                question, peer = sock.recvfrom(CHUNK)
            except OSError:
                return
            threading.Thread(target=ask, args=(question, peer), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


def bind_published(spec: dict[str, Any]) -> list[tuple[socket.socket, int]]:
    """The host's listeners of the published ports, the same host ports as before where
    the box had them (a restore in place), else the ones asked for (0: any)."""
    earlier = {int(g): int(h) for _, h, g in spec.get("bound", [])}
    out = []
    for address, host_port, guest_port in spec.get("publish", []):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, host_port or earlier.get(guest_port, 0)))
        except OSError:
            if host_port:
                raise
            sock.bind((address, 0))
        sock.listen(128)
        out.append((sock, int(guest_port)))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m sandlot.net.forwarder SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the helpers' exits are nobody's business here
    try:
        sandbox = os.pidfd_open(int(spec["watch_pid"]))
    except OSError:
        return 0  # the sandbox is gone already
    ns = Namespaces(spec["netns"])
    published = bind_published(spec)  # in the host's namespace
    for address, port, command in spec.get("listen", []):
        serve(listener(ns.box_socket(), address, int(port)), run_command(shlex.split(command)))
    if spec.get("open_port"):
        serve(listener(ns.box_socket(), "0.0.0.0", int(spec["open_port"])), outward)
        dns_outward(listener(ns.box_socket(socket.SOCK_DGRAM), RESOLVER_ADDRESS, 53, socket.SOCK_DGRAM))
    bound = []
    for sock, guest_port in published:
        address, port = sock.getsockname()[:2]
        bound.append([address, port, guest_port])
        serve(sock, to_box(ns, guest_port))
    sys.stdout.write(json.dumps({"ports": bound}) + "\n")
    sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.close(1)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:  # until the sandbox ends
        if select.select([sandbox], [], [], 60.0)[0]:
            os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
