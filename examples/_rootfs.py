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
