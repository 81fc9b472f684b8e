"""Wire format of the agent protocol: frame headers, TLV payloads, stream offsets.

Mirrors ``guest/agent/proto.h``; ``tests/unit/test_wire.py`` checks the two agree.
See docs/protocol.md for the specification.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum, IntFlag

from ..errors import ProtocolError

PROTOCOL_VERSION = 1
MAGIC = 0x4C53
HEADER = struct.Struct("<HBBII")  # magic, type, flags, channel, length
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 1 << 20
DATA_PREFIX = struct.Struct("<IIQ")  # stream, reserved, offset
DATA_PREFIX_SIZE = DATA_PREFIX.size
DATA_CHUNK = 64 * 1024
WINDOW = 1 << 20
MAX_CHANNELS = 1024
FLAG_MORE = 0x01

STREAM_STDIN = 0
STREAM_STDOUT = 1
STREAM_STDERR = 2


class T(IntEnum):
    """Frame types."""

    HELLO = 0x01
    HELLO_ACK = 0x02
    ERROR = 0x03
    PING = 0x04
    PONG = 0x05
    CLOSE = 0x06
    RESUME = 0x07
    EXEC = 0x10
    EXEC_STARTED = 0x11
    EXIT = 0x12
    SIGNAL = 0x13
    RESIZE = 0x14
    ARCHIVE = 0x15  # a tree as a tar stream, or one unpacked; answered as an EXEC is
    DATA = 0x20
    EOF = 0x21
    ACK = 0x22
    FILE_READ = 0x30
    FILE_INFO = 0x31
    FILE_WRITE = 0x32
    FILE_READY = 0x33
    FILE_DONE = 0x34
    FS = 0x40
    FS_RESULT = 0x41
    WATCH = 0x42
    WATCH_STARTED = 0x43
    CONTROL = 0x50
    CONTROL_OK = 0x51


class Tag(IntEnum):
    """TLV field tags."""

    ARG = 1
    ENV = 2
    CWD = 3
    USER = 4
    FLAGS = 5
    ROWS = 6
    COLS = 7
    PID = 8
    EXIT_CODE = 9
    SIGNAL = 10
    WINDOW = 11
    PATH = 12
    PATH2 = 13
    MODE = 14
    SIZE = 15
    OFFSET = 16
    LENGTH = 17
    OP = 18
    ENTRY = 19
    ERRNO = 20
    MESSAGE = 21
    VERSION_MIN = 22
    VERSION_MAX = 23
    VERSION = 24
    SESSION = 25
    ENTROPY = 26
    TIME_NS = 27
    HOSTNAME = 28
    AGENT_VERSION = 29
    BOOT_ID = 30
    RESUMED = 31
    CHANNEL = 32
    MAX_PAYLOAD = 33
    STREAM_OFFSET = 34
    FRAME_TYPE = 35
    CORE_DUMPED = 36
    TIMEOUT_MS = 37
    UID = 38
    GID = 39
    MACHINE_ID = 40
    COUNT = 41
    IDLE_MS = 42
    PIDS_MAX = 43
    OOM_KILLED = 44
    MEM_TOTAL_KB = 45
    MEM_AVAILABLE_KB = 46
    NET_RX_BYTES = 47
    NET_TX_BYTES = 48
    DISK_READ_BYTES = 49
    DISK_WRITTEN_BYTES = 50
    EXECS = 51
    EXEC_START_US = 52
    TREE_ENTRY = 53
    TARGET = 54
    RDEV = 55
    ASLR = 56
    RATE = 57
    BURST = 58
    PREFIX = 59  # FS: the extended attributes meant, by the start of their names
    XATTR = 60  # FS SETXATTRS (repeated): u16 name length, the name, the value


class ExecFlag:
    TTY = 0x1
    STDIN = 0x2
    CLEAR_ENV = 0x4


class WriteFlag:
    APPEND = 0x1
    PARENTS = 0x2
    EXCLUSIVE = 0x4
    SYNC = 0x8


class FsFlag:
    PARENTS = 0x1
    RECURSIVE = 0x2
    NOFOLLOW = 0x4
    MISSING_OK = 0x8
    SELF = 0x10  # TREE: the path's own entry only
    XATTRS = 0x20  # STAT, LIST: each entry's extended attributes named PREFIX...


class ArchiveOp(IntEnum):
    """Which way an ARCHIVE goes (docs/protocol.md, "Archives")."""

    READ = 1  # the tree at PATH as a tar stream on stdout; records on stderr
    WRITE = 2  # a tar stream on stdin unpacked into PATH; records on stdout


class ArchiveFlag:
    FOLLOW = 0x1  # READ: a link to a file or directory inside the tree goes as what it points to


class ArchiveRecord(IntEnum):
    """The kind of a record an archive's child reports."""

    SKIPPED = 1  # an entry left out, and why
    FAILED = 2  # the last record of a failure: the entry, errno, message
    DONE = 3  # the last record of a success: COUNT entries, SIZE bytes of files
    WRITTEN = 4  # a merge that failed part way had moved this entry into place


class WatchFlag:
    RECURSIVE = 0x1


class WatchEvent(IntEnum):
    """The kind of a watch record (docs/protocol.md, "Watch")."""

    CREATED = 1
    MODIFIED = 2
    DELETED = 3
    MOVED = 4
    OVERFLOW = 5
    BARRIER = 6  # the host's barrier, its token as the path (WatchStream.barrier)


class SignalFlag:
    GROUP = 0x1


class FsOp(IntEnum):
    STAT = 1
    LIST = 2
    MKDIR = 3
    REMOVE = 4
    RENAME = 5
    CHMOD = 6
    CHOWN = 7
    TREE = 8
    SYMLINK = 9
    MKNOD = 10
    SETXATTRS = 11


class ControlOp(IntEnum):
    SHUTDOWN = 1
    SYNC = 2
    SET_HOSTNAME = 3
    SET_TIME = 4
    ADD_ENTROPY = 5
    MOUNT = 6
    STATUS = 7
    FREEZE = 8  # every command stopped for a save (TIMEOUT_MS: how long at most, in guest time)
    THAW = 9  # the shares a DETACH took down are mounted again first
    DETACH = 10  # every 9p share unmounted for a save (only while frozen); an error names who holds one


class MountFlag(IntFlag):
    """FLAGS of a MOUNT: a read-only mount; PATH2 names a drive by serial (ext4), not a 9p tag."""

    READONLY = 0x1
    BLOCK = 0x2


@dataclass(frozen=True, slots=True)
class Frame:
    type: int
    channel: int
    payload: bytes = b""
    flags: int = 0


def encode_frame(frame_type: int, channel: int, payload: bytes = b"", flags: int = 0) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, frame_type, flags, channel, len(payload)) + payload


def session_start_headers() -> tuple[bytes, ...]:
    """The first 8 bytes of each frame that can open an agent's answer on a new
    connection: HELLO_ACK, or the ERROR refusing a HELLO (both on channel 0)."""
    return tuple(HEADER.pack(MAGIC, t, 0, 0, 0)[:8] for t in (T.HELLO_ACK, T.ERROR))


class FrameDecoder:
    """Incremental decoder: feed bytes, iterate whole frames. The agent is trusted
    less than the host's own memory: any framing error is a ProtocolError.

    With ``sync``, bytes before the first occurrence of one of those header prefixes
    are skipped (and counted in ``skipped``): a VM saved while its agent was half way
    through a frame still holds the rest in its virtio-serial queue, and a restored or
    forked VM hands it to the next host connection ahead of the answer to HELLO."""

    def __init__(self, sync: tuple[bytes, ...] = ()) -> None:
        self._buf = bytearray()
        self._sync = sync
        self.skipped = 0

    def _synchronise(self) -> bool:
        hits = [i for i in (self._buf.find(p) for p in self._sync) if i >= 0]
        if hits:
            start = min(hits)
            self._sync = ()
        else:  # keep a tail that may be the start of a header
            start = max(0, len(self._buf) - max(len(p) for p in self._sync) + 1)
        self.skipped += start
        del self._buf[:start]
        return not self._sync

    def feed(self, data: bytes) -> Iterator[Frame]:
        self._buf += data
        if self._sync and not self._synchronise():
            return
        view = self._buf
        pos = 0
        try:
            while len(view) - pos >= HEADER_SIZE:
                magic, ftype, flags, channel, length = HEADER.unpack_from(view, pos)
                if magic != MAGIC:
                    raise ProtocolError(f"bad frame magic 0x{magic:04x} from the agent")
                if length > MAX_PAYLOAD:
                    raise ProtocolError(f"agent frame of {length} bytes exceeds {MAX_PAYLOAD}")
                end = pos + HEADER_SIZE + length
                if len(view) < end:
                    break
                yield Frame(ftype, channel, bytes(view[pos + HEADER_SIZE : end]), flags)
                pos = end
        finally:
            del self._buf[:pos]


# ---- TLV ------------------------------------------------------------------------------

_TLV = struct.Struct("<HI")


def tlv(tag: int, value: bytes | str | int, *, width: int = 4) -> bytes:
    if isinstance(value, str):  # a guest's undecodable name, read with surrogateescape, goes back as it was
        value = value.encode("utf-8", "surrogateescape")
    elif isinstance(value, int):
        value = value.to_bytes(width, "little", signed=False)
    return _TLV.pack(tag, len(value)) + value


def tlv_u64(tag: int, value: int) -> bytes:
    return tlv(tag, value, width=8)


class Fields:
    """Decoded TLV payload: repeated tags keep their order."""

    __slots__ = ("_items",)

    def __init__(self, payload: bytes) -> None:
        items: list[tuple[int, bytes]] = []
        pos = 0
        n = len(payload)
        while pos < n:
            if n - pos < _TLV.size:
                raise ProtocolError("truncated TLV header")
            tag, length = _TLV.unpack_from(payload, pos)
            pos += _TLV.size
            if length > n - pos:
                raise ProtocolError(f"TLV field {tag} overruns its payload")
            items.append((tag, payload[pos : pos + length]))
            pos += length
        self._items = items

    def raw(self, tag: int) -> bytes | None:
        for t, v in self._items:
            if t == tag:
                return v
        return None

    def all(self, tag: int) -> list[bytes]:
        return [v for t, v in self._items if t == tag]

    def u32(self, tag: int, default: int | None = None) -> int | None:
        v = self.raw(tag)
        if v is None:
            return default
        if len(v) != 4:
            raise ProtocolError(f"field {tag} is {len(v)} bytes, expected 4")
        return int.from_bytes(v, "little")

    def u64(self, tag: int, default: int | None = None) -> int | None:
        v = self.raw(tag)
        if v is None:
            return default
        if len(v) != 8:
            raise ProtocolError(f"field {tag} is {len(v)} bytes, expected 8")
        return int.from_bytes(v, "little")

    def str(self, tag: int, default: str | None = None) -> str | None:
        v = self.raw(tag)
        return default if v is None else v.decode("utf-8", "replace")


def data_payload(stream: int, offset: int, data: bytes = b"") -> bytes:
    return DATA_PREFIX.pack(stream, 0, offset) + data


def parse_data(payload: bytes) -> tuple[int, int, memoryview]:
    if len(payload) < DATA_PREFIX_SIZE:
        raise ProtocolError("DATA/EOF/ACK frame shorter than its prefix")
    stream, _, offset = DATA_PREFIX.unpack_from(payload)
    return stream, offset, memoryview(payload)[DATA_PREFIX_SIZE:]


# ---- directory entries -----------------------------------------------------------------

_ENTRY = struct.Struct("<IIIIQqHH")


@dataclass(frozen=True, slots=True)
class RawEntry:
    name: str
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    mtime_ns: int
    link_target: str | None
    xattrs: dict[str, bytes] | None = None  # those asked for (FsFlag.XATTRS), by name


_XATTR_HEAD = struct.Struct("<HI")


def parse_entry(raw: bytes) -> RawEntry:
    if len(raw) < _ENTRY.size:
        raise ProtocolError("truncated directory entry")
    mode, uid, gid, nlink, size, mtime_ns, name_len, target_len = _ENTRY.unpack_from(raw)
    end = _ENTRY.size + name_len + target_len
    xattrs = _xattrs(raw, end) if len(raw) > end else None
    name, target = _name_and_target(raw[:end], _ENTRY.size, name_len, target_len, "directory entry")
    return RawEntry(name, mode, uid, gid, nlink, size, mtime_ns, target, xattrs)


def _xattrs(raw: bytes, at: int) -> dict[str, bytes]:
    """The extended attributes after an entry: u16 count, then each one's u16 name length,
    u32 value length, name and value."""
    try:
        (count,) = struct.unpack_from("<H", raw, at)
        at += 2
        found: dict[str, bytes] = {}
        for _ in range(count):
            name_len, value_len = _XATTR_HEAD.unpack_from(raw, at)
            at += _XATTR_HEAD.size
            if at + name_len + value_len > len(raw):
                raise ProtocolError("an entry's extended attributes run past its end")
            name = raw[at : at + name_len].decode("utf-8", "surrogateescape")
            found[name] = bytes(raw[at + name_len : at + name_len + value_len])
            at += name_len + value_len
    except struct.error:
        raise ProtocolError("an entry's extended attributes are truncated") from None
    if at != len(raw):
        raise ProtocolError("an entry's extended attributes do not add up")
    return found


def _name_and_target(
    raw: bytes, fixed: int, name_len: int, target_len: int, what: str
) -> tuple[str, str | None]:
    """The name (or path) and link target after an entry's ``fixed`` bytes, as the guest
    wrote them (undecodable bytes kept by surrogateescape)."""
    if fixed + name_len + target_len != len(raw):
        raise ProtocolError(f"{what} lengths do not add up")
    name = raw[fixed : fixed + name_len].decode("utf-8", "surrogateescape")
    target = raw[fixed + name_len :].decode("utf-8", "surrogateescape") if target_len else None
    return name, target


_TREE_ENTRY = struct.Struct("<IIIIQqqQQHH")


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """One path of a file tree's manifest (FS TREE), relative to the tree's root ("" for
    the root itself)."""

    path: str
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    rdev: int
    link_target: str | None


def parse_tree_entry(raw: bytes) -> TreeEntry:
    if len(raw) < _TREE_ENTRY.size:
        raise ProtocolError("truncated file tree entry")
    mode, uid, gid, nlink, size, mtime_ns, ctime_ns, ino, rdev, name_len, target_len = (
        _TREE_ENTRY.unpack_from(raw)
    )
    path, target = _name_and_target(raw, _TREE_ENTRY.size, name_len, target_len, "file tree entry")
    if "\x00" in path or (path and any(c in ("", ".", "..") for c in path.split("/"))):
        raise ProtocolError(f"file tree entry with a bad path {path!r}")
    return TreeEntry(path, mode, uid, gid, nlink, size, mtime_ns, ctime_ns, ino, rdev, target)


# ---- watch records -----------------------------------------------------------------------

WATCH_RECORD = struct.Struct("<BBHH")  # kind, flags, path length, old path length
WATCH_IS_DIR = 0x1


@dataclass(frozen=True, slots=True)
class RawWatchRecord:
    kind: WatchEvent
    is_dir: bool
    path: str  # relative to the watch's base directory; "" is the base itself
    old_path: str | None  # a move's source, relative too


def parse_watch_records(buf: bytearray) -> list[RawWatchRecord]:
    """The whole records at the start of ``buf``, taken out of it; a record cut by
    the end of a DATA frame stays for the next one."""
    out: list[RawWatchRecord] = []
    pos = 0
    n = len(buf)
    while n - pos >= WATCH_RECORD.size:
        kind, flags, path_len, old_len = WATCH_RECORD.unpack_from(buf, pos)
        end = pos + WATCH_RECORD.size + path_len + old_len
        if end > n:
            break
        try:
            event = WatchEvent(kind)
        except ValueError:
            raise ProtocolError(f"unknown watch event kind {kind}") from None
        start = pos + WATCH_RECORD.size
        path = bytes(buf[start : start + path_len]).decode("utf-8", "surrogateescape")
        old = bytes(buf[start + path_len : end]).decode("utf-8", "surrogateescape") if old_len else None
        out.append(RawWatchRecord(event, bool(flags & WATCH_IS_DIR), path, old))
        pos = end
    del buf[:pos]
    return out
