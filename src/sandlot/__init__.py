"""sandlot: embeddable microVM sandboxes for AI agents.

>>> import sandlot
>>> with sandlot.Box("python:3.12-slim") as box:                # doctest: +SKIP
...     print(box.exec("python3", "-c", "print(6*7)").stdout)
"""

import builtins
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
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
    from .images.oci import ImageConfig
    from .images.store import Image
    from .net.secrets import Secret
    from .runtime import Runtime

    create = Box.create
    get = Box.get
    list = Box.list
    list_snapshots = Snapshot.list
    get_snapshot = Snapshot.get

# The API is imported on first use, not by ``import sandlot``: helpers that run as
# their own processes (the egress proxy, once per guest connection; the idle
# watchdog) need a small part of the package, and start in a tenth of the time.
_LAZY = {
    "AsyncBox": "api.box", "Box": "api.box",
    "AsyncFiles": "api.files", "FileInfo": "api.files", "Files": "api.files",
    "get_image": "api.images", "import_image": "api.images", "list_images": "api.images",
    "load_image": "api.images", "prune_images": "api.images", "pull": "api.images",
    "pull_async": "api.images", "remove_image": "api.images",
    "AsyncProcess": "api.process", "AsyncStream": "api.process", "ExecResult": "api.process",
    "Process": "api.process", "Stream": "api.process",
    "AsyncSnapshot": "api.snapshot", "Snapshot": "api.snapshot",
    "import_snapshot": "api.templates", "import_snapshot_async": "api.templates",
    "template": "api.templates", "template_async": "api.templates",
    "ImageConfig": "images.oci", "Image": "images.store", "Runtime": "runtime", "Secret": "net.secrets",
}  # fmt: skip
_ALIASES = {
    "create": ("Box", "create"),
    "get": ("Box", "get"),
    "list": ("Box", "list"),
    "list_snapshots": ("Snapshot", "list"),
    "get_snapshot": ("Snapshot", "get"),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _ALIASES:
        owner, attr = _ALIASES[name]
        value = getattr(__getattr__(owner), attr)
    else:
        raise AttributeError(f"module 'sandlot' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> builtins.list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

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
    "Secret",
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
