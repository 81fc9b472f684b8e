"""Fixtures of the unit tests that run boxes on the fake engine; and the default home
of the fast tier: one of each worker's own, never the home the VM tier, the
benchmarks or another checkout on this machine use (a newer sandlot's schema there
failed the tests that open the default home's store). Its guest kernel, agent and
initramfs are the shared cache's (linked, so nothing is fetched or built twice)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_engine import fake_rootfs
from tests.support.roots import CACHE


@pytest.fixture(scope="session")
def unit_home() -> Iterator[Path]:
    shared = CACHE / "home"
    home = Path(tempfile.mkdtemp(prefix="sandlot-unit-home-"))
    for d in ("kernels", "agent", "initramfs"):
        (shared / d).mkdir(parents=True, exist_ok=True)
        (home / d).symlink_to(shared / d)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(autouse=True)
def _default_home(unit_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set for each unit test, and only for them: a run of tests/unit and tests/vm
    together keeps the VM tests' home."""
    monkeypatch.setenv("SANDLOT_HOME", str(unit_home))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A sandlot home of the test's own."""
    return tmp_path / "home"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root file system directory the fake engine boots."""
    return fake_rootfs(tmp_path)
