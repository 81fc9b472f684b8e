"""Directory trees as tar streams, on both ends of a transfer.

Where the box is (``tar_out``, ``tar_in``): a guest directory as a tar stream, and
a tar stream into a guest directory, built on the files API (no ``tar`` needed in
the image). An incoming archive is checked whole before anything is written: a
member that would land outside the target directory (absolute, ``..``, a link
pointing out) or is a device refuses the archive.

Where the caller is (``host_tree``, ``unpack``): a directory of this host as a
tar stream made as it is sent, and a tar stream unpacked as it arrives, refusing
members that would land outside the target (tarfile's ``data`` filter). Each runs
in a thread of its own, fed through a pipe, so neither holds a whole tree in
memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import stat
import tarfile
import tempfile
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar

from ..errors import RequestError

if TYPE_CHECKING:
    from .fs import FileInfo


class TreeFiles(Protocol):
    """What a tree is carried through: a box's ``files`` (``AsyncFiles``)."""

    async def list(self, path: str) -> list[FileInfo]: ...

    def iter_read(self, path: str, *, offset: int = 0, length: int | None = None) -> AsyncIterator[bytes]: ...

    async def mkdir(
        self, path: str, *, parents: bool = True, mode: int = 0o755, user: str | None = None
    ) -> None: ...

    async def write(self, path: str, data: AsyncIterable[bytes], *, mode: int | None = None,
                    user: str | None = None) -> int: ...  # fmt: skip


CHUNK = 1 << 20
T = TypeVar("T")


def _header(info: FileInfo, arcname: str) -> bytes:
    t = tarfile.TarInfo(arcname)
    t.mode, t.uid, t.gid = info.mode, info.uid, info.gid
    t.mtime = int(info.mtime.timestamp())
    if info.is_dir:
        t.type = tarfile.DIRTYPE
    elif info.is_symlink:
        t.type, t.linkname = tarfile.SYMTYPE, info.link_target or ""
    else:
        t.size = info.size
    return t.tobuf(format=tarfile.PAX_FORMAT)


async def tar_out(files: TreeFiles, root: str) -> AsyncIterator[bytes]:
    """The tree under ``root`` as a tar stream (names relative to it)."""
    pending = [(root, ".")]
    while pending:
        path, arc = pending.pop()
        for info in sorted(await files.list(path), key=lambda i: i.name, reverse=True):
            name = info.name if arc == "." else f"{arc}/{info.name}"
            if info.type == "other":
                continue  # sockets, fifos and devices have no content to carry
            yield _header(info, name)
            if info.is_dir:
                pending.append((info.path, name))
            elif info.is_file:
                sent = 0
                async for chunk in files.iter_read(info.path, length=info.size):
                    chunk = chunk[: info.size - sent]
                    sent += len(chunk)
                    yield chunk
                if sent < info.size:  # shrank while read: keep the archive well formed
                    yield bytes(info.size - sent)
                if pad := -info.size % tarfile.BLOCKSIZE:
                    yield bytes(pad)
    yield bytes(2 * tarfile.BLOCKSIZE)


def _inside(name: str) -> str:
    norm = posixpath.normpath(name)
    if name.startswith("/") or norm == ".." or norm.startswith("../") or "\0" in name:
        raise RequestError(f"archive member {name!r} leaves the target directory")
    return norm


def checked_members(archive: IO[bytes]) -> list[tarfile.TarInfo]:
    """Every member of the archive, or RequestError naming the first unsafe one."""
    try:
        with tarfile.open(fileobj=archive, mode="r:") as tar:
            members = tar.getmembers()
    except tarfile.TarError as e:
        raise RequestError(f"not a tar archive: {e}") from None
    for m in members:
        _inside(m.name)
        if m.issym() or m.islnk():
            # the agent's file protocol makes no links yet; refusing beats dropping them silently
            raise RequestError(f"archive member {m.name!r} is a link; links are not supported in uploads")
        if not (m.isfile() or m.isdir()):
            raise RequestError(f"archive member {m.name!r} is a device or fifo; refused")
    return members


async def tar_in(files: TreeFiles, root: str, archive: IO[bytes], user: str | None = None) -> int:
    """Write a checked archive under ``root`` (owned by ``user`` if given, as
    ``files.upload`` does); returns the number of members."""
    members = checked_members(archive)
    archive.seek(0)
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        await files.mkdir(root, parents=True, user=user)
        for m in members:
            dest = posixpath.join(root, _inside(m.name))
            mode = stat.S_IMODE(m.mode)
            if m.isdir():
                await files.mkdir(dest, parents=True, mode=mode, user=user)
            else:
                src = tar.extractfile(m)
                assert src is not None

                async def chunks(src: IO[bytes] = src) -> AsyncIterator[bytes]:
                    while chunk := src.read(CHUNK):
                        yield chunk

                await files.write(dest, chunks(), mode=mode, user=user)
    return len(members)


# -- the caller's side ---------------------------------------------------------------------


def in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a thread of its own: a transfer's long-running side must not hold
    one of the default executor's few threads, which its short reads and writes need."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=run, name="sandlot-transfer", daemon=True).start()
    return fut


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _tar_tree(root: Path, fd: int, total: list[int]) -> None:
    """Write the tree under ``root`` as a tar stream to ``fd`` (in a thread), then close it."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not (info.isfile() or info.isdir()):
            return None  # the box's side takes files and directories only
        total[0] += info.size if info.isfile() else 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w|", dereference=True) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, filter=keep)


def _untar_tree(fd: int, dest: Path) -> int:
    """Extract the tar stream read from ``fd`` under ``dest`` (in a thread); the bytes of its files."""
    total = 0
    with os.fdopen(fd, "rb") as src, tarfile.open(fileobj=src, mode="r|") as tar:
        for member in _members(tar):
            tar.extract(member, dest, filter="data")
            total += member.size if member.isfile() else 0
    return total


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := tar.next()) is not None:
        yield member


@contextlib.asynccontextmanager
async def host_tree(root: Path) -> AsyncIterator[tuple[AsyncIterator[bytes], list[int]]]:
    """The tree under a host directory as tar chunks, made as they are read, and (once
    they are all read) the bytes of its files in ``total[0]``. Symbolic links are
    carried as what they point to; sockets and devices are left out."""
    r, w = os.pipe()
    total = [0]
    writer = in_thread(_tar_tree, root, w, total)

    async def chunks() -> AsyncIterator[bytes]:
        while chunk := await asyncio.to_thread(os.read, r, CHUNK):
            yield chunk

    try:
        yield chunks(), total
    finally:
        os.close(r)  # a writer still busy gets EPIPE and ends
        with contextlib.suppress(BrokenPipeError):
            await writer


async def unpack(chunks: AsyncIterable[bytes], dest: Path) -> int:
    """A tar stream unpacked under ``dest`` (made if needed) as it arrives; the bytes of
    its files. Members that would land outside ``dest`` are refused."""
    dest.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    reader = in_thread(_untar_tree, r, dest)
    try:
        async for chunk in chunks:
            try:
                await asyncio.to_thread(_write_all, w, chunk)
            except BrokenPipeError:
                break  # the reader stopped: its error says why
    except BaseException:
        os.close(w)
        w = -1
        with contextlib.suppress(Exception):
            await reader
        raise
    finally:
        if w >= 0:
            os.close(w)
    return await reader


async def host_file(path: Path) -> AsyncIterator[bytes]:
    """A host file, read in a thread chunk by chunk (never whole in memory)."""
    f = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            yield chunk
    finally:
        f.close()


async def to_host_file(dst: Path, chunks: AsyncIterable[bytes], mode: int = 0o644) -> int:
    """``chunks`` written to the host file ``dst`` whole or not at all (a temporary file
    beside it, synced and renamed once complete); the bytes written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    total = 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in chunks:
                await asyncio.to_thread(f.write, chunk)
                total += len(chunk)
            await asyncio.to_thread(os.fsync, f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return total
