"""The REST and WebSocket routes of docs/server.md, on the server's home, seen through
the caller's namespace.

Each operation of ``api/contract.py``'s table gets its route from the table: its
arguments are the operation's model, its answer the operation's codec, and what
it does is the local backend's (``api/host.py``'s ``run``). The server adds only
what is its own: who may see which box, quotas on what makes boxes, the labels
it stamps, and the processes and previews it holds. The routes written out below
are those no request-and-answer fits: a box's creation and listing, commands,
held processes over WebSocket, streamed files, archives, watches, code cells and
saved state.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import inspect
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.websockets import WebSocketDisconnect

from ..api import access, host
from ..api.backend import SnapshotRef
from ..api.box import AsyncBox, AsyncSnapshot
from ..api.contract import (
    BY_KEY,
    HOST_PATHS,
    OPERATIONS,
    STDERR,
    STDOUT,
    STREAMS,
    BoxCreate,
    ExecCall,
    ExecIn,
    ListBoxesIn,
    Operation,
    Stream,
    VolumeCreate,
    error_json,
    error_message,
)
from ..api.events import check_query as check_events_query
from ..api.events import record_refusal
from ..api.local import LocalBackend, local_snapshot, snapshot_labels
from ..api.loop import with_beats
from ..core.diffs import side_key
from ..core.option_values import is_volume_name
from ..core.volumes import DEFAULT_SIZE_GB
from ..errors import (
    BoxNotFound,
    InvalidArgument,
    QuotaExceeded,
    RequestError,
    SandlotError,
    SnapshotNotFound,
    TransferError,
    VolumeNotFound,
)
from . import leases, origins
from .state import KEY_LABEL, NAMESPACE_LABEL, Caller, ServerState, accept_websocket
from .streams import serve, spawn

router = APIRouter()
UPLOAD_CHUNK = 1 << 20
SSE_KEEPALIVE = 15.0  # seconds between two comments on an idle event stream (proxies close silent ones)
EXEC_CHANNEL_IN_FLIGHT = 64  # execs of one channel running at once; more wait for a slot


def _server(request: Request | WebSocket) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def _caller(request: Request) -> Caller:
    caller: Caller = request.state.caller
    return caller


def _backend(request: Request | WebSocket) -> LocalBackend:
    return LocalBackend.for_home(_server(request).home)


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


def _snapshot_labels(snap: AsyncSnapshot | SnapshotRef) -> dict[str, str]:
    return snapshot_labels(snap.ref if isinstance(snap, AsyncSnapshot) else snap)


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
    visible = [
        s for s in await AsyncSnapshot.list(home=_server(request).home) if caller.may_see(_snapshot_labels(s))
    ]
    found = [s for s in visible if s.name == key] or [s for s in visible if s.id.startswith(key)]
    if not found:
        raise SnapshotNotFound(f"no snapshot {key!r}")
    if len(found) > 1:
        owners = ", ".join(sorted({s.box_name or "?" for s in found}))
        raise InvalidArgument(f"snapshot {key!r} is ambiguous (boxes {owners}): use its id")
    return found[0]


# -- what the server adds: quotas, labels, admin-only requests ---------------------------


async def check_quota(request: Request, n: int, memory_mib: int, disk_gb: int) -> None:
    """Refuse (429) ``n`` more boxes of this size if they would take the caller's key over a quota."""
    caller = _caller(request)
    q = caller.quotas
    if q is None or (q.boxes is None and q.memory_mib is None and q.disk_gb is None):
        return
    mine = _counted(caller)
    boxes = await AsyncBox.list(labels=mine, home=_server(request).home)
    used_memory = sum(int(b.info.get("memory_mib") or 0) for b in boxes)
    used_disk = sum(int(b.info.get("disk_size_gb") or 0) for b in boxes)
    for limit, have, adding, most in (
        ("boxes", len(boxes), n, q.boxes),
        ("memory_mib", used_memory, n * memory_mib, q.memory_mib),
        ("disk_gb", used_disk, n * disk_gb, q.disk_gb),
    ):
        if most is not None and have + adding > most:
            await _over_quota(request, mine, limit, most, f"{have} in use, {adding} more asked")


def _counted(caller: Caller) -> dict[str, str]:
    """The labels of what counts against the caller's quotas: its namespace's, or its key's."""
    return {NAMESPACE_LABEL: caller.namespace} if caller.namespace else {KEY_LABEL: caller.key_id or ""}


async def _over_quota(request: Request, mine: dict[str, str], limit: str, most: int, why: str) -> None:
    """Refuse (429) a request over the caller's quota of ``limit``, in the audit trail too."""
    refused = QuotaExceeded(f"the key's quota of {limit} is {most}: {why}", limit=limit, value=most)
    await record_refusal(str(refused), mine, home=_server(request).home)
    raise refused


async def check_volume_quota(request: Request, body: VolumeCreate) -> None:
    """Refuse (429) a volume that would take the caller's key over its volume quotas."""
    caller = _caller(request)
    q = caller.quotas
    if q is None or (q.volumes is None and q.volume_gb is None):
        return
    mine = _counted(caller)
    have = [
        v for v in await _backend(request).volume_list() if mine.items() <= (v.get("labels") or {}).items()
    ]
    asked_gb = 0.0 if body.shared else float(body.size_gb if body.size_gb is not None else DEFAULT_SIZE_GB)
    used_gb = sum(float(v.get("size_gb") or 0) for v in have)
    for limit, now, adding, most in (("volumes", len(have), 1, q.volumes),
                                     ("volume_gb", used_gb, asked_gb, q.volume_gb)):  # fmt: skip
        if most is not None and now + adding > most:
            await _over_quota(request, mine, limit, most, f"{now:g} in use, {adding:g} more asked")
        if most is not None and limit == "volume_gb" and body.shared:
            await _over_quota(
                request, mine, limit, most, "it bounds volumes by size, and a shared volume has none"
            )


def _check_network(caller: Caller, network: object) -> None:
    """Open networking reaches the server's host: only admin keys may ask for it."""
    if network == "open":
        caller.require_admin("network='open' (it reaches the host)")


def _stamped(caller: Caller, labels: dict[str, str] | None) -> dict[str, str]:
    labels = access.stamped(caller.namespace or None, labels, admin=caller.admin)
    if caller.key_id:
        labels[KEY_LABEL] = caller.key_id
    return labels


def _inherited(caller: Caller, snap: AsyncSnapshot | SnapshotRef) -> dict[str, str]:
    """The labels of boxes started from ``snap``: its box's own, stamped for the caller
    (the server's labels are the caller's, never the snapshot's)."""
    return _stamped(caller, access.own_labels(_snapshot_labels(snap)))


def _create_lock(server: ServerState, caller: Caller) -> asyncio.Lock:
    """Creations of one key or namespace in turn, so two cannot both pass a quota."""
    return server.quota_locks.setdefault(caller.namespace or caller.key_id or "", asyncio.Lock())


Guard = Callable[[Request, Any, Any], contextlib.AbstractAsyncContextManager[Any]]


@contextlib.asynccontextmanager
async def _as_is(request: Request, target: Any, params: Any) -> AsyncIterator[Any]:
    yield params


@contextlib.asynccontextmanager
async def _network_guard(request: Request, target: Any, params: Any) -> AsyncIterator[Any]:
    _check_network(_caller(request), params.network)
    yield params


@contextlib.asynccontextmanager
async def _fork_guard(request: Request, target: Any, params: Any) -> AsyncIterator[Any]:
    info = target.info
    async with _create_lock(_server(request), _caller(request)):
        await check_quota(
            request, params.n, int(info.get("memory_mib") or 0), int(info.get("disk_size_gb") or 0)
        )
        yield params


@contextlib.asynccontextmanager
async def _snapshot_start_guard(request: Request, target: Any, params: Any) -> AsyncIterator[Any]:
    caller = _caller(request)
    _check_network(caller, params.network)
    spec = local_snapshot(target).record.options.get("box") or {}
    labels = {**_inherited(caller, target), **_stamped(caller, params.labels)}
    async with _create_lock(_server(request), caller):
        await check_quota(
            request, params.n, int(spec.get("memory_mib") or 0), int(spec.get("disk_size_gb") or 0)
        )
        yield params.model_copy(update={"labels": labels})


@contextlib.asynccontextmanager
async def _diff_guard(request: Request, target: Any, params: Any) -> AsyncIterator[Any]:
    """A diff's other sides are boxes and snapshots the caller may see, named by id."""
    sides = {}
    for field in ("a", "b"):
        kind, key = side_key(getattr(params, field), "image" if field == "a" else "now")
        if kind == "box":
            audited = getattr(request.state, "box_id", None)
            sides[field] = f"box:{(await box_for(request, key)).id}"
            request.state.box_id = audited  # the request is about its own box, for the audit
        elif kind == "snapshot":
            sides[field] = f"snapshot:{(await snapshot_for(request, key)).id}"
    yield params.model_copy(update=sides)


@contextlib.asynccontextmanager
async def _restore_guard(request: Request, target: Any, params: Any) -> AsyncIterator[Any]:
    """A restore's snapshot is one the caller may see, named by id."""
    kind, key = side_key(params.snapshot, "")
    if kind != "snapshot":
        raise InvalidArgument(f"restore takes a snapshot to restore from, not {params.snapshot!r}")
    yield params.model_copy(update={"snapshot": f"snapshot:{(await snapshot_for(request, key)).id}"})


GUARDS: dict[str, Guard] = {
    "box.diff": _diff_guard,
    "files.restore": _restore_guard,
    "box.set_network": _network_guard,
    "box.fork": _fork_guard,
    "snapshot.start": _snapshot_start_guard,
}


# The operations the server answers itself (``Operation.answers``: "host", what it holds
# for its clients; "server", what it signs), each registered by ``answered_here``;
# server/bridge.py registers the preview URLs it signs.
Answer = Callable[[Request, Any, Any], Awaitable[Any]]
ANSWERED: dict[str, Answer] = {}


def answered_here(key: str) -> Callable[[Answer], Answer]:
    """Register the server's answer to operation ``key``, one the box's backend does not give."""
    op = BY_KEY[key]
    assert op.answers != "box" and key not in ANSWERED, f"{key} is not the server's to answer, or is twice"

    def register(answer: Answer) -> Answer:
        ANSWERED[key] = answer
        return answer

    return register


@answered_here("box.processes")
async def _processes(request: Request, box: AsyncBox, params: Any) -> Any:
    return await _server(request).processes.listed(box.ref)


# -- the operations of api/contract.py, a route each ----------------------------------------


async def run_operation(request: Request, key: str, target: str, **args: Any) -> Any:
    """Operation ``key`` of ``api/contract.py``'s table on the box or snapshot ``target``
    names, as its route runs it (what the caller may see, quotas, guards): for the
    server's other faces."""
    op = BY_KEY[key]
    return await _run(request, op, target, host.arguments(op, args))


async def _run(request: Request, op: Operation, key: str, params: Any) -> Any:
    target: Any = await (snapshot_for(request, key) if op.scope == "snapshot" else box_for(request, key))
    if op.answers != "box":
        return await ANSWERED[op.key](request, target, params)
    async with GUARDS.get(op.key, _as_is)(request, target.ref, params) as params:
        return await host.run(_backend(request), op, target.ref, params)


def _operation_route(op: Operation) -> Callable[..., Awaitable[Any]]:
    """The route of ``op``: its target from the path (as the caller may see it), its
    arguments as its model (from the query or the body), its answer by its codec."""

    async def route(request: Request, **kwargs: Any) -> Any:
        in_path = {n: kwargs[n] for n in op.in_path}
        carried = kwargs.get("params")
        if carried is None:
            params = host.arguments(op, in_path)
        elif in_path:  # the path's arguments beside the query's or the body's, as the one model
            params = host.arguments(op, {**carried.model_dump(exclude_none=True), **in_path})
        else:
            params = carried
        value = await _run(request, op, kwargs["snap" if op.scope == "snapshot" else "box"], params)
        if op.result.kind == "none":
            return Response(status_code=204)
        if op.result.kind == "text":
            return Response(value, media_type="text/plain; charset=utf-8")
        return value

    key = "snap" if op.scope == "snapshot" else "box"
    source = Query() if op.in_query else Body()
    params = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=str) for name in (key, *op.in_path)
    ]
    params.append(inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request))
    if set(op.params.model_fields) - set(op.in_path):  # arguments beyond the path's: the query or the body
        params.append(
            inspect.Parameter(
                "params", inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[op.carried, source]
            )
        )
    route.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    route.__name__ = f"{op.scope}_{op.name}"
    route.__doc__ = op.summary + f" (``{'AsyncSnapshot' if op.scope == 'snapshot' else 'AsyncBox'}"
    route.__doc__ += f"{'.files' if op.scope == 'files' else ''}.{op.name}``)"
    return route


def _refuse_shadow(method: str, path: str, key: str, *, made: int = 0) -> None:
    """A route written out by hand never takes the place of a route of the table: besides
    the ``made`` routes of the table there, none is at ``method`` and ``path``."""
    written = [(m, getattr(r, "path", None)) for r in router.routes for m in getattr(r, "methods", ())]
    if written.count((method, path)) > made:
        raise AssertionError(f"{method} {path} is written out by hand, and {key} of the table is there too")


def _register(op: Operation) -> None:
    """Add ``op``'s route."""
    _refuse_shadow(op.method, op.path, op.key)
    endpoint = _operation_route(op)
    tags: list[str | Enum] = [
        "files" if op.scope == "files" else "live state" if op.scope == "snapshot" else "boxes"
    ]
    router.add_api_route(
        op.path,
        endpoint,
        methods=[op.method],
        status_code=op.status,
        tags=tags,
        name=endpoint.__name__,
        summary=op.summary,
    )


def _stream_route(stream: Stream) -> Callable[..., Awaitable[Any]]:
    """The route of ``stream``: its box from the path, its arguments as its model (the
    query, or the body of a POST), then its frames as they come (JSON ones as NDJSON);
    a client stream's bytes are the request's body, and its answer JSON."""

    async def route(request: Request, box: str, params: Any) -> Any:
        b = await box_for(request, box)
        if stream.audit is not None:
            request.state.audit = stream.audit(params)
        if stream.kind == "client":
            taken = await host.TAKEN[stream.key](_backend(request), b.ref, params, _body(request))
            return JSONResponse(taken)
        frames = host.STREAMED[stream.key](_backend(request), b.ref, params)
        if stream.lasting:
            frames = _lasting(request, stream, b.id, params, frames)
        if stream.frames == "json":
            frames = (json.dumps(message).encode() + b"\n" async for message in frames)
        return await _streamed(frames, stream.media_type, noted=stream.noted)

    source = Query() if stream.in_query else Body()
    route.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("box", inspect.Parameter.KEYWORD_ONLY, annotation=str),
        inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request),
        inspect.Parameter("params", inspect.Parameter.KEYWORD_ONLY,
                          annotation=Annotated[stream.params, source]),
    ])  # fmt: skip
    route.__name__ = f"{stream.scope}_{stream.name}"
    route.__doc__ = stream.summary
    return route


async def _body(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def _lasting(
    request: Request, stream: Stream, box_id: str, params: Any, messages: AsyncIterator[Any]
) -> AsyncIterator[Any]:
    """A lasting stream's messages, with its start (once it holds, or its refusal) and its
    end (the messages it gave, and what ended it) in the audit trail, with the client."""
    server, caller, peer = _server(request), _caller(request), request.client
    detail: dict[str, Any] = {**params.model_dump(), "client": f"{peer.host}:{peer.port}" if peer else None,
                              "user_agent": request.headers.get("user-agent")}  # fmt: skip
    try:
        first = await anext(messages)
    except SandlotError as e:
        server.record(caller, f"{stream.name} start", box_id, e.status, e.code, 0.0, detail)
        raise
    server.record(caller, f"{stream.name} start", box_id, 200, None, 0.0, detail)
    began, count, how = time.monotonic(), 0, "client gone"
    try:
        message: Any = first
        while True:
            kind = message.get("type")
            if kind in ("end", "error"):
                how = kind
            elif kind not in ("watching", "ping"):
                count += 1
            yield message
            message = await anext(messages)
    except StopAsyncIteration:
        return
    finally:
        server.record(caller, f"{stream.name} end", box_id, 200, None, time.monotonic() - began,
                      {**detail, "events": count, "ended_by": how})  # fmt: skip


def _register_stream(stream: Stream) -> None:
    _refuse_shadow(stream.method, stream.path, stream.key)
    endpoint = _stream_route(stream)
    router.add_api_route(stream.path, endpoint, methods=[stream.method], tags=[stream.scope],
                         name=endpoint.__name__, summary=stream.summary.split(". ")[0])  # fmt: skip


# The streams' routes come before those written out below (each checked at the end of the
# module): Starlette tries routes in order, and a file's bytes are among the most asked.
for _stream in STREAMS:
    _register_stream(_stream)


# -- boxes ----------------------------------------------------------------------------


@router.post("/boxes", status_code=201, tags=["boxes"])
async def create_box(body: BoxCreate, request: Request, response: Response) -> dict[str, Any]:  # type: ignore[valid-type]
    """Create a box from an image, a template or a snapshot, and start it unless ``start`` is false."""
    caller = _caller(request)
    server = _server(request)
    wanted: dict[str, Any] = body.model_dump(exclude_none=True)  # type: ignore[attr-defined]
    lease = leases.lease_for(server, caller, wanted)
    for host_path in HOST_PATHS:
        if wanted.get(host_path) is not None:
            caller.require_admin(f"{host_path} (a host path)")
    _check_network(caller, wanted.get("network"))
    start, snapshot = wanted.get("start", True), wanted.get("snapshot")
    for mount in wanted.get("volumes") or ():
        source = str(mount).split(":", 1)[0]
        if not is_volume_name(source):
            caller.require_admin(f"volume {mount!r} (a directory of the server's host)")
        else:  # a volume of another namespace is not there
            await volume_for(request, source)
    options = {**host.box_options(wanted), "labels": _stamped(caller, wanted.get("labels"))}
    memory = int(options.get("memory_mib") or 256)
    disk = int(options.get("disk_size_gb") or 0)
    async with _create_lock(server, caller):
        await check_quota(request, 1, memory, disk)
        if snapshot is not None:
            snap = await snapshot_for(request, snapshot)
            start_options = {k: v for k, v in options.items() if k not in ("image", "template", "name")}
            box = (await snap.start(1, name=options.get("name"), **start_options))[0]
        else:
            if "template" in options:
                options["template"] = (await snapshot_for(request, options["template"])).id
            box = AsyncBox(wanted.get("image"), keep=True, home=server.home, **options)
            try:
                await (box.start() if start else box.ref.backend.create(box.ref, start=False))
            except BaseException:
                # made but not started (a quota of awake boxes, a boot that failed): the
                # caller never learns its id, so it would be left behind for good
                with contextlib.suppress(Exception):
                    await box.remove(force=True)
                raise
        # granted once the box exists: a client that dies while its box boots loses it all the same
        held = await leases.grant(server, caller, box.id, lease) if lease is not None else None
    request.state.box_id = box.id
    response.headers["Location"] = f"/v1/boxes/{box.id}"
    return {**box.info, "lease": held.to_json()} if held is not None else box.info


@router.get("/boxes", tags=["boxes"])
async def list_boxes(request: Request, params: Annotated[ListBoxesIn, Query()]) -> dict[str, Any]:
    """Boxes the caller may see, oldest first, a page at a time."""
    labels = {}
    for item in params.label:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidArgument(f"label filter {item!r} is not KEY=VALUE")
        labels[k] = v
    caller = _caller(request)
    boxes = [
        b
        for b in await AsyncBox.list(state=params.state, labels=labels or None, home=_server(request).home)
        if caller.may_see(b.info["labels"])
    ]
    after = _page_after(params.page_token)
    if after is not None:
        boxes = [b for b in boxes if (b.info["created_at"], b.id) > after]
    page = boxes[: params.limit]
    token = None
    if len(boxes) > params.limit:
        last = page[-1]
        token = base64.urlsafe_b64encode(json.dumps([last.info["created_at"], last.id]).encode()).decode()
    return {"boxes": [b.info for b in page], "next_page_token": token}


def _page_after(token: str | None) -> tuple[float, str] | None:
    if token is None:
        return None
    try:
        at, box_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(at), str(box_id)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidArgument("page_token is malformed") from None


# -- commands -------------------------------------------------------------------------


@router.post("/boxes/{box}/exec", tags=["exec"])
async def exec_box(box: str, body: ExecIn, request: Request) -> dict[str, Any]:
    """Run a command to completion and answer its exit code and output."""
    b = await box_for(request, box)
    audit: dict[str, Any] = {"argv": body.argv}
    request.state.audit = audit
    return await _run_exec(request, b, body, audit)


async def _run_exec(
    where: Request | WebSocket, box: AsyncBox, body: ExecIn, audit: dict[str, Any]
) -> dict[str, Any]:
    """One exec of the REST route or the exec channel: its answer, and ``exit_code`` in ``audit``."""
    answer = await host.run_exec(_backend(where), box.ref, body)
    audit["exit_code"] = answer["exit_code"]
    return answer


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
    await accept_websocket(ws)
    try:
        caller = await server.caller(ws.headers, websocket=True)
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
            await answer({"id": call.id, "result": await _run_exec(ws, b, call, audit)})
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


async def ws_box(ws: WebSocket, key: str, accept: bool = True) -> tuple[ServerState, Caller, AsyncBox] | None:
    """Authenticate a WebSocket and find its box; on failure answer in the error shape and
    close. ``accept=False`` leaves accepting to the caller (unless it fails here)."""
    server = _server(ws)
    if accept:
        await accept_websocket(ws)
    try:
        caller = await server.caller(ws.headers, websocket=True)
        return server, caller, await _box(ws, key, caller)
    except SandlotError as e:
        if not accept:
            await accept_websocket(ws)
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
        await spawn(ws, b.ref, server.processes, server.exited_by(caller))


@router.websocket("/boxes/{box}/processes/{process}/attach")
async def attach_ws(ws: WebSocket, box: str, process: str, stdout: int = 0, stderr: int = 0) -> None:
    """Follow a held process again from the offsets the client has."""
    found = await ws_box(ws, box)
    if found is None:
        return
    server, _, b = found
    try:
        if stdout < 0 or stderr < 0:
            raise RequestError("offsets must be >= 0")
        held = await server.processes.found(b.ref, process)  # a server before this one may have started it
    except SandlotError as e:
        await ws.send_json(error_message(e))
        await ws.close(1008)
        return
    with contextlib.suppress(WebSocketDisconnect):
        await serve(ws, held, {STDOUT: stdout, STDERR: stderr})


# -- streamed answers (the table's streams) ---------------------------------------------


async def _streamed(
    chunks: AsyncIterator[bytes], media_type: str, *, noted: bool = False
) -> StreamingResponse:
    """``chunks`` as the answer; an error before the first (no such file) answers as itself.
    ``noted``: a tar stream whose entry failures the stream itself notes (a global header
    naming the entry, and no end-of-archive blocks), so the answer ends there rather than
    breaking off."""
    first = await anext(chunks, b"")

    async def body() -> AsyncIterator[bytes]:
        yield first
        try:
            async for chunk in chunks:
                yield chunk
        except TransferError:
            if not noted:
                raise

    return StreamingResponse(body(), media_type=media_type)


# -- saved state ----------------------------------------------------------------------


@router.get("/snapshots", tags=["live state"])
async def list_snapshots(request: Request, kind: str | None = None, box: str | None = None) -> dict[str, Any]:
    """Snapshots and templates the caller may see (``kind``: of that kind; ``box``: of that box)."""
    caller = _caller(request)
    box_id = (await box_for(request, box)).id if box is not None else None
    snaps = await AsyncSnapshot.list(box=box_id, kind=kind, home=_server(request).home)
    return {"snapshots": [s.info for s in snaps if caller.may_see(_snapshot_labels(s))]}


@router.get("/snapshots/{snap}", tags=["live state"])
async def get_snapshot(snap: str, request: Request) -> dict[str, Any]:
    return (await snapshot_for(request, snap)).info


@router.get("/snapshots/{snap}/export", tags=["live state"])
async def export_snapshot(snap: str, request: Request, since: str | None = None) -> Response:
    """The snapshot as an archive (written to the server's temporary space, then streamed);
    ``since``: only what changed after that snapshot (one the key may see too)."""
    s = await snapshot_for(request, snap)
    base = await snapshot_for(request, since) if since is not None else None
    tmp = Path(tempfile.mkdtemp(prefix="sandlot-export-", dir=_server(request).settings.tmp))
    try:
        archive = await s.export(tmp / "snapshot.sandlot", since=base)
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
    backend = _backend(request)
    fd, tmp_name = tempfile.mkstemp(prefix="sandlot-import-", suffix=".sandlot", dir=server.settings.tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
        async with _create_lock(server, caller):
            if start:
                await check_quota(request, 1, 0, 0)
            snap = await backend.import_snapshot(Path(tmp_name), name=name, start=False, options={},
                                                 namespace=caller.namespace or None)  # fmt: skip
            assert isinstance(snap, SnapshotRef)
            # it is bound to this home's shared volumes of the names it gives: the caller's own
            saved_box = local_snapshot(snap).record.options.get("box", {})
            try:
                for share in saved_box.get("volumes", []):
                    if len(share) > 3:
                        await volume_for(request, share[3])
            except VolumeNotFound:
                await AsyncSnapshot(snap).remove()
                raise
            if not start:
                return snap.info
            [box] = await backend.snapshot_start(snap, 1, name, labels=_inherited(caller, snap))
            request.state.box_id = box.id
            return box.info
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)


# -- named volumes --------------------------------------------------------------------


async def volume_for(request: Request, key: str) -> dict[str, Any]:
    """The volume ``key`` names, as 404 when the caller may not see it."""
    try:
        found = await _backend(request).volume_get(key)
    except VolumeNotFound:
        found = None
    if found is None or not _caller(request).may_see(found.get("labels") or {}):
        raise VolumeNotFound(f"no volume {key!r}")
    return found


@router.post("/volumes", status_code=201, tags=["volumes"])
async def create_volume(body: VolumeCreate, request: Request, response: Response) -> dict[str, Any]:
    """Create an empty named volume (labelled with the key's namespace, as its boxes are)."""
    caller = _caller(request)
    labels = _stamped(caller, body.labels)
    async with _create_lock(_server(request), caller):
        await check_volume_quota(request, body)
        made = await _backend(request).volume_create(body.name, body.size_gb, labels, body.shared)
    response.headers["Location"] = f"/v1/volumes/{made['id']}"
    return made


@router.get("/volumes", tags=["volumes"])
async def list_volumes(request: Request) -> dict[str, Any]:
    """The volumes the caller may see, oldest first."""
    caller = _caller(request)
    found = await _backend(request).volume_list()
    return {"volumes": [v for v in found if caller.may_see(v.get("labels") or {})]}


@router.get("/volumes/{volume}", tags=["volumes"])
async def get_volume(volume: str, request: Request) -> dict[str, Any]:
    """A volume: its size, labels, the boxes that mount it and the one that writes it back."""
    return await volume_for(request, volume)


@router.delete("/volumes/{volume}", status_code=204, tags=["volumes"])
async def remove_volume(volume: str, request: Request) -> Response:
    """Remove a volume; 409 (volume_in_use) while a box mounts it."""
    found = await volume_for(request, volume)
    await _backend(request).volume_remove(found["id"])
    return Response(status_code=204)


# -- the server -----------------------------------------------------------------------


@router.get("/info", tags=["server"])
async def info(request: Request) -> dict[str, Any]:
    from ..version import __version__

    caller = _caller(request)
    settings = _server(request).settings
    return {
        "version": __version__,
        "namespace": caller.namespace,
        "admin": caller.admin,
        "key": caller.key_name,
        # where port routes and previews are: never this origin (server/origins.py)
        "content_url": origins.content_base(settings, request.url.scheme, request.headers.get("host")),
    }


@router.get("/events", tags=["server"])
async def events(
    request: Request,
    box: Annotated[str | None, Query(max_length=256)] = None,
    since: float | None = None,
    after: Annotated[int | None, Query(ge=0)] = None,
    follow: bool = True,
) -> Response:
    """Server-Sent Events: what happened to the boxes the key may see (``core.events``,
    docs/events.md), whichever process did it. Each is ``id: <event id>``, ``event:
    <kind>`` and ``data: <the event's JSON>``; a client that reconnects with
    ``Last-Event-ID`` (or ``after``) goes on after it. ``since``: from that Unix time
    (negative: seconds ago); ``box``: of that box (id or name); ``follow=false``: the
    kept events only, then the stream ends. A comment every 15 s keeps it open."""
    caller = _caller(request)
    last_seen = request.headers.get("last-event-id")
    if last_seen is not None:
        if not last_seen.isdigit():
            raise InvalidArgument(f"Last-Event-ID must be an event id, not {last_seen!r}")
        after = max(after or 0, int(last_seen))
    box, since, after = check_events_query(box, since, after)
    backend = _backend(request)

    async def stream() -> AsyncIterator[bytes]:
        yield b": events\n\n"
        source = backend.events(box=box, since=since, after=after, follow=follow).__aiter__()
        async for ev in with_beats(source, SSE_KEEPALIVE):
            if ev is None:
                if await request.is_disconnected():
                    return
                yield b": keepalive\n\n"
            elif caller.may_see(ev.labels):
                data = json.dumps(ev.to_json())
                yield f"id: {ev.id}\nevent: {ev.kind}\ndata: {data}\n\n".encode()

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


@router.get("/pools", tags=["server"])
async def list_pools(request: Request) -> dict[str, Any]:
    """The warm pools of the templates the key may see: size, ready, filling, memory."""
    from ..api.templates import pools_async

    caller = _caller(request)
    server = _server(request)
    visible = {s.id for s in await AsyncSnapshot.list(kind="template", home=server.home)
               if caller.may_see(_snapshot_labels(s))}  # fmt: skip
    return {"pools": [p.to_json() for p in await pools_async(home=server.home) if p.template_id in visible]}


@router.get("/metrics/latest", tags=["server"])
async def latest_samples(request: Request) -> dict[str, Any]:
    """The newest sample of each box the key may see, as taken (counters and gauges,
    without the per-second rates ``box.metrics`` adds; null where it was never
    sampled): what a table of boxes shows beside their states."""
    from ..api.metrics import latest

    caller = _caller(request)
    return {"boxes": [{"id": b.id, "name": b.name, "state": b.state, "sample": sample}
                      for b, sample in await latest(_server(request).home)
                      if caller.may_see(b.info["labels"])]}  # fmt: skip


@router.get("/audit", tags=["server"])
async def audit(
    request: Request,
    box: str | None = None,
    key: str | None = None,
    since: float | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> dict[str, Any]:
    """The audit trail (admin keys)."""
    _caller(request).require_admin("reading the audit trail")
    server = _server(request)
    await asyncio.to_thread(server.audit.flush)
    entries = await asyncio.to_thread(
        access.audit_log, box=box, key=key, since=since, limit=limit, home=server.home
    )
    return {"entries": [e.to_json() for e in entries]}


# a route of each operation of the table (none is written out above), and none written
# out above in the place of a stream's
for _op in OPERATIONS:
    _register(_op)
for _stream in STREAMS:
    _refuse_shadow(_stream.method, _stream.path, _stream.key, made=1)
