"""Trees in and out of a box (docs/benchmarks.md, "Trees in and out").

A host tree of ``--mb`` MiB in ``--files`` files (100 directories) and ``--links``
symbolic links is uploaded into a box (``box.files.upload``) and downloaded back
(``box.files.download``), each ``--runs`` times, and, as the baseline in the same run,
carried the way one would without sandlot's transfer: the host's ``tar`` piped into
``tar -x`` run by ``box.exec`` (``box.spawn``, its stdin fed), and back from ``tar -c``
in the box into the host's ``tar -x``. Measured: seconds, MB/s and files/s, and the
ratio of each way to its ``tar`` baseline; for QEMU, and for gVisor where it runs.

    .venv/bin/python benchmarks/files.py [--runs 3] [--mb 200] [--files 10000] [--links 500] [--quick]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import sandlot

from _common import busybox_root, drop_home, emit, gvisor_unusable, host_facts, parser, scratch_home, summary

MB = 1_000_000
DIRS = 100


def make_tree(root: Path, mib: int, files: int, links: int) -> int:
    """The tree; its bytes."""
    per_file = max(1, (mib << 20) // files)
    block = os.urandom(per_file)
    for i in range(files):
        d = root / f"d{i % DIRS:02}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(block[i % 64 :] + block[: i % 64])  # no two alike
    for k in range(links):
        i = (k * 7919) % files
        (root / f"d{k % DIRS:02}" / f"link{k}").symlink_to(f"../d{i % DIRS:02}/f{i}")
    return per_file * files


def tar_up(box: sandlot.Box, src: Path, dest: str) -> None:
    """The baseline upload: the host's tar into ``tar -x`` in the box, through exec's stdin."""
    box.exec("mkdir", "-p", dest)
    proc = box.spawn("tar", "-x", "-f", "-", "-C", dest, stdin=True)
    host = subprocess.Popen(["tar", "-c", "-f", "-", "-C", str(src), "."], stdout=subprocess.PIPE)
    assert host.stdout is not None
    while chunk := host.stdout.read(1 << 20):
        proc.write_stdin(chunk)
    proc.close_stdin()
    assert host.wait() == 0 and proc.wait() == 0


def tar_down(box: sandlot.Box, src: str, dest: Path) -> None:
    """The baseline download: ``tar -c`` in the box, its stdout into the host's tar."""
    dest.mkdir(parents=True)
    proc = box.spawn("tar", "-c", "-f", "-", "-C", src, ".", stdin=False)
    host = subprocess.Popen(["tar", "-x", "-f", "-", "-C", str(dest)], stdin=subprocess.PIPE)
    assert host.stdin is not None
    for chunk in proc.stdout:
        host.stdin.write(chunk)
    host.stdin.close()
    assert proc.wait() == 0 and host.wait() == 0


def figures(times: list[float], size: int, files: int) -> dict[str, Any]:
    s = summary(times, 1, 3)
    return {"s": s, "MBps": round(size / s["median"] / MB, 1), "files_per_s": round(files / s["median"])}


def measure(engine: str, home: Path, src: Path, size: int, files: int, runs: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"upload": [], "download": [], "tar_up": [], "tar_down": []}
    box_of = sandlot.Box(rootfs=busybox_root(), engine=engine, memory_mib=512, home=home)
    with tempfile.TemporaryDirectory(prefix="bench-files-") as d, box_of as box:
        for k in range(runs):
            t = time.perf_counter()
            box.files.upload(src, f"/bench/up{k}")
            out["upload"].append(time.perf_counter() - t)
            t = time.perf_counter()
            box.files.download(f"/bench/up{k}", Path(d) / f"down{k}")
            out["download"].append(time.perf_counter() - t)
            t = time.perf_counter()
            tar_up(box, src, f"/bench/tar{k}")
            out["tar_up"].append(time.perf_counter() - t)
            t = time.perf_counter()
            tar_down(box, f"/bench/tar{k}", Path(d) / f"tar{k}")
            out["tar_down"].append(time.perf_counter() - t)
            kept = box.exec("sh", "-c", f"find /bench/up{k} -type l | wc -l").stdout.strip()
            assert int(kept) > 0 or files < DIRS, "links came in as files"
            box.exec("rm", "-rf", f"/bench/up{k}", f"/bench/tar{k}")
            for p in (Path(d) / f"down{k}", Path(d) / f"tar{k}"):
                shutil.rmtree(p)
        accel = box.accel
    up, down = figures(out["upload"], size, files), figures(out["download"], size, files)
    tup, tdown = figures(out["tar_up"], size, files), figures(out["tar_down"], size, files)
    return {
        "accel": accel,
        "upload": up,
        "download": down,
        "tar_via_exec": {"upload": tup, "download": tdown},
        "ratios": {
            "upload_over_tar": round(up["s"]["median"] / tup["s"]["median"], 2),
            "download_over_tar": round(down["s"]["median"] / tdown["s"]["median"], 2),
        },
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--links", type=int, default=500)
    args = ap.parse_args()
    runs, mib, files, links = (
        (1, 20, 1000, 50) if args.quick else (args.runs, args.mb, args.files, args.links)
    )
    home = scratch_home("bench-files-", kept=True)
    engines: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-files-src-") as d:
            src = Path(d) / "tree"
            size = make_tree(src, mib, files, links)
            engines["qemu"] = measure("qemu", home, src, size, files, runs)
            why = gvisor_unusable(sandlot.Runtime.for_home(home).doctor())
            engines["gvisor"] = {"skipped": why} if why else measure("gvisor", home, src, size, files, runs)
    finally:
        drop_home(home)
    qemu = engines["qemu"]
    emit({
        "benchmark": "files", "quick": args.quick, "host": host_facts(qemu["accel"]),
        "tree": {"MiB": mib, "bytes": size, "files": files, "links": links, "dirs": DIRS},
        "upload": qemu["upload"], "download": qemu["download"], "tar_via_exec": qemu["tar_via_exec"],
        "ratios": qemu["ratios"], "engines": engines,
    })  # fmt: skip


if __name__ == "__main__":
    main()
