"""The core as one event loop of one process sees it: the controller, the live
state component and the launcher, and through the controller one ``BoxEntry``
per box (``core.entry``), shared by every handle of the box.

State that asyncio objects hold (locks, connections, timers) belongs to one
event loop, so a process that runs several loops (the sync API's thread and an
``asyncio.run`` of its own) has one core per loop; across loops and processes
the file locks and the store keep order.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING

from .controller import BoxController
from .entry import BoxEntry
from .launch import Launcher
from .recovery import Recovery
from .runtime import Runtime
from .store import AsyncStore, SnapshotRecord

if TYPE_CHECKING:
    from .livestate import LiveState
    from .pools import Pools
    from .recorder import Recorder


class Core:
    """The controller, live state and launcher for one event loop, wired together.

    The components import downward only: the launcher knows none of them, the
    controller knows the launcher, live state knows both. The controller reaches
    live state (a suspended box resumes on start) through the ``SavedStates``
    interface it declares, set here. Live state and pools are built on first use: most
    commands (``sandlot ls``, ``sandlot exec``) never need it, and its modules
    (the archive format, zstandard) would be most of their start.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.launcher = Launcher(runtime)
        self.controller = BoxController(runtime, Recovery(runtime), self.launcher)
        self._live: LiveState | None = None
        self._pools: Pools | None = None
        self._recorder: Recorder | None = None
        self.controller.saved = LiveStateOnUse(self)

    @property
    def live(self) -> LiveState:
        if self._live is None:
            from .livestate import LiveState

            self._live = LiveState(self.rt, self.controller, self.launcher)
        return self._live

    @property
    def recorder(self) -> Recorder:
        """The flight recorder (built on first use, as live state is)."""
        if self._recorder is None:
            from .recorder import Recorder

            self._recorder = Recorder(self.controller, self.live)
        return self._recorder

    @property
    def pools(self) -> Pools:
        """Warm pools, made on first use (a claim, a fill, a drain)."""
        if self._pools is None:
            from .pools import Pools

            self._pools = Pools(self.rt, self.controller, self.launcher)
        return self._pools

    @property
    def db(self) -> AsyncStore:
        return self.rt.db

    @property
    def entries(self) -> dict[str, BoxEntry]:
        """The entry of every box this loop has seen (the controller keeps them)."""
        return self.controller.entries

    async def close(self) -> None:
        """End every agent session of this loop (their ports go back)."""
        for entry in list(self.entries.values()):
            with contextlib.suppress(Exception):
                await entry.session.close()


class LiveStateOnUse:
    """The controller's ``SavedStates``: the core's live state, built when first asked."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def resume(self, entry: BoxEntry) -> None:
        await self.core.live.resume(entry)

    async def drop_saved_state(self, snap_id: str) -> None:
        await self.core.live.drop_saved_state(snap_id)

    async def auto_template(self, entry: BoxEntry, image_digest: str) -> SnapshotRecord | None:
        return await self.core.live.auto_template(entry, image_digest)

    async def save_auto_template(self, entry: BoxEntry) -> None:
        await self.core.live.save_auto_template(entry)

    async def suspend(self, entry: BoxEntry, *, if_idle_for: float | None = None) -> None:
        await self.core.live.suspend(entry, if_idle_for=if_idle_for)


_cores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, Core]] = weakref.WeakKeyDictionary()


# per loop: an async generator whose closing ends the loop's cores (``_close_at_loop_end``)
_loop_ends: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncGenerator[None, None]] = (
    weakref.WeakKeyDictionary()
)


def core_for(runtime: Runtime) -> Core:
    """The core of ``runtime``'s home for the running event loop."""
    loop = asyncio.get_running_loop()
    per_loop = _cores.get(loop)
    if per_loop is None:
        per_loop = _cores[loop] = {}
        _close_at_loop_end(loop)
    core = per_loop.get(runtime.home)
    if core is None or core.rt is not runtime:
        core = per_loop[runtime.home] = Core(runtime)
    return core


async def settle_recorders() -> None:
    """Every checkpoint the flight recorders of this loop's cores have under way, taken:
    what a program does before its loop ends (``asyncio.run`` cancels the tasks left)."""
    for core in list((_cores.get(asyncio.get_running_loop()) or {}).values()):
        if core._recorder is not None:
            await core._recorder.settle_all()


def _close_at_loop_end(loop: asyncio.AbstractEventLoop) -> None:
    """End the loop's agent sessions when the loop ends, where that is known: a program's
    ``asyncio.run`` (or ``asyncio.Runner``) ends by closing its loop's async generators,
    and one of them is ours. Else a session would outlive its loop, holding one of its
    box's agent ports until the process exits: a process that runs a loop per task (a
    test per loop) would take all of a box's ports, and its sockets would be collected
    unclosed, from whatever thread the collector ran in."""

    async def at_loop_end() -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            ending = asyncio.get_running_loop()  # not held before: this would keep it alive
            _loop_ends.pop(ending, None)
            for core in (_cores.pop(ending, None) or {}).values():
                with contextlib.suppress(Exception):
                    await core.close()

    ender = _loop_ends[loop] = at_loop_end()  # held until the loop ends: the loop holds it weakly
    # Run to its ``yield`` here, in the loop's thread: its first step is when the loop's
    # hooks record it, for the loop's shutdown_asyncgens() to close.
    with contextlib.suppress(StopIteration):
        ender.asend(None).send(None)
