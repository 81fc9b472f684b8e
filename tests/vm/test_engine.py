"""The QEMU engine: command line facts, QMP, and what happens when the Python
process that owns a box is killed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.core.controller import CLOCKSOURCES
from sandlot.engine.base import Placement, VMRef, VMStatus
from sandlot.engine.qemu.command import DEVICE_SET, TCG_CPU, VMConfig, build_command, device_set_of

from tests.support.names import unique
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm


def test_command_line_carries_the_boot_facts(tmp_path: Path) -> None:
    cfg = VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=tmp_path,
                   state_dir=tmp_path, accel="tcg", memory_mib=256, hostname="h1")  # fmt: skip
    cmd = build_command(cfg, "qemu-system-x86_64")
    line = " ".join(cmd)
    assert "microvm,x-option-roms=off,isa-serial=on,rtc=on" in line
    assert "-nodefaults" in cmd and "-no-reboot" in cmd and "-no-user-config" in cmd
    assert TCG_CPU in cmd and "erms=off" in TCG_CPU
    append = cmd[cmd.index("-append") + 1]
    for fact in (
        "console=ttyS0",
        "panic=-1",
        "tsc=reliable",
        "no_timer_check",
        "8250.nr_uarts=1",
        "sandlot.hostname=h1",
        "nowatchdog",  # what an idle box would wake up for, and none needs
        "sysctl.vm.compaction_proactiveness=0",
    ):
        assert fact in append
    assert "tsc_early_khz=" in append
    assert "name=sandlot.0" in line and "virtio-blk-device" in line
    assert "lockdown=" not in append  # a kernel whose modules are not all signed boots unlocked
    cfg.lockdown = True
    locked = build_command(cfg, "qemu-system-x86_64")
    assert "lockdown=confidentiality" in locked[locked.index("-append") + 1].split()


@pytest.mark.parametrize(
    ("devices", "machine_has", "serial", "balloon"),
    [("1", "", "virtio-serial-device", False), ("2", "", "virtio-serial-device", True),
     ("3", ",pcie=on", "virtio-serial-pci", True), ("4", ",pcie=on,pit=off", "virtio-serial-pci", True)],
)  # fmt: skip
def test_each_device_set_has_its_devices(
    tmp_path: Path, devices: str, machine_has: str, serial: str, balloon: bool
) -> None:
    """A VM that loads a state has the devices of the VM that saved it; its command line
    says which set it has (how another process attaching to it knows)."""
    cfg = VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=tmp_path,
                   state_dir=tmp_path, memory_mib=256, hostname="h1", devices=devices)  # fmt: skip
    cmd = build_command(cfg, "qemu-system-x86_64")
    machine = cmd[cmd.index("-M") + 1]
    assert machine.endswith("rtc=on,mem-merge=on" + machine_has)  # KSM may merge its RAM
    assert f"{serial},max_ports=2" in cmd
    assert any(a.startswith("virtio-balloon-device") for a in cmd) == balloon
    assert device_set_of(cmd) == devices
    assert device_set_of(["sleep", "30"]) is None


def test_qmp_reports_running_and_quit_ends_qemu(busybox_root: Path) -> None:
    async def main() -> None:
        box = sandlot.AsyncBox(rootfs=busybox_root, memory_mib=256, template=False)  # a boot's QEMU
        await box.start()
        try:
            info = await box.inspect()
            # QEMU loaded a copy of the kernel, given back once loaded: none of it in its memory
            kernel_rss, mapping = [], ""
            for line in Path(f"/proc/{info['vm_pid']}/smaps").read_text().splitlines():
                if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
                    mapping = line
                elif line.startswith("Rss:") and "vmlinux" in mapping:
                    kernel_rss.append(int(line.split()[1]))
            assert kernel_rss and sum(kernel_rss) == 0
            rt = sandlot.Runtime.for_home()
            assert not (rt.run_dir(box.id) / "vmlinux").exists()
            engine = rt.engine("qemu")
            ref = VMRef(info["vm_pid"], info["vm_start"])
            where = Placement(box.id, box.hostname, rt.box_dir(box.id), rt.run_dir(box.id), 8)
            assert await asyncio.to_thread(engine.probe, ref, where) == VMStatus.RUNNING  # QMP, no loop
            vm = engine.attach(ref, where, info["boot"])
            assert await vm.status() == VMStatus.RUNNING
            await vm.kill(grace=5.0)  # QMP quit first
            assert not engine.alive(ref, box.id)
            assert await box.refresh() == "crashed"  # recovery saw the VM gone
        finally:
            await box.remove(force=True)

    asyncio.run(main())


def test_a_with_block_whose_process_died_is_cleaned_up(busybox_root: Path) -> None:
    code = (
        "import sandlot, sys, time\n"
        f"with sandlot.Box(rootfs={str(busybox_root)!r}, memory_mib=256) as b:\n"
        "    print(b.id, b.inspect()['vm_pid'], flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    box_id, qemu_pid = proc.stdout.readline().split()
    box_dir = sandlot.Runtime.for_home().boxes_dir / box_id
    assert box_dir.exists() and sandlot.get(box_id).state == "running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with sandlot.Box(rootfs=busybox_root, memory_mib=256) as mine:
        ids = [b.id for b in sandlot.list()]  # any sandlot call reconciles
        assert box_id not in ids and not box_dir.exists()
        assert mine.id in ids and mine.exec("true").ok  # a live owner's box is untouched
    deadline = deadline_in(10)
    while time.monotonic() < deadline and Path(f"/proc/{qemu_pid}").exists():
        time.sleep(0.1)
    assert (
        not Path(f"/proc/{qemu_pid}").exists() or "Z" in Path(f"/proc/{qemu_pid}/stat").read_text().split()[2]
    )


def _guest_ram_rss_mib(pid: int, memory_mib: int) -> float:
    """The host memory behind a VM's guest RAM (its mapping of ``memory_mib``)."""
    size, rss = 0, 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0].count("-") == 1 and ":" in fields[3]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            size = (end - start) >> 20
        elif fields and fields[0] == "Rss:" and size == memory_mib:
            rss += int(fields[1])
    return rss / 1024


def test_memory_the_guest_frees_goes_back_to_the_host(busybox_root: Path) -> None:
    """Free page reporting through the balloon: 100 MiB that a program in the box used
    and freed leave the host's memory within seconds (without it they stayed)."""
    with sandlot.Box(rootfs=busybox_root, memory_mib=256) as box:
        pid = box.inspect()["vm_pid"]
        assert box.sh("test -d /sys/bus/virtio/drivers/virtio_balloon").exit_code == 0
        order = box.sh("cat /sys/module/page_reporting/parameters/page_reporting_order").stdout
        assert order == "5\n"  # 128 KiB blocks, set by the agent
        before = _guest_ram_rss_mib(pid, 256)
        fill = box.sh("mkdir -p /run/fill && mount -t tmpfs tmpfs /run/fill && "
                      "dd if=/dev/zero of=/run/fill/x bs=1M count=100 2>/dev/null")  # fmt: skip
        assert fill.exit_code == 0, fill.stderr
        used = _guest_ram_rss_mib(pid, 256)
        assert used > before + 60, (before, used)
        assert box.sh("rm /run/fill/x && umount /run/fill").exit_code == 0
        deadline = deadline_in(20)
        while (now := _guest_ram_rss_mib(pid, 256)) > before + 20 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert now <= before + 20, (before, used, now)


def test_the_box_kernel_runs_in_lockdown(busybox_root: Path) -> None:
    """The distro kernel's modules are signed, so boxes boot it in lockdown: no tracefs
    event tree built at boot (about 9 MiB of every box's RAM), signed modules still load."""
    with sandlot.Box(rootfs=busybox_root, memory_mib=256) as box:
        assert "lockdown=confidentiality" in box.sh("cat /proc/cmdline").stdout.split()
        mode = box.sh("mount -t securityfs none /sys/kernel/security 2>/dev/null; "
                      "cat /sys/kernel/security/lockdown")  # fmt: skip
        assert mode.stdout.strip() == "none integrity [confidentiality]", mode
        assert box.sh("ls /sys/kernel/tracing").stdout == ""  # tracefs never populated
        assert box.sh("test -d /sys/bus/virtio/drivers/virtio_blk").exit_code == 0  # a module


def test_a_template_is_saved_once_the_kernels_boot_time_work_is_done(busybox_root: Path) -> None:
    """The TSC calibration registers the kernel's final clocksource about a second after
    boot and switches to it: a template saved before it would make every box started
    from it do that work (core: ``BoxController.boot_work_done``)."""
    tmpl = sandlot.template(rootfs=busybox_root, memory_mib=256, name=unique("settled"), template=False)
    try:
        with sandlot.Box(template=tmpl) as box:
            assert "tsc-early" not in box.files.read_text(CLOCKSOURCES).split()
    finally:
        tmpl.remove()


@pytest.mark.parametrize("old", ["1", "2", "3", "4"])
def test_states_saved_with_earlier_device_sets_still_load(
    busybox_root: Path, monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    """A state saved by a VM of an earlier device set (every state saved before the
    balloon came: "1"; before the agent ports moved to PCI: "2"; before the PIT went: "3";
    before the egress port: "4") is loaded by a VM with
    those devices, for a rollback and for forks; another process that attaches to such
    a VM and saves it again records the VM's set, not the one it would boot."""
    from sandlot.engine.qemu.engine import QemuEngine

    real = QemuEngine._config

    def with_old_devices(self: QemuEngine, *args: Any, **kw: Any) -> VMConfig:
        cfg = real(self, *args, **kw)
        cfg.devices = old
        return cfg

    def devices_of(box: sandlot.Box) -> str | None:
        return device_set_of(Path(f"/proc/{box.inspect()['vm_pid']}/cmdline").read_text().split("\0"))

    monkeypatch.setattr(QemuEngine, "_config", with_old_devices)
    # booted with the old set (the tree's template, if any, was saved with the newest)
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, template=False) as box:
        assert devices_of(box) == old
        assert box.sh("echo before > /root/mark").exit_code == 0
        snap = box.snapshot()
        monkeypatch.undo()  # this sandlot again: its new VMs have the newest set, states keep theirs
        assert box.sh("echo after > /root/mark").exit_code == 0
        box.rollback(snap)
        assert devices_of(box) == old and box.sh("cat /root/mark").stdout == "before\n"
        [kid] = box.fork(1)
        try:
            assert devices_of(kid) == old and kid.sh("cat /root/mark").stdout == "before\n"
        finally:
            kid.remove(force=True)
        code = f"import sandlot; s = sandlot.get({box.id!r}).snapshot(); print(s.id)"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        again = sandlot.get_snapshot(r.stdout.strip())
        assert again.ref.record.facts["engine_facts"]["devices"] == old  # type: ignore[attr-defined]
        box.rollback(again)
        assert devices_of(box) == old and box.sh("cat /root/mark").stdout == "before\n"
    # the newest set: with a network card, as its egress port is a networked VM's only
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, network="allowlist") as box:
        assert devices_of(box) == DEVICE_SET
        # the agent ports on PCI: their receive queues hold 128 pages each, not 1024
        port = box.sh("readlink -f /sys/class/virtio-ports/vport*p1").stdout
        assert "/pci0000:00/" in port, port
        unreclaimable = box.sh("grep SUnreclaim /proc/meminfo").stdout.split()[1]
        assert int(unreclaimable) < 24 << 10, unreclaimable  # KiB; 43 MiB on virtio-mmio
