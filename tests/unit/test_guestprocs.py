"""The flight recorder's listing of a guest's processes (``core/guestprocs.py``): its
shell script run here, on this host's ``/proc``, by each shell a guest may have (dash,
as Debian's ``/bin/sh``, and busybox's), and what a step keeps of two listings.
tests/vm/test_recorder.py lists a real guest's after each step."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.core import guestprocs, guestshell

SHELLS = [s for s in (["dash"], ["busybox", "sh"]) if shutil.which(s[0])]


def runner(shell: list[str], outputs: list[tuple[int, str]]) -> guestprocs.Runner:
    """What the agent does with a listing's command, done here by ``shell`` (its pid and
    what it printed kept in ``outputs``)."""

    async def run(script: str, env: dict[str, str]) -> str:
        p = subprocess.Popen([*shell, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={"PATH": os.environ["PATH"], **env})  # fmt: skip
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0 and out, p.returncode
        outputs.append((p.pid, out))
        return out

    return run


def listing(shell: list[str], before: guestprocs.Found) -> tuple[guestprocs.Found, str]:
    """A listing on this host, after ``before``: what it found, and what its shell printed."""
    outputs: list[tuple[int, str]] = []
    found = asyncio.run(guestprocs.gathered(runner(shell, outputs), before.processes, before.kernel))
    ((shell_pid, printed),) = outputs
    assert shell_pid not in {p["pid"] for p in found.processes.values()}  # the listing's own shell
    return found, printed


ODD = "open('/proc/self/comm', 'w').write('od) d('); import time; time.sleep(60)"


@pytest.fixture
def odd_child() -> Iterator[subprocess.Popen[bytes]]:
    """A process whose arguments hold a space, a tab and a newline, and whose name a
    parenthesis and a space."""
    p = subprocess.Popen([sys.executable, "-c", ODD, "a b\tc\nd"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{p.pid}/comm").read_text() != "od) d(\n":  # it named itself
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # ended since


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS, ids=[s[0] for s in SHELLS])
def test_unit_a_listing_names_each_process_and_reads_only_what_is_new(
    shell: list[str], odd_child: subprocess.Popen[bytes]
) -> None:
    first, _ = listing(shell, guestprocs.Found())
    mine = {p["pid"]: p for p in first.processes.values()}
    with open(f"/proc/{os.getpid()}/cmdline") as f:
        assert mine[os.getpid()]["argv"] == f.read().split("\0")[:-1]
    # (a newline would end the line: it is a space there)
    odd = [sys.executable, "-c", ODD, "a b\tc d"]
    assert mine[odd_child.pid]["argv"] == odd and mine[odd_child.pid]["name"] == "od) d("
    assert 2 not in mine and all(parent(pid) != 2 for pid in mine)  # no kernel thread: apart
    assert 2 in first.kernel and all(parent(pid) in (0, 2, None) for pid in first.kernel)
    second, printed = listing(shell, first)
    assert second.processes[guestprocs.key(mine[odd_child.pid])]["argv"] == odd  # from the listing before
    lines = printed.splitlines()
    # kernel threads are only named, and a known process's command line is not read again
    assert {int(line) for line in lines if line.isdigit()} == second.kernel & first.kernel
    known = [line for line in lines if line.split(" ", 1)[0] in {str(p) for p in mine}]
    assert known and all(line.endswith(guestprocs.FIELD) for line in known)
    same = [k for k in second.processes if k in first.processes]
    assert [second.processes[k] for k in same] == [first.processes[k] for k in same]


def test_unit_lines_that_are_no_process_s_are_left_out_and_known_ones_keep_their_command_lines() -> None:
    tail = "S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 77 100 1"
    lines = [
        f"9 (a (b) c) {tail}{guestprocs.FIELD}sh{guestprocs.ARG}-c{guestprocs.ARG}",
        "garbage", f"x (y) {tail}", "8 (short) S 1 1", f"10 (kworker) S 2{tail[3:]}{guestprocs.FIELD}", "11",
        f"13 (sandlot-agent) {tail}{guestprocs.FIELD}", f"14 (kept) {tail}{guestprocs.FIELD}",
    ]  # fmt: skip
    # 14 ran before with the same start: its command line is the one kept; 9's pid ran
    # another process before (an older start): it is a new one, with the line read now
    before = {"14:77": proc(14, 77, "kept", "--on"), "9:50": proc(9, 50, "old")}
    found = guestprocs.parse("\n".join(lines), before)
    assert found.processes == {
        "9:77": {"pid": 9, "since": 77, "name": "a (b) c", "argv": ["sh", "-c"]},
        "14:77": {"pid": 14, "since": 77, "name": "kept", "argv": ["kept", "--on"]},
    }
    assert found.kernel == {10, 11}


def proc(pid: int, since: int, *argv: str) -> dict:
    return {"pid": pid, "since": since, "name": argv[0], "argv": list(argv)}


def listed(*procs: dict) -> guestprocs.Found:
    return guestprocs.Found({guestprocs.key(p): p for p in procs}, {2, 3})


def test_unit_a_step_keeps_what_it_started_and_ended_and_a_pid_used_again_is_another_process() -> None:
    server, old, again = proc(10, 100, "server"), proc(11, 100, "worker"), proc(11, 900, "worker", "--new")
    before = listed(server, old).processes
    kept = guestprocs.changes(before, listed(server, again))
    assert kept["started"] == [again] and kept["ended"] == [old]
    assert kept["running"] == [server, again] and kept["count"] == 2 and kept["kernel"] == [2, 3]
    # the next step's baseline, and the kernel threads it skips
    assert guestprocs.from_kept(kept) == (listed(server, again).processes, {2, 3})
    first = guestprocs.changes(None, listed(server))  # no listing before: what runs only
    assert "started" not in first and first["running"] == [server]


def test_unit_a_listing_past_its_bound_is_counted_and_is_no_baseline() -> None:
    many = listed(*(proc(pid, 1, "p") for pid in range(10, guestprocs.LISTED + 30)))
    kept = guestprocs.changes({}, many)
    assert len(kept["started"]) == len(kept["running"]) == guestprocs.LISTED
    assert kept["more"] == {"started": 20, "ended": 0} and kept["count"] == guestprocs.LISTED + 20
    # not all of it: the next step lists without a baseline (its kernel threads still skipped)
    assert guestprocs.from_kept(kept) == (None, {2, 3})
    assert guestprocs.from_kept(None) == (None, set())
    assert guestprocs.from_kept({"running": [{"pid": 1}], "count": 1}) == (None, set())  # damaged


def test_unit_what_a_guest_makes_a_listing_hold_is_bounded() -> None:
    """A process's command line past ``ARGV_KEPT`` characters is cut; a listing past
    ``OUTPUT_MAX`` bytes is none (the step goes without), never held whole."""
    tail = "S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 77 100 1"
    long = guestprocs.ARG.join(["x" * 3000, "y" * 3000, "z"])
    [p] = guestprocs.parse(f"9 (big) {tail}{guestprocs.FIELD}{long}", {}).processes.values()
    assert p["argv"] == ["x" * 3000, "y" * (guestprocs.ARGV_KEPT - 3000) + "..."]

    class Stream:
        def __init__(self, n: int) -> None:
            self.left = n

        async def read(self) -> bytes:
            self.left -= 1
            return b"a" * 1000 if self.left >= 0 else b""

    assert asyncio.run(guestshell.at_most(Stream(3), 3000)) == b"a" * 3000
    with pytest.raises(OSError, match="more than 3000 bytes"):
        asyncio.run(guestshell.at_most(Stream(4), 3000))
