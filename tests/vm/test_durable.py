"""Durable boxes: boxes outlive their process, are found again from others, and
every crash (kill -9 of Python or of QEMU, at several points) is reconciled. A kill
mid-create, before any VM exists, is tests/unit/test_lifecycle.py's (fake engine)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.support.clock import set_while_read
from tests.support.names import unique
from tests.support.waiting import scaled, wait_for

pytestmark = pytest.mark.vm
DURABLE_1 = unique("durable-1")
SHARED_1 = unique("shared-1")
STOP_CRASH = unique("stop-crash")
QEMU_CRASH = unique("qemu-crash")
START_CRASH = unique("start-crash")
RACE_1 = unique("race-1")
OWNER_CRASH = unique("owner-crash")


def py(
    code: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run Python in a separate process with the same sandlot home (``env``: added to ours)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def test_create_exec_stop_start_across_processes(busybox_root: Path) -> None:
    """A box outlives the process that made it; another stops it, a third starts it
    again; what each wrote (a shell's write too, never synced by hand) is on its disk,
    which was unmounted cleanly."""
    r = py(f"""
        import sandlot
        b = sandlot.create(rootfs={str(busybox_root)!r}, name={DURABLE_1!r}, memory_mib=256,
                           labels={{"t": "durable"}})
        b.start()
        b.files.write("/root/from-a", "written by process A")
        print(b.id, b.accel)  # known right after the start
    """)
    assert r.returncode == 0, r.stderr
    box_id, accel = r.stdout.split()
    try:
        assert sandlot.get(DURABLE_1).state == "running"  # the box outlived process A
        assert accel == sandlot.get(box_id).accel == sandlot.get(DURABLE_1).inspect()["accel"]
        assert accel in ("kvm", "tcg")
        r = py(f"""
            import sandlot
            b = sandlot.get({DURABLE_1!r})
            print(b.files.read_text("/root/from-a"))
            b.sh("echo from-b > /root/from-b")  # written, not synced by hand
            b.stop()
            print(b.state, b.running)
            try:
                b.exec("true")  # the handle that stopped it, whose session knew it running
            except sandlot.InvalidState:
                print("refused")
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:3] == ["written by process A", "stopped False", "refused"]
        with pytest.raises(sandlot.InvalidState):
            sandlot.get(DURABLE_1).exec("true")
        r = py(f"""
            import sandlot
            b = sandlot.get({box_id[:6]!r})  # an id prefix works too
            b.start()
            print(b.exec("cat", "/root/from-a", "/root/from-b").stdout, end="")
            # the root filesystem was unmounted cleanly: no journal recovery on this boot
            print("recovery" in b.exec("dmesg").stdout.lower())
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "written by process Afrom-b\nFalse\n"
        box = sandlot.get(DURABLE_1)
        assert box.state == "running" and box.inspect()["labels"] == {"t": "durable"}
        assert [b.name for b in sandlot.list(labels={"t": "durable"})] == [DURABLE_1]
    finally:
        sandlot.get(DURABLE_1).remove(force=True)
    with pytest.raises(sandlot.BoxNotFound):
        sandlot.get(DURABLE_1)


def test_kill9_mid_stop_reconciles_to_stopped(busybox_root: Path) -> None:
    box = sandlot.create(rootfs=busybox_root, name=STOP_CRASH, memory_mib=256)
    try:
        box.start()
        box.files.write("/root/keep", "kept")
        box.exec("sync")
        qemu_pid = box.inspect()["vm_pid"]
        r = py(
            f"""
            import sandlot
            sandlot.get({STOP_CRASH!r}).stop()
        """,
            env={"SANDLOT_CRASH_AT": "stop.before-shutdown"},
        )
        assert r.returncode == -9
        b = sandlot.get(STOP_CRASH)  # reconciles: the stopper died, QEMU is made to follow
        assert b.state == "stopped"
        last = list(b.events(follow=False))[-1]  # said by the recovery that did it
        assert (last.kind, last.by, last.detail["was"]) == ("stopped", "recovery", "stopping"), last
        wait_only_running_vms()
        assert qemu_pid not in vms_left()
        b.start()
        assert b.files.read("/root/keep") == b"kept"
    finally:
        box.remove(force=True)


def test_kill9_of_qemu_is_a_crash_with_a_reason_and_a_killed_box_starts_again(busybox_root: Path) -> None:
    # booted, not restored from the tree's template: what the guest last said is its boot
    box = sandlot.create(rootfs=busybox_root, name=QEMU_CRASH, memory_mib=256, template=False)
    try:
        box.start()
        proc = box.spawn("sleep", "1000")
        os.kill(box.inspect()["vm_pid"], signal.SIGKILL)
        with pytest.raises((sandlot.BoxCrashed, sandlot.ConnectionLost)):
            proc.wait(timeout=scaled(20))
        # its last thread can take a moment to end (it is alive as ours until then)
        wait_for("the box seen crashed", lambda: sandlot.get(QEMU_CRASH).state == "crashed", 30)
        rec = sandlot.get(QEMU_CRASH).inspect()
        assert rec["state"] == "crashed" and "unexpectedly" in rec["reason"]
        crash = list(box.events(follow=False))[-1]  # with the reason and what the guest last said
        assert crash.kind == "crashed" and crash.reason == rec["reason"] and crash.detail["console"], crash
        with pytest.raises(sandlot.InvalidState, match="crashed"):
            box.exec("true")
        box.start()  # a crashed box starts again, disk intact
        assert box.exec("true").ok and box.state == "running"
        box.files.write("/root/before-kill", "x")
        box.exec("sync")
        box.kill()  # pull the plug
        assert box.state == "stopped"
        box.start()
        assert box.files.read("/root/before-kill") == b"x"
    finally:
        box.remove(force=True)


def test_kill9_of_the_owner_mid_start(busybox_root: Path) -> None:
    r = py(
        f"""
        import sandlot
        sandlot.create(rootfs={str(busybox_root)!r}, name={START_CRASH!r}, memory_mib=256,
                       template=False).start()  # a boot: its crash point is the launch's
    """,
        env={"SANDLOT_CRASH_AT": "start.after-launch"},
    )
    assert r.returncode == -9
    b = sandlot.get(START_CRASH)
    try:
        assert b.state in ("running", "crashed")  # the VM went on alone, or died: never "starting"
        wait_only_running_vms()
        b.stop()
        b.start()
        assert b.exec("echo", "ok").stdout == "ok\n"
    finally:
        b.remove(force=True)


def vms_left(home: Path | None = None) -> dict[int, str]:
    """The VM processes on this host launched for a box of ``home`` (default: the tests'),
    by pid: what the box's id is."""
    from sandlot.core.orphans import box_vms
    from sandlot.core.runtime import Runtime

    rt = Runtime.for_home(home)
    return {b.ref.pid: b.box_id for b in box_vms(rt) if b.home == rt.home}


def running_vms(home: Path | None = None) -> dict[int, str]:
    """The VMs the rows of ``home`` say run: a running or paused box's, a warm pool's."""
    from sandlot.core.runtime import Runtime

    rows = Runtime.for_home(home).store.list()
    return {r.vm_pid: r.id for r in rows if r.state in ("running", "paused", "pooled") and r.vm_pid}


def wait_only_running_vms(home: Path | None = None) -> None:
    """Within 5 s (what recovery killed is gone moments after its SIGKILL), the VMs left
    for ``home`` are exactly those its rows say run."""
    wait_for("only the running boxes' VMs", lambda: vms_left(home) == running_vms(home), 5)


@pytest.mark.parametrize(
    ("point", "operation"),
    [
        ("restore.after-launch", "b.rollback(b.snapshot('s'))"),
        ("fork.child-start", "b.fork(2)"),
        ("suspend.after-save", "b.suspend()"),
        ("snapshot.after-save", "b.snapshot('t')"),
    ],
)
def test_kill9_of_the_owner_mid_operation_leaves_no_vm_past_the_next_listing(
    point: str, operation: str, busybox_root: Path
) -> None:
    """The owner of an operation that launches or saves a VM killed midway: the next
    ``sandlot ls`` (any call that reads the boxes) reconciles them, and then exactly the
    VMs of the boxes it shows running are left, none of the operation's half."""
    box = sandlot.Box(rootfs=busybox_root, name=OWNER_CRASH, memory_mib=256, keep=True).start()
    try:
        r = py(
            f"import sandlot\nb = sandlot.get({OWNER_CRASH!r})\n{operation}\n",
            env={"SANDLOT_CRASH_AT": point},
        )
        assert r.returncode == -9, r.stderr
        listing = subprocess.run([sys.executable, "-m", "sandlot.cli", "ls", "-a"], capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
        assert listing.returncode == 0 and OWNER_CRASH in listing.stdout, listing.stderr
        wait_only_running_vms()  # SIGKILL sent before the listing returned
        assert sandlot.get(OWNER_CRASH).state in ("running", "stopped", "suspended")
    finally:
        for b in sandlot.list(all=True):
            if b.name.startswith(OWNER_CRASH):
                b.remove(force=True)
        box.remove(force=True)


@pytest.mark.parametrize("point", ["snapshot.before-save", "snapshot.after-save", "restore.after-launch"])
def test_kill9_of_the_owner_while_a_trees_template_is_saved_or_restored(
    point: str, busybox_root: Path, tmp_path: Path
) -> None:
    """The first box of a root filesystem saves its boot as the tree's template before its
    start returns; the boxes after it restore that. The owner killed at either step leaves
    no half-saved template in sight, and the next box of the tree starts (from a whole
    template, or by booting)."""
    from tests.support.serve import shared_home

    home = shared_home(tmp_path)  # this tree's first boot in it
    env = {"SANDLOT_HOME": str(home)}
    make = f"import sandlot\nsandlot.Box(rootfs={str(busybox_root)!r}, memory_mib=256, keep=True).start()\n"
    if point == "restore.after-launch":  # a template saved whole first, then a box from it
        assert py(make, env=env).returncode == 0
    r = py(make, env={**env, "SANDLOT_CRASH_AT": point})
    assert r.returncode == -9, r.stderr
    templates = sandlot.list_snapshots(kind="template", home=home)
    sandlot.list(home=home)  # reconciles: the killed start's VM, if any, is a box's or gone
    wait_only_running_vms(home)
    # a save cut short leaves no template (its row is written last); a restore's stays
    assert len(templates) == (point == "restore.after-launch"), templates
    for t in templates:  # whole: a box restores it
        assert t.name is None and t.info["size"] > 0
    r = py(f"{make}print(sandlot.list(home={str(home)!r})[-1].exec('echo', 'ok').stdout, end='')", env=env)
    assert (r.returncode, r.stdout) == (0, "ok\n"), r.stderr
    for b in sandlot.list(home=home):
        b.remove(force=True)


def test_volumes_read_write_and_read_only(busybox_root: Path, tmp_path: Path) -> None:
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    (ro / "data.txt").write_text("from the host\n")
    with sandlot.Box(
        rootfs=busybox_root, memory_mib=256, volumes=[f"{rw}:/mnt/rw", (str(ro), "/mnt/ro", "ro")]
    ) as box:
        assert box.exec("cat", "/mnt/ro/data.txt").stdout == "from the host\n"
        assert box.sh("echo from-the-guest > /mnt/rw/out.txt").ok
        assert (rw / "out.txt").read_text() == "from-the-guest\n"
        (rw / "live.txt").write_text("changed on the host")
        assert box.exec("cat", "/mnt/rw/live.txt").stdout == "changed on the host"
        r = box.sh("echo no > /mnt/ro/new.txt")
        assert r.exit_code != 0 and "Read-only" in r.stderr
        assert not (ro / "new.txt").exists()
        box.restart()  # volumes come back after a reboot
        assert box.exec("cat", "/mnt/ro/data.txt").stdout == "from the host\n"


def test_concurrent_starts_of_one_box_boot_it_once(busybox_root: Path) -> None:
    box = sandlot.create(rootfs=busybox_root, name=RACE_1, memory_mib=256)
    try:
        errors: list[BaseException] = []

        def start() -> None:
            try:
                sandlot.get(RACE_1).start()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        assert box.state == "running" and box.exec("true").ok
    finally:
        box.remove(force=True)


# -- one box for the tests that need nothing more (after the crash tests: an idle TCG guest
# still takes CPU time from their boots) ---------------------------------------------------


@pytest.fixture(scope="module")
def shared(busybox_root: Path) -> Iterator[sandlot.Box]:
    """One running box for the tests that need nothing more (each leaves it as it was):
    booted once, not once a test (and booted, not restored: its console holds its boot)."""
    with sandlot.Box(rootfs=busybox_root, name=SHARED_1, memory_mib=256, template=False) as box:
        yield box


def test_two_processes_exec_in_one_box_at_once(shared: sandlot.Box) -> None:
    slow = shared.spawn("sh", "-c", "sleep 2; echo main-done")
    t0 = time.monotonic()
    r = py(f"""
        import sandlot
        b = sandlot.get({SHARED_1!r})
        print(b.exec("echo", "other-process").stdout, end="")
        print(b.exec("sh", "-c", "echo $$").stdout, end="")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("other-process\n")
    assert time.monotonic() - t0 < scaled(30)
    assert slow.result().stdout == "main-done\n"  # ours was undisturbed


def test_pause_unpause(shared: sandlot.Box) -> None:
    box = shared
    box.sh(
        "(while true; do date +%s >> /tmp/ticks; sleep 0.2; done) >/dev/null 2>&1 & echo $! > /tmp/ticks.pid"
    )

    def ticks() -> list[int]:
        return [int(t) for t in box.sh("cat /tmp/ticks 2>/dev/null").stdout.split()]

    wait_for("a tick before the pause", lambda: len(ticks()) >= 2)
    box.pause()
    assert box.state == "paused"
    with pytest.raises(sandlot.InvalidState, match="paused"):
        box.exec("true")
    time.sleep(2)
    box.unpause()
    asked = time.time()
    now = box.exec("date", "+%s").stdout
    assert set_while_read(now, asked, time.time()), (asked, now)  # the clock was set again
    # nothing ran while paused: the first tick after it is 2 s past the last before it
    wait_for("a tick after the pause", lambda: max(b - a for a, b in itertools.pairwise(ticks())) >= 2, 30)
    assert box.exec("echo", "back").stdout == "back\n"
    box.sh("kill $(cat /tmp/ticks.pid); rm /tmp/ticks /tmp/ticks.pid", check=True)


def test_stats_logs_inspect(shared: sandlot.Box) -> None:
    box = shared
    box.exec("sh", "-c", "head -c 8388608 /dev/urandom > /root/f; sync")  # zeros would not be stored
    s = box.stats()
    assert s["cpu_seconds"] > 0 and s["rss_bytes"] > 32 << 20 and s["disk_bytes"] >= 8 << 20
    assert "sandlot-agent: ready" in box.logs()
    info = box.inspect()
    assert info["name"] == SHARED_1 and info["state"] == "running" and Path(info["paths"]["disk"]).exists()
    box.sh("rm /root/f", check=True)


def test_a_port_opened_while_the_box_idles_is_seen_from_its_sigio(shared: sandlot.Box) -> None:
    """An idle agent checks its ports on a timer that backs off to every 8 s; a host
    opening or closing one raises SIGIO in the guest, which is how the agent learns of
    it at once. Other processes, each on a port of its own, come and go after the box
    idled: the agent never found one by its timer (it says so on the console if it does)."""
    box = shared
    said_before = len(box.logs())
    time.sleep(16)  # idle: the timer is at 8 s
    code = f"import sandlot; print(sandlot.get({box.id!r}).exec('echo', 'other').stdout, end='')"
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stdout) == (0, "other\n"), r.stderr
        time.sleep(1)
    assert box.exec("echo", "mine").stdout == "mine\n"
    assert "without SIGIO" not in box.logs()[said_before:]
