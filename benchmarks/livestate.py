"""Live-state benchmarks (issue: live state), a 256 MB box:

* snapshot: the VM's pause and the saved state's size;
* rollback, and suspend, and resume, each to the first exec after it;
* template start to first exec;
* fork of 1, 8 and 20 children to the first exec of all (``box.fork``: the
  snapshot and its one-time preparation for copy-on-write included), then the
  same from an already prepared snapshot (``--rounds`` times); host PSS and the CPU
  seconds each child's VM used to get there.

    .venv/bin/python benchmarks/livestate.py [--runs 10] [--rounds 3] [--root busybox|debian] [--quick]
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import sandlot
from sandlot import AsyncBox

from _common import (
    busybox_root,
    debian_root,
    emit,
    host_facts,
    parser,
    pss_kib,
    rollbacks_to_first_exec,
    summary,
)


async def first_exec_all(boxes: list[AsyncBox]) -> None:
    await asyncio.gather(*(b.exec("true") for b in boxes))


async def cpu_seconds(boxes: list[AsyncBox]) -> list[float]:
    """CPU each box's VM process has used since it started (user + system): for a child
    just restored, what its restore, HELLO and first exec cost the host."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for b in boxes:
        fields = Path(f"/proc/{(await b.inspect())['vm_pid']}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime (fields 14, 15)
    return out


LOOP = "nohup sh -c 'while true; do sleep 0.1; done' >/dev/null 2>&1 &"


async def run(root: Path, runs: int, fan_out: tuple[int, ...], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    box = AsyncBox(rootfs=root, memory_mib=256, keep=True, template=False)
    await box.start()
    try:
        await box.sh(LOOP)
        await box.exec("true")
        pauses, walls, sizes = [], [], []
        for _ in range(runs):
            t = time.perf_counter()
            snap = await box.snapshot()
            walls.append(time.perf_counter() - t)
            assert box.last_pause is not None
            pauses.append(box.last_pause)
            sizes.append(snap.size)
            await snap.remove()
        out["snapshot"] = {"pause_s": summary(pauses, digits=3), "wall_s": summary(walls, digits=3),
                           "state_mb": summary(sizes, 1e-6, 1)}  # fmt: skip

        snap = await box.snapshot("bench-base")
        rollbacks = await rollbacks_to_first_exec(box, snap, runs)
        out["rollback_to_first_exec_s"] = summary(rollbacks, digits=3)

        suspends, resumes = [], []
        for _ in range(runs):
            t = time.perf_counter()
            await box.suspend()
            suspends.append(time.perf_counter() - t)
            t = time.perf_counter()
            await box.resume()
            await box.exec("true")
            resumes.append(time.perf_counter() - t)
        out["suspend_s"] = summary(suspends, digits=3)
        out["resume_to_first_exec_s"] = summary(resumes, digits=3)

        tmpl = await sandlot.template_async(rootfs=root, memory_mib=256, setup=[LOOP], name="bench-template")
        starts = []
        for _ in range(runs):
            t = time.perf_counter()
            b = AsyncBox(template=tmpl, keep=True)
            await b.start()
            await b.exec("true")
            starts.append(time.perf_counter() - t)
            await b.remove(force=True)
        out["template_start_to_first_exec_s"] = summary(starts, digits=3)
        # the host memory of an idle box started from a template, alone (the state it maps
        # is not shared with any other running VM): what a box costs after its image's first
        b = AsyncBox(template=tmpl, keep=True)
        await b.start()
        await b.exec("true")
        await asyncio.sleep(2.0)
        out["template_box_idle_pss_MiB"] = round(pss_kib((await b.inspect())["vm_pid"])["pss"] / 1024, 1)
        await b.remove(force=True)

        forks: dict[str, Any] = {}
        for n in fan_out:
            t = time.perf_counter()
            kids = await box.fork(n)
            await first_exec_all(kids)
            fork_wall = time.perf_counter() - t
            fork_cpu = await cpu_seconds(kids)
            await asyncio.sleep(1.0)
            pss = [pss_kib((await k.inspect())["vm_pid"])["pss"] / 1024 for k in kids]
            for k in kids:
                await k.remove(force=True)
            prepared_walls, prepared_cpu = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                kids = await tmpl.start(n)
                await first_exec_all(kids)
                prepared_walls.append(time.perf_counter() - t)
                prepared_cpu += await cpu_seconds(kids)
                for k in kids:
                    await k.remove(force=True)
            forks[str(n)] = {"fork_to_first_exec_all_s": round(fork_wall, 3),
                             "fork_vm_cpu_s_per_child": summary(fork_cpu, digits=3),
                             "prepared_snapshot_to_first_exec_all_s": summary(prepared_walls, digits=3),
                             "prepared_vm_cpu_s_per_child": summary(prepared_cpu, digits=3),
                             "pss_mib_per_child": summary(pss, digits=1)}  # fmt: skip
        out["fork"] = forks
        await tmpl.remove()
        await snap.remove()
    finally:
        await box.remove(force=True)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="starts of N children from the prepared snapshot")
    ap.add_argument("--root", choices=("busybox", "debian"), default="busybox")
    args = ap.parse_args()
    fan_out = (1, 3) if args.quick else (1, 8, 20)
    rounds = 1 if args.quick else args.rounds
    if args.quick:
        args.runs = 2
    root = busybox_root() if args.root == "busybox" else debian_root()
    accel = sandlot.Runtime.for_home().prepare().accel
    figures = asyncio.run(run(root, args.runs, fan_out, rounds))
    emit({"benchmark": "livestate", "quick": args.quick, "root": args.root, "memory_mib": 256,
          "host": host_facts(accel), **figures})  # fmt: skip


if __name__ == "__main__":
    main()
