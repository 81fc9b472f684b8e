"""``AsyncClient``: the boxes of somewhere else, with the local API.

``sandlot.connect_async(url, api_key=...)`` gives a client of a ``sandlot serve``;
a fleet (``sandlot.fleet.connect()``) is a client of the nodes of a Ray cluster.
Their boxes are ``AsyncBox`` objects like local ones, with the same methods,
results and exceptions: ``exec`` returns the same ``ExecResult``, ``spawn`` the
same ``AsyncProcess``, ``files`` reports the same ``FileInfo``, and every error
the other side answers is raised as the sandlot exception it stands for
(``BoxNotFound``, ``InvalidState`` with ``.state`` and ``.allowed``,
``FileNotFoundError`` for a guest ENOENT, ``ExecTimeout``...). The sync twins
(``sandlot.connect``, ``Client``) are generated into ``api/sync.py``.

>>> import asyncio, sandlot
>>> async def main() -> None:                                   # doctest: +SKIP
...     async with sandlot.connect_async("http://127.0.0.1:7070", api_key="sk-sl-...") as client:
...         async with client.Box("python:3.12-slim") as box:
...             print((await box.exec("python3", "-c", "print(6*7)")).stdout)
...             await box.files.write("/tmp/hello.txt", "hi")
...             proc = await box.spawn("sh", "-c", "cat; echo done >&2")
...             await proc.write_stdin(b"streamed\\n")
...             await proc.close_stdin()
...             print((await proc.result()).stdout)
>>> asyncio.run(main())                                         # doctest: +SKIP
42
streamed
"""

from __future__ import annotations

import builtins
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.events import Event
from ..core.events import query as check_events_query
from ..errors import InvalidArgument
from .backend import Backend, BoxRef
from .box import AsyncBox, AsyncSnapshot, boxes_of
from .volumes import AsyncVolumes

if TYPE_CHECKING:
    import httpx


class AsyncClient:
    """The boxes of a ``sandlot serve`` server (async API), or of another backend.

    ``url`` defaults to ``$SANDLOT_URL``, ``api_key`` to ``$SANDLOT_API_KEY`` (none
    for a server started with ``--no-auth``). ``timeout``: seconds to wait for a
    connection or an answer (a command runs as long as it runs). ``verify``: for
    HTTPS, False or the path of a CA bundle to trust instead of the system's.
    ``transport``: an ``httpx`` transport to send the HTTP requests through instead
    of the network (tests, proxies). ``async with client:`` closes its connections
    at the end; boxes keep running. A client's connections belong to the event loop
    that first uses them: use one client per loop.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        verify: bool | str = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        from .http import HttpBackend

        self._backend: Backend = HttpBackend(
            url, api_key, timeout=timeout, verify=verify, transport=transport
        )

    @classmethod
    def over(cls, backend: Backend) -> AsyncClient:
        """A client of the boxes ``backend`` reaches (a fleet's, a home's)."""
        client = cls.__new__(cls)
        client._backend = backend
        return client

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def transport(self) -> str:
        """How its boxes are reached: "http", "ray" or "local"."""
        return self._backend.transport

    @property
    def url(self) -> str | None:
        """The server's address (without ``/v1``); None for a client that is not of a server."""
        url = getattr(self._backend, "url", None)
        return url if isinstance(url, str) else None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url or self.transport}>"

    @property
    def volume(self) -> AsyncVolumes:
        """The named volumes of the far side: ``client.volume.create("data")``, then
        ``client.Box(image, volumes={"data": "/data"})``."""
        return AsyncVolumes(backend=self._backend)

    # -- boxes --------------------------------------------------------------------------------

    def Box(self, image: str | None = None, **options: Any) -> AsyncBox:
        """A box that does not exist yet: ``start()`` creates and boots it, ``async with``
        does the same and removes it at the end (``keep=True``: leaves it running).
        ``options`` as for ``sandlot.AsyncBox``; over a server, host paths (``rootfs``,
        ``kernel``, ``ca_cert``) need an admin key, and what names something of this
        host (``volumes``, ``credentials``, ``home``...) raises Unsupported."""
        keep = bool(options.pop("keep", False))
        return AsyncBox.bound(self._backend.describe(image, options, keep=keep), keep=keep)

    async def create(self, image: str | None = None, **options: Any) -> AsyncBox:
        """Create a box (disk ready, image pulled) without starting it; ``options`` as for ``Box``."""
        box = self.Box(image, **options)
        await self._backend.create(box.ref, start=False)
        return box

    async def get(self, key: str) -> AsyncBox:
        """The box with this id, name or id prefix (``BoxNotFound`` if none)."""
        return AsyncBox.bound(await self._backend.find(key))

    async def list(
        self, *, all: bool = True, state: str | None = None, labels: Mapping[str, str] | None = None
    ) -> builtins.list[AsyncBox]:
        """The boxes this client may see, oldest first. ``all=False``: only running or
        paused ones; ``state``: only that state; ``labels``: only boxes carrying all of them."""
        return await boxes_of(self._backend, all=all, state=state, labels=labels)

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshots(self, kind: str | None = None) -> builtins.list[AsyncSnapshot]:
        """Snapshots and templates this client may see (``kind``: "snapshot" or "template")."""
        return [AsyncSnapshot(r) for r in await self._backend.snapshot_list(box=None, kind=kind)]

    async def get_snapshot(self, key: str) -> AsyncSnapshot:
        """A snapshot or template by id or name (``SnapshotNotFound`` if none)."""
        return AsyncSnapshot(await self._backend.find_snapshot(key))

    async def import_snapshot(
        self, path: str | os.PathLike[str], *, name: str | None = None, start: bool = True
    ) -> AsyncBox | AsyncSnapshot:
        """Send an exported snapshot (streamed from disk); the other side verifies it and
        adds it; with ``start`` (the default) it starts a box from it (named ``name``)
        and this returns the box, else the snapshot."""
        src = Path(path)
        if not src.is_file():
            raise InvalidArgument(f"{src} is not a file")
        made = await self._backend.import_snapshot(src, name=name, start=start, options={})
        return AsyncBox.bound(made) if isinstance(made, BoxRef) else AsyncSnapshot(made)

    # -- events -------------------------------------------------------------------------------

    async def events(
        self, *, box: str | None = None, since: float | None = None, after: int | None = None,
        follow: bool = True,
    ) -> AsyncIterator[Event]:  # fmt: skip
        """What happened to the boxes this client may see, oldest first (``sandlot.events``):
        ``box``: of that box (id or name); ``since``: from that Unix time (a negative
        number: that many seconds ago); ``after``: after that event id (``Event.id``).
        With ``follow`` (the default) it goes on with each new event as it comes."""
        box, since, after = check_events_query(box, since, after)
        async for ev in self._backend.events(box=box, since=since, after=after, follow=follow):
            yield ev

    # -- the other side -----------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """What the other side says of itself: a server's version, its host's accelerator and
        this key's namespace."""
        return await self._backend.info()

    async def aclose(self) -> None:
        """Close the connections (boxes and their processes keep running)."""
        await self._backend.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def connect_async(url: str | None = None, api_key: str | None = None, **kwargs: Any) -> AsyncClient:
    """A client (``AsyncClient``) of the server at ``url`` (default ``$SANDLOT_URL``) with
    ``api_key`` (default ``$SANDLOT_API_KEY``); ``kwargs``: ``timeout``, ``verify``."""
    return AsyncClient(url, api_key, **kwargs)
