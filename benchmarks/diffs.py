"""Diff benchmarks (docs/diffs.md).

A box holds a tree of ``--mb`` MiB in files of 1 MiB (10 directories), is
snapshotted, and then 10 of those files change. Measured, each over ``--runs``:

* ``snapshot_to_now``: ``box.diff(snap)``, whole: the snapshot started as a box
  of its own, both trees walked, the 20 changed files read, the box removed. The
  target: 2 s for 1 GB here;
* its parts: ``compare_s`` (walks, reads and comparison, from the answer) and, as
  a baseline in the same run, ``snapshot_start_remove``: starting a box from the
  snapshot and removing it, which is what the diff adds to a comparison of two
  running states;
* ``box_to_box``: a fork against its parent, both running (no box to start);
* ``restore_one_file``: ``box.files.restore`` of one changed file from the snapshot.

    .venv/bin/python benchmarks/diffs.py [--runs 10] [--mb 1024] [--quick]
"""

from __future__ import annotations

import time
from typing import Any

import sandlot

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary

DIRS = 10


def make_tree(box: sandlot.Box, mib: int) -> float:
    per_dir = max(1, mib // DIRS)
    t0 = time.monotonic()
    r = box.sh(
        f"for d in $(seq 0 {DIRS - 1}); do mkdir -p /data/$d; for f in $(seq 0 {per_dir - 1}); do "
        "dd if=/dev/urandom of=/data/$d/$f bs=64k count=16 iflag=fullblock 2>/dev/null; done; done; sync",
        timeout=3600,
    )
    assert r.exit_code == 0, r.stderr
    return time.monotonic() - t0


def timed(fn: Any, runs: int) -> tuple[list[float], Any]:
    times, last = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - t0)
    return times, last


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--mb", type=int, default=1024)
    args = ap.parse_args()
    runs, mib = (2, 20) if args.quick else (args.runs, args.mb)
    home = scratch_home("bench-diffs-", kept=True)
    try:
        bigger = {"disk_size_gb": mib // 1024 + 2} if mib > 6 * 1024 else {}  # past the default 8 GB
        with sandlot.Box(rootfs=busybox_root(), memory_mib=256, home=home, **bigger) as box:
            made_s = make_tree(box, mib)
            snap = box.snapshot("bench")
            box.sh(f"for d in $(seq 0 {DIRS - 1}); do echo changed >> /data/$d/0; done")
            times, found = timed(lambda: box.diff(snap), runs)
            assert [c.path for c in found] == [f"/data/{d}/0" for d in range(DIRS)], found.summary()
            compare = [box.diff(snap).seconds for _ in range(max(1, runs // 2))]

            def start_remove() -> None:
                (kid,) = snap.start()
                kid.remove(force=True)

            starts, _ = timed(start_remove, runs)
            (kid,) = box.fork()
            try:
                kid.sh("echo other >> /data/1/1")
                pair, between = timed(lambda: kid.diff(box), runs)
                assert [c.path for c in between] == ["/data/1/1"], between.summary()
            finally:
                kid.remove(force=True)
            restores, _ = timed(lambda: box.files.restore("/data/0/0", from_=snap), runs)
            accel = box.accel
            walked = found.raw["walked"]
    finally:
        drop_home(home)
    diff_s = summary(times, 1, 3)
    emit({
        "benchmark": "diffs", "quick": args.quick, "host": host_facts(accel),
        "tree": {"mib": mib, "files": DIRS * max(1, mib // DIRS), "entries_walked": walked["b"],
                 "made_s": round(made_s, 1), "changed_files": DIRS},
        "snapshot_to_now": {"s": diff_s, "compare_s": summary(compare, 1, 3),
                            "within_2s_target": diff_s["median"] <= 2.0},
        "snapshot_start_remove": {"s": summary(starts, 1, 3)},
        "box_to_box": {"s": summary(pair, 1, 3)},
        "restore_one_file": {"s": summary(restores, 1, 3)},
    })  # fmt: skip


if __name__ == "__main__":
    main()
