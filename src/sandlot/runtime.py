"""The runtime: one ``$SANDLOT_HOME`` and what every box there shares.

It resolves, once per process, the pieces a boot needs: the QEMU binary, the
accelerator (and why), the guest kernel, the agent build and the initramfs.
Boxes ask the runtime; nothing here is per box.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .config import default_home, runtime_dir
from .engine import accel as accel_mod
from .engine.qemu import KERNEL_ARGS, host_tsc_khz, qemu_binary, qemu_version
from .errors import HostSetupError
from .guest.agent import AgentBuild, build_agent
from .guest.initramfs import build_initramfs
from .guest.kernel import BASE_MODULES, Kernel, ensure_kernel
from .images.manager import ImageManager


@dataclass(frozen=True, slots=True)
class BootAssets:
    """Everything a boot needs besides the disk."""

    qemu: str
    kernel: Kernel
    agent: AgentBuild
    initrd: Path
    accel: accel_mod.AccelChoice


class Runtime:
    """Shared state of one sandlot home. Cheap to create; work happens on first use.

    >>> import sandlot
    >>> rt = sandlot.Runtime()            # $SANDLOT_HOME or ~/.local/share/sandlot
    >>> rt.home.name
    'sandlot'
    """

    _instances: dict[Path, Runtime] = {}
    _instances_lock = threading.Lock()

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = Path(home).expanduser().absolute() if home else default_home()
        self._lock = threading.Lock()
        self.images = ImageManager(self.home)
        self._assets: dict[tuple[str | None, str, str | None], BootAssets] = {}

    @classmethod
    def for_home(cls, home: str | os.PathLike[str] | None = None) -> Runtime:
        """The shared runtime of a home (one per process)."""
        key = Path(home).expanduser().absolute() if home else default_home()
        with cls._instances_lock:
            rt = cls._instances.get(key)
            if rt is None:
                rt = cls._instances[key] = cls(key)
            return rt

    # -- layout ----------------------------------------------------------------------

    @property
    def boxes_dir(self) -> Path:
        return self.home / "boxes"

    @property
    def bases_dir(self) -> Path:
        return self.home / "bases"

    def run_dir(self, box_id: str) -> Path:
        return runtime_dir() / box_id

    # -- ephemeral box directories -------------------------------------------------------

    def claim(self, box_dir: Path) -> None:
        """Mark a box directory as owned by this process, so that a later process
        can remove it if we die without cleaning up (the VM dies with us)."""
        (box_dir / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")

    def sweep_orphans(self) -> list[str]:
        """Remove box directories and sockets whose owning process is gone."""
        removed: list[str] = []
        if not self.boxes_dir.is_dir():
            return removed
        for box_dir in self.boxes_dir.iterdir():
            try:
                pid_s, start_s = (box_dir / "owner").read_text().split()
            except (OSError, ValueError):
                continue
            if _start_time(int(pid_s)) == start_s:
                continue  # the owner still runs
            shutil.rmtree(box_dir, ignore_errors=True)
            shutil.rmtree(runtime_dir() / box_dir.name, ignore_errors=True)
            removed.append(box_dir.name)
        return removed

    # -- boot assets ---------------------------------------------------------------------

    def assets(self, *, kernel: str | os.PathLike[str] | None = None, accel: str = "auto") -> BootAssets:
        """Resolve (building or fetching on first use) what a boot needs."""
        key = (str(kernel) if kernel else None, accel, os.environ.get("SANDLOT_INITRAMFS"))
        with self._lock:
            cached = self._assets.get(key)
            if cached is not None:
                return cached
            if not self._assets:
                self.sweep_orphans()
            qemu = qemu_binary()
            kern = ensure_kernel(self.home, kernel)
            agent = build_agent(self.home)
            override = os.environ.get("SANDLOT_INITRAMFS")  # debugging aid: boot another initramfs
            if override:
                initrd = Path(override).expanduser().absolute()
                if not initrd.is_file():
                    raise HostSetupError(f"SANDLOT_INITRAMFS={override} is not a file")
            else:
                modules = [(name, kern.modules[name]) for name in kern.load_order(BASE_MODULES)]
                initrd = build_initramfs(self.home / "initramfs", agent.path, modules)
            choice = accel_mod.choose(
                accel,
                cache_dir=self.home,
                probe_key=f"{qemu}:{kern.sha256[:16]}",
                probe=lambda: probe_kvm(qemu, kern.vmlinux),
            )
            assets = BootAssets(qemu, kern, agent, initrd, choice)
            self._assets[key] = assets
            return assets

    def doctor(self) -> dict[str, object]:
        """Facts about this host for ``sandlot doctor``; never raises for a missing part."""
        report: dict[str, object] = {"home": str(self.home)}
        try:
            qemu = qemu_binary()
            report["qemu"] = {"path": qemu, "version": qemu_version(qemu)}
        except HostSetupError as exc:
            report["qemu"] = {"error": str(exc)}
        blocker = accel_mod.kvm_precheck()
        report["kvm_precheck"] = "ok" if blocker is None else blocker
        try:
            assets = self.assets()
            report["accel"] = {"name": assets.accel.name, "reason": assets.accel.reason}
            report["kernel"] = {
                "version": assets.kernel.version,
                "source": assets.kernel.source,
                "vmlinux": str(assets.kernel.vmlinux),
                "sha256": assets.kernel.sha256,
                "modules": assets.kernel.load_order(BASE_MODULES),
            }
            report["agent"] = {"path": str(assets.agent.path), "compiler": assets.agent.compiler}
            report["initramfs"] = str(assets.initrd)
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["tsc_khz"] = host_tsc_khz()
        self.home.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.home)
        report["disk_free_gib"] = round(usage.free / (1 << 30), 1)
        report["runtime_dir"] = str(runtime_dir())
        return report


def _start_time(pid: int) -> str:
    """A process's start time in clock ticks since boot: (pid, start) names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2 :].split()[19]


def probe_kvm(qemu: str, vmlinux: Path, timeout: float = 8.0) -> str | None:
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
