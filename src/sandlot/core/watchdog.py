"""The idle watchdog: suspends a box with ``idle_timeout`` once nothing uses it.

One detached process per such box (a file lock keeps it to one), so a box goes
to sleep even after every process that used it has exited. It asks the agent
how many operations are in flight (from any process) and how long ago the last
request, start or wake came (``BoxController.activity``); the asking itself does not
count. Once the box has been idle for
``idle_timeout`` it is suspended, and the watchdog exits; whoever resumes the
box (explicitly, or by running a command in it) starts a new one. A suspend that
is called off (a request came) or fails is tried again once the box is idle again.
A resume that comes while a watchdog is ending finds its lock still taken and
starts none: so an ending watchdog lets go of its lock, then looks once more, and
watches on if the box runs again.

    python -m sandlot.core.watchdog HOME BOX_ID
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import try_flock
from ..errors import SandlotError
from .events import acting_as
from .idle import POLL_MAX, watchdog_lock

if TYPE_CHECKING:
    from .entry import BoxEntry
    from .service import Core

IDLE = "idle"  # who its events say acted
RETRY_MAX = 60.0  # seconds between tries of a suspend that keeps failing


async def watch(home: Path, box_id: str, lock_fd: int) -> None:
    """Watch the box while it runs; ``lock_fd`` holds the watchdog's lock, and is
    closed (the lock let go) when this returns."""
    from ..errors import BoxNotFound
    from .runtime import Runtime
    from .service import core_for
    from .state import BoxState

    core = core_for(Runtime.for_home(home))
    lock = watchdog_lock(home, box_id)
    try:
        entry = await core.controller.find(box_id)
        timeout = entry.spec.idle_timeout
        if not timeout:
            return
        poll = wait = min(POLL_MAX, max(0.2, timeout / 4))
        while True:
            await asyncio.sleep(wait)
            try:
                if (await core.controller.refresh(entry)).state != BoxState.RUNNING:
                    # stopped, suspended, removed: a later start or resume watches again,
                    # unless it came before the lock was let go
                    os.close(lock_fd)
                    lock_fd = -1  # let go: not closed again below, whatever comes
                    lock_fd = await _running_again(core, entry, lock)
                    if lock_fd < 0:
                        return
                    wait = poll
                    continue
                busy, idle = await core.controller.activity(entry)
            except BoxNotFound:
                return
            except SandlotError:
                # the store busy, or the agent slow to answer (a host under load, a save in
                # progress): asked again at the next poll, as giving up would leave the box
                # awake for good
                entry.session.drop()
                continue
            if busy == 0 and idle >= timeout:
                entry.session.drop()  # our own connection is not a user
                # Suspended, the next poll sees it and ends this watch. Called off (a request
                # came meanwhile) or failed, whatever the error (its event says why):
                # watched on, as giving up would leave the box awake for good; after a
                # failure, less and less often.
                try:
                    with acting_as(IDLE, f"idle for {idle:.0f}s"):
                        await core.live.suspend(entry, if_idle_for=timeout)
                    wait = poll
                except Exception:
                    wait = min(wait * 2, RETRY_MAX)
    except SandlotError:  # the box gone (found no more, or removed)
        return
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        await core.close()


async def _running_again(core: Core, entry: BoxEntry, lock: Path) -> int:
    """With the lock let go: the lock again (its fd) if the box runs again, as a
    resume meanwhile found it taken and started no watchdog; else -1."""
    from .state import BoxState

    try:
        if (await core.controller.refresh(entry)).state != BoxState.RUNNING:
            return -1
        fd = try_flock(lock)
    except (SandlotError, OSError):  # the store busy, the box removed: its next user watches
        return -1
    return -1 if fd is None else fd  # None: the resume's own watchdog has it


def main() -> None:
    home, box_id = Path(sys.argv[1]), sys.argv[2]
    try:
        fd = try_flock(watchdog_lock(home, box_id))
    except OSError:
        return  # the box's directory is gone
    if fd is None:
        return  # another watchdog has this box
    asyncio.run(watch(home, box_id, fd))


if __name__ == "__main__":
    main()
