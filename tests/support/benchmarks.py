"""The benchmark scripts' quick modes, as the tests run them: each prints one JSON
document holding the figures it promises (``PROMISED``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
PROMISED = {
    "cli": ["python_startup_ms", "version_ms", "ls_ms", "ls_over_python_ms", "exec_true_ms", "targets_met"],
    "density": [
        "boxes",
        "stopped_by",
        "pss_per_box_MiB",
        "idle_host_cpu_ms_per_s_per_box",
        "neighbour_exec_true_ms_rest_idle",
    ],
    "boot": ["boot_to_first_exec_s", "phases_s", "marks_s", "kernel_args"],
    "core": [
        "boot_to_first_exec_s",
        "start_from_automatic_template_to_first_exec_s",
        "boot_over_automatic_template",
        "exec_true_ms",
        "stdout_MBps",
        "upload_MBps",
        "idle_256MiB_box_pss_MiB",
        "guest_fork_exec_true_ms",
        "dynamic_programs",
    ],
    "recorder": ["loop", "storage", "rewind", "bisect"],
    "diffs": ["tree", "snapshot_to_now", "snapshot_start_remove", "box_to_box", "restore_one_file"],
    "files": ["tree", "upload", "download", "tar_via_exec", "ratios", "engines"],
    "durable": ["create_start_first_exec_s", "stop_s", "start_to_first_exec_s"],
    "events": ["state_write", "follow", "query"],  # follow holds metrics_sample
    "fleet": ["create_first_exec_s", "exec_true_ms", "migration_256MiB", "fork"],
    "images": [
        "cold_pull_unpack_base_s",
        "ratio_sandlot_over_skopeo_umoci",
        "box_create_from_pulled_image_ms",
    ],
    "livestate": ["snapshot", "rollback_to_first_exec_s", "resume_to_first_exec_s", "fork"],
    "storage": ["checkpoints", "fan_out", "local_speed", "gvisor_checkpoints", "tier"],
    "wake": ["wake", "cycles", "storm", "deep", "host"],
    "pool": [
        "template_start_to_first_exec_s",
        "pool_claim_to_first_exec_ms",
        "pool_fill_s_per_vm",
        "pool_vm_pss_mib",
    ],
    "hostshare": [
        "pool_claim_ms",
        "pool_claim_to_first_exec_ms",
        "exec_true_ms",
        "agent_ping_ms",
        "over_ping_ratio",
    ],
    "network": [
        "host_to_host",
        "box_to_host_via_egress_proxy",
        "box_to_host_via_proxy_relay_per_connection",
        "box_to_host_via_proxy_helper_per_connection",
        "host_to_box_published_port",
    ],
    "concurrency": ["threads", "processes"],
    "console": ["boxes_page_render_ms", "state_change_to_screen_ms", "keystroke_echo_ms"],
    "volumes": ["places", "ratios", "fork_ms", "snapshot_ms", "gvisor"],
    "interpreter": [
        "run_code_warm_ms",
        "first_run_code_new_box_s",
        "first_run_code_from_template_ms",
        "png_1MB_result_ms",
        "first_bash_cell_ms",
        "bash_cell_warm_ms",
        "bash_cell_over_exec",
    ],
    "report": ["engines", "workloads", "results", "ratios_to_host", "files"],
    "e2b_compat": [
        "sdk_commands_run_ms",
        "remote_exec_bash_ms",
        "commands_run_over_remote_exec_p50_ms",
        "create_from_template_ms",
        "create_from_pool_ms",
    ],
    "frameworks": ["calls", "native", "e2b_face", "docker", "ratios"],
    "server": ["exec_true_local_ms", "exec_true_remote_ms", "upload_MBps", "download_MBps", "load"],
    "watch": ["write_to_event_ms", "stdin_echo_baseline_ms", "burst"],
    "floods": ["engine", "seconds_each", "bounds", "floods", "host"],
    "desktop": ["image_MiB", "engines", "targets", "host"],  # engines: see tests/vm/test_benchmarks.py
    "nested": ["inner", "kvm_in_box", "tcg_on_host", "ratio_kvm_in_box_over_tcg_on_host"],
    "containers": [
        "daemon_start_in_box_s",
        "box_start_from_template_to_docker_answering_s",
        "docker_run_true_ms",
        "fork_3_containers_to_all_answering_s",
    ],
}


def run_quick(name: str, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``benchmarks/NAME.py --quick EXTRA...``: its JSON document, after checking that it
    exited 0 and holds every figure the script promises."""
    # the home the quick modes keep from run to run (benchmarks/_common.py: scratch_home's
    # ``kept``), beside the run's own: its automatic templates spare each script a boot
    import sandlot

    home = sandlot.Runtime.for_home().home
    kept = {"SANDLOT_BENCH_KEPT_HOMES": str(home.with_name(home.name + "-bench"))}
    r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--quick", *extra], capture_output=True,
                       text=True, timeout=900, env={**os.environ, **kept, **(env or {})})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    doc: dict[str, Any] = json.loads(r.stdout)
    assert doc["benchmark"] == name and doc["quick"] is True
    for key in PROMISED[name]:
        assert key in doc, f"{name} does not report {key}"
    return doc
