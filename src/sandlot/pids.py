"""Process identity on Linux: a pid plus its start time names one process, so a
recorded pid that was reused by something else is never mistaken for ours."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

PF_KTHREAD = 0x00200000  # include/linux/sched.h: a kernel thread


def start_time(pid: int | None) -> str | None:
    """Start time in clock ticks since boot, or None if there is no such process."""
    if not pid or pid <= 0:
        return None
    fields = stat_fields(pid)
    if fields is None:
        return None
    if fields[0] == "Z" and not _threads_exiting(pid):  # a zombie is gone for our purposes
        return None
    return fields[19]


def _threads_exiting(pid: int) -> bool:
    """Whether a zombie's other threads still run their exit. A killed multithreaded
    process (QEMU) shows its leader as a zombie while the others tear its memory down
    and hold its files, so its locks too (a disk image's: the next QEMU on it failed
    with "Failed to get write lock" after a kill -9)."""
    try:
        return any(t != str(pid) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return False


def alive(pid: int | None, recorded_start: str | None) -> bool:
    return pid is not None and recorded_start is not None and start_time(pid) == recorded_start


def alive_as(pid: int | None, recorded_start: str | None, marker: str) -> bool:
    """Whether that process lives and is the one whose command line names ``marker``
    (a box's VM, by the box's id). A process of ours reads no command line at both ends
    of its life, and is still ours then:
    - killed, it loses it the moment its leader lets go of its memory, tens of
      milliseconds before its last thread ends and lets go of its files (a disk
      image's lock);
    - starting, its execve closes the pipe that tells its parent the exec went well
      before it lays out its arguments (seen here under load, right after ``Popen``).
    A kernel thread, the other kind without one, is never ours."""
    if pid is None or not alive(pid, recorded_start):
        return False
    argv = cmdline(pid)
    return any(marker in arg for arg in argv) or (not any(argv) and not kernel_thread(pid))


def kernel_thread(pid: int) -> bool:
    """Whether ``pid`` is a kernel thread (or gone)."""
    fields = stat_fields(pid)
    return fields is None or bool(int(fields[6]) & PF_KTHREAD)


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold spaces and
    parentheses): the state first; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def wait_gone(pid: int, recorded_start: str, timeout: float) -> bool:
    """Wait until that process has ended (a zombie has), ``timeout`` seconds at most;
    whether it has. A SIGKILLed process tears its memory down before it is gone: a
    moment for a VM of gigabytes, longer on a loaded host."""
    deadline = time.monotonic() + timeout
    while alive(pid, recorded_start):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


_me: tuple[int, str] = (0, "")


def me() -> tuple[int, str]:
    """This process's pid and start time: read once per process (a fork's child reads
    its own), as every change of a box's state records it."""
    global _me
    pid = os.getpid()
    if _me[0] != pid:
        _me = (pid, start_time(pid) or "")
    return _me


def age(start: str) -> float | None:
    """Seconds since a process started, from its start time (``start_time``); None if unknown."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(start) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none if it is gone), whichever of its threads
    started them (a Go program forks from any)."""
    out = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                out += [int(c) for c in Path(task.path, "children").read_text().split()]
    except OSError:
        pass
    return out


@dataclass(frozen=True, slots=True)
class VMRef:
    """Names one VM process across processes: a pid plus its start time, so a
    recycled pid is never taken for the VM."""

    pid: int
    start: str


def vm_alive(ref: VMRef | None, box_id: str) -> bool:
    """Whether ``ref`` still names the VM of ``box_id``: the process lives and its command
    line names the box (each engine's ``alive``; the store's quick listing asks it too)."""
    return ref is not None and alive_as(ref.pid, ref.start, box_id)


class Process(NamedTuple):
    """A live process: its pid, its start time (``start_time``) and its command line."""

    pid: int
    start: str
    argv: list[str]


def processes() -> Iterator[Process]:
    """The live processes this one may take for its own, each with its command line:
    this user's, in this mount namespace (a path on the command line of a process in
    another one, a container's, names another file), other than this process."""
    uid, me = os.getuid(), os.getpid()
    try:
        ns = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid or os.readlink(f"/proc/{pid}/ns/mnt") != ns:
                continue
        except OSError:  # gone meanwhile, or not ours to look into
            continue
        argv, start = cmdline(pid), start_time(pid)
        if start is not None and any(argv):  # a kernel thread has no command line
            yield Process(pid, start, argv)
