"""The guest's file system as sandlot describes it, on every transport: what ``stat``
and ``list`` report (``FileInfo``), what a watch reports (``FileEvent``), and where a
watch's events come from (``WatchSource``: the agent's watch channel here, a stream
from a server or a fleet node elsewhere)."""

from __future__ import annotations

import stat as _stat
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Literal, Protocol

from .. import records
from ..errors import ConnectionLost, InvalidArgument, InvalidState
from ..protocol.wire import RawEntry, WatchEvent

if TYPE_CHECKING:
    from ..protocol.connection import AgentConnection
    from ..protocol.watch import WatchStream


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
    # the extended attributes asked for (``stat(..., xattrs=PREFIX)``), by name, their values
    # as text (UTF-8; undecodable bytes replaced); None where none were asked for
    xattrs: dict[str, str] | None = None

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


def entry_info(parent: str | None, e: RawEntry, path: str | None = None) -> FileInfo:
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
        xattrs=None if e.xattrs is None else {k: v.decode("utf-8", "replace") for k, v in e.xattrs.items()},
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
    server's NDJSON or a node's Ray stream for a box elsewhere (``follow.FollowedWatch``)."""

    async def next(self) -> FileEvent | None:
        """The next event, or None once the watch has ended."""
        ...

    async def aclose(self) -> None:
        """Stop watching (at once; idempotent)."""
        ...

    async def settle(self, timeout: float) -> bool:
        """Wait until the events of every change the box made before this call have been
        read from this source (by whoever iterates it); False where it cannot say."""
        ...


class AgentWatch:
    """A watch channel of the box's agent, as a ``WatchSource``."""

    def __init__(self, conn: AgentConnection, stream: WatchStream, box: str = "") -> None:
        self._conn = conn
        self._stream = stream
        self._box = box

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
        if record.kind == WatchEvent.OVERFLOW:  # counted for the metrics of this process
            records.TALLY.add("watch", "overflow", self._box)
        st = self._stream
        return FileEvent(
            _EVENT_TYPES[record.kind],
            st.absolute(record.path),
            record.is_dir,
            st.absolute(record.old_path) if record.old_path is not None else None,
        )

    async def aclose(self) -> None:
        self._stream.close()

    async def settle(self, timeout: float) -> bool:
        """A barrier through the agent's watch channel (``WatchStream.barrier``)."""
        return await self._stream.barrier(timeout)


def check_prefix(prefix: object) -> str | None:
    """The start of extended attributes' names, as ``stat``, ``list`` and ``set_xattrs`` take it."""
    if prefix is None:
        return None
    if not isinstance(prefix, str) or not prefix or "\0" in prefix or len(prefix.encode()) > 255:
        raise InvalidArgument(f"an xattrs prefix is a start of names such as 'user.', not {prefix!r}")
    return prefix


XATTR_NAME_MAX = 255  # bytes of an extended attribute's name (Linux's limit)
XATTR_SIZE_MAX = 65536  # bytes of its value


def check_xattrs(values: object, prefix: object) -> tuple[str, dict[str, str]]:
    """What ``set_xattrs`` takes: a prefix, and text values by names that are the prefix and
    more (no NUL), within Linux's limits; the prefix and the values as a dict."""
    start = check_prefix(prefix)
    if not start:
        raise InvalidArgument("set_xattrs needs the prefix of the names it replaces")
    if not isinstance(values, Mapping) or not all(isinstance(v, str) for v in values.values()):
        raise InvalidArgument("set_xattrs takes a mapping of names to text values")
    for name, value in values.items():
        if not isinstance(name, str) or not name.startswith(start) or name == start or "\0" in name:
            raise InvalidArgument(f"an extended attribute's name is {start!r} and more, not {name!r}")
        if len(name.encode()) > XATTR_NAME_MAX or len(value.encode()) > XATTR_SIZE_MAX:
            raise InvalidArgument(
                f"extended attribute {name[:64]!r}: a name is at most {XATTR_NAME_MAX} bytes, "
                f"a value at most {XATTR_SIZE_MAX}"
            )
    return start, dict(values)


def check_mode(mode: int | None) -> int | None:
    if mode is not None and not (isinstance(mode, int) and 0 <= mode <= 0o7777):
        raise InvalidArgument(f"mode must be an int in 0..0o7777, not {mode!r}")
    return mode
