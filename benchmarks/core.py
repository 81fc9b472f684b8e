"""Core benchmarks (issue: boot a microVM box and run commands in it).

Prints one JSON document: cold boot to first exec (and, in the same run, a start from
the root filesystem's automatic template), exec round trip, stdout,
stdin and file throughput, host memory of idle boxes, and dynamically linked
programs' starts with address-space randomization on and off. Baselines measured in
the same run: the raw agent round trip (ping), the guest's own fork and exec of
``/bin/true`` (an exec's floor), and the guest's own pipe speed.

    .venv/bin/python benchmarks/core.py [--boots 10] [--execs 200] [--quick]
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sandlot

from _common import busybox_root, debian_root, emit, host_facts, parser, pss_breakdown_mib, pss_kib, summary

MB = 1_000_000


def bench_boot(root: Path, n: int) -> tuple[dict, str | None]:
    times, boots = [], []
    accel = None
    for _ in range(n):
        box = sandlot.Box(rootfs=root, memory_mib=256, template=False)
        t0 = time.perf_counter()
        box.start()
        t1 = time.perf_counter()
        box.exec("true")
        t2 = time.perf_counter()
        times.append(t2 - t0)
        boots.append(t1 - t0)
        accel = box.accel
        box.remove(force=True)
    return {
        "boot_to_first_exec_s": summary(times, digits=3),
        "boot_to_agent_s": summary(boots, digits=3),
    }, accel


def bench_rootfs_template(root: Path, n: int, boot_median: float) -> dict:
    """A box of the same root filesystem without ``template=False``: the first one's boot
    is saved as the root filesystem's automatic template, and the boxes after it restore
    that state instead of booting (what every ``Box(rootfs=...)`` and ``Box(image)`` does)."""
    sandlot.Box(rootfs=root, memory_mib=256).start().remove(force=True)  # saves the template
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        box = sandlot.Box(rootfs=root, memory_mib=256).start()
        box.exec("true")
        times.append(time.perf_counter() - t0)
        box.remove(force=True)
    s = summary(times, digits=3)
    return {
        "start_from_automatic_template_to_first_exec_s": s,
        "boot_over_automatic_template": round(boot_median / max(float(s["median"]), 1e-3), 1),
    }


def took(call: Callable[..., object], *args: str) -> float:
    """Seconds ``call(*args)`` took."""
    t0 = time.perf_counter()
    call(*args)
    return time.perf_counter() - t0


def bench_exec(box: sandlot.Box, n: int) -> dict:
    box.exec("true")
    lat = [took(box.exec, "true") for _ in range(n)]
    pings = [box.ping() for _ in range(n)]
    ex, pg = summary(lat, 1e3), summary(pings, 1e3, 3)
    guest = guest_fork_exec_ms(box, max(n, 50))
    return {
        "exec_true_ms": ex,
        "agent_ping_ms": pg,
        "exec_over_ping_ratio": round(ex["median"] / pg["median"], 1),
        # the floor an exec cannot go under: the guest kernel's own process creation
        "guest_fork_exec_true_ms": guest,
        "exec_over_guest_fork_exec_ratio": round(ex["median"] / guest, 2),
    }


def guest_fork_exec_ms(box: sandlot.Box, n: int) -> float:
    """The mean cost of the guest's own fork and exec of ``/bin/true`` from a shell,
    ``n`` in a row, on the guest's clock: what an exec costs without sandlot."""
    r = box.sh(
        f"a=$(cut -d' ' -f1 /proc/uptime); i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done; "
        "b=$(cut -d' ' -f1 /proc/uptime); echo $a $b"
    )  # /proc/uptime counts hundredths: n runs make it precise enough
    start, end = map(float, r.stdout.split())
    return round((end - start) * 1000 / n, 2)


def bench_dynamic_programs(quick: bool) -> dict:
    """Dynamically linked programs (a Debian box): exec ``/usr/bin/true`` and a Python
    start, with the box's address-space randomization on (the default) and off
    (``aslr=False``), beside busybox's static ``/bin/true`` in a busybox box, in one
    run. Under TCG a program whose libraries land at new addresses has them translated
    again (QEMU 7.2 keys translated code by virtual address); under KVM the two are
    alike."""
    execs, starts = (5, 2) if quick else (40, 8)
    out: dict = {}
    for aslr in (True, False):
        with sandlot.Box(rootfs=debian_root(), memory_mib=512, aslr=aslr, template=False) as box:
            box.exec("/usr/bin/true")
            lat = [took(box.exec, "/usr/bin/true") for _ in range(execs)]
            py = [took(box.exec, "python3", "-c", "pass") for _ in range(starts)]
            out["aslr_on" if aslr else "aslr_off"] = {
                "exec_usr_bin_true_ms": summary(lat, 1e3),
                "python3_start_ms": summary(py, 1e3, 1),
            }
    on, off = out["aslr_on"], out["aslr_off"]
    for key in ("exec_usr_bin_true_ms", "python3_start_ms"):
        out[f"{key.removesuffix('_ms')}_on_over_off_ratio"] = round(on[key]["median"] / off[key]["median"], 2)
    # beside them, a static program: busybox's, in a busybox box (randomization on)
    with sandlot.Box(rootfs=busybox_root(), memory_mib=256, template=False) as box:
        box.exec("/bin/true")
        static = summary([took(box.exec, "/bin/true") for _ in range(execs)], 1e3)
    out["busybox_exec_bin_true_ms"] = static
    out["exec_usr_bin_true_over_busybox_ratio"] = {
        name: round(out[name]["exec_usr_bin_true_ms"]["median"] / static["median"], 2)
        for name in ("aslr_on", "aslr_off")
    }
    return {"dynamic_programs": out}


def bench_streams(box: sandlot.Box, quick: bool) -> dict:
    size, reps = (16, 1) if quick else (200, 3)
    out_rates, pipe_rates, in_rates = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = box.exec("dd", "if=/dev/zero", "bs=1M", f"count={size}")
        dt = time.perf_counter() - t0
        assert len(r.stdout_bytes) == size << 20
        out_rates.append((size << 20) / dt / MB)
        # baseline: the same bytes through a pipe inside the guest, no host involved
        t0 = time.perf_counter()
        box.sh(f"dd if=/dev/zero bs=1M count={size} 2>/dev/null | dd of=/dev/null bs=1M 2>/dev/null")
        pipe_rates.append((size << 20) / (time.perf_counter() - t0) / MB)
    blob = os.urandom((8 if quick else 64) << 20)
    for _ in range(reps):
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


def bench_files(box: sandlot.Box, quick: bool) -> dict:
    up, down = [], []
    size, reps = (8 << 20, 1) if quick else (100 << 20, 3)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "blob"
        src.write_bytes(os.urandom(size))
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        for _ in range(reps):
            t0 = time.perf_counter()
            box.files.upload(src, "/var/blob")
            up.append(size / (time.perf_counter() - t0) / MB)
            t0 = time.perf_counter()
            box.files.download("/var/blob", Path(d) / "back")
            down.append(size / (time.perf_counter() - t0) / MB)
        assert hashlib.sha256((Path(d) / "back").read_bytes()).hexdigest() == digest
    box.files.remove("/var/blob")
    return {"upload_MBps": summary(up, digits=1), "download_MBps": summary(down, digits=1)}


def bench_memory(root: Path, quick: bool) -> dict:
    settle = 1 if quick else 5
    one = sandlot.Box(rootfs=root, memory_mib=256, template=False).start()
    boxes = [one]
    try:
        one.exec("true")
        time.sleep(settle)
        single = pss_kib(one.inspect()["vm_pid"])
        breakdown = pss_breakdown_mib(one.inspect()["vm_pid"], 256)
        # inside: what the guest kernel holds (the agent ports' receive buffers are unreclaimable slab)
        guest = dict(line.split(":") for line in one.sh("cat /proc/meminfo").stdout.splitlines())
        keys = ("MemTotal", "MemFree", "SUnreclaim")
        guest_mib = {k: round(int(guest[k].split()[0]) / 1024, 1) for k in keys}
        # a program in the box uses 100 MiB and frees it: what the host still holds for it
        one.sh("mkdir -p /run/fill && mount -t tmpfs tmpfs /run/fill && "
               "dd if=/dev/zero of=/run/fill/x bs=1M count=100 2>/dev/null && "
               "rm /run/fill/x && umount /run/fill")  # fmt: skip
        time.sleep(settle)
        after_free = pss_kib(one.inspect()["vm_pid"])
        boxes += [
            sandlot.Box(rootfs=root, memory_mib=256, template=False).start() for _ in range(1 if quick else 3)
        ]
        for b in boxes:
            b.exec("true")
        time.sleep(settle)
        per_box = [pss_kib(b.inspect()["vm_pid"])["pss"] for b in boxes]
    finally:
        for b in boxes:
            b.remove(force=True)
    return {
        "idle_256MiB_box_pss_MiB": round(single["pss"] / 1024, 1),
        "idle_256MiB_box_pss_anon_MiB": round(single["pss_anon"] / 1024, 1),
        "idle_256MiB_box_pss_file_MiB": round(single["pss_file"] / 1024, 1),
        "idle_256MiB_box_pss_breakdown_MiB": breakdown,
        "idle_256MiB_box_guest_meminfo_MiB": guest_mib,
        "idle_256MiB_box_pss_after_using_and_freeing_100MiB_MiB": round(after_free["pss"] / 1024, 1),
        f"idle_pss_per_box_with_{len(per_box)}_boxes_MiB": summary([p / 1024 for p in per_box], digits=1),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--boots", type=int, default=10)
    ap.add_argument("--execs", type=int, default=200)
    args = ap.parse_args()
    if args.quick:
        args.boots, args.execs = 2, 20
    root = busybox_root()
    sandlot.Runtime.for_home().prepare()  # fetch/build once, outside the timings
    warm = sandlot.Box(rootfs=root, memory_mib=256, template=False).start()  # caches the base disk
    warm.remove(force=True)
    boot, accel = bench_boot(root, args.boots)
    boot.update(bench_rootfs_template(root, args.boots, float(boot["boot_to_first_exec_s"]["median"])))
    doc: dict = {"benchmark": "core", "quick": args.quick, "host": host_facts(accel), **boot}
    with sandlot.Box(rootfs=root, memory_mib=256, template=False) as box:
        doc.update(bench_exec(box, args.execs))
        doc.update(bench_streams(box, args.quick))
        doc.update(bench_files(box, args.quick))
    doc.update(bench_memory(root, args.quick))
    doc.update(bench_dynamic_programs(args.quick))
    emit(doc)


if __name__ == "__main__":
    main()
