"""Events (``core.events``): what every change writes, with its reason and who did it,
read in order by any process, on the fake engine. Real VMs, a real OOM and a real
server's SSE and webhooks are in ``tests/vm/test_events.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.core import events as core_events
from sandlot.core import store as core_store
from sandlot.core.runtime import Runtime

from tests.support.fake_engine import FakeEngine, register

register()


def new_box(home: Path, root: Path, **kw: Any) -> sandlot.AsyncBox:
    return sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256, **kw)


def history(home: Path, **kw: Any) -> list[sandlot.Event]:
    return list(sandlot.events(home=home, follow=False, **kw))


def test_each_change_of_a_box_is_one_event_in_order(home: Path, root: Path) -> None:
    async def main() -> tuple[str, list[str]]:
        box = new_box(home, root, keep=True, name="ev")
        await box.start()
        await box.exec("true")
        snap = await box.snapshot("one")
        await box.pause()
        await box.unpause()
        await box.rollback(snap)
        kids = await box.fork(2)
        await box.suspend()
        await box.resume()
        await box.stop()
        for k in kids:
            await k.remove(force=True)
        await box.remove()
        return box.id, [k.id for k in kids]

    box_id, kids = asyncio.run(main())
    mine = history(home, box=box_id)
    assert [(e.kind, e.state) for e in mine] == [
        ("created", "created"), ("started", "running"), ("snapshot", "running"), ("paused", "paused"),
        ("unpaused", "running"), ("rolled_back", "running"), ("snapshot", "running"), ("forked", "running"),
        ("suspended", "suspended"), ("resumed", "running"), ("stopped", "stopped"), ("removed", None),
    ]  # fmt: skip
    assert mine[2].detail["name"] == "one" and mine[5].detail["name"] == "one"
    assert mine[5].detail["snapshot"] == mine[2].detail["snapshot"]
    assert sorted(c["id"] for c in mine[7].detail["children"]) == sorted(kids)
    assert all(e.box_name == "ev" and e.box_id == box_id for e in mine)
    me = f"process {__import__('os').getpid()} "
    assert all(e.by.startswith(me) for e in mine), {e.by for e in mine}
    ids = [e.id for e in history(home)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for kid in kids:  # a fork's child was made from the fork's snapshot, then started
        kinds = [(e.kind, e.detail.get("snapshot")) for e in history(home, box=kid)]
        assert kinds == [("created", mine[6].detail["snapshot"]), ("started", None), ("removed", None)]
    # by name too, a removed box's included
    assert [e.id for e in history(home, box="ev")] == [e.id for e in mine]


def test_a_failed_boot_and_a_dying_vm_are_crashes_with_reasons(home: Path, root: Path) -> None:
    async def main() -> str:
        box = new_box(home, root, keep=True)
        engine = FakeEngine.of(home)
        engine.fail_boot = True
        with pytest.raises(sandlot.BootError):
            await box.start()
        engine.fail_boot = False
        await box.start()
        proc = await box.spawn("sleep", "30")
        (vm,) = engine.vms.values()
        vm.die(137)
        with pytest.raises((sandlot.BoxCrashed, sandlot.ConnectionLost)):
            await proc.wait(5)
        await box.refresh()
        await box.start()
        with pytest.raises(sandlot.ExecTimeout):
            await box.exec("sleep", "5", timeout=0.2)
        await box.remove(force=True)
        return box.id

    box_id = asyncio.run(main())
    got = history(home, box=box_id)
    kinds = [e.kind for e in got]
    assert kinds[:5] == ["created", "crashed", "started", "crashed", "started"], kinds
    failed_boot, died = got[1], got[3]
    assert failed_boot.reason.startswith("boot failed: fake: the VM would not")
    assert failed_boot.state == "crashed"
    assert failed_boot.detail["op"] == "start" and failed_boot.detail["error"] == "BootError"
    assert died.reason == "the VM process exited unexpectedly" and "console" in died.detail
    timeout = got[5]
    assert timeout.kind == "command_timeout" and timeout.state == "running"
    assert timeout.detail["argv"] == ["sleep", "5"] and timeout.detail["timeout"] == 0.2
    assert "0.2s timeout" in timeout.reason
    assert kinds[-1] == "removed"


def test_another_process_follows_events_as_they_are_written(home: Path, root: Path) -> None:
    reader = textwrap.dedent(f"""
        import sandlot, sys
        print("ready", flush=True)
        for e in sandlot.events(home={str(home)!r}, since=-60):
            print(e.id, e.kind, e.box_name, flush=True)
            if e.kind == "removed":
                break
    """)
    proc = subprocess.Popen([sys.executable, "-c", reader], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # following, on an empty store

        async def main() -> None:
            box = new_box(home, root, keep=True, name="watched")
            await box.start()
            await box.stop()
            await box.remove()

        asyncio.run(main())
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert [line.split()[1:] for line in out.splitlines()] == [
        ["created", "watched"], ["started", "watched"], ["stopped", "watched"], ["removed", "watched"],
    ]  # fmt: skip


def test_a_cursor_continues_after_the_last_event_seen_and_since_filters_by_time(
    home: Path, root: Path
) -> None:
    async def main() -> None:
        box = new_box(home, root, keep=True)
        await box.start()
        await box.stop()
        await box.remove()

    asyncio.run(main())
    every = history(home)
    assert len(every) == 4
    assert [e.id for e in history(home, after=every[1].id)] == [e.id for e in every[2:]]
    assert history(home, after=every[-1].id) == []
    assert len(history(home, since=every[2].at)) == 2
    assert len(history(home, since=-3600)) == 4 and history(home, since=time.time() + 60) == []

    async def follow_then_stop() -> list[str]:
        seen = []
        async for e in sandlot.events_async(home=home, after=every[-1].id):
            seen.append(e.kind)
            break
        return seen

    async def both() -> list[str]:
        task = asyncio.ensure_future(follow_then_stop())
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting for a new event
        await main()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(both()) == ["created"]


def test_bad_queries_are_refused_with_a_reason(home: Path) -> None:
    for bad, match in (
        ({"since": "yesterday"}, "since"),
        ({"since": True}, "since"),
        ({"after": -1}, "after"),
        ({"after": 1.5}, "after"),
        ({"box": ""}, "box"),
        ({"box": 7}, "box"),
    ):
        with pytest.raises(sandlot.InvalidArgument, match=match):
            history(home, **bad)


def test_who_acted_and_why_follow_the_context(home: Path, root: Path) -> None:
    async def main() -> str:
        box = new_box(home, root, keep=True)
        with core_events.acting_as("key alice"):
            await box.start()
        with core_events.acting_as("idle", "idle for 30s"):
            await box.stop()
        await box.remove()
        return box.id

    box_id = asyncio.run(main())
    got = {e.kind: e for e in history(home, box=box_id)}
    assert got["started"].by == "key alice" and got["started"].reason is None
    assert got["stopped"].by == "idle" and got["stopped"].reason == "idle for 30s"
    assert got["removed"].by.startswith("process ")


def test_events_are_bounded_and_ids_are_never_used_again(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_store, "PRUNE_EVERY", 1)
    store = Runtime.for_home(home).store
    store.bounds = dataclasses.replace(store.bounds, events_keep=5)
    for i in range(12):
        store.add_event(core_events.draft("quota_refused", f"refusal {i}"), labels={"n": str(i)})
    kept = history(home)
    assert [e.reason for e in kept] == [f"refusal {i}" for i in range(7, 12)]
    assert [e.id for e in kept] == list(range(8, 13)) and kept[-1].labels == {"n": "11"}
    assert kept[0].box_id is None and kept[0].state is None
    with pytest.raises(ValueError, match="unknown event kind"):
        core_events.draft("exploded")


def test_a_warm_pool_vm_is_nobodys_box_until_claimed(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Filling, draining and refilling a pool writes nothing; a claim is a box's
    "created" and "started"."""
    monkeypatch.setenv("SANDLOT_POOL_MEMORY_MIB", "1024")

    async def main() -> str:
        await sandlot.template_async(rootfs=root, engine="fake", home=home, memory_mib=256, name="tpl")
        before = len(history(home))
        await sandlot.set_pool_async("tpl", 2, home=home, wait=True)
        assert len(history(home)) == before
        box = sandlot.AsyncBox(template="tpl", home=home, keep=True, name="claimed")
        await box.start()
        assert box.state == "running"
        await sandlot.set_pool_async("tpl", 0, home=home, wait=True)
        assert len(history(home)) == before + 2
        await box.remove(force=True)
        return box.id

    box_id = asyncio.run(main())
    got = history(home, box=box_id)
    assert [e.kind for e in got] == ["created", "started", "removed"]
    assert got[0].state == "running" and got[0].box_name == "claimed"


def test_a_failed_snapshot_is_an_event_and_removing_the_box_leaves_no_layer(home: Path, root: Path) -> None:
    """A snapshot moves the box onto a new top layer before it saves; when the save fails,
    the layer it froze is the box's alone, and goes with the box (found by a full disk's
    test: it stayed until the next sweep of old layers)."""

    async def main() -> str:
        box = new_box(home, root, keep=True)
        await box.start()
        FakeEngine.of(home).fail.add("save")
        with pytest.raises(sandlot.SavedStateError):
            await box.snapshot("never")
        FakeEngine.of(home).fail.discard("save")
        await box.remove(force=True)
        return box.id

    box_id = asyncio.run(main())
    failed = [e for e in history(home, box=box_id) if e.kind == "failed"]
    assert [(e.detail["op"], e.state, e.detail["error"]) for e in failed] == [
        ("snapshot", "running", "SavedStateError")
    ]
    assert "fake: save failed" in (failed[0].reason or "")
    assert sorted(p.name for p in (home / "layers").iterdir()) == []


def test_a_prefetching_iterator_runs_ahead_by_at_most_its_room_and_closes_what_it_drives() -> None:
    """``sandlot.events`` and ``box.events`` drive their async iterator from a task that runs
    a bounded number of records ahead (one round trip per record made a box's history of
    2000 events take 0.6 s); stopping early closes the iterator, and its errors reach the
    caller."""
    from sandlot.api import loop

    made, closed = [], []

    async def numbers(fail_at: int | None = None):  # type: ignore[no-untyped-def]
        try:
            for i in range(1000):
                if i == fail_at:
                    raise sandlot.InvalidArgument(f"no {i}")
                made.append(i)
                yield i
        finally:
            closed.append(True)

    for i, n in enumerate(loop.iterate(numbers(), prefetch=8)):
        assert n == i
        if i == 3:
            time.sleep(0.2)  # the task fills its room meanwhile, and no more
            assert len(made) <= 4 + 8 + 1, made
            break
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == [True]
    assert list(loop.iterate(numbers(), prefetch=8)) == list(range(1000))
    with pytest.raises(sandlot.InvalidArgument, match="no 5"):
        list(loop.iterate(numbers(fail_at=5), prefetch=8))
