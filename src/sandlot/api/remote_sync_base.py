"""What the generated remote sync classes (``api/remote_sync.py``) build on: each
holds its async original (``api/remote.py``) in ``_a`` and runs its coroutines on
sandlot's loop thread (``api/loop.py``). The few members that differ from a plain
delegation are written here."""

from __future__ import annotations

from typing import Any

from . import loop
from .remote import AsyncClient, RemoteAsyncBox, RemoteAsyncFiles, RemoteAsyncSnapshot
from .sync_base import SyncTwin


class ClientBase(SyncTwin[AsyncClient]):
    pass


class RemoteBoxBase(SyncTwin[RemoteAsyncBox]):
    _a: RemoteAsyncBox

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a RemoteBox comes from its Client: client.Box(image), client.get(key)...")

    @property
    def state(self) -> str:
        """created, running, paused, suspended, stopped or crashed, asked of the server
        on each access ("new" before it was created, "removed" once it is gone)."""
        return loop.run(self._a.refresh())

    @property
    def running(self) -> bool:
        return self.state == "running"


class RemoteFilesBase(SyncTwin[RemoteAsyncFiles]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("RemoteFiles come from their box: box.files")


class RemoteSnapshotBase(SyncTwin[RemoteAsyncSnapshot]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a RemoteSnapshot comes from its box or Client: box.snapshot(), client.snapshots()")
