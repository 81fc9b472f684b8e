"""The host packages sandlot runs on, and installing them (``sandlot setup``).

A wheel brings sandlot's own programs (the agent and the egress relay, prebuilt);
what it cannot bring are the distro's: QEMU, qemu-img, the ext4 tools, the
decompressors of the distro kernel, and optionally gVisor's ``runsc``. They are
declared here once, by the commands that show each package is there, so that
``sandlot setup`` can say exactly what is missing and why, and install it with apt
where it may (as root, or with a sudo that asks no password).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import HostSetupError

SBIN = ("/usr/sbin", "/sbin")  # mkfs.ext4 and debugfs live there, often off a user's PATH
APT_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class HostPackage:
    name: str  # the Debian/Ubuntu package
    commands: tuple[str, ...]  # each must be found for the package to count as there
    needed_for: str
    required: bool
    override: str = ""  # an environment variable that names the binary instead

    def present(self) -> bool:
        if self.override and os.environ.get(self.override):
            return True
        return all(which(c) for c in self.commands)


PACKAGES: tuple[HostPackage, ...] = (
    HostPackage("qemu-system-x86", ("qemu-system-x86_64",), "running boxes", True, "SANDLOT_QEMU"),
    HostPackage("qemu-utils", ("qemu-img",), "qcow2 box disks", True),
    HostPackage("e2fsprogs", ("mkfs.ext4", "debugfs"), "ext4 image disks", True),
    HostPackage("zstd", ("zstd",), "the distro kernel's zstd modules", True),
    HostPackage("lz4", ("lz4",), "lz4-compressed kernels", True),
    HostPackage("runsc", ("runsc",), "the gVisor engine, as root", False, "SANDLOT_RUNSC"),
    HostPackage("fuse2fs", ("fuse2fs",), "gVisor: disk volumes, served by a user-space ext4", False),
    HostPackage("iptables", ("iptables",), "gVisor: network='open'; saves checking closed TCP", False),
    HostPackage("mmdebstrap", ("mmdebstrap",), "sandlot rootfs debian", False),
    HostPackage("busybox-static", ("busybox",), "sandlot rootfs busybox", False),
    HostPackage("musl-tools", ("musl-gcc",), "building the agent from source", False),
)


def which(command: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN])
    return shutil.which(command, path=path)


def missing(*, optional: bool = False) -> list[HostPackage]:
    """The required packages that are not there (and the optional ones, if asked)."""
    return [p for p in PACKAGES if (p.required or optional) and not p.present()]


def _as_root() -> list[str] | None:
    """How to run apt as root here: [] as root, sudo where it asks no password, else None."""
    if os.geteuid() == 0:
        return []
    if which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


def install_command(packages: Sequence[str]) -> str:
    """What a user types to install ``packages``."""
    sudo = "" if os.geteuid() == 0 else "sudo "
    return f"{sudo}apt-get update && {sudo}apt-get install -y --no-install-recommends {' '.join(packages)}"


def can_install() -> bool:
    return which("apt-get") is not None and _as_root() is not None


def _apt(argv: list[str]) -> None:
    prefix = _as_root()
    if prefix is None or which("apt-get") is None:
        raise HostSetupError(f"cannot run apt-get as root here: run `{install_command([])}` yourself")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        proc = subprocess.run([*prefix, "apt-get", *argv], capture_output=True, text=True, env=env,
                              timeout=APT_TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise HostSetupError(f"apt-get {argv[0]} took over {APT_TIMEOUT:.0f} s") from exc
    if proc.returncode != 0:
        raise HostSetupError(f"apt-get {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")


def apt_knows(package: str) -> bool:
    """Whether apt's package lists have ``package`` (the guest kernel is fetched with
    ``apt-get download``, never installed)."""
    if which("apt-cache") is None:
        return False
    return subprocess.run(["apt-cache", "show", package], capture_output=True).returncode == 0


def install(packages: Sequence[str]) -> None:
    """``apt-get update`` and install ``packages``; HostSetupError with apt's words."""
    _apt(["update", "-qq"])
    if packages:
        _apt(["install", "-y", "-qq", "--no-install-recommends", *packages])
