"""Choose the accelerator: KVM only where it really works, otherwise TCG, and say why.

``/dev/kvm`` existing is not enough: nested setups (e.g. PVM) expose it while a
normal guest kernel hangs under it. KVM is chosen only when the device opens
read-write, the CPU advertises vmx/svm, and a probe boot of the real guest
kernel answers within a short deadline. The probe result is cached per host
boot, QEMU binary and kernel, so it costs one boot per host boot at most.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import InvalidArgument

ACCELS = ("auto", "kvm", "tcg")


@dataclass(frozen=True, slots=True)
class AccelChoice:
    name: str  # "kvm" or "tcg"
    reason: str


def cpu_virt_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return {f for f in line.split(":", 1)[1].split() if f in ("vmx", "svm")}
    return set()


def kvm_precheck(dev: str = "/dev/kvm", cpuinfo_path: str = "/proc/cpuinfo") -> str | None:
    """None when KVM may work; otherwise why it cannot."""
    if not os.path.exists(dev):
        return f"{dev} does not exist (no hardware virtualization exposed to this host)"
    if not os.access(dev, os.R_OK | os.W_OK):
        return f"{dev} is not readable and writable by this user (add yourself to the 'kvm' group)"
    try:
        with open(cpuinfo_path) as f:
            flags = cpu_virt_flags(f.read())
    except OSError:
        flags = set()
    if not flags:
        return (
            f"{dev} exists but the CPU advertises neither vmx nor svm: this is nested or "
            "paravirtualized (e.g. PVM) KVM, under which a normal guest kernel hangs"
        )
    return None


def _host_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def choose(
    requested: str,
    *,
    cache_dir: Path,
    probe_key: str,
    probe: Callable[[], str | None],
) -> AccelChoice:
    """Pick kvm or tcg. ``probe`` boots the guest under KVM and returns None on
    success or the reason it failed; it runs only when the precheck passes."""
    if requested not in ACCELS:
        raise InvalidArgument(f"accel must be one of {', '.join(ACCELS)}, not {requested!r}")
    if requested == "tcg":
        return AccelChoice("tcg", "TCG requested")
    blocker = kvm_precheck()
    if requested == "kvm":
        if blocker:
            raise InvalidArgument(f"accel='kvm' requested but KVM is unusable: {blocker}")
        return AccelChoice("kvm", "KVM requested")
    if blocker:
        return AccelChoice("tcg", f"software emulation (TCG), because {blocker}")

    cache = cache_dir / "accel-probe.json"
    key = f"{_host_boot_id()}:{probe_key}"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return AccelChoice(cached["name"], cached["reason"])
    except (OSError, ValueError, KeyError):
        pass
    failure = probe()
    if failure is None:
        choice = AccelChoice("kvm", "KVM: /dev/kvm usable, CPU has vmx/svm, probe boot answered")
    else:
        choice = AccelChoice("tcg", f"software emulation (TCG), because a KVM probe boot failed: {failure}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, **asdict(choice)}))
    os.replace(tmp, cache)
    return choice
