"""``engine="auto"``: which engine a box gets on this host, and why.

The order is the issue's: QEMU with KVM where KVM really works (the accelerator's
own probe, which finds a nested PVM ``/dev/kvm`` unusable); else gVisor where
``runsc`` really runs a sandbox; else QEMU under TCG emulation. A box's own
``engine=`` wins, then ``$SANDLOT_ENGINE``, then the default, ``qemu``: auto is
opt-in, since it gives a box a different isolation boundary (a user-space kernel
instead of a VM) and a different feature set depending on the host.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument
from . import engine_for, names
from .base import BootRequest

ENV = "SANDLOT_ENGINE"
AUTO = "auto"
DEFAULT = "qemu"


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str  # a registered engine: what the store records for the box
    reason: str


def choices() -> tuple[str, ...]:
    return (*names(), AUTO)


def requested(engine: str | None) -> str:
    """The engine a box asks for: its own option, else ``$SANDLOT_ENGINE``, else ``qemu``
    (possibly ``auto``, which ``choose`` resolves). InvalidArgument names the choices."""
    if engine is not None and not isinstance(engine, str):
        raise InvalidArgument(f"engine must be a string, one of {', '.join(choices())}, not {engine!r}")
    source = ""
    if engine is None:
        engine, source = os.environ.get(ENV) or DEFAULT, f" (from ${ENV})" if os.environ.get(ENV) else ""
    if engine not in choices():
        raise InvalidArgument(f"engine must be one of {', '.join(choices())}, not {engine!r}{source}")
    return engine


def kvm_works(home: Path) -> tuple[bool, str]:
    """(KVM usable, why): the QEMU engine's accelerator choice, probe boot included
    (cached per host boot), asked only where the cheap precheck passes."""
    from .qemu.accel import kvm_precheck

    blocker = kvm_precheck()
    if blocker is not None:
        return False, blocker
    try:
        boot = engine_for("qemu", home).prepare(BootRequest())
    except Exception as exc:  # QEMU or its kernel missing: no KVM box either
        return False, f"QEMU cannot boot here: {exc}"
    return boot.accel == "kvm", boot.accel_reason


def gvisor_works(home: Path) -> tuple[bool, str]:
    from .gvisor.probe import why_unusable

    why = why_unusable(home)
    return why is None, why or "runsc ran a probe sandbox"


Probe = Callable[[Path], tuple[bool, str]]


def choose(home: Path, *, kvm: Probe = kvm_works, gvisor: Probe = gvisor_works) -> EngineChoice:
    """What ``engine="auto"`` gives a box on this host. Blocking (a probe boot or sandbox
    the first time per host boot; cached after that)."""
    has_kvm, kvm_why = kvm(home)
    if has_kvm:
        return EngineChoice("qemu", f"QEMU with KVM (hardware isolation): {kvm_why}")
    has_gvisor, gvisor_why = gvisor(home)
    if has_gvisor:
        return EngineChoice(
            "gvisor",
            f"gVisor (a user-space kernel, not hardware isolation), because KVM is unusable: {kvm_why}",
        )
    return EngineChoice(
        "qemu",
        f"QEMU under TCG emulation (slow), because KVM is unusable ({kvm_why}) "
        f"and so is gVisor ({gvisor_why})",
    )
