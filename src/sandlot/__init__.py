"""sandlot: embeddable microVM sandboxes for AI agents.

>>> import sandlot
>>> with sandlot.Box("python:3.12-slim") as box:                # doctest: +SKIP
...     print(box.exec("python3", "-c", "print(6*7)").stdout)
"""

from .api.box import AsyncBox, Box
from .api.files import AsyncFiles, FileInfo, Files
from .api.images import (
    get_image,
    import_image,
    list_images,
    load_image,
    prune_images,
    pull,
    pull_async,
    remove_image,
)
from .api.process import AsyncProcess, AsyncStream, ExecResult, Process, Stream
from .errors import (
    AgentTimeout,
    BootError,
    BootTimeout,
    BoxCrashed,
    BoxNotFound,
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
    InvalidState,
    ProtocolError,
    SandlotError,
)
from .images.oci import ImageConfig
from .images.store import Image
from .runtime import Runtime

__version__ = "0.1.0"

create = Box.create
get = Box.get
list = Box.list

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
    "BoxNotFound",
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
    "Image",
    "ImageConfig",
    "ImageError",
    "InvalidArgument",
    "InvalidState",
    "Process",
    "ProtocolError",
    "Runtime",
    "SandlotError",
    "Stream",
    "__version__",
    "create",
    "get",
    "get_image",
    "import_image",
    "list",
    "list_images",
    "load_image",
    "prune_images",
    "pull",
    "pull_async",
    "remove_image",
]
