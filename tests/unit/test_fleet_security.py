"""The fleet's security without a cluster: the token found as Ray finds it and made
readable by its owner only, the ``ray start`` of a sandlot node (authenticated, the
dashboard on loopback, no Ray Client unless asked), what a node recorded of its
cluster for ``sandlot doctor``, and the node actor's calls: only those of
``NODE_CALLS``, each argument checked against its signature and an operation's against
the contract, as the server checks a request. A real cluster refusing a driver without
its token, and a node refusing an open cluster, are ``tests/vm/test_fleet.py``'s."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot import clusterauth
from sandlot.api import loop
from sandlot.errors import InvalidArgument

ray = pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'sandlot[fleet]'")

from sandlot.cli.fleet import ray_start  # noqa: E402
from sandlot.fleet import trust  # noqa: E402
from sandlot.fleet.backend import opened  # noqa: E402
from sandlot.fleet.node import NODE_CALLS, NodeActor, NodeService  # noqa: E402

from tests.support.fake_engine import fake_rootfs, register  # noqa: E402

# -- the token -----------------------------------------------------------------------------


def test_the_token_is_found_as_ray_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".ray" / "auth_token"
    named = tmp_path / "named"
    assert clusterauth.find_token({}) is None
    default.parent.mkdir()
    default.write_text("from-default\n")
    named.write_text("from-path")
    assert clusterauth.find_token({}) == clusterauth.Token("from-default", str(default))
    assert clusterauth.find_token({"RAY_AUTH_TOKEN_PATH": str(named)}).value == "from-path"  # type: ignore[union-attr]
    both = {"RAY_AUTH_TOKEN_PATH": str(named), "RAY_AUTH_TOKEN": "from-env"}
    assert clusterauth.find_token(both) == clusterauth.Token("from-env", "RAY_AUTH_TOKEN")
    assert clusterauth.find_token({"RAY_AUTH_TOKEN": ""}).value == "from-default"  # type: ignore[union-attr]
    # a path named and missing is an error, as for Ray: never another token silently
    with pytest.raises(InvalidArgument, match=r"RAY_AUTH_TOKEN_PATH names .*missing"):
        clusterauth.find_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")})


def test_a_token_is_made_for_its_owner_only_and_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "d" / "auth_token"
    made = clusterauth.make_token(path)
    assert len(made.value) == 64 and path.read_text() == made.value
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and clusterauth.loose_mode(path) is None
    with pytest.raises(InvalidArgument, match="never replaced"):
        clusterauth.make_token(path)
    assert path.read_text() == made.value
    path.chmod(0o644)
    assert "mode 0644" in (clusterauth.loose_mode(path) or "")


def test_doctor_reads_what_the_node_found(tmp_path: Path) -> None:
    env = {"RAY_AUTH_TOKEN": "t", clusterauth.INSECURE_ENV: "1", "RAY_USE_TLS": "1"}
    assert clusterauth.report(tmp_path, env)["node"] is None
    clusterauth.record_trust(tmp_path, {"node_id": "n1", "cluster_auth": "open", "serving": False})
    found = clusterauth.report(tmp_path, env)
    assert found["node"]["cluster_auth"] == "open" and not found["node"]["serving"]
    assert found["token"] == {"source": "RAY_AUTH_TOKEN"} and found["insecure_allowed"]
    assert found["tls"]["on"] and len(found["tls"]["missing"]) == 3  # no certificate named


# -- starting a node ---------------------------------------------------------------------------


def test_a_node_starts_authenticated_with_little_exposed(tmp_path: Path) -> None:
    token = tmp_path / "auth_token"
    env = {"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(token)}
    with pytest.raises(InvalidArgument, match="copy the head's"):  # a worker needs the head's token
        ray_start(head=False, address="head:6379", cpus=4, memory_mib=4096, environ=env)
    argv, run_env = ray_start(head=True, address=None, cpus=4, memory_mib=4096, environ=env)
    assert token.exists() and stat.S_IMODE(token.stat().st_mode) == 0o600  # the head made it
    assert run_env["RAY_AUTH_MODE"] == "token" and clusterauth.INSECURE_ENV not in run_env
    assert argv[argv.index("--dashboard-host") + 1] == "127.0.0.1"
    assert "--disable-usage-stats" in argv  # nothing sent to Ray's vendor unless asked
    asked, _ = ray_start(head=True, address=None, cpus=4, memory_mib=4096,
                         environ={**env, "RAY_USAGE_STATS_ENABLED": "1"})  # fmt: skip
    assert "--disable-usage-stats" not in asked
    if importlib.util.find_spec("grpc") is not None:  # else Ray runs no Ray Client server anyway
        assert argv[argv.index("--ray-client-server-port") + 1] == "0"  # no Ray Client
    assert '"sandlot_memory_mib": 4096' in argv[argv.index("--resources") + 1]
    argv, run_env = ray_start(head=False, address="head:6379", cpus=4, memory_mib=4096, environ=env)
    assert run_env["RAY_AUTH_MODE"] == "token" and argv[argv.index("--address") + 1] == "head:6379"
    off = {**env, "RAY_AUTH_MODE": "disabled"}
    with pytest.raises(InvalidArgument, match="--insecure-cluster"):
        ray_start(head=True, address=None, cpus=4, memory_mib=4096, environ=off)
    _, run_env = ray_start(
        head=True, address=None, cpus=4, memory_mib=4096, environ=off, insecure_cluster=True
    )
    assert run_env[clusterauth.INSECURE_ENV] == "1" and run_env["RAY_AUTH_MODE"] == "disabled"
    with pytest.raises(InvalidArgument, match=r"--head .* or --address"):
        ray_start(head=True, address="head:6379", cpus=4, memory_mib=4096, environ=env)


def test_a_refused_driver_is_told_where_the_token_was_looked_for() -> None:
    err = trust.refused("10.0.0.1:6379", None, RuntimeError("InvalidAuthToken: missing"))
    assert isinstance(err, sandlot.Unauthorized) and "has no token" in str(err)
    assert "sandlot fleet token" in str(err)
    wrong = trust.refused("10.0.0.1:6379", clusterauth.Token("x", "/t"), RuntimeError("InvalidAuthToken"))
    assert "the token from /t is not the cluster's" in str(wrong)
    assert trust.is_refusal(ConnectionError("... InvalidAuthToken ...")) and not trust.is_refusal(
        OSError("x")
    )


# -- the node actor's calls ------------------------------------------------------------------


def test_ray_sees_only_the_node_calls() -> None:
    seen = {n for n, v in inspect.getmembers(NodeActor, inspect.isfunction) if n != "__init__"}
    assert seen == set(NODE_CALLS)
    for name in NODE_CALLS:  # each of its kind: Ray streams an async generator, awaits a coroutine
        relay, body = getattr(NodeActor, name), getattr(NodeService, name)
        assert inspect.isasyncgenfunction(relay) == inspect.isasyncgenfunction(body), name
        # the body's signature, and the namespace its driver acts for (by keyword only)
        params = list(inspect.signature(relay).parameters.values())
        assert params[:-1] == list(inspect.signature(body).parameters.values()), name
        assert (params[-1].name, params[-1].kind, params[-1].default) == (
            "namespace",
            params[-1].KEYWORD_ONLY,
            None,
        )


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[NodeService, str]]:
    """A node's body on the fake engine, called as a driver would (outside Ray: no cluster check)."""
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    home = tmp_path / "home"
    body = loop.call(NodeService, "n1", str(home))
    made = opened(
        loop.run(body.create(None, {"rootfs": str(fake_rootfs(tmp_path)), "memory_mib": 256}, True))
    )
    try:
        yield body, made["id"]
    finally:
        for b in sandlot.list(home=home):
            b.remove(force=True)
        if body._sweeping is not None:
            loop.call(body._sweeping.cancel)


def refused(reply: Any) -> str:
    """The message of a node's InvalidArgument reply."""
    with pytest.raises(InvalidArgument) as caught:
        opened(reply)
    return str(caught.value)


def test_a_node_runs_only_the_contracts_operations_with_their_arguments(
    node: tuple[NodeService, str],
) -> None:
    body, box = node
    assert opened(loop.run(body.call("box", "refresh", box, {})))["state"] == "running"
    assert "not an operation of the contract" in refused(loop.run(body.call("box", "settle", box, {})))
    assert "not an operation" in refused(loop.run(body.call("box", "__init__", box, {})))
    assert "bogus" in refused(loop.run(body.call("files", "remove", box, {"path": "/x", "bogus": 1})))
    assert "timeout" in refused(loop.run(body.call("box", "stop", box, {"timeout": "soon"})))
    assert "params" in refused(loop.run(body.call("box", "refresh", box, ["not", "an", "object"])))
    assert "key" in refused(loop.run(body.call("box", "refresh", 42, {})))
    assert "a box is named" in refused(loop.run(body.call("box", "refresh", "x" * 300, {})))
    assert "argv" in refused(loop.run(body.exec(box, {"argv": []})))
    assert "rows" in refused(loop.run(body.spawn(box, {"argv": ["cat"], "rows": 0})))
    # the fleet's own calls: strictly their signatures' types (a bool is no count, a string no bool)
    assert "n" in refused(loop.run(body.start_from("snap", True, None, None, {})))
    assert "force" in refused(loop.run(body.remove(box, "yes")))
    assert "labels" in refused(loop.run(body.start_from("snap", 1, None, None, {"k": 1})))
    assert "data" in refused(loop.run(body.upload_chunk("u1", "text, not bytes")))
    assert opened(loop.run(body.call("box", "refresh", box, {})))["state"] == "running"  # nothing changed


async def last(items: Any) -> Any:
    out = None
    async for item in items:
        out = item
    return out


def test_a_nodes_streams_refuse_what_is_not_theirs(node: tuple[NodeService, str]) -> None:
    body, box = node
    for stream, why in (
        (body.stream("shell", box, {}), "no server stream 'shell'"),
        (body.stream("files.write", box, {"path": "/x"}), "no server stream 'files.write'"),
        (body.stream("files.read", box, {"path": "/x", "mode": "w"}), "mode"),
        (body.stream("files.read", box, "path"), "an object"),
        (body.follow(box, "p1", (-1, 0)), "offsets"),
        (body.events({"after": "yesterday"}), "after"),
        (body.events(["box"]), "an object"),
    ):
        message = loop.run(last(stream))
        message = json.loads(message) if isinstance(message, str) else message  # a process's frames are text
        assert message["type"] == "error" and message["error"]["code"] == "invalid_argument", message
        assert why in message["error"]["message"], message


def test_an_env_without_a_mode_gets_token_mode_when_a_token_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``connect`` sends the token it finds; an explicit mode is the operator's."""
    refreshed: list[bool] = []
    monkeypatch.setattr(trust, "refresh_ray_config", lambda: refreshed.append(True))
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    assert trust.use_token("10.0.0.1:6379") is None and "RAY_AUTH_MODE" not in os.environ
    made = trust.use_token(None)  # a local cluster: its token made
    assert made is not None and made.path == tmp_path / ".ray" / "auth_token"
    assert os.environ["RAY_AUTH_MODE"] == "token" and refreshed == [True]
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "named"))
    with pytest.raises(InvalidArgument, match="missing or empty"):  # a cluster elsewhere: never another token
        trust.use_token("10.0.0.1:6379")
    assert trust.use_token(None).path == tmp_path / "named"  # type: ignore[union-attr]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert trust.use_token("10.0.0.1:6379") is None and os.environ["RAY_AUTH_MODE"] == "disabled"


# -- namespaces ------------------------------------------------------------------------------


def test_a_node_answers_a_namespaced_driver_for_its_namespace_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call through the relay (as Ray makes it) carries the driver's namespace; the node
    judges by its own boxes' and snapshots' labels, as ``sandlot serve`` judges a key's."""
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    home = tmp_path / "home"
    actor = loop.call(NodeActor, "n1", str(home))
    root = str(fake_rootfs(tmp_path))

    def made(namespace: str | None, **body: Any) -> dict[str, Any]:
        reply = loop.run(
            actor.create(None, {"rootfs": root, "memory_mib": 256, **body}, True, namespace=namespace)
        )
        return dict(opened(reply))

    try:
        a = made("team-a", name="a1", labels={"app": "x"})
        b = made("team-b", name="b1")
        assert a["labels"] == {"app": "x", "sandlot.namespace": "team-a"}
        assert b["labels"] == {"sandlot.namespace": "team-b"}

        def listed(namespace: str | None) -> set[str]:
            return {x["name"] for x in opened(loop.run(actor.list(namespace=namespace)))}

        assert listed("team-a") == {"a1"} and listed("team-b") == {"b1"} and listed(None) == {"a1", "b1"}
        assert listed("team-c") == set()
        # another namespace's box is not there, by id or by name, for every kind of call
        for key in (b["id"], "b1"):
            with pytest.raises(sandlot.BoxNotFound):
                opened(loop.run(actor.call("box", "refresh", key, {}, namespace="team-a")))
        with pytest.raises(sandlot.BoxNotFound):
            opened(loop.run(actor.exec(b["id"], {"argv": ["true"]}, namespace="team-a")))
        with pytest.raises(sandlot.BoxNotFound):
            opened(loop.run(actor.send(b["id"], "p1", b"x", namespace="team-a")))
        with pytest.raises(sandlot.BoxNotFound):
            opened(loop.run(actor.upload_begin(b["id"], "files.write", {"path": "/f"}, namespace="team-a")))
        message = loop.run(
            last(actor.stream("files.read", b["id"], {"path": "/etc/hostname"}, namespace="team-a"))
        )
        assert message["type"] == "error" and message["error"]["code"] == "box_not_found", message
        assert opened(loop.run(actor.remove(b["id"], True, namespace="team-a"))) is None  # as if gone...
        for move_end in (actor.finish, actor.release, actor.hold, actor.push_box):  # the fleet's moves
            with pytest.raises(sandlot.BoxNotFound):
                opened(loop.run(move_end(b["id"], namespace="team-a")))
        assert listed(None) == {"a1", "b1"}  # ...and it is not
        assert (
            opened(loop.run(actor.finish("0123456789ab", namespace="team-a"))) is None
        )  # none here: no refusal
        # its own box answers
        assert (
            opened(loop.run(actor.exec(a["id"], {"argv": ["echo", "hi"]}, namespace="team-a")))["exit_code"]
            == 0
        )
        # a caller's labels are never sandlot's own; its namespace is stamped whatever it claims
        assert "sandlot." in refused(
            loop.run(actor.create(None, {"rootfs": root, "labels": {"sandlot.namespace": "team-b"}}, True,
                                  namespace="team-a"))
        )  # fmt: skip
        assert "namespace" in refused(loop.run(actor.list(namespace="../x")))
        # snapshots are their box's namespace's; boxes started from one are the caller's
        snap = opened(loop.run(actor.call("box", "snapshot", a["id"], {"name": "sa"}, namespace="team-a")))
        assert snap["name"] == "sa"
        with pytest.raises(sandlot.SnapshotNotFound):
            opened(loop.run(actor.find_snapshot("sa", namespace="team-b")))
        with pytest.raises(sandlot.SnapshotNotFound):
            opened(loop.run(actor.start_from("sa", 1, "stolen", None, {}, namespace="team-b")))
        with pytest.raises(sandlot.SnapshotNotFound):
            opened(loop.run(actor.export("sa", namespace="team-b")))
        assert [
            s["name"] for s in opened(loop.run(actor.snapshot_list(None, None, namespace="team-b")))
        ] == []
        assert "sa" in [
            s["name"] for s in opened(loop.run(actor.snapshot_list(None, None, namespace="team-a")))
        ]
        claimed = {"app": "x", "sandlot.namespace": "team-b"}  # what a driver passes on: restamped
        kids = opened(loop.run(actor.start_from("sa", 1, "a2", None, claimed, namespace="team-a")))
        assert kids[0]["labels"] == {"app": "x", "sandlot.namespace": "team-a"}
        started = opened(
            loop.run(
                actor.call(
                    "snapshot", "start", "sa", {"name": "a3", "labels": {"k": "v"}}, namespace="team-a"
                )
            )
        )
        assert started["boxes"][0]["labels"] == {"app": "x", "k": "v", "sandlot.namespace": "team-a"}
        assert "sandlot." in refused(
            loop.run(actor.call("snapshot", "start", "sa", {"labels": {"sandlot.namespace": "team-b"}},
                                namespace="team-a"))
        )  # fmt: skip
        # events: the namespace's boxes' only
        query = {"follow": False}
        seen_b = {e["box_name"] for e in loop.run(collected(actor.events(query, namespace="team-b")))}
        seen_all = {e["box_name"] for e in loop.run(collected(actor.events(query)))}
        assert seen_b == {"b1"} and {"a1", "a2", "a3", "b1"} <= seen_all
    finally:
        for box in sandlot.list(home=home):
            box.remove(force=True)
        if actor.body._sweeping is not None:
            loop.call(actor.body._sweeping.cancel)


async def collected(items: Any) -> list[Any]:
    return [item async for item in items]


def test_a_namespaced_driver_sends_its_namespace_with_every_call() -> None:
    from sandlot.fleet.client import Fleet, NamespacedNode

    sent: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    class Method:
        def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
            self.name, self.opts = name, options or {}

        def remote(self, *args: Any, **kwargs: Any) -> str:
            sent.append((self.name, args, {**kwargs, **self.opts}))
            return "ref"

        def options(self, **options: Any) -> Method:
            return Method(self.name, options)

    class Handle:
        def __getattr__(self, name: str) -> Method:
            return Method(name)

    node = NamespacedNode(Handle(), "team-a")
    node.exec.remote("box1", {"argv": ["true"]})
    node.stream.options(num_returns="streaming").remote("read", "box1", {})
    assert sent == [
        ("exec", ("box1", {"argv": ["true"]}), {"namespace": "team-a"}),
        ("stream", ("read", "box1", {}), {"namespace": "team-a", "num_returns": "streaming"}),
    ]
    f = Fleet(namespace="team-a")
    assert f.sees({"sandlot.namespace": "team-a"}) and not f.sees({"sandlot.namespace": "team-b"})
    assert not f.sees({}) and Fleet().sees({})
    with pytest.raises(InvalidArgument, match="namespace"):
        Fleet(namespace="a/b")
