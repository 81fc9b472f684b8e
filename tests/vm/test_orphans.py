"""VMs that outlive their home, on real VMs: a home removed (``rm -rf``) while a
template of it keeps a warm pool and a box of it runs has both QEMUs ended within
seconds by the home's watcher, which then exits; a QEMU that its home's store has
no row for is listed by ``sandlot doctor`` (pid, memory, home), left running, and
ended by ``sandlot doctor --kill-orphans``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import sandlot
from sandlot import pids
from sandlot.core.homewatch import MODULE
from sandlot.core.runtime import Runtime

from tests.conftest import TEST_ENGINE
from tests.support.waiting import deadline_in

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(TEST_ENGINE != "qemu", reason="warm pools are tested on QEMU (gVisor: not yet)"),
]
DEADLINE = 10.0  # seconds from a home's removal to the end of its VMs


def within(seconds: float, done: Callable[[], bool]) -> bool:
    deadline = deadline_in(seconds)
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def watchers(home: Path) -> list[int]:
    return [p.pid for p in pids.processes() if MODULE in p.argv and str(home) in p.argv]


def doctor(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandlot.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "SANDLOT_HOME": str(home)})  # fmt: skip


def test_a_removed_homes_pool_vm_and_box_end_within_seconds(other_home: Path, busybox_root: Path) -> None:
    home = other_home
    sandlot.template(rootfs=busybox_root, memory_mib=256, name="pooled", pool=1, home=home)
    # the detached refiller fills the pool, as for any user who asks for one
    assert within(180, lambda: [p.ready for p in sandlot.pools(home=home)] == [1])
    sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True, home=home).start()
    rows = Runtime.for_home(home).store.list()
    vms = [r.vm for r in rows if r.vm is not None]
    assert sorted(r.state for r in rows) == ["pooled", "running"] and len(vms) == 2
    assert all(pids.alive(vm.pid, vm.start) for vm in vms)
    assert len(watchers(home)) == 1  # one for the home, whichever process launched its VMs

    t0 = time.monotonic()
    shutil.rmtree(home)
    ended = within(DEADLINE, lambda: not any(pids.alive(vm.pid, vm.start) for vm in vms))
    assert ended, "a VM outlived its home"
    print(f"both VMs ended {time.monotonic() - t0:.2f} s after the home was removed")
    assert within(DEADLINE, lambda: not watchers(home))


def test_doctor_lists_a_vm_its_home_has_no_row_for_and_ends_it_when_asked(
    other_home: Path, busybox_root: Path
) -> None:
    home = other_home
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True, home=home)
    box.start()
    store = Runtime.for_home(home).store
    [rec] = store.list()
    vm = rec.vm
    assert vm is not None
    store.delete(rec.id)  # what only a fault of sandlot's own could leave: a VM without its row

    r = doctor(home, "--json")
    assert r.returncode == 0, r.stderr
    [listed] = [o for o in json.loads(r.stdout)["orphans"] if o["pid"] == vm.pid]
    assert (listed["home"], listed["box_id"], listed["engine"]) == (str(home), rec.id, "qemu")
    assert listed["why"] == "its home has no box of its id" and not listed["ended"]
    assert listed["rss_bytes"] > 16 << 20
    assert pids.alive(vm.pid, vm.start)  # its home is there: only listed

    r = doctor(home, "--kill-orphans")
    assert f"pid {vm.pid}  qemu" in r.stdout and "ended" in r.stdout, r.stdout
    assert within(5, lambda: not pids.alive(vm.pid, vm.start))
    r = doctor(home)
    assert f"pid {vm.pid}" not in r.stdout
