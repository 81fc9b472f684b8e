"""Live state: snapshots with processes intact, rollback, fork, templates,
suspend/resume across processes, export/import into another home, and kill -9
at several points of each. Real VMs, real QEMU migration, the real agent."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

import sandlot

from tests.conftest import TEST_ENGINE
from tests.support.chunks import memory_chunks
from tests.support.clock import set_while_read, ticks_in

pytestmark = pytest.mark.vm

# A shell loop and a Python process whose state lives only in their memory;
# each writes its counter to a file the tests read (atomically: a reader must
# never see a file half written).
COUNTERS = r"""
nohup sh -c 'echo $$ > /tmp/sh.pid; i=0;
  while true; do i=$((i+1)); echo $i > /tmp/sh.tmp; mv /tmp/sh.tmp /tmp/sh-count;
  sleep 0.1; done' >/dev/null 2>&1 &
nohup python3 -c '
import os, time
open("/tmp/py.pid", "w").write(str(os.getpid()))
n = 0
while True:
    n += 1
    open("/tmp/py-count.tmp", "w").write(str(n))
    os.rename("/tmp/py-count.tmp", "/tmp/py-count")
    time.sleep(0.1)
' >/dev/null 2>&1 &
"""


def counters(box: sandlot.Box) -> tuple[int, int]:
    out = box.sh("cat /tmp/sh-count; echo; cat /tmp/py-count").stdout.split()
    return int(out[0]), int(out[1])


def wait_counters(box: sandlot.Box, at_least: int = 3) -> tuple[int, int]:
    # a first python3 in a freshly booted box, under TCG, with a second test run beside
    # this one on 2 cores, once took over 20 s to write its first count
    deadline = time.monotonic() + 60
    while True:
        try:
            c = counters(box)
            if min(c) >= at_least:
                return c
        except (ValueError, IndexError):
            pass
        assert time.monotonic() < deadline, "the counters never started"
        time.sleep(0.2)


def wait_past(box: sandlot.Box, floor: tuple[int, int] | list[int], by: int) -> tuple[int, int]:
    """The counters once both have gone ``by`` past ``floor``: they run on. (Polled, not
    read after a fixed sleep: on a busy host a loop of 10 a second can do 3 in a second.)"""
    deadline = time.monotonic() + 20
    while True:
        c = counters(box)
        if c[0] > floor[0] + by and c[1] > floor[1] + by:
            return c
        assert time.monotonic() < deadline, f"the counters stopped at {c} (from {floor})"
        time.sleep(0.2)


def told(box: sandlot.Box) -> str:
    """The box's events, for a failure's message: what was done to it, by whom, and why."""
    return "; ".join(f"{e.kind} by {e.by} ({e.reason})" for e in box.events(follow=False))


def py(
    code: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture(scope="module")
def clean_state(debian_root: Path) -> Iterator[sandlot.Snapshot]:
    """A Debian box booted once, its counters running, and saved: each test's box is
    started from this state. Under TCG a cold boot and a first python3 cost several
    times a restore; a box of its own per test (not one box rolled back) keeps a
    test's snapshots, crashes and stopped or suspended states out of the next one."""
    base = sandlot.Box(rootfs=debian_root, memory_mib=256, keep=True, engine=TEST_ENGINE)
    try:
        base.start()
        base.sh(COUNTERS)
        wait_counters(base)
        base.sh("sync")  # what the boot wrote lands in the layer all tests share, not in each box's own
        clean = base.snapshot("clean")
        base.stop()  # its VM would only take the two cores from the tests
        yield clean
        clean.remove()  # refused (SnapshotInUse) if a box started from it outlived its test
    finally:
        base.remove(force=True)


@contextlib.contextmanager
def box_from(clean: sandlot.Snapshot, **options: Any) -> Iterator[sandlot.Box]:
    """A running box restored from ``clean``; afterwards it is removed with the boxes and
    snapshots it made, and the home holds exactly what it held before."""
    boxes = {b.id for b in sandlot.list()}
    snaps = own_snapshots()
    [box] = clean.start(**options)
    try:
        yield box
    finally:
        for b in sandlot.list():
            if b.name.startswith(box.name):  # the box and its forks (named after it)
                b.remove(force=True)
        for s in sandlot.list_snapshots():
            if s.box_name == box.name:
                for k in sandlot.list():
                    if k.inspect()["origin"] == s.id:
                        k.remove(force=True)
                s.remove()
    assert {b.id for b in sandlot.list()} == boxes, "a box outlived its test"
    assert own_snapshots() == snaps, "a snapshot outlived its test"


def own_snapshots() -> set[str]:
    """The snapshots tests took: not the automatic templates of a root filesystem's first
    boot, which sandlot keeps for the boxes after it."""
    return {s.id for s in sandlot.list_snapshots() if not (s.kind == "template" and s.name is None)}


@pytest.fixture
def counting_box(clean_state: sandlot.Snapshot) -> Iterator[sandlot.Box]:
    with box_from(clean_state) as box:
        yield box


def test_snapshot_then_rollback_restores_memory_processes_and_disk(counting_box: sandlot.Box) -> None:
    box = counting_box
    box.files.write("/root/f", "before")
    snap = box.snapshot("s1")
    assert box.last_pause is not None and box.last_pause < 5
    at_snap = counters(box)
    assert box.state == "running"  # the box went on
    box.files.write("/root/f", "after")
    later = wait_past(box, at_snap, 3)
    box_id = box.id
    box.rollback(snap)
    assert box.id == box_id and box.state == "running"
    back = counters(box)
    assert back[0] < later[0] and back[1] < later[1], (at_snap, later, back)
    assert box.files.read_text("/root/f") == "before"
    wait_past(box, back, 0)  # the processes run on
    assert [s.name for s in box.snapshots()] == ["s1"]
    with pytest.raises(sandlot.InvalidArgument):
        box.snapshot("s1")  # names are unique per box


def test_suspend_then_resume_from_another_process(counting_box: sandlot.Box) -> None:
    box = counting_box
    t0 = time.monotonic()
    before = counters(box)
    box.suspend()
    suspended = time.monotonic()
    assert box.state == "suspended"
    assert box.inspect()["vm_pid"] is None
    r = py(f"""
        import time, sandlot
        b = sandlot.get({box.name!r})
        assert b.state == "suspended", b.state
        t = time.monotonic()
        b.resume()
        print(*b.sh("cat /tmp/sh-count; echo; cat /tmp/py-count").stdout.split(), t)
    """)
    read = time.monotonic()
    assert r.returncode == 0, r.stderr
    sh_count, py_count, resuming = r.stdout.split()
    after = (int(sh_count), int(py_count))
    assert after[0] >= before[0] and after[1] >= before[1]
    # continued, not restarted and not run while suspended
    assert after[0] <= before[0] + ticks_in(suspended - t0 + read - float(resuming))
    wait_past(box, after, 0)


def test_streams_reattach_after_suspend_and_exec_resumes_transparently(counting_box: sandlot.Box) -> None:
    box = counting_box
    echo = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n"
    proc = box.spawn("python3", "-u", "-c", echo)
    lines = proc.stdout.lines()
    proc.write_stdin(b"one\n")
    assert next(lines) == b"ONE\n"
    box.suspend()
    # the next command resumes the box by itself
    assert box.exec("echo", "hi").stdout == "hi\n"
    assert box.state == "running"
    proc.write_stdin(b"two\n")
    assert next(lines) == b"TWO\n"  # the same process, through the same stream
    proc.close_stdin()
    assert proc.wait(10) == 0


def test_fork_8_children_diverge(counting_box: sandlot.Box) -> None:
    box = counting_box
    kids = box.fork(8)
    assert len(kids) == 8
    box.sh("kill $(cat /tmp/sh.pid /tmp/py.pid)")
    facts = []
    # One call per child, which then stops its counters: nine boxes each forking
    # twenty processes a second would leave two cores little for the test itself.
    script = ("hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
              "date +%s; cat /tmp/sh-count; echo; cat /tmp/py-count; echo; "
              "kill $(cat /tmp/sh.pid /tmp/py.pid)")  # fmt: skip
    for i, k in enumerate(kids):
        k.files.write("/root/mine", f"child {i}")
        asked = time.time()
        out = k.sh(script).stdout.split()
        answered = time.time()
        facts.append(out)
        assert set_while_read(out[3], asked, answered), ("wall clock", asked, out[3], answered)
        assert int(out[4]) > 0 and int(out[5]) > 0  # the processes came along
    assert len({f[0] for f in facts}) == 8  # hostnames
    assert len({f[1] for f in facts}) == 8  # machine-ids
    assert len({f[2] for f in facts}) == 8  # RNG output
    for i, k in enumerate(kids):
        assert k.files.read_text("/root/mine") == f"child {i}"  # disks are separate
    # memory diverges too: a value set in one child's process is not in another's
    kids[0].sh("echo 1 > /tmp/only-here")
    assert kids[1].sh("test -e /tmp/only-here").returncode == 1
    # the snapshot behind them cannot go while they exist
    snap = sandlot.get_snapshot(kids[0].inspect()["origin"])
    with pytest.raises(sandlot.SnapshotInUse):
        snap.remove()
    for k in kids:
        k.remove(force=True)
    with pytest.raises(sandlot.SnapshotNotFound):  # a fork's own snapshot goes with its last child
        sandlot.get_snapshot(snap.id)


def test_cli_snapshot_commands(counting_box: sandlot.Box) -> None:
    box = counting_box

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sandlot.cli", *args], capture_output=True, text=True, timeout=120
        )

    r = cli("snapshot", box.name, "cli-snap")
    assert r.returncode == 0, r.stderr
    assert "cli-snap" in r.stdout and "paused" in r.stdout
    r = cli("snapshots", box.name)
    assert "cli-snap" in r.stdout
    r = cli("fork", box.name, "-n", "1", "--name", f"{box.name}-kid")
    assert r.returncode == 0, r.stderr
    kid = r.stdout.strip()
    snap_of_kid = sandlot.get(kid).inspect()["origin"]
    r = cli("snapshot", "rm", snap_of_kid)
    assert r.returncode == 125 and "started from it" in r.stderr  # refused, with the reason
    assert cli("suspend", box.name).returncode == 0
    assert sandlot.get(box.name).state == "suspended"
    assert cli("resume", box.name).returncode == 0
    assert cli("rollback", box.name, "cli-snap").returncode == 0
    assert min(counters(box)) > 0
    r = cli("snapshot", "rm", "cli-snap")
    assert r.returncode == 0, r.stderr


def test_template_starts_with_its_server_running(debian_root: Path) -> None:
    name = f"web-{os.urandom(3).hex()}"
    get = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/').read().decode())"
    # saved once the server answers (a fixed sleep was too short for a loaded host)
    tmpl = sandlot.template(
        rootfs=debian_root, memory_mib=256, name=name, engine=TEST_ENGINE,
        setup=["mkdir -p /srv && echo hello-from-template > /srv/index.html",
               "cd /srv && nohup python3 -m http.server 8000 >/dev/null 2>&1 &",
               f'for i in $(seq 300); do python3 -c "{get}" >/dev/null 2>&1 && exit; sleep .2; done; exit 1'],
    )  # fmt: skip
    try:
        assert tmpl.kind == "template"
        with sandlot.Box(template=name) as box:
            r = box.exec("python3", "-c", get)
            assert r.stdout == "hello-from-template\n\n", r.stderr
            assert box.inspect()["origin"] == tmpl.id
        with pytest.raises(sandlot.InvalidArgument):
            sandlot.Box(template=tmpl, memory_mib=1024)  # a template fixes the shape
        before = {b.id for b in sandlot.list()}
        with pytest.raises(sandlot.InvalidArgument):
            sandlot.Box(template=name, memory_mib=1024, keep=True).start()  # by name: when it is made
        assert {b.id for b in sandlot.list()} == before  # and nothing was left half made
    finally:
        tmpl.remove()


def test_a_box_that_frees_memory_leaves_its_templates_memory_file_as_saved(debian_root: Path) -> None:
    """Every box of a template maps its memory file copy-on-write. A guest that frees
    memory reports it (free page reporting), and QEMU 7.2 punched those pages out of the
    file itself: every other box of the template, and every later one, read zeros there
    and crashed (python3 died of SIGSEGV in the suite's boxes). The file stays as it was
    saved, and the freed memory still goes back to the host."""
    if TEST_ENGINE != "qemu":
        pytest.skip("QEMU's own: a gVisor box maps no memory file")
    tmpl = sandlot.template(rootfs=debian_root, memory_mib=256, name=f"frees-{os.urandom(3).hex()}")
    try:
        memory = Path(sandlot.Runtime.for_home().home) / "snapshots" / tmpl.id / "memory"

        def as_saved() -> tuple[int, int, str]:
            st = memory.stat()
            return st.st_mtime_ns, st.st_blocks, hashlib.sha256(memory.read_bytes()).hexdigest()

        before = as_saved()
        with sandlot.Box(template=tmpl) as box:
            freed = "x = bytearray(160 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\ndel x"
            assert box.exec("python3", "-c", freed).ok
            pid = int(box.inspect()["vm_pid"])
            # the guest reports what it freed within seconds; QEMU lets go of its copies
            deadline = time.monotonic() + 60
            while pss_mib(pid) > 120 and time.monotonic() < deadline:
                time.sleep(1)
            assert pss_mib(pid) <= 120, "the freed memory did not go back to the host"
        assert as_saved() == before  # not a page punched, not a byte changed
        with sandlot.Box(template=tmpl) as other:
            assert other.exec("python3", "-c", "print(6*7)").stdout == "42\n"
    finally:
        tmpl.remove()


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_plain_box_of_an_image_restores_its_automatic_template(debian_root: Path) -> None:
    tag = os.urandom(3).hex()
    ref = f"localhost/auto-tmpl-{tag}:1"
    # an image of its own (the label makes its digest unique): other tests import the
    # same tree under other names, and a digest's template lives as long as one of them
    sandlot.import_image(debian_root, ref, labels={"sandlot.test": tag})
    try:
        with sandlot.Box(ref, memory_mib=256, engine=TEST_ENGINE) as first:
            assert first.inspect()["origin"] is None  # booted
        templates = [s for s in sandlot.list_snapshots(kind="template") if s.box_name == first.name]
        assert len(templates) == 1
        with sandlot.Box(ref, memory_mib=256, engine=TEST_ENGINE) as second:
            assert second.inspect()["origin"] == templates[0].id  # restored, not booted
            if TEST_ENGINE == "qemu":  # it maps the template's memory copy-on-write, as an explicit one's do
                maps = Path(f"/proc/{second.inspect()['vm_pid']}/maps").read_text()
                assert f"/snapshots/{templates[0].id}/memory" in maps
            assert second.exec("hostname").stdout.strip() == second.hostname
            assert second.exec("python3", "-c", "print(6*7)").stdout == "42\n"
    finally:
        sandlot.remove_image(ref)  # its automatic template goes with it
    assert not [s for s in sandlot.list_snapshots(kind="template") if s.box_name == first.name]


def test_export_then_import_into_another_home(counting_box: sandlot.Box, other_home: Path,
                                              tmp_path: Path) -> None:  # fmt: skip
    box = counting_box
    box.files.write("/root/moved", "with the box")
    t0 = time.monotonic()
    before = counters(box)  # a lower bound of the counters the snapshot holds
    snap = box.snapshot("to-move")
    saved = time.monotonic()
    archive = snap.export(tmp_path / "box.sandlot")
    assert archive.is_file() and not list(tmp_path.glob(".*"))  # no temporary left
    importing = time.monotonic()
    moved = sandlot.import_snapshot(archive, home=other_home, name="moved")
    assert isinstance(moved, sandlot.Box)
    try:
        assert moved.state == "running"
        assert moved.files.read_text("/root/moved") == "with the box"
        c = counters(moved)
        most = ticks_in(saved - t0 + time.monotonic() - importing)  # from where the snapshot left them
        assert before[0] <= c[0] <= before[0] + most and before[1] <= c[1] <= before[1] + most
    finally:
        moved.remove(force=True)


def _rewrite(archive: Path, dest: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """Copy an archive, passing each (name, bytes) through ``edit``."""
    members = []
    with open(archive, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r, \
            tarfile.open(fileobj=r, mode="r|") as tar:  # fmt: skip
        for m in tar:
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            members.extend(edit(m.name, data))
    with open(dest, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w, \
            tarfile.open(fileobj=w, mode="w|") as tar:  # fmt: skip
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


@pytest.mark.skipif(TEST_ENGINE != "qemu", reason="version 1 archives predate engines: only QEMU wrote them")
def test_an_archive_of_format_version_1_still_imports(
    counting_box: sandlot.Box, other_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Archives written before engines were named (their compatibility facts QEMU's,
    at the top level) are read as they were written; so is a state saved before chunks,
    which exports as it did then (version 3: its memory and devices whole)."""
    monkeypatch.setenv("SANDLOT_STATE_CHUNKS", "0")  # saved as every sandlot before chunks saved it
    archive = counting_box.snapshot().export(tmp_path / "v3.sandlot")
    monkeypatch.delenv("SANDLOT_STATE_CHUNKS")

    def as_version_1(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if name == "manifest.json":
            m = json.loads(data)
            c = m["compat"]
            m["version"] = 1
            m["compat"] = {
                **c.pop("engine_facts"),
                "accel": c["accel"],
                "memory_mib": c["memory_mib"],
                "cpus": c["cpus"],
                "ports": c["agent_ports"],
                "kernel_sha256": c["kernel_sha256"],
            }
            data = json.dumps(m).encode()
        return [(name, data)]

    old = _rewrite(archive, tmp_path / "v1.sandlot", as_version_1)
    moved = sandlot.import_snapshot(old, home=other_home, name="from-v1")
    try:
        assert moved.state == "running" and min(counters(moved)) > 0
    finally:
        moved.remove(force=True)


@pytest.mark.skipif(TEST_ENGINE != "qemu", reason="damages QEMU's archive members (memory, devices)")
def test_import_rejects_damaged_altered_and_incompatible_archives(counting_box: sandlot.Box,
                                                                  tmp_path: Path) -> None:  # fmt: skip
    snap = counting_box.snapshot()
    archive = snap.export(tmp_path / "ok.sandlot")
    before = own_snapshots()

    flipped: list[str] = []

    def flip_memory(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if name.startswith("chunks/") and not flipped:  # a chunk of its memory (version 4)
            flipped.append(name)
            data = data[:-4] + bytes([data[-4] ^ 1]) + data[-3:]
        return [(name, data)]

    def incompatible(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if name == "manifest.json":
            m = json.loads(data)
            m["compat"]["engine_facts"]["qemu_version"] = "1.0.0"
            data = json.dumps(m).encode()
        return [(name, data)]

    def extra_member(name: str, data: bytes) -> list[tuple[str, bytes]]:
        return [(name, data)] + ([("../../etc/evil", b"x")] if name == "state" else [])

    def backing_file(name: str, data: bytes) -> list[tuple[str, bytes]]:
        return [(name, data)]

    cases = [
        (flip_memory, sandlot.CorruptSnapshot),
        (incompatible, sandlot.IncompatibleSnapshot),
        (extra_member, sandlot.CorruptSnapshot),
    ]
    for i, (edit, exc) in enumerate(cases):
        bad = _rewrite(archive, tmp_path / f"bad{i}.sandlot", edit)
        with pytest.raises(exc):
            sandlot.import_snapshot(bad)
    truncated = tmp_path / "short.sandlot"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(sandlot.CorruptSnapshot):
        sandlot.import_snapshot(truncated)
    (tmp_path / "junk.sandlot").write_bytes(b"not an archive")
    with pytest.raises(sandlot.CorruptSnapshot):
        sandlot.import_snapshot(tmp_path / "junk.sandlot")
    # a disk that points at a host file must never be opened
    evil = tmp_path / "evil.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", "/etc/shadow",
                    str(evil), "1G"], check=True)  # fmt: skip
    evil_bytes = evil.read_bytes()
    import hashlib

    def swap_disk(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if name == "manifest.json":
            m = json.loads(data)
            m["files"]["disk.qcow2"] = {
                "size": len(evil_bytes),
                "sha256": hashlib.sha256(evil_bytes).hexdigest(),
            }
            return [(name, json.dumps(m).encode())]
        return [(name, evil_bytes if name == "disk.qcow2" else data)]

    with pytest.raises(sandlot.CorruptSnapshot, match="backing file"):
        sandlot.import_snapshot(_rewrite(archive, tmp_path / "evil.sandlot", swap_disk))

    # an archive names no host directory to share: a box from it is given one, or none
    def share_host_dir(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if name == "manifest.json":
            m = json.loads(data)
            m["snapshot"]["box"]["volumes"] = [["/etc", "/host-etc", False]]
            data = json.dumps(m).encode()
        return [(name, data)]

    with pytest.raises(sandlot.SandlotError, match="its shares are malformed"):
        sandlot.import_snapshot(_rewrite(archive, tmp_path / "share.sandlot", share_host_dir))
    assert own_snapshots() == before  # nothing half-imported is visible


# -- kill -9 at several points -----------------------------------------------------------------


def crash_at(point: str, code: str) -> None:
    """Run ``code`` in a new process that is killed (SIGKILL) at crash point ``point``."""
    r = py(f"import sandlot\n{code}", env={"SANDLOT_CRASH_AT": point})
    assert r.returncode == -9, f"it did not die at {point}: {r.stderr}"


@pytest.mark.parametrize("point", ["snapshot.before-save", "mid-save", "snapshot.after-save"])
def test_kill9_mid_snapshot(counting_box: sandlot.Box, point: str) -> None:
    box = counting_box
    snaps_before = own_snapshots()
    if point == "mid-save" and TEST_ENGINE == "qemu":
        # inside QEMU's migration: the stream half taken apart, some of its chunks written
        crash_at("chunks.mid-write#5", f"sandlot.get({box.name!r}).snapshot('crash')")
    elif point == "mid-save":  # runsc's checkpoint of the paused sandbox (its relays ended)
        r = py(f"""
import os, sandlot
def die(*a, **k):
    os.kill(os.getpid(), 9)
from sandlot.engine.gvisor.vm import GvisorVM as VM; VM._unwatch = die
sandlot.get({box.name!r}).snapshot("crash")
""")
        assert r.returncode == -9, r.stderr
    else:
        crash_at(point, f"sandlot.get({box.name!r}).snapshot('crash')")
    b = sandlot.get(box.name)  # recovered: the VM goes on
    assert b.state == "running"
    c1 = wait_past(b, counters(b), 0)
    assert own_snapshots() == snaps_before  # no half snapshot visible
    snap = b.snapshot("crash")  # and the name was never taken
    b.rollback(snap)
    assert counters(b)[0] >= c1[0]


def test_kill9_mid_suspend_and_mid_resume(counting_box: sandlot.Box) -> None:
    box = counting_box
    crash_at("suspend.before-save", f"sandlot.get({box.name!r}).suspend()")
    assert sandlot.get(box.name).state == "running"  # the suspend never happened
    crash_at("suspend.after-save", f"sandlot.get({box.name!r}).suspend()")
    assert sandlot.get(box.name).state == "suspended"  # saved and recorded: recovery finished it
    crash_at("restore.after-launch", f"sandlot.get({box.name!r}).resume()")
    b = sandlot.get(box.name)
    if TEST_ENGINE == "qemu":  # QEMU loads the state stopped: the guest has not run
        assert b.state == "suspended"  # and its saved state still holds
    else:  # runsc restore runs what it loads: recovery finishes the resume
        assert b.state == "running"
    b.resume()
    assert min(counters(b)) > 0


def test_kill9_mid_rollback_and_mid_fork(counting_box: sandlot.Box) -> None:
    box = counting_box
    box.files.write("/root/f", "kept")
    snap = box.snapshot("base")
    crash_at("restore.after-launch", f"sandlot.get({box.name!r}).rollback({snap.id!r})")
    b = sandlot.get(box.name)
    if TEST_ENGINE == "qemu":  # the loaded guest never ran: the old VM was ended, the disk is as it was
        assert b.state == "stopped"
    else:  # runsc restore runs what it loads: recovery finishes the rollback
        assert b.state == "running" and b.files.read_text("/root/f") == "kept"
    b.rollback(snap)  # and the snapshot still works
    assert b.files.read_text("/root/f") == "kept"
    names_before = {x.name for x in sandlot.list()}
    snaps_before = own_snapshots()
    crash_at("fork.child-start#2", f"sandlot.get({box.name!r}).fork(3)")
    assert {x.name for x in sandlot.list()} == names_before  # half-made children are gone
    assert own_snapshots() == snaps_before  # and the fork's own snapshot


def test_kill9_mid_export_leaves_no_file(counting_box: sandlot.Box, tmp_path: Path) -> None:
    """No archive appears, and the hidden parts it was writing beside it are gone after
    the next operation on the home: here, a listing by another process."""
    snap = counting_box.snapshot("exp")
    crash_at(
        "export.mid-write", f"sandlot.get_snapshot({snap.id!r}).export({str(tmp_path / 'out.sandlot')!r})"
    )
    assert not (tmp_path / "out.sandlot").exists()
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob(".out.sandlot.*")) == [
        ".out.sandlot.parts", ".out.sandlot.tmp"]  # fmt: skip
    listed = subprocess.run([sys.executable, "-m", "sandlot.cli", "ls"], capture_output=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert list(tmp_path.glob(".out.sandlot.*")) == []
    assert sandlot.get_snapshot(snap.id).export(tmp_path / "out.sandlot").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out.sandlot"]


def test_idle_timeout_suspends_and_the_next_command_resumes(clean_state: sandlot.Snapshot) -> None:
    with box_from(clean_state, idle_timeout=4) as box:
        # a command in flight keeps it awake, however long
        assert box.exec("sleep", "6").returncode == 0
        assert box.state == "running"
        # within its idle timeout, the watchdog's poll and a save; more under a loaded host
        deadline = time.monotonic() + 45
        while box.state != "suspended":
            assert time.monotonic() < deadline, f"an idle box was not suspended: {told(box)}"
            time.sleep(0.2)
        assert box.inspect()["vm_pid"] is None
        c = counters(box)  # resumes by itself, processes intact
        assert min(c) > 0 and box.state == "running"
        deadline = time.monotonic() + 45
        while box.state != "suspended":  # and it sleeps again once idle
            assert time.monotonic() < deadline, f"the box was not suspended a second time: {told(box)}"
            time.sleep(0.2)


@pytest.mark.skipif(TEST_ENGINE != "qemu", reason="QEMU's fork preparation (copy-on-write memory)")
def test_kill9_mid_fork_preparation_then_fork_works(counting_box: sandlot.Box) -> None:
    snap = counting_box.snapshot("prep")
    r = py(
        f"""
import os, sandlot
from sandlot.engine.qemu.vm import QemuVM
orig = QemuVM.save_state
async def save_state(self, path, *, ignore_shared=False, **k):
    if ignore_shared:  # the helper VM writing the copy-on-write form
        os.kill(os.getpid(), 9)
    return await orig(self, path, ignore_shared=ignore_shared, **k)
QemuVM.save_state = save_state
sandlot.get_snapshot({snap.id!r}).start(2)
"""
    )
    assert r.returncode == -9, r.stderr
    kids = sandlot.get_snapshot(snap.id).start(2)  # prepared again from the intact stream
    try:
        assert all(min(counters(k)) > 0 for k in kids)
    finally:
        for k in kids:
            k.remove(force=True)


def test_a_damaged_saved_state_fails_clearly_and_loses_nothing(counting_box: sandlot.Box) -> None:
    box = counting_box
    snap = box.snapshot("damaged")
    # a chunk of its memory (on gVisor, of its checkpoint), checked against its hash as it is read
    assert not any(Path(snap.inspect()["path"]).iterdir())  # nothing but chunks holds the state
    state = memory_chunks(snap.id)[len(memory_chunks(snap.id)) // 2]
    why = f"saved state {snap.id}: its chunk {state.parent.name + state.name} is damaged"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 3])  # as a failing disk might
    names = {b.name for b in sandlot.list()}
    with pytest.raises(sandlot.CorruptSnapshot, match=why):
        snap.start()
    assert {b.name for b in sandlot.list()} == names  # the half-started child is gone
    assert not state.exists()  # the damaged chunk was put aside: a save that holds it writes it again
    state.write_bytes(good[: len(good) // 3])
    with pytest.raises(sandlot.CorruptSnapshot, match=why):
        box.rollback(snap)
    state.write_bytes(good)  # the chunk may be another state's too (the home's tests share it)
    b = sandlot.get(box.name)
    assert b.state == "stopped" and "rollback failed" in (b.inspect()["reason"] or "")
    b.start()  # the disk was kept: a cold boot works
    assert b.exec("true").returncode == 0


def test_restarts_of_a_box_with_a_long_snapshot_history_never_time_out(busybox_root: Path) -> None:
    """A box with ten snapshots (a twelve-layer disk chain), stopped and started
    twelve times: every start answers. (Starts used to time out now and then when
    the agent began serving before the guest kernel had registered all its ports.)"""
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True).start()
    try:
        for i in range(10):
            box.exec("sh", "-c", f"echo {i} > /root/gen")
            box.snapshot()
        for i in range(12):
            box.stop()
            box.start()
            assert box.exec("cat", "/root/gen").stdout == "9\n", f"restart {i}"
        assert "only" not in box.logs()  # the agent found every port it was told of
    finally:
        snaps = box.snapshots()
        box.remove(force=True)
        for s in snaps:  # a removed box's snapshots stay in the home until removed themselves
            s.remove()
