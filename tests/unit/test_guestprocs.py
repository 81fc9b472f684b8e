"""The flight recorder's listing of a guest's processes (``core/guestprocs.py``): its
shell script run here, on this host's ``/proc``, by each shell a guest may have (dash,
as Debian's ``/bin/sh``, and busybox's), and what a step keeps of two listings.
tests/vm/test_recorder.py lists a real guest's after each step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.core import guestprocs

SHELLS = [s for s in (["dash"], ["busybox", "sh"]) if shutil.which(s[0])]


def run_listing(shell: list[str], known: dict[str, dict]) -> tuple[str, guestprocs.Listing]:
    r = subprocess.run([*shell, "-c", guestprocs.LIST_SCRIPT], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "KNOWN": " ".join(known)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout, guestprocs.parse(r.stdout, known)


@pytest.fixture
def odd_child() -> Iterator[subprocess.Popen[bytes]]:
    """A process whose arguments hold a space, a tab and a newline."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "a b\tc\nd"])
    deadline = time.monotonic() + 30
    while b"time.sleep" not in Path(f"/proc/{p.pid}/cmdline").read_bytes():  # exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS, ids=[s[0] for s in SHELLS])
def test_unit_a_listing_names_each_process_and_reads_only_new_command_lines(
    shell: list[str], odd_child: subprocess.Popen[bytes]
) -> None:
    out, first = run_listing(shell, {})
    mine = {p["pid"]: p for p in first.values()}
    with open(f"/proc/{os.getpid()}/cmdline") as f:
        assert mine[os.getpid()]["argv"] == f.read().split("\0")[:-1]
    # (a newline would end the line: it is a space there)
    odd = [sys.executable, "-c", "import time; time.sleep(60)", "a b\tc d"]
    assert mine[odd_child.pid]["argv"] == odd and "python" in mine[odd_child.pid]["name"]

    def parent(pid: int) -> int | None:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None  # ended since

    assert 2 not in mine and all(parent(pid) != 2 for pid in mine)  # no kernel thread
    out, second = run_listing(shell, first)
    # no command line read again: a known process's line has none (processes new since do)
    lines = [line.split(guestprocs.FIELD) for line in out.splitlines()]
    assert [at for at, _, argv in lines if at in first and argv] == []
    assert {k: v for k, v in second.items() if k in first} == {k: first[k] for k in second if k in first}
    assert second[guestprocs.key(mine[odd_child.pid])]["argv"] == odd


def proc(pid: int, since: int, *argv: str) -> dict:
    return {"pid": pid, "since": since, "name": argv[0], "argv": list(argv)}


def listing(*procs: dict) -> guestprocs.Listing:
    return {guestprocs.key(p): p for p in procs}


def test_unit_a_step_keeps_what_it_started_and_ended_and_a_pid_used_again_is_another_process() -> None:
    server, old, again = proc(10, 100, "server"), proc(11, 100, "worker"), proc(11, 900, "worker", "--new")
    before = listing(server, old)
    kept = guestprocs.changes(before, listing(server, again))
    assert kept["started"] == [again] and kept["ended"] == [old]
    assert kept["running"] == [server, again] and kept["count"] == 2
    assert guestprocs.from_kept(kept) == listing(server, again)  # the next step's baseline
    first = guestprocs.changes(None, listing(server))  # no listing before: what runs only
    assert "started" not in first and first["running"] == [server]


def test_unit_a_listing_past_its_bound_is_counted_and_is_no_baseline() -> None:
    many = listing(*(proc(pid, 1, "p") for pid in range(1, guestprocs.LISTED + 21)))
    kept = guestprocs.changes({}, many)
    assert len(kept["started"]) == len(kept["running"]) == guestprocs.LISTED
    assert kept["more"] == {"started": 20, "ended": 0} and kept["count"] == guestprocs.LISTED + 20
    assert guestprocs.from_kept(kept) is None  # not all of it: the next step lists without one
    assert guestprocs.from_kept(None) is None and guestprocs.from_kept({"running": [{"pid": 1}]}) is None


def test_unit_lines_that_are_not_a_listing_s_are_left_out() -> None:
    good = f"7:70{guestprocs.FIELD}sh{guestprocs.FIELD}sh{guestprocs.ARG}-c{guestprocs.ARG}"
    out = "\n".join(
        [
            "garbage",
            f"x:1{guestprocs.FIELD}a{guestprocs.FIELD}",
            good,
            f"8{guestprocs.FIELD}b{guestprocs.FIELD}",
        ]
    )
    assert guestprocs.parse(out, {}) == listing(proc(7, 70, "sh", "-c"))
