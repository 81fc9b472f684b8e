"""The flight recorder on a real box: each step through the API and the CLI is in the
timeline with a live checkpoint; a rewind brings memory, processes and disk back to
just after a step; a fork at a step starts there; a step's diff names what it
changed; bisect finds the step that broke a test, through the CLI of another process."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.conftest import TEST_ENGINE

pytestmark = pytest.mark.vm

SANDLOT = [sys.executable, "-m", "sandlot.cli"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([*SANDLOT, *args], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:  # what it said before it was killed, and the box's last events
        said = [f"{ev.box_name}: {ev.kind} {ev.reason}" for ev in sandlot.events(since=-330, follow=False)]
        raise AssertionError(f"sandlot {' '.join(args)} did not end in 300 s; its stderr: {exc.stderr!r}; "
                             f"events: {said[-20:]}") from exc  # fmt: skip


@pytest.fixture(scope="module")
def recorded(busybox_root: Path) -> Iterator[sandlot.Box]:
    """A box that records, with a counter in a shell's memory from before its first step."""
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, engine=TEST_ENGINE, record=True) as box:
        yield box


def test_steps_are_recorded_and_a_rewind_brings_memory_processes_and_disk_back(recorded: sandlot.Box) -> None:
    box = recorded
    start = len(box.timeline())
    box.sh("mkdir -p /work && echo one > /work/a.txt")
    # a process started by this step lives in memory only: a rewind to just after it
    # finds it running, with the file it keeps open
    box.sh(
        "sh -c 'echo $$ > /work/sleeper.pid; exec sleep 3600' </dev/null >/dev/null 2>&1 &"
        " while [ ! -s /work/sleeper.pid ]; do sleep 0.05; done",
        timeout=60,
    )
    box.files.write("/work/b.txt", "two\n")
    assert box.sh("exit 3").exit_code == 3
    box.sh("rm /work/a.txt; kill $(cat /work/sleeper.pid)")
    steps = box.timeline()[start:]
    assert [s.kind for s in steps] == ["exec", "exec", "files", "exec", "exec"]
    assert all(s.kept for s in steps), [str(s) for s in steps]
    assert steps[0].what["argv"][-1] == "mkdir -p /work && echo one > /work/a.txt"
    assert steps[3].result["exit_code"] == 3
    after_b = steps[2].seq
    # the processes each step started and ended, listed in the guest after it: the sleeper
    # the second step left running, and the last step's kill of it
    sleeper = [p for p in steps[1].processes["started"] if p["argv"] == ["sleep", "3600"]]
    assert len(sleeper) == 1, steps[1].processes
    assert sleeper[0]["pid"] == int(box.files.read("/work/sleeper.pid"))
    assert [p["argv"] for p in steps[2].processes["started"] + steps[2].processes["ended"]] == []
    assert sleeper[0] in steps[2].processes["running"]
    assert steps[4].processes["ended"] == sleeper and steps[4].processes["started"] == []

    box.rewind(after_b)
    assert box.sh("cat /work/a.txt /work/b.txt").stdout == "one\ntwo\n"
    assert box.sh("kill -0 $(cat /work/sleeper.pid)").exit_code == 0  # the process is back
    # measured from the state rewound to (the rewind's own row), not from the one left
    after_rewind = box.timeline()[-1].processes
    assert after_rewind["started"] == [] and after_rewind["ended"] == [], after_rewind
    assert [s.what for s in box.timeline() if s.kind == "rewind"] == [{"to": after_b}]

    # what step after_b changed: b.txt, from the checkpoint before it
    one = box.step(after_b, diff=True)
    assert one.diff is not None and [(c.status, c.path) for c in one.diff] == [("added", "/work/b.txt")]
    assert one.files is not None and one.files["added"] == 1 and one.files["since_step"] == after_b - 1

    (child,) = box.fork_at(steps[0].seq)
    try:
        assert child.sh("cat /work/a.txt; test -e /work/b.txt || echo no-b").stdout == "one\nno-b\n"
    finally:
        child.remove(force=True)


def test_the_cli_shows_the_timeline_rewinds_and_bisects(recorded: sandlot.Box) -> None:
    box = recorded
    box.sh("echo 1 > /work/n")
    box.sh("echo 2 > /work/n")
    box.sh("echo 3 > /work/n")  # breaks the test below
    box.sh("echo 4 > /work/n")
    # this process's last steps in the timeline (another process sees a step once its
    # checkpoint is taken: a moment after the next step may begin)
    box.timeline()
    listed = cli("timeline", box.name, "--json")
    assert listed.returncode == 0, listed.stderr
    steps = json.loads(listed.stdout)
    breaking = next(s["seq"] for s in steps if s["what"].get("argv", [""])[-1] == "echo 3 > /work/n")

    good = breaking - 2  # before it, /work/n did not exist: the test fails there too
    found = cli("bisect", box.name, "--test", "test $(cat /work/n) -lt 3", "-j", "2", "--good", str(good),
                "--json")  # fmt: skip
    assert found.returncode == 1, found.stderr  # a step breaks it
    answer = json.loads(found.stdout)
    assert answer["first_bad"]["seq"] == breaking and answer["last_good"]["seq"] == breaking - 1
    assert [c["path"] for c in answer["diff"]["changes"]] == ["/work/n"]
    assert [b.name for b in sandlot.Box.list() if b.name.startswith(box.name[:40] + "-bisect")] == []

    # programs that end right after their last step keep it: the CLI's, and a script's
    # through the sync API (the loop's exit waits for the checkpoint)
    ran = cli("exec", box.name, "sh", "-c", "echo from-cli > /work/last")
    assert ran.returncode == 0, ran.stderr
    script = f"import sandlot; sandlot.Box.get({box.id!r}).sh('echo from-script >> /work/last')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *_, by_cli, by_script = box.timeline()
    assert by_cli.what["argv"][-1] == "echo from-cli > /work/last" and by_cli.kept
    assert by_script.what["argv"][-1] == "echo from-script >> /work/last" and by_script.kept

    r = cli("rewind", box.name, str(breaking - 1))
    assert r.returncode == 0, r.stderr
    assert box.sh("cat /work/n").stdout == "2\n"
    shown = cli("timeline", box.name, "--after", str(breaking))
    assert shown.returncode == 0 and "rewind" in shown.stdout and f"to step {breaking - 1}" in shown.stdout


def test_a_fork_at_a_step_takes_the_box_s_place_with_its_processes(recorded: sandlot.Box) -> None:
    box = recorded
    box.sh("echo base > /work/p.txt")
    base = box.timeline()[-1].seq
    a, b = box.fork_at(base, 2)
    try:
        # b's fix, and a process of b's that lives in memory only
        b.sh("echo fix-b > /work/p.txt; "
             "sh -c 'echo $$ > /work/b.pid; exec sleep 3600' </dev/null >/dev/null 2>&1 &"
             " while [ ! -s /work/b.pid ]; do sleep 0.05; done", timeout=60)  # fmt: skip
        a.sh("echo fix-a > /work/p.txt")
        promoted = cli("promote", box.name, b.name)  # from another process, as a shell would
        assert promoted.returncode == 0, promoted.stderr
        assert box.sh("cat /work/p.txt; kill -0 $(cat /work/b.pid) && echo alive").stdout == "fix-b\nalive\n"
        assert b.state == "removed" and a.state == "running"
        old = sandlot.get_snapshot(promoted.stdout.strip())
        assert old.box_id == box.id  # what the box was before, kept as its snapshot
        with pytest.raises(sandlot.InvalidArgument, match="was not started from a state"):
            a.promote(box)
    finally:
        for child in (a, b):  # b goes with its promotion: not where the test failed before it
            with contextlib.suppress(sandlot.BoxNotFound):
                child.remove(force=True)
