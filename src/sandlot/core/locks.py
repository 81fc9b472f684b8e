"""Who may change a box: one operation at a time, across threads, loops and processes.

A box's lifecycle lock is a ``flock`` on ``boxes/<id>/lock`` (processes, and
event loops of one process, since each takes its own open file) under an
``asyncio.Lock`` of the box's entry (tasks of one loop, first come first
served). Waiting never blocks the event loop or a worker thread: the file lock
is tried without blocking, between short sleeps, until a deadline.

Holding it is a precondition of every state transition; ``BoxLock.require``
checks it where a transition is written, so a code path that forgot the lock
fails loudly in tests instead of racing in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from ..config import flock_within

LOCK_TIMEOUT = 300.0


class BoxLock:
    """The lifecycle lock of one box, for the tasks of one event loop."""

    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self.name = name
        self._local = asyncio.Lock()
        self._fd: int | None = None
        self._owner: asyncio.Task[object] | None = None

    @property
    def held(self) -> bool:
        """Held by the task asking."""
        return self._fd is not None and self._owner is asyncio.current_task()

    def require(self) -> None:
        """The precondition of a state transition: this task holds the box's lock."""
        if not self.held:
            raise RuntimeError(f"box {self.name}: a state transition without its lock held")

    @contextlib.asynccontextmanager
    async def __call__(self, timeout: float = LOCK_TIMEOUT) -> AsyncIterator[None]:
        if self.held:  # re-entered by an operation that is part of another (stop inside remove)
            yield
            return
        async with self._local:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = await flock_within(self.path, timeout, f"box {self.name}")
            self._owner = asyncio.current_task()
            try:
                yield
            finally:
                fd, self._fd, self._owner = self._fd, None, None
                os.close(fd)
