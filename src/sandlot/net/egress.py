"""The home's egress server: the guest connections to the egress proxy and the DNS
answerer of every box, served by one long-lived process.

QEMU's user network runs a command once per guest connection (``guestfwd ...
cmd:``) with the connection as the command's descriptors 0-2. A Python helper per
connection (``python -m sandlot.net.proxy`` or ``.dns``) costs 60-80 ms before it
reads a byte, mostly the interpreter starting. So the command is the relay
(``fdrelay.c``, built once per home, about a millisecond to run): it hands
descriptor 0 and the helper's command line to this server over a Unix socket and
exits, and the server runs the helper's ``handle_connection`` on that connection in
a thread of its own. Everything else stays per connection: the policy, the log, the
secrets and the box link are read from the files the command line names, so a
policy change still applies at the next connection.

A QEMU VM of device set "5" needs no relay while the server runs: its egress port
connects to the server's stream socket beside this one (``mux_socket``), and each
guest connection comes as a stream of that session (``sandlot.net.mux``), served by
the same helpers in the same threads. The relay is its way out while no server is
there.

One server per home (``egress_socket``), which takes a lock first so at most one
runs. The launcher starts it whenever a VM with a network card starts
(``ensure_server``). It lives while any process whose command line names its
socket (a QEMU it serves) lives, and ends ``IDLE_EXIT`` seconds after the last
connection once none does. Where no server takes a connection (it was killed, it
refuses, it is ending) the relay runs the helper itself: a connection is slower
then, never lost. Where no C compiler is at hand the launcher gives QEMU the
helper's command line directly, as does ``SANDLOT_EGRESS_RELAY=0``.

The server's proxy threads are not in any box's host cgroup (the per-connection
helpers were QEMU's children, and were).

The message is the helper's argv as NUL-terminated strings with one descriptor
(SCM_RIGHTS) on a SOCK_SEQPACKET connection; the answer one byte, ``+`` (the server
owns the connection now) or ``-`` (refused: the relay runs the helper). Only the
helpers named in ``HELPERS``, run by this very interpreter, are served here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import pids
from ..config import build_c, private_listener, spawn_unless_locked, try_flock
from ..errors import HostSetupError
from ..native import RELAY, prebuilt
from .mux import Session, peer_helpers

MODULE = "sandlot.net.egress"
SWITCH = "SANDLOT_EGRESS_RELAY"
MUX_SWITCH = "SANDLOT_EGRESS_MUX"
SERVER_VERSION = 2  # 2: VMs' egress ports (``sandlot.net.mux``) beside the relays
HELPERS = ("sandlot.net.proxy", "sandlot.net.dns")
MAX_MESSAGE = 16384  # the relay's limit too
MAX_ACTIVE = 2048  # connections served at once; past it the relay runs the helper itself
IDLE_EXIT = 60.0  # seconds without a connection, once no QEMU names the socket
CHECK_EVERY = 10.0
RECEIPT_TIMEOUT = 5.0  # for the relay's message, which it sent before waiting

Handler = Callable[[socket.socket, list[str]], None]


@dataclass(frozen=True, slots=True)
class Relay:
    """What the launcher needs to route a VM's guest connections to the server."""

    binary: Path
    socket: Path
    lock: Path

    def command(self, helper: list[str]) -> list[str]:
        """The per-connection command: the relay, falling back to ``helper``."""
        return [str(self.binary), str(self.socket), "--", *helper]

    @property
    def mux(self) -> Path:
        """Where the server takes VMs' egress ports (``sandlot.net.mux``)."""
        return mux_socket(self.socket)


def mux_socket(sock: Path) -> Path:
    """The stream socket beside a server's relay socket, for VMs' egress ports."""
    return sock.with_suffix(".mux")


def egress_socket(runtime: Path, home: Path) -> Path:
    """Where a home's egress server listens: a short path (unix sockets allow 107
    bytes) in the private runtime directory. Its name carries ``SERVER_VERSION``: a
    server of an earlier sandlot, kept alive by the VMs it serves, never stands in the
    way of this one's (each VM's command line names the socket of its own)."""
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:16]
    return runtime / f"egress{SERVER_VERSION}-{digest}.sock"


_relays: dict[tuple[Path, Path], Relay | None] = {}


def relay_for(home: Path, runtime: Path) -> Relay | None:
    """The home's relay (the wheel's prebuilt one, or built on first use); None where
    there is none and no C compiler to build it, or ``SANDLOT_EGRESS_RELAY=0`` turns it
    off: the launcher then has QEMU run a helper per connection."""
    if os.environ.get(SWITCH) == "0":
        return None
    key = (home, runtime)
    if key not in _relays:
        binary = prebuilt(RELAY)
        if binary is None and (cc := shutil.which("gcc") or shutil.which("cc")) is not None:
            with contextlib.suppress(HostSetupError, OSError):
                binary, _ = build_c(home / "relay" / "host", RELAY.name, RELAY.sources(), [cc], RELAY.flags)
        relay = None
        if binary is not None:
            with contextlib.suppress(HostSetupError, OSError):
                sock = egress_socket(runtime, home)
                relay = Relay(binary, sock, sock.with_suffix(".lock"))
        _relays[key] = relay
    return _relays[key]


def mux_for(relay: Relay | None) -> Path | None:
    """Where VMs' egress ports connect to the home's server: none without a relay (no
    server runs), nor where ``SANDLOT_EGRESS_MUX=0`` says each connection goes through
    QEMU's user network and the relay (as it did before the port: for comparisons)."""
    if relay is None or os.environ.get(MUX_SWITCH) == "0":
        return None
    return relay.mux


def ensure_server(relay: Relay) -> bool:
    """Start the home's server, detached, unless one runs; True if one was started."""
    return spawn_unless_locked(relay.lock, MODULE, str(relay.socket), str(relay.lock), cwd="/")


# -- the server -------------------------------------------------------------------------


class Server:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.active = 0
        self.last = time.monotonic()
        self._count = threading.Lock()
        self._handlers: dict[str, Handler] = {}

    def serve(self) -> None:
        listener = private_listener(self.path, socket.SOCK_SEQPACKET, 512)  # we hold the lock
        listener.settimeout(CHECK_EVERY)
        ports = private_listener(mux_socket(self.path), socket.SOCK_STREAM, 128)
        threading.Thread(target=self.serve_ports, args=(ports,), daemon=True).start()
        with listener:
            while True:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    if self._done():
                        break
                    continue
                self.take(conn)
            # new relays find no socket from here on; those already queued are still served
            # (VMs' ports connect again to the next server)
            for path in (self.path, mux_socket(self.path)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            listener.setblocking(False)
            while True:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, OSError):
                    break
                self.take(conn)

    def _done(self) -> bool:
        with self._count:
            idle = self.active == 0 and time.monotonic() - self.last >= IDLE_EXIT
        return idle and not _named_by_a_process(self.path)

    def take(self, conn: socket.socket) -> None:
        """One relay's message: its connection, and the helper to serve it with."""
        with conn:
            conn.settimeout(RECEIPT_TIMEOUT)
            try:
                msg, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
            except OSError:
                return
            guest_fd = fds[0] if len(fds) == 1 else None
            for extra in fds[1:]:
                os.close(extra)
            handler, argv = self._helper(msg) if guest_fd is not None else (None, [])
            guest = None
            if guest_fd is not None:
                try:
                    guest = socket.socket(fileno=guest_fd)
                except OSError:  # not a socket: no connection QEMU made
                    os.close(guest_fd)
            truncated = flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
            if handler is not None and guest is not None and (truncated or not self._admit()):
                handler = None
            if handler is None or guest is None:
                if guest is not None:
                    guest.close()
                with contextlib.suppress(OSError):
                    conn.send(b"-")  # the relay runs the helper itself
                return
            if guest.family in (socket.AF_INET, socket.AF_INET6):
                # libslirp's end is a loopback TCP socket: small answers go out at once
                with contextlib.suppress(OSError):
                    guest.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn.send(b"+")
            except OSError:  # the relay is gone: whatever it did with its copy stands
                guest.close()
                self._finished()
                return
        threading.Thread(target=self._run, args=(handler, guest, argv), daemon=True).start()

    def _admit(self) -> bool:
        """Count one more connection served here, unless ``MAX_ACTIVE`` are."""
        with self._count:
            if self.active >= MAX_ACTIVE:
                return False
            self.active += 1
            self.last = time.monotonic()
            return True

    def serve_ports(self, listener: socket.socket) -> None:
        """VMs' egress ports, a thread each (``sandlot.net.mux``)."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._port, args=(conn,), daemon=True).start()

    def _port(self, conn: socket.socket) -> None:
        try:
            helpers = peer_helpers(conn, mux_socket(self.path))
        except OSError:
            helpers = None
        if helpers is None:
            conn.close()
            return
        table: dict[int, tuple[Handler, list[str]]] = {}
        for port, argv in helpers.items():
            handler, args = self._helper(("\0".join(argv) + "\0").encode())
            if handler is not None:
                table[port] = (handler, args)

        def serve(guest: socket.socket, port: int) -> bool:
            if not self._admit():
                return False
            handler, argv = table[port]
            threading.Thread(target=self._run, args=(handler, guest, argv), daemon=True).start()
            return True

        Session(conn, sorted(table), serve).run()

    def _helper(self, msg: bytes) -> tuple[Handler | None, list[str]]:
        """The helper a relay asks for: ``PYTHON -m MODULE ARGS...``, served here only
        if it is one of ours run by this interpreter (another sandlot's is not)."""
        try:
            parts = msg.decode().split("\0")
        except UnicodeDecodeError:
            return None, []
        if len(parts) < 4 or parts[-1] != "" or parts[0] != sys.executable or parts[1] != "-m":
            return None, []
        module, args = parts[2], parts[3:-1]
        if module not in HELPERS:
            return None, []
        if module not in self._handlers:
            self._handlers[module] = importlib.import_module(module).handle_connection
        return self._handlers[module], [module, *args]

    def _run(self, handler: Handler, guest: socket.socket, argv: list[str]) -> None:
        try:
            handler(guest, argv)
        except Exception:  # one connection's failure is its own
            with contextlib.suppress(OSError):
                guest.close()
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._count:
            self.active -= 1
            self.last = time.monotonic()


def _named_by_a_process(path: Path) -> bool:
    """Whether a live process other than this one names ``path`` on its command line
    (a QEMU whose relays come here)."""
    needle = str(path)
    return any(needle in arg for process in pids.processes() for arg in process.argv)


def main(argv: list[str]) -> int:
    """``SOCKET LOCK``: serve until idle; exit at once if the home already has a server."""
    if len(argv) != 3:
        return 2
    if try_flock(Path(argv[2])) is None:  # held until this process ends
        return 0
    import resource

    with contextlib.suppress(ValueError, OSError):  # two descriptors a connection, for MAX_ACTIVE of them
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    threading.stack_size(512 * 1024)  # the helpers recurse little; a thread per connection
    Server(Path(argv[1])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
