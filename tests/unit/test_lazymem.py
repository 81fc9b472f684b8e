"""Lazy restore's memory (``core/lazymem.py``): an image read from its chunks as it is
asked for, the rest brought in the background with what the last wake read first, and
the real helper process serving it on a real FUSE mount that a process maps
copy-on-write, as QEMU does: the bytes it reads are the image's, its writes stay its
own, and once the mapping is gone the helper has unmounted and ended. The wake of a
real VM from the storage tier through it is in tests/vm/test_tier.py."""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from sandlot import config
from sandlot.core import chunks, forkserver, lazymem
from sandlot.core.manifest import CHUNK, Manifest
from sandlot.errors import InvalidArgument

from tests.support.waiting import wait_for

PAGE = 4096
SIZE = 24 * CHUNK


def image_bytes(seed: int = 1) -> bytes:
    """Every third chunk zeros, the rest random."""
    rng = random.Random(seed)
    return b"".join(bytes(CHUNK) if c % 3 == 0 else rng.randbytes(CHUNK) for c in range(SIZE // CHUNK))


def saved(store: chunks.ChunkStore, data: bytes) -> Manifest:
    w = chunks.StateWriter(store, "test", "s")
    img = w.image("ram", len(data))
    for at in range(0, len(data), PAGE):
        page = data[at : at + PAGE]
        img.zeros(at, PAGE) if page == bytes(PAGE) else img.pages(at, page)
    w.stream("devices", b"devices")
    return w.finish()


class CountingStore(chunks.ChunkStore):
    """The home's chunk store, noting each read of chunks together."""

    def __init__(self, home: Path) -> None:
        super().__init__(home)
        self.reads: list[list[bytes]] = []

    def get_many(
        self, wanted: Sequence[tuple[bytes, int | None]], whose: str, *, keep: bool | chunks.KeptLater = True
    ) -> list[bytes]:
        self.reads.append([d for d, _ in wanted])
        return super().get_many(wanted, whose, keep=keep)


def test_memory_reads_chunks_as_asked_and_fills_what_the_last_wake_read_first(tmp_path: Path) -> None:
    data = image_bytes()
    store = CountingStore(tmp_path)
    image = saved(store, data).image("ram")
    memory = lazymem.Memory(store, image, "s", tmp_path / "cache", chunks.KeptLater(store))
    memory.asking_until = time.monotonic() + 60
    by_digest = {d: i for i, d in enumerate(image.digests) if d is not None}

    def reads() -> list[list[int]]:
        return [[by_digest[d] for d in one] for one in store.reads]

    # a read across two chunks brings both, and the chunks after them up to AROUND in
    # the same read; zeros are never fetched
    assert memory.read(2 * PAGE, CHUNK - PAGE) == data[CHUNK - PAGE : CHUNK + PAGE]
    assert reads() == [[i for i in range(1, 1 + lazymem.AROUND) if i % 3]]
    assert (
        memory.read(PAGE, 0) == bytes(PAGE)
        and memory.read(PAGE, 7 * CHUNK) == data[7 * CHUNK : 7 * CHUNK + PAGE]
    )
    assert len(store.reads) == 1  # chunk 0 is zeros; 7 came with 1
    assert memory.read(10 * CHUNK, SIZE - PAGE) == data[-PAGE:]  # clipped at the end
    assert memory.read(PAGE, SIZE) == b""
    assert memory.asked == [1, 7, SIZE // CHUNK - 1]  # chunks of data the VM read, in order (not zeros)
    # the fill: the chunks the last wake read first, in its order, then the rest by address
    store.reads.clear()
    memory.fill([20, 17, 20, 3], workers=1)
    assert reads() == [[20, 17, 19, 22]]  # 3, 18 and 21 are zeros; the others were here
    assert memory.complete() and memory.read(SIZE, 0) == data
    assert memory.waited == 2  # the two reads above that had to wait for a fetch


def test_a_chunk_that_cannot_be_read_is_an_io_error_naming_it(tmp_path: Path) -> None:
    store = chunks.ChunkStore(tmp_path)
    image = saved(store, image_bytes()).image("ram")
    missing = image.digests[4]
    assert missing is not None
    store.path(missing).unlink()
    memory = lazymem.Memory(store, image, "s", tmp_path / "cache", chunks.KeptLater(store))
    assert memory.read(PAGE, 5 * CHUNK) == image_bytes()[5 * CHUNK : 5 * CHUNK + PAGE]
    with pytest.raises(OSError) as caught:
        memory.read(PAGE, 4 * CHUNK)
    assert caught.value.errno == errno.EIO
    assert memory.failed is not None and "chunk 4" in memory.failed and missing.hex() in memory.failed
    memory.fill([], workers=2)  # the fill goes on past it
    assert not memory.complete() and sum(memory.present) == len(image.digests) - 1


def test_the_touched_file_and_the_mode_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "memory-touched"
    assert lazymem.read_touched(path, 10) == []  # none yet
    path.write_bytes(b"\x01\x00\x00")  # torn: ignored, never trusted
    assert lazymem.read_touched(path, 10) == []
    path.write_bytes(b"".join(i.to_bytes(4, "little") for i in (3, 99, 1)))
    assert lazymem.read_touched(path, 10) == [3, 1]  # an index past the image is dropped
    for good in ("auto", "always", "never"):
        monkeypatch.setenv("SANDLOT_LAZY_RESTORE", good)
        assert lazymem.mode() == good
    monkeypatch.setenv("SANDLOT_LAZY_RESTORE", "sometimes")
    with pytest.raises(InvalidArgument, match="SANDLOT_LAZY_RESTORE"):
        lazymem.mode()


def test_auto_is_lazy_only_for_memory_not_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = chunks.ChunkStore(tmp_path)
    image = saved(store, image_bytes()).image("ram")
    monkeypatch.delenv("SANDLOT_LAZY_RESTORE", raising=False)
    assert lazymem.wanted(store, image) is False  # all here: the stream is as fast
    monkeypatch.setattr(lazymem, "LAZY_FROM", 2)
    for d in image.digests[1:3]:
        assert d is not None
        store.path(d).unlink()  # evicted to the tier
        assert lazymem.wanted(store, image) is (d == image.digests[2])  # from LAZY_FROM chunks on
    assert lazymem.unavailable() is None
    monkeypatch.setenv("SANDLOT_LAZY_RESTORE", "always")
    assert lazymem.wanted(store, image) is True
    monkeypatch.setenv("SANDLOT_LAZY_RESTORE", "never")
    assert lazymem.wanted(store, image) is False


def a_home_with_a_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Manifest]:
    """A home holding one saved state's chunks, and a runtime directory of the test's own."""
    monkeypatch.setenv("SANDLOT_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    home = tmp_path / "home"
    return home, saved(chunks.ChunkStore(home), image_bytes())


def warm_server(home: Path) -> int:
    """The home's fork server, started and ready (its log says so: a socket a killed one
    left may be there before it): its pid."""
    log = home / "chunks" / "forkserver.log"
    before = log.read_text().count(" ready") if log.exists() else 0
    assert lazymem.start_fork_server(home)

    def ready() -> bool:
        return log.exists() and log.read_text().count(" ready") > before

    wait_for("the fork server to get ready", ready, timeout=60, every=0.05)
    return int(log.read_text().rsplit(" ready (pid ", 1)[1].split(")")[0])


@pytest.mark.parametrize("how", ["spawned", "forked"])
def test_the_helper_serves_a_mapping_copy_on_write_and_ends_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The real helper on a real FUSE mount (this host has /dev/fuse and fuse3, as
    ``./scripts/setup`` makes sure): mapped private, as QEMU maps guest RAM; spawned, or
    forked by the home's fork server (``core/forkserver.py``)."""
    assert lazymem.unavailable() is None, lazymem.unavailable()
    monkeypatch.setenv("SANDLOT_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    home, box_dir = tmp_path / "home", tmp_path / "box"
    box_dir.mkdir()
    data = image_bytes(7)
    store = chunks.ChunkStore(home)
    manifest = saved(store, data)
    if how == "forked":
        warm_server(home)
    served = lazymem.serve(home, manifest.encode(), "s", "ram", lazymem.touched_of(box_dir))
    assert served is not None and served.alive()
    assert served.memory.stat().st_size == SIZE
    fd = os.open(served.memory, os.O_RDWR)  # QEMU opens its RAM file read-write
    try:
        view = mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)  # the mapping keeps the file open, as QEMU's does
    assert view[5 * CHUNK : 6 * CHUNK] == data[5 * CHUNK : 6 * CHUNK]
    view[0:4] = b"mine"  # copy-on-write: the guest's own
    assert view[:4] == b"mine" and served.memory.read_bytes()[:4] == data[:4]
    assert bytes(view) == b"mine" + data[4:]
    with pytest.raises(OSError), open(served.memory, "r+b") as f:
        f.write(b"x")  # nothing writes the image itself
        f.flush()
    view.close()  # the last reference: the helper unmounts and ends
    deadline = time.monotonic() + 30
    while served.alive() or served.directory.exists():
        assert time.monotonic() < deadline, "the helper outlived the mapping"
        time.sleep(0.05)
    mounts = Path("/proc/self/mounts").read_text()
    assert str(served.directory) not in mounts
    assert lazymem.read_touched(lazymem.touched_of(box_dir), SIZE // CHUNK)  # what this one read first
    said = (box_dir / "lazymem.log").read_text()
    assert "chunks in" in said and f"helper {'forked by' if how == 'forked' else 'spawned'}" in said


def test_a_fork_server_refuses_what_it_should_not_fork_ends_with_its_home_and_its_death_costs_a_spawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, manifest = a_home_with_a_state(tmp_path, monkeypatch)
    pid = warm_server(home)
    assert not lazymem.start_fork_server(home)  # one per home
    # a directory that is no helper's: refused, and the lock is free again for a spawn
    elsewhere = tmp_path / "lazy-elsewhere"
    elsewhere.mkdir()
    assert not forkserver.fork_helper(home, elsewhere)
    fd = config.try_flock(elsewhere / "lock")
    assert fd is not None
    os.close(fd)
    # killed: the next wake spawns its helper (the socket it left refuses), and starts another
    os.kill(pid, signal.SIGKILL)
    wait_for("the fork server to die", lambda: gone(pid), every=0.05)
    served = lazymem.serve(home, manifest.encode(), "s", "ram", tmp_path / "touched")
    assert served is not None
    assert "helper spawned" in (served.directory / "helper.log").read_text()
    served.stop()
    wait_for("the helper to end once stopped", lambda: not (served.alive() or served.directory.exists()))
    again = warm_server(home)
    assert again != pid
    # a home removed: its server ends, and takes its socket with it
    shutil.rmtree(home)
    wait_for(
        "the fork server to end with its home",
        lambda: gone(again) and not forkserver.socket_path(home).exists(),
    )


def gone(pid: int) -> bool:
    """Whether a process ended (a zombie nobody reaps, its parent being gone, is ended)."""
    try:
        return b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
    except FileNotFoundError:
        return True


def test_a_look_at_a_helper_never_makes_its_lock_file(tmp_path: Path) -> None:
    """A look (``alive``) while a helper removes its directory must not put a file back in
    it: the directory would stay, and its launcher would wait for it to go."""
    directory = tmp_path / "lazy-ended"
    directory.mkdir()
    assert not lazymem.Served(directory).alive()
    assert not (directory / "lock").exists()
    fd = config.try_flock(directory / "lock")
    assert fd is not None and lazymem.Served(directory).alive()
    os.close(fd)
    assert not lazymem.Served(directory).alive()


def test_a_fork_server_notices_a_module_it_loaded_changed(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("x = 1\n")
    loaded = {str(module): module.stat().st_mtime_ns}
    assert not forkserver.changed(loaded)
    os.utime(module, ns=(0, module.stat().st_mtime_ns + 1_000_000))
    assert forkserver.changed(loaded)
    module.unlink()
    assert forkserver.changed({str(module): 0})


def test_a_helper_whose_vm_never_came_is_stopped_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, manifest = a_home_with_a_state(tmp_path, monkeypatch)
    served = lazymem.serve(home, manifest.encode(), "s", "ram", tmp_path / "touched")
    assert served is not None
    served.stop()  # a launch that failed before its VM mapped the memory
    deadline = time.monotonic() + 30
    while served.alive() or served.directory.exists():
        assert time.monotonic() < deadline, "the helper outlived its stop"
        time.sleep(0.05)
    assert str(served.directory) not in Path("/proc/self/mounts").read_text()


def test_a_box_keeps_a_bounded_log_of_its_lazy_wakes(tmp_path: Path) -> None:
    box_dir, helper = tmp_path / "box", tmp_path / "lazy-x"
    box_dir.mkdir()
    helper.mkdir()
    (helper / "request").write_text(f"s\nram\n{lazymem.touched_of(box_dir)}\n")
    (box_dir / "lazymem.log").write_bytes(b"old\n" * lazymem.LOG_KEPT)
    (helper / "helper.log").write_bytes(b"this wake\n")
    lazymem._keep_log(helper)
    kept = (box_dir / "lazymem.log").read_bytes()
    assert len(kept) == lazymem.LOG_KEPT and kept.endswith(b"old\nthis wake\n")
