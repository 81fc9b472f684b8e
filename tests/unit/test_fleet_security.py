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
        assert inspect.signature(relay) == inspect.signature(body), name


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
        (body.stream("shell", box, {}), "not 'shell'"),
        (body.stream("read", box, {"path": "/x", "mode": "w"}), "mode"),
        (body.stream("read", box, "path"), "an object"),
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
