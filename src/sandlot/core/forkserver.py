"""A warm start for lazy restore's helpers (``core/lazymem.py``): one process per home
that has imported what a helper runs and made the client of the home's storage tier,
and forks a helper for each lazy wake.

Why: a wake from the storage tier waits for its helper's first chunks, and a helper
spawned anew first starts Python, imports sandlot, libfuse's bindings and boto3, and
reads botocore's service model to make its client: about 0.3 s here before it can ask
the tier for anything, while the VM's first reads wait. A helper forked from this
process has all of that at once.

Each helper is still a process of its own (its own session, its own FUSE mount), as a
spawned one is: the fork server's death ends no VM; the next wake then spawns its
helper, and starts a fork server again for the wakes after it. The server forks only
while it is single-threaded (no thread runs in it, and it makes no request of the
tier, so the client it hands down holds no connection), and only for a caller of the
same Python and the same sandlot; each helper takes its caller's environment. It ends after ``IDLE``
seconds without a wake, when its home is gone, and when a module it loaded changed on
disk (sandlot upgraded under it), before it forks from old code.

The mechanism only: what it warms and what a forked child runs are the caller's
(``lazymem``: ``python -m sandlot.core.lazymem --fork-server HOME``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..config import HELPER_LOCK, runtime_dir, try_flock

log = logging.getLogger("sandlot")

IDLE = 3600.0  # seconds without a wake after which the server ends
LOOK_EVERY = 2.0  # seconds between its looks at its home (gone: it ends)
ASK_WAIT = 2.0  # seconds a launcher waits for the server's answer before it spawns its helper
REQUEST_MAX = 1 << 20  # bytes of a request (a directory and an environment)
CODE = Path(__file__).resolve()  # which sandlot: a server forks only for a launcher of the same


def _name(home: Path) -> str:
    return hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]


def socket_path(home: Path) -> Path:
    return runtime_dir() / f"forks-{_name(home)}"  # (short: a unix socket's path has 107 bytes)


def lock_path(home: Path) -> Path:
    """In the home (its log beside it), so that nothing of a home removed stays behind but
    its socket, which the server removes as it ends."""
    return home / "chunks" / ".forkserver.lock"


def fork_helper(home: Path, directory: Path) -> bool:
    """Ask the home's fork server for a helper serving ``directory`` (``lazymem.serve``'s);
    True if one was forked. The lock on ``directory/lock`` is taken here and handed to
    the helper, held from this moment on, as ``spawn_unless_locked`` hands a spawned
    helper its own; False (no server, or one that refused): the lock is free again."""
    path = socket_path(home)
    if not path.exists():
        return False
    lock = try_flock(directory / "lock")
    if lock is None:
        return False
    request = json.dumps({"directory": str(directory), "python": sys.executable, "code": str(CODE),
                          "env": dict(os.environ)})  # fmt: skip
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(ASK_WAIT)
            conn.connect(str(path))
            socket.send_fds(conn, [request.encode()], [lock])
            conn.shutdown(socket.SHUT_WR)
            answer = conn.recv(64).decode(errors="replace")
    except OSError as exc:
        log.info("the fork server of %s did not answer (%s): the helper is spawned", home, exc)
        return False
    finally:
        os.close(lock)  # the helper's copy holds it now, where one was forked
    if not answer.startswith("forked "):
        log.info("the fork server of %s refused (%s): the helper is spawned", home, answer.strip() or "-")
        return False
    return True


# -- the server ---------------------------------------------------------------------------------


def _loaded_files() -> dict[str, int]:
    """The file of each sandlot module loaded here, and its modification time."""
    out = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.split(".")[0] == "sandlot" and file:
            with contextlib.suppress(OSError):
                out[file] = os.stat(file).st_mtime_ns
    return out


def changed(loaded: dict[str, int]) -> bool:
    """Whether a module file of ``loaded`` changed or went since it was noted."""
    for file, mtime in loaded.items():
        try:
            if os.stat(file).st_mtime_ns != mtime:
                return True
        except OSError:
            return True
    return False


def _take(conn: socket.socket) -> tuple[dict[str, object], int | None]:
    """A launcher's request and the lock it handed down."""
    conn.settimeout(ASK_WAIT)
    data, fds, _, _ = socket.recv_fds(conn, REQUEST_MAX, 1)
    while len(data) < REQUEST_MAX and (more := conn.recv(REQUEST_MAX - len(data))):
        data += more
    lock = fds[0] if fds else None
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError(f"a request is a JSON object, not {type(request).__name__}")
    return request, lock


def _refusal(request: dict[str, object]) -> str | None:
    """Why this server does not fork a helper for ``request`` (None: it does)."""
    if request.get("python") != sys.executable or request.get("code") != str(CODE):
        return "another Python or another sandlot"
    directory = Path(str(request.get("directory", "")))
    if directory.parent != runtime_dir() or not directory.name.startswith("lazy-") or not directory.is_dir():
        return f"not a helper's directory: {directory}"
    if not isinstance(request.get("env"), dict):
        return "no environment"
    return None


Helper = Callable[[Path, Path], int]  # a forked child's work: (home, its directory) -> exit status


def _become(directory: Path, lock: int, env: dict[str, str]) -> None:
    """In the forked child: become what a spawn would have started."""
    os.setsid()  # its own session, as a spawned helper's: the server's end is not its
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its own children (fusermount3)
    os.environ.clear()
    os.environ.update({**env, "MALLOC_ARENA_MAX": "2", HELPER_LOCK: f"{lock}:{directory / 'lock'}"})


class Server:
    """The home's fork server: its lock, its socket, and what each child runs."""

    def __init__(self, home: Path, lock: int, helper: Helper) -> None:
        self.home, self.lock, self.helper = home, lock, helper
        self.path = socket_path(home)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.bound: int | None = None  # the inode of its socket file: removed at its end if still its

    def run(self) -> int:
        loaded = _loaded_files()
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its helpers are reaped as they end
        # bound under another name and renamed: a launcher finds it only once it is warm
        fresh = self.path.with_name(f".forks-{os.getpid()}")
        fresh.unlink(missing_ok=True)
        self.listener.bind(str(fresh))
        self.listener.listen(16)
        self.bound = os.stat(fresh).st_ino
        os.replace(fresh, self.path)
        log.info("fork server of %s ready (pid %d)", self.home, os.getpid())
        last = time.monotonic()
        while time.monotonic() - last < IDLE and self.home.is_dir() and not changed(loaded):
            if select.select([self.listener], [], [], LOOK_EVERY)[0]:
                conn, _ = self.listener.accept()
                last = time.monotonic()
                with conn:
                    self.answer(conn)
        return 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.bound is not None and os.stat(self.path).st_ino == self.bound:
                self.path.unlink()  # its own (a newer server's stays)
        self.listener.close()
        os.close(self.lock)

    def answer(self, conn: socket.socket) -> None:
        """Fork a helper for a launcher's request, or say why not. The lock handed down is
        closed here before the answer goes: the launcher may take it again at once."""
        lock = None
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            request, lock = _take(conn)
            why = "another user" if uid != os.getuid() else _refusal(request)
            if why is None and lock is None:
                why = "no lock handed down"
            if why is None and threading.active_count() > 1:  # a fork copies no thread but this one
                why = "a thread runs in the server"
            pid = None
            if why is None and lock is not None:
                env = request["env"]
                assert isinstance(env, dict)
                pid = os.fork()
                if pid == 0:  # the helper: none of the server's files
                    code = 1
                    try:
                        for fd in (conn.detach(), self.listener.detach(), self.lock):
                            os.close(fd)  # (detached: no socket object closes a number reused later)
                        directory = Path(str(request["directory"]))
                        _become(directory, lock, env)
                        code = self.helper(self.home, directory)
                    finally:
                        os._exit(code)
            if lock is not None:
                os.close(lock)  # the helper's copy holds it, where there is a helper
                lock = None
            conn.sendall(f"forked {pid}\n".encode() if pid is not None else f"refused: {why}\n".encode())
        except (OSError, ValueError) as exc:  # a launcher gone, or a request that is not one
            log.warning("a request to the fork server: %s", exc)
        finally:
            if lock is not None:
                os.close(lock)


def serve(home: Path, warm: Callable[[], None], helper: Helper) -> int:
    """Run as the home's fork server (its lock not held by another): ``warm`` first, then
    fork a child running ``helper`` for each launcher's request, until it ends."""
    logging.basicConfig(level=logging.INFO, filename=str(home / "chunks" / "forkserver.log"),
                        format="%(asctime)s %(levelname)s %(message)s")  # fmt: skip
    lock = try_flock(lock_path(home))
    if lock is None:
        return 0
    server = Server(home, lock, helper)
    try:
        warm()
        return server.run()
    except Exception as exc:  # the next wake spawns its helper, and starts another
        log.exception("fork server of %s: %s", home, exc)
        return 1
    finally:
        server.close()
