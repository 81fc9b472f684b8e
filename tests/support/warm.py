"""What the VM tier's three runs share, made once before they start side by side
(``scripts/test``): the root filesystems and the test image built from the host's
packages (the KVM host's and the desktop's among them: mmdebstrap, a few minutes the first time), and
each home's guest kernel, agent and initramfs. Built lazily, as they otherwise are,
runs could race to write the same cache. And the snapshots no box needs, which
removed boxes leave in the homes (by design, a removal keeps its box's snapshots): a
runner's home is new, but a developer's grew by about 20 GB a day of runs.

    .venv/bin/python -m tests.support.warm HOME [HOME...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import sandlot

from tests.support import roots
from tests.support.images import python_layout


def main(homes: list[str]) -> int:
    debian = roots.debian_root()
    roots.busybox_root()
    roots.kvm_host_root()
    roots.desktop_root()
    python_layout(roots.CACHE, debian)
    for home in homes:
        sandlot.Runtime.for_home(Path(home)).prepare()
        pruned = sandlot.prune_snapshots(home=home)
        if pruned:
            print(f"{home}: {len(pruned)} snapshots of removed boxes pruned")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
