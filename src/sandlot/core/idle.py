"""Starting a box's idle watchdog (``core/watchdog.py``): a detached process, so the
box goes to sleep even after every process that used it has exited."""

from __future__ import annotations

from pathlib import Path

from ..config import spawn_unless_locked

POLL_MAX = 5.0  # the watchdog asks the agent at least this often


def watchdog_lock(home: Path, box_id: str) -> Path:
    return home / "boxes" / box_id / "watchdog.lock"


def spawn(home: Path, box_id: str) -> None:
    """Start the box's watchdog unless one runs (the watchdog holds its lock)."""
    lock = watchdog_lock(home, box_id)
    if lock.parent.is_dir():  # a box removed meanwhile needs none
        spawn_unless_locked(lock, "sandlot.core.watchdog", str(home), box_id)
