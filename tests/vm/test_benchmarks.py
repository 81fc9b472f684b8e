"""Every benchmark script, run in its quick mode (a few iterations of the same
code paths), so that none rots: each must exit 0 and print one JSON document
with the figures it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
PROMISED = {
    "cli": ["python_startup_ms", "version_ms", "ls_ms", "exec_true_ms", "targets_met"],
    "density": [
        "boxes",
        "stopped_by",
        "pss_per_box_MiB",
        "idle_host_cpu_ms_per_s_per_box",
        "neighbour_exec_true_ms_rest_idle",
    ],
    "core": ["boot_to_first_exec_s", "exec_true_ms", "stdout_MBps", "upload_MBps", "idle_256MiB_box_pss_MiB"],
    "durable": ["create_start_first_exec_s", "stop_s", "start_to_first_exec_s"],
    "fleet": ["create_first_exec_s", "exec_true_ms", "migration_256MiB", "fork"],
    "images": [
        "cold_pull_unpack_base_s",
        "ratio_sandlot_over_skopeo_umoci",
        "box_create_from_pulled_image_ms",
    ],
    "livestate": ["snapshot", "rollback_to_first_exec_s", "resume_to_first_exec_s", "fork"],
    "pool": [
        "template_start_to_first_exec_s",
        "pool_claim_to_first_exec_ms",
        "pool_fill_s_per_vm",
        "pool_vm_pss_mib",
    ],
    "network": [
        "host_to_host",
        "box_to_host_via_egress_proxy",
        "box_to_host_via_proxy_helper_per_connection",
        "host_to_box_published_port",
    ],
    "concurrency": ["threads", "processes"],
    "interpreter": [
        "run_code_warm_ms",
        "first_run_code_new_box_s",
        "first_run_code_from_template_ms",
        "png_1MB_result_ms",
    ],
    "report": ["engines", "workloads", "results", "ratios_to_host", "files"],
    "server": ["exec_true_local_ms", "exec_true_remote_ms", "upload_MBps", "download_MBps", "load"],
    "watch": ["write_to_event_ms", "stdin_echo_baseline_ms", "burst"],
    "nested": ["inner", "kvm_in_box", "tcg_on_host", "ratio_kvm_in_box_over_tcg_on_host"],
}


def test_every_script_is_covered() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(PROMISED)


@pytest.mark.parametrize("name", sorted(PROMISED))
def test_benchmark_quick_mode(name: str, tmp_path: Path) -> None:
    extra = ["--out", str(tmp_path)] if name == "report" else []  # its folder of files, not the tree's
    extra += ["--ksm"] if name == "density" else []  # KSM's figures, or why the host gives none
    r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--quick", *extra], capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["benchmark"] == name and doc["quick"] is True
    for key in PROMISED[name]:
        assert key in doc, f"{name} does not report {key}"
    if name == "density":
        assert "saved_MiB" in doc["ksm"] or doc["ksm"]["skipped"], doc["ksm"]
    if name == "concurrency":
        assert doc["threads"]["failures"] == 0 and doc["processes"]["failures"] == 0
    if name == "report":  # every engine it ran fills every row: a figure, or why not
        for engine, cells in doc["results"].items():
            assert set(cells) == set(doc["workloads"]), engine
            assert not [k for k, c in cells.items() if "error" in c], (engine, cells)
        assert {"report.json", "report.md"} <= set(doc["files"])
        assert all((tmp_path / f).stat().st_size > 0 for f in doc["files"])
