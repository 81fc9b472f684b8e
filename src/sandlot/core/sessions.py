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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ..engine.base import VM
from ..errors import BoxBusy, ConnectionLost
from ..protocol.connection import AgentConnection
from .locks import POLL_MAX, POLL_MIN, try_flock

IDLE_RELEASE = 10.0


@dataclass(frozen=True, slots=True)
class Hello:
    """What the agent is told at every handshake (also after a restore or a fork)."""

    hostname: str
    machine_id: str | None
    pids_max: int | None
    request_timeout: float


LostHandler = Callable[["Session"], Awaitable[BaseException | None]]


class Session:
    """This process's connection to one box's agent."""

    def __init__(
        self, box_id: str, name: str, ports_dir: Path, agent_ports: int, on_lost: LostHandler
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
        self._arm_idle_release()
        return conn

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
            on_lost=lost,
        )
        return conn

    async def lease(self, deadline: float) -> None:
        """Take a free agent port, waiting in line while other processes hold them all."""
        if self._port_fd is not None:
            return
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        delay = POLL_MIN
        while True:
            for port in range(self.agent_ports):
                fd = try_flock(self.ports_dir / f"{port}.lock")
                if fd is not None:
                    self.port, self._port_fd = port, fd
                    return
            if time.monotonic() > deadline:
                raise BoxBusy(
                    f"box {self.name}: all {self.agent_ports} agent ports are held by other processes",
                    box=self.name,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    def release_port(self) -> None:
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
        idle = time.monotonic() - conn.last_used
        if conn.open_channels == 0 and idle >= IDLE_RELEASE and conn.failed is None:
            self.drop()  # the port goes back; the next operation connects again
        else:
            self._idle_timer = asyncio.get_running_loop().call_later(
                max(0.5, IDLE_RELEASE - idle), self._idle_check
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
        conn, self.conn, self.vm = self.conn, None, None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if conn is not None:
            conn.closing()
            await conn.close()
        self.release_port()
