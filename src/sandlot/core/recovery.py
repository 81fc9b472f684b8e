"""Recovery: make a box's row agree with its processes after crashes.

There is no daemon: whoever reads a box next finishes or undoes what a dead
process left half done. What to do is a table over three facts:

* the recorded state,
* whether the process that recorded it (the *owner* of an operation in
  progress) still lives,
* what the VM process is doing (``VMStatus``, asked of the engine).

``TABLE`` lists the rows, first match wins; ``decide`` looks a case up and
``Recovery.apply`` carries the action out. Each row has a unit test (with the
fake engine), and the rows read as the rules they are.

Everything here blocks (it may ask QEMU over QMP); async code runs it in a
worker thread.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import pids
from ..engine.base import VMStatus
from . import events, snapshots
from .boxrecord import BoxRecord, needs_recovery, pool_vm, unheld
from .events import Draft
from .runtime import Runtime
from .state import STABLE, BoxState
from .store import BoxStore

S, V = BoxState, VMStatus
ALIVE = frozenset({V.RUNNING, V.PAUSED, V.LOADING, V.SAVING, V.UNKNOWN})
GONE = frozenset({V.GONE})
ANY_VM = ALIVE | GONE


class Action(enum.StrEnum):
    KEEP = "keep"  # the row is right
    DISCARD = "discard"  # end the VM and delete the box: it never fully existed, or was on its way out
    RUN = "run"  # the VM runs: the row says running
    CRASH = "crash"  # the VM is gone (or never ran): crashed, with the reason
    STOP = "stop"  # end the VM: stopped
    SUSPEND = "suspend"  # the state was saved: end the VM, suspended
    UNSAVE = "unsave"  # a save was cut short: cancel it, let the guest run, back where it was
    ROLLED = "rolled"  # a rollback's guest runs: running on the new disk
    UNROLL = "unroll"  # a rollback never ran: end the VM, stopped on the old disk
    RESUMED = "resumed"  # a resume's guest runs: running, its saved state dropped
    UNRESUME = "unresume"  # a resume never ran: end the VM, suspended as before
    END_VM = "end-vm"  # a VM that should not exist (a suspended box's): end it, keep the row


# The state each action writes (core/state.py declares every pair a rule makes of them:
# tests/unit/test_state_writes.py); UNSAVE's is the state the cut-short save began in.
WRITES: dict[Action, BoxState] = {
    Action.RUN: S.RUNNING,
    Action.CRASH: S.CRASHED,
    Action.STOP: S.STOPPED,
    Action.SUSPEND: S.SUSPENDED,
    Action.ROLLED: S.RUNNING,
    Action.UNROLL: S.STOPPED,
    Action.RESUMED: S.RUNNING,
    Action.UNRESUME: S.SUSPENDED,
}


@dataclass(frozen=True, slots=True)
class Rule:
    states: frozenset[BoxState] | None  # None: any
    owner_alive: bool | None  # None: either
    vm: frozenset[VMStatus]
    action: Action
    reason: str = ""
    when: Callable[[BoxRecord], bool] | None = None
    doc: str = ""
    # the box's engine ends the VM process to save its state (gVisor's runsc checkpoint);
    # None: either
    save_ends_vm: bool | None = None


def _suspend_saved(rec: BoxRecord) -> bool:
    return rec.suspended is not None


def _has_new_disk(rec: BoxRecord) -> bool:
    return bool(rec.op and rec.op.get("disk"))


def _pool_vm_unready(rec: BoxRecord) -> bool:
    return pool_vm(rec) and rec.state != BoxState.POOLED


def _states(*states: BoxState) -> frozenset[BoxState]:
    return frozenset(states)


TABLE: tuple[Rule, ...] = (
    Rule(_states(S.POOLED), None, GONE, Action.DISCARD, when=pool_vm,
         doc="a warm pool's VM that exited: it goes, and the pool refills"),
    Rule(None, False, ANY_VM, Action.DISCARD, when=_pool_vm_unready,
         doc="a pool VM whose filler or claimer died before it was done: nobody shares or owns it"),
    Rule(None, False, ANY_VM, Action.DISCARD, when=unheld,
         doc="a `with` block whose process died: the box goes with it (no other process is "
             "running an operation on it)"),
    Rule(STABLE, True, ANY_VM, Action.DISCARD, when=unheld,
         doc="the same, where another process, still alive, ran the box's last operation"),
    Rule(_states(S.CREATING, S.REMOVING), True, ANY_VM, Action.KEEP, doc="being made or removed"),
    Rule(_states(S.CREATING, S.REMOVING), False, ANY_VM, Action.DISCARD,
         doc="its maker or remover died: finish removing it"),
    Rule(_states(S.STARTING), False, frozenset({V.RUNNING, V.UNKNOWN}), Action.RUN,
         doc="the starter died; the guest runs on alone"),
    Rule(_states(S.STARTING), False, frozenset({V.PAUSED, V.LOADING, V.SAVING}), Action.CRASH,
         "the process starting it died before its guest ran", doc="a restore that was never let run"),
    Rule(_states(S.STARTING), False, GONE, Action.CRASH, "the process starting it died, and the VM with it"),
    Rule(_states(S.STOPPING), False, ANY_VM, Action.STOP, doc="the stopper died: the VM is made to follow"),
    Rule(_states(S.SUSPENDING), False, ANY_VM, Action.SUSPEND, when=_suspend_saved,
         doc="the state was saved and recorded; only ending the VM was left"),
    Rule(_states(S.SNAPSHOTTING, S.SUSPENDING), False, ALIVE, Action.UNSAVE,
         doc="a save cut short: the VM goes on as it was"),
    Rule(_states(S.SNAPSHOTTING, S.SUSPENDING), False, GONE, Action.STOP,
         "its process died while the state was saved, before the box ran on from it; it stopped with "
         "its files as they were saved", save_ends_vm=True,
         doc="a save that ends the VM (runsc checkpoint) whose owner died before the restore: stopped, "
             "files kept, nothing half-restored left running"),
    Rule(_states(S.SNAPSHOTTING, S.SUSPENDING), False, GONE, Action.CRASH,
         "the VM exited while saving its state"),
    Rule(_states(S.RESUMING), False, frozenset({V.RUNNING}), Action.RESUMED, doc="the guest came back"),
    Rule(_states(S.RESUMING), False, ANY_VM, Action.UNRESUME,
         doc="the guest never ran: the saved state still matches the disk"),
    Rule(_states(S.RESTORING), False, frozenset({V.RUNNING}), Action.ROLLED, when=_has_new_disk,
         doc="the rolled-back guest runs"),
    Rule(_states(S.RESTORING), False, ANY_VM, Action.UNROLL,
         "a rollback was interrupted; the disk is as it was before it"),
    Rule(_states(S.SUSPENDED), None, ALIVE, Action.END_VM,
         doc="the state was saved; the VM was about to be ended"),
    Rule(_states(S.RUNNING, S.PAUSED), None, GONE, Action.CRASH,
         "the VM process exited unexpectedly (killed, or the host restarted)"),
    Rule(None, None, ANY_VM, Action.KEEP, doc="everything else is as recorded"),
)  # fmt: skip


def decide(rec: BoxRecord, owner_alive: bool, vm: VMStatus, *, save_ends_vm: bool = False) -> Rule:
    """The first rule matching (recorded state, owner alive, VM status, and whether the
    box's engine ends the VM to save it)."""
    state = BoxState(rec.state)
    for rule in TABLE:
        if rule.states is not None and state not in rule.states:
            continue
        if rule.owner_alive is not None and rule.owner_alive != owner_alive:
            continue
        if rule.save_ends_vm is not None and rule.save_ends_vm != save_ends_vm:
            continue
        if vm not in rule.vm:
            continue
        if rule.when is not None and not rule.when(rec):
            continue
        return rule
    raise AssertionError("the last rule matches everything")


# the states whose rows need the VM's exact status, not only whether it lives
_PROBED = _states(S.STARTING, S.SNAPSHOTTING, S.SUSPENDING, S.RESUMING, S.RESTORING)


RECOVERY = "recovery"  # who its events say acted


class Recovery:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def facts(self, rec: BoxRecord) -> tuple[bool, VMStatus]:
        """(owner alive, VM status) of a row; asks the VM only where the table needs it."""
        owner_alive = pids.alive(rec.owner_pid, rec.owner_start)
        engine = self.rt.engine(rec.engine)
        if not engine.alive(rec.vm, rec.id):
            return owner_alive, V.GONE
        if BoxState(rec.state) in _PROBED and not owner_alive:
            where = self.rt.placement(rec, rec.name)
            return owner_alive, engine.probe(rec.vm, where)
        return owner_alive, V.UNKNOWN

    def needed(self, rec: BoxRecord) -> bool:
        """Cheap (no QMP): whether ``apply`` could change anything."""
        return needs_recovery(rec, lambda r: self.rt.engine(r.engine).alive(r.vm, r.id))

    def apply(self, rec: BoxRecord) -> BoxRecord | None:
        """Carry out what the table says for ``rec``; the row after it, or None if the box is gone."""
        if not self.needed(rec):
            return rec
        owner_alive, vm = self.facts(rec)
        rule = decide(rec, owner_alive, vm, save_ends_vm=self.rt.engine(rec.engine).save_ends_vm)
        return self.carry_out(rec, rule)

    def carry_out(self, rec: BoxRecord, rule: Rule) -> BoxRecord | None:
        store, engine = self.rt.store, self.rt.engine(rec.engine)
        a = rule.action
        expect = (rec.state,)

        def update(**changes: Any) -> BoxRecord | None:
            event = self._event(rec, a, rule.reason, changes.get("state"))
            done = store.in_room(BoxStore.update, rec.id, expect=expect, event=event, **changes)
            return done or store.find(rec.id)

        if a is Action.KEEP:
            return rec
        if a is Action.DISCARD:
            engine.kill_now(rec.vm, rec.id)
            self.rt.discard_box(rec, Draft("removed", rule.reason, {"action": a.value}, RECOVERY))
            return None
        if a is Action.RUN:
            return update(state=WRITES[a])
        if a is Action.END_VM:
            engine.kill_now(rec.vm, rec.id)
            return rec
        if a is Action.UNSAVE:
            assert rec.vm is not None
            source = BoxState((rec.op or {}).get("source") or S.RUNNING)
            engine.abort_save(rec.vm, self.rt.placement(rec, rec.name), resume=source == S.RUNNING)
            self._drop_pending_snapshot(rec)
            return update(state=source, op=None)
        if a is Action.ROLLED:
            assert rec.op is not None
            tops = rec.op.get("drives") or [d["top"] for d in rec.drives]
            drives = [{**d, "top": top} for d, top in zip(rec.drives, tops, strict=True)]
            return update(state=WRITES[a], disk=rec.op["disk"], drives=drives, op=None)
        if a is Action.RESUMED:
            return update(state=WRITES[a], suspended=None, op=None)
        engine.kill_now(rec.vm, rec.id)
        if a is Action.CRASH:
            return update(state=WRITES[a], vm_pid=None, reason=rule.reason, op=None)
        if a is Action.STOP:
            # a sandbox restored after its owner died runs under a pid no row names: the
            # engine ends whatever the box left (a no-op for QEMU, whose VM is its process)
            engine.forget(self.rt.placement(rec, rec.name))
            changes: dict[str, Any] = {"reason": rule.reason} if rule.reason else {}
            if rule.save_ends_vm:
                self._drop_pending_snapshot(rec)
            return update(state=WRITES[a], vm_pid=None, stopped_at=time.time(), op=None, **changes)
        if a in (Action.SUSPEND, Action.UNRESUME):
            return update(state=WRITES[a], vm_pid=None, op=None)
        if a is Action.UNROLL:
            return update(state=WRITES[a], vm_pid=None, op=None, reason=rule.reason)
        raise AssertionError(f"unhandled recovery action {a}")

    def _event(self, rec: BoxRecord, action: Action, reason: str | None, state: BoxState | None) -> Draft:
        """What recovery's change of a row tells of: a crash (with the console's tail), a
        stop or a suspend it carried out, or an operation it finished or undid."""
        detail: dict[str, Any] = {"action": action.value, "was": rec.state}
        if state == BoxState.CRASHED:
            console = ""
            with contextlib.suppress(Exception):  # an engine this host lacks now: no tail, still the crash
                where = self.rt.placement(rec, rec.name)
                console = self.rt.engine(rec.engine).console_tail(where, events.CONSOLE_TAIL)
            return Draft("crashed", reason, {**detail, "console": console}, RECOVERY)
        kind = {Action.STOP: "stopped", Action.SUSPEND: "suspended"}.get(action, "recovered")
        return Draft(kind, reason, detail, RECOVERY)

    def _drop_pending_snapshot(self, rec: BoxRecord) -> None:
        """A save cut short leaves no snapshot behind (its directory is a temporary one,
        swept later; its row was never written)."""
        snap_id = (rec.op or {}).get("snapshot")
        if snap_id and self.rt.store.find_snapshot(snap_id) is None:
            snapshots.remove_files(self.rt.home, snap_id)
