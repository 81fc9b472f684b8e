"""The relay and the home's egress server (``net/fdrelay.c``, ``net/egress.py``): a
real relay binary, a real server process and the real proxy, on socketpairs that
stand for QEMU's guest connections. No VM: the VM path is in tests/vm (every
network test goes through them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import pids
from sandlot.net import egress
from sandlot.net import relay as relay_mod
from sandlot.net.policy import Policy, write_policy

from tests.support.waiting import wait_for

REQUEST = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n"


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[egress.Relay]:
    r = egress.relay_for(tmp_path / "home", tmp_path)
    assert r is not None, "gcc builds the relay"
    yield r
    for pid in _server_pids(r):
        os.kill(pid, signal.SIGKILL)


def _server_pids(r: egress.Relay) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"{egress.MODULE} {r.socket}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _helper(tmp_path: Path) -> list[str]:
    policy = tmp_path / "policy.json"
    write_policy(policy, Policy(mode="allowlist"))  # nothing allowed: the proxy answers 403
    return [sys.executable, "-m", "sandlot.net.proxy", str(policy), str(tmp_path / "egress.log")]


def _connect(r: egress.Relay, helper: list[str]) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """A guest connection as QEMU makes one: the relay with the connection on 0-2."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(r.command(helper), stdin=theirs, stdout=theirs, stderr=theirs, close_fds=True)
    theirs.close()
    return ours, proc


def _wait_server(r: egress.Relay) -> None:
    deadline = time.monotonic() + 30
    while not r.socket.exists():
        assert time.monotonic() < deadline, "the egress server did not start"
        time.sleep(0.02)


def test_unit_the_server_owns_the_connection_once_the_relay_exits(
    relay: egress.Relay, tmp_path: Path
) -> None:
    assert egress.ensure_server(relay)
    _wait_server(relay)
    assert not egress.ensure_server(relay)  # one runs: its lock is taken
    conns = [_connect(relay, _helper(tmp_path)) for _ in range(5)]
    for _, proc in conns:
        # the relay is gone before the guest has sent a byte: the server holds the connection
        assert proc.wait(timeout=10) == 0
    for guest, _ in conns:
        guest.sendall(REQUEST)
        assert guest.recv(4096).startswith(b"HTTP/1.1 403 Forbidden")
        guest.close()
    deadline = time.monotonic() + 10  # each line is written as its connection ends (the file with the first)
    path = tmp_path / "egress.log"
    while len(log := (path.read_text() if path.exists() else "").splitlines()) < 5:
        assert time.monotonic() < deadline, log
        time.sleep(0.02)
    assert len(log) == 5 and all('"decision": "denied"' in line for line in log)
    assert len(_server_pids(relay)) == 1


def test_unit_without_a_server_the_relay_runs_the_helper_itself(relay: egress.Relay, tmp_path: Path) -> None:
    relay.socket.touch()  # a stale path, nothing listening: connect is refused
    guest, proc = _connect(relay, _helper(tmp_path))
    guest.sendall(REQUEST)
    assert guest.recv(4096).startswith(b"HTTP/1.1 403 Forbidden")
    guest.close()
    assert proc.wait(timeout=30) == 0  # the helper, in the relay's place, served it


def test_unit_the_server_refuses_what_is_not_its_helper_and_the_relay_runs_it(
    relay: egress.Relay, tmp_path: Path
) -> None:
    egress.ensure_server(relay)
    _wait_server(relay)
    guest, proc = _connect(relay, ["/bin/sh", "-c", 'echo "fallback $SANDLOT_EGRESS_SOCKET"'])
    assert guest.recv(4096) == f"fallback {relay.socket}\n".encode()
    assert proc.wait(timeout=10) == 0
    # another interpreter's helper is refused too: it may be another sandlot
    guest, proc = _connect(relay, ["/usr/bin/env", "-m", "sandlot.net.proxy"])
    proc.wait(timeout=10)
    assert len(_server_pids(relay)) == 1  # and the server lives on


def test_unit_a_killed_server_costs_speed_not_connections(relay: egress.Relay, tmp_path: Path) -> None:
    egress.ensure_server(relay)
    _wait_server(relay)
    held, proc = _connect(relay, _helper(tmp_path))
    assert proc.wait(timeout=10) == 0
    for pid in _server_pids(relay):
        os.kill(pid, signal.SIGKILL)
    assert held.recv(4096) == b""  # what the dead server held is gone with it
    guest, proc = _connect(relay, _helper(tmp_path))  # the next one falls back
    guest.sendall(REQUEST)
    assert guest.recv(4096).startswith(b"HTTP/1.1 403 Forbidden")
    guest.close()
    assert proc.wait(timeout=30) == 0
    assert egress.ensure_server(relay)  # the next launch starts a server again
    _wait_server(relay)


def test_unit_malformed_messages_are_refused_and_the_server_goes_on(
    relay: egress.Relay, tmp_path: Path
) -> None:
    egress.ensure_server(relay)
    _wait_server(relay)
    bad = [(b"no terminator", 1), (b"", 1), (b"\xff\xfe\0", 1), (b"x\0-m\0sandlot.net.proxy\0", 0)]
    ours = f"{sys.executable}\0-m\0sandlot.net.proxy\0{tmp_path}/p\0{tmp_path}/l\0".encode()
    for payload, fds in bad:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(str(relay.socket))
        a, b = socket.socketpair()
        socket.send_fds(s, [payload], [b.fileno()] * fds)
        assert s.recv(1) in (b"-", b"")
        s.close()
        a.close()
        b.close()
    r, w = os.pipe()  # a helper of ours, but on a descriptor that is no connection
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(relay.socket))
    socket.send_fds(s, [ours], [r])
    assert s.recv(1) == b"-"
    for fd in (r, w):
        os.close(fd)
    s.close()
    guest, proc = _connect(relay, _helper(tmp_path))
    assert proc.wait(timeout=10) == 0  # served by the server, which goes on
    guest.sendall(REQUEST)
    assert guest.recv(4096).startswith(b"HTTP/1.1 403 Forbidden")


def test_unit_the_server_ends_when_idle_and_no_process_names_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(egress, "IDLE_EXIT", 0.3)
    monkeypatch.setattr(egress, "CHECK_EVERY", 0.1)
    path = tmp_path / "e.sock"
    holder = subprocess.Popen(["sh", "-c", "sleep 30", str(path)])  # stands for a QEMU naming the socket
    # once its execve has laid its command line out (else the server finds none naming it)
    wait_for("the holder's command line", lambda: str(path) in pids.cmdline(holder.pid), 10, every=0.01)
    server = egress.Server(path)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        assert t.is_alive() and path.exists()  # a process still names it
    finally:
        holder.kill()
        holder.wait()
    t.join(30)
    assert not t.is_alive() and not path.exists()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A TCP pair on the host's loopback, made as libslirp makes a guest connection's."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    return near, far


def test_unit_a_qemu_guest_connection_gets_its_fin_without_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """libslirp's end of a guest connection is on the host's loopback: the guest's TCP
    state is the VM's, so the FIN goes at once. The grace before it (a gVisor netstack's
    FIN let arrive first) is for connections from a box's own address."""
    waited: list[float] = []
    real_select = relay_mod.select.select

    def select(r: list[socket.socket], w: list[socket.socket], x: list[socket.socket], t: float) -> object:
        waited.append(t)
        return real_select(r, w, x, t)

    monkeypatch.setattr(relay_mod.select, "select", select)
    near, far = _tcp_pair()
    with near, far:
        relay_mod.end_guest_output(near)
        far.settimeout(5)
        assert far.recv(1) == b""  # the FIN
    assert waited == []
    # a peer elsewhere (a gVisor box's netstack) is given the grace before the FIN
    monkeypatch.setattr(relay_mod, "_from_slirp", lambda sock: False)
    near, far = _tcp_pair()
    with near, far:
        relay_mod.end_guest_output(near)
        assert far.recv(1) == b""
    assert waited == [relay_mod.FIN_GRACE]


def test_unit_a_socket_path_of_the_longest_length_listens(tmp_path: Path) -> None:
    """A unix socket's path has 107 bytes at most: one that fits is never refused for the
    length of the name it is bound under before it is renamed into place."""
    from sandlot.config import private_listener

    base = str(tmp_path) + "/"
    path = Path(base + "s" * (107 - len(base)))
    with private_listener(path, socket.SOCK_SEQPACKET, 1) as listener:
        assert len(str(path)) == 107 and path.exists()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(str(path))
        conn, _ = listener.accept()
        conn.close()
        client.close()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing else left there


def test_unit_a_gvisor_forwarder_hands_a_connection_to_the_server_with_no_process(
    relay: egress.Relay, tmp_path: Path
) -> None:
    """The forwarder of a gVisor box does the relay's work itself: no process is started
    for a connection the server takes; where none takes it, it says so (and the relay's
    command runs, which runs the helper)."""
    from sandlot.net import forwarder

    guest, theirs = socket.socketpair()
    assert not forwarder.hand_over(str(relay.socket), _helper(tmp_path), theirs)  # no server yet
    egress.ensure_server(relay)
    _wait_server(relay)
    assert forwarder.hand_over(str(relay.socket), _helper(tmp_path), theirs)
    theirs.close()  # the server holds its own copy
    guest.sendall(REQUEST)
    assert guest.recv(4096).startswith(b"HTTP/1.1 403 Forbidden")
    guest.close()
    assert not forwarder.hand_over(str(relay.socket), ["/bin/sh", "-c", "true"], socket.socket())  # not ours
