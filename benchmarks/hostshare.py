"""Sandlot's own share of a call (issue 31): the same API and core on the test suite's
fake engine, whose VM resumes, boots and answers its agent's frames at once, in this
process. What is left is the host's work for each call (the store, the locks, the
session and its frames), the part of a figure that no hypervisor makes faster: under
KVM a claim to its first exec is this plus the guest's resume, HELLO and `true`.

In one run, medians and p99 of each:

* a warm pool claim alone, the claim to its first exec, and a second exec;
* the agent round trip (`ping`), the floor of any call, and the figures over it.

A plain start or restore is left out: there the fake VM's own making (its files and
socket) would count as sandlot's, where QEMU's start dwarfs both.

    .venv/bin/python benchmarks/hostshare.py [--runs 200] [--pool 8] [--quick]
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import sandlot

from _common import drop_home, emit, parser, summary, timed_claims
from tests.support.fake_engine import register


async def run(home: Path, runs: int, pool: int) -> dict[str, Any]:
    root = home / "rootfs"
    (root / "bin").mkdir(parents=True)
    tmpl = await sandlot.template_async(rootfs=root, engine="fake", memory_mib=256, name="share", home=home)
    times: dict[str, list[float]] = {}
    pings: list[float] = []
    while len(times.get("claim", [])) < runs:
        await sandlot.set_pool_async(tmpl, pool, wait=True, home=home)
        claimed = await timed_claims(tmpl, home, min(pool, runs - len(times.get("claim", []))), times)
        for box in claimed:
            pings.append(await box.ping())
            await box.remove(force=True)
    await sandlot.set_pool_async(tmpl, 0, wait=True, home=home)
    await tmpl.remove()
    ping = summary(pings, 1000, digits=3)
    out: dict[str, Any] = {
        "pool_claim_ms": summary(times["claim"], 1000, digits=2),
        "pool_claim_to_first_exec_ms": summary(times["to_first_exec"], 1000, digits=2),
        "exec_true_ms": summary(times["again"], 1000, digits=2),
        "agent_ping_ms": ping,
    }
    out["over_ping_ratio"] = {
        key: round(float(out[key]["median"]) / float(ping["median"]), 1)
        for key in ("pool_claim_to_first_exec_ms", "exec_true_ms")
    }
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--pool", type=int, default=8)
    args = ap.parse_args()
    if args.quick:
        args.runs, args.pool = 8, 4
    os.environ["SANDLOT_POOL_REFILL"] = "0"  # the detached refiller is another process: no fake engine there
    os.environ["SANDLOT_POOL_MEMORY_MIB"] = str(256 * args.pool)
    register()
    home = Path(tempfile.mkdtemp(prefix="bench-hostshare-"))  # the fake engine needs no kernel
    try:
        figures = asyncio.run(run(home, args.runs, args.pool))
    finally:
        drop_home(home)
    emit({"benchmark": "hostshare", "quick": args.quick, "engine": "fake", "pool_size": args.pool,
          "runs": args.runs, **figures})  # fmt: skip


if __name__ == "__main__":
    main()
