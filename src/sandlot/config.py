"""Where sandlot keeps things, and small helpers for writing them safely."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import HostSetupError


def default_home() -> Path:
    """``$SANDLOT_HOME``, else ``$XDG_DATA_HOME/sandlot``, else ``~/.local/share/sandlot``."""
    env = os.environ.get("SANDLOT_HOME")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return (base / "sandlot").absolute()


def runtime_dir() -> Path:
    """A short, private directory for unix sockets (their paths are limited to 107 bytes).

    ``$SANDLOT_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/sandlot``, else ``/tmp/sandlot-<uid>``.
    A directory in /tmp is checked to belong to us and be private, so nobody else
    can plant sockets there.
    """
    env = os.environ.get("SANDLOT_RUNTIME_DIR")
    if env:
        path = Path(env)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "sandlot"
    else:
        path = Path(tempfile.gettempdir()) / f"sandlot-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HostSetupError(f"runtime directory {path} must be owned by uid {os.getuid()} with mode 0700")
    return path


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it into place on success.

    Readers see either nothing or the complete directory. If another process
    finished the same directory first, ours is discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
        else:
            fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write a file so that readers see the old content or the new, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
