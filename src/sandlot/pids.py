"""Process identity on Linux: a pid plus its start time names one process, so a
recorded pid that was reused by something else is never mistaken for ours."""

from __future__ import annotations

from pathlib import Path


def start_time(pid: int | None) -> str | None:
    """Start time in clock ticks since boot, or None if there is no such process."""
    if not pid or pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is gone for our purposes
        return None
    return fields[19]


def alive(pid: int | None, recorded_start: str | None) -> bool:
    return pid is not None and recorded_start is not None and start_time(pid) == recorded_start


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def me() -> tuple[int, str]:
    import os

    pid = os.getpid()
    return pid, start_time(pid) or ""
