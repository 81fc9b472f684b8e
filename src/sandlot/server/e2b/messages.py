"""The messages of E2B's envd: ``process.proto`` and ``filesystem.proto``, as schemas for ``protobuf``.

As E2B's Python SDK ships them (the descriptors of ``e2b/envd/*/*_pb.py``, e2b 2.63), which
``tests/unit/test_e2b_wire.py`` checks these against, field by field. A nested message is a
module name joined with an underscore (``process.PTY.Size`` is ``PTY_Size``).
``PROCESS_METHODS`` and ``FILESYSTEM_METHODS`` give each RPC's request, response and kind.
"""

from __future__ import annotations

from typing import Literal

from .protobuf import Enum, Field, Message

RpcKind = Literal["unary", "server_stream", "client_stream"]

Timestamp = Message("google.protobuf.Timestamp", (Field(1, "seconds", "int64"), Field(2, "nanos", "int32")))
"""A field of this type is a timezone-aware ``datetime`` in Python (see ``protobuf``)."""


# --- process.proto ----------------------------------------------------------------------------------

Signal = Enum("process.Signal", {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9})

PTY_Size = Message("process.PTY.Size", (Field(1, "cols", "uint32"), Field(2, "rows", "uint32")))
PTY = Message("process.PTY", (Field(1, "size", "message", message=PTY_Size),))
ProcessConfig = Message(
    "process.ProcessConfig",
    (
        Field(1, "cmd", "string"),
        Field(2, "args", "string", repeated=True),
        Field(3, "envs", "map", map_value=Field(2, "value", "string")),
        Field(4, "cwd", "string", optional=True),
    ),
)
ProcessSelector = Message(
    "process.ProcessSelector",
    (Field(1, "pid", "uint32", oneof="selector"), Field(2, "tag", "string", oneof="selector")),
)
_SELECTOR = Field(1, "process", "message", message=ProcessSelector)
ProcessInput = Message(
    "process.ProcessInput",
    (Field(1, "stdin", "bytes", oneof="input"), Field(2, "pty", "bytes", oneof="input")),
)

ListRequest = Message("process.ListRequest")
ProcessInfo = Message(
    "process.ProcessInfo",
    (
        Field(1, "config", "message", message=ProcessConfig),
        Field(2, "pid", "uint32"),
        Field(3, "tag", "string", optional=True),
    ),
)
ListResponse = Message(
    "process.ListResponse", (Field(1, "processes", "message", message=ProcessInfo, repeated=True),)
)

StartRequest = Message(
    "process.StartRequest",
    (
        Field(1, "process", "message", message=ProcessConfig),
        Field(2, "pty", "message", message=PTY, optional=True),
        Field(3, "tag", "string", optional=True),
        Field(4, "stdin", "bool", optional=True),
    ),
)
UpdateRequest = Message(
    "process.UpdateRequest", (_SELECTOR, Field(2, "pty", "message", message=PTY, optional=True))
)
UpdateResponse = Message("process.UpdateResponse")

ProcessEvent_StartEvent = Message("process.ProcessEvent.StartEvent", (Field(1, "pid", "uint32"),))
ProcessEvent_DataEvent = Message(
    "process.ProcessEvent.DataEvent",
    (
        Field(1, "stdout", "bytes", oneof="output"),
        Field(2, "stderr", "bytes", oneof="output"),
        Field(3, "pty", "bytes", oneof="output"),
    ),
)
ProcessEvent_EndEvent = Message(
    "process.ProcessEvent.EndEvent",
    (
        Field(1, "exit_code", "sint32"),
        Field(2, "exited", "bool"),
        Field(3, "status", "string"),
        Field(4, "error", "string", optional=True),
    ),
)
ProcessEvent_KeepAlive = Message("process.ProcessEvent.KeepAlive")
ProcessEvent = Message(
    "process.ProcessEvent",
    (
        Field(1, "start", "message", message=ProcessEvent_StartEvent, oneof="event"),
        Field(2, "data", "message", message=ProcessEvent_DataEvent, oneof="event"),
        Field(3, "end", "message", message=ProcessEvent_EndEvent, oneof="event"),
        Field(4, "keepalive", "message", message=ProcessEvent_KeepAlive, oneof="event"),
    ),
)
StartResponse = Message("process.StartResponse", (Field(1, "event", "message", message=ProcessEvent),))
ConnectRequest = Message("process.ConnectRequest", (_SELECTOR,))
ConnectResponse = Message("process.ConnectResponse", (Field(1, "event", "message", message=ProcessEvent),))

SendInputRequest = Message(
    "process.SendInputRequest", (_SELECTOR, Field(2, "input", "message", message=ProcessInput))
)
SendInputResponse = Message("process.SendInputResponse")

StreamInputRequest_StartEvent = Message("process.StreamInputRequest.StartEvent", (_SELECTOR,))
StreamInputRequest_DataEvent = Message(
    "process.StreamInputRequest.DataEvent", (Field(2, "input", "message", message=ProcessInput),)
)
StreamInputRequest_KeepAlive = Message("process.StreamInputRequest.KeepAlive")
StreamInputRequest = Message(
    "process.StreamInputRequest",
    (
        Field(1, "start", "message", message=StreamInputRequest_StartEvent, oneof="event"),
        Field(2, "data", "message", message=StreamInputRequest_DataEvent, oneof="event"),
        Field(3, "keepalive", "message", message=StreamInputRequest_KeepAlive, oneof="event"),
    ),
)
StreamInputResponse = Message("process.StreamInputResponse")

SendSignalRequest = Message("process.SendSignalRequest", (_SELECTOR, Field(2, "signal", "enum", enum=Signal)))
SendSignalResponse = Message("process.SendSignalResponse")
CloseStdinRequest = Message("process.CloseStdinRequest", (_SELECTOR,))
CloseStdinResponse = Message("process.CloseStdinResponse")


# --- filesystem.proto -------------------------------------------------------------------------------

FileType = Enum(
    "filesystem.FileType",
    {"FILE_TYPE_UNSPECIFIED": 0, "FILE_TYPE_FILE": 1, "FILE_TYPE_DIRECTORY": 2, "FILE_TYPE_SYMLINK": 3},
)
EventType = Enum(
    "filesystem.EventType",
    {
        "EVENT_TYPE_UNSPECIFIED": 0,
        "EVENT_TYPE_CREATE": 1,
        "EVENT_TYPE_WRITE": 2,
        "EVENT_TYPE_REMOVE": 3,
        "EVENT_TYPE_RENAME": 4,
        "EVENT_TYPE_CHMOD": 5,
    },
)

EntryInfo = Message(
    "filesystem.EntryInfo",
    (
        Field(1, "name", "string"),
        Field(2, "type", "enum", enum=FileType),
        Field(3, "path", "string"),
        Field(4, "size", "int64"),
        Field(5, "mode", "uint32"),
        Field(6, "permissions", "string"),
        Field(7, "owner", "string"),
        Field(8, "group", "string"),
        Field(9, "modified_time", "message", message=Timestamp),
        Field(10, "symlink_target", "string", optional=True),
        Field(11, "metadata", "map", map_value=Field(2, "value", "string")),
        # Newer envd marks a symlink here and reports its target's type in ``type``; the SDK
        # (e2b 2.63) reads it first, and older envd sends FILE_TYPE_SYMLINK without it.
        Field(12, "is_symlink", "bool"),
    ),
)

_ENTRY = Field(1, "entry", "message", message=EntryInfo)
_PATH = Field(1, "path", "string")

StatRequest = Message("filesystem.StatRequest", (_PATH,))
StatResponse = Message("filesystem.StatResponse", (_ENTRY,))
MakeDirRequest = Message("filesystem.MakeDirRequest", (_PATH,))
MakeDirResponse = Message("filesystem.MakeDirResponse", (_ENTRY,))
MoveRequest = Message(
    "filesystem.MoveRequest", (Field(1, "source", "string"), Field(2, "destination", "string"))
)
MoveResponse = Message("filesystem.MoveResponse", (_ENTRY,))
RemoveRequest = Message("filesystem.RemoveRequest", (_PATH,))
RemoveResponse = Message("filesystem.RemoveResponse")
ListDirRequest = Message("filesystem.ListDirRequest", (_PATH, Field(2, "depth", "uint32")))
ListDirResponse = Message(
    "filesystem.ListDirResponse", (Field(1, "entries", "message", message=EntryInfo, repeated=True),)
)

_WATCH = (
    _PATH,
    Field(2, "recursive", "bool"),
    Field(3, "include_entry", "bool"),
    Field(4, "allow_network_mounts", "bool"),
)
FilesystemEvent = Message(
    "filesystem.FilesystemEvent",
    (
        Field(1, "name", "string"),
        Field(2, "type", "enum", enum=EventType),
        Field(3, "entry", "message", message=EntryInfo, optional=True),
    ),
)
WatchDirRequest = Message("filesystem.WatchDirRequest", _WATCH)
WatchDirResponse_StartEvent = Message("filesystem.WatchDirResponse.StartEvent")
WatchDirResponse_KeepAlive = Message("filesystem.WatchDirResponse.KeepAlive")
WatchDirResponse = Message(
    "filesystem.WatchDirResponse",
    (
        Field(1, "start", "message", message=WatchDirResponse_StartEvent, oneof="event"),
        Field(2, "filesystem", "message", message=FilesystemEvent, oneof="event"),
        Field(3, "keepalive", "message", message=WatchDirResponse_KeepAlive, oneof="event"),
    ),
)
CreateWatcherRequest = Message("filesystem.CreateWatcherRequest", _WATCH)
CreateWatcherResponse = Message("filesystem.CreateWatcherResponse", (Field(1, "watcher_id", "string"),))
GetWatcherEventsRequest = Message("filesystem.GetWatcherEventsRequest", (Field(1, "watcher_id", "string"),))
GetWatcherEventsResponse = Message(
    "filesystem.GetWatcherEventsResponse",
    (Field(1, "events", "message", message=FilesystemEvent, repeated=True),),
)
RemoveWatcherRequest = Message("filesystem.RemoveWatcherRequest", (Field(1, "watcher_id", "string"),))
RemoveWatcherResponse = Message("filesystem.RemoveWatcherResponse")


# --- the services -----------------------------------------------------------------------------------

PROCESS_METHODS: dict[str, tuple[Message, Message, RpcKind]] = {
    "List": (ListRequest, ListResponse, "unary"),
    "Connect": (ConnectRequest, ConnectResponse, "server_stream"),
    "Start": (StartRequest, StartResponse, "server_stream"),
    "Update": (UpdateRequest, UpdateResponse, "unary"),
    "StreamInput": (StreamInputRequest, StreamInputResponse, "client_stream"),
    "SendInput": (SendInputRequest, SendInputResponse, "unary"),
    "SendSignal": (SendSignalRequest, SendSignalResponse, "unary"),
    "CloseStdin": (CloseStdinRequest, CloseStdinResponse, "unary"),
}
"""The RPCs of ``process.Process``: name -> (request, response, kind)."""

FILESYSTEM_METHODS: dict[str, tuple[Message, Message, RpcKind]] = {
    "Stat": (StatRequest, StatResponse, "unary"),
    "MakeDir": (MakeDirRequest, MakeDirResponse, "unary"),
    "Move": (MoveRequest, MoveResponse, "unary"),
    "ListDir": (ListDirRequest, ListDirResponse, "unary"),
    "Remove": (RemoveRequest, RemoveResponse, "unary"),
    "WatchDir": (WatchDirRequest, WatchDirResponse, "server_stream"),
    "CreateWatcher": (CreateWatcherRequest, CreateWatcherResponse, "unary"),
    "GetWatcherEvents": (GetWatcherEventsRequest, GetWatcherEventsResponse, "unary"),
    "RemoveWatcher": (RemoveWatcherRequest, RemoveWatcherResponse, "unary"),
}
"""The RPCs of ``filesystem.Filesystem``: name -> (request, response, kind)."""
