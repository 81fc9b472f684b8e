"""Root filesystems the tests and benchmarks boot, built from the host's Debian
packages (no registry needed) and cached between runs."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from sandlot.images.builders import (
    DOCKER_PACKAGES,
    PODMAN_PACKAGES,
    busybox_rootfs,
    containers_rootfs,
    debian_rootfs,
    desktop_files_digest,
    desktop_rootfs,
    install_desktop,
)

CACHE = Path(os.environ.get("SANDLOT_TEST_CACHE", Path.home() / ".cache" / "sandlot-tests"))


# E2B's code-interpreter template's IPython startup file for images, in our words (its
# ``template/startup_scripts/0003_images.py``): an image saved to a path is shown as a
# result too. sandlot's kernel runs an image's startup files as IPython does
# (scripts/e2b_sdk_tests.py's template, tests/vm/test_interpreter.py).
IMAGES_STARTUP = """\
from IPython.display import display
from PIL.Image import Image

_saved = Image.save


def save(image, fp, format=None, **params):
    if isinstance(fp, str):
        display(image)
    return _saved(image, fp, format, **params)


Image.save = save
"""


def _stamp(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def busybox_root() -> Path:
    """A busybox-static root filesystem (rebuilt when the host's busybox changes)."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    dest = CACHE / f"rootfs-busybox-{_stamp(str(os.stat(busybox).st_mtime_ns), 'v2')}"
    if not (dest / "bin" / "busybox").exists():
        busybox_rootfs(dest)
    return dest


def debian_root() -> Path:
    """Debian bookworm minbase with python3 (mmdebstrap; about 20 s the first time)."""
    dest = CACHE / "rootfs-debian-python3-v1"
    if not (dest / "usr" / "bin" / "python3").exists():
        debian_rootfs(dest, ["python3"])
    return dest


def jupyter_root() -> Path:
    """Debian with python3, Debian's Jupyter kernel (python3-ipykernel), matplotlib and
    pandas, and Node.js with TypeScript (sandlot's JavaScript and TypeScript kernels), without
    recommended packages (mmdebstrap; a few minutes the first time). python3-munkres
    stands in for scipy, which fontTools would otherwise pull in with a C++ compiler."""
    dest = CACHE / "rootfs-debian-jupyter-v2"
    if not (dest / "usr" / "share" / "jupyter" / "kernels" / "python3" / "kernel.json").exists():
        packages = ["python3", "python3-ipykernel", "python3-matplotlib", "python3-pandas", "python3-munkres",
                    "nodejs", "node-typescript"]  # fmt: skip
        debian_rootfs(dest, packages, recommends=False)
    return dest


def kvm_host_root() -> Path:
    """Debian with python3, QEMU (qemu-system-x86), qemu-img, zstd and lz4, without recommended
    packages: a box that runs sandlot on its own KVM (tests/support/kvmhost.py)."""
    dest = CACHE / "rootfs-debian-kvmhost-v2"
    if not (dest / "usr" / "bin" / "qemu-system-x86_64").exists():
        # what `sandlot setup` installs on a host (hostsetup.PACKAGES' required ones)
        packages = ["python3", "qemu-system-x86", "qemu-utils", "e2fsprogs", "zstd", "lz4"]
        debian_rootfs(dest, packages, recommends=False)
    return dest


def containers_root() -> Path:
    """Debian with both container engines: Docker with Compose, and Podman
    (``builders.containers_rootfs``; mmdebstrap, about a minute the first time)."""
    dest = CACHE / "rootfs-debian-containers-v2"
    if not (dest / "usr" / "bin" / "podman").exists() or not (dest / "usr" / "sbin" / "dockerd").exists():
        containers_rootfs(dest, [*DOCKER_PACKAGES, *PODMAN_PACKAGES])
    return dest


def desktop_root() -> Path:
    """Debian with sandlot's desktop (``builders.desktop_rootfs``: Xvnc, openbox, Chromium;
    mmdebstrap, about two minutes the first time). sandlot's own files in it are put in
    again when they change, without building the packages again."""
    dest = CACHE / "rootfs-desktop-v4"
    if not (dest / "usr" / "bin" / "Xtigervnc").exists():  # (Xvnc is a link through /etc/alternatives)
        desktop_rootfs(dest)
    stamp = dest / "usr" / "share" / "sandlot-desktop" / "files.digest"
    digest = desktop_files_digest()
    if not stamp.exists() or stamp.read_text() != digest:
        install_desktop(dest)
        stamp.write_text(digest)
    return dest
