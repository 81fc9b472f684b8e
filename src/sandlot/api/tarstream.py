"""Directory trees as tar streams where the caller is: a directory of this host made
into a tar stream as it is sent (``host_tree``), and a tar stream unpacked into a
directory of this host as it arrives (``unpack``). The box's side of the same is its
agent's (``protocol/archive.py``, ``guest/agent/archive.c``), with the same rules:
trees move as ``docker cp`` moves them.

- A symbolic link is carried as a link, whatever it points at. Upload follows links
  only when asked (``follow_symlinks``), and then only to what is inside the tree, or
  inside a place the caller names (``follow_outside``); a link that would lead
  elsewhere, or nowhere, is refused by name. Files linked together go as hard links;
  fifos and device nodes as what they are. No entry is opened but a regular file, and
  that only once it is known to be one (``O_PATH`` first): a fifo or a device is never
  opened. Sockets are left out, said in a ``TransferWarning``.
- Unpacking never follows a link when it makes or writes a path: each component is
  opened beneath a staging directory with ``O_NOFOLLOW``, so a member under a link (one
  the archive made, say ``a -> /etc`` then ``a/passwd``) is refused by name, as is a
  hard link to what the archive did not hold before it, or a name that is absolute or
  holds ``..``. Set-user and set-group bits are dropped on this host, and owners are not
  kept: what is unpacked is the caller's.
- Whole or nothing: the tree is unpacked into a staging directory, then renamed into
  place where the destination is new, or merged into a destination that is there
  (a directory into a directory, anything else replaced; a directory against a
  non-directory, a link among them, refuses the copy before anything moves). A
  failure leaves the destination as it was; only a merge that fails while it moves
  entries into place (the file system refused a rename) leaves some, which its
  ``TransferError.written`` lists.

Each side runs in a thread of its own, fed through a pipe, so neither holds a tree in
memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import secrets
import stat
import tarfile
import tempfile
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from ..errors import InvalidArgument, TransferError
from ..protocol.archive import ArchiveReport as Report

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
PAX_MAX = 1 << 20  # the largest extended header taken
NAME_MAX_BYTES = 32768  # the longest member name taken
_HIGH_BYTES = bytes(range(128, 256))
T = TypeVar("T")


def text(name: bytes | str) -> str:
    """A name as it is shown: bytes that are not UTF-8 escaped, never lost."""
    if isinstance(name, str):
        name = os.fsencode(name)
    return name.decode("utf-8", "backslashreplace")


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


def _inside(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


# -- a host tree as a tar stream --------------------------------------------------------------


@dataclass(frozen=True)
class Follow:
    """Upload's links: kept (the default), or followed to what is inside the tree, or
    inside one of ``outside`` (real paths)."""

    links: bool = False
    outside: tuple[str, ...] = ()


class _TreeWriter:
    def __init__(self, root: Path, out: IO[bytes], follow: Follow, report: Report) -> None:
        self.out = out
        self.follow = follow
        self.report = report
        self.root = os.path.realpath(root)
        self.stack: list[tuple[int, int]] = []
        self.linked: dict[tuple[int, int], str] = {}

    def run(self, root: Path) -> None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            self.stack.append((st.st_dev, st.st_ino))
            self.header("./", tarfile.DIRTYPE, st)  # the tree's own mode and time, as tar -C DIR . has them
            self.children(fd, "")
        finally:
            os.close(fd)
        self.out.write(bytes(2 * BLOCK))

    def children(self, dfd: int, prefix: str) -> None:
        try:
            names = sorted(os.listdir(dfd))
        except OSError as e:
            raise TransferError.at(
                prefix, f"cannot read the directory: {e.strerror}", side="host", errno=e.errno
            ) from None
        for name in names:
            self.entry(dfd, name, f"{prefix}/{name}" if prefix else name)

    def header(self, arc: str, kind: bytes, st: os.stat_result, size: int = 0, link: str = "") -> None:
        t = tarfile.TarInfo(arc)
        t.type = kind
        t.mode = stat.S_IMODE(st.st_mode)
        t.mtime = max(0, int(st.st_mtime))
        t.size = size
        t.linkname = link
        t.uid = t.gid = 0  # the host's owners are not the box's: the box makes its own
        t.uname = t.gname = ""
        if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
            t.devmajor, t.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        self.out.write(t.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))

    def entry(self, dfd: int, name: str, arc: str) -> None:
        try:
            pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return  # removed as the tree was read
        except OSError as e:
            raise TransferError.at(
                arc, f"cannot look at it: {e.strerror}", side="host", errno=e.errno
            ) from None
        try:
            st = os.fstat(pfd)
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(name, dir_fd=dfd)
                except OSError as e:
                    raise TransferError.at(
                        arc, f"changed while the tree was read: {e.strerror}", side="host", errno=e.errno
                    ) from None
                if not self.follow.links:
                    self.header(arc, tarfile.SYMTYPE, st, link=target)
                    self.report.entries += 1
                    return
                os.close(pfd)
                pfd = -1
                pfd = self.followed(dfd, name, arc, target)
                st = os.fstat(pfd)
            if stat.S_ISDIR(st.st_mode):
                self.directory(pfd, arc)
            elif stat.S_ISREG(st.st_mode):
                self.file(dfd, name, pfd, arc, st)
            elif stat.S_ISFIFO(st.st_mode):
                self.header(arc, tarfile.FIFOTYPE, st)
                self.report.entries += 1
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                self.header(arc, tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else tarfile.BLKTYPE, st)
                self.report.entries += 1
            else:
                self.report.skipped.append((text(arc), "a socket: it cannot be copied"))
        finally:
            if pfd >= 0:
                os.close(pfd)

    def followed(self, dfd: int, name: str, arc: str, target: str) -> int:
        """What the link ``name`` points to, as an O_PATH descriptor, if it may be followed."""
        try:
            fd = os.open(name, os.O_PATH | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            raise TransferError.at(
                arc,
                f"a symbolic link to {target}, which leads nowhere ({e.strerror}): not followed",
                side="host",
                errno=e.errno,
            ) from None
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(os.path.join(self.root, arc))
        if not _inside(real, self.root) and not any(_inside(real, o) for o in self.follow.outside):
            os.close(fd)
            raise TransferError.at(
                arc,
                f"a symbolic link to {target}, which leads out of the tree (to {real}): not followed; "
                "name the places links may lead out to with follow_outside",
                side="host",
                errno=errno.EXDEV,
            )
        return fd

    def directory(self, pfd: int, arc: str) -> None:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pfd)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in self.stack:
                raise TransferError.at(
                    arc,
                    "a symbolic link back to a directory that holds it: a loop",
                    side="host",
                    errno=errno.ELOOP,
                )
            self.header(arc, tarfile.DIRTYPE, st)
            self.report.entries += 1
            self.stack.append((st.st_dev, st.st_ino))
            self.children(fd, arc)
            self.stack.pop()
        finally:
            os.close(fd)

    def file(self, dfd: int, name: str, pfd: int, arc: str, lst: os.stat_result) -> None:
        key = (lst.st_dev, lst.st_ino)
        if lst.st_nlink > 1 and key in self.linked:
            self.header(arc, tarfile.LNKTYPE, lst, link=self.linked[key])
            self.report.entries += 1
            return
        try:  # opened only now that it is known to be a regular file: the very one looked at
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd
            )
        except OSError as e:
            raise TransferError.at(arc, f"cannot open: {e.strerror}", side="host", errno=e.errno) from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != key or not stat.S_ISREG(st.st_mode):
                raise TransferError.at(
                    arc, "replaced while the tree was read", side="host", errno=errno.EAGAIN
                )
            size = st.st_size
            self.header(arc, tarfile.REGTYPE, st, size=size)
            left = size
            while left:
                try:
                    chunk = os.read(fd, min(CHUNK, left))
                except OSError as e:
                    raise TransferError.at(
                        arc, f"cannot read: {e.strerror}", side="host", errno=e.errno
                    ) from None
                if not chunk:
                    raise TransferError.at(
                        arc,
                        f"changed while it was read: it ended at {size - left} of {size} bytes",
                        side="host",
                        errno=errno.EAGAIN,
                    )
                self.out.write(chunk)
                left -= len(chunk)
            self.out.write(bytes(-size % BLOCK))
        finally:
            os.close(fd)
        self.report.entries += 1
        self.report.bytes += size
        if lst.st_nlink > 1:
            self.linked[key] = arc


def _tar_tree(root: Path, fd: int, follow: Follow, report: Report) -> None:
    """Write the tree under ``root`` as a tar stream to ``fd`` (in a thread), then close it."""
    with os.fdopen(fd, "wb", buffering=CHUNK) as out:
        _TreeWriter(root, out, follow, report).run(root)


@contextlib.asynccontextmanager
async def host_tree(
    root: Path, follow: Follow | None = None
) -> AsyncIterator[tuple[AsyncIterator[bytes], Report]]:
    """The tree under a host directory as tar chunks, made as they are read, and (once
    they are all read) its report. A failure (a link that may not be followed, a file
    that shrinks as it is read) is raised by the chunks, in place of their end."""
    r, w = os.pipe()
    report = Report()
    writer = in_thread(_tar_tree, root, w, follow or Follow(), report)

    async def chunks() -> AsyncIterator[bytes]:
        while chunk := await asyncio.to_thread(os.read, r, CHUNK):
            yield chunk
        await writer  # the end of the stream, or the writer's error in its place

    try:
        yield chunks(), report
    finally:
        os.close(r)  # a writer still busy gets EPIPE and ends
        with contextlib.suppress(BrokenPipeError, TransferError, OSError):
            await writer


# -- a tar stream into a host directory -------------------------------------------------------


@dataclass
class Member:
    type: bytes
    name: bytes
    link: bytes
    mode: int
    size: int
    mtime: int
    devmajor: int
    devminor: int


def _num(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # base-256 (GNU): positive only
        if field[0] != 0x80:
            raise ValueError("a negative number")
        return int.from_bytes(field[1:], "big")
    digits = field.replace(b"\0", b" ").strip()
    return int(digits, 8) if digits else 0


class _TarReader:
    """Members of a tar stream, read strictly: sizes bounded, checksums checked, a note
    of the box's (a global header SANDLOT.error.*) raised, skips (SANDLOT.skip.*) kept."""

    def __init__(self, f: IO[bytes], report: Report) -> None:
        self.f = f
        self.report = report
        self.last = b""

    def fail(self, what: str, number: int = errno.EINVAL) -> TransferError:
        return TransferError.at(text(self.last), what, side="host", errno=number)

    def exactly(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail("the archive ends early, after this entry (no end-of-archive blocks)", errno.EIO)
        return data

    def skip(self, n: int) -> None:
        while n:
            n -= len(self.exactly(min(n, CHUNK)))

    def members(self) -> Iterator[Member]:
        """Each member; its data follows it in the stream (read it, then the padding)."""
        long_name: bytes | None = None
        long_link: bytes | None = None
        size_over: int | None = None
        while True:
            block = self.exactly(BLOCK)
            if block == bytes(BLOCK):
                return
            if not self.checksum_ok(block):
                raise self.fail("not a tar archive after this entry (a header's checksum is wrong)")
            kind = block[156:157]
            try:
                size = _num(block[124:136])
            except ValueError:
                raise self.fail("a malformed size in the header after this entry") from None
            if kind in (b"x", b"g", b"L", b"K"):
                if size > PAX_MAX:
                    raise self.fail(
                        f"an extended header of {size} bytes after this entry (the most taken: {PAX_MAX})",
                        errno.E2BIG,
                    )
                data = self.exactly(size)
                self.skip(-size % BLOCK)
                if kind == b"L":
                    long_name = data.split(b"\0", 1)[0]
                elif kind == b"K":
                    long_link = data.split(b"\0", 1)[0]
                else:
                    pax = self.pax(data)
                    if kind == b"g":
                        self.note(pax)
                    else:
                        long_name = pax.get(b"path", long_name)
                        long_link = pax.get(b"linkpath", long_link)
                        if b"size" in pax:
                            try:
                                size_over = int(pax[b"size"])
                            except ValueError:
                                raise self.fail(
                                    "a malformed size in an extended header after this entry"
                                ) from None
                continue
            name = long_name if long_name is not None else block[:100].split(b"\0", 1)[0]
            if long_name is None and block[257:263] == b"ustar\0" and block[345]:
                name = block[345:500].split(b"\0", 1)[0] + b"/" + name
            try:
                m = Member(
                    type=kind if kind != b"\0" else b"0",
                    name=name,
                    link=long_link if long_link is not None else block[157:257].split(b"\0", 1)[0],
                    mode=_num(block[100:108]) & 0o7777,
                    size=size_over if size_over is not None else size,
                    mtime=_num(block[136:148]),
                    devmajor=_num(block[329:337]),
                    devminor=_num(block[337:345]),
                )
            except ValueError:
                raise TransferError.at(
                    text(name), "a malformed header", side="host", errno=errno.EINVAL
                ) from None
            if len(m.name) > NAME_MAX_BYTES:
                raise TransferError.at(
                    text(m.name[:200]) + "...",
                    f"a name longer than {NAME_MAX_BYTES} bytes",
                    side="host",
                    errno=errno.ENAMETOOLONG,
                )
            self.last = m.name
            yield m
            long_name = long_link = None
            size_over = None

    @staticmethod
    def checksum_ok(block: bytes) -> bool:
        try:
            want = _num(block[148:156])
        except ValueError:
            return False
        plain = block[:148] + b" " * 8 + block[156:]
        unsigned = sum(plain)
        if want == unsigned:
            return True
        high = len(plain) - len(plain.translate(None, _HIGH_BYTES))  # old tars summed signed bytes
        return want == unsigned - 256 * high

    def pax(self, data: bytes) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        pos = 0
        while pos < len(data):
            space = data.find(b" ", pos)
            if space < 0 or not data[pos:space].isdigit():
                raise self.fail("a malformed extended header after this entry")
            length = int(data[pos:space])
            record = data[space + 1 : pos + length]
            if length <= space - pos or pos + length > len(data) or not record.endswith(b"\n"):
                raise self.fail("a malformed extended header after this entry")
            key, eq, value = record[:-1].partition(b"=")
            if not eq:
                raise self.fail("a malformed extended header after this entry")
            out[key] = value
            pos += length
        return out

    def note(self, pax: dict[bytes, bytes]) -> None:
        """A global header: the box's word on the stream (SANDLOT.*); the rest is not ours."""
        for key, value in pax.items():
            if key.startswith(b"SANDLOT.skip.") and key.endswith(b".path"):
                why = pax.get(key[: -len(b".path")] + b".why", b"")
                self.report.skipped.append((text(value), why.decode("utf-8", "replace")))
        if b"SANDLOT.error.path" in pax or b"SANDLOT.error.message" in pax:
            number = pax.get(b"SANDLOT.error.errno", b"")
            raise TransferError.at(
                text(pax.get(b"SANDLOT.error.path", b"")),
                pax.get(b"SANDLOT.error.message", b"failed").decode("utf-8", "replace"),
                side="box",
                errno=int(number) if number.isdigit() else None,
            )


def _clean(name: bytes) -> bytes | None:
    """A member's name as a path under the destination ("" for the destination itself);
    None where it leads out (absolute, or ``..``)."""
    if name.startswith(b"/") or b"\0" in name:
        return None
    parts = []
    for part in name.split(b"/"):
        if part == b"..":
            return None
        if part and part != b".":
            parts.append(part)
    return b"/".join(parts)


def _renameat2_noreplace() -> Callable[[int, bytes, int, bytes], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def rename(src_dir: int, src: bytes, dst_dir: int, dst: bytes) -> int:
        if fn(src_dir, src, dst_dir, dst, 1) == 0:  # RENAME_NOREPLACE
            return 0
        return ctypes.get_errno()

    return rename


_RENAMEAT2 = _renameat2_noreplace()
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: bytes | str, dir_fd: int) -> int:
    """The directory ``name`` in ``dir_fd``, never through a link (ELOOP for one). A
    kernel's O_NOFOLLOW with O_DIRECTORY is not relied on (gVisor's opens the directory
    a link points to): the name is opened O_PATH without following, checked, reopened."""
    p = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(p)
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), name)
        return os.open(".", _DIR_FLAGS, dir_fd=p)
    finally:
        os.close(p)


_DROP_BITS = stat.S_ISUID | stat.S_ISGID


@dataclass
class _Dir:
    mode: int
    mtime: int
    named: bool  # a member of the archive, not a parent made for one


class _Unpacker:
    """One archive unpacked beneath a staging directory, then put into place."""

    def __init__(self, dest: Path, report: Report) -> None:
        self.dest = dest
        self.report = report
        self.dirs: dict[bytes, _Dir] = {}
        self.cache: tuple[bytes, int] | None = None
        self.written: list[str] = []
        self.merged: set[bytes] = set()  # directories that were in the destination already
        self.dest_fd = -1
        name = os.fsencode(dest.name)
        tag = f"sandlot-incoming-{secrets.token_hex(4)}".encode()
        if dest.exists():
            if not dest.is_dir():
                raise InvalidArgument(f"{dest} is there and is not a directory")
            self.dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self.parent_fd = self.dest_fd  # inside it: its file system, so entries rename into place
            self.stage_name = b"." + tag
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.parent_fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self.stage_name = b"." + name[:200] + b"." + tag
        self.name = name
        os.mkdir(self.stage_name, 0o700, dir_fd=self.parent_fd)
        self.stage: int | None = _open_dir(self.stage_name, self.parent_fd)

    def close(self) -> None:
        if self.cache is not None:
            os.close(self.cache[1])
            self.cache = None
        if self.stage is not None:
            os.close(self.stage)
            self.stage = None
            _remove_tree(self.parent_fd, self.stage_name)
        if self.dest_fd >= 0 and self.dest_fd != self.parent_fd:
            os.close(self.dest_fd)
        os.close(self.parent_fd)

    # -- beneath the staging directory, no link followed

    def beneath(self, rel: bytes, entry: str, *, create: bool, base: int | None = None) -> int:
        """The directory ``rel`` of the staging directory (or of ``base``), no link followed on
        the way, a descriptor the caller closes; with ``create``, what is missing is made."""
        start = self.stage if base is None else base
        assert start is not None
        fd = os.dup(start)
        so_far: list[bytes] = []
        try:
            for part in rel.split(b"/") if rel else []:
                so_far.append(part)
                path = b"/".join(so_far)
                try:
                    nxt = _open_dir(part, fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                        self.dirs.setdefault(path, _Dir(0o755, 0, named=False))
                    nxt = self.open_dir(fd, part, path, entry)
                except OSError:
                    nxt = self.open_dir(fd, part, path, entry)  # raises what stood in the way
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def open_dir(fd: int, part: bytes, so_far: bytes, entry: str) -> int:
        try:
            return _open_dir(part, fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise TransferError.at(
                        entry,
                        f"{text(so_far)} is a symbolic link: not followed",
                        side="host",
                        errno=errno.ELOOP,
                    ) from None
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                raise TransferError.at(
                    entry, f"{text(so_far)} is not a directory", side="host", errno=errno.ENOTDIR
                ) from None
            raise TransferError.at(
                entry, f"{text(so_far)}: {e.strerror}", side="host", errno=e.errno
            ) from None

    def parent_of(self, rel: bytes, entry: str) -> tuple[int, bytes]:
        """The directory that holds ``rel`` (kept open for the next member), and its name there."""
        parent, _, base = rel.rpartition(b"/")
        if self.cache is not None and self.cache[0] == parent:
            return self.cache[1], base
        fd = self.beneath(parent, entry, create=True)
        if self.cache is not None:
            os.close(self.cache[1])
        self.cache = (parent, fd)
        return fd, base

    # -- members

    def member(self, m: Member, reader: _TarReader) -> None:
        entry = text(m.name)
        rel = _clean(m.name)
        if rel is None:
            raise TransferError.at(
                entry, "a name that leads out of the destination: refused", side="host", errno=errno.EXDEV
            )
        if m.type not in (b"0", b"7"):
            reader.skip(m.size + (-m.size % BLOCK))
        if not rel:
            if m.type != b"5":
                raise TransferError.at(
                    entry,
                    "names the destination itself, which is a directory",
                    side="host",
                    errno=errno.EINVAL,
                )
            self.dirs[b""] = _Dir(m.mode & ~_DROP_BITS, m.mtime, named=True)
            return
        pfd, base = self.parent_of(rel, entry)
        try:
            there = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        if there is not None:
            if stat.S_ISDIR(there.st_mode) != (m.type == b"5"):
                what = "a directory" if stat.S_ISDIR(there.st_mode) else "a non-directory"
                raise TransferError.at(
                    entry, f"an earlier member made {what} here", side="host", errno=errno.EEXIST
                )
            if m.type != b"5":
                os.unlink(base, dir_fd=pfd)  # a later member of the same name wins, as in tar
        try:
            self.make(m, rel, pfd, base, there is not None, reader, entry)
        except OSError as e:
            raise TransferError.at(
                entry, f"cannot make it: {e.strerror}", side="host", errno=e.errno
            ) from None
        self.report.entries += 1

    def make(
        self, m: Member, rel: bytes, pfd: int, base: bytes, there: bool, reader: _TarReader, entry: str
    ) -> None:
        perm = m.mode & ~_DROP_BITS
        if m.type == b"5":
            if not there:
                os.mkdir(base, 0o700, dir_fd=pfd)
            self.dirs[rel] = _Dir(perm, m.mtime, named=True)
        elif m.type in (b"0", b"7"):
            fd = os.open(
                base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd
            )
            try:
                left = m.size
                while left:
                    chunk = reader.f.read(min(CHUNK, left))
                    if not chunk:
                        raise TransferError.at(
                            entry, "the archive ends inside this file", side="host", errno=errno.EIO
                        )
                    _write_all(fd, chunk)
                    left -= len(chunk)
                reader.skip(-m.size % BLOCK)
                os.fchmod(fd, perm)
                os.utime(fd, (m.mtime, m.mtime))
            finally:
                os.close(fd)
            self.report.bytes += m.size
        elif m.type == b"2":
            if not m.link:
                raise TransferError.at(entry, "a symbolic link to nothing", side="host", errno=errno.EINVAL)
            os.symlink(m.link, base, dir_fd=pfd)
            os.utime(base, (m.mtime, m.mtime), dir_fd=pfd, follow_symlinks=False)
        elif m.type == b"1":
            target = _clean(m.link)
            if not target:
                raise TransferError.at(
                    entry,
                    f"a hard link to {text(m.link)}, outside the destination: refused",
                    side="host",
                    errno=errno.EXDEV,
                )
            tparent, _, tbase = target.rpartition(b"/")
            try:
                tfd = self.beneath(tparent, entry, create=False)
            except (TransferError, FileNotFoundError):
                tfd = -1
            try:
                if tfd < 0:
                    raise FileNotFoundError
                os.link(tbase, base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                raise TransferError.at(
                    entry,
                    f"a hard link to {text(m.link)}, which the archive does not hold before it: refused",
                    side="host",
                    errno=errno.ENOENT,
                ) from None
            finally:
                if tfd >= 0:
                    os.close(tfd)
        elif m.type in (b"6", b"3", b"4"):
            kind = {b"6": stat.S_IFIFO, b"3": stat.S_IFCHR, b"4": stat.S_IFBLK}[m.type]
            device = os.makedev(m.devmajor, m.devminor) if m.type != b"6" else 0
            try:
                os.mknod(base, kind | (perm & 0o777), device, dir_fd=pfd)
            except (PermissionError, NotImplementedError) as e:
                what = "fifo" if m.type == b"6" else "device node"
                self.report.skipped.append((entry, f"a {what}, which cannot be made here: {e}"))
                self.report.entries -= 1
                return
            os.utime(base, (m.mtime, m.mtime), dir_fd=pfd, follow_symlinks=False)
        else:
            raise TransferError.at(
                entry,
                f"an entry of type {m.type!r}, which is not copied: refused",
                side="host",
                errno=errno.EINVAL,
            )

    # -- into place

    def finish_dirs(self) -> None:
        """Each directory's mode and time, deepest first, in the destination once the tree
        is in place (a directory that is not writable could not be moved into place, nor
        emptied into another): what the archive named takes its mode and time, a parent
        made for a member 0755; a directory that was there keeps its own."""
        base = self.dest_fd
        for rel in sorted(self.dirs, reverse=True):
            d = self.dirs[rel]
            if rel in self.merged and not d.named:
                continue
            try:
                fd = self.beneath(rel, text(rel), create=False, base=base)
            except (TransferError, OSError):
                continue  # replaced in the destination since: not ours to change
            try:
                os.fchmod(fd, d.mode if d.named else 0o755)
                if d.named:
                    os.utime(fd, (d.mtime, d.mtime))
            finally:
                os.close(fd)

    def commit(self) -> None:
        assert self.stage is not None
        if self.dest_fd < 0:
            failed = self.rename_new()
            if failed is None:
                os.close(self.stage)
                self.stage = None
                self.dest_fd = _open_dir(self.name, self.parent_fd)
                self.dirs.setdefault(b"", _Dir(0o755, 0, named=False))
                self.finish_dirs()
                return
            if failed != errno.EEXIST:
                raise TransferError.at(
                    "",
                    f"cannot move the tree into place at {self.dest}: {os.strerror(failed)}",
                    side="host",
                    errno=failed,
                )
            try:  # made while this ran: merged into, as one that was there
                self.dest_fd = os.open(
                    self.name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.parent_fd
                )
            except OSError as e:
                raise TransferError.at(
                    "",
                    f"{self.dest} appeared while this ran, and is not a directory",
                    side="host",
                    errno=e.errno,
                ) from None
        self.dirs.pop(b"", None)  # a destination that was there keeps its own mode
        self.merged.add(b"")
        self.check(self.stage, self.dest_fd, b"")
        self.move(self.stage, self.dest_fd, b"")
        self.finish_dirs()

    def rename_new(self) -> int | None:
        if _RENAMEAT2 is not None:
            err = _RENAMEAT2(self.parent_fd, self.stage_name, self.parent_fd, self.name)
            if err == 0:
                return None
            if err not in (errno.ENOSYS, errno.EINVAL):
                return err
        with contextlib.suppress(FileNotFoundError):
            os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
            return errno.EEXIST
        try:
            os.rename(self.stage_name, self.name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except OSError as e:
            return e.errno
        return None

    def check(self, sfd: int, dfd: int, rel: bytes) -> None:
        """A merge's first pass: a directory against a non-directory refuses it all."""
        for name in sorted(map(os.fsencode, os.listdir(sfd))):
            path = rel + b"/" + name if rel else name
            s = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            try:
                d = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(s.st_mode) and stat.S_ISDIR(d.st_mode):
                s2 = _open_dir(name, sfd)
                try:
                    d2 = _open_dir(name, dfd)
                    try:
                        self.check(s2, d2, path)
                    finally:
                        os.close(d2)
                finally:
                    os.close(s2)
            elif stat.S_ISDIR(s.st_mode):
                link = " (it is a symbolic link, which is not followed)" if stat.S_ISLNK(d.st_mode) else ""
                raise TransferError.at(
                    text(path),
                    f"cannot overwrite the non-directory there with a directory{link}",
                    side="host",
                    errno=errno.ENOTDIR,
                )
            elif stat.S_ISDIR(d.st_mode):
                raise TransferError.at(
                    text(path),
                    "cannot overwrite the directory there with a non-directory",
                    side="host",
                    errno=errno.EISDIR,
                )

    def move(self, sfd: int, dfd: int, rel: bytes) -> None:
        """The second pass: what is not there moves whole, a non-directory replaces one, a
        directory merges into one (taking the archive's mode and time where it named it)."""
        for name in sorted(map(os.fsencode, os.listdir(sfd))):
            path = rel + b"/" + name if rel else name
            try:
                s = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                try:
                    d: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    d = None
                if d is not None and stat.S_ISDIR(s.st_mode) and stat.S_ISDIR(d.st_mode):
                    s2 = _open_dir(name, sfd)
                    try:
                        os.fchmod(s2, 0o700)  # it is emptied into the other: it must be writable
                        d2 = _open_dir(name, dfd)
                        try:
                            self.merged.add(path)
                            self.move(s2, d2, path)
                        finally:
                            os.close(d2)
                    finally:
                        os.close(s2)
                    continue
                if d is not None and (stat.S_ISDIR(s.st_mode) or stat.S_ISDIR(d.st_mode)):
                    raise OSError(
                        errno.EEXIST,
                        "changed in the destination while it was merged: a directory against a non-directory",
                    )
                os.rename(name, name, src_dir_fd=sfd, dst_dir_fd=dfd)
                self.written.append(text(path))
            except TransferError:
                raise
            except OSError as e:
                raise TransferError.at(
                    text(path),
                    f"cannot move it into place: {e.strerror}",
                    side="host",
                    errno=e.errno,
                    written=list(self.written) or None,
                ) from None


def _remove_tree(dir_fd: int, name: bytes) -> None:
    """``name`` and all under it, no link followed (directories made writable to be emptied)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = _open_dir(name, dir_fd)
    try:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o700)
        for child in os.listdir(fd):
            _remove_tree(fd, os.fsencode(child))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _untar_tree(fd: int, dest: Path, report: Report) -> Report:
    """Unpack the tar stream read from ``fd`` into ``dest`` (in a thread)."""
    with os.fdopen(fd, "rb", buffering=CHUNK) as src:
        reader = _TarReader(src, report)
        unpacker = _Unpacker(dest, report)
        try:
            for m in reader.members():
                unpacker.member(m, reader)
            unpacker.commit()
        except TransferError as e:
            if e.written is None and unpacker.written:
                e.written = unpacker.written
            raise
        except OSError as e:
            raise TransferError.at(
                text(reader.last),
                f"{e.strerror}",
                side="host",
                errno=e.errno,
                written=unpacker.written or None,
            ) from None
        finally:
            with contextlib.suppress(OSError):
                unpacker.close()
    return report


async def unpack(chunks: AsyncIterable[bytes], dest: Path) -> Report:
    """A tar stream unpacked into ``dest`` as it arrives: made if it is not there (whole
    or not at all), merged into if it is. What the stream's source said of it (a note
    of the box's) is raised in preference to how the stream then ended."""
    report = Report()
    r, w = os.pipe()
    reader = in_thread(_untar_tree, r, dest, report)
    try:
        async for chunk in chunks:
            try:
                await asyncio.to_thread(_write_all, w, chunk)
            except BrokenPipeError:
                break  # the reader stopped: its error says why
    except BaseException as feeding:
        os.close(w)
        w = -1
        try:
            await reader
        except Exception as ended:  # the reader's other ends give way to how the feeding ended,
            box_said = isinstance(ended, TransferError) and ended.side == "box"
            if box_said and not isinstance(feeding, asyncio.CancelledError):
                raise ended from None  # but the box's own word on why its stream ended
        raise
    finally:
        if w >= 0:
            os.close(w)
        closer = getattr(chunks, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()
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
        os.chmod(tmp, mode & ~_DROP_BITS)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return total
