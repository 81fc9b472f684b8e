"""Apply image layers to a staging directory exactly and safely, then make the
ext4 base disk with every owner, mode, xattr and device node as the image says.

Exact: OCI whiteouts (``.wh.NAME``) and opaque directories (``.wh..wh..opq``)
remove lower-layer entries only; hard links, symlinks, modes with
setuid/setgid/sticky, mtimes, and PAX ``SCHILY.xattr.*`` extended attributes
are kept.

Safe: a layer is hostile input. Names with ``..``, absolute names, control
characters or NUL are refused with ImageError. Symlinks in a path are resolved
*inside* the staging root, as a container runtime does under chroot, so a
symlink to ``/etc`` means the image's ``/etc``, never the host's. Hard links
must point at an entry already inside the root. Device nodes are never created
on the host: they are recorded and written straight into the guest's disk.

Owners without root: ``mkfs.ext4 -d`` copies owners from the files on disk,
which an ordinary user cannot set. The applier records the intended metadata
of every entry, and after ``mkfs.ext4 -d`` a single ``debugfs`` script sets
whatever the staging files could not carry (owners, modes, xattrs, devices).
As root most of it is applied directly and the script is short or empty.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import queue
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import HostSetupError, ImageError

_BAD_CHARS = {chr(c) for c in range(0x20)} | {"\x7f"}


@dataclass(slots=True)
class Meta:
    mode: int  # full st_mode, type bits included
    uid: int
    gid: int
    mtime: float
    xattrs: dict[str, bytes] = field(default_factory=dict)
    rdev: tuple[int, int] | None = None


class _Pipe(io.RawIOBase):
    """A layer decompressed (and hashed) in a thread, read as a stream: with two
    cores, inflating overlaps parsing the tar and writing files."""

    def __init__(self, path: Path, compression: str) -> None:
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
        self._buf = memoryview(b"")
        self._done = False
        self._stop = threading.Event()
        self.hasher = hashlib.sha256()
        self._thread = threading.Thread(target=self._run, args=(path, compression), daemon=True)
        self._thread.start()

    def _run(self, path: Path, compression: str) -> None:
        try:
            with open(path, "rb") as raw:
                if compression == "gzip":
                    inflate = zlib.decompressobj(wbits=47)  # gzip or zlib header, auto-detected
                    feed: Any = inflate.decompress
                elif compression == "zstd":
                    import zstandard

                    feed = zstandard.ZstdDecompressor().decompressobj().decompress
                elif compression == "none":
                    feed = bytes
                else:
                    raise ImageError(f"unknown layer compression {compression!r}")
                while not self._stop.is_set() and (chunk := raw.read(1 << 20)):
                    out = feed(chunk)
                    if compression == "gzip":
                        while inflate.unused_data:  # concatenated gzip members
                            rest = inflate.unused_data
                            inflate = zlib.decompressobj(wbits=47)
                            out += inflate.decompress(rest)
                    if out:
                        self.hasher.update(out)
                        self._queue.put(out)
        except zlib.error as exc:
            self._queue.put(ImageError(f"corrupt compressed layer: {exc}"))
        except BaseException as exc:
            self._queue.put(exc)
        else:
            self._queue.put(None)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            if self._done:
                return 0
            item = self._queue.get()
            if item is None:
                self._done = True
                return 0
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._buf = memoryview(item)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def drain(self) -> None:
        """Read to the end, so the hash covers the whole layer (tar padding included)."""
        while self.read(1 << 20):
            pass

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)
        super().close()


@contextlib.contextmanager
def open_layer(path: Path, compression: str) -> Iterator[_Pipe]:
    """A decompressed stream of a layer blob; ``.hasher`` sees every uncompressed byte."""
    pipe = _Pipe(path, compression)
    try:
        yield pipe
    finally:
        pipe.close()


def detect_compression(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(6)
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    return "none"


class LayerApplier:
    """Applies layers in order to ``root`` (an empty private directory)."""

    def __init__(self, root: Path, *, whiteouts: bool = True) -> None:
        self.root = Path(os.path.realpath(root))
        self.whiteouts = whiteouts
        self.meta: dict[str, Meta] = {"": Meta(stat.S_IFDIR | 0o755, 0, 0, 0.0)}
        self.devices: set[str] = set()
        self.privileged = os.geteuid() == 0
        self._layer_created: set[str] = set()
        self._dirs: set[str] = {""}  # real directories we made or walked: no symlink on their path
        self.entries = 0

    # -- paths ---------------------------------------------------------------------------

    def _check_name(self, name: str, what: str = "entry") -> list[str]:
        if not name or any(c in _BAD_CHARS for c in name):
            raise ImageError(f"layer {what} {name!r} has an empty name or control characters")
        if name.startswith("/"):
            raise ImageError(f"layer {what} {name!r} is an absolute path")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ImageError(f"layer {what} {name!r} contains '..'")
        return parts

    def _resolve(self, parts: list[str], *, follow_final: bool, create_dirs: bool, name: str) -> list[str]:
        """Resolve ``parts`` to real components below the root. Symlinks are followed
        with the root as ``/`` (never leaving it). With ``create_dirs`` every component
        is a directory, created if missing (a parent path); otherwise the final one may
        be anything and is followed only if ``follow_final``."""
        if create_dirs:
            key = "/".join(parts)
            if key in self._dirs:
                return list(parts)  # walked before, and nothing on the way changed since
        cur: list[str] = []
        todo = list(parts)
        hops = 0
        while todo:
            comp = todo.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if cur:
                    cur.pop()
                continue
            candidate = os.path.join(self.root, *cur, comp)
            last = not todo and not create_dirs
            try:
                st = os.lstat(candidate)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode) and (not last or follow_final):
                hops += 1
                if hops > 40:
                    raise ImageError(f"{name!r}: too many levels of symbolic links")
                target = os.readlink(candidate)
                if target.startswith("/"):
                    cur = []
                todo = [p for p in target.split("/") if p] + todo
                continue
            if not last:
                if st is None:
                    if not create_dirs:
                        raise FileNotFoundError(candidate)
                    os.mkdir(candidate, 0o755)
                    self.meta["/".join([*cur, comp])] = Meta(stat.S_IFDIR | 0o755, 0, 0, 0.0)
                elif not stat.S_ISDIR(st.st_mode):
                    raise ImageError(f"{name!r}: {'/'.join([*cur, comp])} is not a directory")
            cur.append(comp)
        if create_dirs and cur == parts:
            self._dirs.add("/".join(parts))
        return cur

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else str(self.root)

    def _remove(self, rel: str) -> None:
        path = self._abs(rel)
        prefix = rel + "/"
        self._dirs = {d for d in self._dirs if d != rel and not d.startswith(prefix)}
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        for key in [k for k in self.meta if k == rel or k.startswith(prefix)]:
            del self.meta[key]
        for key in [k for k in self.devices if k == rel or k.startswith(prefix)]:
            self.devices.discard(key)

    # -- layers --------------------------------------------------------------------------

    def apply(self, stream: IO[bytes] | io.RawIOBase) -> None:
        """Apply one layer (an uncompressed tar stream)."""
        self._layer_created = set()
        try:
            with tarfile.open(fileobj=stream, mode="r|", errorlevel=2, bufsize=1 << 18) as tf:
                for member in tf:
                    self.entries += 1
                    self._member(tf, member)
        except tarfile.TarError as exc:
            raise ImageError(f"malformed layer tar: {exc}") from exc
        except EOFError as exc:
            raise ImageError(f"truncated layer: {exc}") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # the host is out of space: not the image's fault
            raise ImageError(f"cannot apply layer: {exc}") from exc

    def _member(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = self._check_name(m.name)
        if not parts:
            if m.isdir():  # the root itself
                self.meta[""] = self._meta_of(m)
            return
        base = parts[-1]
        if self.whiteouts and base.startswith(".wh."):
            self._whiteout(parts)
            return
        parent = self._resolve(parts[:-1], follow_final=True, create_dirs=True, name=m.name)
        rel = "/".join([*parent, base])
        path = self._abs(rel)
        try:
            existing = os.lstat(path)
        except FileNotFoundError:
            existing = None

        if m.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                self._remove(rel)
                existing = None
            if existing is None:
                os.mkdir(path, 0o700)
        else:
            if existing is not None:
                self._remove(rel)
            if m.isreg():
                self._write_file(tf, m, path)
            elif m.issym():
                if "\0" in m.linkname or not m.linkname:
                    raise ImageError(f"symlink {m.name!r} has an invalid target")
                os.symlink(m.linkname, path)
            elif m.islnk():
                target_parts = self._check_name(m.linkname.lstrip("/"), "hard link target")
                try:
                    real = self._resolve(target_parts, follow_final=False, create_dirs=False, name=m.linkname)
                    target = self._abs("/".join(real))
                    tst = os.lstat(target)
                except FileNotFoundError:
                    raise ImageError(
                        f"hard link {m.name!r} points at {m.linkname!r}, which is not in the image"
                    ) from None
                if stat.S_ISDIR(tst.st_mode):
                    raise ImageError(f"hard link {m.name!r} points at a directory")
                os.link(target, path, follow_symlinks=False)
                target_meta = self.meta.get("/".join(real))
                if target_meta is not None:
                    self.meta[rel] = target_meta
                self._layer_created.add(rel)
                return
            elif m.ischr() or m.isblk():
                # never a device node on the host: recorded, made inside the guest disk
                self.devices.add(rel)
            elif m.isfifo():
                os.mkfifo(path, 0o600)
            else:
                return  # other types (e.g. GNU sparse markers) carry nothing to extract
        self.meta[rel] = self._meta_of(m)
        self._layer_created.add(rel)
        if rel not in self.devices:
            self._apply_meta(path, self.meta[rel])

    def _write_file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> None:
        src = tf.extractfile(m)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while src is not None and (chunk := src.read(1 << 20)):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def _whiteout(self, parts: list[str]) -> None:
        try:
            parent = self._resolve(parts[:-1], follow_final=True, create_dirs=False, name="/".join(parts))
        except FileNotFoundError:
            return  # nothing below to hide
        base = parts[-1]
        parent_rel = "/".join(parent)
        if base == ".wh..wh..opq":
            directory = self._abs(parent_rel)
            if not os.path.isdir(directory) or os.path.islink(directory):
                return
            for child in os.listdir(directory):
                child_rel = f"{parent_rel}/{child}" if parent_rel else child
                if child_rel not in self._layer_created:
                    self._remove(child_rel)
            return
        target = base[len(".wh.") :]
        if target in ("", ".", ".."):
            raise ImageError(f"invalid whiteout {'/'.join(parts)!r}")
        victim = f"{parent_rel}/{target}" if parent_rel else target
        if victim not in self._layer_created:
            self._remove(victim)

    @staticmethod
    def _meta_of(m: tarfile.TarInfo) -> Meta:
        kind = {
            tarfile.DIRTYPE: stat.S_IFDIR,
            tarfile.SYMTYPE: stat.S_IFLNK,
            tarfile.CHRTYPE: stat.S_IFCHR,
            tarfile.BLKTYPE: stat.S_IFBLK,
            tarfile.FIFOTYPE: stat.S_IFIFO,
        }.get(m.type, stat.S_IFREG)
        xattrs = {}
        for key, value in (m.pax_headers or {}).items():
            if key.startswith("SCHILY.xattr."):
                xattrs[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
        rdev = (m.devmajor, m.devminor) if m.ischr() or m.isblk() else None
        return Meta(kind | (m.mode & 0o7777), m.uid, m.gid, float(m.mtime), xattrs, rdev)

    def _apply_meta(self, path: str, meta: Meta) -> None:
        """Best effort on the staging file; what does not stick is fixed in the disk image."""
        is_link = stat.S_ISLNK(meta.mode)
        if self.privileged:
            with contextlib.suppress(OSError):
                os.lchown(path, meta.uid, meta.gid)
        if not is_link:
            perm = stat.S_IMODE(meta.mode)
            if not self.privileged:  # mkfs.ext4 must be able to read what it copies
                perm |= 0o700 if stat.S_ISDIR(meta.mode) else 0o600
            os.chmod(path, perm)
        for name, value in meta.xattrs.items():
            with contextlib.suppress(OSError):
                os.setxattr(path, name, value, follow_symlinks=False)
        with contextlib.suppress(OSError):
            os.utime(path, (meta.mtime, meta.mtime), follow_symlinks=False)

    def ensure_dir(self, path: str) -> None:
        """Create a directory (and parents) if the layers did not, e.g. the image's WorkingDir."""
        parts = self._check_name(path.lstrip("/"), "directory")
        self._resolve(parts, follow_final=True, create_dirs=True, name=path)

    def finish(self) -> None:
        """The root's own metadata, and directory mtimes last: adding entries changed them."""
        self._apply_meta(str(self.root), self.meta[""])
        for rel in sorted(self.meta, key=lambda r: -r.count("/")):
            meta = self.meta[rel]
            if stat.S_ISDIR(meta.mode):
                with contextlib.suppress(OSError):
                    os.utime(self._abs(rel), (meta.mtime, meta.mtime), follow_symlinks=False)

    # -- the disk image ---------------------------------------------------------------------

    def fixups(self, workdir: Path) -> list[str]:
        """debugfs commands that give the disk image what the staging files lack.
        Binary xattr values are written to files in ``workdir``."""
        cmds: list[str] = []
        for rel, meta in sorted(self.meta.items()):
            gpath = _quote("/" + rel)
            if rel in self.devices:
                kind = "c" if stat.S_ISCHR(meta.mode) else "b"
                major, minor = meta.rdev or (0, 0)
                parent, _, base = ("/" + rel).rpartition("/")
                # debugfs mknod takes a name in its current directory, not a path
                cmds += [
                    f"cd {_quote(parent or '/')}",
                    f"mknod {_quote(base)} {kind} {major} {minor}",
                    "cd /",
                ]
                cmds += [
                    f"sif {gpath} mode 0{meta.mode:o}",
                    f"sif {gpath} uid {meta.uid}",
                    f"sif {gpath} gid {meta.gid}",
                ]
                continue
            try:
                st = os.lstat(self._abs(rel))
            except FileNotFoundError:
                continue
            if (st.st_uid, st.st_gid) != (meta.uid, meta.gid):
                cmds += [f"sif {gpath} uid {meta.uid}", f"sif {gpath} gid {meta.gid}"]
            if not stat.S_ISLNK(meta.mode) and st.st_mode != meta.mode:
                cmds.append(f"sif {gpath} mode 0{meta.mode:o}")
            for name, value in meta.xattrs.items():
                try:
                    if os.getxattr(self._abs(rel), name, follow_symlinks=False) == value:
                        continue
                except OSError:
                    pass
                vfile = os.path.join(workdir, f"xattr-{len(cmds)}")
                with open(vfile, "wb") as f:
                    f.write(value)
                cmds.append(f"ea_set -f {_quote(vfile)} {gpath} {_quote(name)}")
        return cmds


def _quote(path: str) -> str:
    """debugfs (libss) quoting: inside double quotes, a double quote is doubled."""
    return '"' + path.replace('"', '""') + '"'


def run_debugfs(image: Path, cmds: list[str]) -> None:
    if not cmds:
        return
    debugfs = shutil.which("debugfs") or "/sbin/debugfs"
    if not os.path.exists(debugfs):
        raise HostSetupError("debugfs not found: install e2fsprogs")
    with tempfile.NamedTemporaryFile("w", suffix=".debugfs", delete=False) as f:
        f.write("\n".join(cmds) + "\n")
        script = f.name
    try:
        proc = subprocess.run([debugfs, "-w", "-f", script, str(image)], capture_output=True, text=True)
    finally:
        os.unlink(script)
    # debugfs exits 0 even when a command fails; its complaints are on stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("debugfs ")]
    if proc.returncode != 0 or errors:
        raise ImageError("writing owners and modes into the disk image failed: " + "; ".join(errors[:5]))


def apply_layers(root: Path, layers: list[tuple[Path, str]], *, whiteouts: bool = True) -> LayerApplier:
    """Apply (blob path, compression) layers in order into ``root``."""
    applier = LayerApplier(root, whiteouts=whiteouts)
    for path, compression in layers:
        with open_layer(path, compression) as stream:
            applier.apply(stream)
    applier.finish()
    return applier
