"""Abuse inside one box: what it gets, and what the host and a neighbour box feel.

During each attack a neighbour box answers a command every 0.2 s; its latency
(median and worst) is printed with the test (``pytest -s``) and bounded.
The boxes run on ``SANDLOT_TEST_ENGINE`` (qemu by default; gvisor in the second pass
of ``scripts/test``); where a limit cannot be had on a host, the clear error is asserted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.engine import hostcgroup
from sandlot.engine.gvisor import limits as gvisor_limits

from tests.conftest import TEST_ENGINE
from tests.support.neighbour import neighbour_latency
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm

# where the agent keeps the commands' pids limit: cgroup2 in a VM, gVisor's cgroupfs (v1) pids
PIDS_DIR = "/sys/fs/cgroup/sandlot" if TEST_ENGINE == "qemu" else "/sys/fs/cgroup/pids/sandlot"

MEMORY_HOG = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"


@pytest.fixture(scope="module")
def neighbour(busybox_root: Path) -> Iterator[sandlot.Box]:
    with sandlot.Box(rootfs=busybox_root, memory_mib=128, engine=TEST_ENGINE) as box:
        yield box


def test_out_of_memory_is_reported_on_the_command_and_the_box_stays_usable(
    debian_root: Path, neighbour: sandlot.Box
) -> None:
    box = sandlot.Box(rootfs=debian_root, memory_mib=256, engine=TEST_ENGINE)
    with box, neighbour_latency(neighbour, "a memory hog"):
        r = box.exec("python3", "-c", MEMORY_HOG, timeout=120)
        assert r.oom_killed and r.exit_code == 137 and r.signal == 9
        with pytest.raises(sandlot.CommandFailed, match="out-of-memory"):
            r.check()
        # killed inside a shell: the shell goes on, the command is still marked
        r = box.exec("sh", "-c", f"python3 -c '{MEMORY_HOG}'; echo after $?", timeout=120)
        assert r.oom_killed and r.stdout == "after 137\n"
        ok = box.exec("python3", "-c", "print(sum(range(10)))")
        assert ok.stdout == "45\n" and not ok.oom_killed  # usable, and the next command is clean


def test_a_fork_bomb_is_held_by_the_pids_limit(busybox_root: Path, neighbour: sandlot.Box) -> None:
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, pids_limit=64, engine=TEST_ENGINE) as box:
        with neighbour_latency(neighbour, "a fork bomb"), pytest.raises(sandlot.ExecTimeout):
            box.exec("sh", "-c", "bomb() { bomb | bomb & }; bomb; sleep 100", timeout=8)
        # the agent is outside the limit: it answers, and the bomb's group is gone
        deadline = deadline_in(30)
        while True:
            count = box.sh(f"cat {PIDS_DIR}/pids.current").stdout.strip()
            if int(count) <= 2:  # this very command and its shell
                break
            assert time.monotonic() < deadline, f"{count} processes left of the bomb"
            time.sleep(0.5)
        assert box.exec("echo", "fine").stdout == "fine\n"
        assert box.sh(f"cat {PIDS_DIR}/pids.max").stdout.strip() == "64"


def disk_on_host(path: Path) -> int:
    if path.is_file():  # a qcow2 layer
        return path.stat().st_blocks * 512
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*"))  # a layer directory


def test_a_full_disk_is_enospc_inside_and_bounded_outside(busybox_root: Path, neighbour: sandlot.Box) -> None:
    home = sandlot.Runtime.for_home().home
    missing = gvisor_limits.project_quota_missing(home) if TEST_ENGINE == "gvisor" else None
    if missing is not None:  # gVisor on a file system without project quotas: refused, saying why
        before = {b.id for b in sandlot.list()}
        with pytest.raises(
            sandlot.InvalidArgument, match=r"gvisor' cannot bound a box's disk here.*prjquota"
        ):
            sandlot.Box(rootfs=busybox_root, memory_mib=256, disk_size_gb=1, engine=TEST_ENGINE).start()
        assert {b.id for b in sandlot.list()} == before  # refused before a box was made
        return
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, disk_size_gb=1, engine=TEST_ENGINE) as box:
        disk = Path(box.inspect()["paths"]["disk"])
        with neighbour_latency(neighbour, "a disk fill"):
            r = box.sh("dd if=/dev/zero of=/root/fill bs=1M 2>&1; sync", timeout=300)
        # a project quota says EDQUOT on ext4, ENOSPC on XFS; a VM's own file system ENOSPC
        assert "No space left on device" in r.stdout or "quota exceeded" in r.stdout, r.stdout
        on_host = disk_on_host(disk)
        assert on_host < 1.2 * (1 << 30), f"the box's disk takes {on_host} bytes on the host"
        box.sh("rm /root/fill && sync")
        assert box.exec("sh", "-c", "echo written > /root/after && cat /root/after").stdout == "written\n"


def test_host_files_outside_volumes_are_out_of_reach(busybox_root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text(f"host-only-{os.urandom(4).hex()}")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "link-out").symlink_to(secret)  # a link the host made, pointing outside the volume
    with sandlot.Box(
        rootfs=busybox_root, memory_mib=256, volumes=[f"{shared}:/mnt/v"], engine=TEST_ENGINE
    ) as box:
        token = secret.read_text()
        attempts = [
            "cat /mnt/v/link-out",  # followed inside the guest, never on the host
            "cat /mnt/v/../host-secret",
            f"cat {secret}",
            f"grep -rs {token} / --exclude-dir=proc --exclude-dir=sys || true",
        ]
        for cmd in attempts:
            r = box.sh(cmd, timeout=120)
            assert token not in r.stdout + r.stderr, cmd


def test_cpus_are_what_the_box_sees_and_what_the_host_bounds(busybox_root: Path) -> None:
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, cpus=2, engine=TEST_ENGINE) as box:
        assert box.exec("nproc").stdout.strip() == "2"
        placed = box.inspect()["host_cgroup"]
        if not placed:
            assert hostcgroup.detect().version == 0, "the host has cgroups, and the box is in none"
            return
        quotas = []
        for leaf in map(Path, placed["paths"]):
            if (leaf / "cpu.max").exists():
                quotas.append(int((leaf / "cpu.max").read_text().split()[0]))
            elif (leaf / "cpu.cfs_quota_us").exists():
                quotas.append(int((leaf / "cpu.cfs_quota_us").read_text()))
        # QEMU gets a core more than its vCPUs (its own threads); gVisor its CPUs' worth
        want = (2 + hostcgroup.SPARE_CORES) * 100_000 if TEST_ENGINE == "qemu" else 2 * 100_000
        assert want in quotas, (placed, quotas)
