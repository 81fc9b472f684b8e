"""Shared helpers for the benchmark scripts: statistics, JSON output, test roots.

Benchmarks use sandlot's public API only, and ``tests/support`` for what the
tests build too (root filesystems, images, a registry). Each takes ``--quick``:
the same code paths with a few iterations, which CI runs so that none rots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.support

from tests.support.roots import CACHE, busybox_root, debian_root, desktop_root
from tests.support.serve import empty_but_templates, kept_home, sharing_caches

PAGE = 4096  # bytes of a guest page

__all__ = [
    "CACHE",
    "box_pss_mib",
    "busybox_root",
    "changed_memory",
    "debian_root",
    "desktop_root",
    "drop_home",
    "emit",
    "gvisor_unusable",
    "host_facts",
    "manifest",
    "parser",
    "pss_breakdown_mib",
    "pss_kib",
    "scratch_home",
    "summary",
    "timed_claims",
    "tree_pss_mib",
]  # fmt: skip


# Where the quick modes, as the tests run them, keep one home from run to run (set by
# tests/support/benchmarks.py): see ``scratch_home``'s ``kept``
KEPT_HOMES = "SANDLOT_BENCH_KEPT_HOMES"


def kept_folder() -> Path | None:
    folder = os.environ.get(KEPT_HOMES)
    return Path(folder) / "kept" if folder else None


def scratch_home(prefix: str, where: Path | None = None, *, kept: bool = False) -> Path:
    """A new, empty sandlot home sharing the default home's kernel, agent and initramfs
    (so nothing is fetched or built again); under ``where`` (default: beside the default home).

    ``kept`` (for a benchmark that makes one home and times no first start of an image):
    where ``$SANDLOT_BENCH_KEPT_HOMES`` names a folder (the tests' quick modes), the home
    there that every such benchmark uses, run after run, emptied of all but its images
    and automatic templates (tests/support/serve.py: ``kept_home``). Its boxes then start
    from the template an earlier run saved, rather than booting and saving one in each
    script: the quick modes' largest cost, and a path their figures are not about."""
    import sandlot

    folder = kept_folder()
    if kept and folder is not None and where is None:
        return kept_home(folder)
    shared = sandlot.Runtime.for_home().home
    return sharing_caches(Path(tempfile.mkdtemp(prefix=prefix, dir=where or shared.parent)))


def drop_home(home: Path) -> None:
    """Remove a scratch home and every box in it (a kept one: all but its templates)."""
    import shutil

    import sandlot

    if home == kept_folder():
        empty_but_templates(home)
        return
    for p in sandlot.pools(home=home):  # warm pools' VMs are no boxes: they go with their pool
        sandlot.set_pool(p.template_id, 0, wait=True, home=home)
    for b in sandlot.list(home=home):
        b.remove(force=True)
    shutil.rmtree(home, ignore_errors=True)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with ``--quick`` (few iterations, for CI)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few iterations of each figure (CI)")
    return ap


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


def pss_breakdown_mib(pid: int, memory_mib: int) -> dict[str, float]:
    """Where a QEMU process's PSS goes, by mapping: the guest's RAM (the mapping of
    ``memory_mib``), TCG's translated-code cache (an anonymous mapping of about
    ``tb-size``), the kernel image QEMU loaded (``vmlinux``: none since the copy
    QEMU loads is given back once loaded, where it kept 44 MiB before), QEMU's own
    code and libraries, and the rest (heap, stacks, device state)."""
    parts = {"guest_ram": 0, "tcg_code_cache": 0, "kernel_image": 0, "qemu_and_libraries": 0, "other": 0}
    kind = "other"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            is_header = len(fields) >= 5 and fields[0].count("-") == 1 and ":" in fields[3]
            if is_header:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                size_mib, path = (end - start) >> 20, fields[5] if len(fields) > 5 else ""
                if size_mib == memory_mib:
                    kind = "guest_ram"
                elif path.endswith("vmlinux"):
                    kind = "kernel_image"
                elif not path and 96 <= size_mib <= 160:
                    kind = "tcg_code_cache"
                elif path.startswith("/usr/"):
                    kind = "qemu_and_libraries"
                else:
                    kind = "other"
            elif fields and fields[0] == "Pss:":
                parts[kind] += int(fields[1])
    return {k: round(v / 1024, 1) for k, v in parts.items()}


def tree_pss_mib(pid: int) -> float:
    """PSS of ``pid`` and all its descendants (gVisor: the sandbox, its gofer and the
    ptrace stubs are processes of their own), in MiB."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (p / "stat").read_text()
                children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(p.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += pss_kib(p)["pss"]
        todo += children.get(p, [])
    return round(total / 1024, 1)


def vm_root_pid(info: dict[str, Any]) -> int:
    """The process whose tree is the box: QEMU's process; for gVisor the ``runsc`` that
    started the sandbox (its gofer is the sandbox's sibling)."""
    pid = int(info["vm_pid"])
    if info.get("engine") == "gvisor":
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if Path(f"/proc/{parent}/comm").read_text().strip().startswith("runsc"):
                return parent
    return pid


def box_pss_mib(info: dict[str, Any]) -> float:
    """PSS of a box's whole process tree (``box.inspect()``'s ``info``), in MiB."""
    return tree_pss_mib(vm_root_pid(info))


def gvisor_unusable(doctor: dict[str, Any]) -> str | None:
    """Why gVisor does not run here, from ``Runtime.doctor()``'s report; None where it does."""
    gvisor = doctor.get("gvisor") or {}
    return None if gvisor.get("usable") else f"gVisor unusable: {gvisor.get('why', 'no runsc')}"


def manifest(home: Path, state_id: str) -> Any:
    """The chunk manifest of a saved state of ``home`` (None for a state kept whole)."""
    from sandlot.core.manifest import Manifest
    from sandlot.core.store import BoxStore

    data = BoxStore(home / "sandlot.db").state_manifest(state_id)
    return Manifest.decode(data) if data is not None else None


def changed_memory(home: Path, before: str, after: str) -> int:
    """Bytes of guest memory whose pages differ between two states saved as chunks."""
    from sandlot.core.chunks import ChunkStore

    a, b = manifest(home, before), manifest(home, after)
    assert a is not None and b is not None, "both states are chunks"
    store = ChunkStore(home)
    changed = 0
    for img in b.images:
        old = a.image(img.name)
        for i, d in enumerate(img.digests):
            o = old.digests[i] if i < len(old.digests) else None
            if d == o:
                continue
            size = img.chunk_size(i)
            x = store.get(o, before) if o is not None else bytes(size)
            y = store.get(d, after) if d is not None else bytes(size)
            changed += sum(PAGE for p in range(0, size, PAGE) if x[p : p + PAGE] != y[p : p + PAGE])
    return changed


def host_facts(accel: str | None) -> dict[str, Any]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    return {"accel": accel, "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


async def timed_claims(template: Any, home: Path, count: int, times: dict[str, list[float]]) -> list[Any]:
    """``count`` boxes started from ``template`` (an ``AsyncSnapshot`` whose warm pool holds
    them ready), each timed into ``times``: the claim alone (``"claim"``), the claim to
    its first exec (``"to_first_exec"``), and a second exec (``"again"``: what an exec
    costs on this host at that moment, the floor of the figure before). The boxes, kept,
    for the caller to look at and remove."""
    import time

    from sandlot import AsyncBox

    boxes = []
    for _ in range(count):
        t = time.perf_counter()
        box = AsyncBox(template=template, keep=True, home=home)
        await box.start()
        t1 = time.perf_counter()
        await box.exec("true")
        times.setdefault("to_first_exec", []).append(time.perf_counter() - t)
        times.setdefault("claim", []).append(t1 - t)
        t = time.perf_counter()
        await box.exec("true")
        times.setdefault("again", []).append(time.perf_counter() - t)
        boxes.append(box)
    assert all([(await b.inspect())["options"]["pool"] is None for b in boxes])  # all claimed
    return boxes


async def rollbacks_to_first_exec(box: Any, snap: Any, runs: int) -> list[float]:
    """Seconds of each of ``runs`` rollbacks of ``box`` to ``snap``, to the first exec after it."""
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        await box.rollback(snap)
        await box.exec("true")
        walls.append(time.perf_counter() - t)
    return walls


def emit(doc: dict[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
