"""What the VM tier's two runs share, made once before they start side by side
(``scripts/test``): the root filesystems and the test image built from the host's
packages (the KVM host's among them: mmdebstrap, about a minute the first time), and
each home's guest kernel, agent and initramfs. Built lazily, as they otherwise are,
two runs could race to write the same cache.

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
    python_layout(roots.CACHE, debian)
    for home in homes:
        sandlot.Runtime.for_home(Path(home)).prepare()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
