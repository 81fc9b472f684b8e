"""Where sandlot keeps things, and small helpers for writing them safely."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BoxBusy, HostSetupError
from .home import default_home as default_home  # where it was first: callers import it here too
from .home import home_path as home_path

if TYPE_CHECKING:
    import socket


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


def tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a log (a guest console, QEMU's or runsc's), read from
    at most its last ``max_bytes``; "" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").replace("\r\n", "\n").splitlines()[-lines:])


def meminfo() -> dict[str, int]:
    """``/proc/meminfo``'s figures (``MemTotal``, ``MemAvailable``, ...), in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def free_bytes(path: Path) -> int:
    """What an unprivileged writer may still write on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


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


def home_secret(path: Path) -> bytes:
    """A secret of the home kept in ``path`` (32 random bytes, 0600), made on first use.
    It is written whole beside its place and linked in, so no reader ever sees it half
    written, and of two processes making it at once the first link wins and both read its
    bytes. A file that is not 32 bytes is refused: a short key would make what it signs
    guessable."""
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            fsync_dir(path.parent)
        finally:
            os.unlink(tmp)
        secret = path.read_bytes()
    if len(secret) != 32:
        raise HostSetupError(f"{path} holds {len(secret)} bytes, not a 32-byte secret: remove it, and "
                             "what it signed (preview URLs, E2B sandbox tokens) is signed anew")  # fmt: skip
    return secret


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> int:
    """The bytes the files under ``root`` take on disk (sparse files: what was written);
    a file that goes meanwhile counts nothing."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


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


def private_listener(path: Path, kind: int, backlog: int) -> socket.socket:
    """A unix socket of ``kind`` listening at ``path``, mode 0600. A file a dead owner
    left there is replaced: the caller holds the lock that makes it the owner. It is
    bound under another name and renamed into place once it listens, so whoever finds
    the path can connect (never refused between bind and listen). The other name is
    short: a unix socket's path has 107 bytes at most, and one that fits must not be
    refused for the length of its temporary name."""
    import secrets
    import socket

    listener = socket.socket(socket.AF_UNIX, kind)
    tmp = path.with_name(f".{secrets.token_hex(3)}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    listener.bind(str(tmp))
    os.chmod(tmp, 0o600)
    listener.listen(backlog)
    os.replace(tmp, path)
    return listener


# inotify(7)'s events: an entry written, moved away or in, made, removed; the watched
# directory itself removed or moved
IN_MODIFY, IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x2, 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800


def inotify(path: Path, mask: int) -> int | None:
    """A non-blocking descriptor that turns readable on ``mask``'s events of ``path``
    (a directory: of its entries too); None where inotify cannot watch it. Read and
    drop what it holds (``drain``) before waiting on it again."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
        os.close(fd)
        return None
    return fd


def drain(fd: int) -> None:
    """Read and drop what a non-blocking descriptor holds."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


HELPER_LOCK = "SANDLOT_HELPER_LOCK"  # "FD:PATH": the lock a helper's starter took for it


def try_flock(path: Path) -> int | None:
    """An exclusive flock on ``path`` if free now: its fd, else None. In a helper that
    ``spawn_unless_locked`` started, the lock its starter took and handed down."""
    import fcntl

    if (fd := _handed_down(path)) is not None:
        return fd
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


FLOCK_POLL_MIN, FLOCK_POLL_MAX = 0.005, 0.1  # seconds between tries of a taken lock


def flock_wait(path: Path, timeout: float, what: str) -> int:
    """An exclusive flock on ``path``, waited for up to ``timeout`` seconds (tried
    without blocking, between short sleeps: a blocking ``flock`` has no deadline);
    ``BoxBusy`` naming ``what`` after that. For code outside an event loop."""
    import time

    pauses = _flock_pauses(timeout, what)
    while True:
        if (fd := try_flock(path)) is not None:
            return fd
        time.sleep(next(pauses))


async def flock_within(path: Path, timeout: float, what: str) -> int:
    """``flock_wait`` for a coroutine: the loop runs while it waits. Cancelled while
    waiting, it holds nothing (a blocking ``flock`` in a worker thread would take
    the lock after its caller had gone, and hold it for as long as the process runs)."""
    import asyncio

    pauses = _flock_pauses(timeout, what)  # another process holds it: nothing here to wait on
    while True:
        if (fd := try_flock(path)) is not None:
            return fd
        await asyncio.sleep(next(pauses))


def _flock_pauses(timeout: float, what: str) -> Iterator[float]:
    """The sleeps between tries of a taken lock, growing; ``BoxBusy`` once ``timeout``
    seconds have gone by."""
    import time

    deadline = time.monotonic() + timeout
    pause = FLOCK_POLL_MIN
    while time.monotonic() <= deadline:
        yield pause
        pause = min(pause * 2, FLOCK_POLL_MAX)
    raise BoxBusy(f"another process has been busy with {what} for {timeout:.0f}s")


def _handed_down(path: Path) -> int | None:
    """The lock on ``path`` this process's starter took for it, once (see
    ``spawn_unless_locked``); None where there is none."""
    number, _, named = os.environ.get(HELPER_LOCK, "").partition(":")
    try:
        if not (number.isdigit() and os.path.samestat(os.stat(named), os.stat(path))):
            return None
        fd = int(number)
        same = os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return None
    del os.environ[HELPER_LOCK]  # neither taken twice nor passed on to its children
    if not same:  # not the fd it was: nothing to take
        return None
    os.set_inheritable(fd, False)
    return fd


def spawn_unless_locked(
    lock: Path, module: str, *args: str, cwd: str | None = None, env: dict[str, str] | None = None
) -> bool:
    """Start ``python -m module args`` as a detached process (its own session, no
    standard streams) unless the process that holds ``lock`` runs already: each such
    helper takes its lock first (``try_flock``), so at most one runs. True if one was
    started. ``env``: its environment besides this process's.

    The lock taken here passes to the helper, held from this moment on: a helper that
    took it itself would take it only once it had imported sandlot (seconds, on a
    loaded host), and every caller meanwhile would start another."""
    import subprocess
    import sys

    fd = try_flock(lock)
    if fd is None:
        return False
    try:
        # Through a shell that puts it in the background and exits at once, waited for
        # here: the helper is then no child of this process, which leaves neither a zombie
        # when it ends nor a Popen still running when it is collected (a ResourceWarning).
        subprocess.run(
            ["/bin/sh", "-c", '"$0" -m "$@" &', sys.executable, module, *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True, pass_fds=(fd,), cwd=cwd, check=False,
            env={**os.environ, **(env or {}), HELPER_LOCK: f"{fd}:{lock}"},
        )  # fmt: skip
    finally:
        os.close(fd)  # the helper's copy holds the lock now (or none, where it did not start)
    return True


_compiler_versions: dict[str, list[str]] = {}


def compiler_version(cc: str) -> list[str]:
    """The first line of ``cc --version`` (asked once per process)."""
    if cc not in _compiler_versions:
        import subprocess  # not at the top: most importers of this module never build

        out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        _compiler_versions[cc] = out.splitlines()[:1]
    return _compiler_versions[cc]


def build_c(
    dest: Path, name: str, sources: Sequence[Path], cc: Sequence[str], flags: Sequence[str]
) -> tuple[Path, str]:
    """The binary ``name`` built from ``sources`` (``.c`` and ``.h``) under ``dest``
    (``dest`` is ``<area>/<kind>``: the hash is appended); its path and digest.
    ``HostSetupError`` with the compiler's complaint if the build fails.

    The guest agent and the egress relay are C because they run where Python would
    cost too much (as the guest's init; once per guest connection). A build is cached
    under ``dest-<hash>/``, the hash covering the sources, the compiler and the flags,
    so an upgrade rebuilds and two versions live side by side; it is renamed into
    place whole, so two processes building at once never see half a binary."""
    import subprocess

    h = hashlib.sha256()
    h.update(repr((list(cc), list(flags), compiler_version(cc[0]))).encode())
    for f in sources:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    digest = h.hexdigest()[:16]
    final = dest.parent / f"{dest.name}-{digest}"
    binary = final / name
    if binary.exists():
        return binary, digest
    with atomic_dir(final) as tmp:
        cmd = [*cc, *flags, "-o", str(tmp / name), *[str(f) for f in sources if f.suffix == ".c"]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise HostSetupError(f"building {name} failed ({' '.join(cmd[:2])}):\n{proc.stderr[-4000:]}")
    return binary, digest
