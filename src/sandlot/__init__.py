"""sandlot: embeddable microVM sandboxes for AI agents.

>>> import sandlot
>>> with sandlot.Box("python:3.12-slim") as box:                # doctest: +SKIP
...     print(box.exec("python3", "-c", "print(6*7)").stdout)

The boxes of a ``sandlot serve`` server are the same ``Box``
(``sandlot.connect``, or ``sandlot.connect_async`` for the async API):

>>> client = sandlot.connect("http://127.0.0.1:7070", api_key="sk-sl-...")   # doctest: +SKIP
>>> with client.Box("python:3.12-slim") as box:                             # doctest: +SKIP
...     print(box.exec("python3", "-c", "print(6*7)").stdout)
"""

import builtins
from typing import TYPE_CHECKING, Any

from .errors import (
    AgentTimeout,
    BootError,
    BootTimeout,
    BoxBusy,
    BoxCrashed,
    BoxElsewhere,
    BoxNotFound,
    CodeContextNotFound,
    CodeTimeout,
    CommandFailed,
    ConnectionLost,
    CorruptSnapshot,
    EngineTimeout,
    ExecTimeout,
    Forbidden,
    GuestConnectionRefusedError,
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
    InsecureCluster,
    InterpreterError,
    InvalidArgument,
    InvalidState,
    NoCapacity,
    NodeNotFound,
    NoSpace,
    NotFound,
    PortUnreachable,
    ProtocolError,
    QuotaExceeded,
    RequestError,
    SandlotError,
    SavedStateError,
    SnapshotInUse,
    SnapshotNotFound,
    StepNotFound,
    StoreBusy,
    StoreError,
    TierError,
    TransferError,
    TransferWarning,
    Unauthorized,
    Unsupported,
    VolumeInUse,
    VolumeNotFound,
)
from .version import __version__

if TYPE_CHECKING:
    from .api import storage as storage
    from .api.box import AsyncBox, AsyncSnapshot
    from .api.client import AsyncClient, connect_async
    from .api.code import CodeContext, Execution, ExecutionError, Result
    from .api.events import Event, events, events_async
    from .api.files import AsyncFiles, AsyncWatch, FileEvent, FileInfo
    from .api.images import (
        get_image,
        import_image,
        list_images,
        load_image,
        prune_images,
        pull_async,
        remove_image,
    )
    from .api.process import AsyncProcess, AsyncStream, ExecResult
    from .api.sync import (
        Box,
        Client,
        Files,
        Process,
        Snapshot,
        Stream,
        Volumes,
        Watch,
        connect,
        import_snapshot,
        pools,
        prune_snapshots,
        pull,
        set_pool,
        template,
    )
    from .api.templates import (
        import_snapshot_async,
        pools_async,
        prune_snapshots_async,
        set_pool_async,
        template_async,
    )
    from .api.volumes import AsyncVolumes, Volume
    from .core.runtime import Runtime
    from .images.oci import ImageConfig
    from .images.store import Image
    from .net.secrets import Secret

    create = Box.create
    get = Box.get
    list = Box.list
    list_snapshots = Snapshot.list
    get_snapshot = Snapshot.get
    volume = Volumes()  # the named volumes of $SANDLOT_HOME: sandlot.volume.create("data")
    volume_async = AsyncVolumes()

# The API is imported on first use, not by ``import sandlot``: helpers that run as
# their own processes (the egress proxy, once per guest connection; the idle
# watchdog) need a small part of the package, and start in a tenth of the time.
_LAZY = {
    "AsyncBox": "api.box", "Box": "api.sync", "Files": "api.sync", "Process": "api.sync",
    "Snapshot": "api.sync", "Stream": "api.sync", "Watch": "api.sync",
    "AsyncFiles": "api.files", "FileInfo": "api.files", "AsyncWatch": "api.files", "FileEvent": "api.files",
    "CodeContext": "api.code", "Execution": "api.code", "ExecutionError": "api.code", "Result": "api.code",
    "get_image": "api.images", "import_image": "api.images", "list_images": "api.images",
    "load_image": "api.images", "prune_images": "api.images", "pull": "api.sync",
    "pull_async": "api.images", "remove_image": "api.images",
    "AsyncProcess": "api.process", "AsyncStream": "api.process", "ExecResult": "api.process",
    "AsyncSnapshot": "api.box",
    "import_snapshot": "api.sync", "import_snapshot_async": "api.templates",
    "prune_snapshots": "api.sync", "prune_snapshots_async": "api.templates",
    "template": "api.sync", "template_async": "api.templates",
    "set_pool": "api.sync", "set_pool_async": "api.templates",
    "pools": "api.sync", "pools_async": "api.templates",
    "ImageConfig": "images.oci", "Image": "images.store", "Runtime": "core.runtime", "Secret": "net.secrets",
    "connect": "api.sync", "Client": "api.sync", "connect_async": "api.client", "AsyncClient": "api.client",
    "events": "api.events", "events_async": "api.events", "Event": "api.events",
    "Volumes": "api.sync", "AsyncVolumes": "api.volumes", "Volume": "api.volumes",
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

    if name == "fleet":  # Ray is imported only by those who ask for a fleet
        value: Any = importlib.import_module(".fleet", __name__)
    elif name == "storage":  # the home's saved state: sandlot.storage.info(), .gc()
        value = importlib.import_module(".api.storage", __name__)
    elif name in ("volume", "volume_async"):  # each resolves $SANDLOT_HOME when it is called
        value = __getattr__("Volumes" if name == "volume" else "AsyncVolumes")()
    elif name in _LAZY:
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


__all__ = [
    "AgentTimeout",
    "AsyncBox",
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSnapshot",
    "AsyncStream",
    "AsyncVolumes",
    "AsyncWatch",
    "BootError",
    "BootTimeout",
    "Box",
    "BoxBusy",
    "BoxCrashed",
    "BoxElsewhere",
    "BoxNotFound",
    "Client",
    "CodeContext",
    "CodeContextNotFound",
    "CodeTimeout",
    "CommandFailed",
    "ConnectionLost",
    "CorruptSnapshot",
    "EngineTimeout",
    "Event",
    "ExecResult",
    "ExecTimeout",
    "Execution",
    "ExecutionError",
    "FileEvent",
    "FileInfo",
    "Files",
    "Forbidden",
    "GuestConnectionRefusedError",
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
    "InsecureCluster",
    "InterpreterError",
    "InvalidArgument",
    "InvalidState",
    "NoCapacity",
    "NoSpace",
    "NodeNotFound",
    "NotFound",
    "PortUnreachable",
    "Process",
    "ProtocolError",
    "QuotaExceeded",
    "RequestError",
    "Result",
    "Runtime",
    "SandlotError",
    "SavedStateError",
    "Secret",
    "Snapshot",
    "SnapshotInUse",
    "SnapshotNotFound",
    "StepNotFound",
    "StoreBusy",
    "StoreError",
    "Stream",
    "TierError",
    "TransferError",
    "TransferWarning",
    "Unauthorized",
    "Unsupported",
    "Volume",
    "VolumeInUse",
    "VolumeNotFound",
    "Volumes",
    "Watch",
    "__version__",
    "connect",
    "connect_async",
    "create",
    "events",
    "events_async",
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
    "pools",
    "pools_async",
    "prune_images",
    "prune_snapshots",
    "prune_snapshots_async",
    "pull",
    "pull_async",
    "remove_image",
    "set_pool",
    "set_pool_async",
    "template",
    "template_async",
    "volume",
    "volume_async",
]
