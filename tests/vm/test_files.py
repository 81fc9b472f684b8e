"""The files API against a real guest: streamed read/write, metadata, typed errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import sandlot
from sandlot import Box

pytestmark = pytest.mark.vm


def test_write_read_roundtrip(bb_box: Box) -> None:
    assert bb_box.files.write("/home/agent/notes.txt", "hello") == 5
    assert bb_box.files.read("/home/agent/notes.txt") == b"hello"
    assert bb_box.files.read_text("/home/agent/notes.txt") == "hello"
    assert bb_box.exec("cat", "/home/agent/notes.txt").stdout == "hello"
    # parents are created; binary content survives
    blob = bytes(range(256)) * 1000
    bb_box.files.write("/srv/a/b/c.bin", blob, mode=0o600)
    assert bb_box.files.read("/srv/a/b/c.bin") == blob
    info = bb_box.files.stat("/srv/a/b/c.bin")
    assert (info.type, info.size, info.mode, info.uid) == ("file", len(blob), 0o600, 0)
    # append, and ranges
    bb_box.files.write("/srv/log", "a")
    bb_box.files.write("/srv/log", "bc", append=True)
    assert bb_box.files.read("/srv/log") == b"abc"
    assert b"".join(bb_box.files.iter_read("/srv/a/b/c.bin", offset=256, length=4)) == bytes(range(4))
    bb_box.files.remove("/srv", recursive=True)


def test_write_keeps_mode_and_owner_and_sets_user(bb_box: Box) -> None:
    bb_box.files.write("/home/agent/own.txt", "x", user="agent", mode=0o640)
    info = bb_box.files.stat("/home/agent/own.txt")
    assert (info.uid, info.gid, info.mode) == (1000, 1000, 0o640)
    bb_box.files.write("/home/agent/own.txt", "replaced")  # an overwrite keeps mode and owner
    info = bb_box.files.stat("/home/agent/own.txt")
    assert (info.uid, info.gid, info.mode, info.size) == (1000, 1000, 0o640, 8)
    assert bb_box.exec("sh", "-c", "echo more >> /home/agent/own.txt", user="agent").ok
    with pytest.raises(FileExistsError):
        bb_box.files.write("/home/agent/own.txt", "no", exclusive=True)
    bb_box.files.remove("/home/agent/own.txt")


def test_list_stat_mkdir_rename_chmod_chown(bb_box: Box) -> None:
    f = bb_box.files
    f.mkdir("/work/x/y")
    f.write("/work/x/file", "1")
    bb_box.exec("ln", "-s", "/work/x/file", "/work/x/link")
    names = {e.name: e for e in f.list("/work/x")}
    assert set(names) == {"y", "file", "link"}
    assert names["y"].is_dir and names["file"].is_file and names["link"].is_symlink
    assert names["link"].link_target == "/work/x/file"
    assert f.stat("/work/x/link").is_file  # follows
    assert f.stat("/work/x/link", follow_symlinks=False).is_symlink
    f.rename("/work/x/file", "/work/x/renamed")
    assert f.exists("/work/x/renamed") and not f.exists("/work/x/file")
    f.chmod("/work/x/renamed", 0o751)
    assert f.stat("/work/x/renamed").mode == 0o751
    f.chown("/work/x/renamed", "agent:users")
    info = f.stat("/work/x/renamed")
    assert (info.uid, info.gid) == (1000, 100)
    f.mkdir("/work/x/y", parents=True)  # exists: fine with parents
    with pytest.raises(FileExistsError):
        f.mkdir("/work/x/y", parents=False)
    with pytest.raises(sandlot.GuestDirectoryNotEmpty):
        f.remove("/work/x")
    f.remove("/work", recursive=True)
    assert not f.exists("/work")
    f.remove("/work", missing_ok=True)


def test_large_directory_listing(bb_box: Box) -> None:
    bb_box.exec("sh", "-c", "mkdir -p /tmp/many && cd /tmp/many && for i in $(seq 1 3000); do : > f$i; done")
    entries = bb_box.files.list("/tmp/many")
    assert len(entries) == 3000
    bb_box.files.remove("/tmp/many", recursive=True)


def test_errors_are_typed(bb_box: Box) -> None:
    f = bb_box.files
    with pytest.raises(FileNotFoundError):
        f.read("/nope")
    with pytest.raises(sandlot.GuestFileNotFoundError):
        f.stat("/nope/deeper")
    with pytest.raises(IsADirectoryError):
        f.read("/etc")
    with pytest.raises(IsADirectoryError):
        f.write("/etc", "x")
    with pytest.raises(NotADirectoryError):
        f.list("/etc/passwd")
    with pytest.raises(NotADirectoryError):
        f.write("/etc/passwd/child", "x")
    with pytest.raises(sandlot.InvalidArgument):
        f.read("relative/path")
    with pytest.raises(sandlot.InvalidArgument):
        f.write("/bad\0path", "x")
    with pytest.raises(sandlot.InvalidArgument):
        f.chmod("/etc/passwd", 0o17777)
    with pytest.raises(sandlot.GuestError, match="unknown user"):
        f.chown("/etc/passwd", "nobody-here")
    with pytest.raises(PermissionError):  # EPERM inside the guest, as a guest error
        f.chmod("/proc/1/status", 0o777)
    # Linux's procfs says ENOENT to a new file beside /proc/version, gVisor's EPERM:
    # either way a typed error naming the temporary file
    with pytest.raises((FileNotFoundError, PermissionError), match="temporary file beside"):
        f.write("/proc/version", "x")
    assert f.read("/etc/hostname")  # the box is fine


def test_100mb_roundtrip_with_checksum(bb_box: Box, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    block = os.urandom(1 << 20)
    with open(src, "wb") as out:
        for i in range(100):
            out.write(hashlib.sha256(block + bytes([i])).digest() * (1 << 15))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    assert bb_box.files.upload(src, "/var/big.bin") == 100 << 20
    assert bb_box.exec("sha256sum", "/var/big.bin").stdout.split()[0] == digest
    back = tmp_path / "back.bin"
    assert bb_box.files.download("/var/big.bin", back) == 100 << 20
    assert hashlib.sha256(back.read_bytes()).hexdigest() == digest
    bb_box.files.remove("/var/big.bin")


def test_upload_download_tree_and_modes(bb_box: Box, tmp_path: Path) -> None:
    tree = tmp_path / "proj"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "main.py").write_text("print('hi')\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    bb_box.files.upload(tree, "/opt/proj", user="agent")
    assert bb_box.exec("/opt/proj/run.sh").stdout == "ran\n"
    assert bb_box.files.stat("/opt/proj/src/main.py").uid == 1000
    out = tmp_path / "main.py"
    bb_box.files.download("/opt/proj/src/main.py", out)
    assert out.read_text() == "print('hi')\n"
    bb_box.files.remove("/opt/proj", recursive=True)


def test_new_files_get_0644_and_root(bb_box: Box) -> None:
    bb_box.files.write("/tmp/new.txt", "x")
    info = bb_box.files.stat("/tmp/new.txt")
    assert (info.mode, info.uid, info.gid) == (0o644, 0, 0)
    bb_box.files.remove("/tmp/new.txt")
