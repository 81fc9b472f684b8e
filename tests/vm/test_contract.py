"""The contract of a box on real VMs. Every test body runs against a box of this
host's home (the local transport): exec, streamed processes with stdin and a
terminal, files and trees, watches, ports, code, snapshot and rollback, fork,
suspend and resume, the network policy, and the exceptions. The same operations on
the fake engine, locally, through the server's application and through the fleet's
driver to a node's body, run in the fast tier (``tests/unit/test_contract.py``);
what the remote transports add on real VMs is what they carry over a real wire:
one box driven end to end through a real ``sandlot serve`` process
(``sandlot.connect``) and one through a real Ray cluster's node (``sandlot.fleet``),
each a ``sandlot.Box`` (``test_a_real_box_end_to_end_through``), and what only a
server restart shows.

The local tests share one booted busybox box (each test leaves it usable); the
lifecycle test and the code test boot one more each.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.api import loop

from tests.support.contract import a_terminal_follows_its_size, events_past_and_followed, no_watch_left
from tests.support.serve import Served, serving
from tests.support.waiting import deadline_in, scaled

pytestmark = pytest.mark.vm


@dataclass
class Side:
    """How a test makes and finds boxes on one side: ``new(**options)`` an unstarted box
    (a ``sandlot.Box`` of the side's transport), ``get(key)`` an existing one."""

    kind: str
    new: Callable[..., sandlot.Box]
    get: Callable[[str], sandlot.Box]


@pytest.fixture
def served() -> Iterator[Served]:
    """A real ``sandlot serve`` on the tests' home, with an admin key (host paths allowed)."""
    home = Path(os.environ["SANDLOT_HOME"])
    with serving(home) as s:
        yield s
    if s.api_key:  # best effort: leave no key behind in the shared home
        env = {**os.environ, "SANDLOT_HOME": str(home)}
        listing = subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", "ls"], env=env,
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        for line in listing.stdout.splitlines():
            if line.split() and line.split()[0].startswith(f"admin-{os.getpid()}-"):
                subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", "revoke", line.split()[0]],
                               env=env, capture_output=True, timeout=60)  # fmt: skip


@pytest.fixture
def fleet_of_one() -> Iterator[Any]:
    """A real Ray cluster on this machine with one sandlot node (its own home)."""
    ray = pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'sandlot[fleet]'")
    from sandlot import fleet

    from tests.support.fleet import FleetCluster

    fc = FleetCluster()
    try:
        fc.add(cpus=4, memory_mib=2048)
        ray.init(address=fc.address, namespace="sandlot", log_to_driver=False)
        yield fleet.connect(fc.address, placement_timeout=30)
    finally:
        fc.shutdown()


@pytest.fixture(scope="module")
def side(busybox_root: Path) -> Side:
    plain = {"rootfs": str(busybox_root), "memory_mib": 256}
    return Side("local", lambda **kw: sandlot.Box(**{**plain, **kw}), sandlot.get)


@pytest.fixture(scope="module")
def box(side: Side) -> Iterator[Any]:
    with side.new(network="allowlist") as b:
        assert isinstance(b, sandlot.Box) and b.transport == "local"
        yield b


# -- exec ---------------------------------------------------------------------------------


def test_exec_exit_codes_output_bytes_and_stdin(box: Any) -> None:
    r = box.exec("echo", "hello", "world")
    assert isinstance(r, sandlot.ExecResult)
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (0, "hello world\n", "", True)
    assert box.exec("sh", "-c", "exit 42").exit_code == 42
    r = box.exec("sh", "-c", "kill -TERM $$")
    assert r.signal == signal.SIGTERM and r.exit_code == 128 + signal.SIGTERM
    r = box.exec("sh", "-c", r"printf '\377\000out'; printf 'err\n' >&2")
    assert r.stdout_bytes == b"\xff\x00out" and r.stderr_bytes == b"err\n" and r.stdout == "\ufffd\x00out"
    blob = bytes(range(256)) * 64
    assert box.exec("cat", stdin=blob).stdout_bytes == blob
    assert box.exec("cat", stdin="text in\n").stdout == "text in\n"
    assert box.exec("wc", "-c", stdin=io.BytesIO(b"x" * 300_000)).stdout.strip() == "300000"
    assert box.exec("wc", "-c", stdin=b"y" * 2_000_000).stdout.strip() == "2000000"  # past one JSON body
    assert (
        box.exec("sh", "-c", 'echo "$FOO"; pwd', env={"FOO": "bar baz"}, cwd="/etc").stdout
        == "bar baz\n/etc\n"
    )
    assert box.sh("id -u", user="agent").stdout == "1000\n"


def test_exec_timeout_and_check_raise_as_locally(box: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(sandlot.ExecTimeout) as timed_out:
        box.exec("sh", "-c", "echo started; sleep 1000", timeout=5)
    assert isinstance(timed_out.value, TimeoutError) and time.monotonic() - t0 < 5 + scaled(15)
    assert timed_out.value.stdout == b"started\n"
    assert box.exec("echo", "still here").stdout == "still here\n"
    with pytest.raises(sandlot.CommandFailed) as failed:
        box.exec("sh", "-c", "echo oops >&2; exit 3", check=True)
    assert failed.value.result.exit_code == 3 and "oops" in str(failed.value)
    assert box.exec("true", check=True).ok
    with pytest.raises(FileNotFoundError, match="no-such-binary"):
        box.exec("no-such-binary")
    with pytest.raises(sandlot.InvalidArgument):
        box.exec()


# -- processes ------------------------------------------------------------------------------


def test_spawn_streams_output_while_taking_stdin(box: Any) -> None:
    p = box.spawn("sh", "-c", "while read l; do echo got:$l; done; echo bye >&2; exit 7")
    assert isinstance(p, sandlot.Process) and p.pid > 0
    lines = iter(p.stdout.lines())
    for word in ("one", "two", "three"):
        p.write_stdin(f"{word}\n")
        assert next(lines) == f"got:{word}\n".encode()  # each answer comes before the next question
    p.close_stdin()
    assert p.wait(timeout=30) == 7 and p.returncode == 7
    assert p.stderr.read() == b"bye\n"

    sleeper = box.spawn("sleep", "1000")
    sleeper.kill(signal.SIGTERM)
    r = sleeper.result(timeout=30)
    assert r.signal == signal.SIGTERM and r.exit_code == 128 + signal.SIGTERM


def test_spawn_with_a_terminal(box: Any) -> None:
    r = box.exec("sh", "-c", "tty; stty size; test -t 0 && echo interactive", tty=True)
    out = r.stdout.replace("\r\n", "\n")
    assert "/dev/pts/" in out and "24 80" in out and "interactive" in out
    a_terminal_follows_its_size(box)


def test_a_local_process_is_not_held_by_id(box: Any) -> None:
    """A server or a node holds the processes its clients start, and follows one again by
    id (``test_a_real_box_end_to_end_through``); locally there is no such host, and the
    error says so, naming the transport."""
    with pytest.raises(sandlot.Unsupported, match="local transport") as refused:
        box.processes()
    assert refused.value.transport == "local"


# -- files ------------------------------------------------------------------------------------


def test_files_round_trip(box: Any, tmp_path: Path) -> None:
    f = box.files
    assert f.write("/tmp/t/a.txt", "hello\n") == 6
    assert f.read("/tmp/t/a.txt") == b"hello\n" and f.read_text("/tmp/t/a.txt") == "hello\n"
    f.write("/tmp/t/bin", bytes(range(256)), mode=0o600)
    info = f.stat("/tmp/t/bin")
    assert isinstance(info, sandlot.FileInfo) and info.is_file and info.size == 256 and info.mode == 0o600
    assert info.mtime.tzinfo is not None and abs(info.mtime.timestamp() - time.time()) < 3600
    assert b"".join(f.iter_read("/tmp/t/bin", offset=10, length=5)) == bytes(range(10, 15))

    f.mkdir("/tmp/t/sub/deeper")
    assert f.stat("/tmp/t/sub").is_dir and f.exists("/tmp/t/sub/deeper")
    f.rename("/tmp/t/a.txt", "/tmp/t/sub/b.txt")
    f.chmod("/tmp/t/sub/b.txt", 0o751)
    assert f.stat("/tmp/t/sub/b.txt").mode == 0o751 and not f.exists("/tmp/t/a.txt")
    assert [(e.name, e.type) for e in f.list("/tmp/t")] == [("bin", "file"), ("sub", "dir")]

    local = tmp_path / "up.bin"
    local.write_bytes(os.urandom(600_000))
    local.chmod(0o640)
    assert f.upload(local, "/tmp/t/up.bin") == 600_000
    assert f.stat("/tmp/t/up.bin").mode == 0o640
    assert (
        box.exec("md5sum", "/tmp/t/up.bin").stdout.split()[0] == hashlib.md5(local.read_bytes()).hexdigest()
    )
    assert f.download("/tmp/t/up.bin", tmp_path / "down.bin") == 600_000
    assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()

    tree = tmp_path / "tree"
    (tree / "x").mkdir(parents=True)
    (tree / "x" / "y.txt").write_text("why")
    (tree / "z.txt").write_text("zed")
    assert f.upload(tree, "/tmp/t/tree") == 6
    assert f.read_text("/tmp/t/tree/x/y.txt") == "why" and f.read_text("/tmp/t/tree/z.txt") == "zed"

    # owners, appending, and a write that must not replace a file
    f.write("/tmp/t/owned", "mine", user="agent")
    assert (f.stat("/tmp/t/owned").uid, f.stat("/tmp/t/owned").gid) == (1000, 1000)
    f.write("/tmp/t/owned", " and more", append=True)
    assert f.read_text("/tmp/t/owned") == "mine and more" and f.stat("/tmp/t/owned").uid == 1000
    with pytest.raises(FileExistsError):
        f.write("/tmp/t/owned", "x", exclusive=True)
    with pytest.raises(FileNotFoundError):
        f.write("/tmp/t/nodir/x", "x", parents=False)
    f.chown("/tmp/t/owned", "0:0")
    assert f.stat("/tmp/t/owned").uid == 0
    f.mkdir("/tmp/t/theirs", user="agent")
    assert f.stat("/tmp/t/theirs").uid == 1000
    f.upload(tree, "/tmp/t/tree2", user="agent")
    assert {f.stat(p).uid for p in ("/tmp/t/tree2", "/tmp/t/tree2/x", "/tmp/t/tree2/x/y.txt")} == {1000}
    with pytest.raises(sandlot.InvalidArgument):
        f.chown("/tmp/t/owned", "no such:user:x")
    with pytest.raises(FileNotFoundError, match="unknown user"):
        f.chown("/tmp/t/owned", "nobody-here")

    with pytest.raises(FileNotFoundError):
        f.read("/tmp/t/missing")
    with pytest.raises(FileNotFoundError):
        f.stat("/tmp/t/missing")
    with pytest.raises(sandlot.InvalidArgument):
        f.read("relative/path")
    with pytest.raises(OSError):  # a directory that is not empty
        f.remove("/tmp/t/sub")
    f.remove("/tmp/t/sub", recursive=True)
    f.remove("/tmp/t/missing", missing_ok=True)
    assert not f.exists("/tmp/t/sub")
    f.remove("/tmp/t", recursive=True)


# -- ports ------------------------------------------------------------------------------------


def test_trees_move_as_docker_cp_moves_them(box: Any, tmp_path: Path) -> None:
    """Links are links both ways, whatever they point at; a copy that cannot be whole is
    refused by name, with the same error on every transport, and leaves nothing."""
    f = box.files
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret: never in a box")
    tree = tmp_path / "proj"
    (tree / "venv" / "bin").mkdir(parents=True)
    (tree / "main.py").write_text("print('main')\n")
    (tree / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    (tree / "venv" / "m").symlink_to("../main.py")
    (tree / "key").symlink_to(secret)
    os.link(tree / "main.py", tree / "hard.py")
    os.mkfifo(tree / "fifo")
    assert f.upload(tree, "/tmp/cp/proj") == len("print('main')\n")
    out = box.exec(
        "sh",
        "-c",
        "cd /tmp/cp/proj && for l in venv/bin/python venv/m key; do readlink $l; done && [ -p fifo ] && "
        "echo fifo && [ $(stat -c %i main.py) = $(stat -c %i hard.py) ] && echo linked && find . -type f | "
        "xargs cat",
    ).stdout
    assert out.split("\n")[:6] == [
        "/usr/bin/python3",
        "../main.py",
        str(secret),
        "fifo",
        "linked",
        "print('main')",
    ]
    assert "host secret" not in out

    back = tmp_path / "back"
    f.download("/tmp/cp/proj", back)
    assert os.readlink(back / "key") == str(secret) and os.readlink(back / "venv" / "m") == "../main.py"
    assert (back / "main.py").stat().st_ino == (back / "hard.py").stat().st_ino
    with pytest.raises(sandlot.TransferError) as caught:  # followed when asked, only inside the tree
        f.upload(tree, "/tmp/cp/followed", follow_symlinks=True)
    assert (caught.value.entry, caught.value.side) == ("key", "host") and not f.exists("/tmp/cp/followed")
    with pytest.raises(sandlot.TransferError) as caught:  # a directory over the file in the box
        bad = tmp_path / "bad"
        (bad / "main.py").mkdir(parents=True)
        (bad / "main.py" / "x").write_text("x")
        f.upload(bad, "/tmp/cp/proj")
    assert (caught.value.entry, caught.value.side, caught.value.written) == ("main.py", "box", None)
    assert f.read_text("/tmp/cp/proj/main.py") == "print('main')\n"
    box.exec("ln", "-s", "/etc/passwd", "/tmp/cp/proj/out")
    with pytest.raises(sandlot.TransferError) as caught:  # followed only inside the tree
        f.download("/tmp/cp/proj", tmp_path / "followed", follow_symlinks=True)
    assert (caught.value.entry, caught.value.side) == ("key", "box") and not (tmp_path / "followed").exists()
    f.remove("/tmp/cp", recursive=True)


def _recv_all(s: socket.socket) -> bytes:
    parts = []
    while chunk := s.recv(65536):
        parts.append(chunk)
    return b"".join(parts)


def _listening(box: Any, port: int) -> socket.socket:
    """A connection to ``port`` once something listens there (a server just started)."""
    deadline = deadline_in(30)
    while True:
        try:
            return box.connect(port)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_watch_reports_changes_and_stops_with_its_path(box: Any) -> None:
    f = box.files
    f.mkdir("/tmp/wr/sub")
    with pytest.raises(FileNotFoundError):
        f.watch("/tmp/wr/missing").start()
    with f.watch("/tmp/wr") as w:
        box.exec(
            "sh", "-c", "echo x > /tmp/wr/sub/a && mv /tmp/wr/sub/a /tmp/wr/b && mkdir /tmp/wr/d"
        ).check()
        got = [w.next_event(10) for _ in range(4)]
        assert got == [sandlot.FileEvent("created", "/tmp/wr/sub/a"),
                       sandlot.FileEvent("modified", "/tmp/wr/sub/a"),
                       sandlot.FileEvent("moved", "/tmp/wr/b", False, "/tmp/wr/sub/a"),
                       sandlot.FileEvent("created", "/tmp/wr/d", True)]  # fmt: skip
    assert w.closed
    with f.watch("/tmp/wr/d") as w:
        box.exec("rmdir", "/tmp/wr/d").check()
        assert list(w) == [sandlot.FileEvent("deleted", "/tmp/wr/d", True)]  # then the iteration ends
    no_watch_left(box)
    f.remove("/tmp/wr", recursive=True)


def test_connect_reaches_an_unpublished_port_in_the_box(box: Any) -> None:
    web = box.spawn("sh", "-c", "mkdir -p /www && echo hello > /www/index.html && "
                                "exec httpd -f -p 127.0.0.1:8080 -h /www")  # fmt: skip
    echo = box.spawn("nc", "-ll", "-p", "9000", "-e", "cat")
    try:
        with _listening(box, 8080) as s:
            s.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
            answer = _recv_all(s)
        assert answer.startswith(b"HTTP/1.") and b" 200 " in answer.split(b"\r\n")[0]
        assert answer.endswith(b"\r\n\r\nhello\n")
        blob = os.urandom(3 << 20)  # past every window and buffer on the way
        with _listening(box, 9000) as s:
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)  # a half close: the box's side then ends
            assert _recv_all(s) == blob
        with pytest.raises(sandlot.GuestOSError) as refused:
            box.connect(1)
        assert isinstance(refused.value, ConnectionRefusedError) and refused.value.errno == errno.ECONNREFUSED
        for bad in (0, 65536, "80"):
            with pytest.raises(sandlot.InvalidArgument):
                box.connect(bad)
    finally:
        web.kill()
        echo.kill()


# -- code ---------------------------------------------------------------------------------------


def test_code_cells_keep_state_stream_and_time_out(side: Side, debian_root: Path) -> None:
    with side.new(rootfs=str(debian_root), memory_mib=512) as box:
        seen: list[str] = []
        ex = box.run_code("print('a', flush=True)\ndisplay(1)\nv = 20\nv * 2 + 2", on_stdout=seen.append,
                          on_result=lambda r: seen.append(f"result {r.text}"))  # fmt: skip
        # output comes in batches as it is written: "a" and "\n" may be two of them
        assert ex.text == "42" and ex.stdout == "a\n"
        assert "".join(seen[:-2]) == "a\n" and seen[-2:] == ["result 1", "result 42"]
        ex = box.run_code("1 / 0")
        assert ex.error is not None and ex.error.name == "ZeroDivisionError" and ex.execution_count == 2
        with pytest.raises(sandlot.CodeTimeout) as info:
            box.run_code("print('so far', flush=True)\nimport time\ntime.sleep(60)", timeout=5)
        assert isinstance(info.value.execution, sandlot.Execution)
        assert info.value.execution.stdout == "so far\n" and not info.value.state_lost
        assert box.run_code("v").text == "20"
        ctx = box.create_code_context(cwd="/tmp")
        assert ctx.cwd == "/tmp" and ctx.id in {c.id for c in box.list_code_contexts()}
        assert box.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
        assert box.restart_code_context(ctx).id == ctx.id
        box.remove_code_context(ctx)
        with pytest.raises(sandlot.CodeContextNotFound):
            box.run_code("1", context=ctx)


# -- live state ---------------------------------------------------------------------------------


def test_snapshot_then_rollback(box: Any) -> None:
    box.files.write("/root/marker", "before")
    snap = box.snapshot()
    assert snap.kind == "snapshot" and snap.box_name == box.name
    try:
        box.files.write("/root/marker", "after")
        box.rollback(snap)
        assert box.files.read_text("/root/marker") == "before"
        assert snap.id in [s.id for s in box.snapshots()]
        with pytest.raises(sandlot.SnapshotNotFound):
            box.rollback("no-such-snapshot")
        # a box started from it, with options of its own
        (kid,) = snap.start(env={"FROM_SNAP": "yes"}, labels={"role": "kid"}, workdir="/root")
        try:
            said = kid.exec("sh", "-c", 'echo "$FROM_SNAP $(pwd) $(cat marker)"').stdout
            assert said == "yes /root before\n"
            assert kid.info["labels"]["role"] == "kid"
        finally:
            kid.remove(force=True)
    finally:
        snap.remove()


def test_diff_and_restore(box: Any) -> None:
    box.sh("mkdir -p /root/d && echo one > /root/d/kept && echo old > /root/d/edited")
    snap = box.snapshot()
    try:
        box.sh("echo new > /root/d/edited && rm /root/d/kept && echo hi > /root/d/added")
        d = box.diff(snap, paths=["/root/d"])
        assert [(c.path, c.status) for c in d] == [
            ("/root/d/added", "added"), ("/root/d/edited", "modified"), ("/root/d/kept", "deleted"),
        ]  # fmt: skip
        assert "-old\n+new\n" in (d.changes[1].diff or "") and d.stat["modified"] == 1
        done = box.files.restore("/root/d", from_=snap)
        assert done["entries"] == 3 and box.files.read_text("/root/d/kept") == "one\n"
        assert not box.diff(snap, paths="/root/d")
        (kid,) = box.fork()
        try:
            kid.files.write("/root/d/kid", "mine")
            assert [(c.path, c.status) for c in kid.diff(box, paths="/root/d")] == [("/root/d/kid", "added")]
        finally:
            kid.remove(force=True)
        with pytest.raises(sandlot.SnapshotNotFound):
            box.diff("no-such-snapshot")
        with pytest.raises(sandlot.InvalidArgument):
            box.diff(snap, paths=["relative"])
    finally:
        for s in box.snapshots():  # this one and the fork's
            s.remove()


def test_a_box_events_past_and_followed(box: Any) -> None:
    story = events_past_and_followed(box)
    recent = [e.kind for e in box.events(since=story[-1].at, follow=False)]
    assert recent[-2:] == ["paused", "unpaused"]


def test_fork_two(box: Any) -> None:
    box.files.write("/root/forked", "from the parent")
    kids = box.fork(2)
    try:
        assert len(kids) == 2 and len({k.id for k in kids} | {box.id}) == 3
        for kid in kids:
            assert kid.state == "running"
            assert kid.files.read_text("/root/forked") == "from the parent"
        kids[0].files.write("/root/forked", "changed")
        assert kids[1].files.read_text("/root/forked") == "from the parent"
        assert box.files.read_text("/root/forked") == "from the parent"
    finally:
        for kid in kids:
            kid.remove(force=True)
    for snap in box.snapshots():  # the fork's own snapshot
        snap.remove()


def test_lifecycle_suspend_resume_and_invalid_states(side: Side) -> None:
    b = side.new(keep=True)
    try:
        b.start()
        assert b.state == "running"
        b.sh("echo kept > /root/kept")
        b.suspend()
        assert side.get(b.id).state == "suspended"
        b.resume()
        assert b.state == "running" and b.files.read_text("/root/kept") == "kept\n"
        b.stop()
        assert b.state == "stopped"
        with pytest.raises(sandlot.InvalidState) as refused:
            b.pause()
        assert refused.value.state == "stopped" and refused.value.allowed == ("running",)
        b.start()
        with pytest.raises(sandlot.InvalidState):
            b.remove()  # a running box needs force=True
    finally:
        b.remove(force=True)
    assert b.state == "removed"
    with pytest.raises(sandlot.BoxNotFound):
        side.get(b.id)
    with pytest.raises(sandlot.BoxNotFound):
        side.get("no-such-box-anywhere")


def test_set_network(box: Any) -> None:
    box.set_network(allow=["example.com"])
    assert box.inspect()["network"]["allow"] == ["example.com"]
    box.set_network(allow=[])
    assert box.inspect()["network"]["allow"] == []
    with pytest.raises(sandlot.InvalidState, match="network card"):
        box.set_network("none")


def test_a_process_outlives_a_server_restart(box: Any) -> None:
    """What the HTTP transport survives: its server killed and started again while a
    client follows processes of a box through it (the local tests' box: it is of the
    home the server serves)."""
    home = Path(os.environ["SANDLOT_HOME"])
    with serving(home, no_auth=True) as other, sandlot.connect(other.url) as client:
        b = client.get(box.id)  # the same box, through a server of its home
        # What the dead server took and had not sent yet is a gap, as documented; so the
        # output that must survive is written only once that server is gone.
        go = f"/tmp/server-gone-{os.getpid()}"
        wait_go = f"while [ ! -e {go} ]; do sleep 0.05; done"
        rest = "for i in $(seq 2 30); do echo line$i; sleep 0.02; done"
        p = b.spawn("sh", "-c", f"echo line1; {wait_go}; {rest}")
        reader = b.spawn("sh", "-c", "read x; echo got $x; exit 7")  # its stdin goes on too
        late = b.spawn("sh", "-c", f"{wait_go}; echo late >&2; exit 3")  # ends while no server runs
        lines = iter(p.stdout.lines())
        assert next(lines) == b"line1\n"
        other.kill9()
        # the library reaches the box while no server runs, and lets `late` end unheard
        sandlot.get(box.id).sh(f"touch {go}; while kill -0 {late.pid} 2>/dev/null; do sleep 0.05; done")
        other.restart()
        assert b"".join(lines) == b"".join(b"line%d\n" % i for i in range(2, 31))
        assert p.wait(timeout=30) == 0
        reader.write_stdin(b"hi\n")
        assert reader.stdout.read() == b"got hi\n" and reader.wait(timeout=30) == 7
        assert late.stderr.read() == b"late\n" and late.wait(timeout=30) == 3
        listed = {q["id"]: q for q in b.processes()}
        assert listed[p.aio._remote.id]["exit_code"] == 0  # the new server holds what the old one ran


# -- through the remote transports ----------------------------------------------------------


@pytest.fixture(params=["http", "ray"])
def remote(request: pytest.FixtureRequest) -> Iterator[Side]:
    """Boxes through a real ``sandlot serve`` on the tests' home, or through a real Ray
    cluster's node."""
    if request.param == "ray":
        f = request.getfixturevalue("fleet_of_one")
        yield Side("ray", f.Box, f.get)
        return
    served: Served = request.getfixturevalue("served")
    with sandlot.connect(served.url, api_key=served.api_key) as client:
        yield Side("http", client.Box, client.get)


def test_a_real_box_end_to_end_through(remote: Side, busybox_root: Path, debian_root: Path,
                                       tmp_path: Path) -> None:  # fmt: skip
    """Each path a transport carries, once, on real boxes through it: a command's exit,
    signal, bytes, stdin, timeout and errors; streamed processes, signalled, held and
    followed again by id and after a dropped link; a terminal; files, owners, trees and
    refused copies; watches; a port; a restore, a rollback and a fork; events; the
    network policy; code; removal. A transport that breaks any of them on real VMs fails
    here. Each operation with its corner cases is a local test above, and the fast
    tier's on every transport (``tests/unit/test_contract.py``)."""
    with remote.new(rootfs=str(busybox_root), memory_mib=256, network="allowlist") as box:
        assert isinstance(box, sandlot.Box) and box.transport == remote.kind and box.state == "running"
        assert remote.get(box.id).name == box.name and box.ping() > 0

        r = box.exec("sh", "-c", r"printf '\377\000out'; printf 'err\n' >&2; exit 3")
        assert (r.exit_code, r.stdout_bytes, r.stderr_bytes) == (3, b"\xff\x00out", b"err\n")
        assert box.exec("sh", "-c", "kill -TERM $$").signal == signal.SIGTERM
        blob = os.urandom(2_000_000)  # past one JSON body
        assert box.exec("cat", stdin=blob).stdout_bytes == blob
        said = box.exec("sh", "-c", 'echo "$FOO"; pwd; id -u', env={"FOO": "bar"}, cwd="/etc", user="agent")
        assert said.stdout == "bar\n/etc\n1000\n"
        with pytest.raises(sandlot.ExecTimeout) as timed_out:
            box.exec("sh", "-c", "echo started; sleep 1000", timeout=3)
        assert timed_out.value.stdout == b"started\n"
        with pytest.raises(sandlot.CommandFailed) as failed:
            box.exec("false", check=True)
        assert failed.value.result.exit_code == 1
        with pytest.raises(FileNotFoundError, match="no-such-binary"):
            box.exec("no-such-binary")

        p = box.spawn("sh", "-c", "while read l; do echo got:$l; done; echo bye >&2; exit 7")
        lines = iter(p.stdout.lines())
        for word in ("one", "two"):
            p.write_stdin(f"{word}\n")
            assert next(lines) == f"got:{word}\n".encode()  # each answer comes before the next question
        p.close_stdin()
        assert p.wait(timeout=30) == 7 and p.stderr.read() == b"bye\n"
        sleeper = box.spawn("sleep", "1000")
        sleeper.kill(signal.SIGTERM)
        assert sleeper.result(timeout=30).signal == signal.SIGTERM
        p = box.spawn("sh", "-c", "for i in 1 2 3; do echo out$i; sleep 0.2; done; echo done >&2")
        p.detach()  # this client stops following; the server or node keeps the process and its output
        held = next(h for h in box.processes() if h["pid"] == p.pid)
        r = box.attach(held["id"]).result(timeout=30)
        assert (r.stdout, r.stderr, r.exit_code) == ("out1\nout2\nout3\n", "done\n", 0)
        assert box.attach(held["id"], stdout=5).result(timeout=30).stdout == "out2\nout3\n"
        # the link to a held process (a server's WebSocket, a node's Ray stream) breaks, as a
        # network would: the process is followed again from the offsets received
        p = box.spawn("sh", "-c", "for i in $(seq 1 40); do echo line$i; sleep 0.05; done; echo end >&2")
        lines = iter(p.stdout.lines())
        assert next(lines) == b"line1\n"
        handle = p.aio._remote
        if remote.kind == "http":
            loop.call(lambda: handle._link.ws.transport.abort())
        else:
            import ray

            ray.cancel(handle._link.gen)
        assert b"".join(lines) == b"".join(b"line%d\n" % i for i in range(2, 41))  # every byte, once
        assert p.wait(timeout=30) == 0 and p.stderr.read() == b"end\n" and handle.reattached == 1

        r = box.exec("sh", "-c", "stty size; test -t 0 && echo interactive", tty=True)
        assert r.stdout.replace("\r\n", "\n") == "24 80\ninteractive\n"
        a_terminal_follows_its_size(box)

        f = box.files
        assert f.write("/tmp/t/a.txt", "hello\n") == 6 and f.read_text("/tmp/t/a.txt") == "hello\n"
        f.write("/tmp/t/bin", bytes(range(256)), mode=0o600)
        info = f.stat("/tmp/t/bin")
        assert info.is_file and (info.size, info.mode) == (256, 0o600)
        assert b"".join(f.iter_read("/tmp/t/bin", offset=10, length=5)) == bytes(range(10, 15))
        f.mkdir("/tmp/t/sub")
        listed = [(e.name, e.type) for e in f.list("/tmp/t")]
        assert listed == [("a.txt", "file"), ("bin", "file"), ("sub", "dir")]
        f.write("/tmp/t/owned", "mine", user="agent")
        assert f.stat("/tmp/t/owned").uid == 1000
        f.chown("/tmp/t/owned", "0:0")
        assert f.stat("/tmp/t/owned").uid == 0
        with pytest.raises(FileNotFoundError, match="unknown user"):
            f.chown("/tmp/t/owned", "nobody-here")
        local = tmp_path / "up.bin"
        local.write_bytes(os.urandom(3 << 20))  # in more than one chunk on every transport
        assert f.upload(local, "/tmp/t/up.bin") == 3 << 20
        md5 = box.exec("md5sum", "/tmp/t/up.bin").stdout.split()[0]
        assert md5 == hashlib.md5(local.read_bytes()).hexdigest()
        assert f.download("/tmp/t/up.bin", tmp_path / "down.bin") == 3 << 20
        assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
        tree = tmp_path / "tree"
        (tree / "x").mkdir(parents=True)
        (tree / "x" / "y.txt").write_text("why")
        (tree / "link").symlink_to("x/y.txt")
        assert f.upload(tree, "/tmp/t/tree", user="agent") == 3
        out = box.exec("sh", "-c", "readlink /tmp/t/tree/link; stat -c %u /tmp/t/tree/x/y.txt").stdout
        assert out == "x/y.txt\n1000\n"
        f.download("/tmp/t/tree", tmp_path / "back")
        assert (tmp_path / "back" / "x" / "y.txt").read_text() == "why"
        assert os.readlink(tmp_path / "back" / "link") == "x/y.txt"
        bad = tmp_path / "bad"
        (bad / "a.txt").mkdir(parents=True)
        (bad / "a.txt" / "x").write_text("x")
        with pytest.raises(sandlot.TransferError) as caught:  # a directory over a file of the box
            f.upload(bad, "/tmp/t")
        assert (caught.value.entry, caught.value.side) == ("a.txt", "box")
        assert f.read_text("/tmp/t/a.txt") == "hello\n"
        box.exec("ln", "-s", "/etc/passwd", "/tmp/t/tree/out")
        with pytest.raises(sandlot.TransferError) as caught:  # followed only inside the tree
            f.download("/tmp/t/tree", tmp_path / "followed", follow_symlinks=True)
        assert (caught.value.entry, caught.value.side) == ("out", "box")
        assert not (tmp_path / "followed").exists()
        with f.watch("/tmp/t/sub") as w:
            box.exec("sh", "-c", "echo x > /tmp/t/sub/new").check()
            assert w.next_event(10) == sandlot.FileEvent("created", "/tmp/t/sub/new")
        assert w.closed
        f.mkdir("/tmp/t/gone")
        with f.watch("/tmp/t/gone") as w:
            box.exec("rmdir", "/tmp/t/gone").check()
            assert list(w) == [sandlot.FileEvent("deleted", "/tmp/t/gone", True)]  # then the iteration ends
        no_watch_left(box)
        f.remove("/tmp/t", recursive=True)
        assert not f.exists("/tmp/t")

        echo = box.spawn("nc", "-ll", "-p", "9000", "-e", "cat")
        try:
            blob = os.urandom(3 << 20)  # past every window and buffer on the way
            with _listening(box, 9000) as s:
                s.sendall(blob)
                s.shutdown(socket.SHUT_WR)
                assert _recv_all(s) == blob
            with pytest.raises(sandlot.GuestOSError) as refused:
                box.connect(1)
            assert refused.value.errno == errno.ECONNREFUSED
        finally:
            echo.kill()

        box.sh("mkdir -p /root/d && echo before > /root/d/marker")
        snap = box.snapshot()
        assert snap.kind == "snapshot" and snap.box_name == box.name
        assert snap.id in [s.id for s in box.snapshots()]
        box.sh("echo after > /root/d/marker")
        changed = [(c.path, c.status) for c in box.diff(snap, paths=["/root/d"])]
        assert changed == [("/root/d/marker", "modified")]
        assert f.restore("/root/d/marker", from_=snap)["entries"] == 1
        assert f.read_text("/root/d/marker") == "before\n"
        box.sh("echo after > /root/d/marker")
        box.rollback(snap)
        assert f.read_text("/root/d/marker") == "before\n"
        (kid,) = box.fork()
        try:
            assert kid.transport == remote.kind and kid.files.read_text("/root/d/marker") == "before\n"
            kid.files.write("/root/d/kid", "mine")
            assert [(c.path, c.status) for c in kid.diff(box, paths="/root/d")] == [("/root/d/kid", "added")]
        finally:
            kid.remove(force=True)
        for s in box.snapshots():  # this one and the fork's
            s.remove()

        events_past_and_followed(box)
        box.set_network(allow=["example.com"])
        assert box.inspect()["network"]["allow"] == ["example.com"]
        with pytest.raises(sandlot.InvalidState, match="network card"):
            box.set_network("none")

        box.remove(force=True)
        assert box.state == "removed"
        with pytest.raises(sandlot.BoxNotFound):
            remote.get(box.id)

    with remote.new(rootfs=str(debian_root), memory_mib=512) as py:
        seen: list[str] = []
        ex = py.run_code("print('a', flush=True)\ndisplay(1)\nv = 20\nv * 2 + 2", on_stdout=seen.append,
                         on_result=lambda r: seen.append(f"result {r.text}"))  # fmt: skip
        # output comes in batches as it is written: "a" and "\n" may be two of them
        assert (ex.text, ex.stdout) == ("42", "a\n")
        assert "".join(seen[:-2]) == "a\n" and seen[-2:] == ["result 1", "result 42"]
        ex = py.run_code("1 / 0")
        assert ex.error is not None and ex.error.name == "ZeroDivisionError" and ex.execution_count == 2
        with pytest.raises(sandlot.CodeTimeout) as info:
            py.run_code("print('so far', flush=True)\nimport time\ntime.sleep(60)", timeout=3)
        assert info.value.execution.stdout == "so far\n" and not info.value.state_lost
        assert py.run_code("v").text == "20"
        ctx = py.create_code_context(cwd="/tmp")
        assert ctx.id in {c.id for c in py.list_code_contexts()}
        assert py.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
        assert py.restart_code_context(ctx).id == ctx.id
        py.remove_code_context(ctx)
        with pytest.raises(sandlot.CodeContextNotFound):
            py.run_code("1", context=ctx)
