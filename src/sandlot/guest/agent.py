"""Build the guest agent (static C) from the sources shipped in this package.

The build is cached under ``$SANDLOT_HOME/agent/<kind>-<hash>/`` (``config.build_c``).
``musl-gcc`` (Debian: musl-tools) gives a
~130 KB binary; ``gcc -static`` works too.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..config import build_c
from ..errors import HostSetupError

CFLAGS = ["-std=gnu11", "-Os", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing"]
SANITIZE_FLAGS = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


@dataclass(frozen=True, slots=True)
class AgentBuild:
    path: Path
    digest: str
    compiler: str


def source_dir() -> Path:
    return Path(str(resources.files("sandlot.guest") / "agent"))


def _sources() -> list[Path]:
    src = source_dir()
    files = sorted([*src.glob("*.c"), *src.glob("*.h")])
    if not any(f.suffix == ".c" for f in files):
        raise HostSetupError(f"agent sources are missing from {src}")
    return files


def _compiler_for(kind: str) -> list[str]:
    if kind == "guest":
        if shutil.which("musl-gcc"):
            return ["musl-gcc", "-static"]
        if shutil.which("gcc"):
            return ["gcc", "-static"]
        raise HostSetupError(
            "building the guest agent needs a C compiler: install musl-tools (preferred) or gcc"
        )
    if shutil.which("gcc"):
        return ["gcc"]
    raise HostSetupError("building the host agent needs gcc")


def build_agent(home: Path, *, kind: str = "guest") -> AgentBuild:
    """Build (or reuse) the agent. ``kind``: "guest" (static, for /init),
    "host" (for tests on the host) or "sanitize" (host, ASan+UBSan, for fuzzing)."""
    if kind not in ("guest", "host", "sanitize"):
        raise ValueError(f"unknown agent build kind {kind!r}")
    cc = _compiler_for(kind)
    flags = CFLAGS + (SANITIZE_FLAGS if kind == "sanitize" else [])
    binary, digest = build_c(home / "agent" / kind, "sandlot-agent", _sources(), cc, flags)
    return AgentBuild(binary, digest, cc[0])
