"""Every benchmark script, run in its quick mode (a few iterations of the same
code paths), so that none rots: each must exit 0 and print one JSON document
with the figures it promises. ``nested`` runs in the KVM tier, in that tier's own
box (tests/vm/test_kvm_in_a_box.py): booting another would cost CI minutes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchmarks import BENCH, PROMISED, run_quick

pytestmark = pytest.mark.vm

IN_THE_KVM_TIER = {"nested"}
DESKTOP_FIGURES = {
    "start_s", "screenshot_ms", "action_ms", "first_screenshot_from_template_s", "idle_pss_MiB",
    "targets_met",
}  # fmt: skip


def test_every_script_is_covered() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(PROMISED)


@pytest.mark.parametrize("name", sorted(set(PROMISED) - IN_THE_KVM_TIER))
def test_benchmark_quick_mode(name: str, tmp_path: Path) -> None:
    extra = ["--out", str(tmp_path)] if name == "report" else []  # its folder of files, not the tree's
    extra += ["--ksm"] if name == "density" else []  # KSM's figures, or why the host gives none
    doc = run_quick(name, *extra)
    if name == "density":
        assert "saved_MiB" in doc["ksm"] or doc["ksm"]["skipped"], doc["ksm"]
    if name == "desktop":  # the QEMU engine always; gVisor's where it runs (both, here: root and runsc)
        assert doc["engines"]["qemu"]["available"]
        for engine, figures in doc["engines"].items():
            if figures["available"]:
                assert set(figures) >= DESKTOP_FIGURES, (engine, figures)
    if name == "floods":  # each log held to its bound all through its flood
        for record in ("dns", "connect", "console", "boxlink"):
            f = doc["floods"][record]
            assert f["host_max"] is not None and f["host_max"] <= f["bound"], (record, f)
        assert doc["floods"]["interpreter"]["host_kept"]["stdout"] <= doc["floods"]["interpreter"]["bound"]
    if name == "recorder":  # every step lists the guest's processes it left
        assert doc["loop"]["steps_with_processes"] == 1.0, doc["loop"]
    if name == "concurrency":
        assert doc["threads"]["failures"] == 0 and doc["processes"]["failures"] == 0
    if name == "report":  # every engine it ran fills every row: a figure, or why not
        for engine, cells in doc["results"].items():
            assert set(cells) == set(doc["workloads"]), engine
            assert not [k for k, c in cells.items() if "error" in c], (engine, cells)
        assert {"report.json", "report.md"} <= set(doc["files"])
        assert all((tmp_path / f).stat().st_size > 0 for f in doc["files"])
