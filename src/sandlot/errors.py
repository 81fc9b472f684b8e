"""One exception tree for everything sandlot raises.

Catch ``SandlotError`` for all of them, or a branch for what you care about::

    SandlotError
    ├── InvalidArgument (also ValueError)      bad input to a public call
    ├── HostSetupError                         QEMU, kernel or agent missing on the host
    ├── ImageError                             a root filesystem or image is malformed or unsafe
    ├── BootError                              the VM did not come up; has .console_tail
    │   └── BootTimeout (also TimeoutError)
    ├── BoxStateError                          operation not possible in the box's state
    │   └── BoxCrashed                         the VM died; has .console_tail
    ├── ProtocolError                          the agent sent something malformed
    │   └── ConnectionLost                     the agent channel broke mid-operation
    ├── AgentTimeout (also TimeoutError)       the agent did not answer in time
    ├── ExecTimeout (also TimeoutError)        a command ran past its timeout; was killed
    ├── CommandFailed                          exec(check=True) saw a nonzero exit
    └── GuestError                             the guest refused an operation
        └── GuestOSError (also OSError)        with .errno, and per-errno subclasses:
            GuestFileNotFoundError, GuestFileExistsError, GuestIsADirectoryError,
            GuestNotADirectoryError, GuestPermissionError, GuestDirectoryNotEmpty

The guest ``OSError`` subclasses also derive from the matching built-in, so
``except FileNotFoundError`` works for guest files as it does for local ones.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any


class SandlotError(Exception):
    """Base of every sandlot exception."""


class InvalidArgument(SandlotError, ValueError):
    """A public call got input it cannot accept; nothing was changed."""


class HostSetupError(SandlotError):
    """The host lacks something sandlot needs (QEMU, the guest kernel, a compiler)."""


class ImageError(SandlotError):
    """A root filesystem or image is malformed or unsafe; nothing was unpacked outside its root."""


class _WithConsole(SandlotError):
    def __init__(self, message: str, console_tail: str = "") -> None:
        self.console_tail = console_tail
        if console_tail:
            message = f"{message}\n--- guest console (last lines) ---\n{console_tail.rstrip()}"
        super().__init__(message)


class BootError(_WithConsole):
    """The VM did not reach a working agent. ``console_tail`` holds the guest's last words."""


class BootTimeout(BootError, TimeoutError):
    """The VM did not answer within the boot deadline."""


class BoxNotFound(SandlotError, LookupError):
    """No box has that id or name (in this sandlot home)."""


class InvalidState(SandlotError):
    """The operation is not possible in the box's current state (e.g. it is stopped)."""


class BoxCrashed(_WithConsole, InvalidState):
    """The VM exited unexpectedly while in use."""


class StateError(SandlotError):
    """Saving or restoring a box's running state failed (QEMU's reason included)."""


class SnapshotNotFound(SandlotError, LookupError):
    """No snapshot or template by that id or name."""


class SnapshotInUse(InvalidState):
    """A snapshot cannot be removed while boxes started from it exist."""


class IncompatibleSnapshot(SandlotError):
    """A snapshot was made by a QEMU, machine, CPU model, accelerator or kernel
    that this host cannot restore it with."""


class CorruptSnapshot(SandlotError):
    """A snapshot or snapshot archive is damaged or malformed (it is never partly used)."""


class ProtocolError(SandlotError):
    """The agent sent a frame that breaks the protocol."""


class ConnectionLost(ProtocolError):
    """The channel to the agent closed while an operation was in flight."""


class AgentTimeout(SandlotError, TimeoutError):
    """The agent did not answer a request within its deadline."""


class ExecTimeout(SandlotError, TimeoutError):
    """A command ran past its timeout and was killed. Output so far is attached."""

    def __init__(self, message: str, stdout: bytes = b"", stderr: bytes = b"") -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class CommandFailed(SandlotError):
    """``exec(..., check=True)`` saw a command fail. ``result`` is its ExecResult."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


class GuestError(SandlotError):
    """The guest agent refused or failed an operation."""


class GuestOSError(GuestError, OSError):
    """An OS error inside the guest, with the guest's errno."""

    def __init__(self, err: int, message: str) -> None:
        OSError.__init__(self, err, message)
        self.guest_message = message

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno or 0, str(self.errno))
        return f"[guest {name}] {self.guest_message}"


class GuestFileNotFoundError(GuestOSError, FileNotFoundError):
    pass


class GuestFileExistsError(GuestOSError, FileExistsError):
    pass


class GuestIsADirectoryError(GuestOSError, IsADirectoryError):
    pass


class GuestNotADirectoryError(GuestOSError, NotADirectoryError):
    pass


class GuestPermissionError(GuestOSError, PermissionError):
    pass


class GuestDirectoryNotEmpty(GuestOSError):
    pass


_BY_ERRNO: dict[int, type[GuestOSError]] = {
    _errno.ENOENT: GuestFileNotFoundError,
    _errno.EEXIST: GuestFileExistsError,
    _errno.EISDIR: GuestIsADirectoryError,
    _errno.ENOTDIR: GuestNotADirectoryError,
    _errno.EACCES: GuestPermissionError,
    _errno.EPERM: GuestPermissionError,
    _errno.ENOTEMPTY: GuestDirectoryNotEmpty,
}


def guest_os_error(err: int, message: str) -> GuestOSError:
    """The most specific GuestOSError for a guest errno."""
    cls = _BY_ERRNO.get(err, GuestOSError)
    return cls(err, message or os.strerror(err))
