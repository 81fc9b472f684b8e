"""Every example runs as documented (so none rots): each must exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

HERE = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))
STEPS = {"durable": [["create"], ["use"], ["remove"]]}  # run in steps, as its docstring says


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    for args in STEPS.get(path.stem, [[]]):
        argv = [sys.executable, str(path), *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=HERE)
        assert r.returncode == 0, f"{path.name} {args}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
