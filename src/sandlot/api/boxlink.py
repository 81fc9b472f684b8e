"""The box link of a home: how one box reaches a port of another (``box:NAME:PORT``).

Started by a box's egress proxy when a connection needs it (``sandlot.net.boxlink``
says why it is a process of its own, and the request it answers), as
``python -m sandlot.api.boxlink HOME SOCKET``. One runs per home: a second one
finds the lock beside the socket taken and exits. For each request it checks
that the asking box's policy allows that port of that box, and that the two are
in one namespace (the ``sandlot.namespace`` label the server stamps, or none on
both), then opens the port through the box's agent, as ``box.connect`` does.
A box asleep is woken; a stopped one is not started (``failed``). It exits once
it has had no connection for ``IDLE_EXIT`` seconds; its agent sessions give
their ports back after their own idle time. It runs in a host cgroup of its own
(``hostcgroup.place_helper``), not in that of the box whose proxy started it: it
counts against no box's limits, and a box's stop does not take it along.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from ..config import private_listener, try_flock
from ..engine import hostcgroup
from ..errors import SandlotError
from ..net.policy import Policy
from .access import NAMESPACE_LABEL
from .box import AsyncBox
from .bridge import bridge, check_port, open_relay
from .local import local

IDLE_EXIT = 60.0
REQUEST_TIMEOUT = 30.0  # for a box asleep to wake and its port to answer
CONNECT_TIMEOUT = 10.0
MAX_REQUEST = 4096


class Refused(Exception):
    """The request is not one this link carries (``denied``)."""


class BoxLink:
    def __init__(self, home: Path, path: Path) -> None:
        self.home = home
        self.path = path
        self.active = 0  # connections asked for or carried

    async def serve(self) -> None:
        listener = private_listener(self.path, socket.SOCK_STREAM, 128)  # we hold the lock
        listener.setblocking(False)
        inode = self.path.stat().st_ino
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    async with asyncio.timeout(IDLE_EXIT):
                        conn, _ = await loop.sock_accept(listener)
                except TimeoutError:
                    if self.active == 0:
                        return
                    continue
                task = asyncio.ensure_future(self.handle(conn))
                _tasks.add(task)
                task.add_done_callback(_tasks.discard)
        finally:
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == inode:
                    self.path.unlink()
            listener.close()

    async def handle(self, conn: socket.socket) -> None:
        self.active += 1
        carried: asyncio.Task[None] | None = None
        try:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT):
                    source, name, port = await read_request(conn)
                    target = await self.target(source, name, port)
                    duplex = await open_relay(target.spawn, port, CONNECT_TIMEOUT)
            except Refused as exc:
                await answer(conn, f"denied {exc}")
                return
            except TimeoutError:
                await answer(conn, f"failed no answer within {REQUEST_TIMEOUT:.0f}s")
                return
            except (SandlotError, OSError) as exc:
                await answer(conn, f"failed {exc}")
                return
            await answer(conn, "ok")
            carried = bridge(conn, duplex)  # it closes conn when the connection ends
            await carried
        finally:
            if carried is None:
                conn.close()
            self.active -= 1

    async def target(self, source_id: str, name: str, port: int) -> AsyncBox:
        """Box ``name``, if box ``source_id`` may reach its ``port``."""
        try:
            source = await AsyncBox.get(source_id, home=self.home)
        except SandlotError:
            raise Refused(f"no box {source_id}") from None
        if source.id != source_id:
            raise Refused(f"no box {source_id}")
        options = local(source.ref).record.options
        policy = Policy.build(options.get("network"), options.get("allow") or None)
        if not policy.allows_box(name, port):
            raise Refused(f"port {port} of box {name} is not on the allowlist of box {source.name}")
        namespace = namespace_of(source.info)
        for box in await AsyncBox.list(home=self.home):
            if box.name == name and namespace_of(box.info) == namespace:
                return box
        raise Refused(f"no box named {name} in the namespace of box {source.name}")


_tasks: set[asyncio.Task[None]] = set()


def namespace_of(info: dict[str, Any]) -> str | None:
    labels = info.get("labels") or {}
    return labels.get(NAMESPACE_LABEL)


async def read_request(conn: socket.socket) -> tuple[str, str, int]:
    loop = asyncio.get_running_loop()
    line = b""
    while not line.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, MAX_REQUEST)
        if not chunk or len(line) + len(chunk) > MAX_REQUEST:
            raise Refused("malformed request")
        line += chunk
    try:
        req = json.loads(line)
        source, name, port = req["from"], req["box"], check_port(req["port"])
    except (ValueError, KeyError, TypeError, SandlotError):
        raise Refused("malformed request") from None
    if not isinstance(source, str) or not isinstance(name, str):
        raise Refused("malformed request")
    return source, name, port


async def answer(conn: socket.socket, text: str) -> None:
    line = " ".join(text.split()) + "\n"  # one line, whatever the reason held
    with contextlib.suppress(OSError):
        await asyncio.get_running_loop().sock_sendall(conn, line.encode(errors="replace"))


def main(argv: list[str]) -> int:
    """``HOME SOCKET``: serve until idle; exit at once if the home already has a link."""
    if len(argv) != 3:
        return 2
    home, path = Path(argv[1]), Path(argv[2])
    if try_flock(Path(f"{path}.lock")) is None:  # held until this process ends
        return 0  # another link serves this home
    # started by the egress proxy of the first box that needed it, so in that box's
    # cgroup: out of it, since it serves every box and outlives that one
    hostcgroup.place_helper(os.getpid(), "boxlink")
    asyncio.run(BoxLink(home, path).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
