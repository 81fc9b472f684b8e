"""Events benchmarks (docs/events.md).

* what an event adds to a state change: a box row's state written through the
  store with its event (one more INSERT in the same transaction) against the same
  write without one, in one run (median, p99, and the ratio of the medians);
* from a state change to its event in another process: a box is paused and
  unpaused here while a second process follows ``sandlot.events`` and prints
  each event; the clock runs from the call's return to the line's arrival. The
  baseline, in the same run and the same pipe: that process echoing a line;
* a query: one box's whole history (one in ten of ``--events`` kept events);
* a metrics sample of a running box (``core.metrics``: the host's figures and the
  agent's STATUS), as the home's sampler takes one every 10 s, and the host CPU the
  box's VM spends on answering it.

    .venv/bin/python benchmarks/events.py [--runs 200] [--events 100000] [--quick]
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import sandlot
from sandlot.core import events as core_events
from sandlot.core import metrics, sampler
from sandlot.core.runtime import Runtime
from sandlot.core.service import core_for
from sandlot.core.store import BoxRecord

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary

FOLLOWER = """
import sys, sandlot
print("ready", flush=True)
source = sandlot.events(home=sys.argv[1], after=int(sys.argv[2]))
for line in sys.stdin:
    if line.strip() == "go":
        break
    print(line.strip(), flush=True)  # the baseline: an echo through the same pipes
for e in source:
    print(e.kind, flush=True)
"""


def state_writes(home: Any, runs: int) -> dict[str, Any]:
    """A row made as the controller makes one (born creating, moved along declared
    transitions: the store refuses any other), then paused and unpaused."""
    store = Runtime.for_home(home).store
    now = time.time()
    store.insert(BoxRecord("b" * 12, "bench-row", "creating", {}, now, now))
    for before, after in (("creating", "created"), ("created", "starting"), ("starting", "running")):
        store.update("b" * 12, expect=(before,), state=after)
    timings: dict[str, list[float]] = {"with_event": [], "without_event": []}
    state = "running"
    for i in range(runs * 4):
        before, state = state, ("paused" if state == "running" else "running")
        with_event = i % 4 < 2
        t0 = time.perf_counter()
        event = core_events.draft("paused" if state == "paused" else "unpaused") if with_event else None
        store.update("b" * 12, expect=(before,), state=state, event=event)
        timings["with_event" if with_event else "without_event"].append(time.perf_counter() - t0)
    store.delete("b" * 12)
    w, wo = summary(timings["with_event"], 1e3, 3), summary(timings["without_event"], 1e3, 3)
    ratio = round(w["median"] / wo["median"], 2)
    return {"with_event_ms": w, "without_event_ms": wo, "ratio_with_over_without": ratio}


def follow_latency(home: Any, runs: int) -> dict[str, Any]:
    after = Runtime.for_home(home).store.last_event_id()
    proc = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(home), str(after)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    echo, seen = [], []
    try:
        assert proc.stdout.readline().strip() == "ready"
        for i in range(runs + 3):
            t0 = time.perf_counter()
            proc.stdin.write(f"{i}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == str(i)
            if i >= 3:
                echo.append(time.perf_counter() - t0)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        # booted (no template save among the events the follower reads in order)
        with sandlot.Box(rootfs=busybox_root(), memory_mib=256, home=home, template=False) as box:
            for kind in ("created", "started"):
                assert proc.stdout.readline().strip() == kind
            for i in range(runs + 3):
                box.pause()
                t0 = time.perf_counter()
                assert proc.stdout.readline().strip() == "paused"
                t1 = time.perf_counter()
                box.unpause()
                assert proc.stdout.readline().strip() == "unpaused"
                if i >= 3:
                    seen.append(t1 - t0)
            accel = box.accel
            sampling = sample_cost(home, box, runs)
    finally:
        proc.kill()
        proc.wait()
    return {
        "change_to_other_process_ms": summary(seen, 1e3, 2),
        "pipe_echo_baseline_ms": summary(echo, 1e3, 3),
        "metrics_sample": sampling,
        "accel": accel,
    }


def sample_cost(home: Any, box: sandlot.Box, runs: int) -> dict[str, Any]:
    async def go() -> list[float]:
        core = core_for(Runtime.for_home(home))
        rec = await core.db.get(box.id)
        times = []
        for _ in range(runs + 3):
            t0 = time.perf_counter()
            await sampler.sample_box(core, rec)
            times.append(time.perf_counter() - t0)
        await core.close()
        return times[3:]

    cpu0 = box.stats()["cpu_seconds"]
    times = asyncio.run(go())
    vm_cpu = (box.stats()["cpu_seconds"] - cpu0) / (runs + 3)
    return {"ms": summary(times, 1e3, 2), "vm_cpu_ms_per_sample": round(vm_cpu * 1e3, 2),
            "vm_cpu_ms_per_s_at_every_10s": round(vm_cpu * 1e3 / metrics.DEFAULT_EVERY, 3)}  # fmt: skip


def query(home: Any, kept: int) -> dict[str, Any]:
    store = Runtime.for_home(home).store
    now = time.time()
    store.insert(BoxRecord("q" * 12, "queried", "creating", {}, now, now))  # its state is not read
    t0 = time.perf_counter()
    for i in range(kept):
        store.add_event(core_events.draft("quota_refused", f"{i}"), "q" * 12 if i % 10 == 0 else None)
    fill_s = time.perf_counter() - t0
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        got = list(sandlot.events(box="queried", home=home, follow=False))
        times.append(time.perf_counter() - t0)
    store.delete("q" * 12)
    return {"kept": kept, "box_events": len(got), "fill_events_per_s": round(kept / fill_s),
            "box_history_ms": summary(times, 1e3, 2)}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--events", type=int, default=20_000)
    args = ap.parse_args()
    runs, kept = (5, 500) if args.quick else (args.runs, args.events)
    home = scratch_home("bench-events-")
    try:
        writes = state_writes(home, runs)
        latency = follow_latency(home, max(5, runs // 4))
        found = query(home, kept)
    finally:
        drop_home(home)
    emit({"benchmark": "events", "quick": args.quick, "host": host_facts(latency.pop("accel")),
          "state_write": writes, "follow": latency, "query": found})  # fmt: skip


if __name__ == "__main__":
    main()
