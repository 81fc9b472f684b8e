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

from sandlot.config import flock_wait, flock_within, try_flock
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
