"""Every example runs as documented (so none rots): each must exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

EXAMPLES = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.py") if not p.name.startswith("_")
)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, cwd=path.parent
    )
    assert r.returncode == 0, f"{path.name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
