"""Lifecycle, locking, sessions and error paths, through the real API and core,
on the fake engine (no VM: each test takes milliseconds). The same paths run
on real VMs in ``tests/vm``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.api.local import LocalBackend, LocalSnapshotRef
from sandlot.config import try_flock
from sandlot.core import sessions
from sandlot.core.runtime import Runtime
from sandlot.core.service import core_for
from sandlot.core.state import Op

from tests.support.fake_engine import FakeEngine, register
from tests.support.waiting import scaled

register()


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


def new_box(home: Path, root: Path, **kw: Any) -> sandlot.AsyncBox:
    return sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256, **kw)


async def created(home: Path, root: Path, **kw: Any) -> sandlot.AsyncBox:
    """A box made (disk ready) and not started."""
    options: dict[str, Any] = {"engine": "fake", "template": False, "memory_mib": 256, "keep": True, **kw}
    return await sandlot.AsyncBox.create(rootfs=root, home=home, **options)


def test_refresh_reads_without_creating(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True, name="r1")
        assert await box.refresh() == "new"
        assert await sandlot.AsyncBox.list(home=home) == []  # refresh made nothing
        await box.start()
        other = await sandlot.AsyncBox.get("r1", home=home)
        await other.stop()
        assert await box.refresh() == "stopped"
        await other.remove()
        assert await box.refresh() == "removed"

    run(main)


def test_create_start_exec_stop_start_remove(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True)
        assert box.state == "new"
        created = await sandlot.AsyncBox.create(rootfs=root, engine="fake", home=home, name="c1")
        assert created.state == "created" and (await created.inspect())["vm_pid"] is None
        await box.start()
        assert box.state == "running" and box.accel == "fake"
        r = await box.exec("echo", "hi")
        assert (r.exit_code, r.stdout) == (0, "hi\n")
        assert (await box.exec("exit", "3")).exit_code == 3
        await box.stop()
        assert box.state == "stopped" and (await box.inspect())["vm_pid"] is None
        await box.stop()  # nothing to do
        await box.start()
        assert (await box.exec("true")).ok
        await box.start()  # already running: nothing to do
        assert FakeEngine.of(home).launches == 2
        with pytest.raises(sandlot.InvalidState, match="stop it first"):
            await box.remove()
        await box.remove(force=True)
        assert box.state == "removed"
        with pytest.raises(sandlot.BoxNotFound) as err:
            await sandlot.AsyncBox.get(box.id, home=home)
        assert err.value.code == "box_not_found" and err.value.status == 404
        await box.remove()  # removing a removed box does nothing
        await created.remove()

    run(main)


def test_pause_refuses_commands_with_the_state_and_what_is_allowed(home: Path, root: Path) -> None:
    async def main() -> None:
        async with new_box(home, root) as box:
            await box.pause()
            await box.pause()  # already paused
            assert box.state == "paused"
            with pytest.raises(sandlot.InvalidState) as err:
                await box.exec("true")
            assert err.value.state == "paused" and err.value.allowed == ("running",)
            assert err.value.to_dict()["code"] == "invalid_state" and "unpause" in str(err.value)
            with pytest.raises(sandlot.InvalidState, match="unpause"):
                await box.start()
            await box.unpause()
            assert (await box.exec("true")).ok

    run(main)


def test_a_failed_boot_crashes_with_the_reason_and_starts_again(home: Path, root: Path) -> None:
    async def main() -> None:
        box = await created(home, root)
        try:
            engine = FakeEngine.of(home)
            engine.fail_boot = True
            with pytest.raises(sandlot.BootError):
                await box.start()
            info = await box.inspect()
            assert info["state"] == "crashed" and info["reason"].startswith(
                "boot failed: fake: the VM would not"
            )
            engine.fail_boot = False
            await box.start()
            assert box.state == "running" and (await box.inspect())["reason"] is None
        finally:
            await box.remove(force=True)

    run(main)


def test_a_boot_that_hangs_before_init_is_tried_once_more(home: Path, root: Path) -> None:
    async def main() -> None:
        box = await created(home, root, boot_timeout=1.5)  # a fake boot takes milliseconds
        engine = FakeEngine.of(home)
        try:
            engine.hangs, before = 1, engine.launches
            await box.start()  # the first guest hung: a second boot, which comes up
            assert box.state == "running" and engine.launches == before + 2
            await box.stop()
            engine.hangs, before = 5, engine.launches
            with pytest.raises(sandlot.BootTimeout, match="in 2 boots its guest never opened") as err:
                await box.start()
            assert engine.launches == before + 2 and err.value.code == "boot_timeout"
            assert box.state == "crashed" and not engine.vms
        finally:
            engine.hangs = 0
            await box.remove(force=True)

    run(main)


def test_an_agent_that_never_answers_is_a_boot_timeout_that_says_so(home: Path, root: Path) -> None:
    async def main() -> None:
        box = await created(home, root, boot_timeout=1.5)  # a fake boot takes milliseconds
        try:
            FakeEngine.of(home).never_answer = True
            with pytest.raises(sandlot.BootTimeout, match="start\\(\\) tries again") as err:
                await box.start()
            assert err.value.box == box.name and err.value.code == "boot_timeout"
            assert box.state == "crashed" and not FakeEngine.of(home).vms  # the VM was ended
            FakeEngine.of(home).never_answer = False
            await box.start()
            assert box.state == "running"
        finally:
            await box.remove(force=True)

    run(main)


def test_a_vm_that_dies_is_a_crash_with_the_console(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        try:
            proc = await box.spawn("sleep", "30")
            (vm,) = FakeEngine.of(home).vms.values()
            vm.die(137)
            with pytest.raises((sandlot.BoxCrashed, sandlot.ConnectionLost)):
                await proc.wait(5)
            assert await box.refresh() == "crashed"
            assert "unexpectedly" in (await box.inspect())["reason"]
            with pytest.raises(sandlot.InvalidState, match="crashed"):
                await box.exec("true")
            await box.start()
            assert (await box.exec("true")).ok
        finally:
            await box.remove(force=True)

    run(main)


def test_forks_and_templates_are_saved_after_a_first_command(home: Path, root: Path) -> None:
    """What a first command reads is in the state many VMs restore (core.livestate.warm_up);
    a plain snapshot's pause stays the user's alone."""

    async def main() -> None:
        box = new_box(home, root, keep=True, name="cold")
        await box.start()
        try:
            await box.snapshot("plain")
            assert (await box.exec("recall", "true_runs")).stdout == "\n"
            kids = await box.fork(2)
            assert [(await k.exec("recall", "true_runs")).stdout for k in kids] == ["1\n", "1\n"]
            for k in kids:
                await k.remove(force=True)
            rt = Runtime.for_home(home)
            core = core_for(rt)
            snap = await core.live.make_template(await core.controller.find(box.id), "warm")
            [kid] = await sandlot.AsyncSnapshot(LocalSnapshotRef(LocalBackend.for_home(home), snap)).start(1)
            assert (await kid.exec("recall", "true_runs")).stdout == "2\n"
            await kid.remove(force=True)
        finally:
            await box.remove(force=True)

    run(main)


def test_a_template_whose_sharing_fails_is_not_left_behind(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async def disk_full(self: FakeEngine, state: Any, disk: Path, *devices: Any) -> None:
            raise OSError(28, "No space left on device")

        box = new_box(home, root, keep=True, name="tsrc")
        await box.start()
        try:
            live = core_for(Runtime.for_home(home)).live
            entry = await core_for(Runtime.for_home(home)).controller.find(box.id)
            with monkeypatch.context() as m:
                m.setattr(FakeEngine, "share_memory", disk_full)
                with pytest.raises(OSError, match="No space left"):
                    await live.make_template(entry, "t1")
            assert await live.list_snapshots(kind="template") == []
            snap = await live.make_template(entry, "t1")  # the name is free again; sharing works
            assert snap.name == "t1" and (await live.list_snapshots(kind="template")) == [snap]
            assert (await box.exec("true")).ok  # the box itself runs on
        finally:
            await box.remove(force=True)

    run(main)


def test_memory_survives_snapshot_rollback_fork_suspend_resume(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True, name="src")
        await box.start()
        try:
            await box.exec("remember", "k", "1")
            snap = await box.snapshot("one")
            assert box.last_pause is not None and box.state == "running"
            await box.exec("remember", "k", "2")
            await box.rollback(snap)
            assert (await box.exec("recall", "k")).stdout == "1\n"
            kids = await box.fork(3)
            assert sorted([(await k.exec("recall", "k")).stdout for k in kids]) == ["1\n"] * 3
            names = {(await k.exec("hostname")).stdout.strip() for k in kids}
            assert len(names) == 3 and all(n.startswith("src-") for n in names)  # each its own identity
            origin = (await kids[0].inspect())["origin"]
            for k in kids:
                await k.remove(force=True)
            with pytest.raises(sandlot.SnapshotNotFound):  # a fork's own snapshot went with its last child
                await sandlot.AsyncSnapshot.get(origin, home=home)
            await box.suspend()
            assert box.state == "suspended" and (await box.inspect())["vm_pid"] is None
            assert (await box.exec("recall", "k")).stdout == "1\n"  # the next command resumes it
            assert box.state == "running" and (await box.inspect())["suspended"] is None
            assert [s.name for s in await box.snapshots()] == ["one"]
        finally:
            await box.remove(force=True)

    run(main)


def test_failed_restores_leave_the_box_where_it_was(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        engine = FakeEngine.of(home)
        try:
            snap = await box.snapshot()
            await box.suspend()
            engine.fail_restore = True
            with pytest.raises(sandlot.BootError):
                await box.resume()
            assert await box.refresh() == "suspended"  # its saved state is still there
            engine.fail_restore = False
            await box.resume()
            engine.fail_restore = True
            with pytest.raises(sandlot.BootError):
                await box.rollback(snap)
            info = await box.inspect()
            assert info["state"] == "stopped" and info["reason"].startswith("rollback failed")
            engine.fail_restore = False
            await box.rollback(snap)
            assert box.state == "running"
        finally:
            await box.remove(force=True)

    run(main)


def test_handles_of_a_box_share_one_session_and_one_view(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True, name="shared")
        await box.start()
        try:
            others = [await sandlot.AsyncBox.get("shared", home=home) for _ in range(50)]
            results = await asyncio.gather(*(b.exec("echo", str(i)) for i, b in enumerate(others * 4)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(200)]
            core = core_for(Runtime.for_home(home))
            assert len(core.entries) == 1  # one entry, one session, one agent port for all 51 handles
            taken = [
                p
                for p in range(8)
                if try_flock(Path(home) / "boxes" / box.id / "ports" / f"{p}.lock") is None
            ]
            assert len(taken) == 1
            await others[0].stop()
            assert box.state == "stopped"  # every handle sees what any did
        finally:
            await box.remove(force=True)

    run(main)


def test_concurrent_operations_on_one_box_run_one_at_a_time(home: Path, root: Path) -> None:
    async def main() -> None:
        box = await created(home, root)
        try:
            await asyncio.gather(*(box.start() for _ in range(10)))
            assert FakeEngine.of(home).launches == 1
            results = await asyncio.gather(box.pause(), box.unpause(), box.stop(), return_exceptions=True)
            assert not [
                r for r in results if isinstance(r, Exception) and not isinstance(r, sandlot.InvalidState)
            ]
            assert await box.refresh() in ("stopped", "running", "paused")
        finally:
            await box.remove(force=True)

    run(main)


def test_a_transition_needs_the_boxs_lock(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        try:
            core = core_for(Runtime.for_home(home))
            entry = core.entries[box.id]
            with pytest.raises(RuntimeError, match="without its lock"):
                async with core.controller.transition(entry, Op.PAUSE):
                    pass
            assert box.state == "running"
        finally:
            await box.remove(force=True)

    run(main)


async def hold_port(lock: Path, within: float = 5.0) -> int:
    """Take an agent port's lock as another process would, once the box's idle session
    has given it back (when exactly depends on the idle timer, so it is polled)."""
    deadline = time.monotonic() + within
    while (fd := try_flock(lock)) is None:
        assert time.monotonic() < deadline, f"{lock.name} was not given back in {within} s"
        await asyncio.sleep(0.05)
    return fd


async def hold_every_port(ports: Path) -> list[int | None]:
    return [await hold_port(ports / f"{p}.lock") for p in range(8)]


def test_when_other_processes_hold_every_agent_port_a_session_waits_its_turn(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sessions, "IDLE_RELEASE", 0.2)

    async def main() -> None:
        box = new_box(home, root, keep=True, request_timeout=2.0)
        await box.start()
        ports = Path(home) / "boxes" / box.id / "ports"
        try:
            held = await hold_every_port(ports)  # once idle, its port went back
            waiting = asyncio.ensure_future(box.exec("echo", "late"))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # in line, not failed
            os.close(held.pop())  # one process lets go
            assert (await waiting).stdout == "late\n"
            held.append(await hold_port(ports / "7.lock"))  # once idle again
            with pytest.raises(sandlot.BoxBusy, match="all 8 agent ports") as err:
                await box.exec("true")
            assert err.value.status == 423
            for fd in held:
                if fd is not None:
                    os.close(fd)
        finally:
            await box.remove(force=True)

    run(main)


def test_a_connection_held_through_a_slow_restore_is_not_closed_under_it_for_idleness(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A diff and a file restore use the box's connection before and after they bring a
    snapshot up as a box of its own; a restore longer than the idle release (a loaded
    host's) must not leave them holding a connection that the release closed."""
    monkeypatch.setattr(sessions, "IDLE_RELEASE", 0.2)

    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        try:
            await box.files.write("/root/marker", "before")
            snap = await box.snapshot("mark")
            await box.files.write("/root/marker", "changed")
            FakeEngine.of(home).restore_seconds = 1.0
            d = await box.diff(snap, paths="/root")
            assert [(c.path, c.status) for c in d] == [("/root/marker", "modified")]
            assert (await box.files.restore("/root/marker", from_=snap))["entries"] == 1
            assert await box.files.read_text("/root/marker") == "before"
        finally:
            await box.remove(force=True)

    run(main)


def test_a_connection_reconnecting_past_the_idle_release_is_not_closed_under_its_handshake(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection whose socket closed (its box suspended by another process and woken
    by this one's next caller, on a loaded host) reconnects with no channel open: the
    idle release must not take it for idle and close it mid-handshake, which failed the
    caller waiting for it (a request that woke a box on traffic was reset so)."""
    monkeypatch.setattr(sessions, "IDLE_RELEASE", 0.2)

    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        try:
            assert (await box.exec("echo", "one")).stdout == "one\n"
            core = core_for(Runtime.for_home(home))
            conn = (await core.controller.find(box.id)).session.conn
            assert conn is not None
            FakeEngine.of(home).hello_seconds = 1.0  # the agent answers slowly: 5 idle releases
            conn.break_transport()
            await asyncio.sleep(0.1)
            assert conn.reconnecting
            assert (await box.exec("echo", "two")).stdout == "two\n"
            assert conn.failed is None
        finally:
            FakeEngine.of(home).hello_seconds = 0.0
            await box.remove(force=True)

    run(main)


def test_a_save_longer_than_the_idle_release_still_thaws_the_commands_it_froze(
    home: Path, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box with a share has its commands frozen for a save; the thaw after it goes to
    the session as it is then, not to a connection the idle release closed meanwhile."""
    monkeypatch.setattr(sessions, "IDLE_RELEASE", 0.2)
    shared = tmp_path / "shared"
    shared.mkdir()

    async def main() -> None:
        box = new_box(home, root, keep=True, volumes=[(shared, "/mnt")])
        await box.start()
        try:
            engine = FakeEngine.of(home)
            engine.save_seconds = 1.0
            await box.snapshot("slow")
            (vm,) = [v for v in engine.vms.values() if v.running]
            assert not vm.frozen
            assert (await box.exec("echo", "on")).stdout == "on\n"
        finally:
            await box.remove(force=True)

    run(main)


def test_network_policy_changes_and_what_needs_a_stop(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True, network="allowlist", allow=["pypi.org"])
        await box.start()
        try:
            await box.set_network(allow=["example.org:443"])
            assert (await box.inspect())["network"]["allow"] == ["example.org:443"]
            with pytest.raises(sandlot.InvalidState, match="network card") as err:
                await box.set_network("none")
            assert err.value.state == "running"
            await box.stop()
            await box.set_network("none")
            assert (await box.inspect())["network"]["mode"] == "none"
        finally:
            await box.remove(force=True)

    run(main)


def test_the_with_block_removes_its_box_and_keep_leaves_it(home: Path, root: Path) -> None:
    async def main() -> None:
        async with new_box(home, root) as box:
            assert box.state == "running"
        assert box.state == "removed" and await sandlot.AsyncBox.list(home=home) == []
        async with new_box(home, root, keep=True, name="kept") as kept:
            await kept.files.write("/root/x", "y")
        again = await sandlot.AsyncBox.get("kept", home=home)
        assert again.state == "running" and (await again.inspect())["ephemeral"] is False
        assert await again.files.read("/root/x") == b"y"  # the same box, not one made again
        await kept.remove(force=True)
        auto = await created(home, root, name="auto", auto_remove=True)  # goes at its stop
        await auto.start()
        await auto.stop()
        with pytest.raises(sandlot.BoxNotFound):
            await sandlot.AsyncBox.get("auto", home=home)

    run(main)


def test_removing_a_box_keeps_its_snapshots_and_prune_removes_them(home: Path, root: Path) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True, name="old")
        await box.start()
        kept = await box.snapshot("kept")
        needed = await box.snapshot("needed")
        child = (await needed.start(1, name="child"))[0]
        await box.remove(force=True)
        names = {s.name for s in await sandlot.AsyncSnapshot.list(home=home)}
        assert {"kept", "needed"} <= names  # removing a box keeps its snapshots
        gone = await sandlot.prune_snapshots_async(home=home)
        assert [s.id for s in gone] == [kept.id]  # a box started from "needed" still exists
        await child.remove(force=True)
        assert [s.id for s in await sandlot.prune_snapshots_async(home=home)] == [needed.id]
        assert not (Path(home) / "snapshots" / needed.id).exists()

    run(main)


# -- every row of the transition table, through the controller ----------------------------------

SETUP = {  # how to bring a fresh box into each state users see
    "created": [],
    "running": ["start"],
    "paused": ["start", "pause"],
    "suspended": ["start", "suspend"],
    "stopped": ["start", "stop"],
    "crashed": ["start", "crash"],
}


async def into(box: sandlot.AsyncBox, state: str, home: Path) -> None:
    for step in SETUP[state]:
        if step == "crash":
            for vm in list(FakeEngine.of(home).vms.values()):
                vm.die(9)
        else:
            await getattr(box, step)()
    assert await box.refresh() == state


async def do(box: sandlot.AsyncBox, op: Op, snap: Any) -> None:
    if op == Op.DISCARD:
        await box.stop()  # a suspended box's stop discards its saved state
    elif op == Op.NETWORK:
        await box.set_network(allow=["example.org:443"])
    elif op == Op.REMOVE:
        await box.remove(force=True)
    elif op == Op.ROLLBACK:
        await box.rollback(snap)
    elif op == Op.CREATE:
        pass
    else:
        await getattr(box, op.value)()


# The API delegates where an operation means another in a state: start() of a suspended box
# resumes it, stop() of a suspended box discards its saved state (the DISCARD operation).
DELEGATED = {(Op.START, "suspended"): "running", (Op.STOP, "suspended"): "stopped"}
# (a box never started has no snapshot of its own: its rollback is refused as bad input first;
# a warm pool's VMs are no boxes: POOL and CLAIM are the pools' own, tested in test_pools.py;
# CRASH and LOSE are no calls but what befalls a box, tested in test_state_writes.py)
CASES = [(op, s) for op in Op if op not in (Op.CREATE, Op.POOL, Op.CLAIM, Op.CRASH, Op.LOSE) for s in SETUP
         if (op != Op.DISCARD or s == "suspended") and (op, s) != (Op.ROLLBACK, "created")]  # fmt: skip


@pytest.mark.parametrize(("op", "source"), CASES, ids=[f"{o.value}-from-{s}" for o, s in CASES])
def test_every_transition_through_the_controller(home: Path, root: Path, op: Op, source: str) -> None:
    from sandlot.core.state import TRANSITIONS, BoxState, end_state

    t = TRANSITIONS[op]

    async def main() -> None:
        box = new_box(home, root, keep=True, network="allowlist")
        await box.start()
        snap = await box.snapshot("base")  # for the rollbacks
        await box.stop()
        await into(box, source, home) if source != "created" else None
        if source == "created":  # a new box, never started
            box = await created(home, root, network="allowlist")
        state = BoxState(source)
        try:
            if (op, source) in DELEGATED:
                await do(box, op, snap)
                assert await box.refresh() == DELEGATED[(op, source)]
            elif state in t.done:
                await do(box, op, snap)
                assert await box.refresh() == source  # nothing to do
            elif state in t.sources:
                await do(box, op, snap)
                after = await box.refresh()
                assert after == ("removed" if op == Op.REMOVE else end_state(op, state).value)
            else:
                with pytest.raises(sandlot.InvalidState) as err:
                    await do(box, op, snap)
                assert err.value.state == source and set(err.value.allowed) == {s.value for s in t.sources}
                assert await box.refresh() == source  # refused: nothing changed
        finally:
            for b in await sandlot.AsyncBox.list(home=home):
                await b.remove(force=True)

    run(main)


FAILING = [  # (operation, from, what fails in the VM, where the box must fall)
    (Op.START, "stopped", "boot", "crashed"),
    (Op.PAUSE, "running", "pause", "running"),
    (Op.UNPAUSE, "paused", "resume", "paused"),
    (Op.SNAPSHOT, "running", "save", "running"),
    (Op.SNAPSHOT, "paused", "save", "paused"),
    (Op.SUSPEND, "running", "save", "running"),
    (Op.RESUME, "suspended", "restore", "suspended"),
    (Op.ROLLBACK, "running", "restore", "stopped"),
]


@pytest.mark.parametrize(("op", "source", "fails", "falls_to"), FAILING,
                         ids=[f"{o.value}-from-{s}" for o, s, _f, _t in FAILING])  # fmt: skip
def test_failed_operations_fall_where_the_table_says(
    home: Path, root: Path, op: Op, source: str, fails: str, falls_to: str
) -> None:
    from sandlot.core.state import BoxState, failure_state

    assert failure_state(op, BoxState(source)).value == falls_to  # the table says so

    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        snap = await box.snapshot("base")
        await into(box, source, home)
        engine = FakeEngine.of(home)
        if fails == "boot":
            engine.fail_boot = True
        elif fails == "restore":
            engine.fail_restore = True
        else:
            engine.fail.add(fails)
        try:
            with pytest.raises(sandlot.SandlotError):
                await do(box, op, snap)
            assert await box.refresh() == falls_to
            assert (await box.inspect())["op"] is None  # nothing left half done for recovery
        finally:
            engine.fail.clear()
            engine.fail_boot = engine.fail_restore = False
            await box.remove(force=True)

    run(main)


HOLD_THE_STORE = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")  # the write lock, as a process stuck mid-transaction holds it
print("held", flush=True)
sys.stdin.readline()  # until the test lets go: however long a busy host makes its attempts
"""


def test_a_store_locked_past_the_busy_timeout_is_store_busy_and_loses_nothing(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the home's database locked for longer than a call may wait:
    every change fails with StoreBusy, naming the database, within the timeout and not
    before; the boxes keep running, nothing half made is left, and once the lock goes
    everything works again."""
    import subprocess
    import sys

    monkeypatch.setenv("SANDLOT_STORE_BUSY_TIMEOUT", "1")

    async def main() -> None:
        box = await created(home, root)
        await box.start()
        holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_STORE, str(home / "sandlot.db")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            for attempt in (lambda: created(home, root, name="second"), box.stop, box.snapshot):
                t0 = time.monotonic()
                with pytest.raises(sandlot.StoreBusy, match=r"sandlot\.db stayed locked by another process"):
                    await attempt()
                assert 0.9 < time.monotonic() - t0 < 10  # the timeout, not before
            assert (await box.exec("echo", "up")).stdout == "up\n"  # the box runs on
        finally:
            holder.communicate(b"go\n", timeout=30)
        assert [b.name for b in await sandlot.AsyncBox.list(home=home)] == [box.name]
        assert box.state == "running" and await sandlot.AsyncSnapshot.list(home=home) == []
        await box.snapshot()
        await box.stop()
        assert (await created(home, root, name="second")).state == "created"

    run(main)


def test_an_idle_suspend_is_called_off_when_a_request_came_after_the_watchdog_looked(
    home: Path, root: Path
) -> None:
    """The idle watchdog asks the agent once more after the box is marked suspending (when
    other processes wait for the suspend): a request that came in between keeps it running,
    with no event; an idle one is suspended."""

    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        core = core_for(Runtime.for_home(home))
        entry = await core.controller.find(box.id)
        await box.exec("true")  # a request just now: not idle for an hour
        before = [e.kind async for e in box.events(follow=False)]
        await core.live.suspend(entry, if_idle_for=3600)
        assert await box.refresh() == "running" and (await box.exec("echo", "on")).stdout == "on\n"
        assert [e.kind async for e in box.events(follow=False)] == before  # nothing happened
        await core.live.suspend(entry, if_idle_for=0.0)
        assert await box.refresh() == "suspended"
        assert (await box.exec("echo", "back")).stdout == "back\n"  # resumes on the next request
        await box.remove(force=True)

    run(main)


def test_the_idle_watchdog_tries_again_after_a_suspend_that_failed(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A suspend that fails (a save refused on a loaded host) does not end the watch: the
    box would stay awake for good. The watchdog tries again once the box is idle again."""
    from sandlot.core import idle, watchdog
    from sandlot.core.livestate import LiveState

    monkeypatch.setattr(idle, "spawn", lambda home, box_id: None)  # the watch runs here, below
    real = LiveState.suspend
    tries: list[float | None] = []

    async def failing_once(self: LiveState, entry: Any, *, if_idle_for: float | None = None) -> None:
        tries.append(if_idle_for)
        if len(tries) == 1:
            raise sandlot.SandlotError("the save failed")
        await real(self, entry, if_idle_for=if_idle_for)

    monkeypatch.setattr(LiveState, "suspend", failing_once)

    async def main() -> None:
        box = new_box(home, root, keep=True, idle_timeout=0.5)
        await box.start()
        lock = try_flock(idle.watchdog_lock(home, box.id))
        assert lock is not None
        await asyncio.wait_for(watchdog.watch(home, box.id, lock), 30)
        assert tries == [0.5, 0.5] and await box.refresh() == "suspended"
        await box.remove(force=True)

    run(main)


def test_a_resume_while_the_idle_watchdog_ends_is_watched_too(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume that comes after the watchdog saw the box suspended, but before it let go
    of its lock, starts no watchdog of its own (the lock is taken). The ending watchdog
    looks again once it let go, and watches the running box on, until it sleeps again."""
    from sandlot.core import idle, watchdog
    from sandlot.core.controller import BoxController

    started: list[bool] = []  # each start of a watchdog: whether it would have found the lock free
    monkeypatch.setattr(idle, "spawn", lambda home, box_id: started.append(_lock_free(home, box_id)))
    real = BoxController.refresh
    box: sandlot.AsyncBox
    resumed: list[bool] = []

    async def resumed_right_after_the_look(self: BoxController, entry: Any) -> Any:
        record = await real(self, entry)
        if record.state == "suspended" and not resumed:
            resumed.append(True)
            await box.resume()  # as a command would, between the watchdog's look and its exit
        return record

    monkeypatch.setattr(BoxController, "refresh", resumed_right_after_the_look)

    async def main() -> None:
        nonlocal box
        box = new_box(home, root, keep=True, idle_timeout=0.5)
        await box.start()
        started.clear()
        lock = try_flock(idle.watchdog_lock(home, box.id))
        assert lock is not None
        await asyncio.wait_for(watchdog.watch(home, box.id, lock), 30)
        assert started == [False]  # the resume's own watchdog would have exited at once
        kinds = [e.kind async for e in box.events(follow=False)]
        assert kinds.count("suspended") == 2 and kinds.count("resumed") == 1, kinds
        assert await box.refresh() == "suspended"
        assert _lock_free(home, box.id)  # and the watch let go of it
        await box.remove(force=True)

    run(main)


def _lock_free(home: Path, box_id: str) -> bool:
    from sandlot.core import idle

    fd = try_flock(idle.watchdog_lock(home, box_id))
    if fd is not None:
        os.close(fd)
    return fd is not None


def test_a_loop_that_ended_gives_its_agent_ports_back(home: Path, root: Path) -> None:
    """A program that runs a loop per task (``asyncio.run`` each time, or a test per loop)
    and uses a box from each: the box's agent ports, one per process and loop, go back as
    each loop ends. Before, each ended loop kept one until the process exited, and the
    loop after the box's last port waited in line for one until its deadline."""
    from sandlot.core.runtime import AGENT_PORTS

    box = sandlot.Box(rootfs=root, engine="fake", home=home, template=False, memory_mib=256, keep=True)
    box.start()
    try:
        for n in range(AGENT_PORTS + 2):

            async def use(n: int = n) -> str:
                again = await sandlot.AsyncBox.get(box.name, home=home)
                return (await asyncio.wait_for(again.exec("echo", str(n)), 20)).stdout

            assert asyncio.run(use()) == f"{n}\n"
        locks = [try_flock(home / "boxes" / box.id / "ports" / f"{p}.lock") for p in range(AGENT_PORTS)]
        for fd in locks:
            if fd is not None:
                os.close(fd)
        assert locks.count(None) == 1  # the sync API's own session: its loop runs on
    finally:
        box.remove(force=True)


def test_a_command_reads_the_row_again_only_after_a_commit_it_did_not_make(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box's row written by its own operation (a start) is current until something else
    commits: the commands after it ask the store nothing. A commit by another process (its
    own connection) or by another loop of this process (the sync API's, sharing this
    process's connection) makes the next command read the row, and see what they did."""
    from sandlot.core.boxrecord import store_path
    from sandlot.core.controller import BoxController
    from sandlot.core.store import BoxStore

    reads: list[str] = []
    real = BoxController.refresh

    async def counted(self: BoxController, entry: Any) -> Any:
        reads.append(entry.name)
        return await real(self, entry)

    monkeypatch.setattr(BoxController, "refresh", counted)

    async def main() -> None:
        box = new_box(home, root, keep=True, name="seen")
        await box.start()
        try:
            reads.clear()
            assert (await box.exec("true")).ok and (await box.exec("true")).ok
            assert reads == []
            other = BoxStore(store_path(home))  # another process, marking it paused
            other.update(box.id, expect=("running",), state="paused")
            with pytest.raises(sandlot.InvalidState, match="paused"):
                await box.exec("true")
            assert reads == ["seen"]
            other.update(box.id, expect=("paused",), state="running")
            other.close()
            assert (await box.exec("true")).ok and reads == ["seen", "seen"]
            sync = sandlot.Box.get("seen", home=home)  # this process, the sync API's loop
            await asyncio.to_thread(sync.pause)
            with pytest.raises(sandlot.InvalidState, match="paused"):
                await box.exec("true")
            await asyncio.to_thread(sync.unpause)
            assert (await box.exec("true")).ok
        finally:
            await box.remove(force=True)

    run(main)


# -- refusals that boot nothing (they ran on real VMs once; the engine never sees them) --------


def test_bad_options_are_refused_and_change_nothing(home: Path, root: Path, tmp_path: Path) -> None:
    box = sandlot.create(rootfs=root, name="original", memory_mib=256, engine="fake", home=home)
    try:
        before = box.inspect()
        with pytest.raises(sandlot.BoxNotFound):
            sandlot.get("no-such-box", home=home)
        with pytest.raises(sandlot.InvalidArgument, match="already exists"):
            sandlot.create(rootfs=root, name="original", engine="fake", home=home)
        for kwargs in (
            {"name": "bad name"},
            {"name": "-leading"},
            {"name": "x" * 64},
            {"memory_mib": -512},
            {"cpus": 0},
            {"volumes": [f"{tmp_path / 'missing'}:/mnt"]},
            {"volumes": ["nocolon"]},
            {"volumes": [f"{tmp_path}:relative"]},
            {"labels": {"bad key": "v"}},
        ):
            with pytest.raises(sandlot.InvalidArgument):
                sandlot.create(rootfs=root, engine="fake", home=home, **kwargs)
        for kwargs in (  # refused by the constructor, before a start
            {"memory_mib": -1},
            {"memory_mib": 0},
            {"memory_mib": "512"},
            {"cpus": 0},
            {"disk_size_gb": 0},
            {"hostname": "bad host"},
            {"boot_timeout": 0},
        ):
            with pytest.raises(sandlot.InvalidArgument):
                sandlot.Box(rootfs=root, engine="fake", home=home, **kwargs)
        with pytest.raises(sandlot.InvalidArgument, match="does not exist"):
            sandlot.Box(rootfs=tmp_path / "nope", engine="fake", home=home)
        with pytest.raises(ValueError):  # InvalidArgument is a ValueError too
            sandlot.Box(rootfs="", engine="fake", home=home)
        with pytest.raises(sandlot.InvalidState, match="created"):
            box.exec("true")
        after = box.inspect()
        assert {k: after[k] for k in ("state", "name", "options")} == {
            k: before[k] for k in ("state", "name", "options")
        }
        assert [b.name for b in sandlot.list(home=home)] == ["original"]
    finally:
        box.remove()


def test_a_bad_kernel_or_accelerator_fails_before_qemu_runs(home: Path, root: Path, tmp_path: Path) -> None:
    """The QEMU engine's own refusals, each before it launches anything."""
    t0 = time.monotonic()
    missing = tmp_path / "missing-vmlinux"
    with (
        pytest.raises(sandlot.HostSetupError, match="does not exist"),
        sandlot.Box(rootfs=root, kernel=missing, engine="qemu", home=home),
    ):
        pass
    junk = tmp_path / "junk-kernel"
    junk.write_bytes(os.urandom(4096))
    with (
        pytest.raises(sandlot.HostSetupError, match="neither an ELF"),
        sandlot.Box(rootfs=root, kernel=junk, engine="qemu", home=home),
    ):
        pass
    with (
        pytest.raises(sandlot.InvalidArgument, match="accel"),
        sandlot.Box(rootfs=root, accel="warp", engine="qemu", home=home),
    ):
        pass
    # a disk made for the root and no boot: the bound it had on real VMs, for this host's load
    assert time.monotonic() - t0 < scaled(10)
    assert sandlot.list(home=home) == []


def test_boxes_of_a_home_given_by_name(home: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_HOME", str(home))
    rt = sandlot.Runtime()  # the default home ($SANDLOT_HOME)
    assert rt.home == home
    box = sandlot.create(rootfs=root, name="rt-api", memory_mib=256, engine="fake", home=rt.home)
    try:
        assert sandlot.get("rt-api", home=rt.home).id == box.id and box.state == "created"
        assert "rt-api" in [b.name for b in sandlot.list(state="created", home=rt.home)]
    finally:
        box.remove()
    assert "rt-api" not in [b.name for b in sandlot.list(home=rt.home)]


def test_a_hostile_tarball_root_is_refused_and_leaves_nothing(home: Path, tmp_path: Path) -> None:
    """The tarball goes through the image layer applier's rules on its way to a base disk
    (the rules themselves, attack by attack: test_unpack.py): refused before any engine
    sees it, with no box, no base and no file outside its staging directory."""
    import io
    import tarfile

    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tf:
        info = tarfile.TarInfo("../../escape.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(sandlot.ImageError, match=r"contains '\.\.'"):
        sandlot.Box(rootfs=evil, engine="fake", home=home).start()
    assert not (tmp_path.parent / "escape.txt").exists()
    assert sandlot.list(home=home) == [] and FakeEngine.of(home).launches == 0
    # unpacked in <bases>/.<key>.<random>/root, where ../../escape.txt is <bases>/escape.txt
    assert [p.name for p in Runtime.for_home(home).bases_dir.iterdir()] == []


# -- a crash that boots nothing (it ran on real VMs once; no VM exists at that point) ----------

CREATING = """
import sys
from tests.support.fake_engine import register
import sandlot
register()
sandlot.create(rootfs=sys.argv[1], name="half-made", memory_mib=256, engine="fake", home=sys.argv[2])
print("survived", flush=True)
"""


def test_a_process_killed_mid_create_leaves_nothing(home: Path, root: Path) -> None:
    """Killed between the row that names the disk and the disk: the next call in any
    process removes the box, says so, and leaves no directory of it; the name is free."""
    p = subprocess.run(
        [sys.executable, "-c", CREATING, str(root), str(home)],
        env={**os.environ, "SANDLOT_CRASH_AT": "create.before-disk"},
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert p.returncode == -9 and "survived" not in p.stdout, p.stderr[-2000:]
    assert sandlot.list(home=home) == []  # reconciled away
    gone = list(sandlot.events(box="half-made", follow=False, home=home))
    assert [(e.kind, e.by) for e in gone][-1] == ("removed", "recovery"), gone
    assert gone[-1].detail["was"] == "creating", gone[-1]
    with pytest.raises(sandlot.BoxNotFound):
        sandlot.get("half-made", home=home)
    assert list(Runtime.for_home(home).boxes_dir.iterdir()) == []  # no directory without its box
    sandlot.create(rootfs=root, name="half-made", memory_mib=256, engine="fake", home=home).remove()
