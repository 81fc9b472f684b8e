"""The declared state machine: every (operation, state) pair behaves as the table
says, and the table itself is closed (every in-progress state belongs to an
operation, every operation ends in a state users can see)."""

from __future__ import annotations

import pytest

from sandlot.core.state import STABLE, TRANSIENT, TRANSITIONS, BoxState, Op, check, end_state, failure_state
from sandlot.errors import InvalidState

PAIRS = [(op, state) for op in Op for state in BoxState]


@pytest.mark.parametrize(("op", "state"), PAIRS, ids=[f"{o.value}-{s.value}" for o, s in PAIRS])
def test_each_operation_in_each_state(op: Op, state: BoxState) -> None:
    t = TRANSITIONS[op]
    if state in t.done:
        assert check(op, state) is False  # already there: nothing to do
    elif state in t.sources:
        assert check(op, state) is True
        assert end_state(op, state) in STABLE
        assert failure_state(op, state) in STABLE
    else:
        with pytest.raises(InvalidState) as err:
            check(op, state, box="b1")
        assert err.value.state == state.value
        assert err.value.allowed == tuple(s.value for s in t.sources)
        assert err.value.box == "b1" and err.value.code == "invalid_state" and err.value.status == 409
        assert op.value in str(err.value) and state.value in str(err.value)


def test_the_table_is_closed() -> None:
    vias = {t.via for t in TRANSITIONS.values() if t.via is not None}
    assert vias == set(TRANSIENT)  # every in-progress state is some operation's
    for op, t in TRANSITIONS.items():
        assert set(t.sources) <= STABLE, op  # operations start only from states users see
        assert set(t.done) <= STABLE, op
        assert not set(t.done) & set(t.sources), op
        for s in (t.target, t.failure):
            assert s is None or s in STABLE, op


def test_a_failed_start_crashes_and_a_failed_snapshot_changes_nothing() -> None:
    assert failure_state(Op.START, BoxState.STOPPED) is BoxState.CRASHED
    assert failure_state(Op.SNAPSHOT, BoxState.PAUSED) is BoxState.PAUSED
    assert end_state(Op.SNAPSHOT, BoxState.PAUSED) is BoxState.PAUSED
    assert failure_state(Op.RESUME, BoxState.SUSPENDED) is BoxState.SUSPENDED
    assert failure_state(Op.ROLLBACK, BoxState.RUNNING) is BoxState.STOPPED


def test_a_paused_box_says_how_to_go_on() -> None:
    with pytest.raises(InvalidState, match="unpause"):
        check(Op.START, BoxState.PAUSED, box="b")
