"""Pick the root filesystem for the examples: argv[1], or a busybox one built
from the host's busybox-static (cached in ~/.cache/sandlot-examples)."""

from __future__ import annotations

import sys
from pathlib import Path

from sandlot.images.builders import busybox_rootfs


def rootfs(arg: int = 1) -> Path:
    """``sys.argv[arg]`` if given, else the cached busybox root filesystem."""
    if len(sys.argv) > arg:
        return Path(sys.argv[arg])
    dest = Path.home() / ".cache" / "sandlot-examples" / "busybox"
    if not (dest / "bin" / "busybox").exists():
        busybox_rootfs(dest)
    return dest


def python_rootfs(arg: int = 1) -> Path:
    """``sys.argv[arg]`` if given, else a cached Debian root filesystem with python3
    (made with mmdebstrap the first time, about 20 s)."""
    from sandlot.images.builders import debian_rootfs

    if len(sys.argv) > arg:
        return Path(sys.argv[arg])
    dest = Path.home() / ".cache" / "sandlot-examples" / "debian-python3"
    if not (dest / "usr" / "bin" / "python3").exists():
        debian_rootfs(dest, ["python3"])
    return dest
