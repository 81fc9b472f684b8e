"""Every write of a box's state is a declared transition (core/state.py): the store
refuses a pair the table does not list, a state write that does not say what it
expects, and a row born in any state but creating (or suspended, pulled whole from
the storage tier). What no caller asks for is declared too: a VM's death
(``Op.CRASH``), a lost suspended state (``Op.LOSE``) and recovery's ends."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import sandlot
from sandlot.core.recovery import TABLE, WRITES, Action, Rule
from sandlot.core.state import AFTER_DEATH, BORN, DECLARED, TRANSITIONS, BoxState, Op, allowed
from sandlot.core.store import BoxRecord, BoxStore
from sandlot.errors import InvalidState

from tests.support.fake_engine import FakeEngine, fake_rootfs, register

register()
S = BoxState


def row(state: BoxState, box_id: str = "b00000000001") -> BoxRecord:
    now = time.time()
    return BoxRecord(id=box_id, name=f"n-{box_id}", state=str(state), options={}, created_at=now,
                     updated_at=now)  # fmt: skip


def test_every_declared_pair_comes_from_an_operation_or_a_death() -> None:
    for op, t in TRANSITIONS.items():
        for source in t.sources:
            if t.via is not None:
                assert allowed(source, t.via) and allowed(t.via, t.target or source), op
                assert allowed(t.via, t.failure or source) and allowed(t.via, source), op  # called off
            else:
                assert allowed(source, t.target or source) and allowed(source, t.failure or source), op
    assert allowed(S.CREATING, S.CREATED)
    assert AFTER_DEATH <= DECLARED
    # and nothing else: a stopped box never runs without starting, a suspended one never
    # runs without a resume, and nothing leaves removing but back where it was
    never = [(S.STOPPED, S.RUNNING), (S.SUSPENDED, S.RUNNING), (S.CREATED, S.RUNNING),
             (S.CRASHED, S.RUNNING), (S.REMOVING, S.STARTING), (S.POOLED, S.RUNNING)]  # fmt: skip
    for before, after in never:
        assert not allowed(before, after), (before, after)


WRITING = [r for r in TABLE if r.action in WRITES or r.action is Action.UNSAVE]
NAMES = [f"{r.action.value}-{'-'.join(sorted(r.states or ['any']))}" for r in WRITING]


@pytest.mark.parametrize("rule", WRITING, ids=NAMES)
def test_each_recovery_rule_writes_a_declared_transition(rule: Rule) -> None:
    states, action = rule.states or set(BoxState), rule.action
    # a save cut short goes back to the state it began in: running or paused
    ends = [S.RUNNING, S.PAUSED] if action is Action.UNSAVE else [WRITES[action]]
    for before in states:
        for after in ends:
            assert allowed(before, after), f"recovery's {action.value} writes {before} -> {after}"


def test_the_store_refuses_an_undeclared_pair_and_changes_nothing(tmp_path: Path) -> None:
    store = BoxStore(tmp_path / "sandlot.db")
    store.insert(row(S.CREATING))
    assert store.update("b00000000001", expect=(S.CREATING,), state=S.CREATED) is not None
    with pytest.raises(InvalidState) as err:
        store.update("b00000000001", expect=(S.CREATED,), state=S.RUNNING)
    assert "created to running" in str(err.value) and err.value.state == "created"
    assert set(err.value.allowed) == {"starting", "removing"}
    assert store.get("b00000000001").state == "created"
    with pytest.raises(InvalidState, match="must say which states it expects"):
        store.update("b00000000001", state=S.STARTING)
    # one undeclared pair among those expected is enough to refuse
    with pytest.raises(InvalidState, match="running to starting"):
        store.update("b00000000001", expect=(S.CREATED, S.RUNNING), state=S.STARTING)
    assert store.get("b00000000001").state == "created"
    # a write that leaves the state as it is, or changes no state, needs no declaration
    assert store.update("b00000000001", expect=(S.CREATED,), state=S.CREATED, reason="x") is not None
    assert store.update("b00000000001", reason="y") is not None


@pytest.mark.parametrize("state", sorted(set(BoxState) - BORN))
def test_a_row_is_born_only_creating_or_suspended(tmp_path: Path, state: BoxState) -> None:
    store = BoxStore(tmp_path / "sandlot.db")
    with pytest.raises(InvalidState, match=f"cannot be made {state}"):
        store.insert(row(state))
    assert store.list() == []


async def fake_box(home: Path, tmp_path: Path) -> sandlot.AsyncBox:
    return await sandlot.AsyncBox(rootfs=fake_rootfs(tmp_path), engine="fake", keep=True, home=home).start()


def test_a_vm_that_dies_is_a_declared_crash(home: Path, tmp_path: Path) -> None:
    async def main() -> None:
        box = await fake_box(home, tmp_path)
        proc = await box.spawn("sleep", "30")
        (vm,) = FakeEngine.of(home).vms.values()
        vm.die(137)  # seen by the call waiting on it
        with pytest.raises((sandlot.BoxCrashed, sandlot.ConnectionLost)):
            await proc.wait(5)
        assert await box.refresh() == TRANSITIONS[Op.CRASH].target
        last = [e async for e in box.events(follow=False)][-1]
        assert (last.kind, last.reason) == ("crashed", "the VM process exited unexpectedly")
        await box.remove(force=True)

    asyncio.run(main())


def test_a_resume_whose_saved_state_is_gone_is_a_declared_loss(home: Path, tmp_path: Path) -> None:
    async def main() -> None:
        box = await fake_box(home, tmp_path)
        await box.suspend()
        suspended = (await box.inspect())["suspended"]
        BoxStore(home / "sandlot.db").delete_snapshot(suspended)  # gone, as by a hand in the home
        with pytest.raises(sandlot.InvalidState, match="suspended state is missing") as err:
            await box.resume()
        assert err.value.state == "crashed"
        assert await box.refresh() == TRANSITIONS[Op.LOSE].target
        [lost] = [e async for e in box.events(follow=False) if e.kind == "crashed"]
        assert lost.reason == "its suspended state is missing" and lost.detail["saved_state_discarded"]
        assert (await box.inspect())["suspended"] is None
        await box.start()  # boots afresh
        assert await box.refresh() == "running"
        await box.remove(force=True)

    asyncio.run(main())
