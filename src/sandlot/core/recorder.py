"""The flight recorder: every step an agent takes in a box, kept with the state it left.

While a box records (``box.record()``, ``Box(record=True)``; its policy is a column
of its row, so every process and transport sees it), each step that reaches the box
through sandlot (an exec, a spawned process that ended, a code cell, a file write, a
tool call) is appended to its timeline (``core.timeline``) with a checkpoint: a live
snapshot of kind ``step``, which with the chunk store costs what changed since.

The checkpoint is taken after the step's answer is returned, in a task of its own, so
the step itself is never slower: the next step through this process waits until the
checkpoint's state is fixed (``fixed``: the guest runs again while a background
snapshot's memory is still written) and the guest's processes are listed
(``core.guestprocs``: those the step started and ended), so that each checkpoint holds
the state its step left and nothing of the next; reading the timeline waits for the
rows (``settled``). A caller that thinks between steps (a model) hides the checkpoint
in that time. Steps that run inside another (an exec's own process, a tool call's
commands) are that step's, not steps of their own (``OPEN``, ``group``). A program's
end waits for the checkpoints under way (``settle_all``: the CLI, the sync API's exit).

The policy: ``every`` (at most one checkpoint per that many seconds; a step between
is in the timeline without one), and a retention (``keep_last`` checkpoints, or those
of the last ``keep_for`` seconds), which never lets go of a named step's or of one
that boxes were started from. Retention drops checkpoints, never the timeline's rows.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, SandlotError, SnapshotInUse, StepNotFound
from . import guestprocs, timeline
from .state import BoxState
from .timeline import StepRecord

if TYPE_CHECKING:
    from ..protocol.exec import RemoteProcess
    from .controller import BoxController
    from .entry import BoxEntry
    from .livestate import LiveState
    from .store import SnapshotRecord

log = logging.getLogger("sandlot.recorder")

FILES_LISTED = 100  # changed paths a step's kept summary names (its full diff has them all)
EGRESS_LISTED = 200  # egress decisions one step lists (its counts count them all)
EGRESS_SLACK = 0.05  # seconds after a step's end that its connections' decisions may be logged
WATCH_GRACE = 1.0  # seconds a program's end waits for its followed processes' ends to be told


def egress_during(box_dir: Path, windows: list[tuple[int, float, float]]) -> dict[int, list[dict[str, Any]]]:
    """The egress decisions (``net``'s log of the box: each DNS answer, connection and
    refusal, with its time) made during each step's window ``(seq, started, ended)``."""
    windows = sorted(windows, key=lambda w: w[1])
    starts = [w[1] for w in windows]
    found: dict[int, list[dict[str, Any]]] = {}
    for name in ("egress.log.1", "egress.log"):  # the rotated half first: oldest lines first
        try:
            text = (box_dir / name).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                at = float(entry["time"])
            except (ValueError, KeyError, TypeError):
                continue
            i = bisect.bisect_right(starts, at) - 1
            if i >= 0 and at <= windows[i][2] + EGRESS_SLACK:
                found.setdefault(windows[i][0], []).append(entry)
    return found


def egress_counts(entries: list[dict[str, Any]]) -> dict[str, int]:
    """A step's decisions counted by what was decided (a folded line counts what it folded)."""
    counts: dict[str, int] = {}
    for e in entries:
        decision = str(e.get("decision") or "logged")
        counts[decision] = counts.get(decision, 0) + int(e.get("folded") or 1)
    return counts


@dataclass(frozen=True, slots=True)
class Policy:
    """How a box records: ``every`` (at most one checkpoint per that many seconds; 0:
    after every step), ``keep_last`` (checkpoints kept, newest first) and ``keep_for``
    (seconds a checkpoint is kept); named steps are kept whatever these say."""

    every: float = 0.0
    keep_last: int | None = None
    keep_for: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int | float) or not self.every >= 0:
            raise InvalidArgument(f"every must be a number of seconds >= 0, not {self.every!r}")
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1
        ):
            raise InvalidArgument(f"keep_last must be a whole number >= 1, not {self.keep_last!r}")
        seconds = isinstance(self.keep_for, int | float) and not isinstance(self.keep_for, bool)
        if self.keep_for is not None and not (seconds and self.keep_for > 0):
            raise InvalidArgument(f"keep_for must be a number of seconds > 0, not {self.keep_for!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> Policy | None:
        return None if d is None else cls(**{k: d[k] for k in ("every", "keep_last", "keep_for") if k in d})


def policy_of(recording: Mapping[str, Any] | None) -> Policy | None:
    """A row's ``recording`` column as a policy (None: the box does not record)."""
    return Policy.from_json(recording)


@dataclass
class StepDraft:
    """A step under way: what ran, and what its caller writes of how it ended."""

    kind: str
    what: dict[str, Any]
    started_at: float = field(default_factory=time.time)
    result: dict[str, Any] = field(default_factory=dict)

    def failed(self, exc: BaseException) -> None:
        self.result.setdefault("error", f"{type(exc).__name__}: {exc}"[:500])


OPEN: contextvars.ContextVar[StepDraft | None] = contextvars.ContextVar("sandlot_open_step", default=None)


class Recorder:
    """The flight recorder of one core (one event loop)."""

    def __init__(self, controller: BoxController, live: LiveState) -> None:
        self.controller = controller
        self.live = live
        self._pending: dict[str, asyncio.Task[StepRecord | None]] = {}
        self._last: dict[str, float] = {}  # when each box's last checkpoint was taken
        self._watching: set[asyncio.Task[None]] = set()  # spawned processes, to their end
        self._groups: dict[str, StepDraft] = {}  # each box's step opened by ``group``
        self._fixed: dict[str, asyncio.Event] = {}  # set once each box's last checkpoint's state is fixed

    # -- the policy ----------------------------------------------------------------------

    async def set_policy(self, entry: BoxEntry, policy: Policy | None) -> Policy | None:
        """Start recording the box with ``policy`` (its current state becomes a step of
        kind ``record``, the state later steps are measured from), change its policy, or
        stop (None; the timeline stays)."""
        was = policy_of(entry.record.recording)
        rec = await self.controller.db.update(entry.id, recording=policy.to_json() if policy else None)
        if rec is not None:
            entry.update(rec)
        if policy is not None and was is None:
            draft = StepDraft("record", {"policy": policy.to_json()})
            await self._keep(entry, draft, policy, forced=True)
        return policy

    # -- steps ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def step(self, entry: BoxEntry, kind: str, what: dict[str, Any]) -> AsyncIterator[StepDraft]:
        """One step of the box, if it records: the caller runs it in the block and fills
        the draft's ``result``; its checkpoint is taken once the block ends, in a task."""
        outer = self.open_step(entry)
        if outer is not None or policy_of(entry.record.recording) is None:  # inside another: that one's
            yield outer or StepDraft(kind, what)
            return
        await self.fixed(entry.id)
        draft = StepDraft(kind, what)
        token = OPEN.set(draft)
        try:
            yield draft
        except BaseException as exc:
            draft.failed(exc)
            raise
        finally:
            OPEN.reset(token)
            self.ended(entry, draft)

    @contextlib.asynccontextmanager
    async def group(self, entry: BoxEntry, kind: str, what: dict[str, Any]) -> AsyncIterator[None]:
        """Every call on the box through this core inside the block, whatever task makes
        it, is one step (``box.as_step``: a tool call and what it did)."""
        if self.open_step(entry) is not None or policy_of(entry.record.recording) is None:
            yield
            return
        await self.fixed(entry.id)
        draft = self._groups[entry.id] = StepDraft(kind, what)
        try:
            yield
        except BaseException as exc:
            draft.failed(exc)
            raise
        finally:
            del self._groups[entry.id]
            self.ended(entry, draft)

    def open_step(self, entry: BoxEntry) -> StepDraft | None:
        """The step a call on the box now belongs to: the one its task runs in, or the box's
        open group."""
        return OPEN.get() or self._groups.get(entry.id)

    def ended(self, entry: BoxEntry, draft: StepDraft) -> None:
        """A step that ended now (a spawned process's exit): into the timeline, after the
        box's steps before it, with its checkpoint, in a task."""
        policy = policy_of(entry.record.recording)
        if policy is None:
            return
        before, ended = self._pending.get(entry.id), time.time()
        fixed = self._fixed[entry.id] = asyncio.Event()

        async def keep() -> StepRecord | None:
            try:
                if before is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(before)
                return await self._keep(entry, draft, policy, ended=ended, fixed=fixed)
            finally:
                fixed.set()
                # the box's last step is in its timeline: nothing of it to wait for (a
                # server that records many boxes keeps nothing per box once they settle)
                if self._fixed.get(entry.id) is fixed:
                    del self._fixed[entry.id]
                if self._pending.get(entry.id) is asyncio.current_task():
                    del self._pending[entry.id]

        self._pending[entry.id] = asyncio.create_task(keep())

    def follow(self, entry: BoxEntry, process: RemoteProcess, what: dict[str, Any]) -> None:
        """A spawned process is a step once it ends (unless it runs inside one: an exec's)."""
        if self.open_step(entry) is not None:
            return
        draft = StepDraft("process", {**what, "pid": process.pid})

        async def watch() -> None:
            try:
                status = await process.wait(drain=False)
            except Exception as exc:  # the box went, or its connection: the step ended so
                draft.failed(exc)
            else:
                draft.result.update(exit_code=status.exit_code, signal=status.signal)
            self.ended(entry, draft)

        task = asyncio.create_task(watch())
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def fixed(self, box_id: str) -> None:
        """Once the state the box's last step left is fixed in its checkpoint, and its
        processes listed: the guest runs again while the checkpoint's memory is still
        written (``VM.save``), and the next step may begin then without reaching into the
        last one's state (nor reach the box before its row names the VM the save left
        running: gVisor's save runs the box in another)."""
        event = self._fixed.get(box_id)
        if event is not None:
            await event.wait()

    async def settled(self, box_id: str) -> StepRecord | None:
        """Once the box's last step is in its timeline (its checkpoint taken): that step."""
        task = self._pending.get(box_id)
        if task is None:
            return None
        with contextlib.suppress(Exception):
            return await asyncio.shield(task)
        return None

    async def settle_all(self) -> None:
        """Every step this recorder made, in its timeline: a program about to end waits for
        this. A followed process that just ended gets a moment to be told so; one still
        running is not waited for (its step is not in the timeline)."""
        if self._watching:
            await asyncio.wait(self._watching, timeout=WATCH_GRACE)
        for box_id in list(self._pending):
            await self.settled(box_id)

    async def _keep(
        self,
        entry: BoxEntry,
        draft: StepDraft,
        policy: Policy,
        *,
        ended: float | None = None,
        forced: bool = False,
        fixed: asyncio.Event | None = None,
    ) -> StepRecord | None:
        db = self.controller.db
        snap_id, why = None, None
        result = dict(draft.result)
        since = time.time() - self._last.get(entry.id, 0.0)
        take = forced or not policy.every or since >= policy.every
        if not take:
            why = f"within {policy.every:g}s of the last checkpoint"
        try:
            snap_id = await self._checkpoint(entry, result, fixed=fixed, take=take)
        except SandlotError as exc:  # the step happened; only its state is not kept
            why = f"{type(exc).__name__}: {exc}"[:300]
        if snap_id is None and why is None:
            why = f"the box is {entry.state}"
        if why is not None:
            result["no_checkpoint"] = why
        row = StepRecord(
            box_id=entry.id, seq=0, kind=draft.kind, what=draft.what, result=result,
            started_at=draft.started_at, ended_at=ended or time.time(), snapshot_id=snap_id,
        )  # fmt: skip
        try:
            kept = await db.call(timeline.add_step, row)
        except SandlotError as exc:
            log.warning("box %s: step %s not recorded: %s", entry.name, draft.kind, exc)
            if snap_id is not None:
                with contextlib.suppress(SandlotError):
                    await self._drop(snap_id)
            return None
        await self._retain(entry, policy)
        return kept

    async def _checkpoint(
        self,
        entry: BoxEntry,
        result: dict[str, Any],
        *,
        fixed: asyncio.Event | None = None,
        take: bool = True,
    ) -> str | None:
        """If the box runs: the processes the step left, into its ``result``, then
        (``take``) a live snapshot of kind ``step`` of the box now, its id (``fixed``: set
        once the state saved can no longer change). The listing comes first, while the
        guest runs warm (the first command after a save finds the emulator's translations
        of the guest's code gone), and has ended before the save begins."""
        controller, live = self.controller, self.live
        if entry.removed:
            return None
        async with entry.lock():
            rec = await controller.refresh(entry)
            if rec.state != BoxState.RUNNING:
                return None  # (and its agent is not asked: that would wake a box asleep)
            await self._list(entry, result)
            if not take:
                return None
            snap = await live.capture(entry, "step", fixed=fixed)
        self._last[entry.id] = time.time()
        return snap.id

    async def _list(self, entry: BoxEntry, result: dict[str, Any]) -> None:
        if (processes := await self._processes(entry)) is not None:
            result["processes"] = processes

    async def _processes(self, entry: BoxEntry) -> dict[str, Any] | None:
        """The guest's processes after a step (``core.guestprocs``), against those after the
        step before (its row's)."""
        try:
            kept = await self.controller.db.call(timeline.last_result, entry.id, "processes")
            before, kernel = guestprocs.from_kept(kept)
            now = await guestprocs.listing(await self.controller.connection(entry), before or {}, kernel)
        except SandlotError:
            return None
        return None if now is None else guestprocs.changes(before, now)

    async def _retain(self, entry: BoxEntry, policy: Policy) -> None:
        if policy.keep_last is None and policy.keep_for is None:
            return
        older = time.time() - policy.keep_for if policy.keep_for is not None else None
        db = self.controller.db
        for old in await db.call(timeline.expired, entry.id, keep_last=policy.keep_last, older_than=older):
            assert old.snapshot_id is not None
            with contextlib.suppress(SnapshotInUse, SandlotError):  # boxes started from it keep it
                await self._drop(old.snapshot_id)

    async def _drop(self, snap_id: str) -> None:
        snap = await self.controller.db.find_snapshot(snap_id)
        if snap is not None:
            await self.live.remove_snapshot(snap)

    # -- going back ----------------------------------------------------------------------

    async def find(self, entry: BoxEntry, step: int | str) -> StepRecord:
        """A step of the box by its number or its name."""
        db = self.controller.db
        await self.settled(entry.id)
        if isinstance(step, str) and not step.isdigit():
            return await db.call(timeline.by_name, entry.id, step)
        if isinstance(step, str):
            step = int(step)
        return await db.call(timeline.step, entry.id, step)

    async def checkpoint_of(self, entry: BoxEntry, step: int | str) -> tuple[StepRecord, SnapshotRecord]:
        """A step and its checkpoint (StepNotFound naming the nearest kept one if it has none)."""
        found = await self.find(entry, step)
        snap = None
        if found.snapshot_id is not None:
            snap = await self.controller.db.find_snapshot(found.snapshot_id)
        if snap is None:
            every = await self.controller.db.call(timeline.steps, entry.id)
            kept = [s.seq for s in every if s.snapshot_id]
            near = ", ".join(str(s) for s in kept[-5:]) or "none"
            raise StepNotFound(
                f"step {found.seq} of box {entry.name} has no checkpoint kept "
                f"({found.result.get('no_checkpoint') or 'retention let it go'}); steps with one: {near}"
            )
        return found, snap

    async def rewind(self, entry: BoxEntry, step: int | str) -> StepRecord | None:
        """The box back, in place, to the state just after ``step``: memory, processes and
        disk. The rewind is a step of the timeline too, whose checkpoint is that step's."""
        await self.settled(entry.id)
        found, snap = await self.checkpoint_of(entry, step)
        started = time.time()
        await self.live.rollback(entry, snap)
        kept = found.result.get("processes") or {}
        baseline = {k: kept[k] for k in ("running", "count", "kernel") if k in kept}  # for the next step
        result = {"processes": baseline} if baseline else {}
        return await self._appended(entry, "rewind", {"to": found.seq}, started, snap.id, result)

    async def _appended(
        self,
        entry: BoxEntry,
        kind: str,
        what: dict[str, Any],
        started: float,
        snapshot_id: str,
        result: dict[str, Any] | None = None,
    ) -> StepRecord | None:
        """A step of the recorder's own (a rewind, a promotion) whose checkpoint is a state
        the box already has, in the timeline if the box records."""
        if policy_of(entry.record.recording) is None:
            return None
        if result is None:  # the processes the state has, listed now: the next step's baseline
            listed = None
            with contextlib.suppress(SandlotError):
                listed = await guestprocs.listing(await self.controller.connection(entry), {}, set())
            result = {"processes": guestprocs.changes(None, listed)} if listed is not None else {}
        row = StepRecord(
            box_id=entry.id, seq=0, kind=kind, what=what, result=result, started_at=started,
            ended_at=time.time(), snapshot_id=snapshot_id,
        )  # fmt: skip
        return await self.controller.db.call(timeline.add_step, row)

    async def fork_at(
        self, entry: BoxEntry, step: int | str, n: int = 1, *, name: str | None = None
    ) -> list[BoxEntry]:
        """``n`` running boxes in the state just after ``step``; the box goes on as it is."""
        _found, snap = await self.checkpoint_of(entry, step)
        labels = dict(entry.spec.labels)
        return await self.live.start_boxes(snap, n, name=name, as_prefix=True, labels=labels)

    async def promote(self, entry: BoxEntry, child: BoxEntry) -> SnapshotRecord:
        """``child``, a box started from a state of this box (a fork, a fork at a step),
        becomes this box: its memory, processes and disk move in under this box's id, name,
        published ports, preview URLs, volumes and lease (a rollback of this box to a
        snapshot of the child taken now), and the child goes. What this box was is kept as
        a snapshot of it, returned. While the box records, the promotion is a step whose
        checkpoint is the state it took on."""
        if child.id == entry.id:
            raise InvalidArgument(f"box {entry.name} cannot take its own place")
        origin = await self.controller.db.find_snapshot(child.record.origin) if child.record.origin else None
        if origin is None or origin.box_id != entry.id:
            raise InvalidArgument(
                f"box {child.name} was not started from a state of box {entry.name}: only its forks "
                "(fork, fork_at, a snapshot's start) take its place"
            )
        await self.settled(entry.id)
        started = time.time()
        kept = await self.live.snapshot(entry)
        async with child.lock():
            await self.controller.refresh(child)
            moved = await self.live.capture(child, "step")
        # the child's state becomes this box's own (a checkpoint of its timeline, which goes
        # with it), before this box rolls back to it and the child goes
        db = self.controller.db
        await db.update_snapshot(moved.id, box_id=entry.id, box_name=entry.name)
        moved = await db.find_snapshot(moved.id) or moved
        await self.live.rollback(entry, moved)
        await self.controller.remove(child, force=True)
        await self._appended(entry, "promote", {"child": child.name, "kept": kept.id}, started, moved.id)
        return kept

    async def compared(self, entry: BoxEntry, step: StepRecord) -> tuple[StepRecord, str, str]:
        """What a step changed is its checkpoint against the kept one before it: that step,
        and the two sides of the diff (``core.diffs``)."""
        # a row names a checkpoint that exists: a snapshot's removal clears the rows that
        # name it in its own transaction (``BoxStore.delete_snapshot``)
        if step.snapshot_id is None:
            raise StepNotFound(f"step {step.seq} has no checkpoint kept: what it changed is not known")
        for earlier in reversed(await self.controller.db.call(timeline.steps, entry.id, before=step.seq)):
            if earlier.snapshot_id:
                return earlier, f"snapshot:{earlier.snapshot_id}", f"snapshot:{step.snapshot_id}"
        raise StepNotFound(f"no checkpoint before step {step.seq} is kept: what it changed is not known")

    async def keep_files(
        self, entry: BoxEntry, step: StepRecord, since: StepRecord, found: dict[str, Any]
    ) -> None:
        """A step's diff's summary, into its row."""
        changed = [{"path": c["path"], "status": c["status"]} for c in found["changes"][:FILES_LISTED]]
        kept = {**found["stat"], "since_step": since.seq, "changes": changed}
        await self.controller.db.call(timeline.set_files, entry.id, step.seq, kept)
