"""sandlot in a box, on the box's own KVM: the test tier of sandlot's KVM path.

A box with ``nested_virt=True`` gets ``/dev/kvm`` (under TCG, on QEMU's emulated SVM);
its root filesystem is Debian with ``qemu-system-x86`` and ``qemu-utils``
(``roots.kvm_host_root``). Into it go this checkout's sandlot, its C programs prebuilt
(as a wheel ships them), the dependencies it needs from the tests' venv, and the guest
kernel of the tests' home: no network and no compiler are needed inside. There, a
sandlot's accelerator probe finds a usable ``/dev/kvm``, and its boxes run on KVM:
``-accel kvm -cpu host`` and every branch of the engine that only KVM takes.

``python -m tests.support.kvmhost`` boots one and runs ``sandlot doctor`` inside.
"""

from __future__ import annotations

import compileall
import importlib.metadata as metadata
import json
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sandlot
from sandlot import native

from tests.support import roots

REPO = Path(__file__).resolve().parents[2]
SITE = "/opt/sandlot/site"  # sandlot and its dependencies, in the box
HOME = "/root/.local/share/sandlot"  # the inner sandlot's home
BUSYBOX = "/opt/sandlot/busybox"  # a root filesystem for the inner boxes
KVM_GUEST = "/opt/sandlot/kvm_guest"  # the KVM API program (kvm_guest.c), static
# KVM on an emulated CPU is slow to start: QEMU itself runs under TCG, and its probe boot
# (8 s by default) and its boxes' boots (15 s under KVM) get the time a TCG host gives
# (and a claim from a warm pool starts no refiller that would go on beside the tests)
ENV = {"PYTHONPATH": SITE, "PYTHONDONTWRITEBYTECODE": "1", "SANDLOT_KVM_PROBE_TIMEOUT": "120",
       "SANDLOT_BOOT_TIMEOUT": "300", "SANDLOT_POOL_REFILL": "0"}  # fmt: skip
MEMORY_MIB = 2048  # the inner QEMUs and their guests: three 256 MiB boxes and a pool's VM at most


def build_kvm_guest(dest: Path) -> Path:
    """``kvm_guest.c`` built static into ``dest``: a VM of its own on any box's /dev/kvm."""
    source = Path(__file__).parent / "kvm_guest.c"
    subprocess.run(["gcc", "-static", "-O2", "-Wall", "-Werror", "-o", str(dest), str(source)],
                   check=True, capture_output=True)  # fmt: skip
    return dest


def _requirements() -> list[metadata.Distribution]:
    """sandlot's own dependencies (no extras), installed here, and theirs."""
    found: dict[str, metadata.Distribution] = {}

    def walk(requirement: str) -> None:
        if "extra ==" in requirement:
            return
        name = re.split(r"[\s;<>=!\[~(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if name in found:
            return
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return  # a requirement for another Python (its marker is false here)
        found[name] = dist
        for r in dist.requires or []:
            walk(r)

    for r in metadata.requires("sandlot") or []:
        walk(r)
    return list(found.values())


def site_tarball(dest: Path) -> Path:
    """sandlot from this checkout with its C programs prebuilt, and its dependencies'
    files from this venv, as one tar to unpack at SITE (Debian's Python is 3.11 too),
    compiled: every Python the inner sandlot starts (its CLI, its helpers, each script)
    would compile what it imports again under emulation, where that is slow (the box
    writes none: ``ENV``)."""
    work = Path(tempfile.mkdtemp(prefix="kvmhost-", dir=dest.parent))
    try:
        package = work / "sandlot"
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(REPO / "src" / "sandlot", package, ignore=skip)
        cc = native.static_compiler()
        assert cc is not None, "the tests build the agent: a compiler is there"
        native.write_prebuilt(package / native.PREBUILT, package, cc)
        # (checked by hash, not by time: the files' times in the box need not match)
        compileall.compile_dir(
            package, quiet=1, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
        )
        with tarfile.open(dest, "w") as tar:
            tar.add(package, "sandlot")
            for dist in _requirements():  # with the .pyc files pip wrote beside them
                for f in dist.files or []:
                    path = Path(str(f.locate()))
                    if path.is_file() and not str(f).startswith(".."):
                        tar.add(path, str(f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def kernel_tarball(dest: Path) -> Path:
    """The tests' home's pinned guest kernel, as the inner home's ``kernels/``."""
    kernels = sandlot.Runtime.for_home().home / "kernels"
    sandlot.Runtime.for_home().prepare()
    pinned = (kernels / "default").read_text().strip()
    with tarfile.open(dest, "w") as tar:
        tar.add(kernels / "default", "kernels/default")
        tar.add(kernels / pinned, f"kernels/{pinned}")
    return dest


def _unpack(box: sandlot.Box, tarball: Path, where: str) -> None:
    inside = f"/tmp/{tarball.name}"
    box.files.write(inside, tarball.read_bytes())
    script = f"mkdir -p {where} && tar -xf {inside} -C {where} && rm {inside}"
    box.exec("sh", "-c", script, check=True, timeout=300)


def outer_accel() -> str:
    """The outer box's accelerator: this host's own where its boxes may have nested
    virtualization (TCG's emulated SVM always; KVM with the module's ``nested=1``), else
    TCG, whose emulated SVM any host has."""
    report = sandlot.Runtime.for_home().doctor()
    return "auto" if report.get("nested_virt", {}).get("available") else "tcg"


@contextmanager
def kvm_host(**options: Any) -> Iterator[sandlot.Box]:
    """A running box ready to run sandlot on its own KVM (removed at the end)."""
    root = roots.kvm_host_root()
    options.setdefault("accel", outer_accel())
    with tempfile.TemporaryDirectory(prefix="kvmhost-") as tmp, \
            sandlot.Box(rootfs=root, nested_virt=True, memory_mib=MEMORY_MIB, **options) as box:  # fmt: skip
        _unpack(box, site_tarball(Path(tmp) / "site.tar"), SITE)
        _unpack(box, kernel_tarball(Path(tmp) / "kernel.tar"), HOME)
        busybox = Path(tmp) / "busybox.tar"
        with tarfile.open(busybox, "w") as tar:
            tar.add(roots.busybox_root(), ".")
        _unpack(box, busybox, BUSYBOX)
        box.files.write(KVM_GUEST, build_kvm_guest(Path(tmp) / "kvm_guest").read_bytes(), mode=0o755)
        yield box


def run_inner(box: sandlot.Box, script: str, *, timeout: float = 900) -> list[dict[str, Any]]:
    """Run a Python ``script`` with the inner sandlot; the JSON objects it printed, one a
    line. A failure raises AssertionError with the script's output."""
    box.files.write("/tmp/inner.py", script.encode())
    r = box.exec("python3", "/tmp/inner.py", env=ENV, timeout=timeout)
    assert r.exit_code == 0, f"inside the box, exit {r.exit_code}:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def inner_cli(box: sandlot.Box, *args: str, timeout: float = 300) -> sandlot.ExecResult:
    return box.exec("python3", "-m", "sandlot.cli", *args, env=ENV, timeout=timeout)


def main() -> int:
    with kvm_host() as box:
        print(inner_cli(box, "doctor").stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
