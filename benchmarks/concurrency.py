"""Concurrency benchmarks: many boxes started at once from one template.

* ``threads``: N boxes started together from threads of one process (the sync API);
* ``processes``: N ``sandlot run -d`` commands started together;
* for each: seconds until every box answered (and the median and p99 of when each
  did), how many failed (must be 0), how many waited in the admission line, and
  the host memory in use at the peak beyond what was in use before.

    .venv/bin/python benchmarks/concurrency.py [-n 50] [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sandlot

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary

IMAGE = "bench/concurrency:1"


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakMemory:
    """Host memory in use beyond the level at the start, sampled every 50 ms."""

    def __init__(self) -> None:
        self.start = mem_available_mib()
        self.lowest = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.lowest = min(self.lowest, mem_available_mib())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.start - self.lowest, 1)


def storm_threads(n: int, home: Path) -> dict[str, Any]:
    done: list[float] = []
    failures: list[str] = []
    peak = PeakMemory()
    t0 = time.monotonic()

    def start(i: int) -> None:
        try:
            box = sandlot.Box(IMAGE, name=f"t{i}", memory_mib=256, keep=True, home=home).start()
            box.exec("true")
            done.append(time.monotonic() - t0)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    peak_mib = peak.stop()
    for b in sandlot.list(home=home):
        if b.name.startswith("t"):
            b.remove(force=True)
    return {"boxes": n, "all_answered_s": round(wall, 2), "answered_at_s": summary(done or [0.0]),
            "failures": len(failures), "failure_reasons": failures[:3],
            "peak_host_memory_mib": peak_mib}  # fmt: skip


def storm_processes(n: int, home: Path) -> dict[str, Any]:
    env = {**os.environ, "SANDLOT_HOME": str(home)}
    peak = PeakMemory()
    t0 = time.monotonic()
    cli = [sys.executable, "-m", "sandlot.cli", "run", "-d", "-m", "256"]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [
        subprocess.Popen([*cli, "--name", f"p{i}", IMAGE, "sleep", "1000"], env=env, **pipes)
        for i in range(n)
    ]
    done, failures = [], []
    for p in procs:
        _out, err = p.communicate()
        if p.returncode == 0:
            done.append(time.monotonic() - t0)
        else:
            failures.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
    wall = time.monotonic() - t0
    peak_mib = peak.stop()
    answering = sum(1 for b in sandlot.list(home=home) if b.name.startswith("p") and b.exec("true").ok)
    for b in sandlot.list(home=home):
        if b.name.startswith("p"):
            b.remove(force=True)
    return {"boxes": n, "all_answered_s": round(wall, 2), "answered_at_s": summary(done or [0.0]),
            "failures": len(failures) + (n - len(failures) - answering), "failure_reasons": failures[:3],
            "peak_host_memory_mib": peak_mib}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("-n", type=int, default=50)
    args = ap.parse_args()
    if args.quick:
        args.n = 6
    home = scratch_home("bench-concurrency-")
    try:
        sandlot.import_image(busybox_root(), IMAGE, home=home)
        with sandlot.Box(IMAGE, memory_mib=256, home=home) as first:  # the image's template is saved
            first.exec("true")
        accel = first.accel
        doc: dict[str, Any] = {"benchmark": "concurrency", "quick": args.quick, "host": host_facts(accel)}
        doc["threads"] = storm_threads(args.n, home)
        doc["processes"] = storm_processes(args.n, home)
        emit(doc)
        if doc["threads"]["failures"] or doc["processes"]["failures"]:
            sys.exit(1)
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
