"""The contract of a box in the fast tier: the same test bodies against a box of a home
on the fake engine reached locally, through ``sandlot serve``'s application served
in this process (the real routes, keys and WebSockets, driven by the real HTTP
backend), and through the fleet's driver (the real Ray backend) to a node's actor
body in this process (``InProcessRay``: Ray's transport is the one thing left out);
and every operation served by a fleet node's actor body. No VM: the core is real,
the guest's agent is the fake engine's. The same contract on real VMs locally, and
one real box driven end to end through a real server process and through a real Ray
cluster, is ``tests/vm/test_contract.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.api import contract, loop

from tests.support.contract import args_for, events_past_and_followed
from tests.support.fake_engine import FakeEngine, fake_rootfs, register
from tests.support.inproc import serving


@dataclass
class Side:
    kind: str
    new: Callable[..., sandlot.Box]
    get: Callable[[str], sandlot.Box]
    client: Any = None
    home: Path | None = None


class InProcessRay:
    """Ray's actor calls as the fleet's driver makes them (``handle.method.remote(...)``, an
    awaitable; ``.options(num_returns="streaming")``, an async iterator of awaitables),
    answered by an actor body in this process on the running loop. Arguments and answers
    are copied through pickle, as Ray's object store copies them, so a driver that shares
    state with a node or sends what Ray cannot carry fails here too. What is left out is
    Ray's own transport (its serialization of exceptions, cancellation, actor restarts):
    the VM tier drives a box through a real cluster for that."""

    def __init__(self, body: Any, streaming: bool = False) -> None:
        self.body, self.streaming = body, streaming

    def __getattr__(self, name: str) -> InProcessRay:
        return InProcessRay(getattr(self.body, name))

    def options(self, **opts: Any) -> InProcessRay:
        return InProcessRay(self.body, opts.get("num_returns") == "streaming")

    def remote(self, *args: Any) -> Any:
        args = pickle.loads(pickle.dumps(args))
        if self.streaming:
            return Streamed(self.body(*args))
        if inspect.iscoroutinefunction(self.body):

            async def answered() -> Any:
                return pickle.loads(pickle.dumps(await self.body(*args)))

            return asyncio.ensure_future(answered())
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(pickle.loads(pickle.dumps(self.body(*args))))
        return done


class Streamed:
    """A streaming generator's items as the driver reads them; ``ray.cancel`` ends it."""

    def __init__(self, items: Any) -> None:
        self.queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for item in items:
                    self.queue.put_nowait((True, pickle.loads(pickle.dumps(item))))
            finally:
                self.queue.put_nowait((False, None))

        self.task = asyncio.ensure_future(pump())

    def __aiter__(self) -> Streamed:
        return self

    async def __anext__(self) -> Any:
        more, item = await self.queue.get()
        if not more:
            self.queue.put_nowait((False, None))  # every later read ends too
            raise StopAsyncIteration
        ref: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        return ref


class OneNodeFleet:
    """What the Ray backend asks of its fleet (``backend.Fleet``): one node ``n1`` whose
    actor body is a ``NodeService`` of ``home``, and a directory of its own."""

    placement_timeout = 5.0

    def __init__(self, home: Path) -> None:
        from sandlot.fleet.directory import Directory
        from sandlot.fleet.node import NodeService

        self._node = InProcessRay(NodeService("n1", str(home)))
        self._directory = InProcessRay(Directory(str(home / "fleet" / "directory.json")))

    def directory(self) -> Any:
        return self._directory

    def node(self, node_id: str, *, every_namespace: bool = False) -> Any:
        assert node_id == "n1", node_id
        return self._node

    def sees(self, labels: Any) -> bool:
        return True  # a driver of every namespace

    def forget_node(self, node_id: str) -> None:
        pass

    def driver_mark(self) -> str:
        return "sandlot-driver-test"

    def resolve_node(self, key: str) -> str:
        return "n1"

    def reserve_spread(self, one: dict[str, float], timeout: float) -> Any:
        raise AssertionError("one node: nothing spreads")

    def close(self) -> None:
        """End the node body's sweep for boxes of dead drivers, which an actor's process
        would end with it: here it would run on the shared loop after the test."""
        sweeping = self._node.body._sweeping
        if sweeping is not None:
            sweeping.cancel()


@contextlib.contextmanager
def in_process_fleet(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sandlot.Client]:
    """A client of the fleet's boxes (``sandlot.fleet``'s driver) over ``OneNodeFleet``;
    placement always finds room on ``n1`` (Ray's scheduler is the VM tier's)."""
    import ray

    from sandlot.fleet import placement
    from sandlot.fleet.backend import RayBackend

    def reserve(bundles: list[dict[str, float]], **_: Any) -> placement.Reservation:
        return placement.Reservation(f"res-{os.urandom(4).hex()}", ("n1",) * len(bundles))

    def cancel(ref: Any, **_: Any) -> None:
        assert isinstance(ref, Streamed), ref  # the driver cancels only what a node streams
        ref.task.cancel()

    monkeypatch.setattr(placement, "reserve", reserve)
    monkeypatch.setattr(placement, "release", lambda name: None)
    monkeypatch.setattr(placement, "sandlot_nodes", lambda alive_only=True: [{"NodeID": "n1"}])
    monkeypatch.setattr(ray, "cancel", cancel)
    # the node's body is made on the loop its calls will run on, as an actor's is
    fleet = loop.call(OneNodeFleet, home)
    try:
        yield sandlot.Client.over(RayBackend(fleet))
    finally:
        loop.call(fleet.close)


@pytest.fixture(params=["local", "http", "ray"])
def side(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Side]:
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    home = tmp_path / "home"
    root = str(fake_rootfs(tmp_path))
    if request.param == "local":
        yield Side("local", lambda **kw: sandlot.Box(rootfs=root, memory_mib=256, home=home, **kw),
                   lambda key: sandlot.get(key, home=home), home=home)  # fmt: skip
        for b in sandlot.list(home=home):
            b.remove(force=True)
        return
    if request.param == "ray":
        pytest.importorskip("ray")
        with in_process_fleet(home, monkeypatch) as client:
            yield Side(
                "ray", lambda **kw: client.Box(rootfs=root, memory_mib=256, **kw), client.get, client, home
            )
            for b in client.list():
                b.remove(force=True)
        return
    with serving(home) as srv, sandlot.connect(srv.url, api_key=srv.api_key) as client:
        yield Side(
            "http", lambda **kw: client.Box(rootfs=root, memory_mib=256, **kw), client.get, client, home
        )
        for b in client.list():
            b.remove(force=True)


def test_lifecycle_and_the_states_it_refuses(side: Side) -> None:
    box = side.new(keep=True, name="life")
    assert (box.transport, box.aio.state) == (side.kind, "new")
    box.start()
    assert box.state == "running" and box.info["state"] == "running" and box.name == "life"
    assert set(box.info) == set(contract.BoxOut.model_fields)  # one description, whatever the transport
    box.stop()
    assert box.state == "stopped"
    with pytest.raises(sandlot.InvalidState) as refused:
        box.pause()
    assert refused.value.state == "stopped" and refused.value.allowed == ("running",)
    box.start()
    box.pause()
    assert side.get("life").state == "paused"
    box.unpause()
    box.suspend()
    assert side.get(box.id).state == "suspended"
    box.resume()
    box.restart()
    assert box.state == "running" and box.exec("echo", "again").stdout == "again\n"
    with pytest.raises(sandlot.InvalidState):
        box.remove()  # a running box needs force=True
    box.remove(force=True)
    assert box.state == "removed"
    box.remove()  # removing a removed box does nothing
    with pytest.raises(sandlot.BoxNotFound):
        side.get("life")


def test_exec_and_processes_with_stdin(side: Side) -> None:
    with side.new() as box:
        r = box.exec("echo", "hello", "world")
        assert isinstance(r, sandlot.ExecResult) and (r.exit_code, r.stdout, r.ok) == (
            0,
            "hello world\n",
            True,
        )
        assert box.exec("exit", "42").exit_code == 42
        assert box.exec("cat", stdin=b"\x00\xff bytes").stdout_bytes == b"\x00\xff bytes"
        assert box.exec("cat", stdin="text").stdout == "text"
        big = os.urandom(600_000)  # past what travels inline with a request: streamed to a process
        assert box.exec("cat", stdin=big).stdout_bytes == big
        with pytest.raises(sandlot.CommandFailed) as failed:
            box.exec("false", check=True)
        assert failed.value.result.exit_code == 1
        assert box.sh("echo via sh").stdout == "via sh\n"
        p = box.spawn("cat")
        assert isinstance(p, sandlot.Process)
        p.write_stdin(b"one ")
        p.write_stdin("two")
        p.close_stdin()
        assert p.result(timeout=10).stdout == "one two" and p.returncode == 0
        with pytest.raises(sandlot.InvalidArgument):
            box.exec()
        assert box.ping() > 0 and box.activity()[0] >= 0
        assert "sandlot-agent" in box.logs() and box.logs(lines=1).count("\n") == 0


def test_files_and_trees(side: Side, tmp_path: Path) -> None:
    with side.new() as box:
        f = box.files
        assert f.write("/tmp/t/a.txt", "hello\n") == 6
        assert f.read("/tmp/t/a.txt") == b"hello\n" and f.read_text("/tmp/t/a.txt") == "hello\n"
        f.write("/tmp/t/bin", bytes(range(256)), mode=0o600)
        info = f.stat("/tmp/t/bin")
        assert isinstance(info, sandlot.FileInfo) and info.is_file and (info.size, info.mode) == (256, 0o600)
        assert b"".join(f.iter_read("/tmp/t/bin", offset=10, length=5)) == bytes(range(10, 15))
        f.write("/tmp/t/a.txt", "more", append=True)
        assert f.read_text("/tmp/t/a.txt") == "hello\nmore"
        with pytest.raises(FileExistsError):
            f.write("/tmp/t/a.txt", "x", exclusive=True)
        f.mkdir("/tmp/t/sub/deeper")
        assert f.stat("/tmp/t/sub").is_dir and f.exists("/tmp/t/sub/deeper") and not f.exists("/tmp/t/no")
        f.rename("/tmp/t/a.txt", "/tmp/t/sub/b.txt")
        f.chmod("/tmp/t/sub/b.txt", 0o751)
        assert f.stat("/tmp/t/sub/b.txt").mode == 0o751
        assert [(e.name, e.type) for e in f.list("/tmp/t")] == [("bin", "file"), ("sub", "dir")]
        with pytest.raises(FileNotFoundError):
            f.read("/tmp/t/missing")
        with pytest.raises(sandlot.InvalidArgument):
            f.read("relative/path")
        with pytest.raises(OSError):  # not empty
            f.remove("/tmp/t/sub")
        f.remove("/tmp/t/missing", missing_ok=True)

        local = tmp_path / "up.bin"
        local.write_bytes(os.urandom(300_000))
        local.chmod(0o640)
        assert f.upload(local, "/tmp/t/up.bin") == 300_000 and f.stat("/tmp/t/up.bin").mode == 0o640
        assert f.download("/tmp/t/up.bin", tmp_path / "down.bin") == 300_000
        assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
        tree = tmp_path / "tree"
        (tree / "x").mkdir(parents=True)
        (tree / "x" / "y.txt").write_text("why")
        (tree / "z.txt").write_text("zed")
        assert f.upload(tree, "/tmp/t/tree") == 6  # one tar stream, unpacked in the box
        assert f.read_text("/tmp/t/tree/x/y.txt") == "why"
        assert f.download("/tmp/t/tree", tmp_path / "back") == 6
        assert (tmp_path / "back" / "x" / "y.txt").read_text() == "why"
        f.remove("/tmp/t", recursive=True)
        assert not f.exists("/tmp/t")


def test_snapshots_rollback_fork_and_starts(side: Side) -> None:
    with side.new() as box:
        box.files.write("/root/marker", "before")
        snap = box.snapshot("mark")
        assert isinstance(snap, sandlot.Snapshot) and (snap.name, snap.kind, snap.box_name) == (
            "mark", "snapshot", box.name)  # fmt: skip
        assert [s.id for s in box.snapshots()] == [snap.id]
        box.files.write("/root/marker", "after")
        box.rollback(snap)
        assert box.files.read_text("/root/marker") == "before" and box.state == "running"
        box.rollback("mark")  # by name as well
        with pytest.raises(sandlot.SnapshotNotFound):
            box.rollback("no-such-snapshot")
        box.files.write("/root/marker", "changed")
        box.files.write("/root/new", "x")
        d = box.diff("mark", paths=["/root"])
        assert [(c.path, c.status, c.fields) for c in d] == [
            ("/root/marker", "modified", ("content",)), ("/root/new", "added", ()),
        ]  # fmt: skip
        nl = "\\ No newline at end of file\n"
        head = "--- a/root/marker\n+++ b/root/marker\n@@ -1 +1 @@\n"
        assert d.changes[0].diff == f"{head}-before\n{nl}+changed\n{nl}"
        assert box.files.restore("/root/marker", from_=snap)["entries"] == 1
        assert box.files.read_text("/root/marker") == "before"
        assert [c.path for c in box.diff(snap, paths="/root")] == ["/root/new"]
        kids = box.fork(2)
        try:
            assert len({k.id for k in kids} | {box.id}) == 3 and all(k.transport == side.kind for k in kids)
            kids[0].files.write("/root/marker", "kid")
            assert kids[1].files.read_text("/root/marker") == "before"
            assert [c.path for c in kids[0].diff(kids[1], paths="/root")] == ["/root/marker"]
        finally:
            for k in kids:
                k.remove(force=True)
        (started,) = snap.start(labels={"role": "kid"}, env={"A": "1"})
        assert started.info["labels"]["role"] == "kid" and started.files.read_text("/root/marker") == "before"
        started.remove(force=True)
        assert "children" in snap.inspect()
        for s in box.snapshots():
            if s.id != snap.id:
                s.remove()  # the fork's own
        snap.remove()
        assert box.snapshots() == []


def test_events_ports_and_watches(side: Side) -> None:
    assert side.home is not None
    echo = socket.create_server(("127.0.0.1", 0))

    def serve_one() -> None:  # the host's end of what the box's port 9000 reaches: an echo
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve_one, daemon=True).start()
    FakeEngine.of(side.home).ports[9000] = echo.getsockname()
    with side.new() as box, echo:
        events_past_and_followed(box)

        blob = os.urandom(1 << 20)
        with box.connect(9000) as s:
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)  # a half close: the box's side then ends
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got == blob
        with pytest.raises(sandlot.GuestOSError) as refused:
            box.connect(1)
        assert isinstance(refused.value, ConnectionRefusedError) and refused.value.errno == errno.ECONNREFUSED
        with pytest.raises(FileNotFoundError):  # the fake agent has no watches: each is refused so
            box.files.watch("/tmp").start()


def test_a_followed_console_goes_on_as_it_grows_and_ends_with_its_box(side: Side) -> None:
    box = side.new(keep=True)
    box.start()
    assert side.home is not None
    console = sandlot.Runtime.for_home(side.home).box_dir(box.id) / "console.log"
    followed = box.follow_logs(lines=1)
    assert next(followed) == "sandlot-agent: ready\n"  # its last line
    with console.open("a") as f:
        f.write("caf\u00e9 later\n")
    seen = ""
    while "later" not in seen:
        seen += next(followed)
    assert seen == "caf\u00e9 later\n"
    box.stop()
    assert list(followed) == []  # the box stopped: the stream ended
    box.remove(force=True)


def test_what_a_transport_cannot_do_is_a_typed_error_naming_it(side: Side) -> None:
    with side.new() as box:
        if side.kind == "local":
            with pytest.raises(sandlot.Unsupported, match="local transport"):
                box.preview_url(8080)
            with pytest.raises(sandlot.Unsupported, match="local transport"):
                box.processes()
        else:
            if side.kind == "http":
                assert "/p/" in box.preview_url(8080)
            else:  # a preview URL is signed by a server, which a fleet has not
                with pytest.raises(sandlot.Unsupported, match="ray transport"):
                    box.preview_url(8080)
            with pytest.raises(sandlot.Unsupported, match=f"{side.kind} transport") as refused:
                box.taken_over()
            assert refused.value.transport == side.kind
            with pytest.raises(sandlot.Unsupported, match=f"{side.kind} transport"):
                side.new(volumes={"/tmp": "/mnt"})
            p = box.spawn("cat")
            held = {h["id"]: h for h in box.processes()}
            assert [h["argv"] for h in held.values()] == [["cat"]]
            again = box.attach(next(iter(held)))
            p.write_stdin("through one, read by the other")
            p.close_stdin()
            assert again.result(timeout=10).stdout == "through one, read by the other"


# -- a fleet node's side -------------------------------------------------------------------------


def test_a_fleet_node_serves_every_operation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node actor's body (run here without Ray: the cluster is the VM tier's) answers
    each operation of the contract in the contract's JSON, or with a typed error that
    names the ray transport."""
    pytest.importorskip("ray")
    from sandlot.fleet.node import NodeService

    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    root = str(fake_rootfs(tmp_path))

    async def main() -> None:
        node = NodeService("n1", str(tmp_path / "home"))
        made = (await node.create(None, {"rootfs": root, "memory_mib": 256, "name": "on-node"}, True))["ok"]
        assert made["node"] == "n1" and made["state"] == "running"
        key = made["id"]
        snap = (await node.call("box", "snapshot", key, {"name": "s1"}))["ok"]
        assert snap["node"] == "n1"
        for op in contract.OPERATIONS:
            if op.key in ("box.remove", "snapshot.remove"):
                continue  # last
            params = args_for(op)
            target = snap["id"] if op.scope == "snapshot" else key
            reply = await node.call(op.scope, op.name, target, params)
            if "error" in reply:
                err = sandlot.errors.from_dict(reply["error"])
                assert isinstance(err, sandlot.SandlotError), op.key
                if isinstance(err, sandlot.Unsupported):
                    assert err.transport == "ray", op.key
                continue
            if op.result.kind != "text":
                op.result.decode(reply["ok"])  # the driver reads it back
        # what a node streams ends with a typed error where it fails (a stream the table lacks too)
        failing = (
            ("files.read", {"path": "/no/such"}),
            ("files.get_archive", {"path": "/no/such"}),
            ("files.read", {"path": "relative"}),
            ("bogus", {}),
            ("files.write", {"path": "/tmp/x"}),
        )
        for stream, body in failing:
            *_, last = [m async for m in node.stream(stream, key, body)]
            assert isinstance(sandlot.errors.from_dict(last["error"]), sandlot.SandlotError), stream
        cell = [m async for m in node.stream("box.run_code", key, {"code": "1", "language": "python"})]
        assert cell and cell[-1]["type"] in ("execution", "error")
        console = node.stream("box.follow_logs", key, {"lines": 5})  # a running box's goes on
        assert isinstance(await anext(console), bytes)
        await console.aclose()
        # uploads: chunks in, the write's answer at the end (the file's description); a write
        # that fails says why (it does not leave the driver waiting); one given up is gone
        up = (await node.upload_begin(key, "files.write", {"path": "/tmp/up.txt"}))["ok"]
        assert "error" not in await node.upload_chunk(up, b"hello ")
        assert "error" not in await node.upload_chunk(up, b"node")
        assert (await node.upload_end(up))["ok"]["size"] == 10
        up = (await node.upload_begin(key, "files.write", {"path": "/tmp/up.txt", "exclusive": True}))["ok"]
        replies = [await node.upload_chunk(up, b"x" * 1000) for _ in range(8)]
        replies.append(await asyncio.wait_for(node.upload_end(up), 30))
        errors = [sandlot.errors.from_dict(r["error"]) for r in replies if "error" in r]
        assert errors and isinstance(errors[0], FileExistsError | sandlot.SandlotError), replies
        assert "error" in await node.upload_begin(key, "files.read", {"path": "/tmp/x"})  # not an upload
        up = (await node.upload_begin(key, "files.put_archive", {"path": "/tmp/tree"}))["ok"]
        assert "error" not in await node.upload_abort(up)
        assert "error" in await node.upload_end(up)
        assert not node.uploads
        for kid in (await node.list())["ok"]:
            if kid["id"] != key:
                assert "error" not in await node.remove(kid["id"], True)
        for s in (await node.snapshot_list(None, None))["ok"]:
            await node.drop_snapshot(s["id"])
        assert "error" not in await node.call("box", "remove", key, {"force": True})
        assert (await node.list())["ok"] == []

    asyncio.run(main())
