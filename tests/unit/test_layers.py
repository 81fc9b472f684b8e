"""Disk layers written without qemu-img: the bytes ``write_qcow2_overlay`` writes are
the ones ``qemu-img create`` writes, for every shape sandlot makes, and QEMU's own
tools read them as the overlay they are."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sandlot.core import layers
from sandlot.errors import InvalidArgument
from sandlot.images.rootfs import write_qcow2_overlay

SHAPES = [
    ("qcow2", "base.qcow2", 1 << 30),  # a snapshot's new top over a box disk
    ("raw", "vol,with,commas.raw", 16 << 20),  # a volume's first layer, the smallest volume
    ("raw", "big.raw", 16 << 40),  # the largest volume: four clusters of L1 table
    ("qcow2", "d" * 200 + ".qcow2", (10 << 30) + 512),  # a long name; a size in sectors
]


@pytest.mark.parametrize(("fmt", "backing", "size"), SHAPES)
def test_the_bytes_are_qemu_imgs(tmp_path: Path, fmt: str, backing: str, size: int) -> None:
    theirs, ours = tmp_path / "theirs.qcow2", tmp_path / "ours.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", fmt, "-b", str(tmp_path / backing),
                    str(theirs), str(size)], check=True)  # fmt: skip
    write_qcow2_overlay(ours, tmp_path / backing, fmt, size)
    assert ours.read_bytes() == theirs.read_bytes()


def test_qemu_reads_a_chain_of_them_and_writes_through_the_top(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(b"\x5a" * (1 << 20))
    mid = layers.new_layer(tmp_path, base, size=1 << 20, backing_format="raw")
    top = layers.new_layer(tmp_path, mid)
    check = subprocess.run(["qemu-img", "check", "--output=json", str(top)], capture_output=True, text=True)
    assert check.returncode == 0 and json.loads(check.stdout)["check-errors"] == 0, check.stdout
    info = json.loads(subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json", str(top)],
                                     capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert [i["filename"] for i in info] == [str(top), str(mid), str(base)]
    assert info[0]["virtual-size"] == 1 << 20 and info[0]["backing-filename-format"] == "qcow2"
    subprocess.run(["qemu-io", "-c", "write -P 0x11 65536 4096", str(top)], check=True, capture_output=True)
    out = tmp_path / "out"
    read = subprocess.run(["qemu-img", "dd", "-f", "qcow2", "-O", "raw", f"if={top}", f"of={out}", "bs=4096",
                           "count=20"], capture_output=True, text=True)  # fmt: skip
    assert read.returncode == 0, read.stderr
    data = out.read_bytes()
    assert data[:65536] == b"\x5a" * 65536 and data[65536:69632] == b"\x11" * 4096
    assert base.read_bytes() == b"\x5a" * (1 << 20)  # written to the top only


def test_sizes_and_names_qcow2_cannot_hold_are_refused(tmp_path: Path) -> None:
    for size in (0, 1000):
        with pytest.raises(InvalidArgument, match="multiple of 512"):
            write_qcow2_overlay(tmp_path / "x.qcow2", tmp_path / "b", "raw", size)
    with pytest.raises(InvalidArgument, match="1023 bytes"):
        write_qcow2_overlay(tmp_path / "x.qcow2", Path("/" + "n" * 1100), "raw", 1 << 20)
