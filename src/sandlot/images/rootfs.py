"""Root filesystems from a directory or a tarball, as cached ext4 base disks.

A base disk is a sparse ext4 image made by ``mkfs.ext4 -d``; it is read-only
and shared by every box made from the same content and size. The cache key
covers the content (a stat walk for directories, the sha256 for tarballs) and
the filesystem size, so editing the directory gives a new base.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

from ..config import fsync_dir
from ..errors import HostSetupError, ImageError, InvalidArgument

GiB = 1 << 30


def _dir_digest(root: Path) -> str:
    """Digest of a tree's names, types, modes, owners, sizes, times and link targets."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames) + dirnames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
            h.update(f"{st.st_mode}:{st.st_uid}:{st.st_gid}:{st.st_size}:{st.st_mtime_ns}".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
            h.update(b"\n")
    return h.hexdigest()


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with_st = os.lstat(os.path.join(dirpath, name))
            total += with_st.st_blocks * 512
    return total


def make_ext4(src_dir: Path, out: Path, size_bytes: int, label: str = "sandlot-root") -> None:
    """``mkfs.ext4 -d``: an ext4 image of ``size_bytes`` holding ``src_dir``."""
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    if not os.path.exists(mkfs):
        raise HostSetupError("mkfs.ext4 not found: install e2fsprogs")
    need = _tree_bytes(src_dir)
    if need > size_bytes * 0.9:
        raise InvalidArgument(
            f"root filesystem needs about {need / GiB:.2f} GiB but the disk is {size_bytes / GiB:.2f} GiB"
        )
    # -m 0: the box's user is root anyway; the journal stays for crash safety.
    # The size needs a unit: a bare number is read as 1 KiB blocks.
    size = f"{size_bytes // 1024}k"
    cmd = [mkfs, "-q", "-F", "-t", "ext4", "-m", "0", "-L", label, "-d", str(src_dir), str(out), size]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageError(f"mkfs.ext4 failed for {src_dir}: {proc.stderr.strip()[-2000:]}")


def _publish(tmp: Path, final: Path) -> Path:
    os.chmod(tmp, 0o444)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def base_from_dir(cache: Path, src: Path, size_bytes: int) -> Path:
    """Cached ext4 base holding the directory ``src``."""
    src = Path(src)
    if not src.is_dir():
        raise InvalidArgument(f"rootfs {src} is not a directory")
    key = hashlib.sha256(f"dir:{_dir_digest(src)}:{size_bytes}".encode()).hexdigest()[:24]
    final = cache / f"{key}.ext4"
    if final.exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".ext4", dir=cache)
    os.close(fd)
    try:
        make_ext4(src, Path(tmp), size_bytes)
        return _publish(Path(tmp), final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _tar_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Keep modes and owners (a root filesystem needs its setuid bits) and
    absolute symlinks (they resolve inside the guest), but never write outside
    ``dest``: no ``..``, no writes through symlinks, no hard links out, no devices."""
    parts = [p for p in member.name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"tar member {member.name!r} escapes the root")
    if member.isdev():
        return None  # devtmpfs provides /dev in the guest
    name = "/".join(parts)
    if not name:
        return None
    root = os.path.realpath(dest)
    where = os.path.realpath(os.path.join(root, name))
    if not _inside(root, where):
        raise ImageError(f"tar member {member.name!r} would be written through a symlink outside the root")
    if member.islnk():
        target_parts = [p for p in member.linkname.split("/") if p not in ("", ".")]
        target = os.path.realpath(os.path.join(root, *target_parts))
        if ".." in target_parts or not _inside(root, target):
            raise ImageError(f"hard link {member.name!r} points outside the root")
        return member.replace(name=name, linkname="/".join(target_parts), deep=False)
    return member.replace(name=name, deep=False)


def base_from_tarball(cache: Path, tarball: Path, size_bytes: int) -> Path:
    """Cached ext4 base holding the contents of a (optionally compressed) tarball."""
    tarball = Path(tarball)
    if not tarball.is_file():
        raise InvalidArgument(f"rootfs {tarball} is not a file")
    h = hashlib.sha256()
    with open(tarball, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    key = hashlib.sha256(f"tar:{h.hexdigest()}:{size_bytes}".encode()).hexdigest()[:24]
    final = cache / f"{key}.ext4"
    if final.exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{key}.", dir=cache) as tmpdir:
        root = Path(tmpdir) / "root"
        root.mkdir()
        try:
            with tarfile.open(tarball) as tf:
                tf.extractall(root, filter=_tar_filter)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise ImageError(f"cannot unpack {tarball}: {exc}") from exc
        image = Path(tmpdir) / "base.ext4"
        make_ext4(root, image, size_bytes)
        return _publish(image, final)


def base_for(cache: Path, rootfs: str | os.PathLike[str], size_bytes: int) -> Path:
    path = Path(rootfs).expanduser()
    if not path.exists():
        raise InvalidArgument(f"rootfs {path} does not exist")
    if path.is_dir():
        return base_from_dir(cache, path, size_bytes)
    return base_from_tarball(cache, path, size_bytes)


def create_overlay(base: Path, overlay: Path, size_bytes: int) -> None:
    """A qcow2 overlay on the read-only base: the box's private, copy-on-write disk."""
    qemu_img = shutil.which("qemu-img")
    if not qemu_img:
        raise HostSetupError("qemu-img not found: install qemu-utils")
    size = max(size_bytes, base.stat().st_size)
    cmd = [qemu_img, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(overlay), str(size)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HostSetupError(f"qemu-img create failed: {proc.stderr.strip()}")
