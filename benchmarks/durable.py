"""Durable box benchmarks (issue: durable boxes).

* create + start + first exec from an already pulled image (median, p99);
* stop, and start again, of an existing box;
* listing with 50 boxes in the store: the API, and the ``sandlot ls -a`` command.

    .venv/bin/python benchmarks/durable.py [--runs 10] [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import sandlot

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    listed, list_runs, ls_runs = (10, 3, 2) if args.quick else (50, 20, 5)
    if args.quick:
        args.runs = 2
    home = scratch_home("bench-durable-")
    try:
        sandlot.import_image(busybox_root(), "bench/busybox:1", home=home)
        rt = sandlot.Runtime.for_home(home)
        sandlot.Box.create("bench/busybox:1", pull="never", home=home).remove()  # makes the base disk

        create_start_exec, starts, stops = [], [], []
        for i in range(args.runs):
            t0 = time.perf_counter()
            box = sandlot.Box.create("bench/busybox:1", name=f"b{i}", memory_mib=256, pull="never", home=home)
            box.start()
            box.exec("true")
            create_start_exec.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            box.stop()
            stops.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            box.start()
            box.exec("true")
            starts.append(time.perf_counter() - t0)
            box.remove(force=True)

        for i in range(listed):
            sandlot.Box.create("bench/busybox:1", name=f"idle-{i}", pull="never", home=home)
        api = []
        for _ in range(list_runs):
            t0 = time.perf_counter()
            assert len(sandlot.list(home=home)) == listed
            api.append(time.perf_counter() - t0)
        cmd = []
        env = {**os.environ, "SANDLOT_HOME": str(home)}
        for _ in range(ls_runs):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "sandlot.cli", "ls", "-a", "-q"], env=env,
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            cmd.append(time.perf_counter() - t0)
            assert len(out.split()) == listed
        emit(
            {
                "benchmark": "durable",
                "quick": args.quick,
                "host": host_facts(rt.prepare().accel),
                "create_start_first_exec_s": summary(create_start_exec, digits=3),
                "stop_s": summary(stops, digits=3),
                "start_to_first_exec_s": summary(starts, digits=3),
                f"list_api_{listed}_boxes_ms": summary(api, 1e3, 1),
                f"ls_command_{listed}_boxes_s": summary(cmd, digits=3),
            }
        )
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
