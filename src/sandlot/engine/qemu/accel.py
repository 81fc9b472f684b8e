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


# The KVM module of each CPU vendor, which a box with nested virtualization loads.
# QEMU's TCG "max" CPU is an AMD one, with SVM and nested paging: under TCG it is kvm_amd.
KVM_MODULES = {"GenuineIntel": "kvm_intel", "AuthenticAMD": "kvm_amd", "HygonGenuine": "kvm_amd"}
TCG_KVM_MODULE = "kvm_amd"


@dataclass(frozen=True, slots=True)
class NestedSupport:
    """Whether a box on this accelerator can run VMs of its own, and why (or why not).
    ``module``: the guest's KVM vendor module; None where a box cannot have KVM."""

    module: str | None
    why: str

    @property
    def available(self) -> bool:
        return self.module is not None


def cpu_vendor(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def nested_support(
    accel: str, *, cpuinfo_path: str = "/proc/cpuinfo", modules_dir: str = "/sys/module"
) -> NestedSupport:
    """Nested virtualization for boxes on ``accel`` ("kvm" or "tcg"). Under TCG it is
    QEMU's emulated SVM, always there. Under KVM, ``-cpu host`` passes VMX/SVM to the
    guest only where the host's KVM module runs with ``nested=1``."""
    if accel != "kvm":
        return NestedSupport(TCG_KVM_MODULE, "QEMU's emulated CPU offers SVM with nested paging "
                             "(a box's own VMs run under emulation too: slowly)")  # fmt: skip
    try:
        with open(cpuinfo_path) as f:
            vendor = cpu_vendor(f.read())
    except OSError:
        vendor = ""
    module = KVM_MODULES.get(vendor)
    if module is None:
        return NestedSupport(None, f"the host CPU's vendor ({vendor or 'unknown'}) has no KVM module "
                             "sandlot knows (kvm_intel, kvm_amd)")  # fmt: skip
    try:
        value = Path(modules_dir, module, "parameters", "nested").read_text().strip()
    except OSError:
        return NestedSupport(None, f"the host's {module} module is not loaded")
    if value not in ("Y", "1"):
        return NestedSupport(
            None,
            f"the host's {module} module runs with nested={value}: load it with nested=1 "
            f"(echo 'options {module} nested=1' > /etc/modprobe.d/kvm-nested.conf as root, then "
            f"'modprobe -r {module} && modprobe {module}' with no VM running), or give the box accel='tcg'",
        )
    return NestedSupport(module, f"the host's {module} module runs with nested=1")


def nested_blocker(requested: str) -> str | None:
    """Cheap (no probe boot): why a box asking for ``requested`` accel cannot have nested
    virtualization, where that is known before the accelerator is chosen; else None."""
    if requested == "tcg" or kvm_precheck() is not None:
        return None  # TCG (the accel='kvm' request itself fails where KVM is unusable)
    support = nested_support("kvm")
    return None if support.available else support.why


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
