"""Which agent port a session leases, and what a dead host's session file hands on
(``core/sessions.py``): files and flocks only, no VM."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from sandlot.config import try_flock
from sandlot.core.sessions import Inheritance, Kept, Session

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
