"""What the VM tier's three runs share, made once before they start side by side
(``scripts/test``): the root filesystems and the test image built from the host's
packages (the KVM host's, the desktop's and the containers' among them: mmdebstrap, a few minutes the
first time), and
each home's guest kernel, agent and initramfs. Built lazily, as they otherwise are,
runs could race to write the same cache. And what earlier runs left in the homes
that no box needs: the snapshots of removed boxes (by design, a removal keeps its
box's snapshots), then the base disks of removed images and of the root directories
that tests made and no box started from in the last hours (by design, a base is the
cache of the next box from the same root). A runner's home can be new, but one kept
from run to run grew by about 20 GB a day of runs, and a run on a host with little
disk left then failed with ENOSPC.

    .venv/bin/python -m tests.support.warm HOME [HOME...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import sandlot

from tests.support import roots
from tests.support.images import python_layout

# The shared roots' bases are used by every run, so they stay; a root of one test's own
# is new in each run, so its base is left behind by the run before.
BASES_KEPT_FOR = 6 * 3600


def main(homes: list[str]) -> int:
    debian = roots.debian_root()
    roots.busybox_root()
    roots.kvm_host_root()
    roots.desktop_root()
    roots.containers_root()
    roots.jupyter_root()  # (two runs use it: built here, not by both at once)
    python_layout(roots.CACHE, debian)
    for home in homes:
        sandlot.Runtime.for_home(Path(home)).prepare()
        pruned = sandlot.prune_snapshots(home=home)
        report = sandlot.prune_images(home=home, unused_for=BASES_KEPT_FOR)
        if pruned or report.bases_removed:
            print(f"{home}: {len(pruned)} snapshots of removed boxes and {report.bases_removed} unused"
                  f" base disks pruned, {report.bytes_freed >> 20} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
