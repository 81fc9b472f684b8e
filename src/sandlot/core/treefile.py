"""A directory tree as one file, and back: how a layer directory's ``upper/`` and an
image root (a gVisor box's disk) move through the storage tier (``core.remote``).

Written by GNU tar, which reads every owner, mode, device number and extended
attribute (overlayfs's whiteouts are character devices 0/0, its opaque directories an
xattr ``trusted.overlay.opaque``), in name order and without access or change times,
so that a tree that did not change is the same file again (and the tier has it once).

Read back by Python's ``tarfile``, as hostile input (another home wrote it): a member
with an absolute name is refused, and every other is checked by ``tarfile.tar_filter``
(nothing outside the destination, even through a link the tree made) but keeps its
mode bits (setuid programs stay setuid); each member's ``SCHILY.xattr.*`` records are
set on it after (``tarfile`` does not).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from ..errors import CorruptSnapshot, HostSetupError, no_space

XATTR = "SCHILY.xattr."


def pack(tree: Path, dest: Path) -> None:
    """``tree``'s content (not ``tree`` itself) into the tar file ``dest``."""
    tar = shutil.which("tar")
    if tar is None:
        raise HostSetupError("tar not found: install tar")
    proc = subprocess.run(
        [tar, "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sort=name", "--format=posix",
         "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
         "-C", str(tree), "-cf", str(dest), "."],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise CorruptSnapshot(f"the tree {tree} could not be written out: {proc.stderr.strip()[-400:]}")


def unpack(src: Path, tree: Path) -> None:
    """The tar file ``src`` into the empty directory ``tree``, owners, modes, devices
    and extended attributes as it says. ``CorruptSnapshot`` for a member that would land
    outside ``tree``, or a file that is no tar."""

    if not hasattr(tarfile, "tar_filter"):
        raise HostSetupError(
            "reading a tree from the storage tier needs Python 3.11.4 or later (tarfile's filters)"
        )

    def checked(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        if member.name.startswith("/") or (member.islnk() and member.linkname.startswith("/")):
            raise tarfile.AbsolutePathError(member)  # pack never writes one: not a tree of ours
        # what tar_filter made of it (it raises for what must not be extracted), with the
        # mode bits it would clear (a setuid program of the image stays one)
        return tarfile.tar_filter(member, dest).replace(mode=member.mode, deep=False)

    try:
        with tarfile.open(src, "r:", errorlevel=2) as tf:  # every error, none only logged
            members = tf.getmembers()
            tf.extractall(tree, members=members, numeric_owner=True, filter=checked)
        for member in members:
            xattrs = {k[len(XATTR) :]: v for k, v in member.pax_headers.items() if k.startswith(XATTR)}
            for name, value in xattrs.items():
                os.setxattr(tree / member.name, name, value.encode("utf-8", "surrogateescape"),
                            follow_symlinks=False)  # fmt: skip
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(tree, f"the tree {src.name} from the storage tier could not be written") from None
        raise CorruptSnapshot(
            f"the tree {src.name} from the storage tier cannot be written out: {exc}"
        ) from exc
    except (tarfile.TarError, ValueError) as exc:
        raise CorruptSnapshot(f"the tree {src.name} from the storage tier cannot be read: {exc}") from exc
