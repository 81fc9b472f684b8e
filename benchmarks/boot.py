"""Cold boot, phase by phase (issue 31, item 5): where a box's boot to its first exec
goes, on the host's clock.

Each run cold-boots a 256 MiB busybox box with the kernel's messages on its console
(``SANDLOT_KERNEL_ARGS="loglevel=7 earlyprintk=ttyS0"``) and notes when each line
reaches the box's console log (the file ``box.logs()`` reads, watched as it grows), on
the host's clock from ``Box.start()``: the guest's own timestamps stand still through
its early boot, and say nothing of QEMU's start or of the host's side of the HELLO.
The marks, in order:

* ``kernel_first_line``: QEMU started, its firmware ran, the kernel printed its banner;
* ``kernel_patched``: the kernel patched its code for this CPU (``alternatives``: tens of
  thousands of sites, each a write to code that TCG translates again);
* ``init_started``: the kernel's initcalls ran, ``/init`` (the agent) started;
* ``root_mounted``: the agent loaded its modules (each signature checked) and mounted
  the root disk;
* ``agent_ready``: the agent grew the root filesystem to the box's disk, set up the rest
  and listens;
* ``started``: ``Box.start()`` returned (the host's HELLO and its answer);
* ``first_exec``: ``exec("true")`` returned.

``phases_s`` gives each step's share (the time from the mark before), ``marks_s`` the
marks. A plain run without the kernel's messages gives ``boot_to_first_exec_s`` (as
``benchmarks/core.py`` measures it) to show what printing them costs.

    .venv/bin/python benchmarks/boot.py [--runs 5] [--quick]
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import Any

import sandlot

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary

VERBOSE = "loglevel=7 earlyprintk=ttyS0"
MARKS = {  # mark -> the console line that ends it
    "kernel_first_line": b"Linux version",
    "kernel_patched": b"Freeing SMP alternatives memory",
    "init_started": b"Run /init as init process",
    "root_mounted": b"EXT4-fs (vda): mounted",
    "agent_ready": b"sandlot-agent: ready",
}


class ConsoleClock:
    """When each byte of a growing console log arrived, on the host's clock."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self.sizes: list[int] = []
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                size = self.path.stat().st_size
            except OSError:
                size = 0
            if size and (not self.sizes or size != self.sizes[-1]):
                self.sizes.append(size)
                self.times.append(time.perf_counter() - self.t0)
            time.sleep(0.001)

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join()
        return self.path.read_bytes()

    def arrival(self, text: bytes, marker: bytes) -> float | None:
        """When the line holding ``marker`` had reached the log."""
        at = text.find(marker)
        if at < 0:
            return None
        end = text.find(b"\n", at)
        i = bisect.bisect_left(self.sizes, (end if end >= 0 else len(text)))
        return self.times[i] if i < len(self.times) else None


def one_boot(root: Path, home: Path) -> dict[str, float | None]:
    box = sandlot.Box(rootfs=root, memory_mib=256, home=home, template=False)  # a cold boot, each time
    console = sandlot.Runtime.for_home(home).box_dir(box.id) / "console.log"  # what box.logs() reads
    t0 = time.perf_counter()
    clock = ConsoleClock(console, t0)
    try:
        box.start()
        started = time.perf_counter() - t0
        box.exec("true")
        first_exec = time.perf_counter() - t0
    finally:
        text = clock.stop()
        box.remove(force=True)
    marks: dict[str, float | None] = {m: clock.arrival(text, line) for m, line in MARKS.items()}
    return {**marks, "started": started, "first_exec": first_exec}


def plain_boot(root: Path, home: Path) -> tuple[float, str | None]:
    box = sandlot.Box(rootfs=root, memory_mib=256, home=home, template=False)  # a cold boot, each time
    t0 = time.perf_counter()
    box.start()
    box.exec("true")
    took = time.perf_counter() - t0
    accel = box.accel
    box.remove(force=True)
    return took, accel


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    root = busybox_root()
    home = scratch_home("bench-boot-")
    try:
        _, accel = plain_boot(root, home)  # the root's base disk is made once, outside the timings
        plain = [plain_boot(root, home)[0] for _ in range(runs)]
        os.environ["SANDLOT_KERNEL_ARGS"] = VERBOSE
        boots = [one_boot(root, home) for _ in range(runs)]
    finally:
        os.environ.pop("SANDLOT_KERNEL_ARGS", None)
        drop_home(home)
    order = [*MARKS, "started", "first_exec"]
    marks: dict[str, Any] = {}
    phases: dict[str, Any] = {}
    for i, mark in enumerate(order):
        seen = [b for b in boots if b[mark] is not None]
        if not seen:
            marks[mark] = phases[mark] = {"missing": f"no console line {MARKS[mark].decode()!r}"}
            continue
        marks[mark] = summary([b[mark] or 0.0 for b in seen], digits=3)
        before = [b for b in seen if i == 0 or b[order[i - 1]] is not None]
        steps = [(b[mark] or 0.0) - (b[order[i - 1]] or 0.0 if i else 0.0) for b in before]
        phases[mark] = summary(steps, digits=3) if steps else {"missing": "the mark before it"}
    emit({
        "benchmark": "boot", "quick": args.quick, "host": host_facts(accel), "kernel_args": VERBOSE,
        "boot_to_first_exec_s": summary(plain, digits=3),
        "phases_s": phases,
        "marks_s": marks,
    })  # fmt: skip


if __name__ == "__main__":
    main()
