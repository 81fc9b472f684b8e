"""Run the agent on the host over a socketpair (its ``--fd`` mode), for fast
protocol tests and fuzzing without a VM. The agent is the same C code as in
the guest, built for the host (optionally with ASan/UBSan)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sandlot.api.files import AsyncWatch
from sandlot.api.fs import AgentWatch, WatchSource
from sandlot.config import default_home
from sandlot.guest.agent import build_agent
from sandlot.protocol.connection import AgentConnection
from sandlot.protocol.watch import WatchStream
from sandlot.records import Rate


@dataclass
class HostAgent:
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def spawn(tmp: Path, *, kind: str = "host", safe: bool = False, env: dict[str, str] | None = None,
          sndbuf: int | None = None, args: tuple[str, ...] = ()) -> HostAgent:  # fmt: skip
    """``env``: more of the agent's environment (``tests/support/faults.py``'s, say);
    ``sndbuf``: the agent's socket send buffer, small to have its frames go out in part;
    ``args``: more of its options (``--read-idle-ms N``)."""
    build = build_agent(default_home(), kind=kind)
    ours, theirs = socket.socketpair()
    if sndbuf is not None:
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    argv = [str(build.path), "--fd", str(theirs.fileno()), *(["--safe"] if safe else []), *args]
    err = tmp / f"agent-{os.getpid()}-{theirs.fileno()}.stderr"
    sanitizers = {"ASAN_OPTIONS": "abort_on_error=0:detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"}
    full = {**os.environ, **sanitizers, **(env or {})}
    with open(err, "wb") as f:
        proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stderr=f, env=full, cwd=tmp)
    theirs.close()
    return HostAgent(proc, ours, err)


@contextlib.asynccontextmanager
async def connected(
    tmp: Path, *, aslr: bool | None = None, **kw: object
) -> AsyncIterator[tuple[AgentConnection, HostAgent]]:
    """An agent on the host, handshaken. ``aslr``: the HELLO's (the agent, not pid 1 here,
    reports the host's setting and changes nothing); ``kw``: ``spawn``'s."""
    agent = spawn(tmp, **kw)  # type: ignore[arg-type]

    async def connector() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(sock=agent.sock, limit=1 << 22)

    conn = AgentConnection(connector, request_timeout=10, aslr=aslr)
    try:
        await conn.connect(5)
        yield conn, agent
    finally:
        await conn.close()
        agent.proc.kill()
        agent.proc.wait()


class Watcher:
    """``files.watch`` straight over an agent connection (no box, no backend)."""

    def __init__(self, conn: AgentConnection) -> None:
        self.conn = conn

    def watch(
        self, path: str | os.PathLike[str], *, recursive: bool = True, rate: Rate | None = None
    ) -> AsyncWatch:
        p = os.fspath(path)

        async def opener() -> WatchSource:
            return AgentWatch(
                self.conn, await WatchStream.start(self.conn, p, recursive=recursive, rate=rate)
            )

        return AsyncWatch(p, recursive, opener)
