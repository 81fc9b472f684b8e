"""The guest agent (static C): the wheel's prebuilt binary, or built from the
sources shipped in this package.

A build is cached under ``$SANDLOT_HOME/agent/<kind>-<hash>/`` (``config.build_c``).
``musl-gcc`` (Debian: musl-tools) gives a ~130 KB binary; ``gcc -static`` works too.
What the program is, and where a prebuilt one comes from: ``sandlot.native``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..config import build_c, sha256_file
from ..errors import HostSetupError
from ..native import AGENT, PACKAGE, prebuilt, static_compiler

SANITIZE_FLAGS = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined")


@dataclass(frozen=True, slots=True)
class AgentBuild:
    path: Path
    digest: str
    compiler: str


def source_dir() -> Path:
    return PACKAGE / AGENT.folder


def _sources() -> list[Path]:
    files = AGENT.sources()
    if not any(f.suffix == ".c" for f in files):
        raise HostSetupError(f"agent sources are missing from {source_dir()}")
    return files


def _compiler_for(kind: str) -> list[str]:
    if kind == "guest":
        cc = static_compiler()
        if cc is None:
            raise HostSetupError(
                "building the guest agent needs a C compiler: install musl-tools (preferred) or gcc"
            )
        return cc
    if shutil.which("gcc"):
        return ["gcc"]
    raise HostSetupError("building the host agent needs gcc")


def build_agent(home: Path, *, kind: str = "guest") -> AgentBuild:
    """The agent: the wheel's prebuilt one where it has one (``kind="guest"``), else
    built (or reused). ``kind``: "guest" (static, for /init), "host" (for tests on the
    host) or "sanitize" (host, ASan+UBSan, for fuzzing)."""
    if kind not in ("guest", "host", "sanitize"):
        raise ValueError(f"unknown agent build kind {kind!r}")
    shipped = prebuilt(AGENT) if kind == "guest" else None
    if shipped is not None:
        return AgentBuild(shipped, sha256_file(shipped)[:16], "prebuilt")
    cc = _compiler_for(kind)
    flags = [*AGENT.flags, *(SANITIZE_FLAGS if kind == "sanitize" else ())]
    binary, digest = build_c(home / "agent" / kind, AGENT.name, _sources(), cc, flags)
    return AgentBuild(binary, digest, cc[0])
