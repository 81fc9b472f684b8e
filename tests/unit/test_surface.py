"""The box's surface, enumerated from the code, with no allowlist: every operation of
the wire contract (``api/contract.py``) is a method of the facade of its scope with
the operation's arguments, is reached by that method, is implemented by the local
backend, has its route in the server's application, and is carried by the HTTP and
Ray backends and served by a fleet node; every public method of the facades is an
operation or is built on operations and the backends' streaming primitives; every
backend implements every primitive."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

import sandlot
from sandlot.api import contract
from sandlot.api.backend import Backend
from sandlot.api.box import AsyncBox, AsyncSnapshot
from sandlot.api.files import AsyncFiles
from sandlot.api.http import HttpBackend, HttpBoxRef, HttpSnapshotRef
from sandlot.api.local import LocalBackend
from sandlot.errors import Unsupported

from tests.support.contract import args_for

FACADES: dict[str, type] = {"box": AsyncBox, "files": AsyncFiles, "snapshot": AsyncSnapshot}
PRIMITIVES = {n for n, v in vars(Backend).items() if getattr(v, "__isabstractmethod__", False)} | {
    "attach", "taken_over", "release", "info", "aclose", "events", "as_step"}  # fmt: skip


def public_methods(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items()
            if (inspect.isfunction(v) or isinstance(v, classmethod)) and not n.startswith("_")}  # fmt: skip


@pytest.mark.parametrize("op", contract.OPERATIONS, ids=lambda o: o.key)
def test_every_operation_is_a_method_of_its_facade_with_its_arguments(op: contract.Operation) -> None:
    method = getattr(FACADES[op.scope], op.name, None)
    assert method is not None, f"{FACADES[op.scope].__name__} has no {op.name}: the operation has no face"
    params = inspect.signature(method).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for field in op.params.model_fields:
        assert field in params or open_ended, (
            f"{op.key}: {FACADES[op.scope].__name__}.{op.name} lacks {field}"
        )


@pytest.mark.parametrize("op", contract.OPERATIONS, ids=lambda o: o.key)
def test_every_operation_is_implemented_by_the_local_backend(op: contract.Operation) -> None:
    impl = getattr(LocalBackend, f"{op.scope}_{op.name}", None)
    assert impl is not None, f"the local backend does not implement {op.key}"
    params = inspect.signature(impl).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for field in op.params.model_fields:
        assert field in params or open_ended, f"LocalBackend.{op.scope}_{op.name} takes no {field}"


def test_every_operation_has_its_route_in_the_server() -> None:
    from sandlot.server.app import create_app
    from sandlot.server.state import Settings

    app = create_app(Settings(auth=False, mcp=False))
    paths = app.fastapi.openapi()[
        "paths"
    ]  # the guard wraps the FastAPI application; its schema lists every route
    for op in contract.OPERATIONS:
        route = paths.get(f"/v1{op.path}", {})
        assert op.method.lower() in route, f"no route for {op.key}: {op.method} /v1{op.path}"
        declared = {p["name"] for p in route[op.method.lower()].get("parameters", [])}
        body = route[op.method.lower()].get("requestBody")
        for field in op.params.model_fields:  # each argument is in the path, the query or the body
            assert field in declared or body is not None, f"{op.key}: the route does not take {field}"
        answers = route[op.method.lower()]["responses"]
        assert str(op.status) in answers, f"{op.key} answers {sorted(answers)}, not {op.status}"
    made = {op.key for op in contract.OPERATIONS if op.status == 201}
    assert made == {
        "box.snapshot",
        "box.fork",
        "box.fork_at",
        "box.preview_url",
        "box.create_code_context",
        "snapshot.start",
    }


@pytest.mark.parametrize("stream", contract.STREAMS, ids=lambda s: s.key)
def test_every_stream_is_a_primitive_served_by_its_key_and_carried_by_the_two_codecs(
    stream: contract.Stream,
) -> None:
    """A stream of the table is a primitive of the backends (the facade of its scope builds
    on it), the home that holds the box runs it by its key, and a backend elsewhere carries
    it through its transport's two codecs alone: neither HTTP nor Ray writes it out."""
    from sandlot.api import host
    from sandlot.api.remote import StreamingBackend
    from sandlot.fleet.backend import RayBackend

    assert getattr(getattr(Backend, stream.name, None), "__isabstractmethod__", False), stream.key
    assert any(stream.name in calls_in(m)[1] for m in public_methods(FACADES[stream.scope]).values()), (
        stream.key
    )
    registry = host.STREAMED if stream.kind == "server" else host.TAKEN
    assert stream.key in registry, f"the home runs no {stream.key}"
    assert stream.name in vars(StreamingBackend), stream.key
    for cls in (HttpBackend, RayBackend):
        assert stream.name not in vars(cls), f"{cls.__name__} writes {stream.name} out"


def test_every_route_of_the_table_is_its_own_and_none_is_written_over_it() -> None:
    """One route per operation and per stream, at its method and path, made from the table;
    a route written out by hand at the same place is refused when the server is built."""
    from sandlot.server import routes

    made = [(m, r.path, r.name) for r in routes.router.routes for m in getattr(r, "methods", ())]
    for row in (*contract.OPERATIONS, *contract.STREAMS):
        found = [name for m, path, name in made if (m, path) == (row.method, row.path)]
        assert found == [f"{row.scope}_{row.name}"], (row.key, found)
    with pytest.raises(AssertionError, match="written out by hand"):
        routes._refuse_shadow("GET", "/boxes/{box}/files/watch", "files.watch")


TRANSPORTS = ("api/http.py", "api/remote.py", "fleet/backend.py", "fleet/node.py", "server/routes.py")


def test_no_transport_tells_operations_apart_by_name() -> None:
    """What a transport must know of an operation is an attribute of its row (who answers
    it, whether it removes the box...): no transport compares an operation's key or name
    with a literal (its scope says what its target is: a box or a snapshot). A
    transport's own way to run one (the fleet's fork, the server's preview URLs) is
    registered by its key; the server answers every operation that is not the box's."""
    from sandlot.fleet.backend import FLEET_RUNS
    from sandlot.server import bridge, routes

    src = Path(sandlot.__file__).parent
    for name in TRANSPORTS:
        for node in ast.walk(ast.parse((src / name).read_text())):
            if not isinstance(node, ast.Compare):
                continue
            left = ast.unparse(node.left)
            literal = any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators)
            assert not (literal and left in ("op.key", "key", "name", "op.name")), (
                f"{name}: {ast.unparse(node)}"
            )
    assert bridge.make_preview is routes.ANSWERED["box.preview_url"]
    assert set(routes.ANSWERED) == {op.key for op in contract.OPERATIONS if op.answers != "box"}
    assert set(FLEET_RUNS) <= set(contract.BY_KEY)


def test_every_backend_implements_every_primitive() -> None:
    from sandlot.fleet.backend import RayBackend

    for cls in (LocalBackend, HttpBackend, RayBackend):
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)}"


def calls_in(fn: Any) -> tuple[set[str], set[str], set[str]]:
    """What a facade method reaches: operations (``self._op("x")``, ``self._call("x")``,
    ``backend.call("scope", "x", ...)``), backend primitives, and other methods of self."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    ops, prims, own = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
            own.add(node.attr)  # a method handed on (``open_relay(self.spawn, ...)``) counts too
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, target = node.func.attr, ast.unparse(node.func.value)
        literal = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if name in ("_op", "_call") and literal:
            ops.add(literal[0])
        elif name == "call" and target.endswith("backend") and len(literal) >= 2:
            ops.add(literal[1])
        elif target.endswith(("_backend", "backend")) and name in PRIMITIVES:
            prims.add(name)
        elif target in ("self", "self.files", "box"):
            own.add(name)
    return ops, prims, own


@pytest.mark.parametrize("scope", list(FACADES))
def test_every_public_method_is_an_operation_or_built_on_them(scope: str) -> None:
    cls = FACADES[scope]
    names = {op.name for op in contract.OPERATIONS if op.scope == scope}
    reached: set[str] = set()
    graph = {}
    for name, member in public_methods(cls).items():
        fn = member.__func__ if isinstance(member, classmethod) else member
        ops, prims, own = calls_in(fn)
        unknown = ops - names
        assert not unknown, f"{cls.__name__}.{name} asks for operations the contract lacks: {unknown}"
        reached |= ops
        graph[name] = (ops, prims, own)

    def grounded(name: str, seen: frozenset[str] = frozenset()) -> bool:
        ops, prims, own = graph[name]
        if ops or prims:
            return True
        return any(grounded(o, seen | {name}) for o in own if o in graph and o not in seen)

    local_only = {"__init__", "bound", "of", "get", "list", "default_command"}  # the local home's own doors
    for name in graph:
        if name in local_only:
            continue
        assert grounded(name), f"{cls.__name__}.{name} reaches no operation and no backend primitive"
    assert names <= reached, f"operations no method of {cls.__name__} asks for: {names - reached}"


# -- the transports carry every operation ------------------------------------------------------

BOX = {"id": "b0x", "name": "dev", "state": "running", "labels": {}}
FILE = {"path": "/tmp/x", "name": "x", "type": "file", "size": 0, "mode": 0, "uid": 0, "gid": 0,
        "mtime": "2026-01-01T00:00:00+00:00"}  # fmt: skip
CONTEXT = {"id": "c", "language": "python", "cwd": "/", "kernel": "builtin"}
# an answer of each kind of result, as the other side writes it
ANSWERS: dict[str, Any] = {
    "none": None, "text": "console", "json": {}, "box": BOX, "boxes": {"boxes": [BOX]},
    "snapshot": {"id": "s1", "node": "n1"}, "snapshots": {"snapshots": []}, "file": FILE,
    "files": {"entries": []},
    "float": {"value": 0.001}, "activity": {"busy": 0, "idle_s": 1.0}, "ports": {"ports": []},
    "processes": {"processes": []}, "url": {"url": "http://x/p/"}, "context": CONTEXT,
    "contexts": {"contexts": []}, "network": {"network": "none", "allow": []},
}  # fmt: skip


@pytest.mark.parametrize("op", contract.OPERATIONS, ids=lambda o: o.key)
def test_the_http_backend_carries_every_operation_to_its_route(op: contract.Operation) -> None:
    seen: list[httpx.Request] = []
    box = BOX

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        kind = op.result.kind
        if kind == "none":
            return httpx.Response(204)
        if kind == "text":
            return httpx.Response(200, text="console")
        return httpx.Response(200, json=ANSWERS[kind])

    async def main() -> None:
        backend = HttpBackend("http://sandlot.test", "k", transport=httpx.MockTransport(handler))
        target = HttpSnapshotRef(backend, {"id": "s1"}) if op.scope == "snapshot" else \
            HttpBoxRef(backend, None, box)  # fmt: skip
        await backend.call(op.scope, op.name, target, args_for(op))
        await backend.aclose()

    asyncio.run(main())
    [request] = seen
    template = "/v1" + op.path
    expected = template.format(box="b0x", snap="s1", context="ctx-1", step="1")
    assert (request.method, request.url.path) == (op.method, expected)


@pytest.mark.parametrize("op", contract.OPERATIONS, ids=lambda o: o.key)
def test_the_ray_backend_carries_every_operation_to_the_nodes_call(op: contract.Operation) -> None:
    """The driver's side of the Ray transport: each operation becomes the node actor's
    ``call`` with the contract's JSON (the node's side is in ``test_contract.py``, and
    both on a real cluster in ``tests/vm/test_contract.py``)."""
    pytest.importorskip("ray")
    from sandlot.fleet import backend as ray_backend

    calls: list[tuple[str, tuple[Any, ...]]] = []
    box = {**BOX, "node": "n1", "cpus": 1, "memory_mib": 256}

    class Remote:
        def __init__(self, name: str, answer: Any) -> None:
            self.name, self.answer = name, answer

        def remote(self, *args: Any) -> Any:
            calls.append((self.name, args))
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.set_result(self.answer(*args))
            return fut

        def options(self, **_: Any) -> Remote:
            return self

    def node_call(scope: str, name: str, key: str, params: dict[str, Any]) -> Any:
        kind = contract.operation(scope, name).result.kind  # type: ignore[arg-type]
        return {"ok": {**ANSWERS, "box": box, "boxes": {"boxes": [box]}, "json": {"options": {}}}[kind]}

    class Node:
        call = Remote("call", node_call)
        remove = Remote("remove", lambda *a: {"ok": None})
        drop_snapshot = Remote("drop_snapshot", lambda *a: {"ok": None})
        list = Remote("list", lambda *a: {"ok": [box]})

    class Directory:
        get = Remote("directory.get", lambda key: dict(box))
        update = Remote("directory.update", lambda key, changes: {**box, **changes})
        put = Remote("directory.put", lambda rec: rec)
        release = Remote("directory.release", lambda key: [])
        reconcile = Remote("directory.reconcile", lambda alive, seen: ([box], []))
        all = Remote("directory.all", lambda: [box])

    class Fleet:
        placement_timeout = 1.0

        def directory(self) -> Any:
            return Directory()

        def node(self, node_id: str) -> Any:
            return Node()

    async def main() -> None:
        backend = ray_backend.RayBackend(Fleet())  # type: ignore[arg-type]
        if op.scope == "snapshot":
            target: Any = ray_backend.RaySnapshotRef(backend, {"id": "s1", "node": "n1"})
        else:
            target = ray_backend.RayBoxRef(backend, dict(box))
        originals = (ray_backend.placement.reserve, ray_backend.placement.release,
                     ray_backend.placement.sandlot_nodes)  # fmt: skip
        ray_backend.placement.reserve = lambda *a, **k: ray_backend.placement.Reservation("pg", ("n1",) * 8)
        ray_backend.placement.release = lambda name: None
        ray_backend.placement.sandlot_nodes = lambda *a, **k: [{"NodeID": "n1"}]
        try:
            await backend.call(op.scope, op.name, target, args_for(op))
        finally:
            (ray_backend.placement.reserve, ray_backend.placement.release,
             ray_backend.placement.sandlot_nodes) = originals  # fmt: skip

    asyncio.run(main())
    node_calls = [args for name, args in calls if name in ("call", "remove")]
    assert node_calls, f"{op.key} never reached the node"
    if op.key != "box.remove":
        assert any(a[:2] == (op.scope, op.name) for a in node_calls), f"{op.key}: {node_calls}"


def test_a_transport_that_cannot_do_something_says_which(tmp_path: Path) -> None:
    from tests.support.fake_engine import fake_rootfs, register

    register()

    async def main() -> None:
        box = AsyncBox(rootfs=fake_rootfs(tmp_path), engine="fake", home=tmp_path / "home", template=False,
                       memory_mib=256)  # fmt: skip
        async with box:
            with pytest.raises(Unsupported, match="not offered over the local transport") as refused:
                await box.preview_url(8080)
            assert refused.value.transport == "local" and refused.value.to_dict()["transport"] == "local"
            with pytest.raises(Unsupported, match="local transport"):
                await box.processes()
            assert isinstance(refused.value, sandlot.InvalidArgument)  # caught where bad input is

    asyncio.run(main())
