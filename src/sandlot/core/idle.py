"""Starting a box's idle watchdog (``core/watchdog.py``): a detached process, so the
box goes to sleep even after every process that used it has exited."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .locks import try_flock

POLL_MAX = 5.0  # the watchdog asks the agent at least this often


def watchdog_lock(home: Path, box_id: str) -> Path:
    return home / "boxes" / box_id / "watchdog.lock"


def spawn(home: Path, box_id: str) -> None:
    """Start the box's watchdog unless one runs (the watchdog holds its lock)."""
    lock = watchdog_lock(home, box_id)
    fd = try_flock(lock) if lock.parent.is_dir() else None
    if fd is None:
        return
    os.close(fd)
    subprocess.Popen(
        [sys.executable, "-m", "sandlot.core.watchdog", str(home), box_id],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )  # fmt: skip
