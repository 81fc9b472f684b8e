"""The fleet on a real multi-node Ray cluster on this machine (``ray.cluster_utils``):
three nodes, each its own raylet, sandlot home and resources; real VMs, real
moves of saved state through Ray's object store. The tests share one cluster and
run in order: the node-loss test kills a node last. A fleet box is a ``sandlot.Box``
(its contract on every transport is ``test_contract.py``'s); these are what only a
fleet does: placement, forks spread over nodes, moves, node loss and replicas."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandlot

pytestmark = pytest.mark.vm

ray = pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'sandlot[fleet]'")

from sandlot import fleet  # noqa: E402 (after Ray is known to be there)
from sandlot.fleet.backend import answer  # noqa: E402

from tests.support.clock import ticks_in  # noqa: E402
from tests.support.fleet import FleetCluster  # noqa: E402
from tests.support.waiting import deadline_in, goes_past  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# a shell whose counter lives only in its memory; it writes it to a file the tests read
COUNTER = r"""
setsid sh -c 'echo $$ > /tmp/pid; i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp;
  mv /tmp/c.tmp /tmp/count; sleep 0.1; done' </dev/null >/dev/null 2>&1 &
"""


def node_of(box: sandlot.Box) -> str:
    return str(box.info["node"])


def count(box: sandlot.Box) -> int:
    return int(box.sh("cat /tmp/count").stdout)


def wait_count(box: sandlot.Box, at_least: int = 3) -> int:
    deadline = deadline_in(20)
    while True:
        try:
            c = count(box)
            if c >= at_least:
                return c
        except ValueError:
            pass
        assert time.monotonic() < deadline, "the counter never started"
        time.sleep(0.2)


class Nodes:
    def __init__(self, fc: FleetCluster, head: str, a: str, b: str) -> None:
        self.fc, self.head, self.a, self.b = fc, head, a, b


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    fc = FleetCluster()
    try:
        head = fc.add(cpus=4, memory_mib=2048)
        a = fc.add(cpus=4, memory_mib=2048)
        b = fc.add(cpus=2, memory_mib=512)  # the small one
        ray.init(address=fc.address, namespace="sandlot", log_to_driver=False)
        yield Nodes(fc, head, a, b)
    finally:
        fc.shutdown()


@pytest.fixture(scope="module")
def f(nodes: Nodes) -> fleet.Fleet:
    return fleet.connect(nodes.fc.address, placement_timeout=30)  # a busy host commits slowly


def boxes_in(home: Path) -> list[str]:
    return sorted(b.id for b in sandlot.list(home=home))


def test_placement_by_resources(f: fleet.Fleet, nodes: Nodes, busybox_root: Path) -> None:
    t0 = time.monotonic()
    big = f.create(rootfs=busybox_root, memory_mib=768, labels={"t": "place"})
    assert node_of(big) in (nodes.head, nodes.a)  # the small node offers 512 MiB: Ray never puts it there
    small = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.b[:10], labels={"t": "place"})
    assert node_of(small) == nodes.b and small.transport == "ray"
    assert small.exec("echo", "hi").stdout == "hi\n"
    # the methods of a local box, run by the node's actor
    proc = small.spawn("sh", "-c", "echo one; sleep 0.3; echo two >&2; cat")
    assert next(iter(proc.stdout)) == b"one\n"  # as it comes
    proc.write_stdin("fed")
    proc.close_stdin()
    r = proc.result(timeout=30)
    assert (r.stdout, r.stderr, r.exit_code) == ("fed", "two\n", 0)
    assert small.spawn("sh", "-c", "exit 3").result().exit_code == 3
    small.files.write("/root/v", "1")
    snap = small.snapshot("one")
    small.files.write("/root/v", "2")
    small.rollback(snap)
    assert small.files.read_text("/root/v") == "1" and [s.name for s in small.snapshots()] == ["one"]
    assert big.id in boxes_in(nodes.fc.homes[node_of(big)]) and small.id in boxes_in(nodes.fc.homes[nodes.b])
    listed = {b.id: node_of(b) for b in f.list(labels={"t": "place"})}
    assert listed == {big.id: node_of(big), small.id: nodes.b}
    reserved = {n["node_id"]: n["reserved_memory_mib"] for n in f.nodes()}
    assert reserved[nodes.b] == 256
    big.remove(force=True)
    small.remove(force=True)
    assert not {big.id, small.id} & {b.id for b in f.list()}
    assert boxes_in(nodes.fc.homes[nodes.b]) == []
    # spread: boxes made one by one go to different nodes while each has room
    spread = [f.create(rootfs=busybox_root, memory_mib=128, strategy="spread", start=False) for _ in range(3)]
    assert len({node_of(b) for b in spread}) == 3, [node_of(b) for b in spread]
    for b in spread:
        b.remove()
    print(f"placement test {time.monotonic() - t0:.1f} s")


def test_a_fork_spreads_over_nodes_and_its_children_diverge_in_their_namespace(
    f: fleet.Fleet, nodes: Nodes, busybox_root: Path
) -> None:
    """Through a driver acting for a namespace (a platform's tenant): every node it reaches
    (the fork's state moved to each and imported there) labels what it starts with the
    namespace, and a driver of another namespace finds none of it, even asking a node itself."""
    mine = fleet.connect(nodes.fc.address, namespace="team-fork", placement_timeout=30)
    other = fleet.connect(nodes.fc.address, namespace="team-other")
    t0 = time.time()
    src = mine.create(rootfs=busybox_root, memory_mib=256, node=nodes.head, labels={"team": "fork"})
    src.files.write("/root/seed", "from the parent")
    kids = mine.fork(src, 3, spread=True)
    try:
        # each node's events, merged by time: the children were made on three nodes
        merged = list(mine.events(since=t0, follow=False))
        assert {k.id for k in kids} <= {e.box_id for e in merged if e.kind == "created"}
        assert [e.at for e in merged] == sorted(e.at for e in merged)
        with pytest.raises(sandlot.InvalidArgument, match="after= needs box="):
            next(iter(mine.events(after=1)))
        # two children on two nodes are compared on neither: a clear refusal
        with pytest.raises(sandlot.Unsupported, match="one node"):
            kids[0].diff(kids[1])
        assert kids.per_node == {nodes.head: 1, nodes.a: 1, nodes.b: 1}
        assert sorted(node_of(k) for k in kids) == sorted([nodes.head, nodes.a, nodes.b])
        for i, k in enumerate(kids):
            assert (
                k.info["labels"] == {"team": "fork", "sandlot.namespace": "team-fork"}
                and k.state == "running"
            )
            assert k.files.read_text("/root/seed") == "from the parent"
            k.files.write("/root/mine", f"child {i}")
            assert k.id in boxes_in(nodes.fc.homes[node_of(k)])
        assert [k.files.read_text("/root/mine") for k in kids] == ["child 0", "child 1", "child 2"]
        assert not src.files.exists("/root/mine")
        assert len({k.sh("hostname").stdout for k in kids}) == 3  # each its own identity
        # the namespace's boxes, and only to its drivers (and to a driver of every namespace)
        ours = {src.id, *(k.id for k in kids)}
        assert ours <= {b.id for b in mine.list()} and ours <= {b.id for b in f.list()}
        assert all(b.info["labels"].get("sandlot.namespace") == "team-fork" for b in mine.list())
        assert not ours & {b.id for b in other.list()} and not ours & {r["id"] for r in other.reconcile()}
        assert not [e for e in other.events(since=t0, follow=False) if e.box_id in ours]
        with pytest.raises(sandlot.BoxNotFound):
            other.get(src.id)
        for k in kids:  # the node's own answer, past the driver's directory
            with pytest.raises(sandlot.BoxNotFound):
                answer(other.node(node_of(k)).exec.remote(k.id, {"argv": ["true"]}), timeout=60)
        assert (
            answer(mine.node(nodes.head).exec.remote(src.id, {"argv": ["true"]}), timeout=60)["exit_code"]
            == 0
        )
    finally:
        for k in kids:
            k.remove(force=True)
        src.remove(force=True)
    # the fork's state, taken on the source's node and imported on the others, went with the children
    for home in nodes.fc.homes.values():
        left = [
            s for s in sandlot.list_snapshots(home=home) if s.box_name == src.name and s.kind != "template"
        ]
        assert not left, [(s.name, s.kind) for s in left]


def test_migration_keeps_the_box_and_its_running_processes(nodes: Nodes, busybox_root: Path) -> None:
    """Through a driver acting for a namespace: each node of the move answers it for that
    namespace's box (a driver of another namespace finds no box to move)."""
    mine = fleet.connect(nodes.fc.address, namespace="movers", placement_timeout=30)
    box = mine.create(rootfs=busybox_root, memory_mib=256, node=nodes.head, name="mover", labels={"app": "m"})
    labels = {"app": "m", "sandlot.namespace": "movers"}
    try:
        with pytest.raises(sandlot.BoxNotFound):
            fleet.connect(nodes.fc.address, namespace="others").migrate(box.id, node=nodes.a)
        box.sh(COUNTER)
        wait_count(box)
        box.files.write("/root/state", "kept")
        pid = box.files.read_text("/tmp/pid")
        t0 = time.monotonic()
        before = count(box)
        moved = mine.migrate(box, node=nodes.a)
        assert (moved.id, moved.name, moved.info["labels"]) == (box.id, "mover", labels)
        assert node_of(moved) == nodes.a and moved.state == "running"
        after = count(moved)
        # the same counter went on: it did not start again
        assert before <= after <= before + ticks_in(time.monotonic() - t0)
        goes_past("the moved box's counter", lambda: count(moved), after)
        assert (
            moved.files.read_text("/tmp/pid") == pid and moved.exec("kill", "-0", pid.strip()).exit_code == 0
        )
        assert moved.files.read_text("/root/state") == "kept"
        assert boxes_in(nodes.fc.homes[nodes.head]).count(box.id) == 0
        assert box.id in boxes_in(nodes.fc.homes[nodes.a])
        t = mine.last_migration
        assert t is not None and t["bytes"] > 0 and t["chunks"] >= 1
        # a suspended box arrives suspended
        moved.suspend()
        back = mine.migrate(moved.id, node=nodes.head)
        assert back.state == "suspended" and node_of(back) == nodes.head and back.info["labels"] == labels
        back.resume()
        assert count(back) >= after
    finally:
        mine.get(box.id).remove(force=True)


def test_a_second_driver_finds_the_boxes(f: fleet.Fleet, nodes: Nodes, busybox_root: Path) -> None:
    box = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.a, name="found-later")
    box.files.write("/root/note", "left by the first driver")
    code = textwrap.dedent(f"""
        import json
        from sandlot import fleet
        f = fleet.connect({nodes.fc.address!r})
        boxes = {{b.name: b.info["node"] for b in f.list()}}
        box = f.get("found-later")
        note = box.files.read_text("/root/note")
        print(json.dumps({{"boxes": boxes, "note": note, "node": box.info["node"]}}))
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["boxes"]["found-later"] == nodes.a
        assert seen["note"] == "left by the first driver" and seen["node"] == nodes.a
        # and the command line is one more driver
        cli = [sys.executable, "-m", "sandlot.cli", "fleet"]
        ls = subprocess.run([*cli, "ls", "--address", nodes.fc.address, "--json"], capture_output=True,
                            text=True, timeout=180, env=env)  # fmt: skip
        assert ls.returncode == 0, ls.stderr[-3000:]
        assert {b["name"]: b["node"] for b in json.loads(ls.stdout)}["found-later"] == nodes.a
        table = subprocess.run([*cli, "nodes", "--address", nodes.fc.address], capture_output=True,
                               text=True, timeout=180, env=env)  # fmt: skip
        assert table.returncode == 0, table.stderr[-3000:]
        assert all(n[:12] in table.stdout for n in (nodes.head, nodes.a, nodes.b))
    finally:
        box.remove(force=True)


# a driver of the cluster at argv[1] with whatever token its environment gives it: what it
# could do, or the error that stopped it (a sandlot error's class, else Ray's)
STRANGER = """
import json, sys
from sandlot import fleet
out = {}
try:
    f = fleet.connect(sys.argv[1])
    out["listed"] = [b.id for b in f.list()]
    out["exec"] = f.get(sys.argv[2]).exec("echo", "in").stdout
    out["created"] = f.create(rootfs=sys.argv[3], memory_mib=256).id
except Exception as exc:
    out["error"] = [type(exc).__name__, str(exc)]
import ray
ray.shutdown()
try:  # Ray itself, without sandlot: the same door
    ray.init(address=sys.argv[1], namespace="sandlot", log_to_driver=False)
    out["ray"] = "joined"
except Exception as exc:
    out["ray"] = type(exc).__name__
print(json.dumps(out))
"""


def test_a_driver_without_the_clusters_token_can_do_nothing(f: fleet.Fleet, nodes: Nodes, busybox_root: Path,
                                                            tmp_path: Path) -> None:  # fmt: skip
    """The test cluster authenticates with its token (tests/support/fleet.py), as a fleet
    set up as docs/fleet.md says does: a driver with no token, or another one, cannot
    list, create or exec, is told so at once, and Ray itself lets it in no more than sandlot."""
    box = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.a, name="guarded")
    try:
        before = {n: boxes_in(h) for n, h in nodes.fc.homes.items()}
        nobody = tmp_path / "home"  # no ~/.ray/auth_token either
        nobody.mkdir()
        clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        clean.update(HOME=str(nobody), PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
        for label, env in (("no token", clean), ("a wrong token", {**clean, "RAY_AUTH_TOKEN": "0" * 64})):
            t0 = time.monotonic()
            r = subprocess.run([sys.executable, "-c", STRANGER, nodes.fc.address, box.id, str(busybox_root)],
                               capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
            assert r.returncode == 0, r.stderr[-3000:]
            seen = json.loads(r.stdout.strip().splitlines()[-1])
            assert set(seen) == {"error", "ray"}, (label, seen)  # nothing listed, run or made
            kind, message = seen["error"]
            assert kind == "Unauthorized", (label, seen)
            why = "has no token" if label == "no token" else "from $RAY_AUTH_TOKEN is not the cluster's"
            assert why in message and "sandlot fleet token" in message, message
            assert seen["ray"] != "joined", (label, seen)
            assert time.monotonic() - t0 < 120, f"{label}: refused only after {time.monotonic() - t0:.0f} s"
            # the command line says so, and how to fix it
            ls = [sys.executable, "-m", "sandlot.cli", "fleet", "ls", "--address", nodes.fc.address]
            cli = subprocess.run(ls, capture_output=True, text=True, timeout=180, env=env)
            assert cli.returncode == 125 and "refused this driver" in cli.stderr, cli.stderr[-2000:]
        assert {n: boxes_in(h) for n, h in nodes.fc.homes.items()} == before
        assert box.exec("echo", "still").stdout == "still\n"
    finally:
        box.remove(force=True)


OPEN_CLUSTER = """
import json, sys, subprocess, os
from tests.support.fleet import FleetCluster
from sandlot import clusterauth, fleet
fc = FleetCluster(auth=False)
out = {}
try:
    plain = fc.add(cpus=1, memory_mib=512)
    allowed = fc.add(cpus=1, memory_mib=512, env={clusterauth.INSECURE_ENV: "1"})
    f = fleet.connect(fc.address)
    for what, call in (("join", lambda: f.join(plain)),
                       ("create", lambda: f.create(rootfs=sys.argv[1], memory_mib=256, node=plain))):
        try:
            call()
            out[what] = "served"
        except Exception as exc:
            out[what] = [type(exc).__name__, str(exc)]
    out["allowed"] = f.join(allowed)["node_id"] == allowed
    out["reserved"] = [n["reserved_memory_mib"] for n in f.nodes() if n["node_id"] == plain]
    env = {**os.environ, "SANDLOT_HOME": str(fc.homes[plain])}
    doctor = subprocess.run([sys.executable, "-m", "sandlot.cli", "doctor", "--json"], env=env,
                            capture_output=True, text=True, timeout=300)
    out["doctor"] = json.loads(doctor.stdout)["fleet"]["node"]
    out["doctor_allowed"] = clusterauth.read_trust(fc.homes[allowed])
finally:
    fc.shutdown()
print(json.dumps(out))
"""


def test_a_node_refuses_a_cluster_without_authentication(busybox_root: Path) -> None:
    """A cluster started without a token (``RAY_AUTH_MODE=disabled``) gets no box from a
    node, unless the node's operator allowed it (``--insecure-cluster``); ``sandlot
    doctor`` says which. Its own cluster, in a process of its own: this one is joined to
    the module's."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    script = [sys.executable, "-c", OPEN_CLUSTER, str(busybox_root)]
    r = subprocess.run(script, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    for what in ("join", "create"):
        kind, message = seen[what]
        assert kind == "InsecureCluster" and "answers callers without a token" in message, seen
        assert "--insecure-cluster" in message
    assert seen["reserved"] == [0]  # the refused box's room was given back
    assert seen["doctor"]["cluster_auth"] == "open" and seen["doctor"]["serving"] is False
    assert (
        seen["allowed"] and seen["doctor_allowed"]["serving"] and seen["doctor_allowed"]["insecure_allowed"]
    )


TLS_CLUSTER = """
import json, os, subprocess, sys
from tests.support.fleet import FleetCluster
from sandlot import clusterauth, fleet
fc = FleetCluster(tls=True)
out = {}
try:
    node = fc.add(cpus=1, memory_mib=512)
    out["joined"] = fleet.connect(fc.address).join(node)["node_id"] == node
    out["node"] = clusterauth.read_trust(fc.homes[node])
    # a driver with the token and without TLS: told the cluster did not answer it, and why perhaps
    env = {k: v for k, v in os.environ.items() if k != "RAY_USE_TLS"}
    code = "import sys; from sandlot import fleet; fleet.connect(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", code, fc.address], env=env, capture_output=True, text=True,
                       timeout=120)
    out["plain"] = r.stderr.strip().splitlines()[-1] if r.returncode else "joined"
finally:
    fc.shutdown()
print(json.dumps(out))
"""


def test_a_cluster_with_tls_serves_and_a_driver_without_it_is_told() -> None:
    """Ray's mutual TLS between every process of the cluster and its drivers, from a
    private CA (tests/support/fleet.py makes one as docs/fleet.md does), with the token
    too: the node serves, and a driver without TLS is told at once why it got no answer.
    Its own cluster, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", TLS_CLUSTER], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["joined"] and seen["node"]["tls"] and seen["node"]["cluster_auth"] == "token", seen
    assert seen["plain"].startswith("sandlot.errors.ConnectionLost") and "TLS is off here" in seen["plain"], (
        seen
    )
    print(f"TLS cluster test {time.monotonic() - t0:.1f} s")


def test_an_agents_sdk_session_runs_pauses_and_resumes_on_a_fleet(nodes: Nodes, busybox_root: Path) -> None:
    """The OpenAI Agents SDK's session on a fleet box (``SandlotSandboxClient(fleet)``), through a
    driver acting for a namespace: a scripted ``Runner`` run starts a server and writes a
    page, the session ends suspended on its node, and resumes with the server still running,
    reached through the node's published port."""
    pytest.importorskip("agents", reason="the OpenAI Agents SDK: pip install 'sandlot[openai-agents]'")
    import asyncio

    import httpx

    from sandlot.integrations.openai_agents import SandlotSandboxClient, SandlotSandboxClientOptions

    from tests.support.scripted_model import ScriptedModel, add_file, call, run_to_state, say, workspace_agent

    image = "fleet-agents:1"
    for home in nodes.fc.homes.values():  # wherever Ray places the box
        sandlot.import_image(busybox_root, image, home=home)
    mine = fleet.connect(nodes.fc.address, namespace="agents", placement_timeout=30)
    options = SandlotSandboxClientOptions(
        image=image, exposed_ports=(8000,), on_exit="suspend", memory_mib=256
    )
    model = ScriptedModel([
        [call("exec_command", cmd="httpd -p 8000 -h . && echo started"),  # busybox's: bound, then a daemon
         add_file("page.html", "served from the box")],
        [say("serving")],
    ])  # fmt: skip
    agent = workspace_agent(model, b"# site\n")

    async def run() -> dict[str, Any]:
        return await run_to_state(agent, SandlotSandboxClient(mine), options, "serving")

    async def resume(state: dict[str, Any]) -> tuple[str, str]:
        client = SandlotSandboxClient(mine)
        session = await client.resume(client.deserialize_session_state(state))
        async with session:
            inside = await session.exec("cat page.html")
            end = await session.resolve_exposed_port(8000)
            outside = await asyncio.to_thread(httpx.get, end.url_for("http") + "page.html", timeout=60)
        return inside.stdout.decode(), outside.text

    state = asyncio.run(run())
    try:
        box = mine.get(state["box_id"])
        assert box.state == "suspended" and box.info["labels"]["sandlot.namespace"] == "agents"
        assert asyncio.run(resume(state)) == ("served from the box", "served from the box")
    finally:
        with contextlib.suppress(sandlot.BoxNotFound):
            box = mine.get(state["box_id"])
            # the saved states the session persisted are the user's: removing the box keeps them
            saved = box.snapshots()
            assert saved  # (the resumed session's, which replaced the first run's)
            for snap in saved:
                snap.remove()
            box.remove(force=True)
        for home in nodes.fc.homes.values():
            mine_left = sandlot.list_snapshots(home=home)  # (the image's automatic template stays)
            assert not [s for s in mine_left if s.box_id == state["box_id"] and s.kind != "template"]
            sandlot.remove_image(image, home=home)


def test_a_desktop_box_is_driven_and_streamed_through_the_fleet(f: fleet.Fleet, nodes: Nodes) -> None:
    """``box.desktop`` on a node's box, as on a local or a served one: its screen, its
    pointer, and its viewer through a port of this process (the fleet has no preview
    URLs) forwarded over the node's port bridge. (The rest of box.desktop is commands
    of the box, as every transport runs them: tests/vm/test_desktop.py.)"""
    import io

    import httpx
    from PIL import Image

    from tests.support.roots import desktop_root

    box = f.create(rootfs=desktop_root(), memory_mib=1024, node=nodes.head, name="fleet-desk")
    try:
        desk = box.desktop
        shot = Image.open(io.BytesIO(desk.screenshot(scale=0.25)))  # the desktop started on first use
        assert (shot.format, shot.size) == ("PNG", (256, 192))
        desk.move(123, 45)
        assert desk.cursor() == (123, 45)
        url = desk.stream_url(view_only=True)
        assert url.startswith("http://127.0.0.1:") and "view_only=1" in url
        page = httpx.get(url.split("#")[0], timeout=60)
        assert page.status_code == 200 and "<title>sandlot desktop</title>" in page.text
        rfb = httpx.get(url.split("index.html")[0] + "novnc/core/rfb.js", timeout=60)  # noVNC, from the box
        assert rfb.status_code == 200 and "export default class RFB" in rfb.text
        desk.close_stream()
    finally:
        box.remove(force=True)


def test_bad_input_gives_a_clear_error_and_moves_nothing(f: fleet.Fleet, nodes: Nodes, busybox_root: Path,
                                                         tmp_path: Path) -> None:  # fmt: skip
    box = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.a, name="stays")
    saved_before = {s.id for s in sandlot.list_snapshots(home=nodes.fc.homes[nodes.a])}
    try:
        box.sh(COUNTER)
        wait_count(box)
        with pytest.raises(sandlot.NodeNotFound, match="no live sandlot node"):
            f.migrate(box, node="ffffffffffff")
        # over capacity: the small node has 512 MiB, a 768 MiB box never fits there
        with pytest.raises(sandlot.NoCapacity, match=r"fits node .* never"):
            f.create(rootfs=busybox_root, memory_mib=768, node=nodes.b)
        # ... and two 256 MiB boxes fill it: a third waits for room, then gives up
        fill = [f.create(rootfs=busybox_root, memory_mib=256, node=nodes.b, start=False) for _ in range(2)]
        before = boxes_in(nodes.fc.homes[nodes.b])
        with pytest.raises(sandlot.NoCapacity, match="no room on node"):
            f.create(rootfs=busybox_root, memory_mib=256, node=nodes.b, placement_timeout=2)
        with pytest.raises(sandlot.NoCapacity, match="no room on node"):
            f.migrate(box, node=nodes.b, placement_timeout=2)
        assert boxes_in(nodes.fc.homes[nodes.b]) == before
        for x in fill:
            x.remove()
        # a node whose QEMU is another version cannot load the box's state
        qemu = tmp_path / "qemu"
        fake = '[ "$1" = --version ] && { echo "QEMU emulator version 99.0.0"; exit 0; }'
        qemu.write_text(f'#!/bin/sh\n{fake}\nexec qemu-system-x86_64 "$@"\n')
        qemu.chmod(0o755)
        odd = nodes.fc.add(cpus=2, memory_mib=512, env={"SANDLOT_QEMU": str(qemu)})
        with pytest.raises(sandlot.IncompatibleSnapshot, match=r"QEMU 99\.0\.0"):
            f.migrate(box, node=odd)
        odd_home = nodes.fc.homes[odd]
        assert boxes_in(odd_home) == [] and sandlot.list_snapshots(home=odd_home) == []
        still = f.get("stays")
        assert node_of(still) == nodes.a and still.state == "running"
        goes_past("the box's counter", lambda: count(still), count(still))  # its processes went on
        # no state of the moves that failed stays (automatic templates do, and an earlier
        # test's saved states are its own)
        left = sandlot.list_snapshots(home=nodes.fc.homes[nodes.a])
        made = [s for s in left if s.id not in saved_before and (s.name or s.kind != "template")]
        assert [(s.name, s.box_name) for s in made] == []
        assert not any(n["node_id"] == odd and n["reserved_memory_mib"] for n in f.nodes())
        dead(f, nodes, odd)  # the later tests place replicas: never on a node that cannot load them
    finally:
        box.remove(force=True)


def test_a_with_box_goes_with_its_killed_driver(f: fleet.Fleet, nodes: Nodes, busybox_root: Path) -> None:
    """A driver killed inside ``with f.Box()`` cannot remove its box: the box's node does,
    once the driver's job is gone; a live driver's box stays."""
    code = textwrap.dedent(f"""
        import sys
        from sandlot import fleet
        f = fleet.connect({nodes.fc.address!r})
        with f.Box(rootfs={str(busybox_root)!r}, memory_mib=256, node={nodes.a!r}, name="orphan") as box:
            box.exec("true")
            print(box.id, flush=True)
            sys.stdin.read()  # until it is killed
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    home = nodes.fc.homes[nodes.a]
    with f.Box(rootfs=busybox_root, memory_mib=256, node=nodes.a, name="kept") as mine:
        driver = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)  # fmt: skip
        try:
            orphan = (driver.stdout.readline() if driver.stdout else "").strip()
            assert orphan in boxes_in(home), f"the driver made no box: {orphan!r}"
            assert f.record(orphan)["held_by"] and f.record(mine)["held_by"]
        finally:
            driver.kill()
            driver.wait()
        deadline = deadline_in(90)
        while orphan in boxes_in(home) or orphan in {b.id for b in f.list()}:
            assert time.monotonic() < deadline, "the box of the killed driver stayed"
            time.sleep(1)
        assert mine.exec("true").exit_code == 0 and mine.id in boxes_in(home)
        assert not any(n["node_id"] == nodes.a and n["reserved_memory_mib"] > 256 for n in f.nodes())
    assert mine.id not in boxes_in(home)


def goes_on(f: fleet.Fleet, box: sandlot.Box, node: str, pid: str) -> None:
    """The box runs on ``node`` with the processes it had, and they go on."""
    here = f.get(box.id)
    assert (here.state, node_of(here)) == ("running", node)
    goes_past("the box's counter", lambda: count(here), count(here))
    assert here.files.read_text("/tmp/pid") == pid


def moves_left(home: Path) -> list[str]:
    """What a move may leave in a node's home: move snapshots, holds, temporary directories."""
    snaps = [s.name for s in sandlot.list_snapshots(home=home) if (s.name or "").startswith("move-")]
    return snaps + [p.name for p in (*home.glob("fleet-*-*"), *home.glob("fleet/holds/*"))]


def dead(f: fleet.Fleet, nodes: Nodes, node: str) -> None:
    """Kill a node, and return once Ray counts it dead: until then a box or a replica
    may still be placed on it."""
    nodes.fc.kill(node)
    deadline = deadline_in(60)
    while any(n["node_id"] == node and n["alive"] for n in f.nodes()):
        assert time.monotonic() < deadline, "Ray still counts the removed node alive"
        time.sleep(0.5)


def test_a_node_dying_mid_migration_leaves_the_box_where_it_was(f: fleet.Fleet, nodes: Nodes,
                                                                busybox_root: Path) -> None:  # fmt: skip
    """The target dies with the moved box already running there, before it answers; then
    a source dies with the box held (paused, its state written). Each time the box goes
    on where it was with its processes, and nothing of the move stays on either node,
    also once the dead target's host comes back with its home."""
    head_home = nodes.fc.homes[nodes.head]
    target = nodes.fc.add(cpus=2, memory_mib=512, env={"SANDLOT_CRASH_AT": "fleet.import-after-start"})
    source = nodes.fc.add(cpus=2, memory_mib=512, env={"SANDLOT_CRASH_AT": "fleet.export-after-save"})
    made: list[sandlot.Box] = []
    try:
        box = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.head, name="anchored")
        made.append(box)
        box.sh(COUNTER)
        wait_count(box)
        pid = box.files.read_text("/tmp/pid")
        with pytest.raises(sandlot.ConnectionLost, match=f"node {target[:12]} died during the move"):
            f.migrate(box, node=target)
        goes_on(f, box, nodes.head, pid)
        assert moves_left(head_home) == []
        target_home = nodes.fc.homes[target]
        assert box.id in boxes_in(target_home)  # the copy the dead actor had started
        dead(f, nodes, target)
        back = nodes.fc.add(cpus=2, memory_mib=512, like=target)  # its host comes back with its home
        f.join(back)
        assert boxes_in(target_home) == [] and moves_left(target_home) == []
        goes_on(f, box, nodes.head, pid)
        dead(f, nodes, back)

        held = f.create(rootfs=busybox_root, memory_mib=256, node=source, name="held")
        made.append(held)
        held.sh(COUNTER)
        wait_count(held)
        pid = held.files.read_text("/tmp/pid")
        with pytest.raises(sandlot.ConnectionLost, match=f"node {source[:12]} died during the move"):
            f.migrate(held, node=nodes.head)
        goes_on(f, held, source, pid)  # the source's next actor let it go on
        assert held.id not in boxes_in(head_home)
        assert moves_left(nodes.fc.homes[source]) == [] and moves_left(head_home) == []
    finally:
        for b in made:
            with contextlib.suppress(sandlot.SandlotError):
                f.get(b.id).remove(force=True)
        if source in {n["node_id"] for n in f.nodes() if n["alive"]}:
            dead(f, nodes, source)


def test_with_a_storage_tier_a_box_moves_through_it_and_a_dead_nodes_suspended_box_comes_back(
    f: fleet.Fleet, nodes: Nodes, busybox_root: Path, tmp_path: Path
) -> None:
    """Two nodes whose homes share an S3-compatible tier (moto's server on 127.0.0.1): a
    move goes through the tier, not the object store; a node killed with its box
    suspended leaves it in the tier (its pusher sent it), and recover() pulls it onto
    the other node, no replica made before. All through a driver acting for a namespace:
    a driver of another one finds no box to recover, in the directory or in the tier."""
    from tests.support.s3 import CREDENTIALS, s3_server

    mine = fleet.connect(nodes.fc.address, namespace="tiered-ns", placement_timeout=30)
    other = fleet.connect(nodes.fc.address, namespace="others")

    with s3_server(tmp_path) as s3:
        env = {"SANDLOT_STORAGE": s3.url("fleet"), "SANDLOT_STORAGE_ENDPOINT": s3.endpoint_url, **CREDENTIALS}
        x = nodes.fc.add(cpus=2, memory_mib=512, env=env)
        y = nodes.fc.add(cpus=2, memory_mib=512, env=env)
        try:
            box = mine.create(rootfs=busybox_root, memory_mib=256, node=x, name="tiered")
            box.files.write("/root/kept", "written on x")
            box.sh(COUNTER)
            before = wait_count(box)
            moved = mine.migrate(box, y)
            assert mine.last_migration["through"] == s3.url("fleet") and node_of(moved) == y
            assert count(moved) >= before and moved.files.read_text("/root/kept") == "written on x"
            assert box.id not in boxes_in(nodes.fc.homes[x])
            moved.suspend()  # y's pusher sends it to the tier, whole
            deadline = time.monotonic() + 120
            pushed = f"fleet/boxes/{box.id}.json"
            while pushed not in [
                o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket).get("Contents", [])
            ]:
                assert time.monotonic() < deadline, "the pusher of node y never sent the suspended box"
                time.sleep(0.5)
            nodes.fc.kill(y)
            deadline = time.monotonic() + 60
            while mine.get("tiered").state != "lost":
                assert time.monotonic() < deadline, "the box was never found lost"
                time.sleep(1)
            with pytest.raises(sandlot.BoxNotFound):
                other.recover("tiered")
            with pytest.raises(sandlot.BoxNotFound):  # x's own answer: the box in the tier is not theirs
                answer(other.node(x).pull_box.remote(box.id, True, "running"), timeout=120)
            assert answer(other.node(x).tier_holds.remote(box.id), timeout=120) is False
            back = mine.recover("tiered")  # no replica: from the tier, on x
            assert (back.id, back.state, node_of(back)) == (box.id, "running", x)
            assert back.files.read_text("/root/kept") == "written on x"
            assert count(back) >= before  # the counter of the process that ran on x, then y, goes on
            assert mine.record(back)["recovered"]["through"] == "storage tier"
            back.remove(force=True)
        finally:
            for node in (x, y):  # gone before the next test places a box or a replica
                with contextlib.suppress(Exception):
                    if node in {n["node_id"] for n in f.nodes() if n["alive"]}:
                        dead(f, nodes, node)


def test_a_dead_nodes_boxes_are_lost_and_a_replicated_one_recovers(f: fleet.Fleet, nodes: Nodes,
                                                                   busybox_root: Path) -> None:  # fmt: skip
    safe = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.a, name="safe", replicas=1)
    plain = f.create(rootfs=busybox_root, memory_mib=256, node=nodes.a, name="plain")
    assert node_of(plain) == nodes.a
    safe.files.write("/root/saved", "in the snapshot")
    safe.snapshot()
    replica = f.record(safe)["replica"]
    assert replica is not None and replica["node"] != nodes.a
    safe.files.write("/root/later", "after the snapshot")
    nodes.fc.kill(nodes.a)
    killed = time.time()
    deadline = deadline_in(60)
    while True:
        states = {b.name: b for b in f.list()}
        if states["safe"].state == "lost" and states["plain"].state == "lost":
            break
        assert time.monotonic() < deadline, f"never lost: {[(b.name, b.state) for b in states.values()]}"
        time.sleep(1)
    lost = f.record(states["plain"])["lost"]
    assert lost is not None and lost["node"] == nodes.a and killed - 5 < lost["at"] < time.time()
    with pytest.raises(sandlot.InvalidState, match="lost"):
        states["plain"].exec("true")
    with pytest.raises(sandlot.InvalidState, match="has no replica"):
        f.recover("plain")
    back = f.recover("safe")
    assert (back.id, back.name, back.state, node_of(back)) == (safe.id, "safe", "running", replica["node"])
    assert back.files.read_text("/root/saved") == "in the snapshot"
    assert not back.files.exists("/root/later")  # what it did after its last saved state is gone
    assert back.id in boxes_in(nodes.fc.homes[replica["node"]])
    # nothing in the directory claims a box no node has: forgetting the lost one leaves none
    states["plain"].remove()
    assert "plain" not in {b.name for b in f.list()}
    back.remove(force=True)
