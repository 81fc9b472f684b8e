"""A syscall filter that keeps a QEMU process from punching holes in files.

Why: a VM restored from a saved state's memory file (a fork, a template's box, a
pool's VM, an image's box) maps that file copy-on-write, and every box of the state
maps the same file. When its guest reports free pages (the virtio balloon's free page
reporting), QEMU 7.2 discards them with ``fallocate(FALLOC_FL_PUNCH_HOLE)`` on the
file whatever the mapping (``ram_block_discard_range``; QEMU 8.2 stopped doing so for
private mappings): the shared file loses those pages, and every other box that maps
it, and every box started from the state later, reads zeros there. One guest freeing
memory could so corrupt the memory of other boxes, other users' included.

The filter makes a punch a no-op that succeeds. QEMU then only drops the VM's own
copies of the freed pages (``madvise(MADV_DONTNEED)``), as QEMU 8.2 does: the memory
goes back to the host and the file stays as it was saved. Such a VM's disks take no
discards (``discard=ignore``), so QEMU punches nothing else it would rely on.

Written by hand rather than with libseccomp's bindings: eight instructions of
classic BPF, installed with ``prctl`` between QEMU's fork and its exec, need nothing
a host may lack.

>>> len(punch_hole_filter("x86_64") or [])
8
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000  # with errno 0: the call returns 0, and does nothing
FALLOC_FL_PUNCH_HOLE = 0x02

# classic BPF opcodes
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K

# struct seccomp_data: nr at 0, arch at 4, instruction pointer at 8, args from 16
NR, ARCH, MODE = 0, 4, 16 + 8 * 1  # fallocate(fd, mode, offset, len): the low word of args[1]

# per host architecture: its audit arch and fallocate's number
ARCHES = {"x86_64": (0xC000003E, 285), "aarch64": (0xC00000B7, 47)}


class SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def punch_hole_filter(machine: str | None = None) -> list[tuple[int, int, int, int]] | None:
    """The program, as (code, jt, jf, k): any call but ``fallocate`` with a mode that
    punches passes; that one returns 0 having done nothing. None on an architecture
    this does not know."""
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, fallocate = arch
    return [
        (LD_W_ABS, 0, 0, ARCH),
        (JEQ_K, 0, 5, audit_arch),  # another ABI: allowed (QEMU uses none)
        (LD_W_ABS, 0, 0, NR),
        (JEQ_K, 0, 3, fallocate),
        (LD_W_ABS, 0, 0, MODE),
        (JSET_K, 0, 1, FALLOC_FL_PUNCH_HOLE),
        (RET_K, 0, 0, SECCOMP_RET_ERRNO | 0),
        (RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]


def installer() -> Callable[[], None]:
    """A function to call in a child between its fork and its exec (``preexec_fn``):
    it installs the filter for the process and what it execs, or raises ``OSError``
    (the child then never runs: a VM that could punch its memory file does not start).
    Everything it touches is made here, in the parent."""
    program = punch_hole_filter()
    if program is None:
        raise OSError(f"no syscall filter for {platform.machine()}: no VM may map a saved memory file here")
    instructions = (SockFilter * len(program))(*(SockFilter(*i) for i in program))
    fprog = SockFprog(len(program), instructions)
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def install() -> None:
        # no new privileges: what a filter needs without CAP_SYS_ADMIN (QEMU gains none by exec)
        if (
            prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            or prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0
        ):
            code = ctypes.get_errno()
            raise OSError(code, f"cannot install QEMU's syscall filter: {os.strerror(code)}")

    return install  # its closure holds the program for as long as the function lives


__all__ = ["installer", "punch_hole_filter"]
