"""Host cgroups for QEMU: reading the host's cgroup facts, choosing where VM
cgroups go, the limits, and (with a real VM) placement and removal."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.engine import hostcgroup
from sandlot.engine.hostcgroup import HostCgroups, Limits, Tree
from sandlot.engine.qemu.command import TCG_CODE_CACHE_MIB

HYBRID_V1 = """\
9:name=systemd:/
8:pids:/
4:memory:/process_api/2da7
2:cpu,cpuacct:/
0::/
"""

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 /process_api /sys/fs/cgroup/my\\040memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime shared:9 - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""

USER_V2 = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/term.scope\n"


def test_proc_cgroup_gives_the_path_per_controller() -> None:
    paths = hostcgroup.parse_proc_cgroup(HYBRID_V1)
    assert paths["memory"] == "/process_api/2da7"
    assert paths["cpu"] == paths["cpuacct"] == paths["pids"] == "/"
    assert paths[""] == "/"  # the v2 line
    assert hostcgroup.parse_proc_cgroup(USER_V2) == {"": USER_V2.strip()[3:]}


def test_v1_mounts_map_controllers_to_their_hierarchy() -> None:
    mounts = hostcgroup.parse_v1_mounts(MOUNTINFO)
    assert mounts["cpu"] == mounts["cpuacct"] == (Path("/sys/fs/cgroup/cpu,cpuacct"), "/")
    assert mounts["memory"] == (Path("/sys/fs/cgroup/my memory"), "/process_api")
    assert "" not in mounts and "unified" not in str(mounts)  # cgroup2 is not a v1 hierarchy


def _fake_v1(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    mounts = {c: (tmp_path / c, "/") for c in ("memory", "cpu", "cpuacct", "pids")}
    mounts["cpuacct"] = mounts["cpu"]  # co-mounted
    for mount, _ in mounts.values():
        (mount / "process_api" / "2da7").mkdir(parents=True, exist_ok=True)
    return mounts


def test_v1_uses_each_writable_hierarchy_at_our_own_cgroup(tmp_path: Path) -> None:
    mounts = _fake_v1(tmp_path)
    own = hostcgroup.parse_proc_cgroup(HYBRID_V1)
    host = hostcgroup.detect_v1(own, mounts, writable=lambda p: "pids" not in p.parts)
    assert host.version == 1
    assert host.trees == (
        Tree(tmp_path / "memory" / "process_api" / "2da7", ("memory",)),
        Tree(tmp_path / "cpu", ("cpu",)),
    )
    assert host.report()["where"] == [
        str(tmp_path / "memory/process_api/2da7/sandlot"),
        str(tmp_path / "cpu/sandlot"),
    ]
    nothing = hostcgroup.detect_v1(own, mounts, writable=lambda p: False)
    assert nothing.trees == () and "v1 without" in nothing.reason
    # a hierarchy mounted from below our cgroup does not show it
    shifted = {"memory": (tmp_path / "memory", "/elsewhere")}
    assert hostcgroup.detect_v1(own, shifted).trees == ()


def _fake_v2(root: Path, own: str, subtree_control: str) -> None:
    (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
    for depth in range(len(own.strip("/").split("/")) + 1):
        cgroup = root.joinpath(*own.strip("/").split("/")[:depth])
        (cgroup / "cgroup.procs").write_text("")
        (cgroup / "cgroup.subtree_control").write_text(subtree_control)


def test_v2_picks_the_top_of_the_delegated_subtree(tmp_path: Path) -> None:
    own = USER_V2.strip()[3:]
    _fake_v2(tmp_path, own, "cpu memory pids")
    service = tmp_path / "user.slice/user-1000.slice/user@1000.service"

    def delegated(path: Path) -> bool:  # what systemd hands a user: its service and below
        return path.is_relative_to(service)

    assert hostcgroup.delegated_ancestor(tmp_path, own, delegated) == service
    assert hostcgroup.delegated_ancestor(tmp_path, own, lambda p: True) == tmp_path  # root
    # the subtree ends at the first cgroup up that is not ours, even if one higher is
    assert hostcgroup.delegated_ancestor(tmp_path, own, lambda p: p != service) == service / "app.slice"
    assert hostcgroup.delegated_ancestor(tmp_path, own, lambda p: False) is None

    host = hostcgroup.detect_v2(tmp_path, own, delegated)
    assert host == HostCgroups(2, (Tree(service, ("memory", "cpu", "pids")),))
    assert host.report() == {
        "version": 2,
        "where": [str(service / "sandlot")],
        "controllers": ["memory", "cpu", "pids"],
    }
    assert "without a delegated subtree" in hostcgroup.detect_v2(tmp_path, own, lambda p: False).reason


def test_v2_uses_only_the_controllers_the_parent_hands_down(tmp_path: Path) -> None:
    _fake_v2(tmp_path, "/a", "io pids")
    assert hostcgroup.detect_v2(tmp_path, "/a").trees == (Tree(tmp_path, ("pids",)),)
    _fake_v2(tmp_path / "b", "/c", "io")
    assert "enables none of memory, cpu, pids" in hostcgroup.detect_v2(tmp_path / "b", "/c").reason


def test_switch_turns_placement_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hostcgroup.SWITCH, "0")
    host = hostcgroup.detect()
    assert host.trees == ()
    assert host.report() == {"version": None, "reason": "turned off (SANDLOT_HOST_CGROUP=0)"}


def test_limits_leave_room_for_qemu_and_a_spare_core() -> None:
    tcg = Limits.for_vm(512, 2, code_cache_mib=TCG_CODE_CACHE_MIB)
    assert tcg.memory_bytes == (512 + hostcgroup.QEMU_OVERHEAD_MIB + TCG_CODE_CACHE_MIB) << 20
    assert tcg.cpu_quota_us == 3 * hostcgroup.CPU_PERIOD_US
    assert Limits.for_vm(512, 2).memory_bytes == (512 + hostcgroup.QEMU_OVERHEAD_MIB) << 20  # KVM
    mem = str(tcg.memory_bytes)
    assert tcg.files(2, ("memory", "cpu", "pids")) == [
        ("memory.max", mem), ("memory.swap.max", "0"), ("cpu.max", "300000 100000"), ("pids.max", "512"),
    ]  # fmt: skip
    assert tcg.files(1, ("memory", "cpu")) == [
        ("memory.limit_in_bytes", mem), ("memory.memsw.limit_in_bytes", mem),
        ("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "300000"),
    ]  # fmt: skip


def test_leaf_names_are_safe_and_unique_per_qemu() -> None:
    assert hostcgroup.leaf_name("box-1", 42) == "box-1-42"
    assert hostcgroup.leaf_name("a/../b c", 7) == "a-..-b-c-7"


def test_place_writes_limits_before_the_pid(tmp_path: Path) -> None:
    """On a fake v2 tree (plain files): controllers enabled on ``sandlot/``,
    limits and the pid written into the VM's own cgroup."""
    _fake_v2(tmp_path, "/", "memory pids")
    (tmp_path / "sandlot").mkdir()
    (tmp_path / "sandlot" / "cgroup.subtree_control").write_text("")
    host = HostCgroups(2, (Tree(tmp_path, ("memory", "pids")),))
    placement = hostcgroup.place(1234, "box", Limits(300 << 20, 200_000), host)
    leaf = tmp_path / "sandlot" / "box-1234"
    assert placement == hostcgroup.Placement(2, (leaf,))
    assert (tmp_path / "sandlot" / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (leaf / "memory.max").read_text() == str(300 << 20)
    assert (leaf / "pids.max").read_text() == "512"
    assert not (leaf / "memory.swap.max").exists()  # no swap accounting on this "host"
    assert not (leaf / "cpu.max").exists()
    assert (leaf / "cgroup.procs").read_text() == "1234"


def test_a_lifted_memory_bound_comes_back_in_an_order_v1_accepts(tmp_path: Path) -> None:
    """A checkpoint's room above the bound: on v1 the memory+swap bound goes up first and
    down last (it must never be below the memory one); an unbounded file is left alone,
    and a cgroup gone meanwhile is no error."""
    v1, v2, gone = tmp_path / "v1", tmp_path / "v2", tmp_path / "gone"
    v1.mkdir()
    v2.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(str(640 << 20))
    (v1 / "memory.memsw.limit_in_bytes").write_text(str(640 << 20))
    (v2 / "memory.max").write_text("max")
    with hostcgroup.Placement(1, (v1, gone)).memory_lifted(1 << 30):
        assert (v1 / "memory.limit_in_bytes").read_text() == str((640 << 20) + (1 << 30))
        assert (v1 / "memory.memsw.limit_in_bytes").read_text() == str((640 << 20) + (1 << 30))
    assert (v1 / "memory.limit_in_bytes").read_text() == str(640 << 20)
    assert (v1 / "memory.memsw.limit_in_bytes").read_text() == str(640 << 20)
    with hostcgroup.Placement(2, (v2,)).memory_lifted(1 << 30):
        assert (v2 / "memory.max").read_text() == "max"
    assert (v2 / "memory.max").read_text() == "max"


def test_a_refused_placement_is_logged_once_and_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = HostCgroups(2, (Tree(tmp_path / "gone", ("memory",)),))
    with caplog.at_level(logging.WARNING, "sandlot.hostcgroup"):
        assert hostcgroup.place(1, "box", Limits.for_vm(128, 1), host) is None
        assert hostcgroup.place(2, "box", Limits.for_vm(128, 1), host) is None
    assert len(caplog.records) == 1
    assert "not bounded by a host cgroup" in caplog.records[0].getMessage()


def test_sweep_removes_only_old_empty_cgroups(tmp_path: Path) -> None:
    old, young, populated = (tmp_path / n for n in ("old-1", "young-2", "busy-3"))
    for d in (old, young, populated):
        d.mkdir()
    (populated / "cgroup.procs").write_text("99")  # rmdir refuses it, as the kernel does a populated cgroup
    long_ago = time.time() - 2 * hostcgroup.STALE_AFTER_S
    for d in (old, populated):
        os.utime(d, (long_ago, long_ago))
    hostcgroup.sweep(tmp_path)
    assert not old.exists() and young.exists() and populated.exists()


@pytest.mark.vm
def test_qemu_runs_in_a_bounded_host_cgroup_that_goes_with_the_box(busybox_root: Path) -> None:
    host = hostcgroup.detect()
    memory_tree = next((t for t in host.trees if "memory" in t.controllers), None)
    if memory_tree is None:
        pytest.skip(f"no host cgroup with a memory controller here: {host.reason or host.report()}")
    box = sandlot.Box(rootfs=busybox_root, memory_mib=128)
    placed: dict[str, Any] = {"paths": []}
    box.start()
    try:
        pid = box.inspect()["vm_pid"]
        leaf = memory_tree.base / hostcgroup.leaf_name(box.hostname, pid)
        proc = hostcgroup.parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        assert proc["memory" if host.version == 1 else ""].endswith(f"/sandlot/{leaf.name}")
        assert str(pid) in (leaf / "cgroup.procs").read_text().split()
        code_cache = TCG_CODE_CACHE_MIB if box.accel == "tcg" else 0
        limit_file = "memory.max" if host.version == 2 else "memory.limit_in_bytes"
        assert int((leaf / limit_file).read_text()) == Limits.for_vm(128, 1, code_cache).memory_bytes
        placed = box.inspect()["host_cgroup"]
        assert placed["version"] == host.version and str(leaf) in placed["paths"]
        assert len(placed["paths"]) == len(host.trees)
    finally:
        box.remove(force=True)
    assert not any(Path(p).exists() for p in placed["paths"])
