"""Shared helpers for the benchmark scripts: statistics, JSON output, rootfs."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("SANDLOT_BENCH_CACHE", Path.home() / ".cache" / "sandlot-tests"))


def summary(values: list[float], scale: float = 1.0, digits: int = 2) -> dict[str, float | int]:
    """Median, p99 (nearest rank), min and max of ``values`` times ``scale``."""
    v = sorted(x * scale for x in values)
    p99 = v[min(len(v) - 1, max(0, round(0.99 * len(v)) - 1))]
    return {
        "n": len(v),
        "median": round(statistics.median(v), digits),
        "p99": round(p99, digits),
        "min": round(v[0], digits),
        "max": round(v[-1], digits),
    }


def pss_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Rss", "Pss", "Pss_Anon", "Pss_File"):
                out[key.lower()] = int(line.split()[1])
    return out


def host_facts(accel: str | None) -> dict[str, Any]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    return {"accel": accel, "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def busybox_root() -> Path:
    from sandlot.images.builders import busybox_rootfs

    dest = CACHE / "rootfs-busybox-bench"
    if not (dest / "bin" / "busybox").exists():
        busybox_rootfs(dest)
    return dest


def emit(doc: dict[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
