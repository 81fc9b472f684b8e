"""E2B's control API (its ``spec/openapi.yml``: ``/sandboxes`` and ``/v2/sandboxes``),
answered with sandlot's boxes.

A sandbox is a box. Its creation goes through the server's own ``POST /v1/boxes``
(``routes.create_box``), so a key's namespace, quotas, labels and audit apply as
they do to sandlot's own clients. E2B's ``timeout`` (killed after N seconds unless
extended) is the box's lease (``core/leases.py``): ``set_timeout`` and refreshes
grant it again, and the server's sweep removes the box when it lapses. E2B's pause
(memory and disk kept, the sandbox no longer running) is sandlot's suspend; a
connect or resume brings it back with its processes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import time
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ...api import access, leases
from ...api.box import AsyncBox
from ...api.contract import BoxCreate
from ...errors import BoxNotFound, InvalidArgument, InvalidState, SandlotError, SnapshotNotFound, Unsupported
from .. import leases as server_leases
from .. import origins, routes
from ..state import Caller, ServerState
from .envd import ENVD_VERSION

router = APIRouter()
TEMPLATE_LABEL, METADATA_LABEL = "e2b.template", "e2b.metadata"
AUTO_RESUME_LABEL = "e2b.auto_resume"  # "1": a call to the paused sandbox resumes it
# seconds: E2B's set_timeout(5) ends its sandbox then (the server's sweep of leases looks
# every second); a box's own lease, which a client may renew, is 10 s or more
SHORTEST_TIMEOUT = 1.0
TIMEOUT_LABEL = "e2b.timeout"  # the timeout it was made with: what a resume gives it when none is asked
DEFAULT_TIMEOUT = 300  # seconds: E2B's default
DEFAULT_TEMPLATES = ("base", "code-interpreter-v1")  # what the SDKs ask for when given no template
MOST_LISTED = 100
MOST_FORKED = 100  # E2B's own bound on a fork's count
ALL_TRAFFIC = "0.0.0.0/0"  # E2B's name for every destination
CLIENT_ID = "sandlot"


def error_response(err: SandlotError) -> JSONResponse:
    """E2B's error shape for any error of sandlot's, with its status."""
    return JSONResponse(
        {"code": err.status, "message": str(err)}, status_code=err.status, headers=err.http_headers()
    )


def _server(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def _caller(request: Request) -> Caller:
    caller: Caller = request.state.caller
    return caller


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise InvalidArgument(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the body is a JSON object")
    return body


async def sandbox_box(request: Request, sandbox_id: str) -> AsyncBox:
    """The box of a sandbox id the caller may see (404 in E2B's words otherwise)."""
    try:
        return await routes.box_for(request, sandbox_id)
    except BoxNotFound:
        raise BoxNotFound(f"sandbox {sandbox_id} was not found", box=sandbox_id) from None


def _timeout(value: Any, what: str = "timeout") -> int:
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} is a whole number of seconds, not {value!r}")
    return int(leases.check_seconds(max(value, int(SHORTEST_TIMEOUT)), what, shortest=SHORTEST_TIMEOUT))


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):  # fmt: skip
        raise InvalidArgument("metadata is an object of strings")
    return metadata


async def _source(request: Request, template: str) -> tuple[dict[str, Any], bool | None]:
    """What a sandbox of ``template`` starts from: a sandlot template (or snapshot) of
    that name the caller may see, else the image it names; E2B's own default templates
    are what ``sandlot serve --e2b-template`` names (a template or an image; by default
    ``--mcp-image``). With it, whether the saved state has a network card (None: an
    image, booted with any)."""
    saved = await _saved(request, template)
    if saved is not None:
        return saved
    if template in DEFAULT_TEMPLATES:
        default = _server(request).settings.e2b_template
        if default is None:
            raise InvalidArgument(
                f"template {template!r}: this server has no default template "
                "(start it with --e2b-template, or make a sandlot template of that name)"
            )
        return await _saved(request, default) or ({"image": default}, None)
    return {"image": template}, None


async def _saved(request: Request, name: str) -> tuple[dict[str, Any], bool] | None:
    """A sandlot template or snapshot of ``name`` the caller may see, as a box's source,
    and whether its saved state has a network card; None where there is none."""
    try:
        snap = await routes.snapshot_for(request, name)
    except (SnapshotNotFound, InvalidArgument):
        return None
    source = {"template": snap.id} if snap.kind == "template" else {"snapshot": snap.id}
    saved = (await snap.inspect()).get("options", {}).get("vm", {})
    return source, bool(saved.get("network"))


def _fitting(mode: str, saved_nic: bool | None, *, named: bool) -> str | None:
    """The network mode for E2B's egress settings (``_policy``) that a sandbox whose network
    card is fixed can have: one from a saved state, which keeps the state's card (None:
    the state's own mode), or a running one. With a card, no way out is an allow list of
    nothing, as E2B's ``allow_internet_access=False`` is. A state without a card gets
    none: E2B's SDKs ask for the internet unless told not to
    (``allow_internet_access`` is sent either way), so a template made without a network
    gives sandboxes without one, as its maker chose (docs/e2b.md). Destinations named in
    ``network`` it cannot reach are refused, saying why (``requests.check_fits``)."""
    if saved_nic is None:
        return mode
    if saved_nic and mode == "none":
        return "allowlist"
    if not saved_nic and mode == "public" and not named:
        return None
    return mode


@router.post("/sandboxes", status_code=201)
@router.post("/v2/sandboxes", status_code=201)
async def create(request: Request) -> dict[str, Any]:
    body = await _body(request)
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        raise InvalidArgument("templateID is needed")
    timeout = _timeout(body.get("timeout"))
    envs = body.get("envVars") or {}
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise InvalidArgument("envVars is an object of strings")
    labels = {TEMPLATE_LABEL: template[:1024], TIMEOUT_LABEL: str(timeout)}
    metadata = _metadata(body)
    if metadata:
        labels[METADATA_LABEL] = json.dumps(metadata, separators=(",", ":"))
    source, saved_nic = await _source(request, template)
    # (a lease made with the box is one a client could renew: 10 s or more)
    wanted: dict[str, Any] = {**source, "labels": labels, "lease": float(max(timeout, leases.SHORTEST))}
    if envs:
        wanted["env"] = envs
    network = body.get("network") or {}
    if not isinstance(network, dict):
        raise InvalidArgument("network is an object")
    internet = body.get("allow_internet_access")
    if internet is not None or network or "image" in wanted:
        # a sandbox from a sandlot template keeps the template's network unless told otherwise
        mode, allow = _policy(internet, network.get("allowOut"), network.get("denyOut"), network.get("rules"))
        fitting = _fitting(mode, saved_nic, named=bool(network))
        if fitting is not None:
            wanted["network"] = fitting
        if allow:
            wanted["allow"] = allow
    if body.get("autoPause"):
        # E2B's filesystem-only pause (``keep_memory=False``): the box stopped, its disk kept
        labels[server_leases.ON_END_LABEL] = "stop" if body.get("autoPauseMemory") is False else "suspend"
    if body.get("autoResume") is not None:
        resume = body["autoResume"]
        enabled = resume.get("enabled") if isinstance(resume, dict) else resume
        labels[AUTO_RESUME_LABEL] = "1" if enabled is True else "0"
    # ``mcp`` is taken: the SDKs start E2B's gateway themselves, a command in the sandbox
    # (``mcp-gateway``, which E2B's MCP templates hold), once it is made
    if body.get("iam"):
        raise Unsupported("iam (workload identity tokens) is not supported by sandlot")
    if body.get("volumeMounts"):
        raise Unsupported("volumeMounts are not supported over the E2B API: use sandlot's named volumes")
    made = await routes.create_box(BoxCreate(**wanted), request, Response())
    if timeout < leases.SHORTEST:  # a timer shorter than a lease made with a box may be
        await server_leases.grant(_server(request), _caller(request), made["id"], timeout,
                                  shortest=SHORTEST_TIMEOUT)  # fmt: skip
    box = await AsyncBox.get(made["id"], home=_server(request).home)
    return await _sandbox(request, box)


async def _sandbox(request: Request, box: AsyncBox) -> dict[str, Any]:
    home = _server(request).home
    return {
        "templateID": box.info["labels"].get(TEMPLATE_LABEL, box.info.get("image") or ""),
        "sandboxID": box.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access.sandbox_token(box.id, "envd", home),
        "trafficAccessToken": access.sandbox_token(box.id, "traffic", home),
        "domain": _domain(request),
        "alias": box.info["labels"].get(TEMPLATE_LABEL),
    }


async def _listed(request: Request, box: AsyncBox, detail: bool = False) -> dict[str, Any]:
    info = box.info
    lease = await _lease(request, box.id)
    started = _started(box)
    end = lease.until if lease is not None else started + DEFAULT_TIMEOUT
    try:
        metadata = json.loads(info["labels"].get(METADATA_LABEL) or "{}")
    except ValueError:
        metadata = {}
    on_end = info["labels"].get(server_leases.ON_END_LABEL)
    listed = {
        "templateID": info["labels"].get(TEMPLATE_LABEL, info.get("image") or ""),
        "alias": info["labels"].get(TEMPLATE_LABEL),
        "sandboxID": box.id,
        "clientID": CLIENT_ID,
        "startedAt": _iso(started),
        "endAt": _iso(end),
        "cpuCount": int(info.get("cpus") or 1),
        "memoryMB": int(info.get("memory_mib") or 256),
        "diskSizeMB": int(info.get("disk_size_gb") or 8) * 1024,
        "metadata": metadata,
        "state": "paused" if is_paused(box) else "running",
        "envdVersion": ENVD_VERSION,
    }
    if detail:
        auto_resume = info["labels"].get(AUTO_RESUME_LABEL) == "1"
        listed["lifecycle"] = {
            "onTimeout": "pause" if on_end in ("suspend", "stop") else "kill",
            "autoResume": auto_resume,
        }
        listed["envdAccessToken"] = access.sandbox_token(box.id, "envd", _server(request).home)
        listed["domain"] = _domain(request)
    return listed


def _domain(request: Request) -> str | None:
    """Where the SDKs reach a port of a sandbox (``{port}-{id}.{domain}``): the port hosts
    of the content listener, with its port; None without ``--port-domain``."""
    settings = _server(request).settings
    if not settings.port_domain:
        return None
    base = origins.content_base(settings, request.url.scheme, request.headers.get("host"))
    return origins.e2b_domain(base, settings.port_domain)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


async def _lease(request: Request, box_id: str) -> Any:
    return await asyncio.to_thread(leases.of, box_id, home=_server(request).home)


def is_paused(box: AsyncBox) -> bool:
    """Paused to E2B: suspended (memory kept), or stopped by a filesystem-only pause."""
    return box.state in ("suspended", "stopped")


def _e2b_boxes(boxes: list[AsyncBox], caller: Caller) -> list[AsyncBox]:
    """The caller's boxes that are sandboxes: made through this API, running or paused."""
    return [b for b in boxes if TEMPLATE_LABEL in b.info["labels"] and caller.may_see(b.info["labels"])
            and (b.state in ("running", "paused") or is_paused(b))]  # fmt: skip


def _filter_metadata(boxes: list[AsyncBox], query: str | None) -> list[AsyncBox]:
    if not query:
        return boxes
    wanted = dict(parse_qsl(query, keep_blank_values=True))
    kept = []
    for b in boxes:
        try:
            have = json.loads(b.info["labels"].get(METADATA_LABEL) or "{}")
        except ValueError:
            have = {}
        if all(have.get(k) == v for k, v in wanted.items()):
            kept.append(b)
    return kept


@router.get("/sandboxes")
async def list_running(request: Request, metadata: str | None = None) -> list[dict[str, Any]]:
    boxes = _e2b_boxes(await AsyncBox.list(home=_server(request).home), _caller(request))
    boxes = [b for b in _filter_metadata(boxes, metadata) if not is_paused(b)]
    return [await _listed(request, b) for b in boxes]


@router.get("/v2/sandboxes")
async def list_v2(request: Request, response: Response) -> list[dict[str, Any]]:
    q = request.query_params
    states = {s for part in q.getlist("state") for s in part.split(",") if s}
    unknown = states - {"running", "paused"}
    if unknown:
        raise InvalidArgument(f"state {sorted(unknown)}: a sandbox is running or paused")
    try:
        limit = int(q.get("limit", MOST_LISTED))
    except ValueError:
        raise InvalidArgument(f"limit is a number, not {q.get('limit')!r}") from None
    if not 1 <= limit <= MOST_LISTED:
        raise InvalidArgument(f"limit must be 1..{MOST_LISTED}")
    boxes = _e2b_boxes(await AsyncBox.list(home=_server(request).home), _caller(request))
    boxes = _filter_metadata(boxes, q.get("metadata"))
    if q.get("startedAfter"):
        after = _instant(q["startedAfter"], "startedAfter")
        boxes = [b for b in boxes if _started(b) >= after - 1e-6]  # (ISO's microseconds)
    if q.get("template"):
        template = q["template"]
        boxes = [b for b in boxes if template in (b.info["labels"].get(TEMPLATE_LABEL), b.info.get("image"))]
    if states:
        boxes = [b for b in boxes if ("paused" if is_paused(b) else "running") in states]
    boxes.sort(key=_place, reverse=q.get("order") != "asc")
    token = q.get("nextToken")
    if token:
        # a place in the order, not a box: the page after it is found if that box is gone
        try:
            after = json.loads(base64.urlsafe_b64decode(token.encode()))
            cursor = (float(after[0]), str(after[1]))
        except (ValueError, TypeError, IndexError, KeyError):
            raise InvalidArgument("nextToken is not one this server gave") from None
        newest_first = q.get("order") != "asc"
        boxes = [b for b in boxes if (_place(b) < cursor if newest_first else _place(b) > cursor)]
    page = boxes[:limit]
    if len(boxes) > limit:
        place = json.dumps(list(_place(page[-1]))).encode()
        response.headers["X-Next-Token"] = base64.urlsafe_b64encode(place).decode()
    return [await _listed(request, b) for b in page]


def _started(box: AsyncBox) -> float:
    """When the sandbox started, as its listing's ``startedAt`` says."""
    return float(box.info.get("started_at") or box.info.get("created_at") or 0.0)


def _instant(value: str, what: str) -> float:
    """An ISO 8601 time (a ``Z`` or an offset; UTC without one) as Unix time."""
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(f"{what} is an ISO 8601 time, not {value[:64]!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def _place(box: AsyncBox) -> tuple[float, str]:
    return float(box.info.get("created_at") or 0.0), box.id


@router.get("/sandboxes/{sandbox_id}")
async def get(request: Request, sandbox_id: str) -> dict[str, Any]:
    return await _listed(request, await sandbox_box(request, sandbox_id), detail=True)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(request: Request, sandbox_id: str) -> Response:
    box = await sandbox_box(request, sandbox_id)
    await box.remove(force=True)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(request: Request, sandbox_id: str) -> Response:
    body = await _body(request)
    box = await sandbox_box(request, sandbox_id)
    await server_leases.grant(
        _server(request), _caller(request), box.id, _timeout(body.get("timeout")), shortest=SHORTEST_TIMEOUT
    )
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(request: Request, sandbox_id: str) -> Response:
    body = await _body(request)
    box = await sandbox_box(request, sandbox_id)
    lease = await _lease(request, box.id)
    seconds = body.get("duration")
    seconds = (
        _timeout(seconds, "duration")
        if seconds is not None
        else (lease.seconds if lease else DEFAULT_TIMEOUT)
    )
    await server_leases.grant(_server(request), _caller(request), box.id, seconds, shortest=SHORTEST_TIMEOUT)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(request: Request, sandbox_id: str) -> Response:
    body = await _body(request)
    box = await sandbox_box(request, sandbox_id)
    if is_paused(box):
        raise InvalidState(f"sandbox {sandbox_id} is already paused", box=box.id, state=box.state)
    if body.get("memory") is False:  # filesystem only: the box stopped, its disk kept; a connect boots it
        await box.stop()
    else:
        await box.suspend()
    # a paused sandbox has no timeout (E2B keeps it until it is resumed or killed)
    await asyncio.to_thread(leases.drop, box.id, home=_server(request).home)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume(request: Request, sandbox_id: str) -> dict[str, Any]:
    body = await _body(request)
    box = await sandbox_box(request, sandbox_id)
    if not is_paused(box):
        raise InvalidState(f"sandbox {sandbox_id} is already running", box=box.id, state=box.state)
    return await _running(request, box, body)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect(request: Request, response: Response, sandbox_id: str) -> dict[str, Any]:
    body = await _body(request)
    box = await sandbox_box(request, sandbox_id)
    response.status_code = 201 if is_paused(box) else 200
    return await _running(request, box, body)


async def _running(request: Request, box: AsyncBox, body: dict[str, Any]) -> dict[str, Any]:
    """Resume the box where it is suspended (or paused), and give it its timeout again."""
    asked = body.get("timeout")
    await resume_with_timeout(_server(request), box, _timeout(asked) if asked is not None else None)
    return await _sandbox(request, box)


async def resume_with_timeout(state: ServerState, box: AsyncBox, seconds: int | None = None) -> None:
    """Bring a paused sandbox back (by a connect, or by a call to it with auto-resume on)
    and lease it again: for ``seconds``, else its lease's length, else the timeout it was
    made with."""
    running = box.state == "running"
    if box.state == "suspended":
        await box.resume()
    elif box.state == "stopped":  # a filesystem-only pause: it boots from its disk
        await box.start()
    elif box.state == "paused":
        await box.unpause()
    lease = await asyncio.to_thread(leases.of, box.id, home=state.home)
    if running and lease is not None and seconds is not None and lease.until - time.time() >= seconds:
        return  # a connect to a running sandbox lengthens its timeout, never shortens it (as E2B's)
    if seconds is None:
        made_with = box.info["labels"].get(TIMEOUT_LABEL, "")
        seconds = int(lease.seconds) if lease else int(made_with) if made_with.isdigit() else DEFAULT_TIMEOUT
    labels = box.info["labels"]
    owner = Caller.owner_of(labels)
    await server_leases.grant(state, owner, box.id, seconds, shortest=SHORTEST_TIMEOUT)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(request: Request, sandbox_id: str) -> list[dict[str, Any]]:
    """The box's sampled metrics (every 10 s while it runs: docs/events.md) in E2B's shape,
    between ``start`` and ``end`` (Unix seconds)."""
    box = await sandbox_box(request, sandbox_id)
    q = request.query_params
    try:
        start, end = float(q.get("start", 0)), float(q.get("end", 0)) or None
    except ValueError:
        raise InvalidArgument("start and end are Unix times in seconds") from None
    cpus = int(box.info.get("cpus") or 1)
    disk_total = int(box.info.get("disk_size_gb") or 8) << 30
    # a sample whose STATUS the agent did not answer in time has no guest figures: the last
    # ones known stand for them (the box's own memory size before any)
    memory = {"total": int(box.info.get("memory_mib") or 256) << 20, "used": 0}
    out = []
    for m in await box.metrics(since=start or -3600):
        if m.get("guest_memory_total_bytes"):
            memory = {
                "total": int(m["guest_memory_total_bytes"]),
                "used": int(m.get("guest_memory_used_bytes") or 0),
            }
        if end is not None and m["at"] > end:
            continue
        out.append({
            "timestamp": _iso(m["at"]), "timestampUnix": int(m["at"]), "cpuCount": cpus,
            "cpuUsedPct": float(m.get("cpu_percent") or 0.0) / cpus,
            "memUsed": memory["used"], "memTotal": memory["total"], "memCache": 0,
            "diskUsed": int(m.get("disk_bytes") or 0), "diskTotal": disk_total,
        })  # fmt: skip
    return out


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(request: Request, response: Response, sandbox_id: str) -> list[dict[str, Any]]:
    """``count`` running copies of the sandbox, each from this moment of it (sandlot's
    fork: memory, processes and disk), each with the timeout asked for."""
    body = await _body(request)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MOST_FORKED:
        raise InvalidArgument(f"count is 1..{MOST_FORKED}, not {count!r}")
    box = await sandbox_box(request, sandbox_id)
    seconds = _timeout(body.get("timeout"))
    made = await routes.run_operation(request, "box.fork", box.id, n=count)
    children = [await AsyncBox.get(info["id"], home=_server(request).home) for info in made["boxes"]]
    try:
        out = []
        for child in children:
            await server_leases.grant(_server(request), _caller(request), child.id, seconds,
                                      shortest=SHORTEST_TIMEOUT)  # fmt: skip
            out.append({"sandbox": await _sandbox(request, child)})
    except BaseException:  # children nobody was told of would run on, unleased: none is left
        for child in children:
            with contextlib.suppress(SandlotError):
                await child.remove(force=True)
        raise
    response.status_code = 201
    return out


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def snapshot(request: Request, sandbox_id: str) -> dict[str, Any]:
    """A live snapshot of the sandbox (memory, processes, disk); ``Sandbox.create`` of its
    id or name starts new sandboxes from it."""
    body = await _body(request)
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidArgument("name is a string")
    if body.get("memory") is False:
        raise Unsupported("a snapshot without memory: sandlot's snapshots are live, memory and all")
    box = await sandbox_box(request, sandbox_id)
    snap = await routes.run_operation(request, "box.snapshot", box.id, name=name or None)
    return _snapshot_info(snap)


def _snapshot_info(snap: dict[str, Any]) -> dict[str, Any]:
    return {"snapshotID": snap["id"], "names": [snap["name"]] if snap.get("name") else []}


@router.get("/snapshots")
async def list_snapshots(request: Request, response: Response) -> list[dict[str, Any]]:
    q = request.query_params
    box = q.get("sandboxID")
    listed = await routes.list_snapshots(request, kind="snapshot", box=box)
    snaps = [_snapshot_info(s) for s in listed["snapshots"]]
    name = q.get("name")
    if name:
        snaps = [s for s in snaps if name in s["names"]]
    return snaps


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(request: Request, template_id: str) -> Response:
    """E2B deletes a snapshot as a template; so does this, for snapshots and templates."""
    await routes.run_operation(request, "snapshot.remove", template_id)
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(request: Request, sandbox_id: str) -> Response:
    """Change what the sandbox may reach, now (``_policy``); what is not given is cleared,
    as in E2B."""
    body = await _body(request)
    mode, allow = _policy(body.get("allow_internet_access"), body.get("allowOut"), body.get("denyOut"),
                          body.get("rules"))  # fmt: skip
    box = await sandbox_box(request, sandbox_id)
    # its card stays (a running box's cannot come or go): no way out is an allow list of nothing
    mode = _fitting(mode, box.info.get("network") not in (None, "none"), named=True) or mode
    await routes.run_operation(request, "box.set_network", box.id, network=mode, allow=allow or None)
    return Response(status_code=204)


def _policy(internet: Any, allow: Any, deny: Any, rules: Any) -> tuple[str, list[str]]:
    """sandlot's network mode and allow list for E2B's egress settings. In E2B an allowed
    destination wins over a denied one, and nothing is denied unless asked: so what
    restricts a sandbox is a deny of all traffic (``0.0.0.0/0``, or no internet access),
    with ``allowOut`` the exceptions, which is sandlot's allow list."""
    if rules:
        raise Unsupported("network rules (header transforms) are not supported")
    for name, value in (("allowOut", allow), ("denyOut", deny)):
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise InvalidArgument(f"{name} is a list of host names and addresses")
    allow, deny = list(allow or []), list(deny or [])
    particular = [d for d in deny if d != ALL_TRAFFIC]
    if particular:
        named = ", ".join(particular[:3])
        raise Unsupported(
            f"denyOut of particular destinations ({named}) is not supported: sandlot's policy is "
            f"an allow list: deny {ALL_TRAFFIC} and allow what may be reached"
        )
    if internet is False or deny:
        return ("allowlist", allow) if allow else ("none", [])
    return "public", []


@router.get("/sandboxes/{sandbox_id}/logs")
async def logs_v1(request: Request, sandbox_id: str) -> dict[str, Any]:
    entries = await _log_entries(request, sandbox_id)
    return {"logs": [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries],
            "logEntries": entries}  # fmt: skip


@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(request: Request, sandbox_id: str) -> dict[str, Any]:
    return {"logs": await _log_entries(request, sandbox_id)}


async def _log_entries(request: Request, sandbox_id: str) -> list[dict[str, Any]]:
    """The box's console (its kernel's and agent's lines), as E2B's log entries."""
    q = request.query_params
    try:
        limit = int(q.get("limit", 1000))
    except ValueError:
        raise InvalidArgument("limit is a number") from None
    box = await sandbox_box(request, sandbox_id)
    text = await box.logs(lines=max(1, min(limit, 10_000)))
    now = _iso(time.time())
    search = q.get("search")
    lines = [line for line in text.splitlines() if line.strip() and (not search or search in line)]
    if q.get("direction") == "backward":
        lines.reverse()
    return [{"timestamp": now, "message": line, "level": "info", "fields": {}} for line in lines]
