"""``box.files``: the guest's file system from the host.

Paths are absolute guest paths. Guest errors raise typed exceptions that also
derive from the built-in ones (``FileNotFoundError``, ``IsADirectoryError``...).
Transfers stream in both directions with flow control, so size is bounded by
disk, not memory, when you use ``upload``/``download``/``iter_read``.

``AsyncFiles`` is written once over the box's backend (``api/backend.py``): the same
methods, arguments, results and errors whichever way the box is reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import stat as _stat
import time
import warnings
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..core.validate import guest_path
from ..errors import InvalidArgument, TransferWarning
from .backend import Write
from .diffs import side_arg
from .fs import (
    FILE_EVENT_TYPES,
    FileEvent,
    FileEventType,
    FileInfo,
    WatchSource,
    check_mode,
    check_prefix,
    check_xattrs,
)

if TYPE_CHECKING:
    from .backend import Backend, BoxRef

__all__ = [
    "FILE_EVENT_TYPES",
    "AsyncFiles",
    "AsyncWatch",
    "FileEvent",
    "FileEventType",
    "FileInfo",
    "WatchSource",
]


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

    async def settle(self, timeout: float = 5.0) -> bool:
        """Wait until the events of every change made in the box before this call have
        reached this watch, so that a reader who then takes what is queued misses none of
        them: True. False where ``timeout`` seconds passed first, or where the watch cannot
        tell (one over a server or a fleet: their events come as they come). Another task
        must be reading the events meanwhile (``async for``, ``next_event``).

        >>> await box.files.write("/work/a", b"x"); await watch.settle()   # doctest: +SKIP
        True
        """
        await self.start()
        source = self._source
        return source is not None and not self._ended and await source.settle(timeout)

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


def _skipped_of(answer: Any) -> list[tuple[str, str]]:
    found = answer.get("skipped") if isinstance(answer, dict) else None
    return [(str(s.get("entry", "")), str(s.get("reason", ""))) for s in found or [] if isinstance(s, dict)]


def _host_link(dst: Path, target: str) -> None:
    """The link ``dst`` -> ``target`` made on this host whole (beside it, then renamed over
    what is there unless that is a directory)."""
    if dst.is_dir() and not dst.is_symlink():
        raise InvalidArgument(f"{dst} is a directory: a link cannot replace it")
    tmp = dst.parent / f".{dst.name}.sandlot-link-{os.urandom(4).hex()}"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _warn_skipped(skipped: list[tuple[str, str]]) -> None:
    for entry, reason in skipped:
        warnings.warn(f"{entry!r} was not copied: {reason}", TransferWarning, stacklevel=3)


class AsyncFiles:
    """The guest's file system of a box (``box.files``)."""

    def __init__(self, backend: Backend, ref: BoxRef) -> None:
        self._backend = backend
        self._ref = ref

    async def _call(self, name: str, **args: Any) -> Any:
        return await self._backend.call("files", name, self._ref, args)

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
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument("offset and length must not be negative")
        async for chunk in self._backend.read(self._ref, guest_path(path), offset, length):
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
        otherwise; ``exclusive`` fails if it exists (FileExistsError). ``data`` may be an
        async iterable of chunks, streamed as they come. Returns the bytes written."""
        payload: bytes | AsyncIterable[bytes]
        if isinstance(data, str):
            payload = data.encode()
        elif isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
        else:
            payload = data
        how = Write(check_mode(mode), user, append, parents, exclusive)
        return await self._backend.write(self._ref, guest_path(path), payload, how)

    async def upload(
        self,
        local: str | os.PathLike[str],
        remote: str | os.PathLike[str],
        *,
        mode: int | None = None,
        user: str | None = None,
        follow_symlinks: bool = False,
        follow_outside: Iterable[str | os.PathLike[str]] = (),
    ) -> int:
        """Copy a host file (streamed) or directory into the guest, as ``docker cp`` does.

        A directory goes as one tar stream and lands whole or not at all: made at
        ``remote`` if nothing is there, merged into ``remote`` if it is a directory (a
        directory into a directory, anything else replaced; a directory against a
        non-directory, or a link, refuses the copy before anything is written).

        Symbolic links are copied as links, whatever they point at, never followed (a
        ``local`` that is a link too), unless ``follow_symlinks``: then ``local`` is
        followed, a link to what is inside the tree is copied as what it points to, and
        one that leads out of it (or nowhere) refuses the copy, unless it leads into one
        of ``follow_outside`` (host paths). Files linked together stay linked; fifos and
        device nodes are made where the box allows it (else left out, with a
        ``TransferWarning``), never opened; sockets are left out. Entries keep their
        permission bits and times, and are owned by root or ``user``. A failure raises
        ``TransferError`` naming the entry. A single file keeps its permission bits
        unless ``mode`` is given. Returns the bytes of the files copied (docs/api.md,
        "Trees in and out")."""
        from .tarstream import Follow, host_file, host_tree

        src = Path(local)
        dst = guest_path(remote)
        if src.is_symlink() and not follow_symlinks:  # the link itself, as docker cp copies one
            return await self._put_link(dst, os.readlink(src), user)
        if src.is_dir():
            outside = tuple(os.path.realpath(p) for p in follow_outside)
            if outside and not follow_symlinks:
                raise InvalidArgument(
                    "follow_outside names where followed links may lead: give follow_symlinks=True"
                )
            async with host_tree(src, Follow(follow_symlinks, outside)) as (chunks, sent):
                answer = await self._backend.put_archive(self._ref, dst, chunks, user=user)
            _warn_skipped([*sent.skipped, *_skipped_of(answer)])
            return sent.bytes
        if not src.is_file():
            raise InvalidArgument(f"{src} is not a file or directory")
        file_mode = check_mode(mode) if mode is not None else _stat.S_IMODE(src.stat().st_mode)
        return await self._backend.write(self._ref, dst, host_file(src), Write(file_mode, user))

    async def download(
        self, remote: str | os.PathLike[str], local: str | os.PathLike[str], *, follow_symlinks: bool = False
    ) -> int:
        """Copy a guest file to the host (streamed, written atomically), or a guest
        directory's tree to ``local`` as ``docker cp`` does: made whole if nothing is
        there (or not at all), merged into it if it is a directory (see ``upload``).

        Symbolic links are copied as links, whatever they point at, ``remote`` itself
        too (``follow_symlinks``: ``remote`` is followed, and a link to what is inside
        the tree is copied as what it points to; one that leads out of it refuses the
        copy). Nothing is ever written through a link: a member under one, a hard link
        to what the tree does not hold, a name with ``..``, is refused by name
        (``TransferError``), and the destination is left as it was. Owners are not kept
        (the files are yours), set-id bits are dropped, and device nodes are made only
        by root (else left out, with a ``TransferWarning``). Returns the bytes of the
        files copied (docs/api.md, "Trees in and out")."""
        from .tarstream import to_host_file, unpack

        p = guest_path(remote)
        info = await self.stat(p, follow_symlinks=follow_symlinks)
        dst = Path(local)
        if info.is_symlink:  # the link itself, as docker cp copies one
            if dst.is_dir() and not dst.is_symlink():
                dst = dst / PurePosixPath(p).name
            await asyncio.to_thread(_host_link, dst, info.link_target or "")
            return 0
        if info.is_dir:
            got = await unpack(self._backend.get_archive(self._ref, p, follow_symlinks=follow_symlinks), dst)
            _warn_skipped(got.skipped)
            return got.bytes
        if dst.is_dir():
            dst = dst / PurePosixPath(p).name
        return await to_host_file(dst, self._backend.read(self._ref, p, 0, None), info.mode or 0o644)

    async def _put_link(self, path: str, target: str, user: str | None) -> int:
        """The link ``path`` -> ``target`` made in the guest as an archive of one member
        (so it replaces what is there as an archive's member would, never through a link)."""
        import tarfile

        parent, name = posixpath.split(path)
        if not name:
            raise InvalidArgument(f"{path} names no link")
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, int(time.time())
        block = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + bytes(2 * tarfile.BLOCKSIZE)

        async def one() -> AsyncIterator[bytes]:
            yield block

        answer = await self._backend.put_archive(self._ref, parent, one(), user=user)
        _warn_skipped(_skipped_of(answer))
        return 0

    async def stat(
        self, path: str | os.PathLike[str], *, follow_symlinks: bool = True, xattrs: str | None = None
    ) -> FileInfo:
        """What a path is. ``xattrs="user."``: its extended attributes whose names start
        so, too (``FileInfo.xattrs``; values as text).

        >>> (await box.files.stat("/etc/hostname")).size                  # doctest: +SKIP
        """
        info: FileInfo = await self._call(
            "stat", path=guest_path(path), follow_symlinks=follow_symlinks, xattrs=check_prefix(xattrs)
        )
        return info

    async def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            await self.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    async def list(self, path: str | os.PathLike[str], *, xattrs: str | None = None) -> list[FileInfo]:
        """Entries of a directory (without . and ..), sorted by name; ``xattrs`` as ``stat``'s."""
        found: list[FileInfo] = await self._call("list", path=guest_path(path), xattrs=check_prefix(xattrs))
        return found

    async def set_xattrs(
        self, path: str | os.PathLike[str], values: Mapping[str, str], *, prefix: str
    ) -> None:
        """Make the path's extended attributes whose names start with ``prefix`` exactly
        ``values`` (text, stored as UTF-8): the others of that prefix go. Each name starts
        with the prefix; the file system must keep such attributes (``user.`` ones:
        ext4, tmpfs, overlayfs). What E2B's file metadata is (``user.e2b.``)::

            await box.files.set_xattrs("/data/a.csv", {"user.e2b.source": "upload"}, prefix="user.e2b.")
        """
        start, checked = check_xattrs(values, prefix)
        await self._call("set_xattrs", path=guest_path(path), prefix=start, values=checked)

    async def mkdir(
        self,
        path: str | os.PathLike[str],
        *,
        parents: bool = True,
        mode: int = 0o755,
        user: str | None = None,
    ) -> None:
        """Create a directory; with ``parents`` (default) like ``mkdir -p``."""
        await self._call("mkdir", path=guest_path(path), parents=parents, mode=check_mode(mode), user=user)

    async def remove(
        self, path: str | os.PathLike[str], *, recursive: bool = False, missing_ok: bool = False
    ) -> None:
        """Remove a file, symlink or empty directory (``recursive`` for trees; links are not followed)."""
        await self._call("remove", path=guest_path(path), recursive=recursive, missing_ok=missing_ok)

    async def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        await self._call("rename", src=guest_path(src), dst=guest_path(dst))

    async def chmod(self, path: str | os.PathLike[str], mode: int) -> None:
        if mode is None:
            raise InvalidArgument("chmod needs a mode")
        await self._call("chmod", path=guest_path(path), mode=check_mode(mode))

    async def chown(self, path: str | os.PathLike[str], user: str, *, follow_symlinks: bool = True) -> None:
        """Change the owner; ``user`` is "name", "uid", "name:group" or "uid:gid"."""
        if not user:
            raise InvalidArgument("chown needs a user")
        await self._call("chown", path=guest_path(path), user=user, follow_symlinks=follow_symlinks)

    async def restore(
        self, path: str | os.PathLike[str], snapshot: Any = None, *, from_: Any = None
    ) -> dict[str, Any]:
        """Bring ``path`` back as it was in a snapshot (``from_=`` or ``snapshot``: the
        object, its id or its name), without rolling the box back: a file, a link, a
        special file or a whole tree (what was added under it since goes), with modes
        and owners. The snapshot's copy is built beside the path and renamed into place,
        so the path is never half restored. Answers what was copied: ``{"path", "from",
        "entries", "bytes", "skipped"}``.

        >>> box.files.restore("/app/config.yaml", from_=snap)        # doctest: +SKIP
        {'path': '/app/config.yaml', 'from': 'snapshot before', 'entries': 1, 'bytes': 412, 'skipped': None}
        """
        if (snapshot is None) == (from_ is None):
            raise InvalidArgument("restore needs the snapshot to restore from: from_=snapshot")
        found: dict[str, Any] = await self._call(
            "restore", path=guest_path(path), snapshot=side_arg(from_ if from_ is not None else snapshot)
        )
        return found

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
        backend, ref = self._backend, self._ref

        async def opener() -> WatchSource:
            return await backend.watch(ref, p, recursive)

        return AsyncWatch(p, recursive, opener)
