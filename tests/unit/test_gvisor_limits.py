"""The gVisor engine's limits as it hands them to runsc and to the box's init, and the
refusal of a disk bound the host cannot give (no sandbox: ``tests/vm/test_gvisor_limits.py``
and ``tests/security/test_limits.py`` run them for real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandlot.engine.base import BootRequest
from sandlot.engine.gvisor import limits
from sandlot.engine.gvisor.engine import GvisorEngine
from sandlot.engine.gvisor.vm import SandboxConfig, oci_config
from sandlot.errors import InvalidArgument


def test_the_sandbox_gets_the_boxs_shape(tmp_path: Path) -> None:
    cfg = SandboxConfig("b1", "h", tmp_path, tmp_path, tmp_path, tmp_path, tmp_path, "ptrace", 8, 256, 2)
    oci = oci_config(cfg)
    res = oci["linux"]["resources"]
    assert res["cpu"] == {"quota": 200_000, "period": 100_000}
    # the host bound sits above the box's: the agent inside is the box's OOM killer
    assert res["memory"]["limit"] == (256 + limits.HOST_MEMORY_SLACK_MIB) << 20
    assert "pids" not in res  # a host bound ends the Sentry when hit (limits.py says why)
    args = oci["process"]["args"]
    assert args[args.index("--memory-mib") + 1] == "256"
    assert "--cpu-num-from-quota" in limits.runsc_flags()


def test_a_disk_size_is_refused_where_no_project_quota_bounds_it(tmp_path: Path) -> None:
    missing = limits.project_quota_missing(tmp_path)
    if missing is None:
        pytest.skip("this host's file system has project quotas")
    assert "prjquota" in missing
    with pytest.raises(InvalidArgument, match=r"engine='gvisor' cannot bound a box's disk here.*prjquota"):
        limits.disk_bound(BootRequest(disk_gb=2, disk_required=True), tmp_path)
    # the default size is not a request: the box runs, its disk unbounded (docs say so)
    assert limits.disk_bound(BootRequest(disk_gb=8), tmp_path) is None
    # the engine says so before the core makes a box: a refused request leaves no box behind
    with pytest.raises(InvalidArgument, match=r"cannot bound a box's disk here"):
        GvisorEngine(tmp_path).refuse(BootRequest(disk_gb=2, disk_required=True))
    GvisorEngine(tmp_path).refuse(BootRequest(disk_gb=8))


def test_mount_options_decide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(limits, "_mount_of", lambda p: ("ext4", "rw,prjquota"))
    assert limits.project_quota_missing(tmp_path) is None
    assert limits.disk_bound(BootRequest(disk_gb=3, disk_required=True), tmp_path) == 3
    monkeypatch.setattr(limits, "_mount_of", lambda p: ("tmpfs", "rw"))
    assert "tmpfs without project quotas" in (limits.project_quota_missing(tmp_path) or "")
    ids = {limits.project_id(Path(f"/h/layers/{i:016x}.dir")) for i in range(100)}
    assert len(ids) == 100 and 0 not in ids
