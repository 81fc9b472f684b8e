"""Address-space randomization of a box's processes (``aslr``): on by default; off on
request, on every HELLO, so that a box restored, forked or started from a template saved
with the other setting has its own. Under TCG, off is what makes a dynamically linked
program start fast (QEMU 7.2 translates guest code per virtual address); these tests
check what the guest kernel does, not its speed (benchmarks/core.py has the figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

import sandlot

from tests.support.names import unique

pytestmark = pytest.mark.vm

SETTING = "/proc/sys/kernel/randomize_va_space"


def libc_bases(box: sandlot.Box, n: int = 3) -> set[str]:
    """Where libc lands in ``n`` new processes."""
    return {box.sh("grep -m1 'libc.so' /proc/self/maps | cut -d- -f1").stdout.strip() for _ in range(n)}


def setting(box: sandlot.Box) -> str:
    return box.files.read_text(SETTING).strip()


def test_aslr_off_holds_across_a_fork_and_a_template_and_on_comes_back(debian_root: Path) -> None:
    with sandlot.Box(rootfs=debian_root, memory_mib=512, aslr=False) as box:
        assert setting(box) == "0" and len(libc_bases(box)) == 1  # every process alike
        assert box.inspect()["options"]["aslr"] is False
        [child] = box.fork(1)
        try:
            assert setting(child) == "0" and child.inspect()["options"]["aslr"] is False  # the same box
        finally:
            child.remove(force=True)
    tmpl = sandlot.template(rootfs=debian_root, memory_mib=512, aslr=False, name=unique("no-aslr"))
    try:
        with sandlot.Box(template=tmpl) as box:  # as the template was saved
            assert setting(box) == "0"
        with sandlot.Box(template=tmpl, aslr=True) as box:  # given anew: its HELLO turns it on
            assert setting(box) == "2" and len(libc_bases(box)) == 3
    finally:
        tmpl.remove()
    with sandlot.Box(rootfs=debian_root, memory_mib=512) as box:
        assert setting(box) == "2"
