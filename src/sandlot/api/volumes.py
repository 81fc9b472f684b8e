"""Named volumes: filesystems that outlive boxes, mounted by name (``core/volumes.py``
says how they are made and what live state does to them).

>>> import sandlot
>>> sandlot.volume.create("data", size_gb=5)                          # doctest: +SKIP
>>> with sandlot.Box("python:3.12-slim", volumes={"data": "/data"}) as box:  # doctest: +SKIP
...     box.sh("echo kept > /data/note")
>>> with sandlot.Box("python:3.12-slim", volumes=["data:/data:ro"]) as box:  # doctest: +SKIP
...     box.sh("cat /data/note").stdout
'kept\\n'

A mount's mode says what live state does to the volume: ``copy`` (the default) makes
it part of the box's snapshots (a fork's children get copy-on-write copies, a rollback
restores it) and the box writes it back when it is removed; ``ro`` mounts it
read-only, in any number of boxes at once. A volume made with ``shared=True`` is one
live directory that every box mounting it (``shared``, its default, or ``ro``) reads
and writes at once, and never part of a snapshot: a fork keeps the mount.

>>> sandlot.volume.create("scratch", shared=True)                    # doctest: +SKIP
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.volumes import check_labels, check_name, check_size
from ..errors import InvalidArgument, ProtocolError
from .backend import Backend


@dataclass(frozen=True, slots=True)
class Volume:
    """A named volume as it is now: its kind (``disk``, or ``shared``: a directory boxes
    share live), size (0 for a shared one), labels, the boxes that mount it (each
    ``{"name", "id", "mode", "state"}``), the box that will write it back (``holder``:
    the box that mounted it by name in ``copy`` mode) and the bytes it takes on the host."""

    id: str
    name: str
    size_gb: float
    created_at: float
    labels: dict[str, str] = field(default_factory=dict)
    holder: str | None = None
    boxes: list[dict[str, str]] = field(default_factory=list)
    host_bytes: int = 0
    kind: str = "disk"

    @classmethod
    def from_json(cls, data: Any) -> Volume:
        if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
            raise ProtocolError(f"a volume's description is malformed: {data!r}")
        try:
            return cls(
                id=str(data["id"]), name=data["name"], size_gb=float(data["size_gb"]),
                created_at=float(data["created_at"]), labels=dict(data.get("labels") or {}),
                holder=data.get("holder"), boxes=list(data.get("boxes") or []),
                host_bytes=int(data.get("host_bytes") or 0), kind=str(data.get("kind") or "disk"),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a volume's description is malformed ({exc}): {data!r}") from None


class AsyncVolumes:
    """The named volumes of a home (``sandlot.volume_async``; ``home``: default
    ``$SANDLOT_HOME``) or of the far side of a backend (``client.volume``)."""

    def __init__(self, home: str | os.PathLike[str] | None = None, *, backend: Backend | None = None) -> None:
        self._home = home
        self._given = backend

    def _backend(self) -> Backend:
        if self._given is not None:
            return self._given
        from .local import LocalBackend  # the home is read when a call is made, not on import

        return LocalBackend.for_home(self._home)

    async def create(
        self,
        name: str,
        *,
        size_gb: float | None = None,
        labels: Mapping[str, str] | None = None,
        shared: bool = False,
    ) -> Volume:
        """A new, empty volume of ``size_gb`` (default 10; its filesystem's size: a full
        volume is ENOSPC in the box; the host holds only what was written). ``shared``:
        a directory instead, which the boxes that mount it share live, with no size of
        its own.

        >>> sandlot.volume.create("cache", size_gb=2, labels={"team": "evals"})  # doctest: +SKIP
        >>> sandlot.volume.create("scratch", shared=True)                      # doctest: +SKIP
        """
        check_name(name)
        if size_gb is not None:
            check_size(size_gb)
        if not isinstance(shared, bool):
            raise InvalidArgument(f"shared must be True or False, not {shared!r}")
        made = await self._backend().volume_create(name, size_gb, check_labels(labels), shared)
        return Volume.from_json(made)

    async def list(self) -> builtins.list[Volume]:
        """Every volume, oldest first."""
        return [Volume.from_json(v) for v in await self._backend().volume_list()]

    async def get(self, key: str) -> Volume:
        """The volume of that name (or id); VolumeNotFound if there is none."""
        return Volume.from_json(await self._backend().volume_get(key))

    async def inspect(self, key: str) -> dict[str, Any]:
        """The volume as JSON: ``get``'s fields plus its size in bytes."""
        return await self._backend().volume_get(key)

    async def remove(self, key: str) -> None:
        """Remove the volume and the files only it used. VolumeInUse while a box mounts
        it (whatever the box's state; its ``boxes`` says which); snapshots taken of boxes
        that mounted it keep their copies."""
        await self._backend().volume_remove(key)
