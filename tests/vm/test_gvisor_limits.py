"""engine='gvisor' under pressure and at its edges: a hostile box beside a neighbour,
engine='auto' on this host, and a kill -9 between a checkpoint and its restore.
The limits themselves (cpus, memory, pids, disk) are tested on both engines by
``tests/security/test_limits.py``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.core.runtime import Runtime
from sandlot.engine.gvisor import limits, probe

from tests.support.neighbour import neighbour_latency
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vm  # runsc comes with scripts/setup; boxes run as root here


@contextlib.contextmanager
def home_on_own_fs(where: Path, size_gib: int, mkfs: list[str], options: str) -> Iterator[Path]:
    """A home on a file system of its own (a loop device), so that what its boxes write is
    bounded by that file system, whatever else holds. Its boxes are removed, and the file
    system, at the end. Skips where the host cannot mount it so."""
    image, mnt = where / "fs.img", where / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_gib << 30)
    subprocess.run([*mkfs, str(image)], check=True, capture_output=True)
    mounted = subprocess.run(
        ["mount", "-o", f"loop,{options}", str(image), str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        image.unlink()
        pytest.skip(f"this host cannot mount {' '.join(mkfs)} with -o {options}: {mounted.stderr.strip()}")
    home = mnt / "home"
    home.mkdir()
    try:
        yield home
    finally:
        for b in sandlot.list(home=home):
            b.remove(force=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        image.unlink(missing_ok=True)


@pytest.fixture
def quota_home(tmp_path: Path) -> Iterator[Path]:
    """ext4 with the project and quota features, mounted prjquota: what a host needs for
    gVisor disk limits. (This project's CI kernel has no quota support: skipped there.)"""
    with home_on_own_fs(tmp_path, 3, ["mkfs.ext4", "-q", "-O", "quota,project"], "prjquota") as home:
        yield home


@pytest.fixture
def small_home(tmp_path: Path) -> Iterator[Path]:
    """A home on a 3 GiB ext4 of its own: where the host has no project quotas, the file
    system under the home is what bounds its boxes' disks (all of them together)."""
    with home_on_own_fs(tmp_path, 3, ["mkfs.ext4", "-q"], "rw") as home:
        yield home


def du(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*"))


def test_a_project_quota_bounds_the_disk(busybox_root: Path, quota_home: Path) -> None:
    """Writes past disk_size_gb fail inside the box; the layer directory stays bounded on the
    host; after a snapshot the new top layer has a quota of its own."""
    assert limits.project_quota_missing(quota_home) is None
    with sandlot.Box(
        rootfs=busybox_root, engine="gvisor", memory_mib=256, disk_size_gb=1, home=quota_home
    ) as box:
        r = box.sh("dd if=/dev/zero of=/root/fill bs=1M count=1500 2>&1; sync", timeout=300)
        assert "quota exceeded" in r.stdout or "No space left" in r.stdout, r.stdout
        layer = Path(box.inspect()["paths"]["disk"])
        assert du(layer) < 1.1 * (1 << 30), du(layer)
        box.sh("rm /root/fill; sync")
        assert box.exec("sh", "-c", "echo ok > /root/after && cat /root/after").stdout == "ok\n"
        box.snapshot("q1")
        r = box.sh("dd if=/dev/zero of=/root/fill2 bs=1M count=1500 2>&1; sync", timeout=300)
        assert "quota exceeded" in r.stdout or "No space left" in r.stdout, r.stdout
        assert du(Path(box.inspect()["paths"]["disk"])) < 1.1 * (1 << 30)


def test_the_runsc_probe_runs_a_real_sandbox(tmp_path: Path) -> None:
    assert probe.prerequisites() is None  # root, overlayfs and runsc: what the tests run with
    t0 = time.monotonic()
    assert probe.why_unusable(tmp_path) is None
    first = time.monotonic() - t0
    assert (tmp_path / probe.PROBE_FILE).is_file()
    t0 = time.monotonic()
    assert probe.why_unusable(tmp_path) is None  # cached for this host boot and runsc binary
    assert time.monotonic() - t0 < first
    # a runsc that cannot run a sandbox is found out by the probe, not by the first box
    broken = tmp_path / "runsc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'runsc version 0.0~20221219.0' && exit 0\n"
                      "echo 'cannot create sandbox: permission denied' >&2; exit 128\n")  # fmt: skip
    broken.chmod(0o755)
    why = probe.run_probe(str(broken), "ptrace")
    assert why is not None and "permission denied" in why


def test_auto_picks_gvisor_on_this_host_and_records_it(busybox_root: Path) -> None:
    """This host's /dev/kvm is nested PVM (no vmx): auto skips KVM, and runsc works as root."""
    choice = Runtime.for_home().auto_engine()
    assert choice.name == "gvisor", choice.reason
    assert "KVM is unusable" in choice.reason
    report = Runtime.for_home().doctor()
    assert report["auto"]["engine"] == "gvisor"
    assert report["gvisor"]["runsc"]["platform"] in ("ptrace", "systrap")
    with sandlot.Box(rootfs=busybox_root, engine="auto", memory_mib=256) as box:
        assert box.inspect()["engine"] == "gvisor"
        assert box.inspect()["options"]["engine"] == "gvisor"  # never "auto" in the row
        assert "gVisor" in box.exec("dmesg").stdout


def test_kill9_between_checkpoint_and_restore_leaves_a_clean_stopped_box(busybox_root: Path) -> None:
    """runsc checkpoint ends the sandbox; the owner is killed before the restore. The next
    reader stops the box (not crashed) with its files, and it starts again."""
    name = f"gv-ckpt-{os.getpid()}"
    box = sandlot.create(rootfs=busybox_root, engine="gvisor", name=name, memory_mib=256)
    try:
        box.start()
        box.files.write("/root/kept", "yes")
        script = f"import sandlot\nsandlot.get({name!r}).snapshot('cut-short')\n"
        env = {**os.environ, "SANDLOT_CRASH_AT": "snapshot.after-checkpoint"}
        r = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == -9, r.stderr
        found = sandlot.get(name)
        info = found.inspect()
        assert found.state == "stopped", info
        assert "as they were saved" in (info.get("reason") or "")
        assert "cut-short" not in [s.name for s in sandlot.list_snapshots()]
        found.start()
        assert found.files.read("/root/kept") == b"yes"
        assert found.exec("echo", "back").stdout == "back\n"
    finally:
        with contextlib.suppress(sandlot.BoxNotFound):
            sandlot.get(name).remove(force=True)


MEMORY_HOG = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"


def test_hostile_box_is_contained_and_its_neighbour_answers(
    debian_root: Path, busybox_root: Path, small_home: Path
) -> None:
    """A fork bomb, a memory hog and a disk fill in one box, one after the other, each
    held; a neighbour box's exec latency is sampled throughout. The disk fill is bounded
    by the home's own file system (``small_home``; a project quota per box where the host
    kernel has them). One after the other: a hog and a fill at once can end the box (the
    host's cgroup v1 charges the fill's dirty page cache to the sandbox, its OOM killer
    strikes before the agent's, and the ptrace Sentry panics): docs/architecture.md."""
    with (
        sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=128, home=small_home) as neighbour,
        sandlot.Box(
            rootfs=debian_root, engine="gvisor", memory_mib=256, pids_limit=64, home=small_home
        ) as bad,
    ):
        with neighbour_latency(neighbour, "a fork bomb, a memory hog and a disk fill"):
            with pytest.raises(sandlot.ExecTimeout):
                bad.exec("sh", "-c", "bomb() { bomb | bomb & }; bomb; sleep 100", timeout=8)
            assert int(bad.exec("cat", "/sys/fs/cgroup/pids/sandlot/pids.max").stdout) == 64
            # the bomb's group is ended with its command, one process at a time: the next
            # command (a python3) needs room under the limit
            wait_for("the bomb's processes gone", lambda: int(
                bad.exec("cat", "/sys/fs/cgroup/pids/sandlot/pids.current").stdout) <= 2, 30)  # fmt: skip
            hog = bad.exec("python3", "-c", MEMORY_HOG, timeout=120)
            assert hog.exit_code == 137 and hog.oom_killed, hog
            fill = bad.exec("dd", "if=/dev/zero", "of=/root/fill", "bs=1M", timeout=300)
            assert "No space left" in fill.stderr or "quota exceeded" in fill.stderr, fill
        # contained: the hostile box itself still answers, and cleans up
        assert bad.exec("echo", "alive", timeout=60).stdout == "alive\n"
        bad.exec("rm", "-f", "/root/fill", timeout=60)
