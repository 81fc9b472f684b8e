"""Saved state as content-addressed chunks (docs/storage.md), against whole files per
state (``SANDLOT_STATE_CHUNKS=0``: sandlot's saves before chunks), side by side in one
run, each in a home of its own:

* checkpoints: a box with live data in RAM takes ``--checkpoints`` snapshots with
  ``--write-mib`` of files written (and synced) between each: the bytes each adds to
  its home, against the state that changed (the bytes its disk layer took, plus the
  guest memory whose pages differ from the last state's: page cache included), and the
  guest's pause;
* fan-out: ``--boxes`` boxes from one template, each writing a little and suspended:
  the home's bytes against the template's plus what the boxes changed;
* gVisor's checkpoints: a gVisor box holding live data in its kernel's memory takes
  ``--checkpoints`` snapshots with a small write between each (runsc compresses its
  image; sandlot keeps its state inflated, cut by content): the bytes each adds, its
  time, and a rollback to the first exec after it, against runsc's images kept whole;
* local speed: rollback, suspend and resume (each to the first exec after it), and a
  fork of ``--fork`` children to the first exec of all;
* the storage tier, against moto's S3 server on 127.0.0.1 (tests/support/s3.py): a
  box holding ``--live-mib`` in RAM, suspended, moves between two homes ``--runs``
  times (push with release, pull on the other home, resume to the first exec there):
  the push and pull throughput, the time from the pull to the first exec on the new
  home, and the bytes that home read from the tier before that exec answered (the
  chunks the resume loaded: the rest of the state is never fetched). Then the box is
  removed where it is held, and a collection of the bucket (``storage.gc(tier=True)``)
  takes what the bucket kept of it: its time, and the bucket's bytes before and after.

    .venv/bin/python benchmarks/storage.py [--quick] [--memory 512] [--live-mib 200]
        [--checkpoints 10] [--write-mib 4] [--boxes 100] [--fork 20] [--runs 5] [--no-tier]

The changed memory is counted page by page from the chunk store's own states (the
chunks whose hashes differ, compared page by page), which is why this script reads
``sandlot.core``: no public call says which pages of a guest changed.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import sandlot
from sandlot import AsyncBox
from sandlot.config import tree_bytes
from sandlot.core.store import BoxStore

from _common import (
    busybox_root,
    changed_memory,
    debian_root,
    drop_home,
    emit,
    gvisor_unusable,
    host_facts,
    parser,
    rollbacks_to_first_exec,
    scratch_home,
    summary,
)

MiB = 1 << 20
accel: list[str | None] = [None]  # the accelerator the boxes ran under


def use_chunks(on: bool) -> None:
    os.environ["SANDLOT_STATE_CHUNKS"] = "1" if on else "0"


async def checkpoints(
    root: Path, memory: int, live_mib: int, count: int, write_mib: int, chunks: bool
) -> dict[str, Any]:
    use_chunks(chunks)
    home = scratch_home("bench-storage-")
    try:
        box = AsyncBox(rootfs=root, memory_mib=memory, keep=True, template=False, home=home)
        await box.start()
        accel[0] = box.accel
        # live data: a tmpfs file (RAM the guest holds), then the page cache dropped so
        # that what a checkpoint finds changed is what this loop changes
        await box.sh(
            f"head -c {live_mib}M /dev/urandom > /dev/shm/live && sync && echo 3 > /proc/sys/vm/drop_caches"
        )
        first = await box.snapshot("c0")
        added, ratios, pauses, walls, changed_all = [], [], [], [], []
        prev = first
        for i in range(1, count + 1):
            await box.sh(f"head -c {write_mib}M /dev/urandom > /root/w{i} && sync")
            before = tree_bytes(home)
            t = time.perf_counter()
            snap = await box.snapshot(f"c{i}")
            walls.append(time.perf_counter() - t)
            grew = tree_bytes(home) - before
            assert box.last_pause is not None
            pauses.append(box.last_pause)
            added.append(grew)
            if chunks:
                rec = BoxStore(home / "sandlot.db").find_snapshot(snap.id)
                assert rec is not None
                changed = changed_memory(home, prev.id, snap.id) + int(rec.options["disk_bytes"])
                changed_all.append(changed)
                ratios.append(grew / changed)
            prev = snap
        out: dict[str, Any] = {
            "added_MiB_per_checkpoint": summary(added, 1 / MiB, 1),
            "pause_ms": summary(pauses, 1000, 1),
            "snapshot_wall_s": summary(walls, digits=3),
        }
        if chunks:
            out["changed_MiB_per_checkpoint"] = summary(changed_all, 1 / MiB, 1)
            out["added_over_changed"] = summary(ratios, digits=2)
        await box.remove(force=True)
        return out
    finally:
        drop_home(home)


async def fan_out(root: Path, boxes: int, chunks: bool) -> dict[str, Any]:
    use_chunks(chunks)
    home = scratch_home("bench-storage-fan-")
    try:
        before = tree_bytes(home)
        tmpl = await sandlot.template_async(rootfs=root, memory_mib=256, name="fan", home=home)
        # measured once what a save leaves for later is gone (the template's boot box's
        # chunks no state lists): else the boxes' share would come out below zero
        await asyncio.to_thread(sandlot.storage.gc, home=home)
        template_bytes = tree_bytes(home) - before
        changed = 0
        store = BoxStore(home / "sandlot.db")
        for i in range(boxes):
            b = AsyncBox(template=tmpl, keep=True, home=home)
            await b.start()
            await b.sh(f"head -c 256K /dev/urandom > /root/mine-{i} && sync")
            await b.suspend()
            if chunks:
                rec = store.get(b.name)
                assert rec.suspended is not None
                layer = Path(rec.disk or "")
                changed += changed_memory(home, tmpl.id, rec.suspended) + layer.stat().st_blocks * 512
        await asyncio.to_thread(sandlot.storage.gc, home=home)
        total = tree_bytes(home) - before
        out: dict[str, Any] = {"boxes": boxes, "template_MiB": round(template_bytes / MiB, 1),
                               "home_MiB": round(total / MiB, 1),
                               "per_box_MiB": round((total - template_bytes) / boxes / MiB, 2)}  # fmt: skip
        if chunks:
            out["changed_MiB"] = round(changed / MiB, 1)
            out["over_template_plus_changed"] = round(total / (template_bytes + changed), 2)
            out["beyond_template_over_changed"] = round((total - template_bytes) / changed, 2)
        return out
    finally:
        drop_home(home)


async def local_speed(root: Path, runs: int, fork: int, chunks: bool) -> dict[str, Any]:
    use_chunks(chunks)
    home = scratch_home("bench-storage-speed-")
    try:
        box = AsyncBox(rootfs=root, memory_mib=256, keep=True, template=False, home=home)
        await box.start()
        await box.exec("true")
        snap = await box.snapshot("base")
        rollbacks, suspends, resumes = [], [], []
        for _ in range(runs):
            t = time.perf_counter()
            await box.rollback(snap)
            await box.exec("true")
            rollbacks.append(time.perf_counter() - t)
            t = time.perf_counter()
            await box.suspend()
            suspends.append(time.perf_counter() - t)
            t = time.perf_counter()
            await box.resume()
            await box.exec("true")
            resumes.append(time.perf_counter() - t)
        t = time.perf_counter()
        kids = await box.fork(fork)
        await asyncio.gather(*(k.exec("true") for k in kids))
        fork_s = time.perf_counter() - t
        for k in kids:
            await k.remove(force=True)
        await box.remove(force=True)
        return {"rollback_to_first_exec_s": summary(rollbacks, digits=3),
                "suspend_s": summary(suspends, digits=3),
                "resume_to_first_exec_s": summary(resumes, digits=3),
                f"fork_{fork}_to_first_exec_all_s": round(fork_s, 3)}  # fmt: skip
    finally:
        drop_home(home)


async def gvisor_checkpoints(live_mib: int, count: int, runs: int, chunks: bool) -> dict[str, Any]:
    """A gVisor box holding ``live_mib`` in its kernel's memory (a tmpfs in the sandbox),
    ``count`` checkpoints with a small write between each: the bytes each adds to its
    home and its time; then rollbacks to the first, each to the first exec after it."""
    use_chunks(chunks)
    home = scratch_home("bench-storage-gvisor-")
    try:
        box = AsyncBox(rootfs=busybox_root(), engine="gvisor", memory_mib=256, keep=True, template=False,
                       home=home)  # fmt: skip
        await box.start()
        await box.sh(f"mkdir -p /mnt/mem && mount -t tmpfs mem /mnt/mem && "
                     f"head -c {live_mib * MiB} /dev/urandom > /mnt/mem/live")  # fmt: skip
        first = await box.snapshot("g0")
        added, walls = [], []
        for i in range(1, count + 1):
            await box.sh(f"echo {i} > /mnt/mem/step")
            before = tree_bytes(home)
            t = time.perf_counter()
            await box.snapshot(f"g{i}")
            walls.append(time.perf_counter() - t)
            added.append(tree_bytes(home) - before)
        rollbacks = await rollbacks_to_first_exec(box, first, runs)
        await box.remove(force=True)
        return {
            "added_MiB_per_checkpoint": summary(added, 1 / MiB, 2),
            "snapshot_wall_s": summary(walls, digits=3),
            "rollback_to_first_exec_s": summary(rollbacks, digits=3),
        }
    finally:
        drop_home(home)


def tier_moves(root: Path, memory: int, live_mib: int, runs: int) -> dict[str, Any]:
    """A suspended box moved between two homes through the tier, ``runs`` times."""
    import tempfile

    from tests.support.s3 import CREDENTIALS, s3_server

    use_chunks(True)
    os.environ.update(CREDENTIALS)
    os.environ["SANDLOT_STORAGE_PUSH"] = "0"  # the pushes measured are this script's own
    homes = [scratch_home("bench-storage-tier-a-"), scratch_home("bench-storage-tier-b-")]
    with tempfile.TemporaryDirectory() as work, s3_server(Path(work)) as s3:
        try:
            for home in homes:
                sandlot.storage.configure(s3.url("bench"), endpoint_url=s3.endpoint_url, home=home)
            box = sandlot.Box(rootfs=root, memory_mib=memory, keep=True, template=False, home=homes[0])
            box.start()
            box.sh(f"dd if=/dev/urandom of=/dev/shm/live bs=1M count={live_mib} 2>/dev/null")  # (busybox too)
            box.suspend()
            pushes, pulls, firsts, pulled = [], [], [], []
            for i in range(runs):
                src, dst = homes[i % 2], homes[(i + 1) % 2]
                t = time.perf_counter()
                report = sandlot.storage.push(box.name, release=True, home=src)
                pushes.append((report.bytes, time.perf_counter() - t))
                before = sandlot.storage.totals(home=dst)["tier_received_bytes"]
                t = time.perf_counter()
                box = sandlot.storage.pull(box.name, home=dst)
                pulled_at = time.perf_counter()
                box.exec("true")  # resumes it: its state's chunks come from the tier as it loads
                done = time.perf_counter()
                pulls.append(pulled_at - t)
                firsts.append(done - t)
                pulled.append(sandlot.storage.totals(home=dst)["tier_received_bytes"] - before)
                if box.sh("wc -c < /dev/shm/live").stdout.strip() != str(live_mib << 20):
                    raise RuntimeError("the box's memory did not come through the tier whole")
                box.suspend()
            holder = homes[runs % 2]
            box.remove(force=True)  # where it is held: nobody needs what the bucket keeps of it
            bucket_before = bucket_bytes(s3)
            t = time.perf_counter()
            collected = sandlot.storage.gc(tier=True, home=holder).tier
            collect_s = time.perf_counter() - t
            bucket_after = bucket_bytes(s3)
        finally:
            for home in homes:
                drop_home(home)
    assert collected is not None
    first_bytes, first_s = pushes[0]
    return {
        "live_MiB": live_mib,
        "first_push": {"MiB": round(first_bytes / MiB, 1), "s": round(first_s, 3),
                       "MiB_per_s": round(first_bytes / MiB / first_s, 1)},
        "later_push_MiB": summary([b for b, _ in pushes[1:]] or [0.0], 1 / MiB, 2),
        "pull_s": summary(pulls, digits=3),
        "pull_to_first_exec_s": summary(firsts, digits=3),
        "read_from_tier_before_first_exec_MiB": summary(pulled, 1 / MiB, 1),
        "read_MiB_per_s": round(sum(pulled) / MiB / sum(firsts), 1),
        # the box removed where it was held: a collection of the bucket takes what it kept
        "collect": {"s": round(collect_s, 3), "chunks": collected.chunks, "states": collected.states,
                    "files": collected.files, "freed_MiB": round(collected.bytes_freed / MiB, 1),
                    "bucket_MiB_before": round(bucket_before / MiB, 1),
                    "bucket_MiB_after": round(bucket_after / MiB, 1)},
    }  # fmt: skip


def bucket_bytes(s3: Any) -> int:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


async def run(args: Any) -> dict[str, Any]:
    root = debian_root()
    out: dict[str, Any] = {}
    shape = {"memory_mib": args.memory, "live_mib": args.live_mib, "checkpoints": args.checkpoints,
             "write_mib": args.write_mib}  # fmt: skip
    out["checkpoints"] = {"shape": shape}
    for mode, on in (("chunks", True), ("files", False)):
        out["checkpoints"][mode] = await checkpoints(root, args.memory, args.live_mib, args.checkpoints,
                                                     args.write_mib, on)  # fmt: skip
    c, f = out["checkpoints"]["chunks"], out["checkpoints"]["files"]
    out["checkpoints"]["files_over_chunks_added"] = round(
        f["added_MiB_per_checkpoint"]["median"] / max(c["added_MiB_per_checkpoint"]["median"], 0.01), 1
    )
    # quick (CI, so that none of it rots): the saves as whole files once, in the checkpoints;
    # the fan-out and the local speeds on chunks only, the path every box takes
    modes = (("chunks", True),) if args.quick else (("chunks", True), ("files", False))
    out["fan_out"] = {mode: await fan_out(root, args.boxes, on) for mode, on in modes}
    speed = {mode: await local_speed(root, args.runs, args.fork, on) for mode, on in modes}
    fork_key = f"fork_{args.fork}_to_first_exec_all_s"
    if "files" in speed:
        speed["chunks_over_files"] = {
            k: round(speed["chunks"][k]["median"] / speed["files"][k]["median"], 2)
            for k in ("rollback_to_first_exec_s", "suspend_s", "resume_to_first_exec_s")
        }
        speed["chunks_over_files"][fork_key] = round(speed["chunks"][fork_key] / speed["files"][fork_key], 2)
    out["local_speed"] = speed
    # gVisor's checkpoints, kept as chunks of their inflated state or as runsc's files
    unusable = gvisor_unusable(sandlot.Runtime.for_home().doctor())
    if unusable is None:
        live = 8 if args.quick else 64
        g = {mode: await gvisor_checkpoints(live, args.checkpoints, max(args.runs, 2), on)
             for mode, on in (("chunks", True), ("files", False))}  # fmt: skip
        g["shape"] = {"live_mib": live, "checkpoints": args.checkpoints}
        g["files_over_chunks_added"] = round(
            g["files"]["added_MiB_per_checkpoint"]["median"]
            / max(g["chunks"]["added_MiB_per_checkpoint"]["median"], 0.01), 1
        )  # fmt: skip
        g["chunks_over_files_rollback"] = round(
            g["chunks"]["rollback_to_first_exec_s"]["median"]
            / g["files"]["rollback_to_first_exec_s"]["median"],
            2,
        )
        out["gvisor_checkpoints"] = g
    else:
        out["gvisor_checkpoints"] = {"skipped": unusable}
    if args.tier:
        # quick: each path once, on the least that shows it (a busybox disk: the first push
        # sends a disk's base whole, and a Debian one's is most of a quick run's time)
        live, disk = (8, busybox_root()) if args.quick else (args.live_mib, root)
        out["tier"] = await asyncio.to_thread(tier_moves, disk, args.memory, live, max(args.runs, 2))
    out["host"] = host_facts(accel[0])
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--memory", type=int, default=512)
    ap.add_argument("--live-mib", type=int, default=200)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--write-mib", type=int, default=4)
    ap.add_argument("--boxes", type=int, default=100)
    ap.add_argument("--fork", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-tier", dest="tier", action="store_false", help="without the storage tier")
    args = ap.parse_args()
    if args.quick:
        args.memory, args.live_mib, args.checkpoints, args.boxes, args.fork, args.runs = 256, 32, 2, 2, 2, 1
    emit({"benchmark": "storage", "quick": args.quick, **asyncio.run(run(args))})


if __name__ == "__main__":
    main()
