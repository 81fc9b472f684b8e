"""The ``runsc`` binary: where it is, its version and platform, and its commands.

Debian bookworm's package is 0.0~20221219 (ptrace only; systrap came in 2023).
A newer ``runsc`` on the PATH, or ``$SANDLOT_RUNSC``, is used where the host has one.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

from ...config import runtime_dir
from ...errors import HostSetupError

# runsc keeps one directory of container states: every process of every home must
# see the same one, since a container is found again by its id from anywhere.
STATE_ROOT_NAME = "runsc"


def runsc_binary() -> str:
    found = os.environ.get("SANDLOT_RUNSC") or shutil.which("runsc") or "/usr/bin/runsc"
    if not os.access(found, os.X_OK):
        raise HostSetupError("runsc not found: install it (apt-get install runsc) for engine='gvisor'")
    return found


@functools.lru_cache(maxsize=4)
def _version_of(binary: str) -> str:
    proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    first = (proc.stdout or proc.stderr).splitlines()[:1]
    m = re.search(r"runsc version (\S+)", first[0] if first else "")
    return m.group(1) if m else (first[0].strip() if first else "unknown")


def runsc_version(binary: str | None = None) -> str:
    return _version_of(binary or runsc_binary())


def release_date(version: str) -> int:
    """The release a version string names, as YYYYMMDD (0 where it does not say)."""
    m = re.search(r"(20\d{6})", version)
    return int(m.group(1)) if m else 0


def platform_for(version: str) -> str:
    """systrap where the release has it (mid-2023 on), else ptrace: neither needs KVM."""
    return "systrap" if release_date(version) >= 20230601 else "ptrace"


def state_root() -> Path:
    return runtime_dir() / STATE_ROOT_NAME


def global_flags(platform: str, log: Path | None = None, *, network: bool = False) -> list[str]:
    """Flags every runsc command of a container needs (they must agree across its commands).
    ``network``: the sandbox's netstack takes the card of the box's namespace."""
    net = "sandbox" if network else "none"
    flags = [f"--root={state_root()}", f"--platform={platform}", f"--network={net}"]
    if log is not None:
        flags.append(f"--log={log}")
    return flags


def run(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def require_root() -> None:
    """runsc needs root here: it mounts the box's overlay and makes the host cgroups."""
    if os.geteuid() != 0:
        raise HostSetupError(
            "engine='gvisor' needs root on this host: the box's root is a host overlay mount and its "
            "limits are host cgroups; runsc --rootless has neither (run as root, or use engine='qemu')"
        )


REASON_LIMIT = 600


def reason(stderr: str) -> str:
    """What a failed runsc command said, short enough to read: its own refusals can
    dump a whole kernel object (a checkpoint of an unsavable socket prints tens of KB),
    so a long message is cut to the part that says why."""
    text = stderr.strip()
    if len(text) <= REASON_LIMIT:
        return text
    for marker in ("save rejected", "error:", "failed:"):
        at = text.rfind(marker)
        if at >= 0:
            return "… " + text[at : at + REASON_LIMIT].splitlines()[0]
    return text[:REASON_LIMIT] + " …"
