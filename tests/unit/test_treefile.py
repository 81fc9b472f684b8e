"""A directory tree as one tar file and back (``core/treefile.py``): how a gVisor box's
layer directories and image root move through the storage tier. Everything overlayfs
and a root filesystem hold comes back (owners, setuid modes, devices: whiteouts among
them, extended attributes, hard and symbolic links, times); a tree that did not change
packs to the same bytes; a file another home wrote is read as hostile input."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from sandlot.core import treefile
from sandlot.errors import CorruptSnapshot

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="owners, devices and trusted.* xattrs need root")


def a_tree(at: Path) -> Path:
    at.mkdir()
    (at / "bin").mkdir()
    (at / "bin" / "su").write_bytes(b"\x7fELF...")
    os.chown(at / "bin" / "su", 0, 0)  # (before the mode: a chown clears setuid)
    os.chmod(at / "bin" / "su", 0o4755)
    (at / "home").mkdir()
    (at / "home" / "agent").mkdir()
    (at / "home" / "agent" / "notes").write_text("mine")
    os.chown(at / "home" / "agent", 1000, 1000)
    os.chown(at / "home" / "agent" / "notes", 1000, 1000)
    os.link(at / "home" / "agent" / "notes", at / "home" / "agent" / "again")
    os.symlink("/etc/os-release", at / "bin" / "absolute-link")
    os.mknod(at / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # overlayfs's whiteout
    (at / "opaque").mkdir()
    os.setxattr(at / "opaque", "trusted.overlay.opaque", b"y")
    os.setxattr(at / "bin" / "su", "user.note", b"\x00\xffbinary")
    os.utime(at / "home" / "agent" / "notes", (1_000_000, 1_000_000))
    return at


@root_only
def test_a_tree_comes_back_whole(tmp_path: Path) -> None:
    tree = a_tree(tmp_path / "tree")
    packed = tmp_path / "tree.tar"
    treefile.pack(tree, packed)
    out = tmp_path / "out"
    out.mkdir()
    treefile.unpack(packed, out)
    su = (out / "bin" / "su").stat()
    assert stat.S_IMODE(su.st_mode) == 0o4755 and (su.st_uid, su.st_gid) == (0, 0)
    notes = out / "home" / "agent" / "notes"
    assert notes.read_text() == "mine" and (notes.stat().st_uid, notes.stat().st_gid) == (1000, 1000)
    assert notes.stat().st_mtime == 1_000_000
    assert os.path.samefile(notes, out / "home" / "agent" / "again")
    assert os.readlink(out / "bin" / "absolute-link") == "/etc/os-release"
    gone = (out / "gone").stat()
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == os.makedev(0, 0)
    assert os.getxattr(out / "opaque", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(out / "bin" / "su", "user.note") == b"\x00\xffbinary"
    again = tmp_path / "again.tar"
    treefile.pack(tree, again)
    assert again.read_bytes() == packed.read_bytes()  # the same tree, the same file: the tier has it once


def hostile(tmp_path: Path, *members: tuple[str, bytes | None, str | None]) -> Path:
    """A tar of (name, content, symlink target) members."""
    path = tmp_path / "hostile.tar"
    with tarfile.open(path, "w") as tf:
        for name, data, target in members:
            info = tarfile.TarInfo(name)
            if target is not None:
                info.type, info.linkname = tarfile.SYMTYPE, target
                tf.addfile(info)
            else:
                info.size = len(data or b"")
                tf.addfile(info, io.BytesIO(data or b""))
    return path


@pytest.mark.parametrize(
    "members",
    [
        [("../escaped", b"x", None)],
        [("/etc/escaped", b"x", None)],
        [("link", None, "/tmp"), ("link/escaped", b"x", None)],  # through a link the tree made
        [("up", None, ".."), ("up/escaped", b"x", None)],
    ],
)
def test_a_tree_that_would_write_outside_its_directory_is_refused(
    tmp_path: Path, members: list[tuple[str, bytes | None, str | None]]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptSnapshot, match="cannot be read"):
        treefile.unpack(hostile(tmp_path, *members), out)
    assert not (tmp_path / "escaped").exists() and not Path("/etc/escaped").exists()
    assert not Path("/tmp/escaped").exists()


def test_a_file_that_is_no_tar_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptSnapshot, match="cannot be read"):
        treefile.unpack(bad, out)


def test_a_tree_that_cannot_be_laid_out_is_refused_clearly(tmp_path: Path) -> None:
    """A member that cannot land where the tree says (a link where a directory with a
    file in it stands): ``CorruptSnapshot``, not an ``OSError`` of tarfile's."""
    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w") as tf:
        folder = tarfile.TarInfo("d")
        folder.type = tarfile.DIRTYPE
        tf.addfile(folder)
        inside = tarfile.TarInfo("d/f")
        inside.size = 1
        tf.addfile(inside, io.BytesIO(b"x"))
        link = tarfile.TarInfo("d")
        link.type, link.linkname = tarfile.SYMTYPE, "elsewhere"
        tf.addfile(link)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptSnapshot, match="from the storage tier cannot be"):
        treefile.unpack(path, out)
