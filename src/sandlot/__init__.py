"""sandlot: embeddable microVM sandboxes for AI agents.

>>> import sandlot
>>> with sandlot.Box(rootfs="/path/to/rootfs") as box:          # doctest: +SKIP
...     print(box.exec("uname", "-r").stdout)
"""

from .api.box import AsyncBox, Box
from .api.files import AsyncFiles, FileInfo, Files
from .api.process import AsyncProcess, AsyncStream, ExecResult, Process, Stream
from .errors import (
    AgentTimeout,
    BootError,
    BootTimeout,
    BoxCrashed,
    BoxStateError,
    CommandFailed,
    ConnectionLost,
    ExecTimeout,
    GuestDirectoryNotEmpty,
    GuestError,
    GuestFileExistsError,
    GuestFileNotFoundError,
    GuestIsADirectoryError,
    GuestNotADirectoryError,
    GuestOSError,
    GuestPermissionError,
    HostSetupError,
    ImageError,
    InvalidArgument,
    ProtocolError,
    SandlotError,
)
from .runtime import Runtime

__version__ = "0.1.0"

__all__ = [
    "AgentTimeout",
    "AsyncBox",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncStream",
    "BootError",
    "BootTimeout",
    "Box",
    "BoxCrashed",
    "BoxStateError",
    "CommandFailed",
    "ConnectionLost",
    "ExecResult",
    "ExecTimeout",
    "FileInfo",
    "Files",
    "GuestDirectoryNotEmpty",
    "GuestError",
    "GuestFileExistsError",
    "GuestFileNotFoundError",
    "GuestIsADirectoryError",
    "GuestNotADirectoryError",
    "GuestOSError",
    "GuestPermissionError",
    "HostSetupError",
    "ImageError",
    "InvalidArgument",
    "Process",
    "ProtocolError",
    "Runtime",
    "SandlotError",
    "Stream",
    "__version__",
]
