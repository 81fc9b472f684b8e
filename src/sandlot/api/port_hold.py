"""Asking the home's port keeper (``api/port_keeper.py``, which says what it does) to hold
the published ports of a box that wakes on traffic, or to let them go: one JSON line
over the keeper's Unix socket, in the private runtime directory, and its one-line
answer. The keeper is started here where none listens. The local backend calls this
when a box starts, resumes or is found, and when it is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import runtime_dir, spawn_unless_locked
from ..errors import BoxNotFound, InvalidState

if TYPE_CHECKING:
    from ..core.controller import BoxController
    from ..core.entry import BoxEntry

KEEPER = "sandlot.api.port_keeper"
START_WAIT = 60.0  # seconds a caller waits for a keeper it started to listen (a loaded host)
ASK_TIMEOUT = 60.0  # seconds a caller waits for the keeper's answer


def socket_path(home: Path) -> Path:
    """Where the home's keeper listens: a short path in the private runtime directory."""
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:16]
    return runtime_dir() / f"ports-{digest}.sock"


async def ensure(ctl: BoxController, entry: BoxEntry) -> None:
    """Make sure the home's keeper holds the box's published ports, if the box wakes on
    traffic; InvalidState naming the port if one cannot be bound."""
    if not (entry.spec.wake_on_traffic and entry.spec.ports) or entry.removed:
        return
    answer = await asyncio.to_thread(ask, ctl.rt.home, {"hold": entry.id}, start=True)
    if "error" in answer:
        kind = BoxNotFound if answer.get("code") == BoxNotFound.code else InvalidState
        raise kind(answer["error"], box=entry.name)
    await ctl.refresh(entry)  # the keeper recorded the ports


async def release(ctl: BoxController, entry: BoxEntry) -> None:
    """Have the keeper let a removed box's ports go now, where one runs."""
    if entry.spec.wake_on_traffic and entry.spec.ports:
        with contextlib.suppress(OSError, ValueError):
            await asyncio.to_thread(ask, ctl.rt.home, {"release": entry.id}, start=False)


def ask(home: Path, request: dict[str, str], *, start: bool) -> dict[str, Any]:
    """The keeper's answer to one request; with ``start``, starting a keeper where none
    listens (and waiting up to ``START_WAIT`` for it). Requests are idempotent: one that
    met a keeper as it ended is asked again of the next."""
    path = socket_path(home)
    deadline = time.monotonic() + START_WAIT
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(ASK_TIMEOUT)
                s.connect(str(path))
                s.sendall(json.dumps(request).encode() + b"\n")
                line = s.makefile("rb").readline()
            if line:
                answer: dict[str, Any] = json.loads(line)
                return answer
        except (FileNotFoundError, ConnectionError):
            pass
        if not start:
            raise ConnectionRefusedError(f"no port keeper runs for {home}")
        spawn_unless_locked(path.with_suffix(".lock"), KEEPER, str(home), cwd="/")
        if time.monotonic() > deadline:
            raise InvalidState(f"the port keeper of {home} did not start within {START_WAIT:g}s")
        time.sleep(0.02)
