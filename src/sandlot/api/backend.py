"""The seam between the box as users see it and the transports that reach it.

``AsyncBox``, ``AsyncFiles`` and ``AsyncSnapshot`` (``api/box.py``, ``api/files.py``)
are written once, over a ``Backend``: the local one runs the core in this process
(``api/local.py``), the HTTP one asks a ``sandlot serve`` (``api/http.py``), the
Ray one asks the node actor of a fleet node (``fleet/backend.py``). A backend
offers the operations of ``api/contract.py``'s table through one method,
``call``, and the streaming primitives beside it (a process followed as it runs,
a file streamed each way, a watch, an archive, saved state to and from a file).
Where a transport cannot do something it raises ``Unsupported`` naming itself.

Nothing here imports pydantic or an HTTP library: a command on a local box loads
the core and this interface only (``tests/unit/test_cli_lean.py``).
"""

from __future__ import annotations

import base64
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..core.validate import argv as check_argv
from ..errors import InvalidArgument, InvalidState, NotFound, Unsupported
from .process import AsyncProcess, ProcessHandle

if TYPE_CHECKING:
    from ..core.events import Event
    from .code import Callbacks, Execution
    from .fs import WatchSource
    from .process import ExecResult


@dataclass(frozen=True, slots=True)
class Command:
    """A command to run in a box, as every backend takes it: its argv (checked when made),
    its environment, directory and user (a box's own defaults where None), a terminal of
    ``rows`` x ``cols`` with ``tty``, and whether it reads stdin."""

    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    tty: bool = False
    rows: int = 24
    cols: int = 80
    stdin: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", check_argv(self.argv))
        if self.env is not None:
            object.__setattr__(self, "env", dict(self.env))
        if self.tty and not (0 < self.rows <= 10000 and 0 < self.cols <= 10000):
            raise InvalidArgument("rows and cols must be in 1..10000")

    def fields(self) -> dict[str, Any]:
        """As JSON (``contract.SpawnIn``'s fields), the unset ones left out."""
        return {k: v for k, v in asdict(self).items() if v is not None} | {"argv": list(self.argv)}

    def exec_fields(self, stdin: bytes | None, timeout: float | None) -> dict[str, Any]:
        """As an exec's JSON (``contract.ExecIn``'s fields); stdin in base64, so that its
        size is known whatever it holds, and the output asked in base64 alone (the text
        is made from its bytes on this side)."""
        body = {k: v for k, v in self.fields().items() if k in ("argv", "env", "cwd", "user")}
        body["output"] = "b64"
        if timeout is not None:
            body["timeout"] = timeout
        if stdin is not None:
            body["stdin_b64"] = base64.b64encode(stdin).decode()
        return body


@dataclass(frozen=True, slots=True)
class Write:
    """How a file is written: its mode and owner (an existing file's kept where None),
    appended to or replaced atomically, its parents made, refused if it exists."""

    mode: int | None = None
    user: str | None = None
    append: bool = False
    parents: bool = True
    exclusive: bool = False

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, slots=True)
class Cell:
    """A cell of code to run, as every backend takes it: its code, its language, the code
    context it runs in (None: the language's default one), how long it may take, and the
    environment variables set for it alone."""

    code: str
    language: str = "python"
    context: str | None = None
    timeout: float | None = None
    env: Mapping[str, str] | None = None

    def fields(self) -> dict[str, Any]:
        """As JSON (``contract.RunCodeIn``'s fields; ``env`` only where given, so that a
        server of an earlier version, which refuses the field, still takes every other cell)."""
        out = asdict(self)
        if self.env is None:
            del out["env"]
        return out


class BoxRef(ABC):
    """What a backend knows of one box, held by its ``AsyncBox``: a box described and not
    made yet, or one that exists (its description as last read)."""

    backend: Backend

    @property
    @abstractmethod
    def id(self) -> str: ...

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def state(self) -> str:
        """As last read: "new" before it was made, "removed" once it is gone."""

    @property
    @abstractmethod
    def info(self) -> dict[str, Any]:
        """The box's description (``contract.BoxOut``'s fields) as last read; InvalidState
        before it was made."""

    @property
    def made(self) -> bool:
        return self.state != "new"

    def need_made(self) -> None:
        if not self.made:
            raise InvalidState(f"box {self.name or '(new)'} was not created; call start()", box=self.name,
                               state="new")  # fmt: skip

    # what only some transports know: None elsewhere
    @property
    def image(self) -> Any:
        """The image the box was made from: its reference (locally, the ``Image`` given)."""
        return self.info.get("image") if self.made else None

    @property
    def hostname(self) -> str | None:
        return self.info.get("hostname") if self.made else None

    @property
    def accel(self) -> str | None:
        return self.info.get("accel") if self.made else None

    def image_config(self) -> dict[str, Any] | None:
        """The image's Entrypoint and Cmd, where this side knows them."""
        return None

    @property
    def boot_seconds(self) -> float | None:
        return None

    @property
    def last_pause(self) -> float | None:
        return None


class DescribedBoxRef(BoxRef):
    """A box of a backend elsewhere: the description it last answered (``rec``), or what
    making it will ask for (``wanted``: its image, name and options)."""

    def __init__(self, backend: Backend, wanted: dict[str, Any] | None, rec: dict[str, Any] | None) -> None:
        self.backend = backend
        self.wanted = wanted
        self.rec = rec
        self.removed = False

    @property
    def id(self) -> str:
        self.need_made()
        assert self.rec is not None
        return str(self.rec["id"])

    @property
    def described(self) -> dict[str, Any]:
        return self.rec if self.rec is not None else self.wanted or {}

    @property
    def name(self) -> str:
        return str(self.described.get("name") or "")

    @property
    def state(self) -> str:
        return "removed" if self.removed else "new" if self.rec is None else str(self.rec.get("state"))

    @property
    def info(self) -> dict[str, Any]:
        self.need_made()
        assert self.rec is not None
        return dict(self.rec)

    @property
    def image(self) -> Any:
        return self.described.get("image")

    def update(self, rec: Mapping[str, Any]) -> None:
        """Its description as the other side answered it."""
        self.rec = {**(self.rec or {}), **rec}


class SnapshotRef(ABC):
    """A snapshot or template as a backend found it."""

    backend: Backend

    @property
    @abstractmethod
    def info(self) -> dict[str, Any]:
        """``contract.SnapshotOut``'s fields."""

    @property
    def id(self) -> str:
        return str(self.info["id"])


class Backend(ABC):
    """The operations of boxes reached one way. ``transport`` names the way in errors."""

    transport: ClassVar[str]
    # stdin up to this size travels with an exec's request; more is streamed to a process
    inline_stdin: ClassVar[int] = 1 << 62

    def as_step(
        self, ref: BoxRef, kind: str, what: dict[str, Any]
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """The box's calls inside the block as one recorded step (``AsyncBox.as_step``).
        A transport whose every request is a step of its own groups nothing."""
        return contextlib.nullcontext()

    def unsupported(self, what: str, box: str | None = None, hint: str = "") -> Unsupported:
        return Unsupported(f"{what} is not offered over the {self.transport} transport" + (f": {hint}" if hint
                           else ""), transport=self.transport, box=box)  # fmt: skip

    # -- boxes ------------------------------------------------------------------------------

    @abstractmethod
    def describe(self, image: Any, options: Mapping[str, Any], *, keep: bool) -> BoxRef:
        """A box to make (validated now, made by ``create``)."""

    @abstractmethod
    async def create(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> None:
        """Make a described box, and boot it with ``start``. ``ephemeral``: it is a
        ``with`` block's, removed if the block's process dies (where the transport
        knows of such a thing) and by the block's end; a failed start removes it."""

    async def release(self, ref: BoxRef) -> None:
        """A ``with`` block that keeps its box ended: it is no longer the block's."""
        return None

    @abstractmethod
    async def find(self, key: str) -> BoxRef:
        """The box with this id, name or id prefix (BoxNotFound if none)."""

    @abstractmethod
    async def boxes(self, *, state: str | None, labels: Mapping[str, str] | None) -> list[BoxRef]:
        """The boxes, oldest first."""

    @abstractmethod
    async def call(self, scope: str, name: str, target: Any, args: dict[str, Any]) -> Any:
        """Run operation ``scope.name`` (``contract.OPERATIONS``) on ``target`` (a
        ``BoxRef`` for the box and files scopes, a ``SnapshotRef`` for the snapshot one)
        with ``args`` (the fields of the operation's model). A box's description in the
        answer updates ``target``; boxes and snapshots come back as refs."""

    # -- commands ---------------------------------------------------------------------------

    @abstractmethod
    async def exec(self, ref: BoxRef, cmd: Command, stdin: bytes | None, timeout: float | None) -> ExecResult:
        """A command run to completion, its stdin (if any) all given."""

    @abstractmethod
    async def spawn(self, ref: BoxRef, cmd: Command, keep: str | None = None) -> AsyncProcess:
        """A command started, its output followed as it comes."""

    @abstractmethod
    async def run_code(self, ref: BoxRef, cell: Cell, callbacks: Callbacks) -> Execution:
        """A cell run in a code context of the box, its output and results passed to
        ``callbacks`` as they come."""

    async def attach(self, ref: BoxRef, process_id: str, offsets: tuple[int, int]) -> AsyncProcess:
        """A process the host holds for the box, followed from these offsets of its output."""
        raise self.unsupported("attach()", ref.name, "a local process is followed by its AsyncProcess")

    async def taken_over(self, ref: BoxRef) -> list[AsyncProcess]:
        """The processes a dead process of this host kept (``spawn(keep=...)``)."""
        raise self.unsupported("taken_over()", ref.name, "the host holds the processes: processes() and "
                               "attach() follow them again")  # fmt: skip

    @abstractmethod
    def follow_logs(self, ref: BoxRef, lines: int | None) -> AsyncIterator[bytes]:
        """The console of the box's last boot (its last ``lines``), then what the guest
        writes to it as it comes, until the box stops running."""

    # -- files ------------------------------------------------------------------------------

    @abstractmethod
    def read(self, ref: BoxRef, path: str, offset: int, length: int | None) -> AsyncIterator[bytes]:
        """A guest file's bytes as they come."""

    @abstractmethod
    async def write(self, ref: BoxRef, path: str, data: bytes | AsyncIterable[bytes], how: Write) -> int:
        """A guest file written (atomically unless ``how.append``); the bytes written."""

    @abstractmethod
    def get_archive(self, ref: BoxRef, path: str, *, follow_symlinks: bool = False) -> AsyncIterator[bytes]:
        """A guest directory as a tar stream, links kept as links (``follow_symlinks``:
        those to what is inside the tree carried as what they point to); one that fails
        ends with a note naming the entry, and raises (``tarstream``, "Archives")."""

    @abstractmethod
    async def put_archive(
        self, ref: BoxRef, path: str, tar: AsyncIterable[bytes], *, user: str | None
    ) -> dict[str, Any]:
        """A tar stream unpacked into a guest directory, whole or not at all (made, or
        merged into); its report: ``{"entries", "bytes", "skipped": [{"entry", "reason"}]}``."""

    @abstractmethod
    async def watch(self, ref: BoxRef, path: str, recursive: bool) -> WatchSource:
        """A watch of a guest path, begun."""

    # -- snapshots --------------------------------------------------------------------------

    @abstractmethod
    async def find_snapshot(self, key: str) -> SnapshotRef: ...

    @abstractmethod
    async def snapshot_list(self, *, box: str | None, kind: str | None) -> list[SnapshotRef]: ...

    @abstractmethod
    async def export(self, snap: SnapshotRef, path: Path, since: SnapshotRef | None = None) -> Path:
        """The snapshot written to ``path`` (complete, or not there at all); ``since``: only
        what changed after that snapshot of the same box (docs/storage.md)."""

    @abstractmethod
    async def import_snapshot(
        self, path: Path, *, name: str | None, start: bool, options: Mapping[str, Any]
    ) -> BoxRef | SnapshotRef:
        """An exported snapshot added; with ``start``, the box started from it."""

    # -- events -----------------------------------------------------------------------------

    def events(
        self, *, box: str | None, since: float | None, after: int | None, follow: bool
    ) -> AsyncIterator[Event]:
        """What happened to the boxes (``core.events``), in order: after event id
        ``after`` and from Unix time ``since``, about the box ``box`` (id or name) or
        every box; with ``follow``, each new event as it comes, until the caller stops."""
        raise self.unsupported("events")

    # -- named volumes (``core.volumes``) ----------------------------------------------------
    # each answers a volume as ``VolumeInfo.to_json`` writes it

    async def volume_create(
        self, name: str, size_gb: float | None, labels: Mapping[str, str] | None, shared: bool = False
    ) -> dict[str, Any]:
        raise self.unsupported("named volumes")

    async def volume_list(self) -> list[dict[str, Any]]:
        raise self.unsupported("named volumes")

    async def volume_get(self, key: str) -> dict[str, Any]:
        raise self.unsupported("named volumes")

    async def volume_remove(self, key: str) -> None:
        raise self.unsupported("named volumes")

    # -- the backend ------------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """What the other end says of itself."""
        return {"transport": self.transport}

    async def aclose(self) -> None:
        """Close what the backend holds open (boxes run on)."""
        return None


class RemoteBackend(Backend):
    """A backend elsewhere (a server, a fleet's nodes): its boxes are ``DescribedBoxRef``s,
    made by the far side, and its processes are held there and followed from here."""

    @abstractmethod
    async def make(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> dict[str, Any]:
        """Make the described box on the far side (booted with ``start``): its description.
        ``ephemeral``: a ``with`` block's, to go when this side goes (a server's lease)."""

    @abstractmethod
    async def follow(self, ref: BoxRef, process_id: str, pid: int, tty: bool,
                     offsets: tuple[int, int]) -> ProcessHandle:  # fmt: skip
        """A process held on the far side, followed from ``offsets`` of its output."""

    async def create(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> None:
        # made first, then started: a box that fails to start is known here and can go
        box = described(ref)
        if box.wanted is not None:
            box.rec = await self.make(box, start=start and not ephemeral, ephemeral=ephemeral)
            box.wanted = None
            if not (start and ephemeral):
                return
        elif not start:
            return
        try:
            await self.call("box", "start", box, {})
        except BaseException:
            if ephemeral:
                with contextlib.suppress(Exception):
                    await self.call("box", "remove", box, {"force": True})
            raise

    async def attach(self, ref: BoxRef, process_id: str, offsets: tuple[int, int]) -> AsyncProcess:
        held = next((p for p in await self.call("box", "processes", ref, {}) if p.get("id") == process_id),
                    None)  # fmt: skip
        if held is None:
            raise NotFound(f"box {ref.name} has no process {process_id} ({self.transport})", box=ref.name)
        proc = await self.follow(ref, process_id, int(held.get("pid") or 0), bool(held.get("tty")), offsets)
        return AsyncProcess(tuple(str(a) for a in held.get("argv", ())), proc)

    def refuse_start_options(self, options: Mapping[str, Any]) -> None:
        """An import here starts its box as the snapshot's: no options for it."""
        if options:
            raise self.unsupported(f"options for the box an import starts ({', '.join(options)})",
                                   hint="start it with snapshot.start(...)")  # fmt: skip


Ref = TypeVar("Ref", bound="BoxRef | SnapshotRef")


def narrowed(ref: BoxRef | SnapshotRef, kind: type[Ref], what: str) -> Ref:
    """``ref`` as the ref class of one backend (InvalidArgument, naming ``what``, if it is
    another backend's: a box of one transport handed to another)."""
    if not isinstance(ref, kind):
        raise InvalidArgument(f"not {what}: {ref!r}")
    return ref


def described(ref: BoxRef) -> DescribedBoxRef:
    return narrowed(ref, DescribedBoxRef, "a box of a backend elsewhere")


def answered(kind: str, value: Any, target: Any, box: Callable[[Any], BoxRef],
             snapshot: Callable[[Any], SnapshotRef]) -> Any:  # fmt: skip
    """An operation's decoded answer as the facade takes it from a backend elsewhere: a box's
    description updates ``target`` (None is returned), boxes and snapshots become refs."""
    if kind == "box":
        target.update(value)
        return None
    if kind == "boxes":
        return [box(rec) for rec in value]
    if kind == "snapshot":
        return snapshot(value)
    if kind == "snapshots":
        return [snapshot(rec) for rec in value]
    return value


def snapshot_key(snap: Any) -> str:
    """A snapshot's id from a snapshot object, or an id or name as given."""
    if isinstance(snap, str):
        return snap
    key = getattr(snap, "id", None)
    if isinstance(key, str):
        return key
    raise InvalidArgument(f"a snapshot, or its id or name, is needed, not {type(snap).__name__}")
