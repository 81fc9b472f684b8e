"""The streams of a backend elsewhere, written once over two codecs of its transport.

Each stream of ``api/contract.py``'s table (``STREAMS``) is a primitive of the
backend interface (``read``, ``write``, ``watch``...): here each is made of the
transport's two codecs, ``frames`` (a server stream's frames as they come: bytes, or
JSON messages) and ``send`` (a client stream's bytes sent as they come, and its JSON
answer). The HTTP backend (``api/http.py``: a request to the stream's route, NDJSON
for messages) and the Ray backend (``fleet/backend.py``: a node's streaming
generator, uploads in chunks) implement only those two, and know no stream by name;
the home that holds the box runs each by its key (``api/host.py``).

Processes are written once here too: a transport gives ``start_process`` (a process
started, and the link its output first comes on) and ``attach`` (a link to a held
process from given offsets: what ``follow.FollowedProcess`` opens again when one drops).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any

from ..errors import ConnectionLost
from .backend import BoxRef, Cell, Command, RemoteBackend, Write
from .code import Callbacks, Execution, code_event
from .contract import STREAM_BY_KEY, Stream, Strict
from .follow import FollowedProcess, FollowedWatch, Link, Opener
from .fs import WatchSource
from .process import AsyncProcess

Data = bytes | AsyncIterable[bytes]  # what a client stream sends: all of it, or its chunks as they come


class Counted:
    """An async iterable of chunks that counts the bytes it passed on."""

    def __init__(self, source: AsyncIterable[bytes]) -> None:
        self._source = source
        self.total = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._source:
            self.total += len(chunk)
            yield bytes(chunk)


class StreamingBackend(RemoteBackend):
    """A backend elsewhere whose streams go through ``frames`` and ``send``."""

    @abstractmethod
    def frames(self, stream: Stream, ref: BoxRef, params: Strict) -> AsyncGenerator[Any, None]:
        """Server stream ``stream`` of the box, with its arguments: its frames as they come
        (bytes, or JSON messages, an error among them as a message)."""

    @abstractmethod
    async def send(
        self, stream: Stream, ref: BoxRef, params: Strict, data: bytes | AsyncIterable[bytes]
    ) -> Any:
        """Client stream ``stream`` to the box, with its arguments: ``data`` as it comes; its answer."""

    @abstractmethod
    async def start_process(self, ref: BoxRef, cmd: Command) -> tuple[str, int, Link]:
        """``cmd`` started in the box and held there: its id, its pid (0: not told), and
        the link its output first comes on."""

    @abstractmethod
    async def process_link(self, ref: BoxRef, process_id: str, offsets: tuple[int, int]) -> Link:
        """A link to the box's held process ``process_id``, its output from ``offsets``
        (bytes of stdout, of stderr)."""

    def where(self, ref: BoxRef) -> str:
        """Where the box is, for an error's message."""
        return f"{self!r} (box {ref.name})"

    async def spawn(self, ref: BoxRef, cmd: Command, keep: str | None = None) -> AsyncProcess:
        process_id, pid, first = await self.start_process(ref, cmd)
        opener = self._attacher(ref, process_id)
        proc = FollowedProcess(process_id, pid, cmd.tty, opener, self.where(ref), first)
        return AsyncProcess(cmd.argv, proc, key=keep)

    async def follow(
        self, ref: BoxRef, process_id: str, pid: int, tty: bool, offsets: tuple[int, int]
    ) -> FollowedProcess:
        opener = self._attacher(ref, process_id)
        proc = FollowedProcess(process_id, pid, tty, opener, self.where(ref), offsets=offsets)
        await proc.connect()
        return proc

    def _attacher(self, ref: BoxRef, process_id: str) -> Opener:
        async def attach(offsets: tuple[int, int]) -> Link:
            return await self.process_link(ref, process_id, offsets)

        return attach

    def _frames(self, key: str, ref: BoxRef, args: dict[str, Any]) -> AsyncGenerator[Any, None]:
        stream = STREAM_BY_KEY[key]
        return self.frames(stream, ref, stream.arguments(args))

    async def _send(
        self, key: str, ref: BoxRef, args: dict[str, Any], data: bytes | AsyncIterable[bytes]
    ) -> Any:
        stream = STREAM_BY_KEY[key]
        return await self.send(stream, ref, stream.arguments(args), data)

    def follow_logs(self, ref: BoxRef, lines: int | None) -> AsyncIterator[bytes]:
        return self._frames("box.follow_logs", ref, {"lines": lines})

    def read(self, ref: BoxRef, path: str, offset: int, length: int | None) -> AsyncIterator[bytes]:
        return self._frames("files.read", ref, {"path": path, "offset": offset, "length": length})

    def get_archive(self, ref: BoxRef, path: str, *, follow_symlinks: bool = False) -> AsyncIterator[bytes]:
        return self._frames("files.get_archive", ref, {"path": path, "follow_symlinks": follow_symlinks})

    async def write(self, ref: BoxRef, path: str, data: bytes | AsyncIterable[bytes], how: Write) -> int:
        counted = data if isinstance(data, bytes) else Counted(data)
        await self._send("files.write", ref, {"path": path, **how.fields()}, counted)
        return len(counted) if isinstance(counted, bytes) else counted.total

    async def put_archive(
        self, ref: BoxRef, path: str, tar: AsyncIterable[bytes], *, user: str | None
    ) -> dict[str, Any]:
        answer = await self._send("files.put_archive", ref, {"path": path, "user": user}, tar)
        return dict(answer) if isinstance(answer, dict) else {}

    async def watch(self, ref: BoxRef, path: str, recursive: bool) -> WatchSource:
        messages = self._frames("files.watch", ref, {"path": path, "recursive": recursive})

        async def receive() -> dict[str, Any] | None:
            message = await anext(messages, None)
            return None if message is None else dict(message)

        return await FollowedWatch(receive, messages.aclose, self.where(ref)).open()

    async def run_code(self, ref: BoxRef, cell: Cell, callbacks: Callbacks) -> Execution:
        messages = self._frames("box.run_code", ref, cell.fields())
        try:  # a cell left (cancelled, a callback's error) is interrupted where the box is
            async for message in messages:
                done = await code_event(message, callbacks)
                if done is not None:
                    return done
        finally:
            await messages.aclose()
        raise ConnectionLost(f"{self.where(ref)}: the cell's events ended before its end")
