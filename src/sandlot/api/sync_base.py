"""What the generated sync classes (``api/sync.py``) build on: each holds its async
twin in ``_a`` and runs its coroutines on sandlot's loop thread (``api/loop.py``).
The few members that differ from a plain delegation are written here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Generic, Self, TypeVar

from . import loop
from .box import AsyncBox, AsyncSnapshot
from .client import AsyncClient
from .desktop import AsyncDesktop
from .files import AsyncFiles, AsyncWatch
from .process import AsyncProcess, AsyncStream
from .volumes import AsyncVolumes

A = TypeVar("A")


class SyncTwin(Generic[A]):
    _a: A

    @classmethod
    def wrap(cls, inner: A) -> Self:
        """The sync face of an async object."""
        twin = cls.__new__(cls)
        twin._a = inner
        return twin

    @property
    def aio(self) -> A:
        """The async object behind this one, for use on sandlot's loop."""
        return self._a

    def __repr__(self) -> str:
        return repr(self._a)


class BoxBase(SyncTwin[AsyncBox]):
    @property
    def state(self) -> str:
        """created, running, paused, suspended, stopped or crashed, read anew on each
        access (locally from the store, elsewhere from the server or node; "new"
        before it was created, "removed" once it is gone)."""
        return loop.run(self._a.refresh())

    @property
    def running(self) -> bool:
        return self.state == "running"

    @contextlib.contextmanager
    def as_step(self, kind: str, **what: Any) -> Iterator[None]:
        """Everything done in the box inside the block is one step of its timeline, shown
        as ``kind`` with ``what`` (``AsyncBox.as_step``)."""
        group = self._a.as_step(kind, **what)
        loop.run(group.__aenter__())
        try:
            yield
        except BaseException as exc:
            if not loop.run(group.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            loop.run(group.__aexit__(None, None, None))


class SnapshotBase(SyncTwin[AsyncSnapshot]):
    pass


class FilesBase(SyncTwin[AsyncFiles]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Files come from their box: box.files")


class DesktopBase(SyncTwin[AsyncDesktop]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("A desktop comes from its box: box.desktop")


class WatchBase(SyncTwin[AsyncWatch]):
    """Leaving a ``for`` loop over a watch (``break``, an exception) closes it, as it
    closes a generator; so does the end of its ``with`` block."""


class ProcessBase(SyncTwin[AsyncProcess]):
    @property
    def argv(self) -> tuple[str, ...]:
        return self._a.argv

    @property
    def key(self) -> str | None:
        """The ``keep=`` it was started with."""
        return self._a.key

    def detach(self) -> None:
        """Stop following the process; it keeps running in the box, its output is dropped."""
        loop.call(self._a.detach)  # on the loop thread: it ends tasks and sockets the loop owns


class StreamBase(SyncTwin[AsyncStream]):
    pass


class ClientBase(SyncTwin[AsyncClient]):
    pass


class VolumesBase(SyncTwin[AsyncVolumes]):
    pass
