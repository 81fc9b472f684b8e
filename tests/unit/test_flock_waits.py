"""Waiting for a file lock: bounded, and cancellation-safe.

A blocking ``flock`` in a worker thread, awaited by a task that is then cancelled,
takes the lock after its task has gone and keeps it for as long as the process
runs: every later client of that lock waits forever. The QEMU engine's monitor
lock was taken so; the boot's disk-full poll, cancelled as a boot ends, left a VM
whose next QMP command (a template's save) never began."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from sandlot.config import flock_wait, flock_within, spawn_unless_locked, try_flock
from sandlot.engine.qemu.command import VMConfig
from sandlot.engine.qemu.vm import QemuVM
from sandlot.errors import BoxBusy


def test_a_cancelled_wait_holds_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    holder = try_flock(lock)
    assert holder is not None

    async def main() -> None:
        waiting = asyncio.ensure_future(flock_within(lock, 30, "the test's lock"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    os.close(holder)
    time.sleep(0.3)  # a thread left blocking in flock would take it now
    again = try_flock(lock)
    assert again is not None, "the cancelled wait took the lock after all"
    os.close(again)


def test_a_wait_ends_at_its_deadline_naming_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    holder = try_flock(lock)
    began = time.monotonic()
    with pytest.raises(BoxBusy, match="the monitor of VM b1"):
        asyncio.run(flock_within(lock, 0.3, "the monitor of VM b1"))
    with pytest.raises(BoxBusy, match="the VM's monitor"):
        flock_wait(lock, 0.3, "the VM's monitor")
    assert time.monotonic() - began < 10  # at their deadlines, not when the holder lets go
    assert holder is not None
    os.close(holder)
    fd = flock_wait(lock, 1, "the lock")  # free: at once
    os.close(fd)


def test_a_vm_whose_monitor_call_was_cancelled_answers_the_next(tmp_path: Path) -> None:
    """The engine's own path: a QMP call cancelled while another client holds the
    monitor leaves the monitor to the next caller."""
    run = tmp_path / "run"
    run.mkdir()
    vm = QemuVM(VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=run,
                         state_dir=tmp_path))  # fmt: skip
    holder = try_flock(vm.cfg.qmp_lock)
    assert holder is not None

    async def main() -> None:
        asking = asyncio.ensure_future(vm.qmp("query-block"))
        await asyncio.sleep(0.05)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        os.close(holder)
        await asyncio.sleep(0.3)
        async with asyncio.timeout(5):  # the lock is free: the next call gets as far as the socket
            fd = await flock_within(vm.cfg.qmp_lock, 1, "the monitor")
        os.close(fd)

    asyncio.run(main())


HELPER = """
import os, sys, time
time.sleep(1.5)  # a slow import on a loaded host
from sandlot.config import HELPER_LOCK, try_flock
fd = try_flock(sys.argv[1])
with open(sys.argv[2], "w") as out:
    out.write(f"{fd is not None} {HELPER_LOCK in os.environ} {try_flock(sys.argv[1]) is None}")
time.sleep(60)
"""


def test_a_started_helper_holds_its_lock_from_its_start_not_from_its_first_line(tmp_path: Path) -> None:
    (tmp_path / "slow_helper.py").write_text(HELPER)
    lock, said = tmp_path / "helper.lock", tmp_path / "said"
    assert spawn_unless_locked(lock, "slow_helper", str(lock), str(said), cwd=str(tmp_path))
    # while it imports, every other caller finds the lock taken and starts none
    for _ in range(20):
        assert not spawn_unless_locked(lock, "slow_helper", str(lock), str(said), cwd=str(tmp_path))
    deadline = time.monotonic() + 60
    while not said.exists() or not said.read_text():
        assert time.monotonic() < deadline, "the helper did not start"
        time.sleep(0.05)
    # it took the lock handed down, once, and passes nothing on to its children
    assert said.read_text() == "True False True"
    (pid,) = [p for p in os.listdir("/proc") if p.isdigit() and _runs("slow_helper", p)]
    assert try_flock(lock) is None
    os.kill(int(pid), 9)
    deadline = time.monotonic() + 10
    while (fd := try_flock(lock)) is None:  # its end lets the lock go
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.close(fd)


def _runs(module: str, pid: str) -> bool:
    try:
        return module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
