"""A box's states and the transitions between them, declared in one table.

Every operation that changes a box's state is an ``Op``. Its ``Transition``
says from which states it may start (``sources``), in which states there is
nothing to do (``done``), the state the box is in while it runs (``via``,
recorded with the process that runs it, so recovery can tell a live operation
from one whose process died), where it ends (``target``) and where it falls
when it fails (``failure``; ``SOURCE`` means back where it started).

``check`` is the one guard: it raises ``InvalidState`` (with ``.state`` and
``.allowed``) for any other state. ``BoxController.transition`` applies it and
writes ``via``, ``target`` and ``failure`` through the store.

What no caller asks for is declared here too: a VM that dies (``Op.CRASH``), a
suspended box whose saved state is gone (``Op.LOSE``), and the ends recovery gives
an operation whose process died (``AFTER_DEATH``). The store refuses any write of a
state that does not say which states it expects, and any pair of states
``allowed`` does not list; a row is made only in a state of ``BORN``.

>>> from sandlot.core.state import BoxState, Op, TRANSITIONS
>>> TRANSITIONS[Op.START].failure
<BoxState.CRASHED: 'crashed'>
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import InvalidState


class BoxState(enum.StrEnum):
    # what users see
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    STOPPED = "stopped"
    CRASHED = "crashed"
    # a warm pool's VM (``core.pools``): restored from its template, paused until claimed
    POOLED = "pooled"
    # an operation in progress: recovery finishes or undoes it if its process died
    CREATING = "creating"
    STARTING = "starting"
    STOPPING = "stopping"
    REMOVING = "removing"
    SNAPSHOTTING = "snapshotting"
    SUSPENDING = "suspending"
    RESUMING = "resuming"
    RESTORING = "restoring"
    CLAIMING = "claiming"  # a pool VM taken by a box: resumed and re-identified

    @property
    def transient(self) -> bool:
        return self in TRANSIENT

    @property
    def live(self) -> bool:
        """A VM process belongs to the box in this state."""
        return self in LIVE


STABLE = frozenset({BoxState.CREATED, BoxState.RUNNING, BoxState.PAUSED, BoxState.SUSPENDED,
                    BoxState.STOPPED, BoxState.CRASHED, BoxState.POOLED})  # fmt: skip
TRANSIENT = frozenset(set(BoxState) - STABLE)
LIVE = frozenset({BoxState.RUNNING, BoxState.PAUSED, BoxState.STARTING, BoxState.STOPPING,
                  BoxState.SNAPSHOTTING, BoxState.SUSPENDING, BoxState.RESUMING,
                  BoxState.RESTORING, BoxState.POOLED, BoxState.CLAIMING})  # fmt: skip
# Commands can run in these states (a snapshot pauses the VM only for its save).
SERVING = frozenset({BoxState.RUNNING, BoxState.SNAPSHOTTING})


class Op(enum.StrEnum):
    CREATE = "create"
    START = "start"  # a cold boot, or the first start of a box made from a saved state
    STOP = "stop"
    DISCARD = "discard"  # stop of a suspended box: its saved processes end, the disk stays
    KILL = "kill"
    PAUSE = "pause"
    UNPAUSE = "unpause"
    REMOVE = "remove"
    SNAPSHOT = "snapshot"
    SUSPEND = "suspend"
    RESUME = "resume"
    ROLLBACK = "rollback"
    NETWORK = "network"  # a policy change: no state change, but no operation may run meanwhile
    POOL = "pool"  # a pool VM made ready (its HELLO and first exec done) is paused until claimed
    CLAIM = "claim"  # a box takes a pool VM (core.pools: its start is a compare-and-swap)
    CRASH = "crash"  # its VM died: seen by a call to it (no lock: the row's pid says which VM)
    LOSE = "lose"  # a resume finds the suspended state gone: crashed, start() boots it afresh


SOURCE = None  # as a failure state: back to the state the operation started from

_ANY_STABLE = tuple(sorted(STABLE))


@dataclass(frozen=True, slots=True)
class Transition:
    sources: tuple[BoxState, ...]
    via: BoxState | None
    target: BoxState | None  # None: back to the source (a snapshot leaves the box as it was)
    failure: BoxState | None  # None (SOURCE): back to the source
    done: tuple[BoxState, ...] = ()  # already where the operation leads: nothing to do


S = BoxState
TRANSITIONS: dict[Op, Transition] = {
    Op.CREATE: Transition((), S.CREATING, S.CREATED, failure=SOURCE),  # a failed create leaves no box
    Op.START: Transition(
        (S.CREATED, S.STOPPED, S.CRASHED), S.STARTING, S.RUNNING, S.CRASHED, done=(S.RUNNING,)
    ),
    # an operation in progress holds the box's lock, so another one only ever sees stable states
    Op.STOP: Transition(
        (S.RUNNING, S.PAUSED), S.STOPPING, S.STOPPED, S.STOPPED, done=(S.CREATED, S.STOPPED, S.CRASHED)
    ),
    Op.DISCARD: Transition((S.SUSPENDED,), None, S.STOPPED, SOURCE),
    # stopping while the VM is killed: a box seen running with its VM gone is a crash, and
    # another process that looks meanwhile (the box's watchdog) must not take the kill for one
    Op.KILL: Transition(
        (S.RUNNING, S.PAUSED),
        S.STOPPING,
        S.STOPPED,
        S.STOPPED,
        done=(S.CREATED, S.STOPPED, S.CRASHED, S.SUSPENDED),
    ),
    Op.PAUSE: Transition((S.RUNNING,), None, S.PAUSED, SOURCE, done=(S.PAUSED,)),
    Op.UNPAUSE: Transition((S.PAUSED,), None, S.RUNNING, SOURCE, done=(S.RUNNING,)),
    Op.REMOVE: Transition(_ANY_STABLE, S.REMOVING, None, SOURCE),
    Op.SNAPSHOT: Transition((S.RUNNING, S.PAUSED), S.SNAPSHOTTING, None, SOURCE),
    Op.SUSPEND: Transition((S.RUNNING, S.PAUSED), S.SUSPENDING, S.SUSPENDED, SOURCE, done=(S.SUSPENDED,)),
    Op.RESUME: Transition((S.SUSPENDED,), S.RESUMING, S.RUNNING, S.SUSPENDED, done=(S.RUNNING, S.PAUSED)),
    # a box never started has no snapshots of its own to go back to
    Op.ROLLBACK: Transition(
        (S.RUNNING, S.PAUSED, S.SUSPENDED, S.STOPPED, S.CRASHED), S.RESTORING, S.RUNNING, S.STOPPED
    ),
    Op.NETWORK: Transition(_ANY_STABLE, None, None, SOURCE),
    Op.POOL: Transition((S.RUNNING,), None, S.POOLED, SOURCE, done=(S.POOLED,)),
    # a failed claim falls to crashed, and the claimer removes the box and restores afresh
    Op.CLAIM: Transition((S.POOLED,), S.CLAIMING, S.RUNNING, S.CRASHED),
    Op.CRASH: Transition((S.RUNNING, S.PAUSED), None, S.CRASHED, SOURCE, done=(S.CRASHED,)),
    Op.LOSE: Transition((S.SUSPENDED,), None, S.CRASHED, SOURCE),
}

# The ends recovery (core/recovery.py) gives a save whose process died, beyond those
# the save's operation declares: the VM died while saving (crashed), or its engine's
# save ended the VM (gVisor's checkpoint) before the box ran on from it (stopped, with
# its files as saved).
AFTER_DEATH: frozenset[tuple[BoxState, BoxState]] = frozenset(
    (save, end) for save in (S.SNAPSHOTTING, S.SUSPENDING) for end in (S.CRASHED, S.STOPPED)
)

# The states a row is made in: a box being created, or one pulled whole from the
# storage tier, suspended (core/remote.py).
BORN = frozenset({S.CREATING, S.SUSPENDED})
del S


def _declared() -> frozenset[tuple[BoxState, BoxState]]:
    """Every pair of states (from, to) a write may make: each operation's start (its
    sources to ``via``), its end and failure (from ``via``, or from its sources where it
    has none), a start called off (``via`` back to each source), a creation's end (a
    failed one leaves no row), and ``AFTER_DEATH``."""
    pairs = set(AFTER_DEATH)
    for t in TRANSITIONS.values():
        if not t.sources and t.via is not None and t.target is not None:  # a creation: born in via
            pairs.add((t.via, t.target))
        for source in t.sources:
            ends = {t.target or source, t.failure or source}
            if t.via is None:
                pairs |= {(source, end) for end in ends}
            else:
                pairs |= {(source, t.via), (t.via, source)} | {(t.via, end) for end in ends}
    return frozenset((a, b) for a, b in pairs if a != b)


DECLARED = _declared()


def allowed(before: BoxState | str, after: BoxState | str) -> bool:
    """Whether a box's row may go from ``before`` to ``after`` (the same state: always)."""
    return before == after or (BoxState(before), BoxState(after)) in DECLARED


def check(op: Op, state: BoxState | str, *, box: str | None = None) -> bool:
    """Whether ``op`` has work to do in ``state``: True if it may start, False if
    the box is already where it leads; ``InvalidState`` otherwise."""
    t = TRANSITIONS[op]
    current = BoxState(state)
    if current in t.done:
        return False
    if current in t.sources:
        return True
    raise InvalidState.refused(op.value, current.value, [s.value for s in t.sources], box=box)


def end_state(op: Op, source: BoxState) -> BoxState:
    target = TRANSITIONS[op].target
    return source if target is None else target


def failure_state(op: Op, source: BoxState) -> BoxState:
    failure = TRANSITIONS[op].failure
    return source if failure is None else failure


__all__ = [
    "AFTER_DEATH",
    "BORN",
    "DECLARED",
    "LIVE",
    "SERVING",
    "SOURCE",
    "STABLE",
    "TRANSIENT",
    "TRANSITIONS",
    "BoxState",
    "Op",
    "Transition",
    "allowed",
    "check",
    "end_state",
    "failure_state",
]
