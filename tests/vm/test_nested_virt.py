"""Nested virtualization: a box with ``nested_virt=True`` runs VMs of its own on its
``/dev/kvm`` (under TCG, on QEMU's emulated SVM), and keeps its live state while one
runs: snapshot, fork, rollback, pause, suspend and resume. The VM inside is a real one,
made through the KVM API by ``tests/support/kvm_guest.c``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.support.kvmhost import build_kvm_guest
from tests.support.waiting import deadline_in
from tests.vm.test_cli import sandlot as sandlot_cli

pytestmark = pytest.mark.vm

COUNT = "/tmp/count"  # what the looping guest has written so far, every 1000 writes


@pytest.fixture(scope="module")
def kvm_guest(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The KVM API program, static: it runs in any image."""
    return build_kvm_guest(tmp_path_factory.mktemp("kvm") / "kvm_guest").read_bytes()


@pytest.fixture(scope="module")
def nested_box(busybox_root: Path, kvm_guest: bytes) -> Iterator[sandlot.Box]:
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, nested_virt=True) as box:
        box.files.write("/kvm_guest", kvm_guest, mode=0o755)
        yield box


def count(box: sandlot.Box) -> int:
    return int(box.exec("cat", COUNT).stdout or 0)


def advancing(box: sandlot.Box, timeout: float = 30.0) -> tuple[int, int]:
    """(a count, a later one): the box's own VM is running."""
    first = count(box)
    deadline = deadline_in(timeout)
    while (now := count(box)) <= first:
        assert time.monotonic() < deadline, f"the box's VM wrote nothing more in {timeout:.0f} s (at {first})"
        time.sleep(0.2)
    return first, now


def test_a_nested_virt_box_runs_a_vm_of_its_own(nested_box: sandlot.Box) -> None:
    dev = nested_box.exec("ls", "-ln", "/dev/kvm").stdout.split()
    assert dev[0] == "crw-rw-rw-", dev  # any user of the box may run VMs
    r = nested_box.exec("/kvm_guest", timeout=60)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "KVM\n", "")
    assert nested_box.inspect()["options"]["nested_virt"] is True


def test_a_box_without_the_option_has_no_kvm(bb_box: sandlot.Box, kvm_guest: bytes) -> None:
    assert bb_box.exec("test", "-e", "/dev/kvm").exit_code == 1
    bb_box.files.write("/tmp/kvm_guest", kvm_guest, mode=0o755)
    r = bb_box.exec("/tmp/kvm_guest")
    assert r.exit_code == 2 and "open /dev/kvm: No such file or directory" in r.stderr


def test_live_state_while_the_boxs_own_vm_runs(nested_box: sandlot.Box) -> None:
    """QEMU cannot load a state saved while a vCPU runs a nested guest: the box's commands
    are frozen for each save, and every VM restored from one runs its own VM on."""
    nested_box.exec("sh", "-c", f"/kvm_guest loop {COUNT} >/dev/null 2>/tmp/kvm.err &")
    advancing(nested_box)
    snap = nested_box.snapshot("nested-running")
    try:
        advancing(nested_box)  # thawed after the save
        children = nested_box.fork(2)
        try:
            for child in children:
                assert child.inspect()["options"]["nested_virt"] is True
                advancing(child)
            # each child runs its own copy: the parent's count goes on from its own
            assert child.exec("pidof", "kvm_guest").stdout.strip()
        finally:
            for child in children:
                child.remove(force=True)
        before = count(nested_box)
        nested_box.rollback(snap)
        assert count(nested_box) <= before
        advancing(nested_box)
        nested_box.pause()
        nested_box.unpause()
        advancing(nested_box)
        nested_box.suspend()
        nested_box.resume()
        advancing(nested_box)
        assert nested_box.exec("cat", "/tmp/kvm.err").stdout == ""
    finally:
        nested_box.exec("sh", "-c", f"kill $(pidof kvm_guest); rm -f {COUNT} {COUNT}.tmp")
        snap.remove()


def test_a_snapshot_without_kvm_starts_no_nested_virt_box(bb_box: sandlot.Box) -> None:
    snap = bb_box.snapshot("no-kvm")
    try:
        with pytest.raises(sandlot.InvalidArgument, match="without nested virtualization"):  # noqa: SIM117
            with sandlot.Box(template=snap.id, nested_virt=True):
                pass
    finally:
        snap.remove()


def test_the_option_over_http_and_the_cli(busybox_root: Path, kvm_guest: bytes) -> None:
    from tests.support.serve import serving

    with serving(Path(os.environ["SANDLOT_HOME"])) as served, \
            sandlot.connect(served.url, api_key=served.api_key) as client, \
            client.Box(rootfs=busybox_root, memory_mib=256, nested_virt=True) as box:  # fmt: skip
        box.files.write("/kvm_guest", kvm_guest, mode=0o755)
        assert box.exec("/kvm_guest", timeout=60).stdout == "KVM\n"
    r = sandlot_cli(
        "run", "--rm", "--nested-virt", "--rootfs", str(busybox_root), "--", "test", "-c", "/dev/kvm"
    )
    assert r.returncode == 0, r.stderr
