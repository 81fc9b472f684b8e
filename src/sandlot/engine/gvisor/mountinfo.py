"""What the host has mounted where (``/proc/self/mountinfo``), and unmounting it."""

from __future__ import annotations

import ctypes
from pathlib import Path

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def is_mounted(path: Path) -> bool:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    target = str(path)
    return any(len(f := line.split()) > 4 and f[4] == target for line in text.splitlines())


def unmount(path: Path, *, lazy: bool = True) -> None:
    """Unmount whatever is mounted at ``path``. ``lazy=False`` tries a plain unmount
    first, which returns once a FUSE server has been told to end (its data written back
    as it does); a mount still in use is then detached, and ends with its last user."""
    while is_mounted(path):
        if _libc.umount2(str(path).encode(), MNT_DETACH if lazy else 0) != 0:
            if lazy:
                return
            lazy = True
