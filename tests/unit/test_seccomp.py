"""The filter that keeps a QEMU process from punching holes in files (a saved state's
memory file above all, which other boxes map: engine/qemu/seccomp.py), tried on a real
process: a punch succeeds and changes nothing, every other call runs as before. And the
VMs that get it: those whose RAM maps a saved memory file, whose disks take no discards."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot.engine.qemu import seccomp
from sandlot.engine.qemu.command import VMConfig, build_command

PUNCH_HOLE, KEEP_SIZE, ZERO_RANGE = 0x02, 0x01, 0x10
CALLS = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDWR)
for mode, at in ((0x02 | 0x01, 0), (0x10, 65536)):
    print(libc.fallocate(fd, mode, ctypes.c_long(at), ctypes.c_long(65536)), ctypes.get_errno())
os.write(fd, b"still writable")
"""

pytestmark = pytest.mark.skipif(seccomp.punch_hole_filter() is None, reason="an architecture with no filter")


def test_a_punch_succeeds_and_changes_nothing_while_the_rest_runs(tmp_path: Path) -> None:
    f = tmp_path / "memory"
    f.write_bytes(b"x" * (1 << 20))
    done = subprocess.run([sys.executable, "-c", CALLS, str(f)], preexec_fn=seccomp.installer(),
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.split("\n")[:2] == ["0 0", "0 0"], done.stdout + done.stderr
    data = f.read_bytes()
    assert data[14:65536] == b"x" * (65536 - 14)  # the punched range is as it was
    assert data[65536:131072] == b"\0" * 65536  # a zeroed range is zeroed
    assert data[:14] == b"still writable"


def test_without_it_the_same_punch_makes_a_hole(tmp_path: Path) -> None:
    f = tmp_path / "memory"
    f.write_bytes(b"x" * (1 << 20))
    done = subprocess.run([sys.executable, "-c", CALLS, str(f)], check=True, capture_output=True, text=True)
    if not done.stdout.startswith("0 0"):
        pytest.skip(f"this filesystem punches no holes: {done.stdout.splitlines()[0]}")
    assert f.read_bytes()[14:65536] == b"\0" * (65536 - 14)  # what QEMU 7.2 did to a shared file


def test_the_program_reads_as_the_kernel_takes_it() -> None:
    program = seccomp.punch_hole_filter("x86_64")
    assert program is not None and len(program) == 8
    # every jump lands inside the program, on one of its two returns or the next load
    for i, (code, jt, jf, _k) in enumerate(program):
        if code in (seccomp.JEQ_K, seccomp.JSET_K):
            assert i + 1 + jt < len(program) and i + 1 + jf < len(program)
    assert program[-2] == (seccomp.RET_K, 0, 0, seccomp.SECCOMP_RET_ERRNO)  # errno 0: returns 0
    assert seccomp.punch_hole_filter("mips") is None


def test_a_vm_on_a_saved_memory_file_takes_no_discards(tmp_path: Path) -> None:
    base = dict(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=tmp_path,
                state_dir=tmp_path)  # fmt: skip
    restored = VMConfig(**base, ram_file=tmp_path / "memory", ram_shared=False)  # type: ignore[arg-type]
    booted = VMConfig(**base)  # type: ignore[arg-type]
    preparing = VMConfig(**base, ram_file=tmp_path / "memory", ram_shared=True)  # type: ignore[arg-type]
    assert restored.maps_saved_memory and not booted.maps_saved_memory and not preparing.maps_saved_memory
    assert "discard=ignore,detect-zeroes=on" in " ".join(build_command(restored, "qemu"))
    assert "discard=unmap,detect-zeroes=unmap" in " ".join(build_command(booted, "qemu"))
    assert ctypes.sizeof(seccomp.SockFilter) == 8  # struct sock_filter
