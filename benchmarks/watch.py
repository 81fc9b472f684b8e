"""File watching benchmarks (issue: box.files.watch).

* latency from a file written in the box to its event on the host (median, p99):
  a process in the box writes a file each time it reads a line on its stdin; the
  clock runs from the host's write of that line to the ``modified`` event.
  Baseline measured in the same run, by the same process: the line's echo on its
  stdout (host -> process -> host through the agent, no file, no inotify);
* a burst: 5000 files made by one ``xargs touch`` in the box, from starting it
  to the last ``created`` event on the host (the guest's own speed of making
  files under emulation is most of it).

    .venv/bin/python benchmarks/watch.py [--runs 200] [--quick]
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sandlot

from _common import busybox_root, emit, host_facts, parser, summary

D = "/tmp/bench-watch"
WRITER = f"while read n; do echo $n > {D}/f; echo $n; done"


async def bench(runs: int, burst: int) -> dict[str, Any]:
    async with sandlot.AsyncBox(rootfs=busybox_root(), memory_mib=256) as box:
        await box.files.mkdir(D)
        proc = await box.spawn("sh", "-c", WRITER)
        lines = proc.stdout.lines()
        event_ms, echo_ms = [], []
        async with box.files.watch(D) as w:
            for i in range(runs + 3):  # the first ones warm up (the file's creation, code paths)
                t0 = time.perf_counter()
                await proc.write_stdin(f"{i}\n")
                while True:
                    e = await w.next_event(30)
                    assert e is not None
                    if e.type == "modified":
                        break
                t1 = time.perf_counter()
                assert await anext(lines) == f"{i}\n".encode()
                if i >= 3:
                    event_ms.append(t1 - t0)
            # the echo alone, without a file write, as the baseline
            await proc.close_stdin()
            await proc.wait()
            echo = await box.spawn("sh", "-c", "while read n; do echo $n; done")
            echo_lines = echo.stdout.lines()
            for i in range(runs + 3):
                t0 = time.perf_counter()
                await echo.write_stdin(f"{i}\n")
                assert await anext(echo_lines) == f"{i}\n".encode()
                t2 = time.perf_counter()
                if i >= 3:
                    echo_ms.append(t2 - t0)
            await echo.close_stdin()
            await echo.wait()

            t0 = time.perf_counter()
            made = await box.spawn("sh", "-c", f"cd {D} && seq 1 {burst} | sed 's/^/burst-/' | xargs touch")
            seen = 0
            while seen < burst:
                e = await w.next_event(60)
                assert e is not None and e.type != "overflow", e
                seen += e.type == "created"
            burst_s = time.perf_counter() - t0
            await made.wait()
        return {
            "host": host_facts(box.accel),
            "write_to_event_ms": summary(event_ms, 1e3, 2),
            "stdin_echo_baseline_ms": summary(echo_ms, 1e3, 2),
            "burst": {"files": burst, "seconds": round(burst_s, 3), "events_per_s": round(burst / burst_s)},
        }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    runs, burst = (10, 500) if args.quick else (args.runs, 5000)
    doc = asyncio.run(bench(runs, burst))
    emit({"benchmark": "watch", "quick": args.quick, **doc})


if __name__ == "__main__":
    main()
