"""Root filesystems from a directory or a tarball, as cached ext4 base disks.

A base disk is a sparse ext4 image made by ``mkfs.ext4 -d``; it is read-only
and shared by every box made from the same content. The cache key covers the
content (a stat walk for directories, the sha256 for tarballs), so editing the
directory gives a new base.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from pathlib import Path

from ..config import fsync_dir, tree_bytes
from ..errors import HostSetupError, ImageError, InvalidArgument, no_space

GiB = 1 << 30


def _dir_digest(root: Path) -> str:
    """Digest of a tree's names, types, modes, owners, sizes, times and link targets.

    Walked with ``os.scandir`` in ``os.walk``'s order (files, then directories, each
    sorted; a link to a directory listed with the directories, not entered; an
    unreadable directory left out), so digests stay those of earlier releases: a
    ``rootfs=`` directory is digested at every box's creation, and this walk takes
    half the time of ``os.walk`` with an ``lstat`` per name (48 ms for Debian's 10k)."""
    h = hashlib.sha256()

    def walk(path: str, rel: str) -> None:
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            return
        dirs = sorted((e for e in entries if e.is_dir()), key=lambda e: e.name)
        files = sorted((e for e in entries if not e.is_dir()), key=lambda e: e.name)
        for e in files + dirs:
            st = e.stat(follow_symlinks=False)
            h.update((rel + e.name).encode("utf-8", "surrogateescape") + b"\0")
            h.update(f"{st.st_mode}:{st.st_uid}:{st.st_gid}:{st.st_size}:{st.st_mtime_ns}".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(e.path).encode("utf-8", "surrogateescape"))
            h.update(b"\n")
        for d in dirs:
            if not d.is_symlink():
                walk(d.path, f"{rel}{d.name}/")

    walk(str(root), "")
    return h.hexdigest()


def base_size(root: Path) -> int:
    """A base disk just big enough for its content plus room to work: boxes grow it
    to their disk size at first boot (online resize, about 0.1 s)."""
    need = tree_bytes(root)
    size = max(512 << 20, int(need * 1.3) + (256 << 20))
    return (size + (64 << 20) - 1) // (64 << 20) * (64 << 20)


def make_ext4(src_dir: Path, out: Path, size_bytes: int, label: str = "sandlot-root") -> None:
    """``mkfs.ext4 -d``: an ext4 image of ``size_bytes`` holding ``src_dir``."""
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    if not os.path.exists(mkfs):
        raise HostSetupError("mkfs.ext4 not found: install e2fsprogs")
    need = tree_bytes(src_dir)
    if need > size_bytes * 0.9:
        raise InvalidArgument(
            f"root filesystem needs about {need / GiB:.2f} GiB but the disk is {size_bytes / GiB:.2f} GiB"
        )
    # -m 0: the box's user is root anyway; the journal stays for crash safety.
    # The size needs a unit: a bare number is read as 1 KiB blocks.
    size = f"{size_bytes // 1024}k"
    cmd = [mkfs, "-q", "-F", "-t", "ext4", "-m", "0", "-L", label, "-d", str(src_dir), str(out), size]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 and "No space left" in proc.stderr:
        raise no_space(out.parent, f"the disk image of {src_dir} could not be made")
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


def rootfs_key(rootfs: str | os.PathLike[str]) -> str:
    """The content key of a root filesystem directory (its tree's names, types, modes,
    owners, sizes, times and link targets) or tarball (its bytes): what its cached base
    disk and its automatic template (``LiveState.template_key``) are found by, so that
    a directory that changed gets neither of the old one's."""
    path = Path(rootfs).expanduser()
    if path.is_dir():
        return hashlib.sha256(f"dir:{_dir_digest(path)}".encode()).hexdigest()[:24]
    if not path.is_file():
        raise InvalidArgument(f"rootfs {path} is neither a directory nor a file")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return hashlib.sha256(f"tar:{h.hexdigest()}".encode()).hexdigest()[:24]


def _reused(base: Path) -> Path:
    """``base``, its time of modification set to now: a cached base's last use, which
    ``prune_images(unused_for=...)`` goes by (its content never changes after it is made)."""
    with contextlib.suppress(OSError):
        os.utime(base)
    return base


def base_from_dir(cache: Path, src: Path, key: str | None = None) -> Path:
    """Cached ext4 base holding the directory ``src`` (owners as on disk)."""
    src = Path(src)
    if not src.is_dir():
        raise InvalidArgument(f"rootfs {src} is not a directory")
    key = key or rootfs_key(src)
    final = cache / f"{key}.ext4"
    if final.exists():
        return _reused(final)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".ext4", dir=cache)
    os.close(fd)
    try:
        make_ext4(src, Path(tmp), base_size(src))
        return _publish(Path(tmp), final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def base_from_tarball(cache: Path, tarball: Path, key: str | None = None) -> Path:
    """Cached ext4 base holding the contents of a (optionally compressed) tarball.

    Unpacked with the image layer applier (whiteouts off): the same safety rules
    and the same exact owners, modes and xattrs, also when not running as root.
    """
    from .unpack import apply_layers, detect_compression, run_debugfs

    tarball = Path(tarball)
    if not tarball.is_file():
        raise InvalidArgument(f"rootfs {tarball} is not a file")
    key = key or rootfs_key(tarball)
    final = cache / f"{key}.ext4"
    if final.exists():
        return _reused(final)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{key}.", dir=cache) as tmpdir:
        root = Path(tmpdir) / "root"
        root.mkdir()
        applier = apply_layers(root, [(tarball, detect_compression(tarball))], whiteouts=False)
        image = Path(tmpdir) / "base.ext4"
        make_ext4(root, image, base_size(root))
        run_debugfs(image, applier.fixups(Path(tmpdir)))
        return _publish(image, final)


def base_for(cache: Path, rootfs: str | os.PathLike[str], key: str | None = None) -> Path:
    """The cached base disk of a root filesystem directory or tarball (``key``: its
    ``rootfs_key``, if the caller took it already: the tree as the caller saw it)."""
    path = Path(rootfs).expanduser()
    if not path.exists():
        raise InvalidArgument(f"rootfs {path} does not exist")
    if path.is_dir():
        return base_from_dir(cache, path, key)
    return base_from_tarball(cache, path, key)


def rootfs_dir_for(cache: Path, rootfs: str | os.PathLike[str], key: str | None = None) -> Path:
    """The cached, read-only copy of a root filesystem directory or tarball, as a
    directory (the lower layer of boxes whose disk is an overlay: engine gvisor).
    A copy, not the user's directory itself: an overlay's lower layer must not change."""
    from .unpack import apply_layers, detect_compression

    path = Path(rootfs).expanduser()
    if not path.exists():
        raise InvalidArgument(f"rootfs {path} does not exist")
    key = key or rootfs_key(path)
    final = cache / f"{key}.rootfs"
    if final.is_dir():
        return _reused(final)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache))
    try:
        root = tmp / "root"
        if path.is_dir():
            proc = subprocess.run(["cp", "-a", "--reflink=auto", f"{path}/.", str(root)], capture_output=True,
                                  text=True)  # fmt: skip
            if proc.returncode != 0:
                raise ImageError(f"copying rootfs {path} failed: {proc.stderr.strip()}")
        else:
            root.mkdir()
            apply_layers(root, [(path, detect_compression(path))], whiteouts=False)
        try:
            os.rename(root, final)
        except OSError:
            if not final.is_dir():  # a racing maker's copy is as good
                raise
        fsync_dir(cache)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def qcow2_backing_file(path: Path) -> str | None:
    """The backing file a qcow2 image names (its header: offset 8, length at 16)."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
            if header[:4] != b"QFI\xfb":
                return None
            offset = int.from_bytes(header[8:16], "big")
            length = int.from_bytes(header[16:20], "big")
            if not offset or not 0 < length <= 4096:
                return None
            f.seek(offset)
            return f.read(length).decode("utf-8", "replace")
    except OSError:
        return None


QCOW2_CLUSTER = 1 << 16
_QCOW2_FEATURES = ((0, 0, b"dirty bit"), (0, 1, b"corrupt bit"), (0, 2, b"external data file"),
                   (0, 3, b"compression type"), (0, 4, b"extended L2 entries"), (1, 0, b"lazy refcounts"),
                   (2, 0, b"bitmaps"), (2, 1, b"raw external data"))  # fmt: skip
_QCOW2_BACKING_FORMAT, _QCOW2_FEATURE_NAMES = 0xE2792ACA, 0x6803F857


def write_qcow2_overlay(path: Path, backing: Path, backing_format: str, size: int) -> None:
    """An empty qcow2 (v3, 64 KiB clusters) over ``backing``: the bytes ``qemu-img create
    -f qcow2 -u -F FORMAT -b BACKING PATH SIZE`` writes (tests/unit/test_layers.py
    compares them), written here because a qemu-img process costs about 28 ms, and
    every snapshot makes a layer per disk and every fork's child one more. An existing
    file is replaced, as qemu-img does. Its layout: the header with its extensions and
    the backing file's name (cluster 0), the refcount table (1), one refcount block
    (2), the L1 table (from 3 on, all zero: nothing allocated). qemu-img zero-fills
    those clusters (196 KiB); these are sparse (12 KiB)."""
    if size <= 0 or size % 512:
        raise InvalidArgument(f"a disk layer's size is a positive multiple of 512 bytes, not {size}")
    name, fmt = os.fsencode(backing), backing_format.encode()
    if not 0 < len(name) <= 1023:
        raise InvalidArgument(f"a backing file's name is 1 to 1023 bytes, not {len(name)}")
    l1_size = -(-size // (QCOW2_CLUSTER * (QCOW2_CLUSTER // 8)))
    l1_offset = 3 * QCOW2_CLUSTER
    l1_clusters = -(-l1_size * 8 // QCOW2_CLUSTER)
    names = b"".join(struct.pack(">BB46s", t, b, n) for t, b, n in _QCOW2_FEATURES)
    extensions = (
        _extension(_QCOW2_BACKING_FORMAT, fmt) + _extension(_QCOW2_FEATURE_NAMES, names) + _extension(0, b"")
    )
    header_length = 112
    backing_offset = header_length + len(extensions)
    header = struct.pack(
        ">4sIQIIQIIQQIIQQQQII8x", b"QFI\xfb", 3, backing_offset, len(name), 16, size, 0, l1_size, l1_offset,
        QCOW2_CLUSTER, 1, 0, 0, 0, 0, 0, 4, header_length,
    )  # fmt: skip
    refcounts = struct.pack(f">{3 + l1_clusters}H", *([1] * (3 + l1_clusters)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + extensions + name)
            f.seek(QCOW2_CLUSTER)
            f.write(struct.pack(">Q", 2 * QCOW2_CLUSTER))
            f.seek(2 * QCOW2_CLUSTER)
            f.write(refcounts)
            f.truncate(l1_offset + l1_size * 8)
    except OSError as exc:
        path.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(path.parent, "a disk layer could not be made") from None
        raise


def _extension(kind: int, data: bytes) -> bytes:
    """A qcow2 header extension: type, length, the data padded to 8 bytes."""
    return struct.pack(">II", kind, len(data)) + data + b"\0" * (-len(data) % 8)


def create_overlay(base: Path, overlay: Path, size_bytes: int) -> None:
    """A qcow2 overlay on the read-only base: the box's private, copy-on-write disk."""
    if size_bytes < base.stat().st_size:
        raise InvalidArgument(
            f"the disk must be at least {-(-base.stat().st_size // GiB)} GiB to hold this root filesystem"
        )
    write_qcow2_overlay(overlay, base, "raw", size_bytes)
