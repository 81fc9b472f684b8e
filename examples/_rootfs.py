"""Pick the root filesystem for the examples: argv[1], or a busybox one built
from the host's busybox-static (cached in ~/.cache/sandlot-examples)."""

from __future__ import annotations

import sys
from pathlib import Path

from sandlot.images.builders import busybox_rootfs


def rootfs() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    dest = Path.home() / ".cache" / "sandlot-examples" / "busybox"
    if not (dest / "bin" / "busybox").exists():
        busybox_rootfs(dest)
    return dest
