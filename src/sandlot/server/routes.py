"""The REST and WebSocket routes of docs/server.md: each translates a request into
calls of the public API on the server's home, seen through the caller's namespace."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from starlette.websockets import WebSocketDisconnect

from ..api.box import AsyncBox, AsyncSnapshot
from ..api.code import CodeContext, Result, context_id
from ..api.templates import import_snapshot_async
from ..errors import (
    BoxNotFound,
    InvalidArgument,
    QuotaExceeded,
    RequestError,
    SandlotError,
    SnapshotNotFound,
)
from ..net.secrets import Secret
from . import tarstream
from .models import (
    BoxCreate,
    ChmodIn,
    ChownIn,
    CodeContextIn,
    ExecCall,
    ExecIn,
    ForkIn,
    MkdirIn,
    NetworkIn,
    RenameIn,
    RollbackIn,
    RunCodeIn,
    SnapshotIn,
    SnapshotStartIn,
    box_json,
    error_json,
    exec_json,
    file_json,
    snapshot_json,
)
from .state import KEY_LABEL, NAMESPACE_LABEL, Caller, ServerState
from .streams import STDERR, STDOUT, error_message, serve, spawn

router = APIRouter()
PAGE_MAX = 1000
UPLOAD_CHUNK = 1 << 20


def _server(request: Request | WebSocket) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def _caller(request: Request) -> Caller:
    caller: Caller = request.state.caller
    return caller


async def _box(request: Request | WebSocket, key: str, caller: Caller) -> AsyncBox:
    """The box ``key`` names, as 404 when the caller may not see it (ids do not leak).

    A box asked for by its full id is kept as a handle (ids are never reused), which
    saves a store read on every request; a name or prefix is looked up each time,
    since another process may give a name to a new box."""
    handles = _server(request).handles
    box = handles.get(key)
    if box is not None and box.state == "removed":
        del handles[key]
        box = None
    if box is None:
        try:
            box = await AsyncBox.get(key, home=_server(request).home)
        except BoxNotFound:
            raise BoxNotFound(f"no box {key!r}", box=key) from None
        if box.id == key:
            handles[key] = box
    if not caller.may_see(box.info["labels"]):
        raise BoxNotFound(f"no box {key!r}", box=key)
    if isinstance(request, Request):
        request.state.box_id = box.id
    return box


async def box_for(request: Request, key: str) -> AsyncBox:
    return await _box(request, key, _caller(request))


def _snapshot_labels(snap: AsyncSnapshot) -> dict[str, str]:
    labels: dict[str, str] = (snap.record.options.get("box") or {}).get("labels") or {}
    return labels


async def snapshot_for(request: Request, key: str) -> AsyncSnapshot:
    caller = _caller(request)
    try:
        snap = await AsyncSnapshot.get(key, home=_server(request).home)
    except SnapshotNotFound:
        raise SnapshotNotFound(f"no snapshot {key!r}") from None
    except InvalidArgument:
        # a name (or id prefix) that several snapshots of the home share: the store's error
        # names their boxes, other namespaces' too, so choose among the caller's own instead
        return await _visible_snapshot(request, caller, key)
    if not caller.may_see(_snapshot_labels(snap)):
        raise SnapshotNotFound(f"no snapshot {key!r}")
    return snap


async def _visible_snapshot(request: Request, caller: Caller, key: str) -> AsyncSnapshot:
    visible = [s for s in await AsyncSnapshot.list(home=_server(request).home)
               if caller.may_see(_snapshot_labels(s))]  # fmt: skip
    found = [s for s in visible if s.name == key] or [s for s in visible if s.id.startswith(key)]
    if not found:
        raise SnapshotNotFound(f"no snapshot {key!r}")
    if len(found) > 1:
        owners = ", ".join(sorted({s.box_name or "?" for s in found}))
        raise InvalidArgument(f"snapshot {key!r} is ambiguous (boxes {owners}): use its id")
    return found[0]


# -- quotas ---------------------------------------------------------------------------


async def check_quota(request: Request, n: int, memory_mib: int, disk_gb: int) -> None:
    """Refuse (429) ``n`` more boxes of this size if they would take the caller's key over a quota."""
    caller = _caller(request)
    q = caller.quotas
    if q is None or (q.boxes is None and q.memory_mib is None and q.disk_gb is None):
        return
    mine = {NAMESPACE_LABEL: caller.namespace} if caller.namespace else {KEY_LABEL: caller.key_id or ""}
    boxes = await AsyncBox.list(labels=mine, home=_server(request).home)
    used_memory = sum(int(b.info["options"].get("memory_mib") or 0) for b in boxes)
    used_disk = sum(int(b.info["options"].get("disk_size_gb") or 0) for b in boxes)
    for limit, have, adding, most in (
        ("boxes", len(boxes), n, q.boxes),
        ("memory_mib", used_memory, n * memory_mib, q.memory_mib),
        ("disk_gb", used_disk, n * disk_gb, q.disk_gb),
    ):
        if most is not None and have + adding > most:
            raise QuotaExceeded(
                f"the key's quota of {limit} is {most}: {have} in use, {adding} more asked",
                limit=limit, value=most,
            )  # fmt: skip


def _check_network(caller: Caller, network: object) -> None:
    """Open networking reaches the server's host: only admin keys may ask for it."""
    if network == "open":
        caller.require_admin("network='open' (it reaches the host)")


def _stamped(caller: Caller, labels: dict[str, str] | None) -> dict[str, str]:
    labels = dict(labels or {})
    if not caller.admin and any(k.startswith("sandlot.") for k in labels):
        raise InvalidArgument("labels starting with 'sandlot.' are the server's")
    if caller.namespace:
        labels[NAMESPACE_LABEL] = caller.namespace
    if caller.key_id:
        labels[KEY_LABEL] = caller.key_id
    return labels


def _inherited(caller: Caller, snap: AsyncSnapshot) -> dict[str, str]:
    """The labels of boxes started from ``snap``: its box's own, stamped for the caller
    (the server's labels are the caller's, never the snapshot's)."""
    own = {k: v for k, v in _snapshot_labels(snap).items() if not k.startswith("sandlot.")}
    return _stamped(caller, own)


# -- boxes ----------------------------------------------------------------------------


@router.post("/boxes", status_code=201, tags=["boxes"])
async def create_box(body: BoxCreate, request: Request, response: Response) -> dict[str, Any]:
    """Create a box from an image, a template or a snapshot, and start it unless ``start`` is false."""
    caller = _caller(request)
    server = _server(request)
    for host_path in ("rootfs", "kernel", "ca_cert"):
        if getattr(body, host_path) is not None:
            caller.require_admin(f"{host_path} (a host path)")
    _check_network(caller, body.network)
    options: dict[str, Any] = body.model_dump(exclude_none=True, exclude={"start", "snapshot", "secrets",
                                                                         "ports"})  # fmt: skip
    options["labels"] = _stamped(caller, body.labels)
    if body.ports is not None:
        options["ports"] = [f"{p.host}:{p.guest}" if p.host else str(p.guest) for p in body.ports]
    if body.secrets is not None:
        options["secrets"] = [Secret(s.name, s.value, hosts=s.hosts) for s in body.secrets]
    memory = int(options.get("memory_mib") or 256)
    disk = int(options.get("disk_size_gb") or 0)
    async with _create_lock(server, caller):
        await check_quota(request, 1, memory, disk)
        if body.snapshot is not None:
            snap = await snapshot_for(request, body.snapshot)
            start_options = {k: v for k, v in options.items() if k not in ("image", "template", "name")}
            box = (await snap.start(1, name=body.name, **start_options))[0]
        else:
            if body.template is not None:
                options["template"] = (await snapshot_for(request, body.template)).id
            image = options.pop("image", None)
            if body.start:
                box = await AsyncBox(image, keep=True, home=server.home, **options).start()
            else:
                box = await AsyncBox.create(image, keep=True, home=server.home, **options)
    request.state.box_id = box.id
    response.headers["Location"] = f"/v1/boxes/{box.id}"
    return box_json(box)


def _create_lock(server: ServerState, caller: Caller) -> asyncio.Lock:
    """Creations of one key or namespace in turn, so two cannot both pass a quota."""
    return server.quota_locks.setdefault(caller.namespace or caller.key_id or "", asyncio.Lock())


@router.get("/boxes", tags=["boxes"])
async def list_boxes(
    request: Request,
    state: str | None = None,
    label: Annotated[list[str] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=PAGE_MAX)] = 100,
    page_token: str | None = None,
) -> dict[str, Any]:
    """Boxes the caller may see, oldest first, a page at a time."""
    labels = {}
    for item in label or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidArgument(f"label filter {item!r} is not KEY=VALUE")
        labels[k] = v
    caller = _caller(request)
    boxes = [b for b in await AsyncBox.list(state=state, labels=labels or None, home=_server(request).home)
             if caller.may_see(b.info["labels"])]  # fmt: skip
    after = _page_after(page_token)
    if after is not None:
        boxes = [b for b in boxes if (b.info["created_at"], b.id) > after]
    page = boxes[:limit]
    token = None
    if len(boxes) > limit:
        last = page[-1]
        token = base64.urlsafe_b64encode(json.dumps([last.info["created_at"], last.id]).encode()).decode()
    return {"boxes": [box_json(b) for b in page], "next_page_token": token}


def _page_after(token: str | None) -> tuple[float, str] | None:
    if token is None:
        return None
    try:
        at, box_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(at), str(box_id)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidArgument("page_token is malformed") from None


@router.get("/boxes/{box}", tags=["boxes"])
async def get_box(box: str, request: Request) -> dict[str, Any]:
    return box_json(await box_for(request, box))


@router.delete("/boxes/{box}", status_code=204, tags=["boxes"])
async def remove_box(box: str, request: Request, force: bool = False) -> Response:
    b = await box_for(request, box)
    await b.remove(force=force)
    return Response(status_code=204)


async def _lifecycle(request: Request, key: str, op: str, timeout: float | None) -> dict[str, Any]:
    b = await box_for(request, key)
    if op in ("stop", "restart"):
        await getattr(b, op)(timeout if timeout is not None else 10.0)
    else:
        await getattr(b, op)()
    await b.refresh()
    return box_json(b)


for _op in ("start", "stop", "restart", "kill", "pause", "unpause", "suspend", "resume"):

    def _route(op: str) -> Any:
        async def lifecycle(box: str, request: Request, timeout: float | None = None) -> dict[str, Any]:
            return await _lifecycle(request, box, op, timeout)

        lifecycle.__name__ = f"{op}_box"
        lifecycle.__doc__ = f"{op.capitalize()} the box (the library's ``{op}()``)."
        return lifecycle

    router.post(f"/boxes/{{box}}/{_op}", tags=["boxes"])(_route(_op))


@router.get("/boxes/{box}/inspect", tags=["boxes"])
async def inspect_box(box: str, request: Request) -> dict[str, Any]:
    return await (await box_for(request, box)).inspect()


@router.get("/boxes/{box}/stats", tags=["boxes"])
async def box_stats(box: str, request: Request) -> dict[str, Any]:
    return await (await box_for(request, box)).stats()


@router.get("/boxes/{box}/logs", tags=["boxes"])
async def box_logs(box: str, request: Request, lines: Annotated[int | None, Query(ge=1)] = None,
                   follow: bool = False) -> Response:  # fmt: skip
    """The guest console of the last boot; ``follow`` streams it as it grows while the box runs."""
    b = await box_for(request, box)
    text = await b.logs(lines)
    if not follow:
        return Response(text, media_type="text/plain; charset=utf-8")
    path = b.runtime.box_dir(b.id) / "console.log"

    async def growing() -> AsyncIterator[bytes]:
        yield text.encode()
        at = path.stat().st_size if path.exists() else 0
        while not await request.is_disconnected():
            size = path.stat().st_size if path.exists() else 0
            if size < at:  # a new boot began a new console
                at = 0
            if size > at:
                with open(path, "rb") as f:
                    f.seek(at)
                    chunk = f.read(size - at)
                at += len(chunk)
                yield chunk
            elif await b.refresh() not in ("running", "paused"):
                return
            await asyncio.sleep(0.2)

    return StreamingResponse(growing(), media_type="text/plain; charset=utf-8")


@router.get("/boxes/{box}/network", tags=["network"])
async def get_network(box: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    net = (await b.inspect())["network"]
    return {"network": net.get("mode"), "allow": net.get("allow", [])}


@router.put("/boxes/{box}/network", tags=["network"])
async def put_network(box: str, body: NetworkIn, request: Request) -> dict[str, Any]:
    _check_network(_caller(request), body.network)
    b = await box_for(request, box)
    await b.set_network(body.network, allow=body.allow)
    net = (await b.inspect())["network"]
    return {"network": net.get("mode"), "allow": net.get("allow", [])}


@router.get("/boxes/{box}/ports", tags=["network"])
async def get_ports(box: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    return {"ports": (await b.inspect())["network"]["ports"]}


# -- exec -----------------------------------------------------------------------------


@router.post("/boxes/{box}/exec", tags=["exec"])
async def exec_box(box: str, body: ExecIn, request: Request) -> dict[str, Any]:
    """Run a command to completion and answer its exit code and output."""
    b = await box_for(request, box)
    audit: dict[str, Any] = {"argv": body.argv}
    request.state.audit = audit
    return await _run_exec(b, body, audit)


async def _run_exec(box: AsyncBox, body: ExecIn, audit: dict[str, Any]) -> dict[str, Any]:
    """One exec of the REST route or the exec channel: its answer, and ``exit_code`` in ``audit``."""
    stdin: bytes | None = None
    if body.stdin is not None and body.stdin_b64 is not None:
        raise InvalidArgument("give stdin or stdin_b64, not both")
    if body.stdin is not None:
        stdin = body.stdin.encode()
    elif body.stdin_b64 is not None:
        try:
            stdin = base64.b64decode(body.stdin_b64, validate=True)
        except binascii.Error:
            raise InvalidArgument("stdin_b64 is not base64") from None
    result = await box.exec(*body.argv, env=body.env, cwd=body.cwd, user=body.user, stdin=stdin,
                            timeout=body.timeout)  # fmt: skip
    audit["exit_code"] = result.exit_code
    return exec_json(result)


EXEC_CHANNEL_IN_FLIGHT = 64  # execs of one channel running at once; more wait for a slot


@router.websocket("/exec")
async def exec_channel(ws: WebSocket) -> None:
    """One-shot execs of any visible boxes over one WebSocket, many at once.

    Each text message is an exec (``ExecCall``: the REST route's body with an ``id``
    and a ``box``); each answer ``{"id", "result"}`` (the REST route's answer) or
    ``{"id", "error"}`` (its error shape), in the order they finish. It saves the
    HTTP request of each exec: the remote client's ``exec`` goes this way. Execs are
    audited as ``POST /v1/boxes/{box}/exec``. A refused key, or a message that is
    not an ExecCall, is answered with ``"id": null`` and ends the channel (1008)."""
    server = _server(ws)
    await ws.accept()
    try:
        caller = await server.caller(ws.headers)
    except SandlotError as e:
        await ws.send_json({"id": None, "error": error_json(e)})
        await ws.close(1008)
        return
    slots = asyncio.Semaphore(EXEC_CHANNEL_IN_FLIGHT)
    sending = asyncio.Lock()

    async def answer(message: dict[str, Any]) -> None:
        async with sending:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):  # the client left
                await ws.send_text(json.dumps(message))

    async def run(call: ExecCall) -> None:
        t0 = asyncio.get_running_loop().time()
        audit: dict[str, Any] = {"argv": call.argv}
        status, code, box_id = 200, None, call.box
        try:
            b = await _box(ws, call.box, caller)
            box_id = b.id
            await answer({"id": call.id, "result": await _run_exec(b, call, audit)})
        except SandlotError as e:
            status, code = e.status, e.code
            await answer({"id": call.id, "error": error_json(e)})
        finally:
            slots.release()
            duration = asyncio.get_running_loop().time() - t0
            server.record(caller, "POST /v1/boxes/{box}/exec", box_id, status, code, duration, audit)

    try:
        while True:
            text = await ws.receive_text()
            try:
                call = ExecCall.model_validate_json(text)
            except ValueError as e:
                await answer({"id": None, "error": error_json(RequestError(f"not an exec call: {e}"))})
                await ws.close(1008)
                return
            await slots.acquire()
            task = asyncio.ensure_future(run(call))
            _channel_tasks.add(task)
            task.add_done_callback(_channel_tasks.discard)
    except (WebSocketDisconnect, RuntimeError, KeyError):
        return  # the client left (a text frame expected: a binary one reads as KeyError)


_channel_tasks: set[asyncio.Task[None]] = set()  # execs under way: kept from the collector


@router.get("/boxes/{box}/processes", tags=["exec"])
async def list_processes(box: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    server = _server(request)
    await server.take_over(b)
    return {"processes": [h.describe() for h in server.processes.of_box(b.id)]}


async def ws_box(ws: WebSocket, key: str, accept: bool = True) -> tuple[ServerState, Caller, AsyncBox] | None:
    """Authenticate a WebSocket and find its box; on failure answer in the error shape and
    close. ``accept=False`` leaves accepting to the caller (unless it fails here)."""
    server = _server(ws)
    if accept:
        await ws.accept()
    try:
        caller = await server.caller(ws.headers)
        return server, caller, await _box(ws, key, caller)
    except SandlotError as e:
        if not accept:
            await ws.accept()
        await ws.send_json(error_message(e))
        await ws.close(1008)
        return None


@router.websocket("/boxes/{box}/spawn")
async def spawn_ws(ws: WebSocket, box: str) -> None:
    """Start a process and stream it (frames in docs/server.md)."""
    found = await ws_box(ws, box)
    if found is None:
        return
    server, caller, b = found
    with contextlib.suppress(WebSocketDisconnect):
        await spawn(ws, b, server.processes, server.exited_by(caller))


@router.websocket("/boxes/{box}/processes/{process}/attach")
async def attach_ws(ws: WebSocket, box: str, process: str, stdout: int = 0, stderr: int = 0) -> None:
    """Reattach to a process from the offsets the client has."""
    found = await ws_box(ws, box)
    if found is None:
        return
    server, _, b = found
    held = server.processes.get(b.id, process)
    if held is None:  # a server before this one started it (and its take-over may be under way)
        await server.take_over(b)
        held = server.processes.get(b.id, process)
    if held is None or stdout < 0 or stderr < 0:
        err = RequestError(f"no process {process!r} in box {b.name}") if held is None else \
            RequestError("offsets must be >= 0")  # fmt: skip
        await ws.send_json(error_message(err))
        await ws.close(1008)
        return
    with contextlib.suppress(WebSocketDisconnect):
        await serve(ws, held, {STDOUT: stdout, STDERR: stderr})


# -- code -----------------------------------------------------------------------------


@router.post("/boxes/{box}/code", tags=["code"])
async def run_code(box: str, body: RunCodeIn, request: Request) -> Response:
    """Run a cell in the box's interpreter. The answer streams as JSON lines, as the cell
    goes: ``{"type": "stdout"|"stderr", "text"}``, ``{"type": "result", "result": BUNDLE}``
    (MIME type -> value, PNG and JPEG in base64, plus ``is_main_result``), then one
    ``{"type": "execution", "execution": {...}}`` or ``{"type": "error", "error": {...}}``
    (a CodeTimeout carries the execution so far). A client that leaves mid-cell
    interrupts it."""
    b = await box_for(request, box)
    request.state.audit = {"language": body.language, "context": body.context, "code_bytes": len(body.code)}
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def cell() -> None:
        try:
            execution = await b.run_code(
                body.code, language=body.language, context=body.context, timeout=body.timeout,
                on_stdout=lambda text: events.put_nowait({"type": "stdout", "text": text}),
                on_stderr=lambda text: events.put_nowait({"type": "stderr", "text": text}),
                on_result=lambda r: events.put_nowait({"type": "result", "result": _result_json(r)}),
            )  # fmt: skip
            events.put_nowait({"type": "execution", "execution": execution.to_dict()})
        except SandlotError as e:
            events.put_nowait({"type": "error", "error": error_json(e)})
        finally:
            events.put_nowait(None)

    task = asyncio.ensure_future(cell())

    async def lines() -> AsyncIterator[bytes]:
        try:
            while (event := await events.get()) is not None:
                yield (json.dumps(event) + "\n").encode()
        finally:
            if not task.done():  # the client left mid-cell
                task.cancel()
                with contextlib.suppress(SandlotError):
                    await b.interrupt_code_context(context_id(body.context, body.language))

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _result_json(result: Result) -> dict[str, Any]:
    return dict(result.to_bundle(), is_main_result=result.is_main_result)


def _context_json(ctx: CodeContext) -> dict[str, Any]:
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd, "kernel": ctx.kernel}


@router.get("/boxes/{box}/code/contexts", tags=["code"])
async def list_code_contexts(box: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    return {"contexts": [_context_json(c) for c in await b.list_code_contexts()]}


@router.post("/boxes/{box}/code/contexts", tags=["code"], status_code=201)
async def create_code_context(box: str, body: CodeContextIn, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    ctx = await b.create_code_context(language=body.language, cwd=body.cwd, kernel=body.kernel,
                                      env=body.env, user=body.user)  # fmt: skip
    return _context_json(ctx)


@router.post("/boxes/{box}/code/contexts/{context}/interrupt", tags=["code"], status_code=204)
async def interrupt_code_context(box: str, context: str, request: Request) -> Response:
    b = await box_for(request, box)
    await b.interrupt_code_context(context)
    return Response(status_code=204)


@router.post("/boxes/{box}/code/contexts/{context}/restart", tags=["code"])
async def restart_code_context(box: str, context: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    return _context_json(await b.restart_code_context(context))


@router.delete("/boxes/{box}/code/contexts/{context}", tags=["code"], status_code=204)
async def remove_code_context(box: str, context: str, request: Request) -> Response:
    b = await box_for(request, box)
    await b.remove_code_context(context)
    return Response(status_code=204)


# -- files ----------------------------------------------------------------------------


@router.get("/boxes/{box}/files/content", tags=["files"])
async def read_file(box: str, path: str, request: Request, offset: Annotated[int, Query(ge=0)] = 0,
                    length: Annotated[int | None, Query(ge=0)] = None) -> Response:  # fmt: skip
    """The file's bytes, streamed."""
    b = await box_for(request, box)
    chunks = b.files.iter_read(path, offset=offset, length=length)
    first = await anext(chunks, b"")  # errors (no such file) answer before the stream begins

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return StreamingResponse(body(), media_type="application/octet-stream")


@router.put("/boxes/{box}/files/content", tags=["files"])
async def write_file(
    box: str,
    path: str,
    request: Request,
    mode: Annotated[int | None, Query(ge=0, le=0o7777)] = None,
    user: str | None = None,
    append: bool = False,
    parents: bool = True,
    exclusive: bool = False,
) -> dict[str, Any]:
    """Write the request body to the file, streamed (atomically replaced when complete;
    ``append`` adds to its end; ``exclusive``: 409 if it exists; ``user`` owns it)."""
    b = await box_for(request, box)

    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            if chunk:
                yield chunk

    await b.files.write(
        path, chunks(), mode=mode, user=user, append=append, parents=parents, exclusive=exclusive
    )
    return file_json(await b.files.stat(path))


@router.get("/boxes/{box}/files", tags=["files"])
async def list_files(box: str, path: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    return {"entries": [file_json(i) for i in await b.files.list(path)]}


@router.get("/boxes/{box}/files/stat", tags=["files"])
async def stat_file(box: str, path: str, request: Request, follow_symlinks: bool = True) -> dict[str, Any]:
    b = await box_for(request, box)
    return file_json(await b.files.stat(path, follow_symlinks=follow_symlinks))


@router.post("/boxes/{box}/files/mkdir", status_code=204, tags=["files"])
async def mkdir(box: str, body: MkdirIn, request: Request) -> Response:
    b = await box_for(request, box)
    if body.mode is None:
        await b.files.mkdir(body.path, parents=body.parents, user=body.user)
    else:
        await b.files.mkdir(body.path, parents=body.parents, mode=body.mode, user=body.user)
    return Response(status_code=204)


@router.post("/boxes/{box}/files/rename", status_code=204, tags=["files"])
async def rename(box: str, body: RenameIn, request: Request) -> Response:
    await (await box_for(request, box)).files.rename(body.src, body.dst)
    return Response(status_code=204)


@router.post("/boxes/{box}/files/chmod", status_code=204, tags=["files"])
async def chmod(box: str, body: ChmodIn, request: Request) -> Response:
    await (await box_for(request, box)).files.chmod(body.path, body.mode)
    return Response(status_code=204)


@router.post("/boxes/{box}/files/chown", status_code=204, tags=["files"])
async def chown(box: str, body: ChownIn, request: Request) -> Response:
    b = await box_for(request, box)
    await b.files.chown(body.path, body.user, follow_symlinks=body.follow_symlinks)
    return Response(status_code=204)


@router.delete("/boxes/{box}/files", status_code=204, tags=["files"])
async def remove_file(box: str, path: str, request: Request, recursive: bool = False) -> Response:
    await (await box_for(request, box)).files.remove(path, recursive=recursive)
    return Response(status_code=204)


WATCH_HEARTBEAT = 15.0  # seconds of quiet after which a watch stream says it is still there


@router.get("/boxes/{box}/files/watch", tags=["files"])
async def watch_files(box: str, path: str, request: Request, recursive: bool = True) -> Response:
    """Changes under a path as they happen, as NDJSON: ``{"type": "watching"}`` once the
    watch holds, then one ``FileEvent`` a line, ``{"type": "ping"}`` after 15 s of
    quiet, and last ``{"type": "end"}`` (the path or the box went away) or
    ``{"type": "error", "error": {...}}``. A missing path answers 404 before the stream."""
    b = await box_for(request, box)
    watch = b.files.watch(path, recursive=recursive)
    await watch.start()

    def line(message: dict[str, Any]) -> bytes:
        return json.dumps(message).encode() + b"\n"

    async def body() -> AsyncIterator[bytes]:
        try:
            yield line({"type": "watching", "path": watch.path, "recursive": watch.recursive})
            while True:
                try:
                    event = await watch.next_event(WATCH_HEARTBEAT)
                except TimeoutError:
                    yield line({"type": "ping"})
                    continue
                except SandlotError as e:
                    yield line(error_message(e))
                    return
                if event is None:
                    yield line({"type": "end"})
                    return
                yield line({"type": event.type, "path": event.path, "is_dir": event.is_dir,
                            "old_path": event.old_path})  # fmt: skip
        finally:
            await watch.aclose()  # the client went away, or the watch ended: the box frees it

    return StreamingResponse(body(), media_type="application/x-ndjson")


@router.get("/boxes/{box}/files/archive", tags=["files"])
async def get_archive(box: str, path: str, request: Request) -> Response:
    """The directory ``path`` as a tar stream."""
    b = await box_for(request, box)
    if not (await b.files.stat(path)).is_dir:
        raise InvalidArgument(f"{path} is not a directory")
    return StreamingResponse(tarstream.tar_out(b.files, path), media_type="application/x-tar")


@router.put("/boxes/{box}/files/archive", status_code=204, tags=["files"])
async def put_archive(box: str, path: str, request: Request, user: str | None = None) -> Response:
    """Unpack the tar stream of the body into the directory ``path`` (checked whole
    first), owned by ``user`` if given."""
    b = await box_for(request, box)
    with await _spooled(request) as archive:
        await tarstream.tar_in(b.files, path, archive, user=user)
    return Response(status_code=204)


async def _spooled(request: Request) -> Any:
    """The request body in a temporary file of the server's (memory holds one chunk at a time)."""
    f = tempfile.SpooledTemporaryFile(max_size=8 << 20, dir=str(_server(request).settings.tmp))  # noqa: SIM115
    try:
        async for chunk in request.stream():
            f.write(chunk)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


# -- live state -----------------------------------------------------------------------


@router.post("/boxes/{box}/snapshots", status_code=201, tags=["live state"])
async def take_snapshot(box: str, body: SnapshotIn, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    return snapshot_json(await b.snapshot(body.name))


@router.get("/boxes/{box}/snapshots", tags=["live state"])
async def box_snapshots(box: str, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    return {"snapshots": [snapshot_json(s) for s in await b.snapshots()]}


@router.get("/snapshots", tags=["live state"])
async def list_snapshots(request: Request, kind: str | None = None) -> dict[str, Any]:
    caller = _caller(request)
    snaps = await AsyncSnapshot.list(home=_server(request).home)
    return {
        "snapshots": [
            snapshot_json(s)
            for s in snaps
            if caller.may_see(_snapshot_labels(s)) and (kind is None or s.kind == kind)
        ]
    }


@router.get("/snapshots/{snap}", tags=["live state"])
async def get_snapshot(snap: str, request: Request) -> dict[str, Any]:
    return snapshot_json(await snapshot_for(request, snap))


@router.delete("/snapshots/{snap}", status_code=204, tags=["live state"])
async def remove_snapshot(snap: str, request: Request) -> Response:
    await (await snapshot_for(request, snap)).remove()
    return Response(status_code=204)


@router.post("/boxes/{box}/rollback", tags=["live state"])
async def rollback(box: str, body: RollbackIn, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    snap = await snapshot_for(request, body.snapshot)
    await b.rollback(snap)
    await b.refresh()
    return box_json(b)


@router.post("/boxes/{box}/fork", status_code=201, tags=["live state"])
async def fork(box: str, body: ForkIn, request: Request) -> dict[str, Any]:
    b = await box_for(request, box)
    opts = b.info["options"]
    caller = _caller(request)
    async with _create_lock(_server(request), caller):
        await check_quota(request, body.n, int(opts.get("memory_mib") or 0),
                          int(opts.get("disk_size_gb") or 0))  # fmt: skip
        kids = await b.fork(body.n, name=body.name)
    return {"boxes": [box_json(k) for k in kids]}


@router.post("/snapshots/{snap}/start", status_code=201, tags=["live state"])
async def start_snapshot(snap: str, body: SnapshotStartIn, request: Request) -> dict[str, Any]:
    s = await snapshot_for(request, snap)
    spec = s.record.options.get("box") or {}
    caller = _caller(request)
    _check_network(caller, body.network)
    own = body.model_dump(exclude={"n", "name", "labels"}, exclude_none=True)
    labels = {**_inherited(caller, s), **_stamped(caller, body.labels)}
    async with _create_lock(_server(request), caller):
        await check_quota(request, body.n, int(spec.get("memory_mib") or 0),
                          int(spec.get("disk_size_gb") or 0))  # fmt: skip
        kids = await s.start(body.n, name=body.name, labels=labels, **own)
    return {"boxes": [box_json(k) for k in kids]}


@router.get("/snapshots/{snap}/export", tags=["live state"])
async def export_snapshot(snap: str, request: Request) -> Response:
    """The snapshot as an archive (written to the server's temporary space, then streamed)."""
    s = await snapshot_for(request, snap)
    tmp = Path(tempfile.mkdtemp(prefix="sandlot-export-", dir=_server(request).settings.tmp))
    try:
        archive = await s.export(tmp / "snapshot.sandlot")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            with open(archive, "rb") as f:
                while chunk := f.read(UPLOAD_CHUNK):
                    yield chunk
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    headers = {"Content-Length": str(archive.stat().st_size)}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


@router.post("/snapshots/import", status_code=201, tags=["live state"])
async def import_snapshot(request: Request, name: str | None = None, start: bool = True) -> dict[str, Any]:
    """Import an uploaded archive (checked whole); start a box from it unless ``start`` is false."""
    server = _server(request)
    caller = _caller(request)
    fd, tmp_name = tempfile.mkstemp(prefix="sandlot-import-", suffix=".sandlot", dir=server.settings.tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
        async with _create_lock(server, caller):
            if start:
                await check_quota(request, 1, 0, 0)
            out = await import_snapshot_async(tmp_name, name=name, home=server.home, start=False)
            assert isinstance(out, AsyncSnapshot)
            if not start:
                return snapshot_json(out)
            box = (await out.start(1, name=name, labels=_inherited(caller, out)))[0]
            request.state.box_id = box.id
            return box_json(box)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)


# -- the server -----------------------------------------------------------------------


@router.get("/info", tags=["server"])
async def info(request: Request) -> dict[str, Any]:
    from ..version import __version__

    caller = _caller(request)
    return {"version": __version__, "namespace": caller.namespace, "admin": caller.admin,
            "key": caller.key_name}  # fmt: skip


@router.get("/events", tags=["server"])
async def events(request: Request) -> Response:
    """Server-Sent Events: each change of a visible box's state, whichever process made it."""
    caller = _caller(request)
    home = _server(request).home

    async def stream() -> AsyncIterator[bytes]:
        import time

        seen: dict[str, str] = {}
        first = True
        while not await request.is_disconnected():
            now = {b.id: b for b in await AsyncBox.list(home=home) if caller.may_see(b.info["labels"])}
            for box_id, b in now.items():
                if seen.get(box_id) != b.state:
                    seen[box_id] = b.state
                    if not first:
                        data = {"id": box_id, "name": b.name, "state": b.state, "at": time.time()}
                        yield f"event: box\ndata: {json.dumps(data)}\n\n".encode()
            for box_id in [i for i in seen if i not in now]:
                del seen[box_id]
                data = {"id": box_id, "name": None, "state": "removed", "at": time.time()}
                yield f"event: box\ndata: {json.dumps(data)}\n\n".encode()
            if first:
                yield b": watching\n\n"
                first = False
            await asyncio.sleep(0.25)

    return StreamingResponse(stream(), media_type="text/event-stream")


@router.get("/audit", tags=["server"])
async def audit(request: Request, box: str | None = None, key: str | None = None,
                since: float | None = None,
                limit: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> dict[str, Any]:  # fmt: skip
    """The audit trail (admin keys)."""
    from ..api import access

    _caller(request).require_admin("reading the audit trail")
    server = _server(request)
    await asyncio.to_thread(server.audit.flush)
    entries = await asyncio.to_thread(access.audit_log, box=box, key=key, since=since, limit=limit,
                                      home=server.home)  # fmt: skip
    return {"entries": [e.to_json() for e in entries]}
