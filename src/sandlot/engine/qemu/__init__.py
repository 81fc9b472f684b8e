"""QEMU ``microvm`` with the distro's cloud kernel: KVM when it really works, TCG otherwise."""

from .engine import QemuEngine

__all__ = ["QemuEngine"]
