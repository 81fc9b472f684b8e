"""``box.files``: the guest's file system from the host.

Paths are absolute guest paths. Guest errors raise typed exceptions that also
derive from the built-in ones (``FileNotFoundError``, ``IsADirectoryError``...).
Transfers stream in both directions with flow control, so size is bounded by
disk, not memory, when you use ``upload``/``download``/``iter_read``.
"""

from __future__ import annotations

import asyncio
import os
import stat as _stat
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ..core.validate import check_user, guest_path
from ..errors import InvalidArgument
from ..protocol import files as proto
from ..protocol.wire import FsFlag, FsOp, RawEntry

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
