"""A guest directory as a tar stream, and a tar stream into a guest directory.

Built on the files API (no ``tar`` needed in the image). An incoming archive is
checked whole before anything is written: a member that would land outside the
target directory (absolute, ``..``, a link pointing out) or is a device refuses
the archive."""

from __future__ import annotations

import posixpath
import stat
import tarfile
from collections.abc import AsyncIterator
from typing import IO

from ..api.files import AsyncFiles, FileInfo
from ..errors import RequestError

CHUNK = 1 << 20


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


async def tar_out(files: AsyncFiles, root: str) -> AsyncIterator[bytes]:
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


async def tar_in(files: AsyncFiles, root: str, archive: IO[bytes], user: str | None = None) -> int:
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
