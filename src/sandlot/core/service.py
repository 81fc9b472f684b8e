"""The core as one event loop of one process sees it: the controller, the live
state component, the launcher, the admission line and one ``BoxEntry`` per box.

Every handle of a box (``AsyncBox.get`` twice, a server's thousands of
requests) shares that box's entry: its last known record, its lifecycle lock,
its VM handle and its agent session. State that asyncio objects hold (locks,
connections, timers) belongs to one event loop, so a process that runs several
loops (the sync API's thread and an ``asyncio.run`` of its own) has one core per
loop; across loops and processes the file locks and the store keep order.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from pathlib import Path

from ..config import runtime_dir
from ..engine.base import VM
from .admission import Admission, default_slots
from .controller import BoxController
from .launch import Launcher
from .livestate import LiveState
from .locks import BoxLock
from .recovery import Recovery
from .runtime import AGENT_PORTS, Runtime
from .sessions import Session
from .spec import BoxSpec
from .state import BoxState
from .store import AsyncStore, BoxRecord


class BoxEntry:
    """One box, as this process (event loop) knows it."""

    def __init__(self, core: Core, rec: BoxRecord) -> None:
        self.id = rec.id
        self.name = rec.name
        self.record = rec
        self.spec = BoxSpec.from_options(rec.options)
        box_dir = core.rt.box_dir(rec.id)
        self.lock = BoxLock(box_dir / "lock", rec.name)
        self.vm: VM | None = None
        self.session = Session(rec.id, rec.name, box_dir / "ports", AGENT_PORTS, core.controller.agent_lost)
        self.seen: int | None = None  # the store's version when the record was last read
        self.boot_seconds: float | None = None  # how long the last start took
        self.last_pause: float | None = None  # seconds the last snapshot or suspend paused the VM
        self.removed = False

    def update(self, rec: BoxRecord) -> BoxRecord:
        self.record = rec
        self.spec = BoxSpec.from_options(rec.options)
        return rec

    @property
    def state(self) -> BoxState:
        return BoxState(self.record.state)

    @property
    def hostname(self) -> str:
        return self.spec.hostname or hostname_for(self.name)

    @property
    def dir(self) -> Path:
        return self.lock.path.parent


def hostname_for(name: str) -> str:
    h = "".join(c if c.isalnum() or c in ".-" else "-" for c in name).strip("-.")[:63]
    return h or "sandlot"


class Core:
    """The controller, live state, launcher and box entries for one event loop."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.recovery = Recovery(runtime)
        self.entries: dict[str, BoxEntry] = {}
        self._admission: dict[int, Admission] = {}
        self.controller = BoxController(self)
        self.live = LiveState(self)
        self.launcher = Launcher(self)

    @property
    def db(self) -> AsyncStore:
        return self.rt.db

    def entry(self, rec: BoxRecord) -> BoxEntry:
        """The entry of the box ``rec`` describes (made on first sight), brought up to date."""
        entry = self.entries.get(rec.id)
        if entry is None:
            entry = self.entries[rec.id] = BoxEntry(self, rec)
        else:
            entry.update(rec)
        return entry

    def forget(self, entry: BoxEntry) -> None:
        entry.removed = True
        entry.session.drop()
        self.entries.pop(entry.id, None)

    def admission(self, accel: str) -> Admission:
        slots = default_slots(accel)
        line = self._admission.get(slots)
        if line is None:
            line = self._admission[slots] = Admission(runtime_dir() / "admission", slots)
        return line

    async def close(self) -> None:
        """End every agent session of this loop (their ports go back)."""
        for entry in list(self.entries.values()):
            with contextlib.suppress(Exception):
                await entry.session.close()


_cores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, Core]] = weakref.WeakKeyDictionary()


def core_for(runtime: Runtime) -> Core:
    """The core of ``runtime``'s home for the running event loop."""
    loop = asyncio.get_running_loop()
    per_loop = _cores.get(loop)
    if per_loop is None:
        per_loop = _cores[loop] = {}
    core = per_loop.get(runtime.home)
    if core is None or core.rt is not runtime:
        core = per_loop[runtime.home] = Core(runtime)
    return core


async def close_all() -> None:
    """End the sessions of every core of the running loop (at the end of a program)."""
    for core in list((_cores.get(asyncio.get_running_loop()) or {}).values()):
        await core.close()
