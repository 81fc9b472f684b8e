"""engine='gvisor': the same agent as the sandbox's init, the same API; each box an
overlay on the image's shared root that survives stop and start; live state through
runsc checkpoint and restore; what the engine does not do yet refused with a clear
error (the "no" cells of the engine table)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import sandlot
from sandlot.core import volumes

from tests.security.test_network import WAIT_FOR_8000
from tests.support.clock import set_while_read, ticks_in
from tests.support.waiting import deadline_in, goes_past, scaled, wait_for

pytestmark = pytest.mark.vm  # runsc comes with scripts/setup; boxes run as root here


def test_exec_files_and_persistence(busybox_root: Path) -> None:
    with sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as box:
        assert box.exec("echo", "hi").stdout == "hi\n"  # (how fast: benchmarks/report.py)
        assert "gVisor" in box.exec("dmesg").stdout  # the user-space kernel, not a VM's
        r = box.exec("sh", "-c", "cat; echo err >&2; exit 3", stdin=b"in\n")
        assert (r.stdout, r.stderr, r.exit_code) == ("in\n", "err\n", 3)
        box.files.write("/root/persist.txt", "survives")
        box.exec("sh", "-c", "echo from-shell > /etc/marker")
        box.stop()
        box.start()
        assert box.files.read("/root/persist.txt") == b"survives"
        assert box.exec("cat", "/etc/marker").stdout == "from-shell\n"
        info = box.inspect()
        assert info["engine"] == "gvisor" and info["paths"]["disk"].endswith(".dir")


def test_boxes_share_a_read_only_base(busybox_root: Path) -> None:
    with (
        sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as a,
        sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as b,
    ):
        a.files.write("/bin/only-in-a", "a")
        assert not b.files.exists("/bin/only-in-a")
        assert a.exec("hostname").stdout != b.exec("hostname").stdout
        layer_a, layer_b = Path(a.inspect()["paths"]["disk"]), Path(b.inspect()["paths"]["disk"])
        base = (layer_a / "base").read_text()
        assert base == (layer_b / "base").read_text()  # one unpacked root under both
        assert not (Path(base) / "bin" / "only-in-a").exists()
        assert (layer_a / "upper" / "bin" / "only-in-a").read_text() == "a"


def test_users_spawn_and_kill(busybox_root: Path) -> None:
    with sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as box:
        assert box.exec("id", "-u", user="nobody").stdout.strip() != "0"
        proc = box.spawn("sh", "-c", "read line; echo got:$line")
        proc.write_stdin(b"abc\n")
        proc.close_stdin()
        assert proc.wait() == 0
        assert proc.result().stdout == "got:abc\n"
        with pytest.raises(sandlot.ExecTimeout):
            box.exec("sleep", "30", timeout=0.5)
        assert box.exec("true").exit_code == 0


def test_interpreter(debian_root: Path) -> None:
    with sandlot.Box(rootfs=debian_root, engine="gvisor", memory_mib=512) as box:
        box.run_code("x = 6 * 7")
        assert box.run_code("print(x)").stdout == "42\n"


# a process whose state lives only in its memory, writing its counter to a file (atomically)
COUNTER = (
    "(i=0; while true; do i=$((i+1)); echo $i > /tmp/n.tmp; mv /tmp/n.tmp /tmp/n; sleep 0.1; done)"
    " >/dev/null 2>&1 &"
)


def count(box: sandlot.Box) -> int:
    return int(box.exec("cat", "/tmp/n").stdout)


def wait_count(box: sandlot.Box) -> int:
    deadline = deadline_in(10)
    while True:
        with contextlib.suppress(sandlot.GuestError, ValueError):
            if (n := count(box)) > 2:
                return n
        assert time.monotonic() < deadline, "the counter never started"
        time.sleep(0.1)


def test_snapshot_rollback_and_fork_through_runsc_checkpoint(busybox_root: Path) -> None:
    """A checkpoint ends the sandbox: the box runs on from it at once, over a new layer
    on the frozen one, with this process's running command and connection carried over."""
    with sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as box:
        box.exec("sh", "-c", COUNTER)
        wait_count(box)
        box.files.write("/root/f", "before")
        echo = box.spawn("sh", "-c", 'while read l; do echo "got $l"; done')
        lines = echo.stdout.lines()
        pid_before = box.inspect()["vm_pid"]
        snap = box.snapshot("s1")
        assert box.state == "running" and box.last_pause is not None and box.last_pause < 10
        assert box.inspect()["vm_pid"] != pid_before  # runsc restored it as a new sandbox
        echo.write_stdin("one\n")
        assert next(lines) == b"got one\n"  # the command and its streams came along
        echo.close_stdin()
        assert echo.wait(10) == 0
        at_snap = count(box)
        box.files.write("/root/f", "after")
        # well past the snapshot's count, so that the rollback's is told apart from it
        later = goes_past("the counter", lambda: count(box), at_snap + 10)
        box.rollback(snap)
        assert box.files.read_text("/root/f") == "before"
        back = count(box)
        assert back < later
        goes_past("the counter after the rollback", lambda: count(box), back)  # its processes run on

        kids = box.fork(2)
        try:
            script = "hostname; cat /etc/machine-id; date +%s"
            asked = time.time()
            facts = [k.exec("sh", "-c", script).stdout.split() for k in kids]
            answered = time.time()
            assert facts[0][0] != facts[1][0] and facts[0][1] != facts[1][1]  # fork-safety
            assert all(set_while_read(f[2], asked, answered) for f in facts), (asked, facts, answered)
            kids[0].files.write("/root/mine", "0")
            assert not kids[1].files.exists("/root/mine")
            assert all(count(k) > 0 for k in kids)
        finally:
            for k in kids:
                k.remove(force=True)


def test_checkpoints_are_chunks_that_share_what_did_not_change(busybox_root: Path) -> None:
    """A checkpoint image is kept as chunks of its state, inflated and cut by content: a
    second checkpoint adds about what changed, not the sandbox's memory again; what a
    restore reads back is checked against its hashes."""
    with sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as box:
        # 16 MiB in the sandbox's own memory (a tmpfs of its kernel), which every checkpoint holds
        mount = (
            "mkdir -p /mnt/mem && mount -t tmpfs mem /mnt/mem && head -c 16777216 /dev/urandom >/mnt/mem/b"
        )
        assert box.exec("sh", "-c", mount).returncode == 0
        blob = box.exec("md5sum", "/mnt/mem/b").stdout
        first = box.snapshot("first")
        box.exec("sh", "-c", "echo changed > /mnt/mem/note")
        second = box.snapshot("second")
        for snap in (first, second):
            assert not any(Path(snap.inspect()["path"]).iterdir())  # no image beside its chunks
            assert snap.logical_size > 16 << 20  # what the restore reads back
        assert first.size > 15 << 20  # its first save: the blob, compressed by nothing
        assert second.size < 2 << 20, (first.size, second.size)  # what changed, not the blob again
        box.exec("rm", "/mnt/mem/b")
        box.rollback(first)
        assert box.exec("md5sum", "/mnt/mem/b").stdout == blob
        assert not box.files.exists("/mnt/mem/note")
        first.remove()
        second.remove()


def test_suspend_then_resume_from_another_process(busybox_root: Path) -> None:
    name = f"gv-suspend-{os.getpid()}"
    box = sandlot.create(rootfs=busybox_root, engine="gvisor", name=name, memory_mib=256)
    try:
        box.start()
        box.exec("sh", "-c", COUNTER)
        wait_count(box)
        t0 = time.monotonic()
        before = count(box)
        box.suspend()
        suspended = time.monotonic()
        assert box.state == "suspended" and box.inspect()["vm_pid"] is None
        script = (
            f"import sandlot, time\nb = sandlot.get({name!r})\nt = time.monotonic()\nb.resume()\n"
            "print(b.exec('cat', '/tmp/n').stdout.strip(), t)\n"
        )
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        read = time.monotonic()
        assert r.returncode == 0, r.stderr
        after, resuming = r.stdout.split()
        # continued, not restarted, and not run while suspended
        assert before <= int(after) <= before + ticks_in(suspended - t0 + read - float(resuming))
        assert box.state == "running" and count(box) >= int(after)
    finally:
        box.remove(force=True)


def test_a_snapshot_by_another_process_keeps_this_ones_connection(busybox_root: Path) -> None:
    """The other process's save ends this process's relay too: its session waits for the
    snapshot to finish, then follows the restored sandbox, its running command with it."""
    name = f"gv-other-{os.getpid()}"
    box = sandlot.create(rootfs=busybox_root, engine="gvisor", name=name, memory_mib=256)
    try:
        box.start()
        echo = box.spawn("sh", "-c", 'while read l; do echo "got $l"; done')
        lines = echo.stdout.lines()
        echo.write_stdin("one\n")
        assert next(lines) == b"got one\n"
        script = f"import sandlot\nprint(sandlot.get({name!r}).snapshot('by-other').name)\n"
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "by-other", r.stderr
        echo.write_stdin("two\n")
        assert next(lines) == b"got two\n"
        echo.close_stdin()
        assert echo.wait(10) == 0
        assert box.exec("echo", "still").stdout == "still\n"
    finally:
        box.remove(force=True)
        for snap in sandlot.list_snapshots():
            if snap.box_name == name:
                snap.remove()


def test_export_then_import_into_another_home(busybox_root: Path, other_home: Path, tmp_path: Path) -> None:
    with sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256) as box:
        box.exec("sh", "-c", COUNTER)
        wait_count(box)
        t0 = time.monotonic()
        before = count(box)
        box.files.write("/root/moved", "with the box")
        box.exec("rm", "/bin/ls")  # a deletion (an overlay whiteout) moves too
        snap = box.snapshot("to-move")
        saved = time.monotonic()
        archive = snap.export(tmp_path / "box.sandlot")
    assert archive.is_file() and not list(tmp_path.glob(".*"))
    importing = time.monotonic()
    moved = sandlot.import_snapshot(archive, home=other_home, name="moved")
    assert isinstance(moved, sandlot.Box)
    try:
        assert moved.state == "running" and moved.inspect()["engine"] == "gvisor"
        assert moved.files.read_text("/root/moved") == "with the box"
        assert not moved.files.exists("/bin/ls") and moved.files.exists("/bin/busybox")
        after = count(moved)  # the process came along, from where the snapshot left it
        assert before <= after <= before + ticks_in(saved - t0 + time.monotonic() - importing)
    finally:
        moved.remove(force=True)


def test_a_saved_state_of_the_other_engine_is_refused(busybox_root: Path) -> None:
    with sandlot.Box(rootfs=busybox_root, memory_mib=256) as box:  # qemu
        snap = box.snapshot()
    try:
        with pytest.raises(sandlot.IncompatibleSnapshot, match=r"saved by the 'qemu' engine.*gvisor"):
            snap.start(engine="gvisor")
    finally:
        snap.remove()


def test_shares_are_bind_mounts_that_live_state_keeps(busybox_root: Path, tmp_path: Path) -> None:
    """Host directories and shared volumes on gVisor: bind mounts served by its gofer,
    which a checkpoint names by path. A file open under one does not stop a save."""
    host, ro = tmp_path / "host", tmp_path / "ro"
    host.mkdir()
    ro.mkdir()
    (ro / "given").write_text("read only\n")
    name = f"gv-shared-{os.urandom(3).hex()}"
    sandlot.volume.create(name, shared=True)
    where = Path(volumes.get_volume(sandlot.Runtime.for_home().store, name).layer)
    made: list[sandlot.Box] = []
    try:
        box = sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256,
                          volumes=[f"{host}:/h", (str(ro), "/ro", "ro"), f"{name}:/s"])  # fmt: skip
        made.append(box)
        box.start()
        box.sh("echo from-the-box > /h/a && echo shared > /s/a", check=True)
        assert (host / "a").read_text() == "from-the-box\n" and (where / "a").read_text() == "shared\n"
        assert box.sh("cat /ro/given").stdout == "read only\n"
        refused = box.sh("(echo x > /ro/new) 2>&1; echo rc=$?").stdout
        assert "rc=1" in refused and not (ro / "new").exists(), refused
        box.sh("sleep 600 > /h/held 2>&1 &", check=True)  # open under a share: the save goes on
        snap = box.snapshot()
        box.sh("echo after > /h/after", check=True)
        [child] = box.fork(1)
        made.append(child)
        assert child.sh("cat /h/a /h/after /s/a").stdout == "from-the-box\nafter\nshared\n"
        child.sh("echo child > /h/child", check=True)
        assert box.sh("cat /h/child").stdout == "child\n"  # the same directory, live
        box.rollback(snap)  # the box goes back, never what it shares
        assert box.sh("cat /h/after /h/child").stdout == "after\nchild\n"
        box.suspend()
        assert box.sh("cat /s/a").stdout == "shared\n"
    finally:
        for b in made:
            b.remove(force=True)
        sandlot.volume.remove(name)


def test_kill9_of_the_owner_then_reattach(busybox_root: Path) -> None:
    """The sandbox outlives a process killed with SIGKILL; another process finds it again."""
    name = f"gv-crash-{os.getpid()}"
    script = (
        "import sandlot, time\n"
        f"b = sandlot.create(rootfs={str(busybox_root)!r}, engine='gvisor', name={name!r}, memory_mib=256)\n"
        "b.start(); b.files.write('/root/x', 'kept'); print('up', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        box = sandlot.get(name)
        assert box.state == "running"
        assert box.files.read("/root/x") == b"kept"
        vm_pid = box.inspect()["vm_pid"]
        os.kill(vm_pid, signal.SIGKILL)  # the sandbox itself, pulled like a plug
        wait_for("the box seen down", lambda: sandlot.get(name).state != "running", 30)
        box.start()
        assert box.files.read("/root/x") == b"kept"
        box.remove(force=True)
    finally:
        if child.poll() is None:
            child.kill()
        with contextlib.suppress(sandlot.BoxNotFound):
            sandlot.get(name).remove(force=True)


# In the box: one connection to the egress proxy left open and idle (as a program
# waiting on a long poll would hold one), whose end it records in /tmp/conn.txt
HOLD_A_CONNECTION = r"""
import socket
s = socket.create_connection(("10.0.2.100", 3128), timeout=30)
open("/tmp/conn.txt", "w").write("open\n")
s.settimeout(None)
try:
    s.recv(1)
    end = "closed"
except OSError as exc:
    end = type(exc).__name__
open("/tmp/conn.txt", "a").write(end + "\n")
"""

# In the box: a connection the box closes first (its side would wait in TIME_WAIT)
CLOSE_FIRST = r"""
import socket
s = socket.create_connection(("10.0.2.100", 3128), timeout=30)
s.close()
"""


def fetch(port: int) -> bytes:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=20).read()


SERVE_8000 = "cd /tmp && echo served-from-box > index.html && exec python3 -m http.server 8000"


def test_live_state_of_a_box_with_a_network_and_connections(debian_root: Path) -> None:
    """A snapshot, rollback, fork and suspend of a gVisor box with a network card, with a
    server listening in it, a connection open and connections just closed on either
    side: the save resets what is connected (the box's programs see ECONNRESET), leaves
    nothing in TIME_WAIT, and every state restores; each child has its own namespace."""
    box = sandlot.Box(
        rootfs=debian_root, engine="gvisor", memory_mib=256, network="allowlist", ports=[(0, 8000)]
    )
    with box:
        cid = f"sandlot-{box.id}"
        assert Path(f"/run/netns/{cid}").exists()
        box.spawn("sh", "-c", SERVE_8000)
        box.exec("python3", "-c", WAIT_FOR_8000, timeout=180).check()
        _, port = box.port(8000)
        for _ in range(3):  # the box's server closes first (HTTP/1.0)
            assert fetch(port) == b"served-from-box\n"
        box.exec("python3", "-c", CLOSE_FIRST)
        box.spawn("python3", "-c", HOLD_A_CONNECTION)
        idle = socket.create_connection(("127.0.0.1", port))  # a host client's, left open
        for _ in range(100):
            if box.files.exists("/tmp/conn.txt"):
                break
            time.sleep(0.05)
        snap = box.snapshot("with-connections")
        assert idle.recv(1) == b""  # the host's side was reset, or closed
        for _ in range(100):
            if box.files.read_text("/tmp/conn.txt").count("\n") == 2:
                break
            time.sleep(0.05)
        assert box.files.read_text("/tmp/conn.txt").split() == ["open", "ConnectionResetError"]
        _, port = box.port(8000)
        assert fetch(port) == b"served-from-box\n"
        box.rollback(snap)
        _, port = box.port(8000)
        assert fetch(port) == b"served-from-box\n"
        kid = box.fork()[0]
        try:
            assert Path(f"/run/netns/sandlot-{kid.id}").exists()
            assert kid.inspect()["network"]["mode"] == "allowlist"
            r = kid.exec(
                "python3", "-c", "import socket; socket.create_connection(('10.0.2.100', 3128), 10).close()"
            )
            assert r.returncode == 0, r.stderr  # its own proxy, in its own namespace
        finally:
            kid.remove(force=True)
        assert not Path(f"/run/netns/sandlot-{kid.id}").exists()
        box.suspend()
        assert not Path(f"/run/netns/{cid}").exists() or box.state == "suspended"
        box.resume()
        _, port = box.port(8000)
        assert fetch(port) == b"served-from-box\n"
        snap.remove()
    assert not Path(f"/run/netns/{cid}").exists()


def test_a_save_waits_for_the_box_s_time_wait_to_end(
    debian_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection the box closed first, whose peer then closed as usual (not one of
    sandlot's ends, which answer with a reset): the box's endpoint waits in TIME_WAIT
    for a minute, and gVisor cannot save it. A save finds it, waits for it to end and
    then succeeds; given less time, it refuses clearly and the box keeps running."""
    from sandlot.engine.gvisor import network, vm
    from sandlot.net.addresses import GATEWAY_ADDRESS

    with sandlot.Box(rootfs=debian_root, engine="gvisor", memory_mib=256, network="allowlist") as box:
        cid = f"sandlot-{box.id}"
        listening: list[socket.socket] = []

        def listen() -> None:  # a plain peer of the box, in its namespace
            s = socket.socket()
            s.bind((GATEWAY_ADDRESS, 5555))
            s.listen()
            listening.append(s)

        network.in_namespace(cid, listen)
        with listening[0]:
            r = box.exec(
                "python3", "-c", "import socket; s = socket.create_connection(('10.0.2.2', 5555), 10); "
                "print(s.getsockname()[1]); s.close()",
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            peer, _ = listening[0].accept()
            assert peer.recv(1) == b""  # the box closed first
            peer.close()  # an ordinary close: the box's side goes to TIME_WAIT
        box_port = int(r.stdout)
        assert network.held_time_waits(cid) == [(box_port, GATEWAY_ADDRESS, 5555)]

        monkeypatch.setattr(vm, "TIME_WAIT_LIMIT", 1.0)
        with pytest.raises(sandlot.SavedStateError, match="TIME_WAIT"):
            box.snapshot("too-soon")
        assert box.state == "running" and box.exec("echo", "alive").stdout == "alive\n"

        monkeypatch.undo()
        t0 = time.monotonic()
        snap = box.snapshot("after-time-wait")
        assert time.monotonic() - t0 < vm.TIME_WAIT_LIMIT + scaled(30)
        assert network.held_time_waits(cid) == []
        box.files.write("/tmp/later", "x")
        box.rollback(snap)
        assert not box.files.exists("/tmp/later") and box.exec("true").returncode == 0
        snap.remove()


def test_export_then_import_of_a_box_with_a_network(
    debian_root: Path, other_home: Path, tmp_path: Path
) -> None:
    """A networked box moves with its server listening: the imported box gets a namespace
    of its own and a host port of its own, and its card works (its proxy answers). The
    archive carries no policy: the importer gives one, as for any box started from a
    saved state with a card."""
    with sandlot.Box(
        rootfs=debian_root, engine="gvisor", memory_mib=256, network="allowlist", ports=[(0, 8000)]
    ) as box:
        box.spawn("sh", "-c", SERVE_8000)
        box.exec("python3", "-c", WAIT_FOR_8000, timeout=180).check()
        _, port = box.port(8000)
        assert fetch(port) == b"served-from-box\n"
        archive = box.snapshot("to-move").export(tmp_path / "box.sandlot")
        moved = sandlot.import_snapshot(  # the policy is the importer's to give, as for any start
            archive, home=other_home, name="moved-with-network", network="allowlist", ports=[(0, 8000)]
        )
        assert isinstance(moved, sandlot.Box)
        try:
            assert moved.inspect()["network"]["mode"] == "allowlist"
            assert Path(f"/run/netns/sandlot-{moved.id}").exists() and moved.id != box.id
            _, moved_port = moved.port(8000)
            assert moved_port != port and fetch(moved_port) == b"served-from-box\n"
            assert fetch(port) == b"served-from-box\n"  # the original still serves too
            r = moved.exec(
                "python3", "-c", "import socket; socket.create_connection(('10.0.2.100', 3128), 10).close()"
            )
            assert r.returncode == 0, r.stderr
        finally:
            moved.remove(force=True)
        assert not Path(f"/run/netns/sandlot-{moved.id}").exists()


def test_a_save_after_open_mode_connections_finds_no_phantom_time_wait(debian_root: Path) -> None:
    """Open mode's connections are redirected to the forwarder (NAT in the box's
    namespace): the save's probes of the ended ones read the box's answers as it sent
    them, so a save finds nothing held and does not wait."""
    import http.server
    import threading

    from sandlot.engine.gvisor import network, vm

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with sandlot.Box(rootfs=debian_root, engine="gvisor", memory_mib=256, network="open") as box:
            fetch_three = (
                "import socket, urllib.request\n"
                f"for _ in range(3): urllib.request.urlopen('http://10.0.2.2:{port}/', timeout=20).read()\n"
                f"s = socket.create_connection(('10.0.2.2', {port}), 10); s.close()\n"  # the box closes first
            )
            r = box.exec("python3", "-c", fetch_three, env={"NO_PROXY": "*"})
            assert r.returncode == 0, r.stderr
            assert network.held_time_waits(f"sandlot-{box.id}") == []
            t0 = time.monotonic()
            snap = box.snapshot("after-open-mode")
            assert time.monotonic() - t0 < vm.TIME_WAIT_LIMIT / 2  # nothing waited for
            assert box.exec("true").returncode == 0
            snap.remove()
    finally:
        server.shutdown()
