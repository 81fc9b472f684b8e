"""The CPU each test costs, for the suite's budget (docs/testing.md): a pytest plugin
that ``./scripts/test`` loads in each of its VM runs (``-p tests.support.cpu_census``).

The suite is bound by CPU, not by waits: under emulation a test's wall time says more
about what ran beside it than about what it costs. So each run of the suite moves its
pytest process into a CPU accounting group of its own, before it starts anything, and
every process it starts stays there wherever it is reparented (QEMU, gVisor, servers,
Ray, port keepers). The group's counter then gives each test's CPU seconds, setup,
call and teardown together (a module's fixture is billed to its first test), and the
run's total. At the end it prints the tests that cost the most, and writes the run's
figures to ``$SANDLOT_TEST_CPU_OUT`` (JSON) where that is set.

gVisor's sandboxes are not counted: runsc moves each into a cgroup of its own, in every
hierarchy (its OCI spec's), so a gVisor box's own CPU is missing from its test's figure
(its host-side processes, the agent's connections and sandlot's, are there).

Where no group can be made (not root, or no cgroup v1 ``cpuacct`` hierarchy: under
cgroup v2 sandlot moves each VM into a cgroup of its own, outside the run's), it says
why once and counts nothing: never a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

V1 = Path("/sys/fs/cgroup/cpuacct")
SHOWN = 15


class Group:
    """A CPU accounting group this process moved itself into: its usage in seconds."""

    def __init__(self, path: Path, usage: Path, parse: Any) -> None:
        self.path, self._usage, self._parse = path, usage, parse

    def seconds(self) -> float:
        try:
            return float(self._parse(self._usage.read_text()))
        except (OSError, ValueError):
            return 0.0

    @classmethod
    def enter(cls, name: str) -> Group:
        """A new group named ``name`` (unique per process), with this process in it.
        Raises OSError saying why there is none."""
        if (V1 / "cpuacct.usage").exists():
            for stale in V1.glob("sandlot-tests-*-*"):  # earlier runs' groups, emptied since
                pid = stale.name.rsplit("-", 1)[1]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():  # never a run's that goes on
                    with contextlib.suppress(OSError):
                        stale.rmdir()  # refused while a process is in it
            path = V1 / name
            path.mkdir()
            (path / "cgroup.procs").write_text(str(os.getpid()))
            return cls(path, path / "cpuacct.usage", lambda text: int(text) / 1e9)
        # cgroup v2 has one hierarchy, and sandlot places each VM in it outside this run's
        # group (engine/hostcgroup.py): a group here would not hold the VMs' CPU
        raise OSError(
            "no cgroup v1 cpuacct hierarchy (under cgroup v2 the VMs live outside this run's group)"
        )

    def leave(self) -> None:
        """Back into the parent group; the group goes once nothing is left in it (a
        process that outlived the run keeps it, and its CPU, until it ends)."""
        with contextlib.suppress(OSError):
            (self.path.parent / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            self.path.rmdir()


class Census:
    def __init__(self, lane: str) -> None:
        self.lane = lane
        self.group: Group | None = None
        self.why_not = ""
        self.costs: dict[str, tuple[float, float]] = {}  # nodeid: (cpu s, wall s)
        self.started = time.monotonic()
        try:
            self.group = Group.enter(f"sandlot-tests-{lane}-{os.getpid()}")
        except OSError as exc:
            self.why_not = f"{type(exc).__name__}: {exc}"
        self.start_cpu = self.seconds()

    def seconds(self) -> float:
        return self.group.seconds() if self.group else 0.0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        cpu, wall = self.seconds(), time.monotonic()
        yield
        self.costs[item.nodeid] = (self.seconds() - cpu, time.monotonic() - wall)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        if self.group is None:
            write(f"CPU per test: not counted ({self.why_not})")
            return
        total, wall = self.seconds() - self.start_cpu, time.monotonic() - self.started
        terminalreporter.section(f"CPU per test, the {SHOWN} dearest ({self.lane})")
        for nodeid, (cpu, took) in sorted(self.costs.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
            write(f"{cpu:8.1f} CPU s {took:8.1f} s  {nodeid}")
        write(f"this run: {total:.0f} CPU s in {wall:.0f} s ({total / max(wall, 1e-9):.2f} cores)")
        out = os.environ.get("SANDLOT_TEST_CPU_OUT")
        if out:
            tests = {k: {"cpu_s": round(c, 2), "wall_s": round(w, 2)} for k, (c, w) in self.costs.items()}
            doc = {"lane": self.lane, "cpu_s": round(total, 1), "wall_s": round(wall, 1), "tests": tests}
            Path(out).write_text(json.dumps(doc, indent=1))

    def pytest_unconfigure(self) -> None:
        if self.group is not None:
            self.group.leave()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Census(os.environ.get("SANDLOT_TEST_LANE", "run")), "sandlot-cpu-census")


def report(folder: Path, shown: int = 10) -> str:
    """The runs' CPU seconds against their wall time, and the dearest tests of them all,
    from the JSON files the runs wrote into ``folder`` (cpu-*.json)."""
    docs = [json.loads(p.read_text()) for p in sorted(folder.glob("cpu-*.json"))]
    if not docs:
        return "no run counted its CPU (see each run's own line)"
    lines = [f"    {d['lane']}: {d['cpu_s']:.0f} CPU s in {d['wall_s']:.0f} s" for d in docs]
    lines.append(f"    together: {sum(d['cpu_s'] for d in docs):.0f} CPU s")
    tests = [(t["cpu_s"], t["wall_s"], d["lane"], k) for d in docs for k, t in d["tests"].items()]
    files: Counter[str] = Counter()
    for cpu, _wall, _lane, nodeid in tests:
        files[nodeid.split("::")[0]] += cpu
    lines.append(f"  the {shown} dearest files:")
    for name, cpu in files.most_common(shown):
        lines.append(f"    {cpu:7.1f} CPU s  {name}")
    lines.append(f"  the {shown} dearest tests:")
    lines += [
        f"    {c:7.1f} CPU s {w:7.1f} s  [{lane}] {k}"
        for c, w, lane, k in sorted(tests, reverse=True)[:shown]
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tests.support.cpu_census FOLDER
    import sys

    print(report(Path(sys.argv[1])))
