"""The home's chunk store: saved state as content-addressed chunks, each kept once.

A chunk is a piece of a saved state (``core.manifest``: 64 KiB of a VM's memory, or of
one of its byte streams), named by the BLAKE3 hash of its bytes and kept compressed
(zstd) in ``chunks/<2 hex>/<62 hex>``. A save writes only the chunks the store lacks,
so a checkpoint costs what changed since any state of the home, not a copy of the VM's
memory; and every state of every box, template and fork shares what they hold alike.

Who may delete what, across processes:
- The store's ``chunks`` table counts, for each chunk, the saved states whose manifests
  list it; a state's row and its counts are written in one transaction, and deleted in
  one. A chunk whose count falls to zero is garbage.
- Everyone who writes or reads chunks holds ``chunks/.lock`` shared (``using``) for as
  long as a chunk it found there must stay: a save from its first dedup to its row's
  commit, a restore until its stream is read. The collector (``collect``) holds it
  exclusively, so it never deletes a chunk a save just counted on finding, or one a
  restore is reading; it does not wait for them (it runs again later).
- A save makes its chunks durable (``syncfs``) before its row is committed: a committed
  state never names a chunk a crash could lose. A chunk written by a save that never
  committed has no row: ``collect(orphans=True)`` deletes it once it is older than
  ``ORPHAN_AGE``.

Every chunk is checked against its hash when it is read: a damaged or missing one is a
``CorruptSnapshot`` naming the state and the chunk, never a garbled guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import itertools
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..crashpoints import crash_point
from ..engine.base import ImageSink, StateSink, StateSource
from ..errors import CorruptSnapshot, SandlotError, SavedStateError, no_space
from . import packs, tier
from .manifest import CHUNK, Image, Manifest, Stream
from .store import BoxStore

if TYPE_CHECKING:
    import zstandard

ORPHAN_AGE = 60.0  # seconds before a chunk no state counts may be a crash's leftover
LEVEL = 3  # zstd's default: ~570 MB/s here, within a few percent of level 1's ratio on memory
LOCK_WAIT = 120.0  # seconds a user of the store waits for a collection to end
READ_AHEAD = 16  # chunks read and checked ahead of the one a restore's stream needs
TIER_RUN = 64  # chunks of a state asked of the tier together as it loads (neighbours share a read)
TIER_RUNS = 4  # runs asked for at once (a state's load, a lazy restore's fill)
ZERO = bytes(CHUNK)


def enabled() -> bool:
    """Whether states are saved as chunks (``SANDLOT_STATE_CHUNKS=0``: whole files per
    state, each snapshot stopping the guest for all of its save, as sandlot did before
    chunks; for comparisons)."""
    return os.environ.get("SANDLOT_STATE_CHUNKS", "1") != "0"


def digest(data: bytes | bytearray | memoryview) -> bytes:
    import blake3  # here: a command that never saves or loads a state (``sandlot ls``) never needs it

    return blake3.blake3(data).digest()


class KeptLater:
    """Chunks fetched from the tier, written into the home's store by a thread of this
    object's rather than by the reader that fetched them: a lazy restore's VM waits on
    its reads, and the files of a run of chunks (a create, a write and a rename each)
    took about a sixth of a wake from the tier (measured: 1.43 s to 1.17 s, the median
    of six wakes). At most ``limit`` bytes wait; past that, and once closed, a reader
    writes its own. As a context manager, it is closed when the block ends."""

    def __init__(self, store: ChunkStore, limit: int = 16 << 20) -> None:
        import queue

        self.store, self.limit = store, limit
        self._queue: queue.SimpleQueue[tuple[bytes, bytes] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # bytes queued, not yet written
        self._closed = False
        self._thread = threading.Thread(target=self._write_all, name="sandlot-keep", daemon=True)
        self._thread.start()

    def put(self, d: bytes, packed: bytes) -> None:
        with self._lock:
            later = not self._closed and self._waiting + len(packed) <= self.limit
            if later:
                self._waiting += len(packed)
                self._queue.put((d, packed))
        if not later:
            self.store.keep(d, packed)

    def __enter__(self) -> KeptLater:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Write what waits, and end the thread."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    def _write_all(self) -> None:
        while (item := self._queue.get()) is not None:
            d, packed = item
            self.store.keep(d, packed)
            with self._lock:
                self._waiting -= len(packed)


class ChunkStore:
    """The chunk files of one home. Cheap to create; thread-safe."""

    def __init__(self, home: Path, db: BoxStore | None = None) -> None:
        self.home = home
        self.root = home / "chunks"
        self._zc = threading.local()
        self._tier: tier.Tier | bool | None = False  # False: not looked up yet
        self._tier_lock = threading.Lock()
        self._db = db  # the home's store (the tier's places), where the caller has it open

    def tier(self) -> tier.Tier | None:
        """The home's storage tier, where one is configured (looked up once)."""
        with self._tier_lock:
            if self._tier is False:
                config = tier.configured(self.home)
                self._tier = tier.Tier(config) if config is not None else None
            assert self._tier is not True
            return self._tier

    def path(self, d: bytes) -> Path:
        h = d.hex()
        return self.root / h[:2] / h[2:]

    def size(self, d: bytes) -> int | None:
        """The stored (compressed) size of a chunk the store has; None if it has not."""
        try:
            return os.stat(self.path(d)).st_size
        except FileNotFoundError:
            return None

    def _compressor(self) -> zstandard.ZstdCompressor:
        import zstandard

        zc = getattr(self._zc, "c", None)
        if zc is None:
            zc = self._zc.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
        return zc

    def put(self, d: bytes, data: bytes | bytearray | memoryview) -> int:
        """Keep ``data`` (whose digest is ``d``) unless it is kept already; the bytes it
        took on disk (0 if it was there). Its file is whole or absent, never half."""
        final = self.path(d)
        if final.exists():
            return 0
        return self._write(final, self._compressor().compress(data))

    def _write(self, final: Path, packed: bytes) -> int:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                f.write(packed)
            crash_point("chunks.mid-write")
            os.rename(tmp, final)  # a racing writer of the same chunk wrote the same bytes
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(self.root, "a saved state's chunks could not be written") from None
            raise
        return len(packed)

    def get(self, d: bytes, whose: str, size: int | None = None, *, keep: bool = True) -> bytes:
        """A chunk's bytes, checked against its hash (and ``size`` where known). A damaged
        chunk is put aside (``damaged/``): the next save that holds its bytes (a box that
        still has them in memory) then writes it again instead of counting on it. One this
        home lacks comes from its storage tier, and stays here (``keep``: a chunk of a
        state of the home; not a chunk of a disk file being pulled)."""
        return self.get_many([(d, size)], whose, keep=keep)[0]

    def get_many(
        self, wanted: Sequence[tuple[bytes, int | None]], whose: str, *, keep: bool | KeptLater = True
    ) -> list[bytes]:
        """``get`` of each chunk (its hash and size), in order: those this home lacks are
        asked of the tier together, neighbours in a pack in one read (``core.packs``), and
        kept here (``keep``: at once, or by a ``KeptLater``'s thread)."""
        held: dict[bytes, bytes] = {}
        for d, _ in wanted:
            with contextlib.suppress(FileNotFoundError):
                held[d] = self.path(d).read_bytes()
        fetched = self._fetch([d for d, _ in wanted if d not in held])
        out = []
        for d, size in wanted:
            packed = held.get(d)
            if packed is None:
                packed = fetched.get(d)
                if packed is None:
                    raise CorruptSnapshot(f"saved state {whose}: its chunk {d.hex()} is missing")
            out.append(self._checked(d, packed, whose, size, fetched=d not in held))
            if d not in held and keep:  # kept here again: the next load of it reads the disk
                held[d] = packed
                if isinstance(keep, KeptLater):
                    keep.put(d, packed)
                else:
                    self.keep(d, packed)
        return out

    def keep(self, d: bytes, packed: bytes) -> None:
        """Keep a chunk fetched from the tier (as the tier holds it, compressed; checked by
        the caller) where the next load of it reads it; a full disk keeps none: the tier
        has it."""
        with contextlib.suppress(OSError):
            self._write(self.path(d), packed)

    def _checked(self, d: bytes, packed: bytes, whose: str, size: int | None, *, fetched: bool) -> bytes:
        import zstandard

        try:
            data = unpack(packed)
            why = "its bytes do not match its hash" if digest(data) != d else None
            if why is None and size is not None and len(data) != size:
                why = f"{len(data)} bytes where its state has {size}"
        except zstandard.ZstdError as exc:
            why = str(exc)
        if why is None:
            return data
        if fetched:
            raise CorruptSnapshot(
                f"saved state {whose}: its chunk {d.hex()} in the storage tier is damaged ({why})"
            )
        with contextlib.suppress(OSError):
            (self.root / "damaged").mkdir(exist_ok=True)
            os.rename(self.path(d), self.root / "damaged" / d.hex())
        raise CorruptSnapshot(f"saved state {whose}: its chunk {d.hex()} is damaged ({why})")

    def packed(self, d: bytes, whose: str) -> bytes:
        """A chunk as the store keeps it (zstd), checked: for an archive that carries it."""
        self.get(d, whose)  # checked (and brought from the tier where it is only there)
        return self.path(d).read_bytes() if self.path(d).exists() else self._fetch([d]).get(d, b"")

    def put_packed(self, d: bytes, packed: bytes, whose: str) -> int:
        """Keep a chunk given as the store keeps it (an archive's), once it is checked
        against its name; the bytes it took (0 if it was there)."""
        import zstandard

        try:
            data = unpack(packed)
        except zstandard.ZstdError as exc:
            raise CorruptSnapshot(f"{whose}: its chunk {d.hex()} is damaged ({exc})") from None
        if digest(data) != d:
            raise CorruptSnapshot(f"{whose}: its chunk {d.hex()} does not match its hash (damaged, altered)")
        final = self.path(d)
        return 0 if final.exists() else self._write(final, packed)

    def _fetch(self, wanted: list[bytes]) -> dict[bytes, bytes]:
        """Chunks this home does not hold, from its storage tier, as kept (unchecked): those
        in packs by their places, the rest each as an object of its own (what older homes
        sent); one the tier lacks is not in the answer."""
        remote = self.tier() if wanted else None
        if remote is None:
            return {}
        places = packs.tier_places(self.db(), wanted)
        gone: set[bytes] = set()
        found = packs.read(remote, places, gone) if places else {}
        if gone:  # packs a collection wrote again since this home learned their places
            for pack in gone:
                if (went := packs.moved(remote, pack)) is not None:
                    packs.add_places(self.db(), went)
            now = packs.tier_places(self.db(), [d for d, p in places.items() if p.pack in gone])
            found.update(packs.read(remote, {d: p for d, p in now.items() if p.pack not in gone}))

        def alone(d: bytes) -> None:
            one = remote.get(remote.key("chunks", d.hex()))
            if one is not None:
                found[d] = one[0]

        remote.each(alone, [d for d in dict.fromkeys(wanted) if d not in places])
        return found

    def db(self) -> BoxStore:
        """The home's store, where the tier's places are (opened once, when first asked)."""
        with self._tier_lock:
            if self._db is None:
                from .boxrecord import store_path

                self._db = BoxStore(store_path(self.home))
            return self._db

    def tally(self, store: BoxStore) -> None:
        """Add the bytes this store's loads read from the tier to the home's totals."""
        with self._tier_lock:
            remote = self._tier
        if isinstance(remote, tier.Tier):
            with contextlib.suppress(SandlotError):
                add_counters(store, remote.traffic())

    def using(self, wait: float = LOCK_WAIT) -> contextlib.AbstractContextManager[None]:
        """Hold the store against a collection (shared with every other user)."""
        return self._held(fcntl.LOCK_SH, wait, "the chunk store (a collection holds it)")

    @contextmanager
    def _held(self, how: int, wait: float, what: str) -> Iterator[None]:
        fd = self._lock_fd()
        try:
            _flock(fd, how, wait, what)
            yield
        finally:
            os.close(fd)

    def _lock_fd(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def local_bytes(self) -> int:
        """What the chunk files of this home take on its disk."""
        from ..config import tree_bytes

        return tree_bytes(self.root) if self.root.is_dir() else 0

    def sync(self) -> None:
        """Make every chunk written so far durable: one ``syncfs`` of the home's filesystem
        (a fsync per chunk would cost a journal commit each)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _libc is None or _libc.syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    def collect(
        self, store: BoxStore, *, orphans: bool = False, wait: float = 0.0, busy_ok: bool = True
    ) -> tuple[int, int]:
        """Delete the chunks no saved state counts any more, and (``orphans``) those no
        state ever counted that a crashed save left, if nobody uses the store now (or
        within ``wait`` seconds); else leave them for the next collection (``busy_ok``)
        or raise ``SavedStateError``. Returns the chunks and bytes deleted."""
        if not self.root.is_dir():
            return 0, 0
        fd = self._lock_fd()
        try:
            try:
                _flock(fd, fcntl.LOCK_EX, wait, "the chunk store (saves or loads use it)")
            except SavedStateError:
                if busy_ok:
                    return 0, 0  # in use: the next collection takes what this one leaves
                raise
            count = freed = 0
            dead = forget_chunks(store)
            if dead:
                crash_point("chunks.mid-collect")
            for d in dead:
                count, freed = count + 1, freed + remove_file(self.path(d))
            if orphans:
                known = chunk_digests(store)
                now = time.time()
                for sub in self.root.iterdir():
                    if len(sub.name) != 2 or not sub.is_dir():  # (``damaged/``: kept for a look)
                        continue
                    for f in sub.iterdir():
                        with contextlib.suppress(OSError, ValueError):
                            if now - f.stat().st_mtime < ORPHAN_AGE:
                                continue
                            if f.name.startswith("."):  # a write a crash cut short
                                freed += remove_file(f)
                            elif bytes.fromhex(sub.name + f.name) not in known:
                                count, freed = count + 1, freed + remove_file(f)
            return count, freed
        finally:
            os.close(fd)

    def drop_unlisted(self, store: BoxStore, written: set[bytes]) -> int:
        """Give back at once the room of a failed save (on a full disk, the room its
        failure must be recorded in): delete the chunks it wrote that no saved state
        lists, if no other save or load holds the store now (one may have found such a
        chunk and count on it); else a collection of orphans takes them later. The bytes freed."""
        fd = self._lock_fd()
        try:
            try:
                _flock(fd, fcntl.LOCK_EX, 0.0, "the chunk store")
            except SavedStateError:
                return 0
            listed = listed_chunks(store, written)
            return sum(remove_file(self.path(d)) for d in written - listed)
        finally:
            os.close(fd)

    def collecting(self, wait: float = LOCK_WAIT) -> contextlib.AbstractContextManager[None]:
        """Hold the store alone: no save counts on, and no load reads, a chunk file meanwhile."""
        return self._held(fcntl.LOCK_EX, wait, "the chunk store (saves or loads use it)")


def unpack(packed: bytes) -> bytes:
    """A chunk's bytes from its zstd frame, which must say its size and say at most a
    chunk's (a frame from a damaged disk, a bucket or an archive, not a bomb)."""
    import zstandard

    size = zstandard.get_frame_parameters(packed).content_size
    if not 0 <= size <= CHUNK:
        raise zstandard.ZstdError(f"a frame of {size} bytes, where a chunk is at most {CHUNK}")
    zd = getattr(_decompressors, "d", None)
    if zd is None:  # one a thread, made once: making one costs more than a chunk's decompression
        zd = _decompressors.d = zstandard.ZstdDecompressor()
    data: bytes = zd.decompress(packed, max_output_size=CHUNK)
    return data


_decompressors = threading.local()


def remove_file(path: Path) -> int:
    """Delete a file; the bytes it took (0 if it was not there)."""
    try:
        size = path.stat().st_size
        path.unlink()
        return size
    except FileNotFoundError:
        return 0


def _flock(fd: int, how: int, wait: float, what: str) -> None:
    deadline = time.monotonic() + wait
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SavedStateError(f"{what} was not free within {wait:.0f}s") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs.argtypes = [ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


# -- writing a state -----------------------------------------------------------------------


class StateWriter(StateSink):
    """A state being saved, cut into chunks as the engine writes it. Chunks are hashed
    as they complete and the ones the store lacks are compressed and written by a few
    threads (zstd and BLAKE3 let go of the GIL) while the engine goes on; ``finish``
    waits for them, makes them durable and returns the manifest."""

    WORKERS = 2
    PENDING = 64  # chunks waiting to be written before the engine's thread waits for one

    def __init__(self, store: ChunkStore, engine: str, whose: str, *, shared: bool = False) -> None:
        self.store = store
        self.manifest = Manifest(engine=engine)
        self.whose = whose
        self.shared = shared
        self.stored: dict[bytes, int] = {}  # every chunk the state lists: its size in the store
        self.added: set[bytes] = set()  # the chunks this save wrote (the store lacked them)
        self._images: list[_ImageWriter] = []
        self._pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="sandlot-chunks")
        self._pending: dict[bytes, Future[int]] = {}
        self._slots = threading.BoundedSemaphore(self.PENDING)
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def image(self, name: str, size: int) -> ImageSink:
        if size <= 0 or size % 4096:
            raise SavedStateError(f"memory image {name!r}: a size of {size} bytes")
        w = _ImageWriter(self, Image(name, size, [None] * -(-size // CHUNK)))
        self._images.append(w)
        self.manifest.images.append(w.image)
        return w

    def stream(self, name: str, data: bytes) -> None:
        self.stream_pieces(name, (data[at : at + CHUNK] for at in range(0, len(data), CHUNK)))

    def stream_pieces(self, name: str, pieces: Iterable[bytes]) -> None:
        digests, size = [], 0
        for piece in pieces:
            digests.append(self.keep(piece))
            size += len(piece)
        self.manifest.streams.append(Stream(name, size, digests))
        self.manifest.logical += size

    def keep(self, data: bytes | bytearray | memoryview) -> bytes:
        """Hash a chunk, and have it written unless the store (or this save) has it."""
        if self._error is not None:
            raise self._error
        d = digest(data)
        with self._lock:
            if d in self.stored or d in self._pending:
                return d
        size = self.store.size(d)
        if size is not None:
            with self._lock:
                self.stored[d] = size
            return d
        copy = data if isinstance(data, bytes) else bytes(data)  # the caller may reuse its buffer
        self._slots.acquire()
        with self._lock:
            self._pending[d] = self._pool.submit(self._write, d, copy)
        return d

    def _write(self, d: bytes, data: bytes) -> int:
        try:
            added = self.store.put(d, data)
            with self._lock:
                self.stored[d] = added or (self.store.size(d) or 0)
                self.manifest.added += added
                if added:
                    self.added.add(d)
                del self._pending[d]
            return added
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._slots.release()

    def finish(self) -> Manifest:
        """Every chunk written and durable; the manifest of the whole state."""
        try:
            for w in self._images:
                w.close()
            with self._lock:
                pending = list(self._pending.values())
            for f in pending:
                f.result()
            if self._error is not None:
                raise self._error
            self.store.sync()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        return self.manifest

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _ImageWriter(ImageSink):
    """One image's chunks, each put together from its pages as they come, in any order."""

    PAGE = 4096

    def __init__(self, writer: StateWriter, image: Image) -> None:
        self.writer = writer
        self.image = image
        self.done = [False] * len(image.digests)
        self.open: dict[int, tuple[bytearray, set[int]]] = {}

    def _chunk(self, index: int) -> tuple[bytearray, set[int]]:
        entry = self.open.get(index)
        if entry is None:
            size = self.image.chunk_size(index)
            buf = bytearray(size)
            if self.done[index]:  # a page sent again: the chunk is opened from what was kept
                d = self.image.digests[index]
                if d is not None:
                    buf[:] = self.writer.store.get(d, self.writer.whose, size)
                self.done[index] = False
            entry = self.open[index] = (buf, set())
        return entry

    def _put(self, offset: int, data: bytes | memoryview | None, length: int) -> None:
        if offset % self.PAGE or length % self.PAGE or offset + length > self.image.size:
            raise SavedStateError(f"memory image {self.image.name!r}: pages at {offset:#x} out of bounds")
        end = offset + length
        while offset < end:
            index, within = divmod(offset, CHUNK)
            n = min(end - offset, CHUNK - within)
            whole = within == 0 and n == self.image.chunk_size(index)
            if whole and index not in self.open and not self.done[index]:
                # a whole chunk at once (most of them: QEMU sends pages in runs): no assembly
                at = length - (end - offset)
                self._seal(index, data[at : at + n] if data is not None else None)
                offset += n
                continue
            buf, seen = self._chunk(index)
            if data is not None:
                at = length - (end - offset)
                buf[within : within + n] = data[at : at + n]
            elif any(i in seen for i in range(within // self.PAGE, (within + n) // self.PAGE)):
                buf[within : within + n] = bytes(n)  # a page sent again, as zeros this time
            seen.update(range(within // self.PAGE, (within + n) // self.PAGE))
            if len(seen) * self.PAGE == len(buf):
                self._seal(index, buf)
            offset += n

    def pages(self, offset: int, data: bytes | memoryview) -> None:
        self._put(offset, data, len(data))

    def zeros(self, offset: int, length: int) -> None:
        self._put(offset, None, length)

    def _seal(self, index: int, buf: bytes | bytearray | memoryview | None) -> None:
        self.open.pop(index, None)
        self.done[index] = True
        if buf is None or buf == ZERO[: len(buf)]:
            self.image.digests[index] = None
            return
        self.image.digests[index] = self.writer.keep(buf)
        self.writer.manifest.logical += len(buf)

    def close(self) -> None:
        missing = [i for i, d in enumerate(self.done) if not d]
        if missing:
            raise SavedStateError(
                f"memory image {self.image.name!r} of the saved state is incomplete: "
                f"{len(missing)} of its chunks were never sent whole (the first at {missing[0] * CHUNK:#x})"
            )


# -- reading a state -----------------------------------------------------------------------


class StateReader(StateSource):
    """A saved state's chunks, read and checked a few ahead of the one asked for."""

    def __init__(self, store: ChunkStore, manifest: Manifest, whose: str) -> None:
        self.store = store
        self.manifest = manifest
        self.whose = whose

    def images(self) -> dict[str, int]:
        return {i.name: i.size for i in self.manifest.images}

    def leaving_out(self, image: str) -> StateReader:
        """The same state without one memory image: one the VM maps from elsewhere
        (``core.lazymem``), so its pages are not in the stream at all."""
        m = self.manifest
        kept = [i for i in m.images if i.name != image]
        return StateReader(self.store, Manifest(m.engine, kept, m.streams, m.logical, m.added), self.whose)

    def extents(self, name: str) -> Iterator[tuple[int, bytes]]:
        img = self.manifest.image(name)
        wanted = [(i, d) for i, d in enumerate(img.digests) if d is not None]
        # chunks that come from the storage tier (an evicted state, a box pulled from
        # another home) wait on the network, not the disk: runs of them are asked for
        # together (neighbours in a pack in one read), a few runs at once
        remote = self.store.tier() is not None and any(not self.store.path(d).exists() for _, d in wanted)
        if not remote:
            with ThreadPoolExecutor(2, thread_name_prefix="sandlot-read") as pool:
                ahead: list[tuple[int, Future[bytes]]] = []
                for i, d in wanted:
                    ahead.append((i, pool.submit(self.store.get, d, self.whose, img.chunk_size(i))))
                    if len(ahead) > READ_AHEAD:
                        j, f = ahead.pop(0)
                        yield j * CHUNK, f.result()
                for j, f in ahead:
                    yield j * CHUNK, f.result()
            return
        runs = [wanted[k : k + TIER_RUN] for k in range(0, len(wanted), TIER_RUN)]
        with ThreadPoolExecutor(TIER_RUNS, thread_name_prefix="sandlot-read") as pool:
            pending: list[tuple[list[tuple[int, bytes]], Future[list[bytes]]]] = []

            def submit(run: list[tuple[int, bytes]]) -> None:
                items = [(d, img.chunk_size(i)) for i, d in run]
                pending.append((run, pool.submit(self.store.get_many, items, self.whose)))

            for run in runs[:TIER_RUNS]:
                submit(run)
            following = iter(runs[TIER_RUNS:])
            while pending:
                run, answer = pending.pop(0)
                for (i, _), data in zip(run, answer.result(), strict=True):
                    yield i * CHUNK, data
                if (more := next(following, None)) is not None:
                    submit(more)

    def stream(self, name: str) -> bytes:
        return b"".join(self.stream_pieces(name))

    def streams(self) -> list[str]:
        return [s.name for s in self.manifest.streams]

    def stream_pieces(self, name: str) -> Iterator[bytes]:
        s = self.manifest.stream(name)
        read = 0
        # runs of chunks (neighbours in a pack: one read of the tier), the next read ahead
        runs = (
            [(d, None) for d in s.digests[at : at + TIER_RUN]] for at in range(0, len(s.digests), TIER_RUN)
        )
        # one reader thread: a second, and the consumer, only wait on one another for the GIL
        with ThreadPoolExecutor(1, thread_name_prefix="sandlot-read") as pool:
            ahead = [pool.submit(self.store.get_many, run, self.whose) for run in itertools.islice(runs, 1)]
            while ahead:
                got = ahead.pop(0).result()
                if (run := next(runs, None)) is not None:
                    ahead.append(pool.submit(self.store.get_many, run, self.whose))
                for data in got:
                    read += len(data)
                    yield data
        if read != s.size:
            raise CorruptSnapshot(
                f"saved state {self.whose}: its stream {name!r} is not the size it was saved at"
            )


class Saving:
    """One state being saved as chunks, from the engine's first byte to its snapshot's
    row: the chunk store is held (``using``) all along, so nothing the save found there
    and counted on is collected before the row counts it. An engine that writes files
    (``enabled`` False) gets no sink, and this does nothing."""

    def __init__(
        self, home: Path, db: BoxStore, engine: str, whose: str, *, enabled: bool, shared: bool = False
    ) -> None:
        self.store = ChunkStore(home)
        self.db = db
        self.writer = StateWriter(self.store, engine, whose, shared=shared) if enabled else None
        self._held: contextlib.ExitStack | None = None
        self.manifest: Manifest | None = None

    @property
    def sink(self) -> StateSink | None:
        return self.writer

    async def __aenter__(self) -> Saving:
        if self.writer is not None:
            stack = contextlib.ExitStack()
            await asyncio.to_thread(stack.enter_context, self.store.using())
            self._held = stack
        return self

    async def finish(self) -> tuple[bytes | None, dict[bytes, int] | None]:
        """The saved state's manifest (encoded) and the size of each chunk it lists, once
        every chunk is durable; (None, None) for a state of files."""
        if self.writer is None:
            return None, None
        self.manifest = await asyncio.to_thread(self.writer.finish)
        return self.manifest.encode(), dict(self.writer.stored)

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self.writer is not None:
            await asyncio.to_thread(self.writer.abort)
        if self._held is not None:
            self._held.close()
        if self.writer is not None and exc_type is not None and self.writer.added:
            await asyncio.to_thread(self.store.drop_unlisted, self.db, self.writer.added)


@contextlib.asynccontextmanager
async def reading(home: Path, store: BoxStore, snap_id: str) -> AsyncIterator[StateReader | None]:
    """A saved state's chunks (None: it is files in its directory), held against a
    collection until the block ends: a load reads them all before it does."""
    source = await asyncio.to_thread(open_state, home, store, snap_id)
    if source is None:
        yield None
        return
    try:
        with contextlib.ExitStack() as held:
            await asyncio.to_thread(held.enter_context, source.store.using())
            yield source
    finally:
        await asyncio.to_thread(source.store.tally, store)


def open_state(home: Path, store: BoxStore, snap_id: str) -> StateReader | None:
    """The chunks of a saved state, if it was saved as chunks (else its directory holds it)."""
    data = store.state_manifest(snap_id)
    if data is None:
        return None
    return StateReader(ChunkStore(home, store), Manifest.decode(data, snap_id), snap_id)


# -- the ``chunks`` table and the home's ``counters``: functions that take the store first,
# as ``BoxStore``'s methods do, so that ``AsyncStore.call`` runs them (a state's rows count
# its chunks in the transaction that writes or removes it: ``BoxStore``'s snapshots)


def forget_chunks(store: BoxStore) -> list[bytes]:
    """Delete the rows of the chunks no state lists; their digests (the caller, who
    holds the chunk store exclusively, deletes their files). Of those the storage tier
    holds, that it does is kept (``tier_chunks``): a box's next state, which shares
    most of its chunks with the last (a box that sleeps, wakes and sleeps again), sends
    only what it changed."""
    with store.reading() as db:  # most calls find none: no write transaction (and its fsync) then
        if db.execute("SELECT 1 FROM chunks WHERE refs <= 0 LIMIT 1").fetchone() is None:
            return []
    with store.transaction() as db:
        rows = db.execute("DELETE FROM chunks WHERE refs <= 0 RETURNING digest, remote").fetchall()
        kept = [(r[0],) for r in rows if r[1]]
        db.executemany("INSERT OR IGNORE INTO tier_chunks (digest) VALUES (?)", kept)
    return [bytes(r[0]) for r in rows]


def listed_chunks(store: BoxStore, digests: set[bytes]) -> set[bytes]:
    """Which of ``digests`` a saved state lists."""
    found: set[bytes] = set()
    batch = sorted(digests)
    with store.reading() as db:
        for at in range(0, len(batch), 500):
            part = batch[at : at + 500]
            marks = ",".join("?" * len(part))
            rows = db.execute(f"SELECT digest FROM chunks WHERE digest IN ({marks})", part)
            found.update(bytes(r[0]) for r in rows)
    return found


def chunk_digests(store: BoxStore) -> set[bytes]:
    with store.reading() as db:
        return {bytes(r[0]) for r in db.execute("SELECT digest FROM chunks")}


def add_counters(store: BoxStore, add: dict[str, int]) -> None:
    """Add to the home's running totals (a counter never goes down)."""
    add = {k: n for k, n in add.items() if n > 0}
    if not add:
        return
    with store.transaction(durable=False) as db:
        db.executemany(
            "INSERT INTO counters (name, value) VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value",
            list(add.items()),
        )


def counters(store: BoxStore) -> dict[str, int]:
    with store.reading() as db:
        return {r[0]: int(r[1]) for r in db.execute("SELECT name, value FROM counters")}


def chunk_totals(store: BoxStore) -> dict[str, int]:
    """The chunk store's figures: chunks kept and the bytes they take, the bytes the
    states they make up would take without sharing (each state's listed chunks
    counted once per state), and those of chunks no state lists any more."""
    with store.reading() as db:
        live = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(stored), 0), COALESCE(SUM(stored * refs), 0) "
            "FROM chunks WHERE refs > 0"
        ).fetchone()
        dead = db.execute("SELECT COUNT(*), COALESCE(SUM(stored), 0) FROM chunks WHERE refs <= 0").fetchone()
        states = db.execute("SELECT COUNT(*) FROM states").fetchone()[0]
        remote = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(stored), 0) FROM chunks WHERE refs > 0 AND remote = 1"
        ).fetchone()
        pushed = db.execute("SELECT COUNT(*) FROM states WHERE pushed = 1").fetchone()[0]
    return {"states": int(states), "chunks": int(live[0]), "stored_bytes": int(live[1]),
            "unshared_bytes": int(live[2]), "garbage_chunks": int(dead[0]),
            "garbage_bytes": int(dead[1]), "remote_chunks": int(remote[0]),
            "remote_bytes": int(remote[1]), "pushed_states": int(pushed)}  # fmt: skip


__all__ = ["CHUNK", "ChunkStore", "Saving", "StateReader", "StateWriter", "add_counters", "chunk_digests",
           "chunk_totals", "counters", "digest", "forget_chunks", "listed_chunks", "open_state",
           "reading"]  # fmt: skip
