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
from .api.snapshot import AsyncSnapshot, Snapshot
from .api.templates import import_snapshot, import_snapshot_async, template, template_async
from .errors import (
    AgentTimeout,
    BootError,
    BootTimeout,
    BoxCrashed,
    BoxNotFound,
    CommandFailed,
    ConnectionLost,
    CorruptSnapshot,
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
    IncompatibleSnapshot,
    InvalidArgument,
    InvalidState,
    ProtocolError,
    SandlotError,
    SnapshotInUse,
    SnapshotNotFound,
    StateError,
)
from .images.oci import ImageConfig
from .images.store import Image
from .runtime import Runtime

__version__ = "0.1.0"

create = Box.create
get = Box.get
list = Box.list
list_snapshots = Snapshot.list
get_snapshot = Snapshot.get

__all__ = [
    "AgentTimeout",
    "AsyncBox",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSnapshot",
    "AsyncStream",
    "BootError",
    "BootTimeout",
    "Box",
    "BoxCrashed",
    "BoxNotFound",
    "CommandFailed",
    "ConnectionLost",
    "CorruptSnapshot",
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
    "IncompatibleSnapshot",
    "InvalidArgument",
    "InvalidState",
    "Process",
    "ProtocolError",
    "Runtime",
    "SandlotError",
    "Snapshot",
    "SnapshotInUse",
    "SnapshotNotFound",
    "StateError",
    "Stream",
    "__version__",
    "create",
    "get",
    "get_image",
    "get_snapshot",
    "import_image",
    "import_snapshot",
    "import_snapshot_async",
    "list",
    "list_images",
    "list_snapshots",
    "load_image",
    "prune_images",
    "pull",
    "pull_async",
    "remove_image",
    "template",
    "template_async",
]
