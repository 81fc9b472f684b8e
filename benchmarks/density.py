"""Density: how many idle boxes one host holds, and what each costs while idle.

Boxes start from one 256 MiB busybox template, in batches, until a limit: ``--max``
boxes, the host's available memory down to ``--reserve-mib``, or a neighbour's exec
``true`` p99 over 100 ms with the rest idle. Then, in one run:

* the count and why it stopped;
* PSS per box (a sample of up to 30 boxes, ``/proc/PID/smaps_rollup``);
* idle host CPU per box: the CPU time of every box's VM process (all its threads,
  from ``schedstat``, in nanoseconds) over a window with all of them idle, in ms per
  second per box;
* a neighbour's exec ``true`` p50/p99 with the rest idle, and with a tenth of them
  busy (a shell loop each);
* beside them, boxes of the same tree as an image, ``sandlot.Box(image)``, the path a
  newcomer takes (its first box boots and is saved as the image's automatic template,
  the others start from that): their start and PSS, and the PSS as a ratio to the
  explicit template's boxes'.

* with ``--ksm`` (as root, where the host has KSM): what kernel samepage merging saves
  across the boxes. KSM is turned on for the run (``ksmd`` scanning faster than its
  default, so that it is done in a minute rather than many) and set back as it was
  after; the figures are PSS per box before and after, the MiB merged, and ``ksmd``'s
  CPU over the scans. Without root or KSM, the report says why.

Every box is a ``with`` block's (ephemeral): a benchmark killed midway leaves no VM,
its boxes go with their holder.

    .venv/bin/python benchmarks/density.py [--max 200] [--reserve-mib 2048] [--ksm] [--quick]
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import sandlot

from _common import busybox_root, drop_home, emit, host_facts, parser, pss_kib, scratch_home, summary

P99_LIMIT_MS = 100.0
BUSY = "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!"


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) >> 10
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's threads so far, to the nanosecond (``/proc/PID/stat``
    counts 10 ms ticks: an idle box's second is well under one)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def exec_times_ms(box: sandlot.Box, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        box.exec("true")
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def idle_cpu_ms_per_s(pids: list[int], window: float) -> list[float]:
    """Each VM's CPU time over ``window`` seconds with nothing asked of it, per second."""
    before = {p: cpu_seconds(p) for p in pids}
    t0 = time.monotonic()
    time.sleep(window)
    spent = time.monotonic() - t0
    return [(cpu_seconds(p) - before[p]) * 1e3 / spent for p in pids]


KSM_FAST = {"pages_to_scan": "2000", "sleep_millisecs": "20"}  # ~390 MiB a second


def ksmd_pid() -> int | None:
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "ksmd":
                return int(proc.name)
    return None


def measure_ksm(pids: list[int], patience: float, fast: bool) -> dict[str, object]:
    """Turn KSM on (``fast``: scanning faster than by default) until merging settles
    or ``patience`` seconds pass, measure, and set every KSM setting back as it was."""
    from sandlot import ksm

    where = ksm.KSM_DIR
    state = ksm.status()
    if not state["available"]:
        return {"skipped": state["why"]}
    names = ["run", *KSM_FAST]
    before = {n: (where / n).read_text().strip() for n in names}
    pss_before = [pss_kib(p)["pss"] / 1024 for p in pids]
    ksmd = ksmd_pid()
    cpu0 = cpu_seconds(ksmd) if ksmd else 0.0
    try:
        for name, value in {**(KSM_FAST if fast else {}), "run": "1"}.items():
            (where / name).write_text(value)
    except OSError as exc:
        return {"skipped": f"cannot turn KSM on here: {exc}"}
    try:
        t0 = time.monotonic()
        scans0 = int((where / "full_scans").read_text())
        last, settled = -1, 0
        while time.monotonic() - t0 < patience and settled < 2:
            time.sleep(2.0)
            scans = int((where / "full_scans").read_text())
            sharing = int((where / "pages_sharing").read_text())
            if scans - scans0 >= 2:  # a page is merged on its second scan
                # settled: two readings in a row within 1% (pages keep changing in live VMs)
                settled = settled + 1 if abs(sharing - last) <= max(64, last // 100) else 0
                last = sharing
        spent = time.monotonic() - t0
        pss_after = [pss_kib(p)["pss"] / 1024 for p in pids]
        merged = ksm.status()
        doc: dict[str, object] = {
            "boxes": len(pids),
            "full_scans": int((where / "full_scans").read_text()) - scans0,
            "seconds_to_settle": round(spent, 1),
            "saved_MiB": merged["saved_mib"],
            "pss_per_box_MiB_before": summary(pss_before, digits=1),
            "pss_per_box_MiB_after": summary(pss_after, digits=1),
        }
        if ksmd:
            doc["ksmd_cpu_s"] = round(cpu_seconds(ksmd) - cpu0, 2)
        return doc
    finally:
        for name in reversed(names):  # run last: merged pages stay merged if it was on
            with contextlib.suppress(OSError):
                (where / name).write_text(before[name])


def from_image(home: Path, n: int, settle: float) -> tuple[dict[str, object], list[float]]:
    """``n`` boxes of the template's tree imported as an image, started the way a
    newcomer starts them (``sandlot.Box(ref)``), after one that boots the image and
    saves its automatic template: their start and PSS, idle."""
    ref = "localhost/density-busybox:1"
    sandlot.import_image(busybox_root(), ref, home=home)
    t0 = time.perf_counter()
    with sandlot.Box(ref, memory_mib=256, home=home):
        first = time.perf_counter() - t0
    with contextlib.ExitStack() as held:
        boxes, starts = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            boxes.append(held.enter_context(sandlot.Box(ref, memory_mib=256, home=home)))
            starts.append(time.perf_counter() - t0)
        # measured as the template's boxes are: idle since their start, none having run
        # a command (a first exec's translated code is a few MiB of each QEMU's own)
        time.sleep(settle)
        pss = [pss_kib(int(b.inspect()["vm_pid"]))["pss"] / 1024 for b in boxes]
    doc = {
        "boxes": n,
        "first_box_s": round(first, 3),  # boots and saves the automatic template
        "start_s": summary(starts, digits=3),  # the first of them gives it its shared form
        "pss_per_box_MiB": summary(pss, digits=1),
    }
    return doc, pss


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--max", type=int, default=200, help="boxes at most")
    ap.add_argument("--reserve-mib", type=int, default=2048, help="host memory left available at least")
    ap.add_argument("--batch", type=int, default=10, help="boxes started between two checks")
    ap.add_argument("--ksm", action="store_true", help="also measure KSM across the boxes (as root)")
    args = ap.parse_args()
    q = args.quick
    most, batch, window = (4, 2, 2.0) if q else (args.max, args.batch, 10.0)
    home = scratch_home("bench-density-")
    try:
        tmpl = sandlot.template(rootfs=busybox_root(), memory_mib=256, name="dense", home=home)
        with contextlib.ExitStack() as held:
            boxes: list[sandlot.Box] = []
            starts: list[float] = []
            stopped_by = "max"
            neighbour: sandlot.Box | None = None
            while len(boxes) < most:
                for _ in range(min(batch, most - len(boxes))):
                    t0 = time.perf_counter()
                    boxes.append(held.enter_context(sandlot.Box(template=tmpl, home=home)))
                    starts.append(time.perf_counter() - t0)
                neighbour = neighbour or boxes[0]
                if mem_available_mib() < args.reserve_mib:
                    stopped_by = "memory"
                    break
                time.sleep(0.5)  # the batch's first moments (its restores' own work) pass
                exec_times_ms(neighbour, 5)  # and a first exec's translation under TCG
                if summary(exec_times_ms(neighbour, 20))["p99"] > P99_LIMIT_MS:
                    stopped_by = "neighbour exec p99"
                    break
            assert neighbour is not None
            time.sleep(1.0 if q else 5.0)  # the last starts settle
            pids = [int(b.inspect()["vm_pid"]) for b in boxes]
            # PSS idle since the start, before the neighbour's and the busy boxes' commands
            sample = pids[:: max(1, len(pids) // 30)][:30]
            template_pss = [pss_kib(p)["pss"] / 1024 for p in sample]
            idle = idle_cpu_ms_per_s(pids, window)
            quiet = exec_times_ms(neighbour, 20 if q else 200)
            busy_boxes = [b for b in boxes[1:] if b is not neighbour][: max(1, len(boxes) // 10)]
            loops = [b.sh(BUSY).stdout.strip() for b in busy_boxes]
            time.sleep(0.5)
            noisy = exec_times_ms(neighbour, 20 if q else 200)
            for b, pid in zip(busy_boxes, loops, strict=True):
                b.exec("kill", pid)
            doc = {
                "benchmark": "density",
                "quick": q,
                "host": host_facts(neighbour.accel),
                "boxes": len(boxes),
                "stopped_by": stopped_by,
                "host_mem_available_MiB_at_end": mem_available_mib(),
                "start_from_template_s": summary(starts, digits=3),
                "pss_per_box_MiB": summary(template_pss, digits=1),
                "idle_host_cpu_ms_per_s_per_box": summary(idle, digits=2),
                "idle_host_cpu_all_boxes_cores": round(sum(idle) / 1e3, 3),
                "neighbour_exec_true_ms_rest_idle": summary(quiet),
                f"neighbour_exec_true_ms_{len(busy_boxes)}_busy": summary(noisy),
            }
            if args.ksm:
                # the quick mode's few boxes are scanned in seconds at ksmd's own pace
                doc["ksm"] = measure_ksm(pids, 30.0 if q else 300.0, fast=not q)
        image, image_pss = from_image(home, min(len(boxes), 4 if q else 20), 1.0 if q else 5.0)
        ratio = statistics.median(image_pss) / statistics.median(template_pss)
        image["pss_over_template_boxes"] = round(ratio, 3)
        doc["from_image"] = image
        emit(doc)
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
