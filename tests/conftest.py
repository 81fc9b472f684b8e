"""Shared fixtures: test root filesystems (built from Debian packages and cached
between runs), a sandlot home reused across runs, and booted boxes shared by
the tests of a module where that keeps the tests honest (each test leaves the
box as it found it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.support import roots
from tests.support.roots import CACHE

# Kernel, agent and base disks are reused between runs; boxes are per test.
os.environ.setdefault("SANDLOT_HOME", str(CACHE / "home"))

# The engine of the shared boxes (bb_box, py_box): the API suites that use them run
# on gVisor with SANDLOT_TEST_ENGINE=gvisor, unchanged.
TEST_ENGINE = os.environ.get("SANDLOT_TEST_ENGINE", "qemu")


@pytest.fixture(scope="session")
def busybox_root() -> Path:
    return roots.busybox_root()


@pytest.fixture(scope="session")
def debian_root() -> Path:
    """Debian bookworm minbase with python3 (mmdebstrap; about 20 s the first time)."""
    return roots.debian_root()


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a certificate for 'localhost' signed by it (openssl)."""
    d = tmp_path_factory.mktemp("ca")

    def ssl_(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl_("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=sandlot test CA")  # fmt: skip
    ssl_("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=localhost")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost\n")
    ssl_("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return d


@pytest.fixture(scope="module")
def bb_box(busybox_root: Path) -> Iterator[sandlot.Box]:
    """A booted busybox box shared by the tests of one module."""
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, engine=TEST_ENGINE) as box:
        yield box


@pytest.fixture(scope="module")
def py_box(debian_root: Path) -> Iterator[sandlot.Box]:
    """A booted Debian box with python3, shared by the tests of one module."""
    with sandlot.Box(rootfs=debian_root, memory_mib=512, engine=TEST_ENGINE) as box:
        yield box


@pytest.fixture
def other_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A second sandlot home, as on another machine (the kernel is copied, not fetched)."""
    home = Path.home() / ".cache" / "sandlot-tests" / f"other-home-{os.urandom(3).hex()}"
    sandlot.Runtime.for_home().prepare()  # the kernel is fetched once, into the tests' home
    src = sandlot.Runtime.for_home().home / "kernels"
    shutil.copytree(src, home / "kernels", symlinks=True)
    yield home
    for b in sandlot.list(home=home):
        b.remove(force=True)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def hub_mirror(tmp_path_factory: pytest.TempPathFactory, debian_root: Path) -> Iterator[str]:
    """A registry on 127.0.0.1 that stands in for Docker Hub: ``python:3.12-slim`` is the
    Debian + python3 test image. Set ``SANDLOT_REGISTRY_MIRRORS=docker.io=<this>`` and the
    docs' and README's examples run as written, with nothing fetched from the internet."""
    from tests.support.images import python_layout
    from tests.support.registry import run_registry

    with run_registry(tmp_path_factory.mktemp("hub")) as reg:
        reg.push(python_layout(CACHE, debian_root), "test/python:3", "library/python:3.12-slim")
        yield reg.host
