"""VMs that no home owns (``core.orphans``) and a home's watcher (``core.homewatch``):
the engines know their VMs' command lines; the core lists a VM whose home was
removed, or whose home has no row for it, and never one its home owns; the
watcher, a real process here, ends the VMs of a removed home within seconds and
leaves every other VM alone. The VMs are fake ones (the fake engine's, handed in
as processes) and real processes whose command lines read like QEMU's."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot import pids
from sandlot.config import try_flock
from sandlot.core import homewatch, orphans
from sandlot.core.orphans import Why
from sandlot.core.runtime import Runtime
from sandlot.core.store import BoxRecord
from sandlot.engine.base import VMRef
from sandlot.engine.gvisor import GvisorEngine
from sandlot.engine.qemu.command import VMConfig, build_command, state_dir_of

from tests.support.fake_engine import FakeEngine, process_of, register

register()
# A watcher, here a real process, ends the VMs of any removed home of this user, and some
# of these tests' processes stand for VMs of removed homes: so that one test's watcher
# never ends another's, they all run in one worker (scripts/test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("homewatch")


# -- the engines know their VMs ---------------------------------------------------------------


def test_a_qemu_command_line_names_the_state_dir_it_was_built_with(tmp_path: Path) -> None:
    state = tmp_path / "a,home" / "boxes" / "b1"  # a comma, doubled on the command line
    cfg = VMConfig(kernel=Path("/k"), initrd=Path("/i"), disk=Path("/d"), run_dir=tmp_path / "run",
                   state_dir=state, hostname="web")  # fmt: skip
    assert state_dir_of(build_command(cfg, "qemu-system-x86_64")) == state
    unnamed = ["qemu-system-x86_64", "-name", "other", "-chardev", f"file,id=console,path={state}"]
    assert state_dir_of(unnamed) is None
    assert state_dir_of(["vim", str(state / "console.log")]) is None


def test_a_gvisor_sandbox_is_found_through_the_runsc_that_runs_it(tmp_path: Path) -> None:
    state = tmp_path / "home" / "boxes" / "3f45e4068974"
    log, cid = f"--log={state}/runsc.log", "sandlot-3f45e4068974"
    runner = ["/usr/bin/runsc", "--root=/tmp/sandlot-0/runsc", "--platform=ptrace", log, "run", cid]
    execs = ["/usr/bin/runsc", "--root=/tmp/sandlot-0/runsc", log, "exec", cid, "/.sandlot/sandlot-agent"]
    engine = GvisorEngine(tmp_path / "home")
    me, start = pids.me()
    assert engine.vm_of(pids.Process(me, start, runner)) is None  # no sandbox under it
    # this process stands for the runsc, with a child whose command line is a sandbox's
    sandbox = subprocess.Popen(["bash", "-c", "exec -a runsc-sandbox sleep 60"])
    try:
        deadline = time.monotonic() + 5
        while pids.cmdline(sandbox.pid)[:1] != ["runsc-sandbox"] and time.monotonic() < deadline:
            time.sleep(0.01)
        ref = VMRef(sandbox.pid, pids.start_time(sandbox.pid) or "")
        assert engine.vm_of(pids.Process(me, start, runner)) == (ref, state)
        assert engine.vm_of(pids.Process(me, start, execs)) is None  # a command run in the box
        assert engine.vm_of(pids.Process(me, start, [*runner[:3], "run", cid])) is None  # another log
    finally:
        sandbox.kill()
        sandbox.wait()


# -- the core's list, on the fake engine ------------------------------------------------------


def with_a_box(home: Path, root: Path, check: Callable[[Runtime, BoxRecord], None]) -> None:
    """``check`` a running box of ``home``'s (its row), in the event loop its fake VM lives in."""

    async def main() -> None:
        await sandlot.AsyncBox(rootfs=root, engine="fake", name="b", keep=True, home=home).start()
        rt = Runtime.for_home(home)
        [rec] = rt.store.list()
        check(rt, rec)

    asyncio.run(main())


def the_processes(home: Path) -> list[pids.Process]:
    return [process_of(vm) for vm in FakeEngine.of(home).vms.values()]


def test_a_vm_its_home_owns_is_no_orphan(home: Path, root: Path) -> None:
    def check(rt: Runtime, rec: BoxRecord) -> None:
        [found] = orphans.box_vms(rt, the_processes(home))
        assert (found.home, found.box_id, found.engine, found.ref) == (home, rec.id, "fake", rec.vm)
        assert orphans.find(rt, the_processes(home)) == []

    with_a_box(home, root, check)


def test_a_vm_whose_row_is_gone_is_listed_and_ended_with_what_it_left(home: Path, root: Path) -> None:
    def check(rt: Runtime, rec: BoxRecord) -> None:
        rt.store.delete(rec.id)
        [o] = orphans.find(rt, the_processes(home))
        assert (o.why, o.box.box_id, o.box.ref) == (Why.NO_ROW, rec.id, rec.vm)
        assert o.to_json()["pid"] == rec.vm_pid and not o.to_json()["home_removed"]
        assert rt.run_dir(rec.id).is_dir()
        assert orphans.end([o], rt) == [o]
        assert FakeEngine.of(home).vms == {}
        assert not rt.run_dir(rec.id).exists()  # its sockets: no other VM of the box has them
        assert orphans.end([o], rt) == []  # ended already

    with_a_box(home, root, check)


def test_a_vm_its_box_row_does_not_name_is_listed_and_its_box_keeps_its_files(home: Path, root: Path) -> None:
    def check(rt: Runtime, rec: BoxRecord) -> None:
        other = pids.me()
        rt.store.update(rec.id, vm_pid=other[0], vm_start=other[1])  # the row names another process
        [o] = orphans.find(rt, the_processes(home))
        assert o.why is Why.NOT_ITS_ROW
        orphans.end([o], rt)
        assert FakeEngine.of(home).vms == {}
        assert rt.run_dir(rec.id).is_dir()  # the VM the row names uses them

    with_a_box(home, root, check)


def test_a_vm_of_a_removed_home_is_listed_and_an_unreadable_store_proves_nothing(
    home: Path, root: Path, tmp_path: Path
) -> None:
    def check(rt: Runtime, rec: BoxRecord) -> None:
        rt.store.delete(rec.id)
        for f in home.glob("sandlot.db*"):  # with its WAL, which would hold its pages
            f.rename(tmp_path / f.name)
        (home / "sandlot.db").write_bytes(b"not a database".ljust(4096, b"!"))
        assert orphans.find(rt, the_processes(home)) == []
        shutil.rmtree(home)
        [o] = orphans.find(rt, the_processes(home))
        assert o.why is Why.HOME_REMOVED and o.to_json()["home_removed"]

    with_a_box(home, root, check)


def test_a_home_is_gone_only_once_its_store_is(tmp_path: Path) -> None:
    home = tmp_path / "h"
    assert orphans.home_gone(home)
    home.mkdir()
    assert orphans.home_gone(home)  # a home that never had a store ran no VM
    (home / "sandlot.db").touch()
    assert not orphans.home_gone(home)
    home.chmod(0)
    try:  # a directory that cannot be read proves nothing (root reads it anyway)
        assert not orphans.home_gone(home)
    finally:
        home.chmod(0o755)


# -- real processes, and the watcher ----------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def like_qemu(started: list[subprocess.Popen[bytes]], home: Path, box_id: str) -> subprocess.Popen[bytes]:
    """A process whose command line reads as that of a QEMU of ``home``'s box ``box_id``,
    returned once it runs: right after ``Popen`` its execve may not have laid that command
    line out yet (a process without one is skipped by a scan, and is anyone's VM to
    ``pids.alive_as``)."""
    console = home / "boxes" / box_id / "console.log"
    argv = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)",
            "-name", f"sandlot-{box_id}", "-chardev", f"file,id=console,path={console}"]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


def a_home(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "sandlot.db").touch()
    return path


def test_a_process_of_a_removed_home_is_found_on_the_host(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    p = like_qemu(processes, tmp_path / "removed", "b1")
    mine = [o for o in orphans.find(Runtime.for_home(tmp_path / "h")) if o.box.home == tmp_path / "removed"]
    assert [(o.box.ref.pid, o.box.box_id, o.box.engine, o.why) for o in mine] == [
        (p.pid, "b1", "qemu", Why.HOME_REMOVED)
    ]
    assert (mine[0].rss_bytes or 0) > 1 << 20


def watcher(home: Path) -> subprocess.Popen[bytes]:
    w = subprocess.Popen([sys.executable, "-m", homewatch.MODULE, str(home)], cwd="/")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and w.poll() is None:
        fd = try_flock(homewatch.watch_lock(home))
        if fd is None:
            return w  # it holds its lock: it watches
        os.close(fd)
        time.sleep(0.02)
    raise AssertionError(f"the watcher did not take its lock (exit status {w.poll()})")


def test_the_watcher_ends_the_vms_of_its_removed_home_and_no_other(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    gone, kept = a_home(tmp_path / "gone"), a_home(tmp_path / "kept")
    a, b = like_qemu(processes, gone, "a1"), like_qemu(processes, gone, "a2")
    other = like_qemu(processes, kept, "k")
    w = watcher(gone)
    time.sleep(0.2)
    assert a.poll() is None and b.poll() is None and w.poll() is None
    shutil.rmtree(gone)
    a.wait(timeout=30)  # within a second, on a quiet host
    b.wait(timeout=30)
    assert a.returncode == -signal.SIGKILL
    w.wait(timeout=30)
    assert w.returncode == 0
    assert other.poll() is None  # its home is there


def test_a_new_watcher_ends_the_vms_of_a_home_removed_while_none_watched(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    left = like_qemu(processes, tmp_path / "removed-earlier", "x")  # no home, no watcher
    home = a_home(tmp_path / "h")
    mine = like_qemu(processes, home, "m")
    w = watcher(home)
    left.wait(timeout=30)
    assert mine.poll() is None and w.poll() is None
    mine.kill()
    w.send_signal(signal.SIGTERM)
    w.wait()


def test_a_watcher_of_a_home_without_vms_exits_and_one_per_home_runs(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    home = a_home(tmp_path / "h")
    idle = subprocess.Popen([sys.executable, "-m", homewatch.MODULE, str(home)], cwd="/")
    idle.wait(timeout=30)
    assert idle.returncode == 0
    like_qemu(processes, home, "m")
    w = watcher(home)
    second = subprocess.Popen([sys.executable, "-m", homewatch.MODULE, str(home)], cwd="/")
    second.wait(timeout=30)  # the home has its watcher
    assert w.poll() is None
    w.send_signal(signal.SIGTERM)
    w.wait()


def test_a_store_made_again_at_once_is_no_removed_home(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    home = a_home(tmp_path / "h")
    vm = like_qemu(processes, home, "m")
    w = watcher(home)
    (home / "sandlot.db").unlink()  # as a tool that rewrites the store does: the home is there
    time.sleep(0.15)  # the watcher sees it missing; less than homewatch.CONFIRM_S
    (home / "sandlot.db").touch()
    time.sleep(homewatch.CONFIRM_S + 1.0)
    assert vm.poll() is None and w.poll() is None
    w.send_signal(signal.SIGTERM)
    w.wait()


def test_kill_now_returns_once_the_vm_is_gone_and_spares_what_is_not_the_box(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Recovery removes a killed VM's files and reports the box gone right after
    ``kill_now``: the VM must be gone by then, not still tearing its memory down."""
    home = a_home(tmp_path / "h")
    engine = Runtime.for_home(home).engine("qemu")
    p = like_qemu(processes, home, "k1")
    ref = VMRef(p.pid, pids.start_time(p.pid) or "")
    assert pids.wait_gone(p.pid, ref.start, 0.05) is False  # alive: the wait ends at its timeout
    engine.kill_now(ref, "k2")  # not that box's VM: left alone
    assert pids.alive(p.pid, ref.start)
    engine.kill_now(ref, "k1")
    assert not pids.alive(p.pid, ref.start)  # no sleep: gone when kill_now returns
    assert p.wait(timeout=5) == -signal.SIGKILL
