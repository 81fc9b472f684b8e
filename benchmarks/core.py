"""Core benchmarks (issue: boot a microVM box and run commands in it).

Prints one JSON document: cold boot to first exec, exec round trip, stdout,
stdin and file throughput, and host memory of idle boxes. Baselines measured in
the same run: the raw agent round trip (ping) and the guest's own pipe speed.

    .venv/bin/python benchmarks/core.py [--boots 10] [--execs 200]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import sandlot
from _common import busybox_root, emit, host_facts, pss_kib, summary

MB = 1_000_000


def bench_boot(root: Path, n: int) -> tuple[dict, str | None]:
    times, boots = [], []
    accel = None
    for _ in range(n):
        box = sandlot.Box(rootfs=root, memory_mib=256)
        t0 = time.perf_counter()
        box.start()
        t1 = time.perf_counter()
        box.exec("true")
        t2 = time.perf_counter()
        times.append(t2 - t0)
        boots.append(t1 - t0)
        accel = box.accel
        box.remove()
    return {
        "boot_to_first_exec_s": summary(times, digits=3),
        "boot_to_agent_s": summary(boots, digits=3),
    }, accel


def bench_exec(box: sandlot.Box, n: int) -> dict:
    box.exec("true")
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        box.exec("true")
        lat.append(time.perf_counter() - t0)
    pings = [box.ping() for _ in range(n)]
    ex, pg = summary(lat, 1e3), summary(pings, 1e3, 3)
    return {
        "exec_true_ms": ex,
        "agent_ping_ms": pg,
        "exec_over_ping_ratio": round(ex["median"] / pg["median"], 1),
    }


def bench_streams(box: sandlot.Box) -> dict:
    size = 200
    out_rates, pipe_rates, in_rates = [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        r = box.exec("dd", "if=/dev/zero", "bs=1M", f"count={size}")
        dt = time.perf_counter() - t0
        assert len(r.stdout_bytes) == size << 20
        out_rates.append((size << 20) / dt / MB)
        # baseline: the same bytes through a pipe inside the guest, no host involved
        t0 = time.perf_counter()
        box.sh(f"dd if=/dev/zero bs=1M count={size} 2>/dev/null | dd of=/dev/null bs=1M 2>/dev/null")
        pipe_rates.append((size << 20) / (time.perf_counter() - t0) / MB)
    blob = os.urandom(64 << 20)
    for _ in range(3):
        t0 = time.perf_counter()
        r = box.exec("dd", "of=/dev/null", "bs=1M", stdin=blob)  # busybox wc would be the bottleneck
        in_rates.append(len(blob) / (time.perf_counter() - t0) / MB)
        assert r.ok
    out, pipe = summary(out_rates, digits=1), summary(pipe_rates, digits=1)
    return {
        "stdout_MBps": out,
        "stdin_MBps": summary(in_rates, digits=1),
        "guest_pipe_MBps_baseline": pipe,
        "stdout_over_guest_pipe_ratio": round(out["median"] / pipe["median"], 2),
    }


def bench_files(box: sandlot.Box) -> dict:
    up, down = [], []
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "blob"
        src.write_bytes(os.urandom(100 << 20))
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        for _ in range(3):
            t0 = time.perf_counter()
            box.files.upload(src, "/var/blob")
            up.append((100 << 20) / (time.perf_counter() - t0) / MB)
            t0 = time.perf_counter()
            box.files.download("/var/blob", Path(d) / "back")
            down.append((100 << 20) / (time.perf_counter() - t0) / MB)
        assert hashlib.sha256((Path(d) / "back").read_bytes()).hexdigest() == digest
    box.files.remove("/var/blob")
    return {"upload_MBps": summary(up, digits=1), "download_MBps": summary(down, digits=1)}


def bench_memory(root: Path) -> dict:
    one = sandlot.Box(rootfs=root, memory_mib=256).start()
    one.exec("true")
    time.sleep(5)
    single = pss_kib(one.aio._vm.pid)  # type: ignore[union-attr]
    others = [sandlot.Box(rootfs=root, memory_mib=256).start() for _ in range(3)]
    for b in others:
        b.exec("true")
    time.sleep(5)
    per_box = [pss_kib(b.aio._vm.pid)["pss"] for b in [one, *others]]  # type: ignore[union-attr]
    for b in [one, *others]:
        b.remove()
    return {
        "idle_256MiB_box_pss_MiB": round(single["pss"] / 1024, 1),
        "idle_256MiB_box_pss_anon_MiB": round(single["pss_anon"] / 1024, 1),
        "idle_256MiB_box_pss_file_MiB": round(single["pss_file"] / 1024, 1),
        "idle_pss_per_box_with_4_boxes_MiB": summary([p / 1024 for p in per_box], digits=1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=10)
    ap.add_argument("--execs", type=int, default=200)
    args = ap.parse_args()
    root = busybox_root()
    sandlot.Box(rootfs=root).aio.runtime.assets()  # fetch/build once, outside the timings
    warm = sandlot.Box(rootfs=root, memory_mib=256).start()  # caches the base disk
    warm.remove()
    boot, accel = bench_boot(root, args.boots)
    doc: dict = {"benchmark": "core", "host": host_facts(accel), **boot}
    with sandlot.Box(rootfs=root, memory_mib=256) as box:
        doc.update(bench_exec(box, args.execs))
        doc.update(bench_streams(box))
        doc.update(bench_files(box))
    doc.update(bench_memory(root))
    emit(doc)


if __name__ == "__main__":
    main()
