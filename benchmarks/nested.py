"""The KVM path's figures, where no real KVM is: sandlot in a box with nested
virtualization (tests/support/kvmhost.py), its boxes on the box's own KVM, beside the
same boxes under TCG on this host, measured in the same run. Per accelerator, a
256 MiB busybox box:

* cold boot to first exec (a new box each run, no template);
* exec ``true`` (median, p99);
* snapshot (wall), rollback to first exec, fork of 2 to the first exec of both;

and the ratios of the nested KVM figures to the host's TCG ones. KVM here runs on
QEMU's emulated SVM inside a TCG box: the figures show what the KVM path does and how
far emulated hardware virtualization is from plain emulation one level down, never
what KVM on real hardware does. TCG inside the box (``--tcg-inside``) is emulation
inside emulation: its boots take minutes.

    .venv/bin/python benchmarks/nested.py [--runs 3] [--tcg-inside] [--quick] [--box BOX]

``--box`` measures in a running box made by ``tests.support.kvmhost.kvm_host`` (in the
same home) rather than booting one: the KVM tier hands its own box to the quick mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sandlot

from _common import emit, host_facts, parser
from tests.support.kvmhost import BUSYBOX, inner_cli, kvm_host, run_inner
from tests.support.roots import busybox_root

INNER = """
import json, statistics, time
import sandlot

ACCEL, RUNS, EXECS = {accel!r}, {runs}, {execs}

def summary(values, digits=3):
    v = sorted(values)
    return {{"n": len(v), "median": round(statistics.median(v), digits),
             "p99": round(v[min(len(v) - 1, max(0, round(0.99 * len(v)) - 1))], digits)}}

def box():
    return sandlot.Box(rootfs={root!r}, memory_mib=256, accel=ACCEL, template=False)

boots = []

def booted():
    t = time.monotonic()
    b = box().start()
    b.exec("true")
    boots.append(time.monotonic() - t)
    return b

for _ in range(RUNS - 1):
    booted().remove(force=True)
b = booted()  # the last boot's box is the one measured next (a boot here is dear: near a minute)
try:
    execs = []
    for _ in range(EXECS):
        t = time.monotonic()
        b.exec("true")
        execs.append((time.monotonic() - t) * 1000)
    snaps, rollbacks, forks = [], [], []
    for _ in range(RUNS):
        t = time.monotonic()
        snap = b.snapshot()
        snaps.append(time.monotonic() - t)
        t = time.monotonic()
        b.rollback(snap)
        b.exec("true")
        rollbacks.append(time.monotonic() - t)
        t = time.monotonic()
        children = b.fork(2)
        for c in children:
            c.exec("true")
        forks.append(time.monotonic() - t)
        for c in children:
            c.remove(force=True)
        snap.remove()
finally:
    b.remove(force=True)
print(json.dumps({{"accel": b.accel, "boot_to_first_exec_s": summary(boots),
                  "exec_true_ms": summary(execs, 2), "snapshot_s": summary(snaps),
                  "rollback_to_first_exec_s": summary(rollbacks), "fork_2_to_first_exec_s": summary(forks)}}),
      flush=True)
"""

FIGURES = (
    "boot_to_first_exec_s",
    "exec_true_ms",
    "snapshot_s",
    "rollback_to_first_exec_s",
    "fork_2_to_first_exec_s",
)


def on_this_host(script: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    return figures


@contextmanager
def outer_box(name: str | None) -> Iterator[sandlot.Box]:
    """The box to measure in: the one named, left running, or a new one, removed after."""
    if name is not None:
        yield sandlot.Box.get(name)
        return
    with kvm_host() as box:
        yield box


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=3, help="boots, snapshots, rollbacks, forks per accelerator")
    ap.add_argument("--tcg-inside", action="store_true", help="also TCG inside the box (very slow)")
    ap.add_argument("--box", help="a running box made by tests.support.kvmhost.kvm_host, to measure in")
    args = ap.parse_args()
    runs, execs = (1, 5) if args.quick else (args.runs, 30)
    t = time.monotonic()
    with outer_box(args.box) as host:
        setup_s = time.monotonic() - t
        doctor = json.loads(inner_cli(host, "doctor", "--json").stdout)
        inside: dict[str, Any] = {}
        for accel in ("kvm", "tcg") if args.tcg_inside else ("kvm",):
            script = INNER.format(accel=accel, runs=runs, execs=execs, root=BUSYBOX)
            [inside[accel]] = run_inner(host, script, timeout=3600)
    host_tcg = on_this_host(INNER.format(accel="tcg", runs=runs, execs=execs, root=str(busybox_root())))
    ratios = {k: round(inside["kvm"][k]["median"] / host_tcg[k]["median"], 2) for k in FIGURES}
    emit({
        "benchmark": "nested", "quick": args.quick, "host": host_facts("tcg"),
        "inner": {"accel": doctor["accel"], "nested_virt": doctor["nested_virt"]},
        "outer_box_ready_s": round(setup_s, 1), "outer_box_given": args.box is not None,
        "kvm_in_box": inside["kvm"], "tcg_in_box": inside.get("tcg"),
        "tcg_on_host": host_tcg, "ratio_kvm_in_box_over_tcg_on_host": ratios,
        "note": "KVM on QEMU's emulated SVM inside a TCG box: not the speed of KVM on hardware",
    })  # fmt: skip


if __name__ == "__main__":
    main()
