"""One exception tree for everything sandlot raises.

Catch ``SandlotError`` for all of them, or a branch for what you care about::

    SandlotError                               .code .box .state .status .to_dict()
    ├── InvalidArgument (also ValueError)      bad input to a public call; nothing was changed
    │   └── Unsupported                        the box's transport cannot do this; has .transport
    ├── HostSetupError                         QEMU, kernel or agent missing on the host
    ├── ImageError                             a root filesystem or image is malformed or unsafe
    ├── NotFound (also LookupError)
    │   ├── BoxNotFound                        no box by that id or name
    │   ├── SnapshotNotFound                   no snapshot or template by that id or name
    │   ├── StepNotFound                       no such step in a box's timeline
    │   ├── CodeContextNotFound                no code context by that id in the box
    │   ├── VolumeNotFound                     no named volume by that name or id
    │   └── NodeNotFound                       no fleet node by that id (``sandlot.fleet``)
    ├── InvalidState                           not possible in the box's state; has .allowed
    │   ├── BoxBusy                            another process holds the box too long
    │   ├── BoxCrashed                         the VM died; has .console_tail
    │   ├── SnapshotInUse                      boxes started from it still exist
    │   └── VolumeInUse                        boxes mount it (remove), or one writes it (copy)
    ├── BootError                              the VM did not come up; has .console_tail
    │   └── BootTimeout (also TimeoutError)
    ├── SavedStateError                        saving or loading a running state failed
    │   ├── IncompatibleSnapshot               made by an engine or host this one cannot load
    │   └── CorruptSnapshot                    a snapshot or archive is damaged or malformed
    ├── ProtocolError                          the agent sent something malformed
    │   └── ConnectionLost                     the agent channel broke mid-operation
    ├── AgentTimeout (also TimeoutError)       the agent did not answer in time
    ├── ExecTimeout (also TimeoutError)        a command ran past its timeout; was killed
    ├── CodeTimeout (also TimeoutError)        a cell ran past its timeout; was interrupted
    ├── InterpreterError                       a code context could not start (no python3, no kernel)
    ├── CommandFailed                          exec(check=True) saw a nonzero exit
    ├── Unauthorized                           a server request without a valid API key
    ├── Forbidden                              the key may not do this (admin only)
    ├── QuotaExceeded                          over a key's quota; has .limit, .value
    ├── NoCapacity                             no fleet node has room for the box (in time)
    ├── RequestError                           a server refused a request as malformed
    ├── TransferError                          a tree copied in or out failed at an entry; has .entry
    ├── PortUnreachable                        nothing answers on the box's port (a preview URL)
    └── GuestError                             the guest refused an operation
        └── GuestOSError (also OSError)        with .errno, and per-errno subclasses:
            GuestFileNotFoundError, GuestFileExistsError, GuestIsADirectoryError,
            GuestNotADirectoryError, GuestPermissionError, GuestDirectoryNotEmpty,
            GuestConnectionRefusedError (nothing listens on the port: ``box.connect``)

Every error carries a stable ``code`` (a string that never changes between
releases), the ``box`` it concerns and that box's ``state`` where known, and the
HTTP ``status`` a server answers it with; ``to_dict()`` gives them as JSON. An
error that is the failure of a sleeping box's wake on a call is marked
(``while_waking``): ``waking`` true, status 503, and ``retry_after`` where its
cause passes by itself.
The guest ``OSError`` subclasses also derive from the matching built-in, so
``except FileNotFoundError`` works for guest files as it does for local ones.

>>> from sandlot.errors import InvalidState
>>> err = InvalidState.refused("pause", "stopped", ["running"], box="dev")
>>> err.code, err.state, err.allowed, err.status
('invalid_state', 'stopped', ('running',), 409)
"""

from __future__ import annotations

import base64
import contextlib
import errno as _errno
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar


class SandlotError(Exception):
    """Base of every sandlot exception."""

    code: ClassVar[str] = "sandlot_error"
    status: int = 500  # a server's answer: the kind's, or 503 for a failed wake (``while_waking``)
    # seconds after which the same call may well succeed, where the cause passes by itself
    # (a busy store, a saturated host); a server says it in ``Retry-After``
    retry_after: ClassVar[int | None] = None
    waking = False

    def __init__(self, message: str = "", *, box: str | None = None, state: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.box = box
        self.state = state

    def while_waking(self) -> SandlotError:
        """Mark this error as the failure of a sleeping box's wake on a call (its resume,
        which the call waited for): it keeps its kind and code, so callers catch what
        they would have, and a server answers it 503 Service Unavailable, the box being
        there but not able to serve now."""
        self.waking = True
        self.status = 503
        return self

    def http_headers(self) -> dict[str, str]:
        """What a server's answer carries beside the body: ``Retry-After`` on a 503 whose
        cause may pass."""
        return {"Retry-After": str(self.retry_after)} if self.status == 503 and self.retry_after else {}

    def to_dict(self) -> dict[str, Any]:
        """The error as JSON: ``code``, ``message``, ``box``, ``state`` and any fields of its
        kind; ``waking`` and ``retry_after`` where a wake failed (``while_waking``)."""
        out: dict[str, Any] = {"code": self.code, "message": str(self), "box": self.box, "state": self.state}
        if self.waking:
            out.update(waking=True, retry_after=self.retry_after)
        out.update(self._fields())
        return out

    def _fields(self) -> dict[str, Any]:
        return {}


class InvalidArgument(SandlotError, ValueError):
    """A public call got input it cannot accept; nothing was changed."""

    code, status = "invalid_argument", 400


class Unsupported(InvalidArgument):
    """What was asked is not offered over the transport the box is reached through
    (``"local"``, ``"http"`` or ``"ray"``): a host path sent to a server, a server's
    preview URL asked of a local box. Nothing was changed."""

    code, status = "unsupported", 501

    def __init__(self, message: str, *, transport: str = "", box: str | None = None) -> None:
        super().__init__(message, box=box)
        self.transport = transport

    def _fields(self) -> dict[str, Any]:
        return {"transport": self.transport}


class HostSetupError(SandlotError):
    """The host lacks something sandlot needs (QEMU, the guest kernel, a compiler)."""

    code, status = "host_setup", 503


class ImageError(SandlotError):
    """A root filesystem or image is malformed or unsafe; nothing was unpacked outside its root."""

    code, status = "image_invalid", 422


class NotFound(SandlotError, LookupError):
    """No such thing in this sandlot home."""

    code, status = "not_found", 404


class BoxNotFound(NotFound):
    """No box has that id or name (in this sandlot home)."""

    code = "box_not_found"


class SnapshotNotFound(NotFound):
    """No snapshot or template by that id or name."""

    code = "snapshot_not_found"


class StepNotFound(NotFound):
    """No step by that number or name in the box's timeline (``box.timeline()``)."""

    code = "step_not_found"


class CodeContextNotFound(NotFound):
    """No code context by that id in the box (it was removed, or the box rebooted)."""

    code = "code_context_not_found"


class VolumeNotFound(NotFound):
    """No named volume has that name or id (in this sandlot home)."""

    code = "volume_not_found"


class NodeNotFound(NotFound):
    """No node of the fleet has that id (or it is not a sandlot node, or it is dead)."""

    code = "node_not_found"


class InvalidState(SandlotError):
    """The operation is not possible in the box's current state (e.g. it is stopped).
    ``state`` is that state; ``allowed`` the states the operation starts from."""

    code, status = "invalid_state", 409

    def __init__(
        self,
        message: str = "",
        *,
        box: str | None = None,
        state: str | None = None,
        allowed: Iterable[str] = (),
    ) -> None:
        super().__init__(message, box=box, state=state)
        self.allowed = tuple(allowed)

    @classmethod
    def refused(cls, op: str, state: str, allowed: Iterable[str], *, box: str | None = None) -> InvalidState:
        allowed = tuple(allowed)
        hint = {
            "paused": "; unpause() it",
            "stopped": "; start() it",
            "created": "; start() it",
            "crashed": "; start() it",
        }.get(state, "")
        where = f"box {box}" if box else "the box"
        need = f" (it needs {' or '.join(allowed)})" if allowed else ""
        return cls(f"{where} is {state}: cannot {op}{need}{hint}", box=box, state=state, allowed=allowed)

    def _fields(self) -> dict[str, Any]:
        return {"allowed": list(self.allowed)}


class BoxElsewhere(InvalidState):
    """The box belongs to another home: it went through the storage tier and that home
    took it (``sandlot.storage.pull``), or holds it there. ``holder`` names that home."""

    code, status = "box_elsewhere", 409

    def __init__(
        self,
        message: str = "",
        *,
        box: str | None = None,
        state: str | None = None,
        allowed: Iterable[str] = (),
        holder: str = "",
    ) -> None:
        super().__init__(message, box=box, state=state, allowed=allowed)
        self.holder = holder

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "holder": self.holder}


class BoxBusy(InvalidState):
    """Another process held the box's lock past the deadline (a long operation, or a stuck process)."""

    code, status = "box_busy", 423
    retry_after = 5


class _WithConsole(SandlotError):
    def __init__(
        self, message: str, console_tail: str = "", *, box: str | None = None, state: str | None = None
    ) -> None:
        self.console_tail = console_tail
        if console_tail:
            message = f"{message}\n--- guest console (last lines) ---\n{console_tail.rstrip()}"
        super().__init__(message, box=box, state=state)

    def _fields(self) -> dict[str, Any]:
        return {"console_tail": self.console_tail}


class BoxCrashed(_WithConsole, InvalidState):
    """The VM exited unexpectedly while in use."""

    code, status = "box_crashed", 409

    def __init__(
        self, message: str, console_tail: str = "", *, box: str | None = None, state: str | None = "crashed"
    ) -> None:
        _WithConsole.__init__(self, message, console_tail, box=box, state=state)
        self.allowed = ()


class SnapshotInUse(InvalidState):
    """A snapshot cannot be removed while boxes started from it exist."""

    code = "snapshot_in_use"


class VolumeInUse(InvalidState):
    """A volume cannot be removed while boxes mount it, and only one box at a time
    writes a volume back (``copy`` mode): ``.boxes`` names them."""

    code = "volume_in_use"

    def __init__(self, message: str, *, boxes: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.boxes = list(boxes)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "boxes": self.boxes}


class BootError(_WithConsole):
    """The VM did not reach a working agent. ``console_tail`` holds the guest's last words."""

    code, status = "boot_failed", 502


class BootTimeout(BootError, TimeoutError):
    """The VM did not answer within the boot deadline."""

    code, status = "boot_timeout", 504
    retry_after = 10


class SavedStateError(SandlotError):
    """Saving or loading a box's running state failed (the engine's reason included)."""

    code, status = "saved_state_failed", 500


class IncompatibleSnapshot(SavedStateError):
    """A snapshot was made by an engine, machine, CPU model, accelerator or kernel
    that this host cannot restore it with."""

    code, status = "incompatible_snapshot", 422


class CorruptSnapshot(SavedStateError):
    """A snapshot or snapshot archive is damaged or malformed (it is never partly used)."""

    code, status = "corrupt_snapshot", 422


class TierError(SandlotError):
    """The object-storage tier under the home's saved state failed (after its client's
    retries) or refused (docs/storage.md): the object and the store's answer included."""

    code, status = "storage_tier_failed", 502


class NoSpace(SandlotError, OSError):
    """A filesystem sandlot writes to (the home's, an export's destination) is full:
    what needed the space was not done, and nothing half-written is left visible."""

    code, status = "no_space", 507

    def __init__(self, message: str = "", *, box: str | None = None, state: str | None = None) -> None:
        SandlotError.__init__(self, message, box=box, state=state)
        self.errno = _errno.ENOSPC


@contextlib.contextmanager
def space_for(path: os.PathLike[str] | str, what: str, *, box: str | None = None) -> Iterator[None]:
    """Raise an ``OSError`` of a full filesystem (ENOSPC, EDQUOT) in the block as ``no_space``."""
    try:
        yield
    except NoSpace:
        raise
    except OSError as exc:
        if exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
            raise no_space(path, what, box=box) from None
        raise


def no_space(path: os.PathLike[str] | str, what: str, *, box: str | None = None) -> NoSpace:
    """NoSpace for ``what``, saying how much the filesystem of ``path`` has left (named by
    its nearest folder that is not a hidden work folder of sandlot's)."""
    path = os.fspath(path)
    while os.path.basename(path).startswith(".") and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
        left = f"{st.f_bavail * st.f_frsize / (1 << 20):.0f} MiB free"
    except OSError:
        left = "its free space unknown"
    return NoSpace(f"{what}: the filesystem of {path} is full ({left})", box=box)


class StoreError(SandlotError):
    """A home's state database cannot be used (corrupt, or from a newer sandlot)."""

    code, status = "store_unusable", 500


class StoreBusy(StoreError):
    """Another process held the home's state database locked for longer than the busy
    timeout (``SANDLOT_STORE_BUSY_TIMEOUT``, 30 s); nothing was changed, and the call
    may be tried again."""

    code, status = "store_busy", 503
    retry_after = 5


class ProtocolError(SandlotError):
    """The agent sent a frame that breaks the protocol."""

    code, status = "protocol_error", 502


class ConnectionLost(ProtocolError):
    """The channel to the agent closed while an operation was in flight."""

    code = "connection_lost"


class AgentTimeout(SandlotError, TimeoutError):
    """The agent did not answer a request within its deadline."""

    code, status = "agent_timeout", 504
    retry_after = 10


class EngineTimeout(AgentTimeout):
    """A VM's engine did not answer within its deadline: QEMU's monitor (QMP), busy or
    stopped; the message names the command and the deadline."""

    code = "engine_timeout"


class ExecTimeout(SandlotError, TimeoutError):
    """A command ran past its timeout and was killed. Output so far is attached."""

    code, status = "exec_timeout", 504

    def __init__(
        self, message: str, stdout: bytes = b"", stderr: bytes = b"", *, box: str | None = None
    ) -> None:
        super().__init__(message, box=box)
        self.stdout = stdout
        self.stderr = stderr


class CodeTimeout(SandlotError, TimeoutError):
    """A cell ran past its timeout. It was interrupted (its context keeps its state)
    or, where it ignored the interrupt, its interpreter was restarted (the state is
    lost; ``state_lost`` says which). ``execution`` holds what the cell did so far."""

    code, status = "code_timeout", 504

    def __init__(
        self, message: str, execution: Any = None, *, state_lost: bool = False, box: str | None = None
    ) -> None:
        super().__init__(message, box=box)
        self.execution = execution
        self.state_lost = state_lost

    def _fields(self) -> dict[str, Any]:
        to_dict = getattr(self.execution, "to_dict", None)
        return {"state_lost": self.state_lost, "execution": to_dict() if to_dict else None}


class InterpreterError(SandlotError):
    """A code context could not start: the image has no python3, or no Jupyter kernel
    for the language asked for. The message says what the image lacks."""

    code, status = "interpreter_error", 422


class CommandFailed(SandlotError):
    """``exec(..., check=True)`` saw a command fail. ``result`` is its ExecResult."""

    code, status = "command_failed", 422

    def __init__(self, message: str, result: Any, *, box: str | None = None) -> None:
        super().__init__(message, box=box)
        self.result = result

    def _fields(self) -> dict[str, Any]:
        return {"exit_code": getattr(self.result, "exit_code", None)}


class Unauthorized(SandlotError):
    """A request to ``sandlot serve`` without a valid API key, or a fleet's Ray cluster
    that refused this driver's token (none, or the wrong one)."""

    code, status = "unauthorized", 401


class Forbidden(SandlotError):
    """The API key is valid but may not do this (an admin-only operation)."""

    code, status = "forbidden", 403


class InsecureCluster(Forbidden):
    """A fleet node refuses to serve boxes on a Ray cluster that does not authenticate its
    callers (its operator did not allow it with ``--insecure-cluster``)."""

    code = "insecure_cluster"


class QuotaExceeded(SandlotError):
    """Doing this would take an API key over one of its quotas."""

    code, status = "quota_exceeded", 429
    retry_after = 5  # said where it failed a wake (503): the quota of awake boxes frees as boxes sleep

    def __init__(self, message: str, *, limit: str = "", value: int = 0, box: str | None = None) -> None:
        super().__init__(message, box=box)
        self.limit = limit
        self.value = value

    def _fields(self) -> dict[str, Any]:
        return {"limit": self.limit, "value": self.value}


class NoCapacity(SandlotError):
    """No node of the fleet has room for the box's CPUs and memory (Ray's scheduler did
    not place its reservation in time); nothing was made or moved."""

    code, status = "no_capacity", 503
    retry_after = 10


class PortUnreachable(SandlotError):
    """Nothing answers on the box's port a request through ``sandlot serve`` was for."""

    code, status = "port_unreachable", 502


class RequestError(SandlotError):
    """A server refused a request as malformed (a body too large, a frame out of protocol)."""

    code, status = "bad_request", 400


class TransferError(SandlotError):
    """A tree copied into or out of a box (``files.upload``/``download``, ``sandlot cp``,
    the archive routes) was refused or failed at one entry, which ``entry`` names (its
    path in the tree; ``""`` when the failure is not one entry's): a link that would be
    followed out of the tree, a member under a link, a hard link to what the tree does not
    hold, a name with ``..``, a file that changed as it was read, a disk that is full.
    ``side``: where it failed, ``"host"`` or ``"box"``; ``errno`` the system's error
    number where there is one.

    The destination is as it was, unless ``written`` is not None: a merge into a
    destination that was there failed while it moved entries into place, and
    ``written`` lists those moved by then (paths in the tree)."""

    code, status = "transfer_error", 422

    def __init__(
        self,
        message: str,
        *,
        entry: str = "",
        side: str = "",
        errno: int | None = None,
        written: list[str] | None = None,
        box: str | None = None,
    ) -> None:
        super().__init__(message, box=box)
        self.entry = entry
        self.side = side
        self.errno = errno
        self.written = written

    @classmethod
    def at(
        cls, entry: str, what: str, *, side: str, errno: int | None = None, written: list[str] | None = None
    ) -> TransferError:
        """The error of ``entry``, its message saying which and where."""
        where = "in the box" if side == "box" else "on this host" if side == "host" else ""
        head = f"{entry!r}" if entry else "the transfer"
        text = f"{head}{' (' + where + ')' if where else ''}: {what}"
        if written:
            shown = ", ".join(repr(w) for w in written[:10])
            more = f" and {len(written) - 10} more" if len(written) > 10 else ""
            text += f"; the destination was merged into and holds these already: {shown}{more}"
        return cls(text, entry=entry, side=side, errno=errno, written=written)

    def _fields(self) -> dict[str, Any]:
        return {"entry": self.entry, "side": self.side,
                "errno": _errno.errorcode.get(self.errno, self.errno) if self.errno else None,
                "written": self.written}  # fmt: skip


class TransferWarning(UserWarning):
    """An entry of a tree that a copy left out, and why (``warnings.warn``): a socket, a
    device node where none can be made (a host user who is not root, a gVisor box)."""


class GuestError(SandlotError):
    """The guest agent refused or failed an operation."""

    code, status = "guest_error", 400


class GuestOSError(GuestError, OSError):
    """An OS error inside the guest, with the guest's errno."""

    code = "guest_os_error"

    def __init__(self, err: int, message: str) -> None:
        OSError.__init__(self, err, message)
        self.guest_message = message
        self.message = message
        self.box = None
        self.state = None

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno or 0, str(self.errno))
        return f"[guest {name}] {self.guest_message}"

    def _fields(self) -> dict[str, Any]:
        return {"errno": _errno.errorcode.get(self.errno or 0, self.errno)}


class GuestFileNotFoundError(GuestOSError, FileNotFoundError):
    status = 404


class GuestFileExistsError(GuestOSError, FileExistsError):
    status = 409


class GuestIsADirectoryError(GuestOSError, IsADirectoryError):
    pass


class GuestNotADirectoryError(GuestOSError, NotADirectoryError):
    pass


class GuestPermissionError(GuestOSError, PermissionError):
    status = 403


class GuestDirectoryNotEmpty(GuestOSError):
    status = 409


class GuestConnectionRefusedError(GuestOSError, ConnectionRefusedError):
    """Nothing listens on the port in the box (``box.connect``)."""

    status = 502


_BY_ERRNO: dict[int, type[GuestOSError]] = {
    _errno.ENOENT: GuestFileNotFoundError,
    _errno.EEXIST: GuestFileExistsError,
    _errno.EISDIR: GuestIsADirectoryError,
    _errno.ENOTDIR: GuestNotADirectoryError,
    _errno.EACCES: GuestPermissionError,
    _errno.EPERM: GuestPermissionError,
    _errno.ENOTEMPTY: GuestDirectoryNotEmpty,
    _errno.ECONNREFUSED: GuestConnectionRefusedError,
}


def guest_os_error(err: int, message: str) -> GuestOSError:
    """The most specific GuestOSError for a guest errno."""
    cls = _BY_ERRNO.get(err, GuestOSError)
    return cls(err, message or os.strerror(err))


def _subclasses(cls: type[SandlotError]) -> list[type[SandlotError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_subclasses(sub))
    return out


def output_bytes(data: Mapping[str, Any], name: str) -> bytes:
    """A stream's bytes in a server's error: exact in ``NAME_b64``, else as text in ``NAME``."""
    raw = data.get(f"{name}_b64")
    if isinstance(raw, str):
        with contextlib.suppress(ValueError):
            return base64.b64decode(raw)
    text = data.get(name)
    return text.encode() if isinstance(text, str) else b""


def from_dict(data: dict[str, Any]) -> SandlotError:
    """The exception a server's error (``to_dict()`` plus ``type``) stands for, as the
    same class, so ``except`` clauses behave alike against a local and a remote box.
    An unknown type falls back to the class of its ``code``, else ``SandlotError``."""
    by_name = {c.__name__: c for c in _subclasses(SandlotError) if not c.__name__.startswith("_")}
    by_code = {c.code: c for c in reversed(_subclasses(SandlotError))}
    message = str(data.get("message", ""))
    box, state = data.get("box"), data.get("state")
    cls = by_name.get(str(data.get("type"))) or by_code.get(str(data.get("code")), SandlotError)
    err: SandlotError
    if issubclass(cls, GuestOSError):
        number = getattr(_errno, str(data.get("errno")), None)
        number = number if isinstance(number, int) else int(data.get("errno") or 0)
        text = message.split("] ", 1)[1] if message.startswith("[guest ") and "] " in message else message
        err = cls(number, text)
    elif issubclass(cls, _WithConsole):
        tail = str(data.get("console_tail", ""))
        marker = "\n--- guest console (last lines) ---\n"
        err = cls(message.split(marker, 1)[0] if tail else message, tail, box=box)
    elif issubclass(cls, VolumeInUse):
        err = cls(message, boxes=[str(b) for b in data.get("boxes") or ()])
    elif issubclass(cls, BoxElsewhere):
        holder = str(data.get("holder", ""))
        err = cls(message, box=box, state=state, allowed=data.get("allowed") or (), holder=holder)
    elif issubclass(cls, InvalidState):
        err = cls(message, box=box, state=state, allowed=data.get("allowed") or ())
    elif issubclass(cls, QuotaExceeded):
        err = cls(message, limit=str(data.get("limit", "")), value=int(data.get("value") or 0), box=box)
    elif issubclass(cls, ExecTimeout):  # the output so far travels with a timeout
        err = cls(message, output_bytes(data, "stdout"), output_bytes(data, "stderr"), box=box)
    elif issubclass(cls, Unsupported):
        err = cls(message, transport=str(data.get("transport") or ""), box=box)
    elif issubclass(cls, CommandFailed):
        err = cls(message, None, box=box)
    elif issubclass(cls, TransferError):
        number = getattr(_errno, str(data.get("errno")), None)
        written = data.get("written")
        err = cls(message, entry=str(data.get("entry") or ""), side=str(data.get("side") or ""),
                  errno=number if isinstance(number, int) else None, box=box,
                  written=[str(w) for w in written] if isinstance(written, list) else None)  # fmt: skip
    elif issubclass(cls, CodeTimeout):  # the host side rebuilds .execution (api/code.py)
        err = cls(message, data.get("execution"), state_lost=bool(data.get("state_lost")), box=box)
    else:
        try:
            err = cls(message, box=box, state=state)
        except TypeError:  # a class whose constructor takes other fields
            err = SandlotError(message, box=box, state=state)
    if data.get("waking") is True:
        err.while_waking()
    return err
