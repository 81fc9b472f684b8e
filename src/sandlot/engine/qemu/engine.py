"""The QEMU engine: microVMs under KVM, or under TCG emulation where KVM is not usable.

Saved states are QEMU migration streams. A state directory holds one of two forms:

* ``state``: RAM and devices in one stream. Any VM of the same shape loads it;
  its RAM ends up private to that VM.
* ``memory`` + ``devices``: the guest RAM as a raw file and the device state
  without RAM (``x-ignore-shared``). VMs map ``memory`` copy-on-write
  (``memory-backend-file,share=off``), so twenty children of one snapshot share
  every page none of them wrote. ``share_memory`` turns the first form into the
  second, once, with a helper QEMU; forks, templates and exports use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import pids
from ...config import flock_within, free_bytes, fsync_dir, runtime_dir
from ...errors import HostSetupError, IncompatibleSnapshot, NoSpace, SavedStateError, Unsupported, no_space
from .. import hostcgroup
from ..base import (
    Boot,
    BootRequest,
    Drive,
    Engine,
    LaunchSpec,
    NetSpec,
    Placement,
    SavedState,
    VMRef,
    VMStatus,
    Volume,
)
from . import accel as accel_mod
from .command import (
    DEVICE_SET,
    DEVICE_SETS,
    MACHINE,
    SERIAL_ON_PCI_MODULE,
    VMConfig,
    cpu_model,
    device_set_of,
    host_tsc_khz,
    kernel_args_from_env,
    qemu_binary,
    qemu_version,
    state_dir_of,
)
from .monitor import qmp_sync
from .vm import STATUS, QemuVM

if TYPE_CHECKING:
    from ...guest.kernel import Kernel
    from .assets import Assets, BootAssets

STATE_FILES = {"devices": "devices", "memory": "memory"}  # archive member -> file in the state directory
MATERIALIZE_WAIT = 600.0  # seconds to wait for another process making the same memory file


class QemuEngine(Engine):
    name = "qemu"
    host_processes = True
    chunked_state = True  # its saves are migration streams, taken apart into chunks (``stream``)
    lazy_image = "microvm.ram"  # the RAM block ``command`` names its memory backend after

    def __init__(self, home: Path) -> None:
        self.home = home
        self._assets: Assets | None = None

    @property
    def assets(self) -> Assets:
        """Kernel, initramfs and accelerator, looked into at the first boot (a command on
        a running box never needs them, nor their imports)."""
        if self._assets is None:
            from .assets import Assets

            self._assets = Assets(self.home)
        return self._assets

    # -- boots -------------------------------------------------------------------------

    def refuse(self, request: BootRequest) -> None:
        if request.nested_virt:
            blocker = accel_mod.nested_blocker(request.accel)
            if blocker is not None:
                raise Unsupported(f"nested_virt=True cannot be had on this host: {blocker}")

    def resolve(self, request: BootRequest) -> BootAssets:
        """The assets behind a ``Boot`` (for ``sandlot setup`` and the tests)."""
        flavor = "generic" if request.volumes else "cloud"  # the cloud kernel has no 9p
        extra: tuple[str, ...] = ("9p", "9pnet_virtio") if request.volumes else ()
        if request.network:
            extra += ("virtio_net",)
        assets = self.assets.resolve(kernel=request.kernel, accel=request.accel, flavor=flavor,
                                     extra_modules=extra)  # fmt: skip
        if request.containers:
            from ...guest.kernel import CONTAINER_MODULES  # boot assets: a running box's command needs none

            # what this kernel has as modules; the rest is built in, or missing, which the
            # engine in the box then says (sandlot checks its start: ``core.containers``)
            extra += tuple(m for m in CONTAINER_MODULES if m in assets.kernel.modules)
            assets = self.assets.resolve(kernel=request.kernel, accel=request.accel, flavor=flavor,
                                         extra_modules=extra)  # fmt: skip
        if not request.nested_virt:
            return assets
        # the guest's KVM: the vendor module of the CPU it gets (and kvm, irqbypass beneath it)
        support = accel_mod.nested_support(assets.accel.name)
        if support.module is None:
            raise Unsupported(f"nested_virt=True cannot be had on this host: {support.why}")
        kvm = ("kvm", support.module)
        lacking = kvm_lacking(support, assets.kernel)
        if lacking:
            raise HostSetupError(f"nested_virt=True needs the guest kernel's {' and '.join(lacking)} "
                                 f"module(s), which kernel {assets.kernel.version} lacks")  # fmt: skip
        return self.assets.resolve(kernel=request.kernel, accel=request.accel, flavor=flavor,
                                   extra_modules=extra + kvm)  # fmt: skip

    def prepare(self, request: BootRequest) -> Boot:
        assets = self.resolve(request)
        return Boot(
            engine=self.name,
            accel=assets.accel.name,
            accel_reason=assets.accel.reason,
            record={
                "kernel": str(assets.kernel.vmlinux),
                "initrd": str(assets.initrd),
                "accel": assets.accel.name,
                # the agent ports go on PCI where the kernel has its driver
                "devices": DEVICE_SET if SERIAL_ON_PCI_MODULE in assets.kernel.modules else "2",
                "lockdown": assets.kernel.modules_signed(),
            },
            identity=type(self.assets).identity(assets),
        )

    def _config(self, where: Placement, boot: dict[str, Any], **kw: Any) -> VMConfig:
        """A VM's configuration from its launch record (what attach knows) and ``kw``."""
        shape: dict[str, Any] = {"memory_mib": boot.get("memory_mib", 512), "cpus": boot.get("cpus", 1),
                                 "network": NetSpec() if boot.get("network") else None,
                                 # launch records from before the device sets say nothing: "2"
                                 "devices": boot.get("devices", "2"),
                                 "lockdown": bool(boot.get("lockdown"))}  # fmt: skip
        return VMConfig(
            kernel=Path(boot.get("kernel") or ""), initrd=Path(boot.get("initrd") or ""),
            run_dir=where.run_dir, state_dir=where.state_dir, accel=boot.get("accel") or "tcg",
            hostname=where.hostname, ports=where.agent_ports, **{**shape, **kw},
        )  # fmt: skip

    async def launch(self, spec: LaunchSpec) -> QemuVM:
        cfg = self._config(
            spec.where, spec.boot, disk=spec.disk, memory_mib=spec.memory_mib, cpus=spec.cpus,
            detached=spec.detached, volumes=spec.volumes, network=spec.network,
            disk_readonly=spec.disk_readonly, drives=spec.drives,
        )  # fmt: skip
        if spec.saved is not None:
            cfg.devices = device_set(spec.saved.facts)
            d = spec.saved.directory
            if self.memory_shared(d):
                cfg.ram_file, cfg.ram_shared = d / "memory", False
                cfg.restore_from, cfg.restore_ignore_shared = d / "devices", True
            elif spec.saved.source is not None:
                cfg.restore_source = spec.saved.source
                if spec.saved.memory is not None:  # mapped, read as it is touched (core.lazymem)
                    cfg.ram_file, cfg.ram_shared = spec.saved.memory, False
            elif (d / "state").is_file():  # saved by a sandlot before chunks
                cfg.restore_from, cfg.restore_ignore_shared = d / "state", False
            else:
                raise SavedStateError(f"the saved state in {d} has no files (removed meanwhile?)")
        if cfg.boots:
            cfg.extra_kernel_args = kernel_args_from_env()
        vm = QemuVM(cfg)
        await vm.start()
        return vm

    def attach(self, ref: VMRef, where: Placement, boot: dict[str, Any]) -> QemuVM:
        cfg = self._config(where, boot, disk=Path())
        # the VM's own devices: one restored from an older state has that state's, whatever
        # the launch record (which says how this sandlot boots) holds
        cfg.devices = device_set_of(pids.cmdline(ref.pid)) or cfg.devices
        return QemuVM.attach(cfg, ref)

    # -- recovery (no event loop) --------------------------------------------------------

    def probe(self, ref: VMRef | None, where: Placement) -> VMStatus:
        if not self.alive(ref, where.box_id):
            return VMStatus.GONE
        try:
            reply = qmp_sync(
                where.run_dir / "qmp.sock", where.state_dir / "qmp.lock", [("query-status", None)]
            )
        except Exception:
            return VMStatus.UNKNOWN
        status = reply[0].get("status") if isinstance(reply[0], dict) else None
        return STATUS.get(str(status), VMStatus.UNKNOWN)

    def held_for_room(self, ref: VMRef | None, where: Placement) -> bool:
        # a virtio drive's default error policy is werror=enospc: QEMU stops the guest
        # ("io-error") rather than fail a write the host has no room for, and names why
        # per drive
        if not self.alive(ref, where.box_id):
            return False
        try:
            asked: list[tuple[str, dict[str, Any] | None]] = [("query-status", None), ("query-block", None)]
            status, drives = qmp_sync(where.run_dir / "qmp.sock", where.state_dir / "qmp.lock", asked)
        except Exception:
            return False
        return (
            isinstance(status, dict)
            and status.get("status") == "io-error"
            and any(isinstance(d, dict) and d.get("io-status") == "nospace" for d in drives or [])
        )

    def let_run(self, ref: VMRef, where: Placement) -> None:
        qmp_sync(where.run_dir / "qmp.sock", where.state_dir / "qmp.lock", [("cont", None)])

    def vm_of(self, process: pids.Process) -> tuple[VMRef, Path] | None:
        state_dir = state_dir_of(process.argv)  # QEMU is the VM
        return (VMRef(process.pid, process.start), state_dir) if state_dir is not None else None

    def abort_save(self, ref: VMRef, where: Placement, *, resume: bool) -> None:
        sock, lock = where.run_dir / "qmp.sock", where.state_dir / "qmp.lock"
        with contextlib.suppress(Exception):
            # A background snapshot is let finish, never cancelled: QEMU 7.2 leaves the
            # guest's memory write-protected after one that did not complete, and the guest
            # hangs at its next write. It writes a file, so it ends by itself.
            deadline = time.monotonic() + BACKGROUND_SAVE_WAIT
            while True:
                info, caps = qmp_sync(
                    sock, lock, [("query-migrate", None), ("query-migrate-capabilities", None)]
                )
                background = any(
                    c.get("capability") == "background-snapshot" and c.get("state") for c in caps
                )
                if not background or info.get("status") not in MIGRATING or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if not background:
                qmp_sync(sock, lock, [("migrate_cancel", None)])
        if resume:
            with contextlib.suppress(Exception):
                qmp_sync(sock, lock, [("cont", None)])

    # -- saved states ----------------------------------------------------------------------

    def memory_shared(self, directory: Path) -> bool:
        return (directory / "devices").is_file() and (directory / "memory").is_file()

    def state_files(self, directory: Path) -> dict[str, Path]:
        return {member: directory / name for member, name in STATE_FILES.items()}

    async def share_memory(
        self, state: SavedState, disk: Path, drives: tuple[Drive, ...] = (), shares: tuple[Volume, ...] = ()
    ) -> None:
        """Load the stream into a helper QEMU whose RAM is a shared file, then save
        the devices without RAM: the file is the memory image children map."""
        d = state.directory
        if self.memory_shared(d):
            return
        fd = await flock_within(d / ".materialize.lock", MATERIALIZE_WAIT, "this snapshot's memory file")
        try:
            if self.memory_shared(d):
                return
            facts = state.facts
            work = Path(tempfile.mkdtemp(prefix=".work-", dir=d))
            mem_tmp = d / ".memory.tmp"
            with contextlib.suppress(FileNotFoundError):
                mem_tmp.unlink()
            boot = {"kernel": facts["engine_facts"]["kernel"], "initrd": facts["engine_facts"]["initrd"],
                    "accel": facts["accel"]}  # fmt: skip
            where = Placement(f"m-{d.name}", f"materialize-{d.name}", work, runtime_dir() / f"m-{d.name}",
                              facts["agent_ports"])  # fmt: skip
            cfg = self._config(
                where, boot, disk=disk, disk_readonly=True, memory_mib=facts["memory_mib"],
                cpus=facts["cpus"], detached=False, ram_file=mem_tmp, ram_shared=True, incoming=True,
                network=NetSpec() if facts.get("network") else None,  # the same devices; it never runs
                devices=device_set(facts), drives=tuple(replace(d, readonly=True) for d in drives),
                # the same 9p devices, none mounted in a saved guest: of an empty directory,
                # as this VM never runs (and the host directories may be gone since)
                volumes=tuple(replace(v, host=str(work), readonly=True) for v in shares),
            )  # fmt: skip
            vm = QemuVM(cfg)
            try:
                if free_bytes(d) < (facts["memory_mib"] << 20):  # the memory file it is about to write
                    raise no_space(d, f"the saved state {d.name} cannot be prepared for forks and exports "
                                      f"(its {facts['memory_mib']} MiB memory file)")  # fmt: skip
                await vm.start()
                if state.source is not None:
                    await vm.load_source(state.source)
                else:
                    await vm.load_state(d / "state")
                await vm.save_state(d / ".devices.tmp", ignore_shared=True)
            except NoSpace:
                with contextlib.suppress(FileNotFoundError):
                    mem_tmp.unlink()
                raise
            except Exception as exc:
                if "No space left" in f"{exc}\n{vm.stderr_tail()}":
                    with contextlib.suppress(FileNotFoundError):
                        mem_tmp.unlink()
                    raise no_space(
                        d, f"the saved state {d.name} cannot be prepared for forks and exports"
                    ) from exc
                raise SavedStateError(
                    f"the saved state {d.name} could not be prepared for forks: {exc}\n{vm.stderr_tail()}"
                ) from exc
            finally:
                await vm.kill(grace=1.0)
                vm.cleanup()
                shutil.rmtree(work, ignore_errors=True)
            await asyncio.to_thread(_fsync_file, mem_tmp)
            os.rename(mem_tmp, d / "memory")
            os.rename(d / ".devices.tmp", d / "devices")
            fsync_dir(d)
            with contextlib.suppress(FileNotFoundError):  # the stream says nothing the two files do not
                (d / "state").unlink()
        finally:
            os.close(fd)

    def check_compatible(self, facts: dict[str, Any], boot: Boot) -> None:
        if facts.get("engine") != self.name:
            raise IncompatibleSnapshot(
                f"the snapshot was saved by the {facts.get('engine')!r} engine; this box runs on {self.name}"
            )
        ef = facts.get("engine_facts") or {}
        mine = qemu_version()
        if ef.get("machine") != MACHINE:
            raise IncompatibleSnapshot(
                f"the snapshot is of a {ef.get('machine')!r} machine; sandlot runs {MACHINE}"
            )
        if ef.get("devices", "1") not in DEVICE_SETS:
            raise IncompatibleSnapshot(
                f"the snapshot's VM has device set {ef.get('devices')!r}; "
                f"this sandlot knows sets {', '.join(DEVICE_SETS)}"
            )
        if _major_minor(ef.get("qemu_version", "")) != _major_minor(mine):
            raise IncompatibleSnapshot(
                f"the snapshot was saved by QEMU {ef.get('qemu_version')}; this host has QEMU {mine}"
            )
        if facts.get("accel") != boot.accel:
            raise IncompatibleSnapshot(
                f"the snapshot was saved under {facts.get('accel')}; this host runs boxes under {boot.accel}"
            )
        wanted_cpu = cpu_model(boot.accel)
        if ef.get("cpu_model") != wanted_cpu:
            raise IncompatibleSnapshot(
                f"the snapshot's CPU model {ef.get('cpu_model')!r} is not {wanted_cpu!r}"
            )

    def facts_for_import(self, facts: dict[str, Any], boot: Boot) -> dict[str, Any]:
        ef = facts.get("engine_facts") or {}
        keep = {k: ef[k] for k in ("machine", "devices", "qemu_version", "cpu_model") if k in ef}
        return {
            **facts,
            "engine_facts": {**keep, "kernel": boot.record["kernel"], "initrd": boot.record["initrd"]},
        }

    # -- facts ----------------------------------------------------------------------------

    def doctor(self) -> dict[str, Any]:
        from ...guest.kernel import BASE_MODULES

        report: dict[str, Any] = {"engine": self.name}
        try:
            qemu = qemu_binary()
            report["qemu"] = {"path": qemu, "version": qemu_version(qemu)}
        except HostSetupError as exc:
            report["qemu"] = {"error": str(exc)}
        blocker = accel_mod.kvm_precheck()
        report["kvm_precheck"] = "ok" if blocker is None else blocker
        try:
            assets = self.resolve(BootRequest())
            report["accel"] = {"name": assets.accel.name, "reason": assets.accel.reason}
            if assets.accel.name == "tcg":
                report["accel"]["advice"] = TCG_ADVICE
            report["kernel"] = {
                "version": assets.kernel.version,
                "source": assets.kernel.source,
                "vmlinux": str(assets.kernel.vmlinux),
                "sha256": assets.kernel.sha256,
                "modules": assets.kernel.load_order(BASE_MODULES),
                "lockdown": assets.kernel.modules_signed(),
            }
            support = accel_mod.nested_support(assets.accel.name)
            lacking = kvm_lacking(support, assets.kernel)
            why = f"kernel {assets.kernel.version} lacks {', '.join(lacking)}" if lacking else support.why
            report["nested_virt"] = {"available": support.available and not lacking, "why": why}
            from ...guest.kernel import CONTAINER_MODULES

            has, wanted = [m for m in CONTAINER_MODULES if m in assets.kernel.modules], len(CONTAINER_MODULES)
            rest = "" if len(has) == wanted else " (the rest are built in, or missing: a box's start checks)"
            why = f"kernel {assets.kernel.version} has {len(has)} of the {wanted} modules Docker needs{rest}"
            report["containers"] = {"modules": len(has), "of": wanted, "why": why}
            report["agent"] = {"path": str(assets.agent.path), "compiler": assets.agent.compiler}
            report["initramfs"] = str(assets.initrd)
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["tsc_khz"] = host_tsc_khz()
        report["host_cgroup"] = hostcgroup.detect().report()
        return report


# Under emulation QEMU keeps the code it translated by virtual address: a process
# whose ld.so and libc land at new addresses has them translated again (measured:
# exec of Debian's /usr/bin/true 56 ms with randomization, 14 without; docs/api.md).
TCG_ADVICE = (
    "under emulation, dynamically linked programs start several times faster in boxes "
    "with aslr=False (sandlot run --no-aslr), which gives up the randomization of "
    "their processes' addresses"
)


BACKGROUND_SAVE_WAIT = 120.0  # seconds recovery lets a background snapshot run to its end
MIGRATING = ("setup", "active", "pre-switchover", "device", "wait-unplug", "postcopy-active")


def kvm_lacking(support: accel_mod.NestedSupport, kernel: Kernel) -> list[str]:
    """The guest KVM modules a box with nested virtualization loads (kvm and the vendor's)
    that ``kernel`` does not have."""
    return [m for m in ("kvm", support.module) if m and m not in kernel.modules]


def device_set(facts: dict[str, Any]) -> str:
    """The device set of a saved state's VM (states saved before the sets came do not say: "1")."""
    return str((facts.get("engine_facts") or {}).get("devices", "1"))


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(" ")[0].split(".")[:2])


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
