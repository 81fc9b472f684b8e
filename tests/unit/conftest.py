"""Fixtures of the unit tests that run boxes on the fake engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fake_engine import fake_rootfs


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A sandlot home of the test's own."""
    return tmp_path / "home"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root file system directory the fake engine boots."""
    return fake_rootfs(tmp_path)
