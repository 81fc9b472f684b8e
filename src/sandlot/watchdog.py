"""The idle watchdog: suspends a box with ``idle_timeout`` once nothing uses it.

One detached process per such box (a file lock keeps it to one), so a box goes
to sleep even after every process that used it has exited. It asks the agent
how many operations are in flight (from any process) and how long ago the last
request came; the asking itself does not count. Once the box has been idle for
``idle_timeout`` it is suspended, and the watchdog exits; whoever resumes the
box (explicitly, or by running a command in it) starts a new one.

    python -m sandlot.watchdog HOME BOX_ID
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

POLL_MAX = 5.0


def spawn(home: Path, box_id: str) -> None:
    """Start the box's watchdog unless one runs (it checks the lock itself)."""
    lock = home / "boxes" / box_id / "watchdog.lock"
    if _locked(lock):
        return
    subprocess.Popen(
        [sys.executable, "-m", "sandlot.watchdog", str(home), box_id],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )  # fmt: skip


def _locked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


async def watch(home: Path, box_id: str) -> None:
    from .api.box import AsyncBox
    from .errors import SandlotError

    box = AsyncBox.get(box_id, home=home)
    timeout = box.spec.idle_timeout
    if not timeout:
        return
    poll = min(POLL_MAX, max(0.2, timeout / 4))
    while True:
        await asyncio.sleep(poll)
        try:
            if box.state != "running":
                return  # stopped, suspended, removed: a later start or resume watches again
            busy, idle = await box.activity()
        except SandlotError:
            return
        if busy == 0 and idle >= timeout:
            with contextlib.suppress(SandlotError):
                box._disconnect()  # our own connection is not a user
                await box.suspend()
            return


def main() -> None:
    home, box_id = Path(sys.argv[1]), sys.argv[2]
    lock = home / "boxes" / box_id / "watchdog.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another watchdog has this box
    asyncio.run(watch(home, box_id))


if __name__ == "__main__":
    main()
