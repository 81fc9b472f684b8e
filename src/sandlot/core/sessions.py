"""Agent sessions: one connection to a box's agent per process (and event loop),
shared by every handle of that box.

A box's VM has a fixed number of agent ports (``AGENT_PORTS``, 8): virtio-serial
ports are set when the VM starts and are part of its saved device state, so
saved states and forks fix the number too. Each port carries one connection,
and a connection multiplexes any number of operations (the protocol's
channels), so what the ports bound is the number of *processes* attached to a
box at once, not the number of handles or concurrent commands: a server holding
thousands of handles and many requests per box uses one port.

A port is leased with a ``flock`` on ``boxes/<id>/ports/<n>.lock``. When all are
taken by other processes, a new session waits in line for one (up to its
request deadline) instead of failing, and a session idle for
``IDLE_RELEASE`` seconds (no operation in flight) gives its port back; its next
operation connects again (a handshake, a few milliseconds).

A process may outlive its host: the agent keeps the channels of a session whose
host went away, until a host says the same session token again. A process that
``takes_over`` sessions (``sandlot serve``) writes ``ports/<n>.session`` beside
the lock: the token and the processes started with a ``keep`` key. When that
host dies, its lock goes with it and the file stays; the next process with the
same heir name (``sandlot serve`` on the same address) that leases a port takes
that port first, says the dead host's token, and follows the kept processes
again (``taken_over``); channels nobody kept are let go. A session file a live
host holds is never touched (its lock is taken), and other processes (another
server of the home, the library) lease such a port only when no other is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import FLOCK_POLL_MAX, FLOCK_POLL_MIN, atomic_write, try_flock
from ..engine.base import VM
from ..errors import BoxBusy, ConnectionLost
from ..protocol.connection import AgentConnection
from ..protocol.exec import RemoteProcess

IDLE_RELEASE = 10.0


@dataclass(frozen=True, slots=True)
class Hello:
    """What the agent is told at every handshake (also after a restore or a fork)."""

    hostname: str
    machine_id: str | None
    pids_max: int | None
    request_timeout: float
    aslr: bool | None = None  # kernel.randomize_va_space on (2) or off (0); None: left as it is


LostHandler = Callable[["Session"], Awaitable[BaseException | None]]


@dataclass(frozen=True, slots=True)
class Kept:
    """A process recorded in a session file, to be followed again by a later host."""

    key: str
    argv: tuple[str, ...]
    pid: int
    tty: bool

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "argv": list(self.argv), "pid": self.pid, "tty": self.tty}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Kept:
        argv, pid = d["argv"], d["pid"]
        if not isinstance(argv, list) or not isinstance(pid, int):
            raise TypeError("a kept process needs a list argv and an int pid")
        return cls(str(d["key"]), tuple(str(a) for a in argv), pid, bool(d["tty"]))


@dataclass(frozen=True, slots=True)
class Inheritance:
    """What a dead host left on a port: its session token and the processes it kept."""

    token: bytes
    heir: str  # which later host may take it over (``take_over_sessions``)
    kept: dict[int, Kept]  # by channel

    @classmethod
    def read(cls, path: Path) -> Inheritance | None:
        """The file's content; None if it is missing or unreadable (then nothing is taken over)."""
        try:
            d = json.loads(path.read_bytes())
            token = bytes.fromhex(d["token"])
            heir = str(d.get("heir", ""))
            kept = {int(ch): Kept.from_json(k) for ch, k in d["processes"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return cls(token, heir, kept) if len(token) == 16 else None


class Session:
    """This process's connection to one box's agent."""

    def __init__(
        self,
        box_id: str,
        name: str,
        ports_dir: Path,
        agent_ports: int,
        on_lost: LostHandler,
        takes_over: str | None = None,
    ) -> None:
        self.box_id = box_id
        self.name = name
        self.ports_dir = ports_dir
        self.agent_ports = agent_ports
        self._on_lost = on_lost
        self.conn: AgentConnection | None = None
        self.vm: VM | None = None  # the VM the connection goes to
        self.port: int | None = None
        self._port_fd: int | None = None
        self._connecting = asyncio.Lock()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._pending: AgentConnection | None = None  # the connection being made
        self.resumed = asyncio.Event()  # a suspended box came back (waiting reconnections go on)
        self.takes_over = takes_over  # the name of the heir this process is (None: none)
        self._inherited: Inheritance | None = None  # what the port's last host left, when leased
        self._kept: dict[int, Kept] = {}  # by channel: written to the session file
        self.taken_over: list[tuple[Kept, RemoteProcess]] = []  # for the API to claim

    @property
    def healthy(self) -> bool:
        return self.conn is not None and self.conn.failed is None

    async def connection(self, vm: VM, hello: Hello) -> AgentConnection:
        """The connection to ``vm``'s agent, made on first use."""
        conn = self.conn
        if conn is not None and conn.failed is None and self.vm is vm:
            await conn.wait_ready()
            return conn
        async with self._connecting:
            if self.conn is not None and self.conn.failed is None and self.vm is vm:
                return self.conn
            return await self._connect(vm, hello, time.monotonic() + hello.request_timeout, booting=False)

    async def attach_booting(self, vm: VM, hello: Hello, deadline: float) -> AgentConnection:
        """Connect to the agent of a VM that is coming up: retry until its socket
        exists and the agent answers, or until ``deadline``."""
        return await self._connect(vm, hello, deadline, booting=True)

    async def _connect(self, vm: VM, hello: Hello, deadline: float, *, booting: bool) -> AgentConnection:
        self.drop()
        await self.lease(deadline)
        try:
            while True:
                conn = self._pending = self._new_connection(vm, hello)
                try:
                    await conn.connect(max(0.1, deadline - time.monotonic()))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if not booting or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.01)  # its socket is not there yet
        except BaseException:
            self.release_port()
            raise
        finally:
            self._pending = None
        self.conn, self.vm = conn, vm
        if self.takes_over is not None:
            self._take_over(conn)
        self._arm_idle_release()
        return conn

    def _take_over(self, conn: AgentConnection) -> None:
        """Follow again the kept processes of the dead host whose token ``conn`` says;
        let go of its other channels."""
        inherited, self._inherited = self._inherited, None
        if inherited is not None and inherited.token == conn.token:
            for ch in sorted(conn.orphans):
                kept = inherited.kept.get(ch)
                if kept is None:
                    conn.let_go(ch)
                    continue
                self.taken_over.append((kept, RemoteProcess.adopt(conn, ch, kept.pid, kept.tty)))
                self._kept[ch] = kept
        self._write_session_file()

    @property
    def inheritance(self) -> Inheritance | None:
        """What the leased port's dead host left, until the connection takes it over."""
        return self._inherited

    def inheritance_left(self) -> bool:
        """A dead host whose heir this process is left a session file on a port of this
        box (its lock is free)."""
        for path in self.ports_dir.glob("*.session"):
            if not path.stem.isdigit() or not self._heir_of(int(path.stem)):
                continue
            fd = try_flock(path.with_suffix(".lock"))
            if fd is not None:
                os.close(fd)
                return True
        return False

    def keep(self, channel: int, kept: Kept) -> None:
        """Record a process in the session file, for a later host to follow."""
        if self.takes_over is None or self.conn is None:
            return
        self._kept[channel] = kept
        self._write_session_file()

    def _session_file(self) -> Path | None:
        return None if self.port is None else self.ports_dir / f"{self.port}.session"

    def _write_session_file(self) -> None:
        path, conn = self._session_file(), self.conn
        if path is None or conn is None:
            return
        self._kept = {ch: k for ch, k in self._kept.items() if conn.is_open(ch)}
        if not self._kept:
            self._remove_session_file()
            return
        kept = {str(ch): k.to_json() for ch, k in self._kept.items()}
        body = {"token": conn.token.hex(), "heir": self.takes_over or "", "processes": kept}
        atomic_write(path, json.dumps(body).encode(), mode=0o600)

    def _remove_session_file(self) -> None:
        self._kept.clear()
        path = self._session_file()
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _new_connection(self, vm: VM, hello: Hello) -> AgentConnection:
        assert self.port is not None
        port = self.port

        async def connector() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            target = self.vm or vm  # after a restore elsewhere, the session follows the new VM
            return await target.agent_connector(port)()

        async def lost() -> BaseException | None:
            if conn is self._pending:  # still handshaking: its caller reports why
                return ConnectionLost(f"box {self.name}: the agent's socket closed before it answered")
            if self.conn is not conn:  # replaced (a rollback) or dropped meanwhile: never reconnect
                return ConnectionLost(
                    f"box {self.name}: this connection was replaced (a rollback or a restart)"
                )
            reason = await self._on_lost(self)
            if self.conn is not conn and reason is None:
                # dropped while the handler waited (for a resume, say: an idle release came
                # first): the port went back and another process may hold it now. A VM's
                # port takes one host at a time, so this connection, followed to the new VM,
                # would keep the other's in QEMU's queue, unanswered until its HELLO timed out
                return ConnectionLost(f"box {self.name}: this connection was dropped while the VM was away")
            if reason is not None and self.conn is conn:  # the VM is gone: its port goes back
                self.conn, self.vm = None, None
                self.release_port()
            return reason

        conn = AgentConnection(
            connector,
            request_timeout=hello.request_timeout,
            hostname=hello.hostname,
            machine_id=hello.machine_id,
            pids_max=hello.pids_max,
            aslr=hello.aslr,
            on_lost=lost,
            token=self._inherited.token if self._inherited is not None else None,
        )
        return conn

    async def lease(self, deadline: float) -> None:
        """Take a free agent port, waiting in line while other processes hold them all.

        A port a dead host left a session file on comes first for the process that
        is that host's heir (the same ``takes_over`` name), and last for any other
        (its kept processes are then let go)."""
        if self._port_fd is not None:
            return
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        delay = FLOCK_POLL_MIN
        while True:
            names = set(os.listdir(self.ports_dir))  # one look, where a stat per port took eight
            left = {p for p in range(self.agent_ports) if f"{p}.session" in names}
            free = [p for p in range(self.agent_ports) if p not in left]
            ours = [p for p in sorted(left) if self._heir_of(p)]
            order = [*ours, *free, *(p for p in sorted(left) if p not in ours)]
            for port in order:
                fd = try_flock(self.ports_dir / f"{port}.lock")
                if fd is not None:
                    self.port, self._port_fd = port, fd
                    if port in left:
                        path = self.ports_dir / f"{port}.session"
                        found = Inheritance.read(path)
                        self._inherited = found if found and found.heir == self.takes_over else None
                        if self._inherited is None:
                            path.unlink(missing_ok=True)
                    return
            if time.monotonic() > deadline:
                raise BoxBusy(
                    f"box {self.name}: all {self.agent_ports} agent ports are held by other processes",
                    box=self.name,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, FLOCK_POLL_MAX)

    def _heir_of(self, port: int) -> bool:
        """Whether this process is the heir of the session file on ``port``."""
        if self.takes_over is None:
            return False
        found = Inheritance.read(self.ports_dir / f"{port}.session")
        return found is not None and found.heir == self.takes_over

    def release_port(self, *, keep_session: bool = False) -> None:
        """Give the port back. Its session file goes too, unless ``keep_session`` (this
        process is ending and its kept processes wait for a later host)."""
        self._inherited = None
        if keep_session and self._kept:
            self._kept.clear()
        else:
            self._remove_session_file()
        if self._port_fd is not None:
            os.close(self._port_fd)
            self._port_fd = None
            self.port = None

    def _arm_idle_release(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = asyncio.get_running_loop().call_later(IDLE_RELEASE, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        conn = self.conn
        if conn is None:
            return
        if conn.reconnecting:
            # a box that woke (resumed by this process's next caller, who waits for it) or
            # was rolled back: closed under its handshake, the reconnection would fail, and
            # its callers with it, as on a crash. Its idleness counts from its new socket.
            conn.last_used = time.monotonic()
        idle = time.monotonic() - conn.last_used
        if conn.open_channels == 0 and idle >= IDLE_RELEASE and conn.failed is None:
            self.drop()  # the port goes back; the next operation connects again
        else:
            self._idle_timer = asyncio.get_running_loop().call_later(
                max(IDLE_RELEASE / 4, IDLE_RELEASE - idle), self._idle_check
            )

    def drop(self) -> None:
        """End the connection on purpose (the VM is going, or being replaced) and free the port."""
        conn, self.conn, self.vm = self.conn, None, None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if conn is not None:
            conn.closing()  # its reader must not take the coming EOF for a crash
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().create_task(conn.close())
        self.release_port()

    async def close(self) -> None:
        """End the connection as this process ends: kept processes run on, for a later host."""
        conn, self.conn, self.vm = self.conn, None, None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if conn is not None:
            conn.closing()
            await conn.close()
        self.release_port(keep_session=True)
