"""Recovery, row by row: each rule of ``core.recovery.TABLE`` is matched by a
case built in a real store (its owner alive or dead, its VM a fake one in a
given status), and carried out. A rule added without a case fails here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandlot import pids
from sandlot.core import recovery
from sandlot.core.runtime import Runtime
from sandlot.core.state import BoxState
from sandlot.core.store import BoxRecord
from sandlot.engine.base import Placement, VMStatus

from tests.support.fake_engine import FakeEngine, FakeVM, pid_of_dead_process, register
from tests.support.rows import plant
from tests.support.waiting import wait_for

register()

S, V = BoxState, VMStatus


@dataclass
class Case:
    state: BoxState
    owner_alive: bool
    vm: VMStatus  # GONE: no VM process
    expect_state: str | None  # None: the box is gone
    vm_survives: bool
    extra: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    save_ends_vm: bool = False  # the engine's save ends the VM process (gVisor)
    holder_alive: bool | None = None  # an ephemeral box's: whether its with block's process lives


SAVE_CUT_SHORT = {"kind": "snapshot", "source": "paused", "snapshot": "pending1"}
ROLLBACK = {"kind": "rollback", "disk": "/new.qcow2"}
POOL_VM = {"pool": "tmpl1"}
CASES: dict[int, Case] = {
    0: Case(S.POOLED, False, V.GONE, None, False, {"options": POOL_VM}),
    1: Case(S.CLAIMING, False, V.RUNNING, None, False, {"options": POOL_VM}),
    2: Case(S.RUNNING, False, V.RUNNING, None, False, {"ephemeral": True}, holder_alive=False),
    3: Case(S.RUNNING, True, V.RUNNING, None, False, {"ephemeral": True}, holder_alive=False),
    4: Case(S.CREATING, True, V.GONE, "creating", True),
    5: Case(S.CREATING, False, V.GONE, None, False),
    6: Case(S.STARTING, False, V.RUNNING, "running", True),
    7: Case(S.STARTING, False, V.LOADING, "crashed", False, reason="before its guest ran"),
    8: Case(S.STARTING, False, V.GONE, "crashed", False, reason="and the VM with it"),
    9: Case(S.STOPPING, False, V.RUNNING, "stopped", False),
    10: Case(S.SUSPENDING, False, V.PAUSED, "suspended", False, {"suspended": "s1"}),
    11: Case(S.SNAPSHOTTING, False, V.PAUSED, "paused", True, {"op": SAVE_CUT_SHORT}),
    # on an engine whose save ends the VM (gVisor): the owner died between the checkpoint
    # and the restore
    12: Case(
        S.SNAPSHOTTING,
        False,
        V.GONE,
        "stopped",
        False,
        {"op": SAVE_CUT_SHORT},
        reason="as they were saved",
        save_ends_vm=True,
    ),
    13: Case(S.SNAPSHOTTING, False, V.GONE, "crashed", False, reason="saving its state"),
    14: Case(S.RESUMING, False, V.RUNNING, "running", True, {"suspended": "s2"}),
    15: Case(S.RESUMING, False, V.LOADING, "suspended", False, {"suspended": "s3"}),
    16: Case(S.RESTORING, False, V.RUNNING, "running", True, {"op": ROLLBACK}),
    17: Case(S.RESTORING, False, V.GONE, "stopped", False, reason="rollback was interrupted"),
    18: Case(S.SUSPENDED, False, V.RUNNING, "suspended", False, {"suspended": "s4"}),
    19: Case(S.RUNNING, True, V.GONE, "crashed", False, reason="exited unexpectedly"),
    20: Case(S.RUNNING, True, V.RUNNING, "running", True),
}


def test_every_rule_has_a_case() -> None:
    assert set(CASES) == set(range(len(recovery.TABLE)))


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return Runtime(tmp_path / "home")


def make(rt: Runtime, case: Case) -> tuple[BoxRecord, FakeVM | None]:
    engine = rt.engine("fake")
    assert isinstance(engine, FakeEngine)
    owner = pids.me() if case.owner_alive else pid_of_dead_process()
    box_id = f"b{time.monotonic_ns() % 10**9:09d}"
    vm = None
    if case.vm is not V.GONE:
        where = Placement(box_id, box_id, rt.box_dir(box_id), rt.run_dir(box_id), 1)
        vm = FakeVM(engine, where, None)
        vm.status_now = case.vm
        engine.vms[vm.ref.pid] = vm
    now = time.time()
    extra = dict(case.extra)
    options = extra.pop("options", {})
    if case.holder_alive is not None:
        holder = pids.me() if case.holder_alive else pid_of_dead_process()
        extra.update(holder_pid=holder[0], holder_start=holder[1])
    rec = BoxRecord(
        id=box_id, name=box_id, state=case.state, options=options, created_at=now, updated_at=now,
        engine="fake", owner_pid=owner[0], owner_start=owner[1], vm_pid=vm.ref.pid if vm else None,
        vm_start=vm.ref.start if vm else None, **extra,
    )  # fmt: skip
    plant(rt.store.path, rec)  # as a process killed mid-operation left it
    return rec, vm


@pytest.mark.parametrize("row", sorted(CASES))
def test_rule(runtime: Runtime, row: int) -> None:
    case = CASES[row]
    rec, vm = make(runtime, case)
    engine = runtime.engine("fake")
    assert isinstance(engine, FakeEngine)
    engine.save_ends_vm = case.save_ends_vm  # type: ignore[misc]
    rec_recovery = recovery.Recovery(runtime)
    owner_alive, status = rec_recovery.facts(rec)
    rule = recovery.decide(rec, owner_alive, status, save_ends_vm=case.save_ends_vm)
    assert recovery.TABLE.index(rule) == row, (
        f"case {row} matched rule {recovery.TABLE.index(rule)}: {rule.doc}"
    )
    if row in (11, 12):  # a save cut short left its directory behind; no row names it
        (runtime.home / "snapshots" / "pending1").mkdir(parents=True)
    after = rec_recovery.apply(rec)
    if case.expect_state is None:
        assert after is None and runtime.store.find(rec.id) is None
    else:
        assert after is not None and after.state == case.expect_state
        assert runtime.store.get(rec.id).state == case.expect_state  # written, not only returned
        if case.reason:
            assert case.reason in (after.reason or "")
        if not case.vm_survives:
            assert after.vm_pid is None or after.state in ("suspended",)
    if vm is not None:
        assert vm.running == case.vm_survives, "the VM should have been ended" if vm.running else "killed"
    if row in (11, 12):
        assert not (runtime.home / "snapshots" / "pending1").exists()
    if row == 14:
        assert after is not None and after.suspended is None
    if row == 16:
        assert after is not None and after.disk == "/new.qcow2" and after.op is None


def test_a_row_with_nothing_to_do_is_not_probed(runtime: Runtime) -> None:
    """Stable rows are decided on /proc facts alone: recovery asks no VM (no QMP) for them."""
    rec, _vm = make(runtime, Case(S.STOPPED, False, V.GONE, "stopped", False))
    assert not recovery.Recovery(runtime).needed(rec)
    rec, _vm = make(runtime, Case(S.RUNNING, True, V.RUNNING, "running", True))
    assert not recovery.Recovery(runtime).needed(rec)


def test_an_ephemeral_box_stays_with_its_holder_whoever_ran_its_last_operation(runtime: Runtime) -> None:
    """A ``with`` block's box is its process's, not the last operation's: another process
    that snapshotted it (its owner for the operation) and exited leaves it alone, and one
    whose operation is under way finishes it even where the holder has died."""
    rec, _vm = make(runtime, Case(S.RUNNING, False, V.RUNNING, "running", True, {"ephemeral": True},
                                  holder_alive=True))  # fmt: skip
    rec_recovery = recovery.Recovery(runtime)
    assert not rec_recovery.needed(rec)
    after = rec_recovery.apply(rec)
    assert after is not None and after.state == "running"
    rec, _vm = make(runtime, Case(S.SNAPSHOTTING, True, V.RUNNING, "snapshotting", True, {"ephemeral": True},
                                  holder_alive=False))  # fmt: skip
    after = rec_recovery.apply(rec)
    assert after is not None and after.state == "snapshotting"


def test_a_killed_process_is_gone_only_once_its_last_thread_is() -> None:
    """A multithreaded process whose leader has exited shows the leader as a zombie,
    with no command line, while its other threads still run (and, killed, tear its
    memory down holding its files, a disk image's lock among them): it is not gone,
    nor another process, until they are."""
    import subprocess
    import sys

    leader_leaves = (
        "import ctypes, sys, threading, time\n"
        "threading.Thread(target=lambda: time.sleep(60)).start()\n"
        "sys.stdin.readline()\n"  # the test looks at it whole first
        "ctypes.CDLL(None).syscall(60, 0)\n"  # SYS_exit: this thread alone, as a leader may
    )
    proc = subprocess.Popen([sys.executable, "-c", leader_leaves, "leader_leaves"], stdin=subprocess.PIPE)
    try:
        started = pids.start_time(proc.pid)
        assert pids.alive_as(proc.pid, started, "leader_leaves")
        # right after Popen its execve may not have laid its arguments out yet (no
        # command line: ours, whatever the marker); once it has, they decide
        wait_for("its command line", lambda: "leader_leaves" in pids.cmdline(proc.pid), 10, every=0.01)
        assert not pids.alive_as(proc.pid, started, "another-box")
        assert proc.stdin is not None
        proc.stdin.write(b"now\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline, "the leader never exited"
            time.sleep(0.01)
        assert pids.alive(proc.pid, started)  # its other thread runs on
        # and it is still the process its command line named, though that is gone with
        # the leader's hold on its memory
        assert pids.cmdline(proc.pid) == [""]
        assert pids.alive_as(proc.pid, started, "leader_leaves")
        assert not pids.alive_as(proc.pid, "1", "leader_leaves")  # another start: another process
        proc.kill()
        assert pids.wait_gone(proc.pid, started or "", 10)  # a zombie with no thread left
    finally:
        proc.kill()
        proc.wait()
    # a kernel thread, the other kind without a command line, is nobody's box
    every_pid = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    for kthread in [pid for pid in every_pid if pids.kernel_thread(pid)][:3]:
        assert not pids.alive_as(kthread, pids.start_time(kthread), "box-id")
