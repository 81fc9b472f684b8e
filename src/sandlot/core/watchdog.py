"""The idle watchdog: suspends a box with ``idle_timeout`` once nothing uses it.

One detached process per such box (a file lock keeps it to one), so a box goes
to sleep even after every process that used it has exited. It asks the agent
how many operations are in flight (from any process) and how long ago the last
request came; the asking itself does not count. Once the box has been idle for
``idle_timeout`` it is suspended, and the watchdog exits; whoever resumes the
box (explicitly, or by running a command in it) starts a new one. A suspend that
is called off (a request came) or fails is tried again once the box is idle again.

    python -m sandlot.core.watchdog HOME BOX_ID
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
from pathlib import Path

from .events import acting_as
from .idle import POLL_MAX, watchdog_lock

IDLE = "idle"  # who its events say acted
RETRY_MAX = 60.0  # seconds between tries of a suspend that keeps failing


async def watch(home: Path, box_id: str) -> None:
    from ..errors import BoxNotFound, SandlotError
    from .runtime import Runtime
    from .service import core_for
    from .state import BoxState

    core = core_for(Runtime.for_home(home))
    try:
        entry = await core.controller.find(box_id)
    except SandlotError:
        return
    timeout = entry.spec.idle_timeout
    if not timeout:
        return
    poll = wait = min(POLL_MAX, max(0.2, timeout / 4))
    try:
        while True:
            await asyncio.sleep(wait)
            try:
                if (await core.controller.refresh(entry)).state != BoxState.RUNNING:
                    return  # stopped, suspended, removed: a later start or resume watches again
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
    finally:
        await core.close()


def main() -> None:
    home, box_id = Path(sys.argv[1]), sys.argv[2]
    lock = watchdog_lock(home, box_id)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another watchdog has this box
    asyncio.run(watch(home, box_id))


if __name__ == "__main__":
    main()
