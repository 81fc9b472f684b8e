"""``box.files``: the guest's file system from the host.

Paths are absolute guest paths. Guest errors raise typed exceptions that also
derive from the built-in ones (``FileNotFoundError``, ``IsADirectoryError``...).
Transfers stream in both directions with flow control, so size is bounded by
disk, not memory, when you use ``upload``/``download``/``iter_read``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat as _stat
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal, Protocol

from ..core.validate import check_user, guest_path
from ..errors import ConnectionLost, InvalidArgument, InvalidState
from ..protocol import files as proto
from ..protocol.watch import WatchStream
from ..protocol.wire import FsFlag, FsOp, RawEntry, WatchEvent

if TYPE_CHECKING:
    from ..protocol.connection import AgentConnection

CHUNK = 256 * 1024


@dataclass(frozen=True, slots=True)
class FileInfo:
    """What ``stat`` and ``list`` report about a guest path."""

    path: str
    name: str
    type: str  # "file", "dir", "symlink" or "other"
    size: int
    mode: int  # permission bits, e.g. 0o644
    uid: int
    gid: int
    mtime: datetime
    link_target: str | None = None

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @property
    def is_file(self) -> bool:
        return self.type == "file"

    @property
    def is_symlink(self) -> bool:
        return self.type == "symlink"


def _kind(mode: int) -> str:
    if _stat.S_ISREG(mode):
        return "file"
    if _stat.S_ISDIR(mode):
        return "dir"
    if _stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _info(parent: str | None, e: RawEntry, path: str | None = None) -> FileInfo:
    full = path if path is not None else str(PurePosixPath(parent or "/") / e.name)
    return FileInfo(
        path=full,
        name=e.name,
        type=_kind(e.mode),
        size=e.size,
        mode=_stat.S_IMODE(e.mode),
        uid=e.uid,
        gid=e.gid,
        mtime=datetime.fromtimestamp(e.mtime_ns / 1e9, tz=UTC),
        link_target=e.link_target,
    )


FileEventType = Literal["created", "modified", "deleted", "moved", "overflow"]


@dataclass(frozen=True, slots=True)
class FileEvent:
    """One change under a watched path (``box.files.watch``).

    ``type`` is one of:

    - ``"created"``: ``path`` appeared (created, or moved in from outside the
      watched tree; the entries of a directory that appears are reported too);
    - ``"modified"``: a file's content changed: reported when a writer closes it,
      or at most every 0.25 s while a writer keeps it open (a 1 MiB write is one
      event, not hundreds); attribute changes (chmod, touch) are not reported;
    - ``"deleted"``: ``path`` is gone (removed, or moved out of the watched tree);
    - ``"moved"``: renamed within the watched tree, from ``old_path`` to ``path``;
    - ``"overflow"``: events under ``path`` may have been lost (the box's queue
      filled while nobody read, or a directory could not be watched): look at
      ``path`` again instead of trusting the events alone.

    Paths are absolute guest paths; ``is_dir`` tells whether ``path`` is a directory.
    """

    type: FileEventType
    path: str
    is_dir: bool = False
    old_path: str | None = None  # "moved": where it was


FILE_EVENT_TYPES: frozenset[FileEventType] = frozenset(
    ("created", "modified", "deleted", "moved", "overflow")
)
_EVENT_TYPES: dict[WatchEvent, FileEventType] = {
    WatchEvent.CREATED: "created",
    WatchEvent.MODIFIED: "modified",
    WatchEvent.DELETED: "deleted",
    WatchEvent.MOVED: "moved",
    WatchEvent.OVERFLOW: "overflow",
}


class WatchSource(Protocol):
    """What ``AsyncWatch`` reads: a watch channel of the box's agent locally, a
    streamed HTTP answer for a remote box (``api/remote.py``)."""

    async def next(self) -> FileEvent | None:
        """The next event, or None once the watch has ended."""
        ...

    async def aclose(self) -> None:
        """Stop watching (at once; idempotent)."""
        ...


class AsyncWatch:
    """The events of a watched guest path: ``async for event in watch``.

    The watch starts on ``async with``, ``start()`` or the first iteration, and
    stops on ``aclose()``, at the end of the ``async with`` block, or when the
    object is dropped (a ``break`` out of ``async for box.files.watch(...)``).
    Iteration ends when the watched path itself is deleted or moved away (after a
    ``"deleted"`` event for it), or when the box stops, is suspended or removed;
    it raises ``BoxCrashed`` if the box crashes, ``ConnectionLost`` if the
    connection to it fails otherwise.

    Events wait in the box (up to 256 KiB of them) while you do not read; beyond
    that they are dropped and one ``"overflow"`` event says so.
    """

    def __init__(self, path: str, recursive: bool, opener: Callable[[], Awaitable[WatchSource]]) -> None:
        self._path = path
        self._recursive = recursive
        self._opener = opener
        self._source: WatchSource | None = None
        self._starting: asyncio.Future[WatchSource] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._ended = False

    @property
    def path(self) -> str:
        """The watched path."""
        return self._path

    @property
    def recursive(self) -> bool:
        return self._recursive

    @property
    def closed(self) -> bool:
        """``aclose()`` was called, or the watch has ended."""
        return self._closed or self._ended

    async def start(self) -> AsyncWatch:
        """Begin watching now (idempotent): changes from here on are reported. A
        missing path raises ``FileNotFoundError``."""
        if self._closed:
            raise InvalidArgument(f"the watch of {self._path} is closed")
        if self._source is None:
            if self._starting is None:
                self._loop = asyncio.get_running_loop()
                self._starting = asyncio.ensure_future(self._opener())
            try:
                source = await asyncio.shield(self._starting)
            except BaseException:
                if self._starting.done():
                    self._starting = None  # a failed start may be tried again
                raise
            if self._closed:  # closed while it started
                await source.aclose()
                raise InvalidArgument(f"the watch of {self._path} is closed")
            self._source = source
        return self

    async def next_event(self, timeout: float | None = None) -> FileEvent | None:
        """The next event, waiting at most ``timeout`` seconds (then ``TimeoutError``);
        None once the watch has ended."""
        if self._ended or self._closed:
            return None
        await self.start()
        source = self._source
        assert source is not None
        try:
            async with asyncio.timeout(timeout):
                event = await source.next()
        except TimeoutError:
            if self._closed:
                return None
            raise
        if event is None:
            self._ended = True
        return event

    async def aclose(self) -> None:
        """Stop watching; the box frees what it held for the watch."""
        self._closed = True
        source, self._source = self._source, None
        starting, self._starting = self._starting, None
        if source is None and starting is not None:  # a start in progress, or one nobody awaited
            if not starting.done():
                starting.cancel()  # the channel it may have opened is closed as it ends
            elif not starting.cancelled() and starting.exception() is None:
                source = starting.result()
        if source is not None:
            await source.aclose()

    async def __aenter__(self) -> AsyncWatch:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[FileEvent]:
        return self

    async def __anext__(self) -> FileEvent:
        event = await self.next_event()
        if event is None:
            raise StopAsyncIteration
        return event

    def __del__(self) -> None:
        # dropped while watching (a break out of ``async for``): stop it on its loop
        source, loop = self._source, self._loop
        if source is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(source.aclose()))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "watching" if self._source is not None else "not started"
        return f"<AsyncWatch {self._path} recursive={self._recursive} {state}>"


class _AgentWatch:
    """A watch channel of the box's agent, as a ``WatchSource``."""

    def __init__(self, conn: AgentConnection, stream: WatchStream) -> None:
        self._conn = conn
        self._stream = stream

    async def next(self) -> FileEvent | None:
        try:
            record = await self._stream.next()
        except (ConnectionLost, InvalidState) as e:
            # The box stopped, was suspended or removed: by this process (the
            # connection was closed on purpose, so it records no failure), or by
            # another one (the connection's failure says so). A crash raises.
            failure = self._conn.failed
            if failure is None or (type(failure) is InvalidState and failure is e):
                return None
            raise
        if record is None:
            return None
        st = self._stream
        return FileEvent(
            _EVENT_TYPES[record.kind],
            st.absolute(record.path),
            record.is_dir,
            st.absolute(record.old_path) if record.old_path is not None else None,
        )

    async def aclose(self) -> None:
        self._stream.close()


def _mode(mode: int | None) -> int | None:
    if mode is not None and not (isinstance(mode, int) and 0 <= mode <= 0o7777):
        raise InvalidArgument(f"mode must be an int in 0..0o7777, not {mode!r}")
    return mode


class AsyncFiles:
    """File operations on a running box (``box.files``)."""

    def __init__(self, connection: Callable[[], Awaitable[AgentConnection]]) -> None:
        self._conn = connection

    async def read(self, path: str | os.PathLike[str]) -> bytes:
        """The whole file as bytes."""
        parts = [chunk async for chunk in self.iter_read(path)]
        return b"".join(parts)

    async def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def iter_read(
        self, path: str | os.PathLike[str], *, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes]:
        """Stream a file in chunks (``offset``/``length`` select a range)."""
        p = guest_path(path)
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument("offset and length must not be negative")
        _size, _mode_bits, chunks = await proto.read_stream(
            await self._conn(), p, offset=offset, length=length
        )
        async for chunk in chunks:
            yield chunk

    async def write(
        self,
        path: str | os.PathLike[str],
        data: bytes | str | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        user: str | None = None,
        append: bool = False,
        parents: bool = True,
        exclusive: bool = False,
    ) -> int:
        """Write a whole file atomically (or append). Creates parent directories by
        default; keeps an existing file's mode and owner unless ``mode``/``user`` say
        otherwise. ``data`` may be an async iterable of chunks, streamed as they come.
        Returns the bytes written."""
        p = guest_path(path)
        payload: bytes | AsyncIterable[bytes]
        if isinstance(data, str):
            payload = data.encode()
        elif isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
        else:
            payload = data
        return await proto.write_stream(
            await self._conn(), p, payload, mode=_mode(mode), user=check_user(user), append=append,
            parents=parents, exclusive=exclusive,
        )  # fmt: skip

    async def upload(
        self,
        local: str | os.PathLike[str],
        remote: str | os.PathLike[str],
        *,
        mode: int | None = None,
        user: str | None = None,
    ) -> int:
        """Copy a host file (streamed) or directory (recursively) into the guest.
        A file keeps its permission bits unless ``mode`` is given. Returns bytes copied."""
        src = Path(local)
        dst = guest_path(remote)
        if src.is_dir():
            total = 0
            await self.mkdir(dst, parents=True, user=user)
            for child in sorted(src.iterdir()):
                total += await self.upload(child, str(PurePosixPath(dst) / child.name), user=user)
            return total
        if not src.is_file():
            raise InvalidArgument(f"{src} is not a file or directory")
        file_mode = _mode(mode) if mode is not None else _stat.S_IMODE(src.stat().st_mode)

        async def chunks() -> AsyncIterator[bytes]:
            f = await asyncio.to_thread(open, src, "rb")
            try:
                while chunk := await asyncio.to_thread(f.read, CHUNK):
                    yield chunk
            finally:
                f.close()

        owner = check_user(user)
        return await proto.write_stream(await self._conn(), dst, chunks(), mode=file_mode, user=owner)

    async def download(self, remote: str | os.PathLike[str], local: str | os.PathLike[str]) -> int:
        """Copy a guest file to the host (streamed, written atomically). Returns bytes copied."""
        p = guest_path(remote)
        dst = Path(local)
        if dst.is_dir():
            dst = dst / PurePosixPath(p).name
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
        total = 0
        try:
            with os.fdopen(fd, "wb") as f:
                _size, mode_bits, chunks = await proto.read_stream(await self._conn(), p)
                async for chunk in chunks:
                    await asyncio.to_thread(f.write, chunk)
                    total += len(chunk)
            os.chmod(tmp, _stat.S_IMODE(mode_bits) or 0o644)
            os.replace(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return total

    async def stat(self, path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> FileInfo:
        p = guest_path(path)
        flags = 0 if follow_symlinks else FsFlag.NOFOLLOW
        entries = await proto.fs_request(await self._conn(), FsOp.STAT, p, flags=flags)
        return _info(None, entries[0], path=p)

    async def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            await self.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    async def list(self, path: str | os.PathLike[str]) -> list[FileInfo]:
        """Entries of a directory (without . and ..), sorted by name."""
        p = guest_path(path)
        entries = await proto.fs_request(await self._conn(), FsOp.LIST, p)
        return sorted((_info(p, e) for e in entries), key=lambda i: i.name)

    async def mkdir(
        self,
        path: str | os.PathLike[str],
        *,
        parents: bool = True,
        mode: int = 0o755,
        user: str | None = None,
    ) -> None:
        """Create a directory; with ``parents`` (default) like ``mkdir -p``."""
        flags = FsFlag.PARENTS if parents else 0
        owner, where, conn = check_user(user), guest_path(path), await self._conn()
        await proto.fs_request(conn, FsOp.MKDIR, where, mode=_mode(mode), flags=flags, user=owner)

    async def remove(
        self, path: str | os.PathLike[str], *, recursive: bool = False, missing_ok: bool = False
    ) -> None:
        """Remove a file, symlink or empty directory (``recursive`` for trees; links are not followed)."""
        flags = (FsFlag.RECURSIVE if recursive else 0) | (FsFlag.MISSING_OK if missing_ok else 0)
        await proto.fs_request(await self._conn(), FsOp.REMOVE, guest_path(path), flags=flags)

    async def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        await proto.fs_request(await self._conn(), FsOp.RENAME, guest_path(src), path2=guest_path(dst))

    async def chmod(self, path: str | os.PathLike[str], mode: int) -> None:
        if mode is None:
            raise InvalidArgument("chmod needs a mode")
        await proto.fs_request(await self._conn(), FsOp.CHMOD, guest_path(path), mode=_mode(mode))

    async def chown(self, path: str | os.PathLike[str], user: str, *, follow_symlinks: bool = True) -> None:
        """Change the owner; ``user`` is "name", "uid", "name:group" or "uid:gid"."""
        if not user:
            raise InvalidArgument("chown needs a user")
        check_user(user)
        flags = 0 if follow_symlinks else FsFlag.NOFOLLOW
        await proto.fs_request(await self._conn(), FsOp.CHOWN, guest_path(path), user=user, flags=flags)

    def watch(self, path: str | os.PathLike[str], *, recursive: bool = True) -> AsyncWatch:
        """Watch a directory (with everything below it, unless ``recursive=False``)
        or a file for changes: an iterator of ``FileEvent``::

            async with box.files.watch("/work") as events:
                async for event in events:
                    print(event.type, event.path)

        The watch begins on ``async with`` (or the first iteration): a missing
        path raises ``FileNotFoundError`` then. A file is followed by its path, so
        a file replaced by a rename (as ``files.write`` does) is still watched: the
        replacement is a ``"moved"`` event onto the path. See ``AsyncWatch`` for
        when iteration ends."""
        p = guest_path(path)
        connection = self._conn

        async def opener() -> WatchSource:
            conn = await connection()
            return _AgentWatch(conn, await WatchStream.start(conn, p, recursive=recursive))

        return AsyncWatch(p, recursive, opener)
