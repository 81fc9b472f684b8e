"""Which agent port a session leases, and what a dead host's session file hands on
(``core/sessions.py``): files and flocks only, no VM."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from sandlot.config import try_flock
from sandlot.core.sessions import Hello, Inheritance, Kept, Session
from sandlot.errors import ConnectionLost
from sandlot.protocol.connection import AgentConnection

TOKEN = bytes(range(16))


async def _no_vm(_session: Session) -> None:
    return None


def _session(ports: Path, takes_over: str | None) -> Session:
    return Session("b1", "box", ports, 4, _no_vm, takes_over)  # type: ignore[arg-type]


def _leave(ports: Path, port: int, kept: dict[int, Kept], heir: str = "serve a:1") -> None:
    """What a host that died leaves: the session file, and its lock free."""
    ports.mkdir(parents=True, exist_ok=True)
    body = {"token": TOKEN.hex(), "heir": heir, "processes": {str(ch): k.to_json() for ch, k in kept.items()}}
    (ports / f"{port}.session").write_text(json.dumps(body))


def _lease(s: Session) -> int:
    asyncio.run(s.lease(time.monotonic() + 1))
    assert s.port is not None
    return s.port


def test_unit_an_heir_leases_the_port_a_dead_host_left_and_inherits_its_token(tmp_path: Path) -> None:
    kept = {3: Kept("p1", ("sh", "-c", "x"), 42, False)}
    _leave(tmp_path, 2, kept)
    heir = _session(tmp_path, takes_over="serve a:1")
    assert heir.inheritance_left()
    assert _lease(heir) == 2
    inherited = heir.inheritance
    assert inherited is not None and inherited.token == TOKEN and inherited.kept == kept
    heir.release_port()
    assert not (tmp_path / "2.session").exists()  # given back on purpose: nothing to hand on


def test_unit_other_processes_lease_a_left_port_last_and_end_its_inheritance(tmp_path: Path) -> None:
    _leave(tmp_path, 0, {1: Kept("p1", ("true",), 7, True)})
    plain = _session(tmp_path, takes_over=None)
    assert _lease(plain) == 1  # not the left one while another is free
    held = [try_flock(tmp_path / f"{p}.lock") for p in (2, 3)]  # other processes hold the rest
    try:
        second = _session(tmp_path, takes_over=None)
        assert _lease(second) == 0 and second.inheritance is None
        assert not (tmp_path / "0.session").exists()  # its processes were let go
    finally:
        for fd in held:
            assert fd is not None
            os.close(fd)


def test_unit_only_the_dead_hosts_heir_inherits_its_session(tmp_path: Path) -> None:
    """Two servers of one home: the one on another address leases the port a dead
    server left last and lets its processes go; the dead one's heir inherits them."""
    _leave(tmp_path, 0, {1: Kept("p1", ("true",), 7, False)}, heir="serve a:1")
    other = _session(tmp_path, takes_over="serve b:2")
    assert not other.inheritance_left()
    assert _lease(other) == 1 and other.inheritance is None
    assert (tmp_path / "0.session").exists()  # still waiting for its heir
    heir = _session(tmp_path, takes_over="serve a:1")
    assert heir.inheritance_left() and _lease(heir) == 0
    assert heir.inheritance is not None and heir.inheritance.heir == "serve a:1"


def test_unit_a_session_file_a_live_host_holds_is_not_inherited(tmp_path: Path) -> None:
    _leave(tmp_path, 1, {})
    fd = try_flock(tmp_path / "1.lock")  # its host lives
    try:
        heir = _session(tmp_path, takes_over="serve a:1")
        assert not heir.inheritance_left()
        assert _lease(heir) != 1 and heir.inheritance is None
        assert (tmp_path / "1.session").exists()
    finally:
        assert fd is not None
        os.close(fd)


def test_unit_a_damaged_session_file_hands_nothing_on(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    for body in (b"", b"{", b'{"token": "zz", "processes": {}}', b'{"token": "00", "processes": {}}',
                 b'{"token": "%s", "processes": {"1": {"key": "k", "argv": "sh", "pid": 1, "tty": 0}}}'
                 % TOKEN.hex().encode()):  # fmt: skip
        (tmp_path / "0.session").write_bytes(body)
        assert Inheritance.read(tmp_path / "0.session") is None, body
    heir = _session(tmp_path, takes_over="serve a:1")
    assert not heir.inheritance_left()
    held = [try_flock(tmp_path / f"{p}.lock") for p in (1, 2, 3)]  # the other ports are held
    try:
        assert _lease(heir) == 0 and heir.inheritance is None
        assert not (tmp_path / "0.session").exists()
    finally:
        for fd in held:
            assert fd is not None
            os.close(fd)


class _VM:
    """A VM whose agent socket is counted, never reached."""

    running = True

    def __init__(self) -> None:
        self.connects: list[int] = []

    def agent_connector(self, port: int) -> Any:
        async def connect() -> Any:
            self.connects.append(port)
            raise ConnectionRefusedError("no agent here")

        return connect


def test_unit_a_connection_dropped_while_its_vm_was_away_never_follows_the_next_vm(tmp_path: Path) -> None:
    """Its port went back when it was dropped (an idle release while it waited for the box
    to be resumed), and another process may hold it: QEMU serves one host per port, so a
    connection that followed the resumed VM there would keep the other's unanswered."""

    async def main() -> None:
        resumed = asyncio.Event()

        async def wait_for_resume(_session: Session) -> None:
            await resumed.wait()  # the box runs again: reconnect, says the handler

        s = Session("b1", "box", tmp_path, 4, wait_for_resume)  # type: ignore[arg-type]
        await s.lease(time.monotonic() + 1)
        vm = _VM()
        conn = s._new_connection(vm, Hello("box", None, None, 5.0))  # type: ignore[arg-type]
        s.conn, s.vm = conn, vm  # type: ignore[assignment]
        lost = asyncio.ensure_future(conn._lost())  # its socket closed: the VM was suspended
        await asyncio.sleep(0.01)
        s.drop()  # idle meanwhile: the connection ends and port 0 goes back
        other = try_flock(tmp_path / "0.lock")
        assert other is not None  # another process leases it
        resumed.set()
        await asyncio.wait_for(lost, 5)
        os.close(other)
        assert vm.connects == []
        assert isinstance(conn.failed, ConnectionLost)

    asyncio.run(main())


def test_unit_a_connection_closed_while_it_reconnects_leaves_no_socket_open(tmp_path: Path) -> None:
    """The socket its connector made once it was closed is closed at once, not handshaken."""
    import socket

    async def main() -> None:
        ours, theirs = socket.socketpair()
        connected = asyncio.Event()
        go_on = asyncio.Event()

        async def connector() -> Any:
            connected.set()
            await go_on.wait()
            return await asyncio.open_connection(sock=ours)

        conn = AgentConnection(connector)
        reconnecting = asyncio.ensure_future(conn.reconnect(timeout=5))
        await connected.wait()
        await conn.close()
        go_on.set()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(reconnecting, 5)
        theirs.setblocking(False)
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.sock_recv(theirs, 64), 5) == b""  # closed: no HELLO sent
        theirs.close()

    asyncio.run(main())


def test_unit_a_reconnection_whose_connection_is_closed_ends_then_not_at_its_hello_timeout() -> None:
    """Whoever waits for the reconnection (a resume that follows it) hears at once that
    it will not come, and connects anew, rather than after the HELLO's 60 s."""
    import socket

    async def main() -> None:
        ours, theirs = socket.socketpair()

        async def connector() -> Any:
            return await asyncio.open_connection(sock=ours)

        async def the_vm_lives() -> None:
            return None

        conn = AgentConnection(connector, on_lost=the_vm_lives)
        lost = asyncio.ensure_future(conn._lost())  # its socket closed: it follows the VM
        theirs.setblocking(False)
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.sock_recv(theirs, 4096), 5)  # a HELLO, never answered
        await conn.close()
        await asyncio.wait_for(lost, 5)
        assert isinstance(conn.failed, ConnectionLost)
        theirs.close()

    asyncio.run(main())
