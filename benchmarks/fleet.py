"""Fleet benchmarks (issue: a sandlot fleet on Ray), on a real three-node Ray cluster
on this machine (``ray.cluster_utils``; each node its own raylet and sandlot home),
256 MB boxes:

* ``fleet.create`` + first exec against a local create + first exec on the same
  node's home, and an exec of ``true`` through the fleet against the same box
  locally: the fleet's overhead per operation (target: at most 50 ms);
* migration of a 256 MB box holding 64 MiB of random data in RAM (tmpfs),
  broken into save (freeze and snapshot), export, move (fetch and verify the
  chunks through the object store), import and restore;
* ``f.fork(box, 20, spread=True)`` over three nodes against ``fork(20)`` on one, to the
  first exec of every child, with where the children landed.

    .venv/bin/python benchmarks/fleet.py [--runs 10] [--quick]
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import sandlot

from _common import busybox_root, emit, host_facts, parser, summary
from tests.support.fleet import FleetCluster

FILL = "mkdir -p /mnt/t && mount -t tmpfs -o size=100m tmpfs /mnt/t && dd if=/dev/urandom of=/mnt/t/x bs=1M count=64"  # noqa: E501
LOOP = "setsid sh -c 'while true; do sleep 0.1; done' </dev/null >/dev/null 2>&1 &"


def overhead(f: Any, fc: FleetCluster, node: str, root: Path, runs: int) -> dict[str, Any]:
    local_s, fleet_s, local_exec, fleet_exec = [], [], [], []
    home = fc.homes[node]
    os.environ["SANDLOT_RUNTIME_DIR"] = str(fc.runs[node])  # where that node's VMs have their sockets
    # untimed: the node's first box of the image makes its automatic template, which both then use
    sandlot.Box(rootfs=root, memory_mib=256, home=home).start().remove(force=True)
    for _ in range(runs):
        t = time.perf_counter()
        local = sandlot.Box(rootfs=root, memory_mib=256, keep=True, home=home)
        local.start()
        local.exec("true")
        local_s.append(time.perf_counter() - t)
        local.remove(force=True)
        t = time.perf_counter()
        box = f.create(rootfs=root, memory_mib=256, node=node)
        box.exec("true")
        fleet_s.append(time.perf_counter() - t)
        same = sandlot.get(box.id, home=home)  # the same box, without the fleet
        for _ in range(10):
            t = time.perf_counter()
            box.exec("true")
            fleet_exec.append(time.perf_counter() - t)
            t = time.perf_counter()
            same.exec("true")
            local_exec.append(time.perf_counter() - t)
        box.remove(force=True)
    lm, fm = summary(local_s, digits=3), summary(fleet_s, digits=3)
    le, fe = summary(local_exec, 1e3), summary(fleet_exec, 1e3)
    return {
        "create_first_exec_s": {"local": lm, "fleet": fm,
                                "overhead_ms": round((fm["median"] - lm["median"]) * 1e3, 1)},
        "exec_true_ms": {"local": le, "fleet": fe, "overhead_ms": round(fe["median"] - le["median"], 2)},
    }  # fmt: skip


def migration(f: Any, fc: FleetCluster, nodes: list[str], root: Path, runs: int) -> dict[str, Any]:
    box = f.create(rootfs=root, memory_mib=256, node=nodes[0])
    parts: dict[str, list[float]] = {}
    sizes = []
    try:
        box.sh(FILL, check=True)
        box.sh(LOOP)
        for i in range(runs):
            box = f.migrate(box, node=nodes[(i + 1) % len(nodes)])
            box.exec("true")
            t = f.last_migration
            assert t is not None
            for k in ("save_s", "export_s", "move_s", "import_s", "restore_s", "total_s"):
                parts.setdefault(k, []).append(t[k])
            sizes.append(t["bytes"])
    finally:
        box.remove(force=True)
    out: dict[str, Any] = {k: summary(v, digits=3) for k, v in parts.items()}
    out["archive_mb"] = summary(sizes, 1e-6, 1)
    return out


def fork(f: Any, node: str, root: Path, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"children": n}
    src = f.create(rootfs=root, memory_mib=256, node=node)
    try:
        src.sh(LOOP)
        for label, spread in (("one_node", False), ("spread_3_nodes", True)):
            t = time.perf_counter()
            kids = f.fork(src, n, spread=spread, placement_timeout=60)
            for k in kids:
                k.exec("true")
            wall = time.perf_counter() - t
            out[label] = {"to_first_exec_of_all_s": round(wall, 3),
                          "per_node": sorted(kids.per_node.values(), reverse=True),
                          "timings_s": {k: round(v, 3) for k, v in kids.timings.items()}}  # fmt: skip
            for k in kids:
                k.remove(force=True)
    finally:
        src.remove(force=True)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    runs, fan_out = (2, 3) if args.quick else (args.runs, 20)
    root = busybox_root()
    accel = sandlot.Runtime.for_home().prepare().accel
    import ray

    from sandlot import fleet

    fc = FleetCluster()
    try:
        nodes = [fc.add(cpus=32, memory_mib=8192) for _ in range(3)]
        ray.init(address=fc.address, namespace="sandlot", log_to_driver=False)
        f = fleet.connect(fc.address, placement_timeout=60)
        figures = {
            **overhead(f, fc, nodes[1], root, runs),
            "migration_256MiB": migration(f, fc, nodes, root, runs),
            "fork": fork(f, nodes[0], root, fan_out),
        }
    finally:
        fc.shutdown()
    emit({"benchmark": "fleet", "quick": args.quick, "memory_mib": 256, "nodes": 3,
          "host": host_facts(accel), **figures})  # fmt: skip


if __name__ == "__main__":
    main()
