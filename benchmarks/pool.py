"""Warm pools (issue 17 part 1), a 256 MB busybox template, in one run:

* before: a plain template start (a restore into a new QEMU process) to its first exec;
* after: a claim of a ready pool VM (its HELLO and first exec done before, paused) to its
  first exec; the pool is full at each claim and no refill runs while it is timed; split
  into the claim alone, and beside it a second exec of the same box (an exec's own cost
  on this host at that moment);
* the fill: seconds per pool VM (restore, HELLO, first exec, pause), and the host PSS of
  a ready pool VM.

    .venv/bin/python benchmarks/pool.py [--runs 20] [--pool 3] [--quick]
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import sandlot
from sandlot import AsyncBox

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary, timed_claims

LOOP = "nohup sh -c 'while true; do sleep 0.1; done' >/dev/null 2>&1 &"


async def run(root: Path, home: Path, runs: int, pool: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tmpl = await sandlot.template_async(
        rootfs=root, memory_mib=256, setup=[LOOP], name="bench-pool", home=home
    )
    starts = []
    for _ in range(runs):
        t = time.perf_counter()
        b = AsyncBox(template=tmpl, keep=True, home=home)
        await b.start()
        await b.exec("true")
        starts.append(time.perf_counter() - t)
        await b.remove(force=True)
    out["template_start_to_first_exec_s"] = summary(starts, digits=3)

    times: dict[str, list[float]] = {}
    fills: list[float] = []
    pss: list[float] = []
    while len(times.get("claim", [])) < runs:
        before = sum(p.ready for p in await sandlot.pools_async(home=home))
        t = time.perf_counter()
        info = await sandlot.set_pool_async(tmpl, pool, wait=True, home=home)
        if info.ready > before:
            fills.append((time.perf_counter() - t) / (info.ready - before))
        pss.append(info.pss_bytes / max(1, info.ready))
        claimed = await timed_claims(tmpl, home, min(pool, runs - len(times.get("claim", []))), times)
        for b in claimed:
            await b.remove(force=True)
    out["pool_claim_to_first_exec_ms"] = summary(times["to_first_exec"], 1000, digits=1)
    out["pool_claim_only_ms"] = summary(times["claim"], 1000, digits=1)
    out["second_exec_true_ms"] = summary(times["again"], 1000, digits=1)
    out["pool_fill_s_per_vm"] = summary(fills, digits=3)
    out["pool_vm_pss_mib"] = summary(pss, 1 / (1 << 20), digits=1)
    out["pool_size"] = pool
    await sandlot.set_pool_async(tmpl, 0, wait=True, home=home)
    await tmpl.remove()
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--pool", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.runs, args.pool = 3, 2
    os.environ["SANDLOT_POOL_REFILL"] = "0"  # refills happen between the timed claims, not during
    accel = sandlot.Runtime.for_home().prepare().accel
    home = scratch_home("bench-pool")
    try:
        figures = asyncio.run(run(busybox_root(), home, args.runs, args.pool))
    finally:
        drop_home(home)
    emit({"benchmark": "pool", "quick": args.quick, "root": "busybox", "memory_mib": 256,
          "host": host_facts(accel), **figures})  # fmt: skip


if __name__ == "__main__":
    main()
