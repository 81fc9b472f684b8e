"""The flight recorder on the fake engine, through the real core and store: each step
an agent takes is in the timeline with a checkpoint of the state it left; a rewind, a
fork at a step, retention, names, grouped steps, and what removal takes with it. The
VM tier runs the same on real boxes (``tests/vm/test_recorder.py``)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

import sandlot
from sandlot.api import loop
from sandlot.core.recorder import Policy

from tests.support.fake_engine import fake_rootfs, register


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    monkeypatch.setenv("SANDLOT_HOME", str(tmp_path / "home"))
    return fake_rootfs(tmp_path)


def recall(box: sandlot.Box, key: str) -> str:
    return box.exec("recall", key).stdout.strip()


def snapshot_ids(home: Path, kind: str) -> set[str]:
    db = sqlite3.connect(home / "sandlot.db")
    try:
        return {r[0] for r in db.execute("SELECT id FROM snapshots WHERE kind = ?", (kind,))}
    finally:
        db.close()


def test_every_step_is_in_the_timeline_with_the_state_it_left(root: Path) -> None:
    with sandlot.Box(rootfs=root, record=True) as box:
        box.exec("remember", "k", "one")
        box.files.write("/tmp/notes.txt", "hello")
        r = box.exec("exit", "3")
        box.exec("remember", "k", "two", env={"TOKEN": "s3cret"})
        steps = box.timeline()
        assert [s.kind for s in steps] == ["record", "exec", "files", "exec", "exec"]
        assert [s.seq for s in steps] == [1, 2, 3, 4, 5]
        assert all(s.kept for s in steps), [str(s) for s in steps]
        assert steps[1].what["argv"] == ["remember", "k", "one"] and steps[1].result["exit_code"] == 0
        assert steps[2].what == {"op": "write", "path": "/tmp/notes.txt", "append": False}
        assert steps[2].result["bytes"] == 5
        assert r.exit_code == 3 and steps[3].result["exit_code"] == 3 and "exit 3" in str(steps[3])
        # an environment is shown by its names, never its values
        assert steps[4].what["env"] == ["TOKEN"] and "s3cret" not in repr(steps[4])
        assert all(s.ended_at >= s.started_at for s in steps)
        # the checkpoints are the timeline's, not among the box's snapshots
        assert box.snapshots() == []
        assert len(sandlot.Snapshot.list(kind="step")) == 5

        box.rewind(2)  # just after "remember k one"
        assert recall(box, "k") == "one"
        rewound = box.timeline()
        assert rewound[5].kind == "rewind" and rewound[5].what == {"to": 2}
        assert rewound[5].checkpoint == steps[1].checkpoint

        children = box.fork_at(5, 2, name="branch")
        try:
            assert [recall(c, "k") for c in children] == ["two", "two"]
            assert recall(box, "k") == "one"  # the box goes on where it was
        finally:
            for c in children:
                c.remove(force=True)


def test_a_step_without_a_checkpoint_says_why_and_cannot_be_rewound_to(root: Path) -> None:
    with sandlot.Box(rootfs=root) as box:
        assert box.record(every=3600) == Policy(every=3600).to_json()
        box.exec("true")  # within the hour of the first step's checkpoint
        first, second = box.timeline()
        assert first.kept and not second.kept
        assert "within 3600s" in second.result["no_checkpoint"]
        with pytest.raises(sandlot.StepNotFound, match="steps with one: 1"):
            box.rewind(2)
        with pytest.raises(sandlot.StepNotFound):
            box.step(99)
        with pytest.raises(sandlot.InvalidArgument):
            box.record(keep_last=0)


def test_retention_keeps_the_last_checkpoints_and_every_named_one(root: Path) -> None:
    home = root.parent / "home"
    with sandlot.Box(rootfs=root) as box:
        box.record(keep_last=2)
        box.exec("remember", "k", "a")
        box.name_step(2, "before-b")
        for v in ("b", "c", "d"):
            box.exec("remember", "k", v)
        steps = box.timeline()
        assert [s.seq for s in steps if s.kept] == [2, 4, 5]  # the named one and the last two
        assert steps[1].name == "before-b"
        assert len(snapshot_ids(home, "step")) == 3
        box.rewind("before-b")
        assert recall(box, "k") == "a"
        with pytest.raises(sandlot.InvalidArgument, match="already named"):
            box.name_step(4, "before-b")
        with pytest.raises(sandlot.InvalidArgument, match="not a number"):
            box.name_step(4, "7")
        # stopping keeps the timeline; no step is added after it
        assert box.record(False) is None
        box.exec("true")
        # four execs, the rewind, the recall after it; not the exec after recording stopped
        assert [s.kind for s in box.timeline()] == ["record"] + ["exec"] * 4 + ["rewind", "exec"]


def test_a_group_is_one_step_and_a_spawned_process_is_a_step_once_it_ends(root: Path) -> None:
    with sandlot.Box(rootfs=root, record={"keep_last": 10}) as box:
        with box.as_step("tool", tool="setup", arguments={"n": 2}):
            box.exec("remember", "a", "1")
            box.files.write("/tmp/x", "y")
        proc = box.spawn("sleep", "0.2")
        assert proc.wait(timeout=10) == 0
        steps = box.timeline()
        assert [s.kind for s in steps] == ["record", "tool", "process"]
        assert steps[1].what == {"tool": "setup", "arguments": {"n": 2}}
        assert steps[1].describe() == "setup(n=2)"
        assert steps[2].what["argv"] == ["sleep", "0.2"] and steps[2].result["exit_code"] == 0


def test_a_failed_step_is_recorded_with_its_error(root: Path) -> None:
    with sandlot.Box(rootfs=root, record=True) as box:
        with pytest.raises(sandlot.ExecTimeout):
            box.exec("sleep", "5", timeout=0.2)
        last = box.timeline()[-1]
        assert last.kind == "exec" and "ExecTimeout" in last.result["error"]


def test_removing_a_box_takes_its_checkpoints_but_those_boxes_started_from(root: Path) -> None:
    home = root.parent / "home"
    box = sandlot.Box(rootfs=root, record=True).start()
    box.exec("remember", "k", "v")
    (child,) = box.fork_at(2)
    kept = box.timeline()[1].checkpoint
    box.remove(force=True)
    assert snapshot_ids(home, "step") == {kept}  # the child's origin stays while it lives
    assert recall(child, "k") == "v"
    child.remove(force=True)
    assert snapshot_ids(home, "step") == set()


def test_the_policy_is_the_rows_so_another_process_s_steps_are_recorded(root: Path) -> None:
    """The policy lives in the box's row: a handle that did not turn it on records too."""
    with sandlot.Box(rootfs=root) as box:
        other = sandlot.Box.get(box.id)

        async def turn_on() -> None:
            a = await sandlot.AsyncBox.get(box.id)
            await a.record()

        asyncio.run(turn_on())  # another event loop: another core, as another process has
        other.exec("remember", "k", "v")
        assert [s.kind for s in box.timeline()] == ["record", "exec"]


def test_a_tool_call_is_one_step_and_the_tools_read_and_rewind_the_timeline(root: Path) -> None:
    from sandlot.tools import Toolkit

    with sandlot.Box(rootfs=root, record=True) as box:
        kit = Toolkit(box)

        async def main() -> None:
            await kit.call("exec", {"command": "remember k tool"})
            await kit.call("write_file", {"path": "/tmp/big", "content": "x" * 2000})
            listed = await kit.call("timeline", {})
            assert [s["kind"] for s in listed.data["steps"]] == ["record", "tool", "tool"]
            first, second = listed.data["steps"][1:]
            assert first["what"].startswith("exec(command='remember k tool'")
            assert "write_file" in second["what"] and "(2000 chars)" in second["what"]
            await kit.call("rewind", {"step": "1"})

        loop.run(main())  # on the loop the box's handle lives on
        assert recall(box, "k") == ""
        steps = box.timeline()
        assert steps[1].what["tool"] == "exec" and steps[1].what["arguments"]["command"] == "remember k tool"
        assert steps[-2].kind == "rewind" and steps[-2].what == {"to": 1}


@pytest.mark.parametrize("parallel", [1, 4])
def test_bisect_finds_the_first_step_after_which_the_test_fails(root: Path, parallel: int) -> None:
    with sandlot.Box(rootfs=root, record=True) as box:
        for i in range(1, 33):  # steps 2..33 remember 1..32: "below n 20" fails from step 21 on
            box.exec("remember", "n", str(i))
        found = box.bisect(["below", "n", "20"], parallel=parallel, diff=False)
        assert found.first_bad is not None and found.first_bad.seq == 21
        assert found.last_good is not None and found.last_good.seq == 20
        assert found.exit_code == 1 and "n is 20, not below 20" in found.stderr
        assert found.rounds <= (6 if parallel == 1 else 4), found.tested
        assert "first bad step" in str(found)
        assert [b.name for b in sandlot.Box.list()] == [box.name]  # every fork went
        # a test that never fails, and one that fails from the first step
        assert box.bisect(["below", "n", "100"], parallel=parallel).first_bad is None
        early = box.bisect(["below", "n", "0"], parallel=parallel)
        assert early.first_bad is not None and early.first_bad.seq == 1 and early.last_good is None
        with pytest.raises(sandlot.InvalidArgument):
            box.bisect([], parallel=parallel)


def test_a_step_shows_the_egress_decisions_made_during_it(root: Path) -> None:
    with sandlot.Box(rootfs=root, record=True) as box:
        box.exec("sleep", "0.3")
        step = box.timeline()[1]
        during = (step.started_at + step.ended_at) / 2
        lines = [
            {"time": step.started_at - 60, "method": "CONNECT", "decision": "allowed", "host": "before.test"},
            {"time": during, "method": "DNS", "decision": "refused", "host": "evil.example"},
            {"time": during, "method": "CONNECT", "decision": "allowed", "host": "pypi.org"},
            {"time": during, "folded": 40, "decision": "refused", "summary": "refused 40 lookups"},
        ]
        log = Path(box.inspect()["paths"]["dir"]) / "egress.log"
        log.write_text("".join(json.dumps(e) + "\n" for e in lines) + "not a line of the log\n")
        assert box.timeline()[1].egress == {"refused": 41, "allowed": 1}
        one = box.step(2)
        assert [e.get("host") for e in one.egress_log or []] == ["evil.example", "pypi.org", None]
        assert "egress allowed 1, refused 41" in str(one)
        assert box.timeline()[0].egress is None


def test_a_fork_takes_its_parent_s_place_and_the_old_parent_is_kept(root: Path) -> None:
    with sandlot.Box(rootfs=root, record=True, name="parent") as box:
        box.exec("remember", "k", "before")
        a, b = box.fork_at(2, 2)
        a.exec("remember", "k", "fix-a")
        b.exec("remember", "k", "fix-b")
        box.exec("remember", "k", "parent-went-on")
        with pytest.raises(sandlot.InvalidArgument, match="was not started from a state of box parent"):
            a.promote(b)
        old = box.promote(b)
        assert (box.name, box.state) == ("parent", "running")
        assert recall(box, "k") == "fix-b"  # the child's memory, under the parent's id and name
        assert b.state == "removed"
        assert {x.name for x in sandlot.Box.list()} == {box.name, a.name}
        (back,) = old.start()  # what the parent was is kept
        try:
            assert recall(back, "k") == "parent-went-on"
        finally:
            back.remove(force=True)
        last = box.timeline()[-2]  # the promotion, then the recall after it
        assert last.kind == "promote" and last.what["child"] == b.name and last.kept
        box.rewind(last.seq)
        assert recall(box, "k") == "fix-b"
        a.remove(force=True)
