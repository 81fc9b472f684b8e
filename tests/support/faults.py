"""Faults injected into the agent built for the host (``hostagent.spawn(env=...)``), by
an LD_PRELOAD library (``faults/faults.c``): a readdir() that fails part-way, and
allocations that fail from a moment the test chooses. The agent has no hook of its
own for them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sandlot.config import default_home

SOURCE = Path(__file__).with_name("faults") / "faults.c"


def library() -> Path:
    """The shim, built once per change of its source."""
    out = default_home() / "agent" / "faults" / f"faults-{int(SOURCE.stat().st_mtime_ns)}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # a name of this process's own: the unit tests' workers may build it at once, and
        # each publishes a whole library under the one name (a rename replaces atomically)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(tmp), str(SOURCE), "-ldl"], check=True)
        tmp.rename(out)
    return out


def readdir_fails(name: str) -> dict[str, str]:
    """The environment under which readdir() of a directory whose path holds ``name``
    fails with EIO after two entries."""
    return {"LD_PRELOAD": str(library()), "SANDLOT_FAULT_READDIR": name}


def allocations_fail(at_least: int, armed: Path) -> dict[str, str]:
    """The environment under which every allocation of ``at_least`` bytes or more fails
    once the file ``armed`` exists."""
    return {"LD_PRELOAD": str(library()), "SANDLOT_FAULT_MALLOC": str(at_least),
            "SANDLOT_FAULT_ARMED": str(armed)}  # fmt: skip
