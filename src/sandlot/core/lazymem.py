"""Lazy restore: a saved state's memory, served from its chunks as the VM touches it
(docs/storage.md, "Deep sleep and lazy restore").

A VM resumed the usual way gets its whole memory streamed into it before its first
instruction: from a state evicted to the storage tier, that is every chunk of its RAM
fetched over the network first. Here the engine maps its RAM copy-on-write from a file
(``memory``) on a FUSE mount that a helper process serves, and the stream it loads
carries the devices and the small RAM blocks only. The guest runs at once; a page it
touches is read through the mount, and the helper fetches, checks and unpacks the
64 KiB chunk that holds it at that moment. Meanwhile the helper fetches every other
chunk: first those the last lazy wake of the box touched (``touched``: the order a
wake asks for its memory in is much the same each time), then the rest in address
order. What it has is kept in a sparse file in the box's directory (on the home's disk,
not the runtime directory, often a small tmpfs; unlinked as soon as it is open, so a
killed helper leaves none), so that chunks collected after the wake (the state it woke
from is dropped) are never needed again.

    python -m sandlot.core.lazymem HOME DIR      (DIR: manifest, image, touched; made by ``serve``)
    python -m sandlot.core.lazymem --fork-server HOME      (``start_fork_server``)

The helper lives as long as the VM's mapping: QEMU keeps the file open while it runs,
and when its last reference goes (the VM ended, was suspended or stopped) the helper
unmounts and exits. It is part of the VM: killed, the VM's next touch of memory not
yet read fails, as if QEMU had been killed. It is started with ``auto_unmount`` where
``fusermount3`` is installed, so a killed helper's mount goes with it where nothing maps
it; one a VM still mapped is detached by the next ``serve``'s sweep.

Written on ``mfusepy`` (libfuse through ctypes): one file, read only, in a process of
its own; userfaultfd would need the faults of QEMU's own process (postcopy, whose
source side QEMU alone speaks), and nothing else maps a file lazily.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..config import atomic_write, runtime_dir, spawn_unless_locked, try_flock
from . import forkserver, tier
from .chunks import TIER_RUNS, ChunkStore, KeptLater, StateReader
from .manifest import CHUNK, Image, Manifest

log = logging.getLogger("sandlot")

READY_WAIT = 15.0  # seconds a launcher waits for the helper's mount before it loads the state whole
OPEN_WAIT = 120.0  # seconds the helper waits for the VM to open its memory before it gives up
TOUCH_WINDOW = 3.0  # seconds after the VM opens its memory in which what it reads is its wake's
AROUND = 16  # chunks a read of the VM brings: the one it reads and those after it (1 MiB)
FILL_RUN = 64  # chunks the fill asks for together
# chunks of memory not on this host from which ``auto`` is lazy. Measured here (moto's
# S3 server on 127.0.0.1, TCG, 2 cores, chunks read from packs in runs): a request to a
# box with 440 such chunks took 0.98 s fetched first; with 850, 1.72 s fetched first and
# 1.62 s lazily (even, and a helper held for the box's life); with 1,750, 4.1 s fetched
# first and 2.0 s lazily
LAZY_FROM = 1024
LOG_KEPT = 256 << 10  # bytes of its lazy wakes' logs a box keeps
CALM_WAIT = 1.0  # seconds at most a fill fetch holds back for the VM's own reads
_INDEX = struct.Struct("<I")
STARTED = time.monotonic()


def mode() -> str:
    """``$SANDLOT_LAZY_RESTORE``: ``auto`` (the default: a state with ``LAZY_FROM`` chunks
    of memory or more not on this host), ``always`` (every state of chunks) or ``never``."""
    from ..errors import InvalidArgument

    raw = os.environ.get("SANDLOT_LAZY_RESTORE", "auto") or "auto"
    if raw not in ("auto", "always", "never"):
        raise InvalidArgument(f"SANDLOT_LAZY_RESTORE must be auto, always or never, not {raw!r}")
    return raw


def unavailable() -> str | None:
    """Why this host cannot serve memory lazily (None: it can)."""
    import importlib.util

    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is missing or not usable by this user"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt install fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is not installed (apt install fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the mfusepy package is not installed (pip install 'sandlot[storage]')"
    return None


def wanted(store: ChunkStore, image: Image) -> bool:
    """Whether a resume of ``image`` should be lazy, by ``mode`` and this host."""
    how = mode()
    if how == "never":
        return False
    if how == "auto":
        elsewhere = sum(1 for d in image.digests if d and not store.path(d).exists())
        if elsewhere < LAZY_FROM:
            return False
    why = unavailable()
    if why is not None:
        log.info("resuming with the whole memory read first: %s", why)
    return why is None


def lazily(home: Path, source: StateReader, image: str, touched: Path) -> Served | None:
    """A helper serving ``image`` of ``source``'s state, where a resume of it should be lazy
    (``wanted``) and the helper starts; else None (the state is loaded whole)."""
    if image not in source.images() or not wanted(source.store, source.manifest.image(image)):
        return None
    return serve(home, source.manifest.encode(), source.whose, image, touched)


def read_touched(path: Path, chunks: int) -> list[int]:
    """The chunk indexes a wake asked for first, in its order (unreadable: none)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    if len(data) % _INDEX.size:
        return []
    return [i for (i,) in _INDEX.iter_unpack(data) if i < chunks]


# -- the launcher's side ----------------------------------------------------------------------


class Served:
    """A helper serving one image: ``memory`` is the file to map."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.memory = directory / "mnt" / "memory"

    def alive(self) -> bool:
        """Whether its helper runs: it holds the directory's lock. The lock file is opened,
        never made: a look while the helper removes its directory must not put a file back
        in it (its removal would then leave the directory behind)."""
        import fcntl

        try:
            fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # it ended, and took its directory with it
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def stop(self) -> None:
        """End a helper whose VM never mapped its memory (a launch that failed)."""
        _unmount(self.directory / "mnt")


def serve(home: Path, manifest: bytes, whose: str, image: str, touched: Path) -> Served | None:
    """Start a helper serving ``image`` of a state (its manifest, encoded) and wait for its
    mount; None where it could not start (the caller then loads the state whole)."""
    import secrets

    _sweep()
    directory = runtime_dir() / f"lazy-{secrets.token_hex(6)}"
    directory.mkdir(mode=0o700)
    (directory / "mnt").mkdir()
    atomic_write(directory / "manifest", manifest, 0o600)
    atomic_write(directory / "request", f"{whose}\n{image}\n{touched}\n".encode(), 0o600)
    size = Manifest.decode(manifest, whose).image(image).size
    served = Served(directory)
    forked = forkserver.fork_helper(home, directory)  # warm: Python, its imports and the tier's client
    if not forked:
        # two heaps for its threads, not eight a core: each held what a fill's run left in
        # it, for as long as the VM ran (about 50 MiB more here)
        spawn_unless_locked(directory / "lock", "sandlot.core.lazymem", str(home), str(directory),
                            env={"MALLOC_ARENA_MAX": "2"})  # fmt: skip
    deadline = time.monotonic() + READY_WAIT
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if served.memory.stat().st_size == size:
                if not forked and tier.configured_quickly(home):
                    start_fork_server(home)  # for the wakes after this one
                return served
        if not served.alive():
            break
        time.sleep(0.005)
    from ..config import tail

    why = tail(directory / "helper.log", 10) if (directory / "helper.log").exists() else ""
    log.warning("lazy restore of %s did not start; its memory is read whole: %s", whose, why.strip() or "-")
    served.stop()
    shutil.rmtree(directory, ignore_errors=True)
    return None


def start_fork_server(home: Path) -> bool:
    """Start the home's fork server (``core/forkserver.py``) unless one runs: a detached
    process that forks this module's helpers warm. True if started; a home with no chunk
    store has no state a helper could serve, and gets none."""
    if not (home / "chunks").is_dir():
        return False
    # two heaps for its helpers' threads, not eight a core (see ``serve``)
    return spawn_unless_locked(forkserver.lock_path(home), "sandlot.core.lazymem", "--fork-server", str(home),
                               env={"MALLOC_ARENA_MAX": "2"})  # fmt: skip


def _warm(home: Path) -> None:
    """What a forked helper then has at once: the modules it runs, and the client of the
    home's tier, where it has one (botocore's service model read; no request made)."""
    import blake3  # noqa: F401
    import mfusepy  # noqa: F401
    import zstandard  # noqa: F401

    from . import boxrecord, packs, store  # noqa: F401

    remote = ChunkStore(home).tier()
    if remote is not None:
        remote.client  # noqa: B018


def helpers() -> list[tuple[Path, int]]:
    """The helpers running for this user: each one's directory and pid."""
    out = []
    for d in runtime_dir().glob("lazy-*"):
        with contextlib.suppress(OSError, ValueError):
            pid = int((d / "pid").read_text())
            if Served(d).alive():
                out.append((d, pid))
    return out


def _sweep() -> None:
    """Remove what killed helpers left in the runtime directory, their mounts too (lazily);
    a directory younger than ``READY_WAIT`` may be one a launcher is making."""
    mounts = Path("/proc/self/mounts").read_text()
    for d in runtime_dir().glob("lazy-*"):
        with contextlib.suppress(OSError):
            young = time.time() - d.stat().st_mtime < 4 * READY_WAIT
            if not young and not Served(d).alive():
                if f" {d / 'mnt'} " in mounts:  # one auto_unmount could not take (its VM mapped it)
                    _unmount(d / "mnt")
                shutil.rmtree(d, ignore_errors=True)


# -- the helper --------------------------------------------------------------------------------


class Memory:
    """One memory image, read from its chunks as it is asked for, kept in ``cache``."""

    def __init__(self, store: ChunkStore, image: Image, whose: str, cache: Path, keep: KeptLater) -> None:
        self.store, self.image, self.whose = store, image, whose
        self.keep = keep  # what it fetches is kept in the home's store too, by a thread of its own
        self.fd = os.open(cache, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(cache)  # this process's alone: gone with it, however it ends
        os.ftruncate(self.fd, image.size)  # sparse: a chunk of zeros is never written
        self.present = bytearray(d is None for d in image.digests)
        self._busy: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        # the VM's reads waiting on a fetch: the fill holds back while there are any, so
        # that the store answers them first, not after the fill's queue of requests
        self._wanting = 0
        self._calm = threading.Condition(self._lock)
        self.failed: str | None = None
        self.asked: list[int] = []  # the chunks of data the VM read in its first moments, in order
        self._seen = bytearray(self.present)  # zeros are never worth a fetch ahead
        self.asking_until = float("inf")
        self.waited = 0  # reads that waited for a chunk the fill had not brought yet
        self.fetched = 0

    def ensure(self, index: int, *, asked: bool = False) -> None:
        """Chunk ``index`` in the cache, fetched now unless it is there or on its way; with
        it, the chunks after it that are not (``AROUND``): what a guest touches lies in runs,
        and neighbours in a pack come in one read (``core.packs``)."""
        if asked and not self._seen[index]:
            with self._lock:
                if not self._seen[index] and time.monotonic() < self.asking_until:
                    self._seen[index] = 1
                    self.asked.append(index)
        if self.present[index]:
            return
        with self._lock:
            self.waited += asked
            self._wanting += asked
        try:
            tries = 0
            while not self.present[index]:
                with self._lock:
                    busy = self._busy.get(index)
                if busy is not None:
                    busy.wait()
                elif tries < 2:  # a run that failed for another chunk of it: once more
                    tries += 1
                    self.bring(range(index, min(index + AROUND, len(self.present))))
                else:
                    break
        finally:
            if asked:
                with self._lock:
                    self._wanting -= 1
                    if not self._wanting:
                        self._calm.notify_all()
        if not self.present[index]:
            raise OSError(errno.EIO, f"chunk {index} could not be read: {self.failed}")

    def bring(self, indexes: Iterable[int]) -> None:
        """Fetch those of ``indexes`` that are neither here nor on their way, in one
        ``get_many`` (a chunk of zeros is always here)."""
        with self._lock:
            mine = [i for i in indexes if not self.present[i] and i not in self._busy]
            busy = threading.Event()
            for i in mine:
                self._busy[i] = busy
        if not mine:
            return
        try:
            try:
                self._fetch(mine)
            except Exception:
                if len(mine) == 1:
                    raise
                for i in mine:  # one bad chunk fails its run: the others, each alone
                    with contextlib.suppress(Exception):
                        self._fetch([i])
                if not all(self.present[i] for i in mine):
                    raise
        except Exception as exc:
            named = (i for i in mine if (self.image.digests[i] or b"").hex() in str(exc))
            self.failed = f"chunk {next(named, mine[0])}: {exc}"
            log.error("lazy restore of %s: %s", self.whose, self.failed)
        finally:
            with self._lock:
                for i in mine:
                    self._busy.pop(i, None)
            busy.set()

    def _fetch(self, indexes: list[int]) -> None:
        wanted = [(d, self.image.chunk_size(i)) for i in indexes if (d := self.image.digests[i]) is not None]
        got = self.store.get_many(wanted, self.whose, keep=self.keep)  # (zeros are present from the start)
        for i, data in zip(indexes, got, strict=True):
            os.pwrite(self.fd, data, i * CHUNK)
            self.present[i] = 1
        self.fetched += len(indexes)

    def read(self, size: int, offset: int) -> bytes:
        end = min(offset + size, self.image.size)
        if offset >= end:
            return b""
        for index in range(offset // CHUNK, (end - 1) // CHUNK + 1):
            self.ensure(index, asked=True)
        return os.pread(self.fd, end - offset, offset)

    def fill(self, first: list[int], workers: int) -> None:
        """Bring every chunk, ``first`` first, ``FILL_RUN`` at a time."""
        order = list(dict.fromkeys(i for i in first if not self.present[i]))
        early = set(order)
        order += [i for i in range(len(self.image.digests)) if not self.present[i] and i not in early]

        def one(run: list[int]) -> None:
            with self._calm:
                self._calm.wait_for(lambda: not self._wanting, timeout=CALM_WAIT)
            self.bring(run)  # a chunk that fails: the VM's own read of it says so, if it comes

        runs = [order[k : k + FILL_RUN] for k in range(0, len(order), FILL_RUN)]
        with ThreadPoolExecutor(workers, thread_name_prefix="sandlot-fill") as pool:
            list(pool.map(one, runs))

    def complete(self) -> bool:
        return all(self.present)


def _unmount(mountpoint: Path) -> None:
    """Detach a mount of this user (lazily: a VM mapping it keeps what it has)."""
    import subprocess

    if shutil.which("fusermount3"):
        subprocess.run(["fusermount3", "-u", "-z", "-q", str(mountpoint)], capture_output=True, check=False)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(str(mountpoint).encode(), 2)  # MNT_DETACH


def _operations(memory: Memory, on_last_release: Any) -> Any:
    import mfusepy

    uid, gid, now = os.getuid(), os.getgid(), time.time_ns()

    class Operations(mfusepy.Operations):  # type: ignore[misc]
        use_ns = True

        def __init__(self) -> None:
            self.opened = 0
            self.mutex = threading.Lock()  # not ``lock``: that name is FUSE's POSIX lock operation

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            times = {"st_atime": now, "st_mtime": now, "st_ctime": now, "st_uid": uid, "st_gid": gid}
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o700, "st_nlink": 2, **times}
            if path == "/memory":
                return {"st_mode": stat.S_IFREG | 0o600, "st_nlink": 1, "st_size": memory.image.size, **times}
            raise mfusepy.FuseOSError(errno.ENOENT)

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", "memory"]

        def open(self, path: str, flags: int) -> int:
            if path != "/memory":
                raise mfusepy.FuseOSError(errno.ENOENT)
            with self.mutex:
                self.opened += 1
                if memory.asking_until == float("inf"):
                    memory.asking_until = time.monotonic() + TOUCH_WINDOW
                    log.info("opened %.3fs after start", time.monotonic() - STARTED)
            return 0

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            try:
                return memory.read(size, offset)
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno or errno.EIO) from None

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            raise mfusepy.FuseOSError(errno.EROFS)  # the VM maps it copy-on-write: its writes stay its own

        def truncate(self, path: str, length: int, fh: int | None = None) -> None:
            if length != memory.image.size:
                raise mfusepy.FuseOSError(errno.EROFS)

        def release(self, path: str, fh: int) -> int:
            with self.mutex:
                self.opened -= 1
                last = self.opened == 0
            if last:
                on_last_release()
            return 0

    return Operations()


def run(home: Path, directory: Path) -> int:
    import mfusepy

    lock = try_flock(directory / "lock")
    if lock is None:
        return 0
    mountpoint = directory / "mnt"
    try:
        # who it is, where ``helpers`` finds it: a forked helper's command line is its fork server's
        atomic_write(directory / "pid", f"{os.getpid()}\n".encode(), 0o600)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, b"sandlot-lazymem", 0, 0, 0)  # PR_SET_NAME: what ps and top show
        whose, image_name, touched_name = (directory / "request").read_text().splitlines()[:3]
        manifest = Manifest.decode((directory / "manifest").read_bytes(), whose)
        image = manifest.image(image_name)
        store = ChunkStore(home)
        touched = Path(touched_name)
        near = touched.parent if touched.parent.is_dir() else directory
        keep = KeptLater(store)
        memory = Memory(store, image, whose, near / f".{directory.name}.cache", keep)
        ended = threading.Event()

        def last_release() -> None:
            ended.set()
            threading.Thread(target=_unmount, args=(mountpoint,), daemon=True).start()

        def filling() -> None:
            t0 = time.monotonic()
            with store.using():  # no collection takes a chunk before it is in the cache, or kept
                first = read_touched(touched, len(image.digests))
                try:
                    memory.fill(first, TIER_RUNS)  # runs at once, from the tier or this host's disk
                finally:
                    keep.close()  # the VM's reads keep their own from now on (what the fill could not bring)
            with contextlib.suppress(OSError, AttributeError):
                # the fill's runs were large buffers, freed now: the C heap gives them back,
                # so that the helper holds what Python and boto3 need while its VM runs on
                ctypes.CDLL(None).malloc_trim(0)
            log.info("%s: %d chunks in %.2fs, %d of them read by the VM first, %d waited for (%s)",
                     whose, memory.fetched, time.monotonic() - t0, len(memory.asked), memory.waited,
                     "complete" if memory.complete() else f"incomplete: {memory.failed}")  # fmt: skip
            with contextlib.suppress(Exception):  # a figure, never a reason to fail
                from .boxrecord import store_path
                from .store import BoxStore

                store.tally(BoxStore(store_path(home)))

        def keep_touched() -> None:
            # every chunk of data the VM read in its first TOUCH_WINDOW: the next wake's first fetches
            while not ended.wait(1.0) and time.monotonic() < memory.asking_until:
                pass
            if memory.asked and touched.parent.is_dir():
                with contextlib.suppress(OSError):
                    atomic_write(touched, b"".join(_INDEX.pack(i) for i in memory.asked), 0o600)

        def watch_open() -> None:
            if not ended.wait(OPEN_WAIT) and memory.asking_until == float("inf"):
                log.warning("%s: no VM opened its memory in %.0fs", whose, OPEN_WAIT)
                last_release()

        jobs = [threading.Thread(target=job, daemon=True, name=f"sandlot-{job.__name__}")
                for job in (filling, keep_touched, watch_open)]  # fmt: skip
        for job in jobs:
            job.start()
        options: dict[str, Any] = {
            "foreground": True,
            "fsname": "sandlot-memory",
            "kernel_cache": True,
            "max_readahead": CHUNK,
        }
        if shutil.which("fusermount3"):
            options["auto_unmount"] = True
        mfusepy.FUSE(_operations(memory, last_release), str(mountpoint), **options)
        ended.set()
        jobs[1].join(5.0)  # what this wake read first, kept before the process ends
        return 0
    finally:
        with contextlib.suppress(OSError):
            os.close(lock)
        _unmount(mountpoint)
        _keep_log(directory)
        shutil.rmtree(directory, ignore_errors=True)


def _keep_log(directory: Path) -> None:
    """The helper's log, added to the box's (in its state directory), which keeps its last
    ``LOG_KEPT`` bytes: a box woken lazily again and again never grows it past that."""
    with contextlib.suppress(OSError, ValueError):
        touched = Path((directory / "request").read_text().splitlines()[2])
        if touched.parent.is_dir():
            kept = touched.parent / "lazymem.log"
            before = kept.read_bytes() if kept.exists() else b""
            atomic_write(kept, (before + (directory / "helper.log").read_bytes())[-LOG_KEPT:], 0o600)


def main(argv: list[str], how: str = "spawned") -> int:
    if len(argv) == 2 and argv[0] == "--fork-server":
        home = Path(argv[1])

        def forked(home: Path, directory: Path) -> int:
            return main([str(home), str(directory)], "forked by the home's fork server")

        return forkserver.serve(home, lambda: _warm(home), forked)
    if len(argv) != 2:
        print("usage: python -m sandlot.core.lazymem HOME DIR | --fork-server HOME", file=sys.stderr)
        return 2
    directory = Path(argv[1])
    # (force: in a helper forked by the fork server, its own log replaces the server's)
    logging.basicConfig(level=logging.INFO, filename=str(directory / "helper.log"),
                        format="%(asctime)s %(levelname)s %(message)s", force=True)  # fmt: skip
    global STARTED
    STARTED = time.monotonic()  # (a forked helper's module was imported long before)
    log.info("helper %s", how)
    try:
        return run(Path(argv[0]), directory)
    except Exception as exc:  # said in the log the launcher reads
        log.exception("lazy restore helper: %s", exc)
        return 1


def touched_of(state_dir: Path) -> Path:
    """Where a box keeps what its last lazy wake touched first."""
    return state_dir / "memory-touched"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
