"""What a QEMU boot needs besides the disk: the QEMU binary, the accelerator (and
why), the guest kernel, the agent build and the initramfs. Resolved once per
process and kind of boot, fetching or building on first use."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import HostSetupError
from ...guest.agent import AgentBuild, build_agent
from ...guest.initramfs import build_initramfs
from ...guest.kernel import BASE_MODULES, Kernel, ensure_kernel
from . import accel as accel_mod
from .command import KERNEL_ARGS, qemu_binary, qemu_version

PROBE_TIMEOUT = 8.0  # seconds a KVM probe boot has to print the kernel's banner


@dataclass(frozen=True, slots=True)
class BootAssets:
    qemu: str
    kernel: Kernel
    agent: AgentBuild
    initrd: Path
    accel: accel_mod.AccelChoice


class Assets:
    """The boot assets of one sandlot home, cached per kind of boot."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._lock = threading.Lock()
        self._cache: dict[tuple[object, ...], BootAssets] = {}

    def resolve(
        self,
        *,
        kernel: str | os.PathLike[str] | None = None,
        accel: str = "auto",
        flavor: str = "cloud",
        extra_modules: tuple[str, ...] = (),
    ) -> BootAssets:
        """``flavor`` picks the distro kernel ("cloud", or "generic" which has 9p for volumes)."""
        override = os.environ.get("SANDLOT_INITRAMFS")  # debugging aid: boot another initramfs
        key = (str(kernel) if kernel else None, accel, flavor, extra_modules, override)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                return cached
            qemu = qemu_binary()
            kern = ensure_kernel(self.home, kernel, flavor=flavor)
            agent = build_agent(self.home)
            if override:
                initrd = Path(override).expanduser().absolute()
                if not initrd.is_file():
                    raise HostSetupError(f"SANDLOT_INITRAMFS={override} is not a file")
            else:
                wanted = (*BASE_MODULES, *extra_modules)
                missing = [m for m in extra_modules if m not in kern.modules]
                if missing:
                    raise HostSetupError(f"kernel {kern.version} lacks modules {', '.join(missing)}")
                modules = [(name, kern.modules[name]) for name in kern.load_order(wanted)]
                initrd = build_initramfs(self.home / "initramfs", agent.path, modules)
            choice = accel_mod.choose(
                accel,
                cache_dir=self.home,
                probe_key=f"{qemu}:{kern.sha256[:16]}",
                probe=lambda: probe_kvm(qemu, kern.vmlinux, probe_timeout()),
            )
            assets = BootAssets(qemu, kern, agent, initrd, choice)
            self._cache[key] = assets
            return assets

    @staticmethod
    def identity(assets: BootAssets) -> tuple[str, ...]:
        """What a state saved from a VM booted with ``assets`` depends on."""
        return (assets.accel.name, assets.kernel.sha256, assets.agent.digest, str(assets.initrd),
                qemu_version(assets.qemu))  # fmt: skip


def probe_timeout() -> float:
    """``$SANDLOT_KVM_PROBE_TIMEOUT``, else 8 s: what a KVM that works needs to print a
    kernel's banner, with room to spare. A host that emulates the CPU it runs KVM on
    (a nested box under TCG) may need more; a wrong value only costs that probe, once
    per host boot."""
    value = os.environ.get("SANDLOT_KVM_PROBE_TIMEOUT")
    try:
        seconds = float(value) if value else PROBE_TIMEOUT
    except ValueError:
        raise HostSetupError(f"SANDLOT_KVM_PROBE_TIMEOUT={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise HostSetupError(f"SANDLOT_KVM_PROBE_TIMEOUT={value!r} must be more than 0")
    return seconds


def probe_kvm(qemu: str, vmlinux: Path, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Boot the kernel under KVM without a root disk; None if it prints its banner in time."""
    cmd = [
        qemu, "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on", "-accel", "kvm", "-cpu", "host",
        "-m", "128M", "-smp", "1", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(vmlinux), "-append", KERNEL_ARGS.replace("quiet", "") + " panic=-1",
        "-serial", "stdio",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    except OSError as exc:
        return str(exc)
    deadline = time.monotonic() + timeout
    out = b""
    assert proc.stdout is not None
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        while time.monotonic() < deadline:
            chunk = proc.stdout.read()
            if chunk:
                out += chunk
                if b"Linux version" in out or b"Run /init" in out or b"Kernel panic" in out:
                    return None
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                return f"QEMU exited ({proc.returncode}): {err.strip()[-300:]}"
            time.sleep(0.05)
        return f"no kernel output within {timeout:.0f}s"
    finally:
        proc.kill()
        proc.wait()
