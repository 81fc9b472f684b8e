"""The wire contract: every operation a box offers, as data, with the shapes of what
it takes and what it answers, and the frames a followed process is streamed in.

One table (``OPERATIONS``) is the whole request/answer surface of a box, of its
files and of its snapshots, as Firecracker's ``VmmAction`` is the whole interface
of its VMM. Each ``Operation`` names the method it is on its object (``AsyncBox``,
``AsyncFiles``, ``AsyncSnapshot``), the model its arguments travel in, how its
result is written as JSON and read back, and the REST route that serves it. The
facades (``api/box.py``) ask a backend to run an operation; the server
(``server/routes.py``) registers one route per operation from this table; the HTTP
backend (``api/http.py``) and the fleet's Ray backend send the same models and
read the same answers. What does not fit a request and its answer (a process
followed as it runs, a file streamed, a watch, an archive) is a streaming
primitive of the backend interface (``api/backend.py``), and its frames are here
too.

A box's options are declared once (``core/options.py``); ``BoxCreate``, the body
of ``POST /v1/boxes``, is made of their wire forms, with the fields of the request
itself (``REQUEST_FIELDS``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from ..core.options import LOCAL, OPTIONS
from ..core.validate import MOST_AT_ONCE
from ..errors import (
    ExecTimeout,
    Forbidden,
    InvalidArgument,
    NotFound,
    ProtocolError,
    RequestError,
    SandlotError,
    Unauthorized,
    Unsupported,
    from_dict,
    output_bytes,
)
from ..protocol.exec import ExitStatus
from .backend import snapshot_key
from .fs import FILE_EVENT_TYPES, FileEvent, FileInfo
from .process import ExecResult

# -- the frames of a followed process (docs/server.md, "Processes, streamed") ---------------
#
# Server to client: binary ``[stream u8][offset u64 big-endian][bytes]`` for output, and
# JSON text messages ``{"type": "exit"|"gap"|"error"|"pong", ...}``. Client to server:
# binary ``[0][stdin bytes]`` and JSON ``{"type": "stdin_eof"|"signal"|"resize"|"ping"}``.
# The same frames travel over a WebSocket (``sandlot serve``) and a Ray stream (a fleet node).

STDOUT, STDERR = 1, 2
HEADER = struct.Struct(">BQ")
CHUNK = 256 * 1024  # bytes per stdin frame, per file chunk read from disk


def encode_stdin(data: bytes | bytearray | memoryview) -> bytes:
    """A client -> host frame carrying stdin bytes: ``[0][bytes]``."""
    return b"\x00" + bytes(data)


def decode_stdin(frame: bytes) -> bytes:
    """The stdin bytes of a client frame (RequestError if it is not one)."""
    if not frame or frame[0] != 0:
        raise RequestError("a binary frame from the client must be [0][stdin bytes]")
    return bytes(frame[1:])


def decode_output(frame: bytes) -> tuple[int, int, bytes]:
    """A host -> client output frame as (stream, offset, bytes); stream 1 is stdout, 2 stderr.
    ProtocolError if it is not one."""
    if len(frame) < HEADER.size:
        raise ProtocolError(f"an output frame of {len(frame)} bytes is shorter than its header")
    stream, offset = HEADER.unpack_from(frame)
    if stream not in (STDOUT, STDERR):
        raise ProtocolError(f"an output frame names stream {stream}; only 1 (stdout) and 2 (stderr) exist")
    return stream, offset, bytes(frame[HEADER.size :])


def encode_output(stream: int, offset: int, data: bytes) -> bytes:
    """A host -> client output frame (the inverse of ``decode_output``)."""
    return HEADER.pack(stream, offset) + data


def control(kind: str, **fields: Any) -> str:
    """A JSON control message: ``control("signal", signal=15, group=True)``."""
    return json.dumps({"type": kind, **fields}, separators=(",", ":"))


def decode_control(text: str | bytes, where: str) -> dict[str, Any]:
    """A JSON control message as a dict with a ``type`` (ProtocolError if it is not one)."""
    try:
        msg = json.loads(text)
    except ValueError:
        msg = None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError(f"{where}: a message out of protocol: {str(text)[:100]!r}")
    return msg


def exit_status(msg: Mapping[str, Any]) -> ExitStatus:
    """The exit status an ``exit`` message carries."""
    sig = msg.get("signal")
    return ExitStatus(int(msg.get("exit_code") or 0), int(sig) if sig else None,
                      oom_killed=bool(msg.get("oom_killed")))  # fmt: skip


def exit_message(result: ExecResult) -> dict[str, Any]:
    return {"type": "exit", "exit_code": result.exit_code, "signal": result.signal,
            "oom_killed": result.oom_killed}  # fmt: skip


# -- errors --------------------------------------------------------------------------------


def error_json(err: SandlotError) -> dict[str, Any]:
    """An error as every answer and stream carries it: ``to_dict()`` plus its class name
    (and the output so far of a command that timed out)."""
    body = {**err.to_dict(), "type": type(err).__name__}
    if isinstance(err, ExecTimeout):
        body["stdout"] = err.stdout.decode("utf-8", "replace")
        body["stderr"] = err.stderr.decode("utf-8", "replace")
        body["stdout_b64"] = b64(err.stdout)
        body["stderr_b64"] = b64(err.stderr)
    return body


def error_message(err: SandlotError) -> dict[str, Any]:
    """A stream's error message: the error shape under ``"type": "error"``."""
    return {"type": "error", "error": error_json(err)}


_STATUS_ERRORS: dict[int, type[SandlotError]] = {
    400: RequestError,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    413: RequestError,
}


def error_from_answer(status: int, body: bytes, where: str) -> SandlotError:
    """The exception a non-2xx answer stands for: the error body rebuilt as its own
    class (``errors.from_dict``); else one chosen by the HTTP status."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        data = None
    err_body = data.get("error") if isinstance(data, dict) else None
    if isinstance(err_body, dict):
        return from_dict(err_body)
    text = body[:300].decode("utf-8", "replace").strip()
    cls = _STATUS_ERRORS.get(status, ProtocolError)
    return cls(f"{where} answered HTTP {status}" + (f": {text}" if text else ""))


def raise_if_error(msg: Mapping[str, Any]) -> None:
    if msg.get("type") == "error" and isinstance(msg.get("error"), dict):
        raise from_dict(msg["error"])


# -- request models ------------------------------------------------------------------------


class Strict(BaseModel):
    """A request body or query: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


Path_ = Annotated[str, BeforeValidator(_fspath)]  # a guest path (checked where it is used)


class Empty(Strict):
    pass


# The fields of ``POST /v1/boxes`` that are not options of a box: what it starts from,
# whether it boots, and the lease of a remote ``with`` block's box (server/leases.py),
# of ``lease`` seconds (else its key's length, else the server's)
REQUEST_FIELDS: dict[str, Any] = {
    "image": (str | None, None),
    "snapshot": (str | None, None),
    "start": (bool, True),
    "ephemeral": (bool | None, None),
    "lease": (float | None, None),
}
SENT = {o.name: o for o in OPTIONS if o.kind != "handle" and o.wire is not LOCAL}
NOT_SENT = {o.name: o for o in OPTIONS if o.kind != "handle" and o.wire is LOCAL}
HOST_PATHS = tuple(o.name for o in OPTIONS if o.admin)  # paths on the server's host: admin keys only


def _box_create() -> type[Strict]:
    # an option not given is unset: the server's default, BoxSpec's
    fields: dict[str, Any] = {n: (o.wire | None, None) for n, o in SENT.items()}
    fields.update(REQUEST_FIELDS)
    model = create_model("BoxCreate", __base__=Strict, **fields)
    model.__doc__ = ("A box to create: ``POST /v1/boxes``. Its options are ``sandlot.AsyncBox``'s "
                     "(``core/options.py``); host paths need an admin key.")  # fmt: skip
    return model


BoxCreate = _box_create()


def box_create(image: Any, options: Mapping[str, Any], transport: str) -> dict[str, Any]:
    """The JSON body of ``POST /v1/boxes`` for ``AsyncBox``-style arguments. An option a
    box reached over ``transport`` cannot have raises Unsupported; an unknown one
    InvalidArgument."""
    body: dict[str, Any] = {}
    for name, value in options.items():
        if name in NOT_SENT:
            if value is not None and value != NOT_SENT[name].default:
                raise Unsupported(f"{name}= is not offered over the {transport} transport: it names "
                                  "something of this host", transport=transport)  # fmt: skip
            continue
        if name not in SENT and (name not in REQUEST_FIELDS or name in ("start", "ephemeral")):
            raise InvalidArgument(f"unknown box option(s): {name}")
        if value is None:
            continue
        body[name] = _option_json(name, value, transport)
    if image is not None:
        if not isinstance(image, str):
            raise Unsupported(f"an Image object is not offered over the {transport} transport; give its "
                              "reference (a string)", transport=transport)  # fmt: skip
        body = {"image": image, **body}
    made: dict[str, Any] = validated(BoxCreate, body).model_dump(exclude_none=True, exclude={"start"})
    return made


def _option_json(name: str, value: Any, transport: str) -> Any:
    if name in ("template", "snapshot"):  # a snapshot of the API's, or its id or name
        if value is False and name == "template":
            raise Unsupported(f"template=False is not offered over the {transport} transport",
                              transport=transport)  # fmt: skip
        return snapshot_key(value)
    option = SENT.get(name)  # else a field of the request (``lease``)
    return option.to_wire(value, transport) if option and option.to_wire else value


def validated(model: type[Strict], data: Mapping[str, Any]) -> Any:
    """``data`` as ``model``; what it cannot be raises InvalidArgument naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise refusal(e) from None


def refusal(e: ValidationError) -> InvalidArgument:
    """A validation's failure as InvalidArgument naming the fields (its first five)."""
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return InvalidArgument("; ".join(parts) or "malformed arguments")


class ExecIn(Strict):
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    stdin: str | None = None
    stdin_b64: str | None = None
    timeout: float | None = None
    # "b64": the output's bytes in stdout_b64/stderr_b64 alone, its text fields left empty.
    # What sandlot's clients ask: binary output as text is up to 6 bytes of JSON a byte
    # (each undecodable one a \ufffd), beside its base64.
    output: Literal["both", "b64"] = "both"


class ExecCall(ExecIn):
    """An exec on the exec channel (``WS /v1/exec``): the REST body, its box and an id
    the answer carries back."""

    id: int = Field(ge=0)
    box: str = Field(min_length=1)


class SpawnIn(Strict):
    """The first message of ``WS /v1/boxes/{box}/spawn``, and what a node's ``spawn`` takes."""

    type: Literal["spawn"] = "spawn"
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    tty: bool = False
    stdin: bool = True
    rows: int = Field(default=24, ge=1, le=10000)
    cols: int = Field(default=80, ge=1, le=10000)


class RunCodeIn(Strict):
    code: str
    language: str = "python"
    context: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    env: dict[str, str] | None = None


class CodeContextIn(Strict):
    language: str = "python"
    cwd: str | None = None
    kernel: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None
    id: str | None = None


class ContextIn(Strict):
    context: str


class TimeoutIn(Strict):
    timeout: float = Field(default=10.0, gt=0)


class LogsIn(Strict):
    lines: int | None = Field(default=None, ge=1)


class MetricsIn(Strict):
    since: float | None = None  # a Unix time, or negative: seconds ago
    limit: int | None = Field(default=None, ge=1, le=100_000)


class RemoveBoxIn(Strict):
    force: bool = False


class NetworkIn(Strict):
    network: str | bool | None = None
    allow: list[str] | None = None


class VolumeCreate(Strict):
    """A named volume to create: ``POST /v1/volumes``."""

    name: str
    size_gb: float | None = None  # 10 for a disk volume; a shared one has no size
    labels: dict[str, str] | None = None
    shared: bool = False


class SnapshotIn(Strict):
    name: str | None = None


class RollbackIn(Strict):
    snapshot: str


class DiffIn(Strict):
    a: str | None = None  # "image" (the default), "now", "box:KEY", "snapshot:KEY" or a snapshot
    b: str | None = None  # "now" (the default), or as a
    paths: list[str] | None = Field(default=None, max_length=MOST_AT_ONCE)
    text_limit: int | None = Field(default=None, ge=0, le=64 * 1024 * 1024)


class ForkIn(Strict):
    n: int = Field(default=1, ge=1, le=MOST_AT_ONCE)
    name: str | None = None


class RecordIn(Strict):
    """The flight recorder's policy (``core.recorder.Policy``), or ``on=False`` to stop."""

    on: bool = True
    every: float = Field(default=0.0, ge=0)
    keep_last: int | None = Field(default=None, ge=1)
    keep_for: float | None = Field(default=None, gt=0)


class TimelineIn(Strict):
    after: int = Field(default=0, ge=0)
    limit: int | None = Field(default=None, ge=1)


StepKey = Annotated[str, Field(min_length=1, max_length=63)]


class StepIn(Strict):
    step: StepKey  # its number, or the name it was given
    diff: bool = False  # what it changed in the files, in full (two checkpoints compared)
    text_limit: int | None = Field(default=None, ge=0, le=64 * 1024 * 1024)


class NameStepIn(Strict):
    step: StepKey
    name: str | None = None  # None: the step's name is taken back


class RewindIn(Strict):
    step: StepKey


class ForkAtIn(ForkIn):
    step: StepKey


class PromoteIn(Strict):
    child: str = Field(min_length=1, max_length=128)  # a box started from a state of this one


class PreviewIn(Strict):
    port: int = Field(ge=1, le=65535)
    ttl: float = Field(default=3600, gt=0)
    # the port's own host (``--port-domain``) at its root, not a path; None (not sent) is
    # false: a server older than the field refuses it, even as false
    at_host: bool | None = None


class SnapshotStartIn(ForkIn):
    """Boxes from a snapshot: how many, their name, and what each may have of its own
    (the rest is the snapshot's: its memory, disk and processes)."""

    env: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    workdir: str | None = None
    user: str | None = None
    idle_timeout: float | None = None
    request_timeout: float | None = None
    network: str | None = None
    allow: list[str] | None = None


class PathIn(Strict):
    path: Path_


class StatIn(PathIn):
    follow_symlinks: bool = True
    xattrs: str | None = None  # the extended attributes wanted too, by the start of their names


class ListIn(PathIn):
    xattrs: str | None = None


class SetXattrsIn(PathIn):
    prefix: str = Field(min_length=1)
    values: dict[str, str]


class FileRemoveIn(PathIn):
    recursive: bool = False
    missing_ok: bool = False


class MkdirIn(PathIn):
    parents: bool = True
    mode: int = Field(default=0o755, ge=0, le=0o7777)
    user: str | None = None


class RenameIn(Strict):
    src: Path_
    dst: Path_


class RestoreIn(Strict):
    path: Path_
    snapshot: str


class ChmodIn(PathIn):
    mode: int = Field(ge=0, le=0o7777)


class ChownIn(PathIn):
    user: str = Field(min_length=1)
    follow_symlinks: bool = True


class WriteIn(PathIn):
    """A file's write (``PUT .../files/content`` takes these as its query; the body is the bytes)."""

    mode: int | None = Field(default=None, ge=0, le=0o7777)
    user: str | None = None
    append: bool = False
    parents: bool = True
    exclusive: bool = False


class ReadIn(PathIn):
    offset: int = Field(default=0, ge=0)
    length: int | None = Field(default=None, ge=0)


class WatchIn(PathIn):
    recursive: bool = True


class ArchiveIn(PathIn):
    user: str | None = None  # put: who owns what is unpacked (root if not given)
    follow_symlinks: bool = False  # get: links to what is inside the tree go as what they point to


class ListBoxesIn(Strict):
    state: str | None = None
    label: list[str] = []
    limit: int = Field(default=100, ge=1, le=1000)
    page_token: str | None = None


# -- answers -------------------------------------------------------------------------------


class BoxOut(BaseModel):
    """A box as every transport describes it (``AsyncBox.info``)."""

    id: str
    name: str
    state: str
    image: str | None = None
    labels: dict[str, str] = {}
    created_at: float | None = None
    started_at: float | None = None
    memory_mib: int | None = None
    cpus: int | None = None
    disk_size_gb: int | None = None
    network: str | None = None
    hostname: str | None = None
    engine: str | None = None
    accel: str | None = None
    origin: str | None = None
    reason: str | None = None
    # bytes the box takes in its home beyond its snapshots and its image: its own disk
    # layers and, suspended, its saved state (docs/storage.md); and what they hold
    size: int | None = None
    logical_size: int | None = None
    node: str | None = None  # the fleet node the box lives on (``sandlot.fleet``)


class SnapshotOut(BaseModel):
    """A snapshot or template as every transport describes it (``AsyncSnapshot.info``)."""

    id: str
    name: str | None = None
    kind: str = "snapshot"
    box_id: str | None = None
    box_name: str | None = None
    created_at: float = 0.0
    size: int = 0  # bytes its save added to its home (docs/storage.md)
    logical_size: int = 0  # bytes of state it holds, before sharing and compression
    node: str | None = None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def exec_json(r: ExecResult, *, text: bool = True) -> dict[str, Any]:
    """An exec's answer; ``text=False`` leaves its text fields empty (``ExecIn.output``)."""
    return {"argv": list(r.argv), "exit_code": r.exit_code, "signal": r.signal, "oom_killed": r.oom_killed,
            "duration": r.duration, "pid": r.pid, "stdout": r.stdout if text else "",
            "stderr": r.stderr if text else "", "stdout_b64": b64(r.stdout_bytes),
            "stderr_b64": b64(r.stderr_bytes)}  # fmt: skip


def exec_result(data: Any, argv: tuple[str, ...] = ()) -> ExecResult:
    """An ``ExecResult`` from its JSON (``exec_json``)."""
    if not isinstance(data, Mapping):
        raise ProtocolError(f"an exec's answer is not an object: {data!r:.200}")
    sig = data.get("signal")
    return ExecResult(
        tuple(str(a) for a in data.get("argv") or argv),
        int(data.get("exit_code") or 0),
        output_bytes(data, "stdout"),
        output_bytes(data, "stderr"),
        int(sig) if sig else None,
        float(data.get("duration") or 0.0),
        int(data.get("pid") or 0),
        bool(data.get("oom_killed")),
    )


def file_json(info: FileInfo) -> dict[str, Any]:
    return {"path": info.path, "name": info.name, "type": info.type, "size": info.size, "mode": info.mode,
            "uid": info.uid, "gid": info.gid, "mtime": info.mtime.isoformat(),
            "link_target": info.link_target, "xattrs": info.xattrs}  # fmt: skip


def file_info(data: Any) -> FileInfo:
    """A ``FileInfo`` from its JSON (``mtime`` in ISO 8601)."""
    try:
        mtime = datetime.fromisoformat(str(data["mtime"]))
        if mtime.tzinfo is None:
            mtime = mtime.replace(tzinfo=UTC)
        return FileInfo(path=str(data["path"]), name=str(data["name"]), type=str(data["type"]),
                        size=int(data["size"]), mode=int(data["mode"]), uid=int(data["uid"]),
                        gid=int(data["gid"]), mtime=mtime, link_target=data.get("link_target"),
                        xattrs=_xattrs(data.get("xattrs")))  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"a file's description is malformed ({e}): {data!r:.200}") from None


def _xattrs(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TypeError("xattrs is an object of strings")
    return value


def file_event_json(event: FileEvent) -> dict[str, Any]:
    return {"type": event.type, "path": event.path, "is_dir": event.is_dir, "old_path": event.old_path}


def file_event(msg: Mapping[str, Any], where: str) -> FileEvent:
    """A watch message as the ``FileEvent`` it carries (ProtocolError if it is none)."""
    kind = msg.get("type")
    if kind not in FILE_EVENT_TYPES or not isinstance(msg.get("path"), str):
        raise ProtocolError(f"{where}: not a watch event: {dict(msg)!r:.200}")
    old = msg.get("old_path")
    return FileEvent(kind, msg["path"], bool(msg.get("is_dir")), old if isinstance(old, str) else None)


# -- results: how each operation's value is written as JSON and read back ------------------


@dataclass(frozen=True)
class Codec:
    """A result's JSON form: ``encode`` where the box is, ``decode`` where the caller is.
    ``kind`` tells the facade what the value is (a box's description, boxes, a snapshot...)."""

    kind: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


def _nothing(_value: Any) -> None:
    return None


def _model(model: type[BaseModel]) -> Callable[[Any], dict[str, Any]]:
    def decode(data: Any) -> dict[str, Any]:
        try:
            return model.model_validate(data).model_dump()
        except ValidationError as e:
            raise ProtocolError(f"a {model.__name__} answer is malformed: {e.errors()[:1]}") from None

    return decode


def _many(decode: Callable[[Any], Any], key: str) -> Callable[[Any], list[Any]]:
    def decode_all(data: Any) -> list[Any]:
        items = data.get(key) if isinstance(data, Mapping) else None
        if not isinstance(items, list):
            raise ProtocolError(f"an answer without its list of {key}: {data!r:.200}")
        return [decode(i) for i in items]

    return decode_all


NONE = Codec("none", _nothing, _nothing)
JSON = Codec("json", _same, _same)
TEXT = Codec("text", str, str)
FLOAT = Codec("float", lambda v: {"value": float(v)}, lambda d: float(d["value"]))
BOX = Codec("box", _same, _model(BoxOut))
BOXES = Codec("boxes", lambda v: {"boxes": v}, _many(_model(BoxOut), "boxes"))
SNAPSHOT = Codec("snapshot", _same, _model(SnapshotOut))
SNAPSHOTS = Codec("snapshots", lambda v: {"snapshots": v}, _many(_model(SnapshotOut), "snapshots"))
FILE = Codec("file", file_json, file_info)
FILES = Codec("files", lambda v: {"entries": [file_json(i) for i in v]},
              lambda d: sorted(_many(file_info, "entries")(d), key=lambda i: i.name))  # fmt: skip
ACTIVITY = Codec("activity", lambda v: {"busy": v[0], "idle_s": v[1]},
                 lambda d: (int(d["busy"]), float(d["idle_s"])))  # fmt: skip
NETWORK = Codec("network", _same, _same)
PORTS = Codec("ports", lambda v: {"ports": v}, lambda d: list(d["ports"]))
PROCESSES = Codec("processes", lambda v: {"processes": v}, lambda d: list(d["processes"]))
URL = Codec("url", lambda v: {"url": v}, lambda d: str(d["url"]))


def _context(data: Any) -> Any:
    from .code import CodeContext

    try:
        return CodeContext.from_info(data)
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"a code context's description is malformed ({e}): {data!r:.200}") from None


def _context_json(ctx: Any) -> dict[str, Any]:
    from .code import context_json

    return context_json(ctx)


CONTEXT = Codec("context", _context_json, _context)
CONTEXTS = Codec(
    "contexts", lambda v: {"contexts": [_context_json(c) for c in v]}, _many(_context, "contexts")
)


# -- the operations ------------------------------------------------------------------------

Scope = Literal["box", "files", "snapshot"]
# Who answers an operation: "box", the backend of the box (every transport's); "host",
# the home that serves a remote client, from what it holds for clients (their processes),
# which a local backend has none of; "server", a sandlot serve only (it signs with its key).
Answerer = Literal["box", "host", "server"]


@dataclass(frozen=True)
class Operation:
    """One request and its answer. ``name`` is the method of its ``scope``'s object
    (``AsyncBox``, ``AsyncFiles``, ``AsyncSnapshot``) and of the backends; ``method`` and
    ``path`` its REST route under ``/v1``, whose parameters come from ``params`` (in the
    query for GET and DELETE, and where ``query`` says so; else in a JSON body). An
    operation that makes something (``created``) answers 201; one that answers nothing, 204.

    What a transport must know of an operation is an attribute, never its name:
    ``answers`` (who answers it), ``removes`` (the box is gone after it: a client lets go
    of it, and a box already gone answers as removed), ``describes`` (it reads the box's
    description: a box gone answers as removed), ``stamps`` (the boxes it makes carry the
    labels of the caller's namespace)."""

    scope: Scope
    name: str
    method: str
    path: str
    params: type[Strict]
    result: Codec
    query: bool = False
    summary: str = ""
    created: bool = False
    answers: Answerer = "box"
    removes: bool = False
    describes: bool = False
    stamps: bool = False

    @property
    def status(self) -> int:
        return 204 if self.result.kind == "none" else 201 if self.created else 200

    @property
    def key(self) -> str:
        return f"{self.scope}.{self.name}"

    @property
    def in_query(self) -> bool:
        return self.query or self.method in ("GET", "DELETE")

    @property
    def in_path(self) -> tuple[str, ...]:
        """The arguments the route's path carries (``{context}``), beside the box or snapshot."""
        return tuple(n for n in re.findall(r"{(\w+)}", self.path) if n not in ("box", "snap"))

    @cached_property
    def carried(self) -> type[Strict]:
        """The model of the arguments the query or the body carries: the operation's own,
        but for those its path does (a step's number, a code context's id)."""
        if not self.in_path:
            return self.params
        fields: dict[str, Any] = {
            n: (f.annotation, f) for n, f in self.params.model_fields.items() if n not in self.in_path
        }
        return create_model(f"{self.params.__name__}Carried", __base__=Strict, **fields)

    def url(self, target: str, params: Mapping[str, Any]) -> str:
        """The route's path for ``target`` (a box's or a snapshot's id) and ``params``."""
        values = {n: quote(str(params[n]), safe="") for n in self.in_path}
        return self.path.format(box=quote(target, safe=""), snap=quote(target, safe=""), **values)

    def arguments(self, values: Mapping[str, Any]) -> Any:
        """The operation's arguments as its model (InvalidArgument for what cannot be one)."""
        return validated(self.params, {k: v for k, v in values.items() if v is not None})


def _ops(scope: Scope, base: str, rows: tuple[tuple[Any, ...], ...]) -> tuple[Operation, ...]:
    """Operations of one scope: (name, "METHOD path under base[ 201]", params, result, summary[,
    attributes]), the attributes a mapping (``query``, ``answers``, ``removes``...)."""
    out = []
    for name, route, params, result, summary, *attributes in rows:
        method, path, *created = route.split(" ")
        given = attributes[0] if attributes else {}
        out.append(Operation(scope, name, method, base + path, params, result, summary=summary,
                             created=created == ["201"], **given))  # fmt: skip
    return tuple(out)


QUERY, REMOVES, DESCRIBES = {"query": True}, {"removes": True}, {"describes": True}
HOST, SERVER = {"answers": "host"}, {"answers": "server"}


CTX = "/code/contexts/{context}"
OPERATIONS: tuple[Operation, ...] = (
    *_ops("box", "/boxes/{box}", (
        ("refresh", "GET ", Empty, BOX, "The box's description, read anew.", DESCRIBES),
        ("inspect", "GET /inspect", Empty, JSON, "Everything about the box."),
        ("stats", "GET /stats", Empty, JSON, "Host CPU, memory and disk use."),
        ("logs", "GET /logs", LogsIn, TEXT, "The guest console of the last boot."),
        ("metrics", "GET /metrics", MetricsIn, JSON, "Sampled CPU, memory, disk, network and commands."),
        ("start", "POST /start", Empty, BOX, "Boot the box."),
        ("stop", "POST /stop", TimeoutIn, BOX, "Stop gracefully.", QUERY),
        ("restart", "POST /restart", TimeoutIn, BOX, "Stop, then start.", QUERY),
        ("kill", "POST /kill", Empty, BOX, "Stop at once."),
        ("pause", "POST /pause", Empty, BOX, "Freeze the vCPUs."),
        ("unpause", "POST /unpause", Empty, BOX, "Thaw the vCPUs."),
        ("suspend", "POST /suspend", Empty, BOX, "Save the running state, end the VM."),
        ("resume", "POST /resume", Empty, BOX, "Bring a suspended box back."),
        ("remove", "DELETE ", RemoveBoxIn, NONE, "Delete the box.", REMOVES),
        ("set_network", "PUT /network", NetworkIn, NETWORK, "Change the egress policy."),
        ("ports", "GET /ports", Empty, PORTS, "The published ports."),
        ("ping", "GET /ping", Empty, FLOAT, "The agent's round trip, in seconds."),
        ("activity", "GET /activity", Empty, ACTIVITY, "What the idle timeout sees."),
        ("snapshot", "POST /snapshots 201", SnapshotIn, SNAPSHOT, "Save the running state."),
        ("snapshots", "GET /snapshots", Empty, SNAPSHOTS, "The box's snapshots."),
        ("rollback", "POST /rollback", RollbackIn, BOX, "Back to a snapshot."),
        ("fork", "POST /fork 201", ForkIn, BOXES, "Running copies of the box."),
        ("diff", "POST /diff", DiffIn, JSON, "What changed in its files between two states."),
        ("record", "PUT /recording", RecordIn, JSON, "Record every step with its state, or stop."),
        ("timeline", "GET /timeline", TimelineIn, JSON, "The steps recorded, oldest first."),
        ("step", "GET /timeline/{step}", StepIn, JSON, "One recorded step; its diff on request."),
        ("name_step", "PUT /timeline/{step}/name", NameStepIn, JSON, "Name a step: kept for good."),
        ("rewind", "POST /rewind", RewindIn, BOX, "Back, in place, to just after a step."),
        ("fork_at", "POST /fork_at 201", ForkAtIn, BOXES, "Running boxes from just after a step."),
        ("promote", "POST /promote", PromoteIn, SNAPSHOT, "A fork takes the box's place; the old kept."),
        ("processes", "GET /processes", Empty, PROCESSES, "The processes the host holds for the box.", HOST),
        ("preview_url", "POST /previews 201", PreviewIn, URL, "A signed URL to a port.", SERVER),
        ("create_code_context", "POST /code/contexts 201", CodeContextIn, CONTEXT, "Start an interpreter."),
        ("list_code_contexts", "GET /code/contexts", Empty, CONTEXTS, "The interpreters running."),
        ("interrupt_code_context", f"POST {CTX}/interrupt", ContextIn, NONE, "Interrupt a context's cell."),
        ("restart_code_context", f"POST {CTX}/restart", ContextIn, CONTEXT, "Start its interpreter afresh."),
        ("remove_code_context", f"DELETE {CTX}", ContextIn, NONE, "End a context and forget it."),
    )),
    *_ops("files", "/boxes/{box}/files", (
        ("stat", "GET /stat", StatIn, FILE, "A path's description."),
        ("list", "GET ", ListIn, FILES, "A directory's entries."),
        ("set_xattrs", "POST /xattrs", SetXattrsIn, NONE, "Set a path's extended attributes."),
        ("mkdir", "POST /mkdir", MkdirIn, NONE, "Make a directory."),
        ("remove", "DELETE ", FileRemoveIn, NONE, "Remove a path."),
        ("rename", "POST /rename", RenameIn, NONE, "Rename a path."),
        ("chmod", "POST /chmod", ChmodIn, NONE, "Change a path's mode."),
        ("chown", "POST /chown", ChownIn, NONE, "Change a path's owner."),
        ("restore", "POST /restore", RestoreIn, JSON, "Bring a path back from a snapshot."),
    )),
    *_ops("snapshot", "/snapshots/{snap}", (
        ("inspect", "GET /inspect", Empty, JSON, "Everything about a snapshot."),
        ("start", "POST /start 201", SnapshotStartIn, BOXES, "Boxes from a snapshot.", {"stamps": True}),
        ("remove", "DELETE ", Empty, NONE, "Delete a snapshot."),
    )),
)  # fmt: skip
BY_KEY: dict[str, Operation] = {op.key: op for op in OPERATIONS}
assert len(BY_KEY) == len(OPERATIONS), "one operation per scope and name"


def operation(scope: Scope, name: str) -> Operation:
    return BY_KEY[f"{scope}.{name}"]


# -- the streams ---------------------------------------------------------------------------

StreamKind = Literal["server", "client"]
Frames = Literal["bytes", "json"]


@dataclass(frozen=True)
class Stream:
    """An operation whose answer (``kind`` "server") or request (``kind`` "client") is a
    stream of ``frames``: bytes (a file, a tar), or JSON messages (a watch's, a cell's),
    each NDJSON line over HTTP and an item of a Ray stream. ``name`` is the backend's
    primitive (``Backend.read``...), which the facade of its ``scope`` builds on; the
    home that holds the box runs it by its key (``api/host.py``'s ``STREAMED``). A
    client stream's answer is JSON. ``noted``: a tar whose failure part way is noted in
    the stream itself, which then ends there rather than breaking off."""

    scope: Scope
    name: str
    kind: StreamKind
    method: str
    path: str
    params: type[Strict]
    frames: Frames
    media_type: str
    summary: str
    noted: bool = False
    # a stream that lasts as long as its client keeps it (a watch): a GET, which an audit
    # trail leaves out, yet it reads the box all that time: its start and end are entries
    lasting: bool = False
    live: bool = False  # bytes worth having as soon as they come (a console), not gathered in chunks
    # it may say nothing for as long as the box works (a cell, a big tree's tar, a quiet
    # console): a client gives it no deadline between two frames
    quiet: bool = False
    audit: Callable[[Any], dict[str, Any]] | None = None  # what of its arguments an audit entry says

    @property
    def key(self) -> str:
        return f"{self.scope}.{self.name}"

    @property
    def in_query(self) -> bool:
        """Its arguments travel in the query (a client stream's body is its stream)."""
        return self.kind == "client" or self.method == "GET"

    def url(self, box: str) -> str:
        return self.path.format(box=quote(box, safe=""))

    def arguments(self, values: Mapping[str, Any]) -> Any:
        return validated(self.params, {k: v for k, v in values.items() if v is not None})

    @staticmethod
    def fields(params: Strict) -> dict[str, Any]:
        """Its arguments as they travel: those given (a default is the far side's)."""
        fields: dict[str, Any] = params.model_dump(exclude_unset=True, exclude_none=True)
        return fields


NDJSON, OCTETS, TAR = "application/x-ndjson", "application/octet-stream", "application/x-tar"
IN_FILES = "/boxes/{box}/files"
STREAMS: tuple[Stream, ...] = (
    Stream("files", "read", "server", "GET", f"{IN_FILES}/content", ReadIn, "bytes", OCTETS,
           "The file's bytes, from ``offset``, ``length`` of them (all: none)."),
    Stream("files", "get_archive", "server", "GET", f"{IN_FILES}/archive", ArchiveIn, "bytes", TAR,
           "The directory ``path`` as a tar stream, links kept as links (``follow_symlinks``: those to what "
           "is inside the tree carried as what they point to). A failure part way ends the stream with a "
           "global header naming the entry (``SANDLOT.error.path``) and no end-of-archive blocks, so no "
           "reader takes it for whole.", noted=True, quiet=True),
    Stream("files", "watch", "server", "GET", f"{IN_FILES}/watch", WatchIn, "json", NDJSON,
           "Changes under a path as they happen: ``{\"type\": \"watching\"}`` once the watch holds, then "
           "one ``FileEvent`` a message, ``{\"type\": \"ping\"}`` after 15 s of quiet, and last "
           "``{\"type\": \"end\"}`` (the path or the box went away) or an error. A missing path "
           "answers 404 before the stream.", lasting=True),
    Stream("box", "run_code", "server", "POST", "/boxes/{box}/code", RunCodeIn, "json", NDJSON,
           "Run a cell in the box's interpreter, its events as they come: ``{\"type\": "
           "\"stdout\"|\"stderr\", \"text\"}``, ``{\"type\": \"result\", \"result\": BUNDLE}``, then one "
           "``{\"type\": \"execution\", ...}`` or an error (a CodeTimeout carries the execution so "
           "far). A client that leaves mid-cell interrupts it.", quiet=True,
           audit=lambda p: {"language": p.language, "context": p.context, "code_bytes": len(p.code)}),
    Stream("box", "follow_logs", "server", "GET", "/boxes/{box}/logs/follow", LogsIn, "bytes",
           "text/plain; charset=utf-8", "The guest console of the last boot (its last ``lines``), then "
           "what the guest writes to it as it comes, until the box stops running.", live=True, quiet=True),
    Stream("files", "write", "client", "PUT", f"{IN_FILES}/content", WriteIn, "bytes", OCTETS,
           "Write the body to the file, streamed (atomically replaced when complete; ``append`` adds "
           "to its end; ``exclusive``: 409 if it exists; ``user`` owns it); answers the file's "
           "description."),
    Stream("files", "put_archive", "client", "PUT", f"{IN_FILES}/archive", ArchiveIn, "bytes", TAR,
           "Unpack the body's tar stream into the directory ``path``, owned by ``user`` if given, "
           "whole or not at all; answers ``{\"entries\", \"bytes\", \"skipped\"}``, and a refusal "
           "names the entry (``transfer_error``, 422)."),
)  # fmt: skip
STREAM_BY_KEY: dict[str, Stream] = {s.key: s for s in STREAMS}
assert len(STREAM_BY_KEY) == len(STREAMS), "one stream per scope and name"
