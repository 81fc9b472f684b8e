"""The flight recorder (docs/recorder.md): what recording every step costs an agent.

* ``loop``: a scripted agent loop of ``--steps`` steps on a Debian box with python3
  (a file written through the API, its unit tests run with ``python3 -m unittest``, an
  edit with ``sed`` and a compile, a code cell), the same steps on two boxes of the
  same image in one run: one not recording, one recording every step. Measured back to
  back (a script's worst case: each step waits for the last one's checkpoint) and with
  ``--think`` seconds between steps (an agent waiting on its model, which hides the
  checkpoint), over ``--think-steps`` steps: the loop's wall time each way, the ratio,
  and each step's latency (median, p99); and the share of the recorded steps that list
  the guest's processes they left (``steps_with_processes``: 1.0);
* ``storage``: what each step's checkpoint added to the home (its stored chunks and
  disk layer) against the state the step changed (the guest memory pages that differ
  from the checkpoint before, and the disk written), per step;
* ``rewind``: ``box.rewind(n)`` to the middle step and to the first exec, to the first
  exec after it;
* ``bisect``: a box that records ``--bisect-steps`` steps, a test that breaks at a known
  step, found with 4 forks at once and with 1: the step found, the rounds, the wall time.

    .venv/bin/python benchmarks/recorder.py [--steps 200] [--think 0.5] [--think-steps 40]
        [--bisect-steps 128] [--quick]
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import sandlot
from sandlot.core.store import BoxStore

from _common import changed_memory, debian_root, drop_home, emit, host_facts, parser, scratch_home, summary

APP = "N = {n}\n\ndef double(x):\n    return 2 * x\n"
TEST = "import unittest\nfrom app import double\n\nclass T(unittest.TestCase):\n    def test(self):\n" \
       "        self.assertEqual(double(21), 42)\n"  # fmt: skip


def step(box: sandlot.Box, i: int) -> None:
    """One step of the scripted agent: each kind in turn."""
    kind = i % 4
    if kind == 0:
        box.files.write("/work/app.py", APP.format(n=i))
    elif kind == 1:
        r = box.sh("cd /work && python3 -m unittest -q test_app 2>&1")
        assert r.exit_code == 0, r.stdout
    elif kind == 2:
        r = box.sh(f"sed -i 's/^N = .*/N = {i}/' /work/app.py && python3 -m py_compile /work/app.py")
        assert r.exit_code == 0, r.stderr
    else:
        done = box.run_code(f"n = {i}\nn * 2")
        assert done.error is None, done.error


def loop(box: sandlot.Box, steps: int, think: float) -> tuple[float, list[float]]:
    latencies = []
    began = time.perf_counter()
    for i in range(steps):
        t = time.perf_counter()
        step(box, i)
        latencies.append(time.perf_counter() - t)
        if think:
            time.sleep(think)
    return time.perf_counter() - began, latencies


def prepared(home: Any, record: bool, template: bool | None = None) -> sandlot.Box:
    box = sandlot.Box(rootfs=debian_root(), memory_mib=512, home=home, keep=True, template=template).start()
    box.sh("mkdir -p /work")
    box.files.write("/work/app.py", APP.format(n=0))
    box.files.write("/work/test_app.py", TEST)
    box.run_code("0")  # the interpreter started before the loop, on both boxes
    if record:
        box.record()
    return box


def compare_loops(home: Any, steps: int, think: float) -> dict[str, Any]:
    plain, recorded = prepared(home, False), prepared(home, True)
    try:
        out: dict[str, Any] = {}
        shapes = (("back_to_back", steps, 0.0), (f"think_{think:g}s", max(2, steps // 5), think))
        for label, n, pause in shapes:
            wall_plain, lat_plain = loop(plain, n, pause)
            wall_rec, lat_rec = loop(recorded, n, pause)
            recorded.timeline()  # the last checkpoint taken
            out[label] = {
                "steps": n,
                "wall_s": {"plain": round(wall_plain, 2), "recorded": round(wall_rec, 2)},
                "recorded_over_plain": round(wall_rec / wall_plain, 3),
                "overhead_pct": round(100 * (wall_rec - wall_plain) / (wall_plain - n * pause), 1),
                "step_ms": {"plain": summary(lat_plain, 1000, 1), "recorded": summary(lat_rec, 1000, 1)},
            }
        steps_kept = recorded.timeline()
        assert all(s.kept for s in steps_kept), [str(s) for s in steps_kept if not s.kept]
        # each step with the guest's processes it left (listed in the checkpoint's time)
        listed = sum(s.processes is not None for s in steps_kept)
        out["steps_with_processes"] = round(listed / len(steps_kept), 3)
        # a box booted cold (no template: its RAM is anonymous), whose checkpoints stop the
        # guest only while its devices are saved, and whose next step begins then
        cold = prepared(home, True, template=False)
        try:
            wall_cold, lat_cold = loop(cold, steps, 0.0)
            cold.timeline()
            base = out["back_to_back"]["wall_s"]["plain"]
            out["back_to_back_cold_booted"] = {
                "steps": steps, "wall_s": {"plain": base, "recorded": round(wall_cold, 2)},
                "recorded_over_plain": round(wall_cold / base, 3),
                "overhead_pct": round(100 * (wall_cold - base) / base, 1),
                "step_ms": {"recorded": summary(lat_cold, 1000, 1)},
            }  # fmt: skip
        finally:
            cold.remove(force=True)
        return {"loops": out, "box": recorded, "timeline": steps_kept}
    finally:
        plain.remove(force=True)


def storage(home: Any, timeline: list[Any]) -> dict[str, Any]:
    store = BoxStore(home / "sandlot.db")
    added, changed, ratios = [], [], []
    for before, after in itertools.pairwise(timeline):
        rec = store.find_snapshot(after.checkpoint)
        assert rec is not None
        grew = int(rec.options["stored_bytes"])
        moved = changed_memory(home, before.checkpoint, after.checkpoint) + int(rec.options["disk_bytes"])
        added.append(grew)
        changed.append(moved)
        ratios.append(grew / moved if moved else 0.0)
    return {
        "steps": len(added),
        "added_KiB_per_step": summary(added, 1 / 1024, 1),
        "changed_KiB_per_step": summary(changed, 1 / 1024, 1),
        "added_over_changed": summary(ratios, digits=2),
    }


def rewinds(box: sandlot.Box, timeline: list[Any], runs: int) -> dict[str, Any]:
    middle = timeline[len(timeline) // 2].seq
    first_exec = next(s.seq for s in timeline if s.kind == "exec")
    out = {}
    for label, target in (("to_middle", middle), ("to_first_exec", first_exec)):
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            box.rewind(target)
            box.exec("true")
            times.append(time.perf_counter() - t)
        out[label] = {"step": target, "of": timeline[-1].seq, "to_first_exec_s": summary(times, digits=3)}
    return out


def bisection(home: Any, steps: int) -> dict[str, Any]:
    breaks = steps * 2 // 3
    box = sandlot.Box(rootfs=debian_root(), memory_mib=256, home=home, keep=True, record=True).start()
    try:
        for i in range(1, steps + 1):
            box.sh(f"echo {i} > /tmp/n")
        good = next(s.seq for s in box.timeline() if s.kind == "exec")
        out: dict[str, Any] = {"steps": steps, "breaks_after": f"the step that wrote {breaks}"}
        for parallel in (4, 1):
            t = time.perf_counter()
            found = box.bisect(f"test $(cat /tmp/n) -lt {breaks}", parallel=parallel, good=good, diff=False)
            wall = time.perf_counter() - t
            assert found.first_bad is not None, found
            assert found.first_bad.what["argv"][-1] == f"echo {breaks} > /tmp/n", found
            out[f"forks_{parallel}"] = {"found": found.first_bad.seq, "rounds": found.rounds,
                                        "tests": len(found.tested), "wall_s": round(wall, 2)}  # fmt: skip
        return out
    finally:
        box.remove(force=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--think", type=float, default=0.5)
    ap.add_argument("--bisect-steps", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    steps, think, bisect_steps, runs = (8, 0.2, 8, 1) if args.quick else (
        args.steps, args.think, args.bisect_steps, args.runs)  # fmt: skip
    home = scratch_home("bench-recorder-", kept=True)
    try:
        compared = compare_loops(home, steps, think)
        box, timeline = compared["box"], compared["timeline"]
        accel = box.accel
        kept = storage(home, timeline)
        back = rewinds(box, timeline, runs)
        box.remove(force=True)
        found = bisection(home, bisect_steps)
    finally:
        drop_home(home)
    emit({
        "benchmark": "recorder", "quick": args.quick, "host": host_facts(accel),
        "loop": compared["loops"], "storage": kept, "rewind": back, "bisect": found,
    })  # fmt: skip


if __name__ == "__main__":
    main()
