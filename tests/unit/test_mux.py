"""The egress port's host side (``net/mux.py``): a session's frames over a socketpair
that stands for QEMU's chardev, with a guest written here from the protocol; and the
real egress server serving a process that presents itself as a QEMU (its command
line names the helpers) with the real proxy. The guest's side (``egress.c``) runs in
the VM tests (every proxied request of a QEMU box goes through it)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandlot.engine.base import NetSpec
from sandlot.engine.qemu.command import VMConfig, build_command, device_set_of
from sandlot.net import egress, mux
from sandlot.net.addresses import FALLBACK_ADDRESS, PROXY_ADDRESS
from sandlot.net.policy import Policy, write_policy


class Guest:
    """The guest's end of a session, frame by frame."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)
        self.buf = b""
        self.at = 0

    def send(self, sid: int, kind: int, payload: bytes = b"", flags: int = 0) -> None:
        self.sock.sendall(mux.frame(sid, kind, payload, flags))

    def recv(self) -> tuple[int, int, int, bytes]:
        while True:
            at, left = self.at, len(self.buf) - self.at
            if left >= mux.HEADER.size:
                sid, kind, flags, n = mux.HEADER.unpack_from(self.buf, at)
                if left >= mux.HEADER.size + n:
                    payload = bytes(self.buf[at + mux.HEADER.size : at + mux.HEADER.size + n])
                    self.at = at + mux.HEADER.size + n
                    return sid, kind, flags, payload
            data = self.sock.recv(65536)
            if not data:
                raise EOFError
            self.buf = self.buf[self.at :] + data
            self.at = 0

    def recv_kind(self, kind: int) -> tuple[int, int, int, bytes]:
        """The next frame of ``kind``, skipping WINDOW frames."""
        while True:
            f = self.recv()
            if f[1] != mux.WINDOW or kind == mux.WINDOW:
                assert f[1] == kind, f
                return f

    def hello(self) -> bytes:
        """The host's HELLO's payload, after its preamble of zeros (frames of nothing)."""
        skipped = 0
        while True:
            sid, kind, _, payload = self.recv()
            if kind == mux.HELLO:
                assert sid == 0 and payload.startswith(mux.MAGIC)
                assert skipped == len(mux.PREAMBLE)
                return payload
            assert (sid, kind, payload) == (0, 0, b"")
            skipped += mux.HEADER.size

    def greet(self) -> list[int]:
        payload = self.hello()
        ports = [struct.unpack(">H", payload[i : i + 2])[0] for i in range(len(mux.MAGIC), len(payload), 2)]
        self.send(0, mux.HELLO, mux.MAGIC)
        return ports

    def closed(self) -> bool:
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            pass
        return True


def echo(sock: socket.socket) -> None:
    with sock:
        while data := sock.recv(65536):
            sock.sendall(data)


@pytest.fixture
def session() -> Iterator[Callable[..., tuple[Guest, list[socket.socket]]]]:
    threads: list[threading.Thread] = []

    def start(ports: tuple[int, ...] = (3128, 53), handler: Callable[[socket.socket], None] | None = echo,
              refuse: bool = False) -> tuple[Guest, list[socket.socket]]:  # fmt: skip
        host, guest = socket.socketpair()
        served: list[socket.socket] = []

        def serve(sock: socket.socket, port: int) -> bool:
            if refuse:
                return False
            served.append(sock)
            if handler is not None:
                threading.Thread(target=handler, args=(sock,), daemon=True).start()
            return True

        t = threading.Thread(target=mux.Session(host, list(ports), serve).run, daemon=True)
        t.start()
        threads.append(t)
        return Guest(guest), served

    yield start
    for t in threads:
        t.join(timeout=10)


def test_unit_a_stream_carries_bytes_both_ways_and_ends_with_both_eofs(session) -> None:  # type: ignore[no-untyped-def]
    g, served = session()
    assert g.greet() == [3128, 53]
    g.send(1, mux.OPEN, struct.pack(">H", 3128))
    assert g.recv_kind(mux.OPENED)[0] == 1
    g.send(1, mux.DATA, b"ping")
    assert g.recv_kind(mux.DATA)[3] == b"ping"
    g.send(1, mux.EOF)
    assert g.recv_kind(mux.EOF)[0] == 1  # the echo ended when its input did
    # both directions ended: the stream is gone, and a frame for it is ignored
    g.send(1, mux.DATA, b"late")
    g.send(2, mux.OPEN, struct.pack(">H", 53))
    assert g.recv_kind(mux.OPENED)[0] == 2
    assert len(served) == 2
    g.sock.close()


def test_unit_the_guest_hello_is_found_after_bytes_from_before(session) -> None:  # type: ignore[no-untyped-def]
    g, _ = session()
    g.hello()
    g.sock.sendall(b"\x00\x07stale half frame" + mux.MAGIC[:3])  # what a VM wrote to a host that went away
    g.send(0, mux.HELLO, mux.MAGIC)
    g.send(1, mux.OPEN, struct.pack(">H", 3128))
    assert g.recv_kind(mux.OPENED)[0] == 1
    g.sock.close()


def test_unit_a_port_not_served_or_a_full_server_is_refused(session) -> None:  # type: ignore[no-untyped-def]
    g, _ = session()
    g.greet()
    g.send(1, mux.OPEN, struct.pack(">H", 8080))
    assert g.recv_kind(mux.CLOSE)[:3] == (1, mux.CLOSE, mux.REFUSED)
    g.sock.close()
    g, served = session(refuse=True)
    g.greet()
    g.send(1, mux.OPEN, struct.pack(">H", 3128))
    assert g.recv_kind(mux.CLOSE)[:3] == (1, mux.CLOSE, mux.REFUSED)
    assert served == []
    g.sock.close()


def test_unit_no_more_than_the_window_is_sent_until_the_guest_gives_it_back(session) -> None:  # type: ignore[no-untyped-def]
    big = os.urandom(3 * mux.STREAM_WINDOW)

    def flood(sock: socket.socket) -> None:
        with sock:
            sock.sendall(big)

    g, _ = session(handler=flood)
    g.greet()
    g.send(1, mux.OPEN, struct.pack(">H", 3128))
    g.recv_kind(mux.OPENED)
    got = b""
    while len(got) < mux.STREAM_WINDOW:
        got += g.recv_kind(mux.DATA)[3]
    assert len(got) == mux.STREAM_WINDOW
    g.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):  # nothing more until a WINDOW
        g.recv()
    g.sock.settimeout(10)
    while True:
        g.send(1, mux.WINDOW, struct.pack(">I", mux.STREAM_WINDOW))
        _, kind, _, payload = g.recv()
        while kind == mux.DATA:
            got += payload
            if len(got) % mux.STREAM_WINDOW == 0:
                break
            _, kind, _, payload = g.recv()
        if kind == mux.EOF or len(got) == len(big):
            break
    assert got == big
    g.sock.close()


def test_unit_a_guest_that_sends_past_its_window_ends_the_session(session) -> None:  # type: ignore[no-untyped-def]
    g, served = session(handler=None)  # nobody reads: the guest's bytes wait here
    g.greet()
    g.send(1, mux.OPEN, struct.pack(">H", 3128))
    g.recv_kind(mux.OPENED)
    # what a broken guest does: it sends on, whatever window it was given (the helper's
    # socket takes some, after which no more is given back)
    with pytest.raises(OSError):
        for _ in range(1000):
            g.send(1, mux.DATA, b"x" * 60000)
    assert served and g.closed()


def test_unit_a_guest_that_reads_none_of_the_answers_it_asks_for_is_let_go(  # type: ignore[no-untyped-def]
    session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mux, "OUT_LIMIT", 64 * 1024)
    g, _ = session()
    g.greet()
    not_served = struct.pack(">H", 8080)
    with pytest.raises(OSError):  # each OPEN is answered (refused), none read: past the limit, the end
        for n in range(500):
            g.sock.sendall(b"".join(mux.frame(n * 1000 + k, mux.OPEN, not_served) for k in range(1, 1001)))


@pytest.mark.parametrize(
    "frames",
    [
        [(5, mux.DATA, b"x")],  # a stream never opened
        [(1, mux.OPEN, b"\x0c")],  # a port of one byte
        [(1, mux.OPEN, struct.pack(">H", 3128)), (1, mux.OPEN, struct.pack(">H", 3128))],  # an id again
        [(0, mux.HELLO, mux.MAGIC)],  # a second HELLO
        [(1, 99, b"")],  # no such frame
    ],
)
def test_unit_a_frame_that_breaks_the_protocol_ends_the_session(session, frames) -> None:  # type: ignore[no-untyped-def]
    g, _ = session()
    g.greet()
    for sid, kind, payload in frames:
        g.send(sid, kind, payload)
    assert g.closed()


def test_unit_a_guest_that_never_says_hello_is_let_go(session, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mux, "HELLO_TIMEOUT", 0.3)
    g, _ = session()
    g.hello()
    g.sock.sendall(b"garbage without a hello")
    assert g.closed()


# -- who the peer is -----------------------------------------------------------------------


def _vm_command(tmp_path: Path, relay: list[str], helpers: dict[int, list[str]], mux_path: Path) -> list[str]:
    import shlex

    cmd = {port: shlex.join([*relay, "--", *argv]) for port, argv in helpers.items()}
    net = NetSpec(proxy_command=cmd[3128], dns_command=cmd[53], transparent_ports=(443,),
                  guest_forwards=(("10.0.2.101", 5432, cmd[3128] + " --box db 5432"),),
                  egress_mux=str(mux_path))  # fmt: skip
    cfg = VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=tmp_path,
                   state_dir=tmp_path, network=net)  # fmt: skip
    return build_command(cfg, "qemu-system-x86_64")


def test_unit_the_helpers_are_read_from_a_vm_command_line_at_the_proxy_address_only(tmp_path: Path) -> None:
    helper = [sys.executable, "-m", "sandlot.net.proxy", str(tmp_path / "pol,icy.json"), "log"]
    dns = [sys.executable, "-m", "sandlot.net.dns", "p", "log"]
    argv = _vm_command(tmp_path, ["/relay", "/sock"], {3128: helper, 53: dns}, tmp_path / "e.mux")
    joined = " ".join(argv)
    assert f"guestfwd=tcp:{FALLBACK_ADDRESS}:3128-cmd:" in joined  # the slow way stays
    assert f"path={tmp_path / 'e.mux'},reconnect=1" in joined and "name=sandlot-egress" in joined
    assert "sandlot.egress=1" in joined
    found = mux.helpers_of(argv)
    assert found == {3128: helper, 443: [*helper, "--transparent", "443"], 53: dns}
    assert mux.netdev_options("user,a=1,,2,b") == ["user", "a=1,2", "b"]


def test_unit_a_vm_without_a_server_has_a_port_whose_host_never_opens(tmp_path: Path) -> None:
    net = NetSpec(proxy_command="/bin/true")
    for devices, port in (("4", False), ("5", True)):
        cfg = VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=tmp_path,
                       state_dir=tmp_path, network=net, devices=devices)  # fmt: skip
        argv = build_command(cfg, "qemu")
        assert device_set_of(argv) == devices  # what an attaching process reads back
        joined = " ".join(argv)
        assert ("null,id=egress" in joined) is port and ("sandlot.egress=1" in joined) is port
        assert (f"{FALLBACK_ADDRESS}:3128" in joined) is port
        assert f"guestfwd=tcp:{PROXY_ADDRESS}:3128" in joined  # a state saved before the port has it


# -- the real server ------------------------------------------------------------------------


def test_unit_the_egress_server_serves_a_vms_port_with_the_helpers_its_command_line_names(
    tmp_path: Path,
) -> None:
    """A process presenting itself as a QEMU (its argv is a VM's, naming the helpers)
    connects to the real server; a guest stream to 3128 is served by the real proxy
    with the policy that command line names. A peer whose command line does not name
    the socket gets nothing."""
    relay = egress.relay_for(tmp_path / "home", tmp_path)
    assert relay is not None
    policy = tmp_path / "policy.json"
    write_policy(policy, Policy(mode="allowlist"))  # nothing allowed: the proxy answers 403
    helper = [sys.executable, "-m", "sandlot.net.proxy", str(policy), str(tmp_path / "egress.log")]
    dns = [sys.executable, "-m", "sandlot.net.dns", str(policy), str(tmp_path / "egress.log")]
    vm_argv = _vm_command(
        tmp_path, [str(relay.binary), str(relay.socket)], {3128: helper, 53: dns}, relay.mux
    )
    egress.ensure_server(relay)
    deadline = time.monotonic() + 30
    while not relay.mux.exists():
        assert time.monotonic() < deadline, "the egress server did not start"
        time.sleep(0.02)
    try:
        # a stranger (this test process names no socket on its command line): let go at once
        stranger = socket.socket(socket.AF_UNIX)
        stranger.connect(str(relay.mux))
        stranger.settimeout(10)
        assert stranger.recv(100) == b""
        # the VM: a pair of processes, as QEMU holds the connection; the guest here
        host_end, guest_end = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-c", _PASS_THROUGH, str(relay.mux), *vm_argv[1:]],
            stdin=host_end, stdout=host_end, close_fds=True,
        )  # fmt: skip
        host_end.close()
        g = Guest(guest_end)
        assert g.greet() == [53, 443, 3128]
        g.send(1, mux.OPEN, struct.pack(">H", 3128))
        g.recv_kind(mux.OPENED)
        g.send(1, mux.DATA, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n")
        answer = g.recv_kind(mux.DATA)[3]
        assert answer.startswith(b"HTTP/1.1 403"), answer
        g.send(1, mux.EOF)
        g.recv_kind(mux.EOF)
        guest_end.close()
        proc.wait(timeout=10)
    finally:
        subprocess.run(["pkill", "-9", "-f", f"{egress.MODULE} {relay.socket}"])


# The "QEMU": connects to the server (argv[1]) and copies bytes between it and its
# standard input/output (the guest's end of a socketpair); its argv is the VM's.
_PASS_THROUGH = r"""
import os, select, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
ends = {s.fileno(): 1, 0: s.fileno()}
while True:
    r, _, _ = select.select([s, 0], [], [])
    if s in r:
        data = s.recv(65536)
        if not data:
            break
        os.write(1, data)
    if 0 in r:
        data = os.read(0, 65536)
        if not data:
            break
        s.sendall(data)
"""
