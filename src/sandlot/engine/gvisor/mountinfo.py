"""What the host has mounted where (``/proc/self/mountinfo``)."""

from __future__ import annotations

from pathlib import Path


def is_mounted(path: Path) -> bool:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    target = str(path)
    return any(len(f := line.split()) > 4 and f[4] == target for line in text.splitlines())
