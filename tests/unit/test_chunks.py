"""The chunk store under saved states (``core/chunks.py``, ``core/manifest.py``): each
chunk kept once, counted by the states that list it in the store's transactions,
checked against its hash whenever it is read, collected only when nothing lists or
uses it, and whole or absent after a kill -9 anywhere. On the fake engine, whose saves
give the core a memory image by page as QEMU's do; tests/vm/test_chunks.py does the same
with real VMs."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.core import chunks, snapshots
from sandlot.core.manifest import CHUNK, Manifest
from sandlot.core.store import BoxStore, SnapshotRecord
from sandlot.errors import CorruptSnapshot, InvalidArgument, SavedStateError

from tests.support.fake_engine import register

register()
PAGE = 4096
SIZE = 16 * CHUNK


def ram(seed: int, changed: int = 0) -> bytearray:
    """A memory image: a quarter of its chunks zeros, the rest random; ``changed``
    pages after the first rewritten (one per chunk, so that many chunks differ)."""
    rng = random.Random(seed)
    data = bytearray(SIZE)
    for c in range(SIZE // CHUNK):
        if c % 4:
            data[c * CHUNK : (c + 1) * CHUNK] = rng.randbytes(CHUNK)
    for i in range(changed):
        at = ((1 + i) % (SIZE // CHUNK)) * CHUNK + PAGE
        data[at : at + PAGE] = random.Random(seed * 1000 + i).randbytes(PAGE)
    return data


def save(store: chunks.ChunkStore, data: bytes, whose: str = "s", *, shuffle: int = 1) -> chunks.StateWriter:
    """A state written as an engine writes one: every page once, in any order, zero
    pages said as zeros; then its devices' stream."""
    w = chunks.StateWriter(store, "test", whose)
    img = w.image("ram", len(data))
    order = list(range(0, len(data), PAGE))
    random.Random(shuffle).shuffle(order)
    for at in order:
        page = bytes(data[at : at + PAGE])
        img.zeros(at, PAGE) if page == bytes(PAGE) else img.pages(at, page)
    w.stream("devices", b"devices of " + whose.encode())
    w.finish()
    return w


def read(reader: chunks.StateReader) -> bytearray:
    out = bytearray(reader.images()["ram"])
    for at, data in reader.extents("ram"):
        out[at : at + len(data)] = data
    return out


def test_a_state_goes_in_by_page_in_any_order_and_comes_back_whole(tmp_path: Path) -> None:
    store = chunks.ChunkStore(tmp_path)
    data = ram(1)
    w = save(store, data)
    m = Manifest.decode(w.manifest.encode())
    assert sum(d is None for d in m.image("ram").digests) == 4  # the zero chunks are not kept
    assert m.logical == 12 * CHUNK + len(b"devices of s")
    back = chunks.StateReader(store, m, "s")
    assert read(back) == data
    assert back.stream("devices") == b"devices of s"


def test_a_second_state_adds_only_the_chunks_that_changed(tmp_path: Path) -> None:
    store = chunks.ChunkStore(tmp_path)
    first = save(store, ram(1), "a")
    again = save(store, ram(1), "b", shuffle=2)
    assert again.manifest.added <= len(b"devices of b") + 64  # only its devices' stream is new
    changed = save(store, ram(1, changed=3), "c")
    one_chunk = max(first.stored.values())
    assert 3 * one_chunk * 0.9 < changed.manifest.added <= 3 * one_chunk + 200
    assert len(list(store.root.glob("??/*"))) == 12 + 3 + 3  # a's chunks, c's three, three streams


def test_a_page_sent_twice_counts_its_last_bytes_and_a_page_never_sent_fails_the_save(tmp_path: Path) -> None:
    store = chunks.ChunkStore(tmp_path)
    data = ram(2)
    w = chunks.StateWriter(store, "test", "s")
    img = w.image("ram", SIZE)
    for at in range(0, SIZE, PAGE):
        img.pages(at, bytes(PAGE))  # all zeros first: every chunk sealed as zeros
    for at in range(0, SIZE, PAGE):
        img.pages(at, bytes(data[at : at + PAGE]))  # then sent again with its bytes
    w.finish()
    assert read(chunks.StateReader(store, w.manifest, "s")) == data

    short = chunks.StateWriter(store, "test", "t")
    img = short.image("ram", SIZE)
    for at in range(0, SIZE - PAGE, PAGE):
        img.pages(at, bytes(PAGE))
    with pytest.raises(SavedStateError, match=r"incomplete: 1 of its chunks .* at 0xf0000"):
        short.finish()


def test_a_damaged_or_missing_chunk_is_a_corrupt_snapshot_naming_the_state_and_the_chunk(
    tmp_path: Path,
) -> None:
    store = chunks.ChunkStore(tmp_path)
    w = save(store, ram(3), "snap1")
    victim = next(d for d in w.manifest.image("ram").digests if d is not None)
    path = store.path(victim)
    good = path.read_bytes()
    import zstandard

    other = zstandard.ZstdCompressor().compress(bytes(CHUNK - 1) + b"x")  # a valid frame, other bytes
    for damage, why in (
        (good[:-7], "damaged"),
        (b"not zstd", "damaged"),
        (other, r"damaged \(its bytes do not match its hash\)"),
    ):
        path.write_bytes(damage)
        with pytest.raises(CorruptSnapshot, match=f"saved state snap1: its chunk {victim.hex()} is {why}"):
            read(chunks.StateReader(store, w.manifest, "snap1"))
    path.unlink(missing_ok=True)  # (the last damage was put aside already)
    with pytest.raises(CorruptSnapshot, match=f"its chunk {victim.hex()} is missing"):
        read(chunks.StateReader(store, w.manifest, "snap1"))
    # a damaged chunk is put aside, and the next save holding its bytes writes it again
    path.write_bytes(b"not zstd")
    with pytest.raises(CorruptSnapshot, match="damaged"):
        read(chunks.StateReader(store, w.manifest, "snap1"))
    assert not path.exists() and (store.root / "damaged" / victim.hex()).read_bytes() == b"not zstd"
    again = save(store, ram(3), "snap2")
    assert again.manifest.added > 0 and read(chunks.StateReader(store, w.manifest, "snap1")) == ram(3)
    with pytest.raises(CorruptSnapshot, match="the manifest of saved state snap1 is damaged"):
        Manifest.decode(w.manifest.encode()[:-5], "snap1")


def row(snap_id: str) -> SnapshotRecord:
    return SnapshotRecord(id=snap_id, kind="snapshot", layer="/l", box_id="b", box_name="b",
                          created_at=time.time(), options={})  # fmt: skip


@contextlib.contextmanager
def held_by_another_process(home: Path) -> Iterator[None]:
    """The home's chunk store used (``ChunkStore.using``) by another process all through the block."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib\nfrom sandlot.core.chunks import ChunkStore\n"
         f"with ChunkStore(pathlib.Path({str(home)!r})).using():\n"
         "    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.communicate("", timeout=10)


def test_a_chunk_goes_with_the_last_state_that_lists_it(tmp_path: Path) -> None:
    db = BoxStore(tmp_path / "sandlot.db")
    store = chunks.ChunkStore(tmp_path)
    a = save(store, ram(4), "a")
    b = save(store, ram(4, changed=2), "b")
    db.insert_snapshot(row("a"), manifest=a.manifest.encode(), stored=a.stored)
    db.insert_snapshot(row("b"), manifest=b.manifest.encode(), stored=b.stored)
    totals = chunks.chunk_totals(db)
    assert totals["states"] == 2 and totals["chunks"] == len(a.stored | b.stored)
    assert totals["unshared_bytes"] > totals["stored_bytes"]  # most chunks serve both states
    db.delete_snapshot("a")
    count, freed = store.collect(db)
    only_a = set(a.stored) - set(b.stored)
    assert count == len(only_a) and freed == sum(a.stored[d] for d in only_a)
    assert read(chunks.StateReader(store, Manifest.decode(db.state_manifest("b") or b""), "b")) == ram(
        4, changed=2
    )
    db.delete_snapshot("b")
    store.collect(db)
    assert list(store.root.glob("??/*")) == [] and chunks.chunk_totals(db)["chunks"] == 0


def test_a_collection_leaves_the_store_to_those_using_it(tmp_path: Path) -> None:
    db = BoxStore(tmp_path / "sandlot.db")
    store = chunks.ChunkStore(tmp_path)
    a = save(store, ram(5), "a")
    db.insert_snapshot(row("a"), manifest=a.manifest.encode(), stored=a.stored)
    db.delete_snapshot("a")
    with held_by_another_process(tmp_path):
        assert store.collect(db) == (0, 0)  # a restore (say) reads them: nothing goes
        assert len(list(store.root.glob("??/*"))) == len(a.stored)
    assert store.collect(db)[0] == len(a.stored)


def test_chunks_no_state_ever_listed_go_once_they_are_old(tmp_path: Path) -> None:
    db = BoxStore(tmp_path / "sandlot.db")
    store = chunks.ChunkStore(tmp_path)
    a = save(store, ram(6), "a")  # a save whose row never came (its process died)
    old = time.time() - chunks.ORPHAN_AGE - 5
    files = list(store.root.glob("??/*"))
    half = files[: len(files) // 2]
    for f in half:
        os.utime(f, (old, old))
    cut = store.root / "ab" / ".cd.1234"  # a write a crash cut short
    cut.parent.mkdir(exist_ok=True)
    cut.write_bytes(b"x")
    os.utime(cut, (old, old))
    assert store.collect(db, orphans=True)[0] == len(half)
    assert not cut.exists() and len(list(store.root.glob("??/*"))) == len(files) - len(half)
    assert a.manifest.added > 0


def test_a_failed_save_gives_back_its_room_unless_another_save_may_count_on_it(tmp_path: Path) -> None:
    import asyncio

    db = BoxStore(tmp_path / "sandlot.db")
    store = chunks.ChunkStore(tmp_path)
    kept = save(store, ram(7), "kept")
    db.insert_snapshot(row("kept"), manifest=kept.manifest.encode(), stored=kept.stored)

    async def failed_save(data: bytes) -> None:
        async with chunks.Saving(tmp_path, db, "test", "late", enabled=True) as saving:
            assert saving.writer is not None
            img = saving.writer.image("ram", len(data))
            img.pages(0, data)
            await asyncio.to_thread(saving.writer.finish)
            raise OSError(28, "No space left on device")  # say, its row could not be written

    with pytest.raises(OSError):
        asyncio.run(failed_save(bytes(ram(7, changed=3))))
    # only the chunks it wrote went: those the kept state lists stay, and it reads whole
    assert {bytes.fromhex(f.parent.name + f.name) for f in store.root.glob("??/*")} == set(kept.stored)
    manifest = Manifest.decode(db.state_manifest("kept") or b"")
    assert read(chunks.StateReader(store, manifest, "kept")) == ram(7)
    # while another save holds the store, its chunks stay (that save may have found them): gc's
    with held_by_another_process(tmp_path):
        with pytest.raises(OSError):
            asyncio.run(failed_save(bytes(ram(8))))
        assert len(list(store.root.glob("??/*"))) > len(kept.stored)


def fake_box(home: Path, root: Path, **kw: object) -> sandlot.Box:
    box = sandlot.Box(rootfs=root, engine="fake", home=home, template=False, memory_mib=256, keep=True, **kw)
    box.start()
    return box


def test_the_core_saves_live_state_as_chunks_each_costing_what_changed(home: Path, root: Path) -> None:
    box = fake_box(home, root)
    try:
        box.exec("remember", "k1", "one")
        s1 = box.snapshot("one")
        box.exec("remember", "k2", "two")
        s2 = box.snapshot("two")
        store = BoxStore(home / "sandlot.db")
        m1 = Manifest.decode(store.state_manifest(s1.id) or b"")
        m2 = Manifest.decode(store.state_manifest(s2.id) or b"")
        # the fake VM's memory: a page per key; s2 changed one chunk and its state stream
        assert len(set(m2.digests()) - set(m1.digests())) == 2
        assert s2.info["size"] < s1.info["size"] * 2
        box.rollback(s1)
        assert box.exec("recall", "k2").stdout == "\n" and box.exec("recall", "k1").stdout == "one\n"
        kids = box.fork(2)
        assert [k.exec("recall", "k1").stdout for k in kids] == ["one\n", "one\n"]
        running = box.size
        assert running is not None and running >= 0  # its own disk layer (the fake's is empty)
        box.suspend()
        held = BoxStore(home / "sandlot.db").find_snapshot(
            BoxStore(home / "sandlot.db").get(box.id).suspended or ""
        )
        assert held is not None and held.size > 0
        assert box.size == running + held.size  # and, suspended, its state
        assert box.info["logical_size"] == running + held.options["logical_bytes"]
        assert box.inspect()["size"] == box.size  # and sandlot inspect
        assert box.exec("recall", "k1").stdout == "one\n"  # resumed from its chunks
        assert box.size == running
        for k in kids:
            k.remove(force=True)
        box.snapshots()  # (a listing reclaims a fork's state whose children are gone)
        s2.remove()
        s1.remove()
    finally:
        box.remove(force=True)
    sandlot.prune_snapshots(home=home, templates=True)
    assert chunks.chunk_totals(BoxStore(home / "sandlot.db"))["chunks"] == 0
    assert list((home / "chunks").glob("??/*")) == []


def test_a_state_whose_chunk_is_damaged_is_refused_and_the_box_keeps_what_it_had(
    home: Path, root: Path
) -> None:
    box = fake_box(home, root)
    try:
        box.exec("remember", "k", "v")
        snap = box.snapshot("s")
        m = Manifest.decode(BoxStore(home / "sandlot.db").state_manifest(snap.id) or b"")
        victim = next(d for d in m.image("fake.ram").digests if d is not None)
        chunks.ChunkStore(home).path(victim).write_bytes(b"garbage")
        with pytest.raises(CorruptSnapshot, match=f"its chunk {victim.hex()} is damaged"):
            box.rollback(snap)
    finally:
        box.remove(force=True)


CRASHING = """
import os, sys, pathlib
from tests.support.fake_engine import register
import sandlot
register()
home, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
box = sandlot.Box(rootfs=root, engine="fake", home=home, template=False, memory_mib=256, keep=True, name="c")
box.start()
box.exec("remember", "k", "v")
box.snapshot("first")
box.exec("remember", "k2", "v2")
print("ready", flush=True)
os.environ["SANDLOT_CRASH_AT"] = sys.argv[4]  # from here on: the step under test only
if sys.argv[3] == "snapshot":
    box.snapshot("second")
else:
    next(s for s in box.snapshots() if s.name == "first").remove()
print("survived", flush=True)
"""


@pytest.mark.parametrize(
    ("point", "step"),
    [
        ("chunks.mid-write#2", "snapshot"),
        ("snapshot.after-save", "snapshot"),
        ("chunks.mid-collect", "remove"),
    ],
)
def test_a_kill_anywhere_leaves_every_state_whole_and_its_leftovers_collected(
    home: Path, root: Path, point: str, step: str
) -> None:
    p = subprocess.run([sys.executable, "-c", CRASHING, str(home), str(root), step, point],
                       capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).parents[2])  # fmt: skip
    assert p.returncode == -9 and "ready" in p.stdout and "survived" not in p.stdout, p.stderr[-2000:]
    db = BoxStore(home / "sandlot.db")
    store = chunks.ChunkStore(home)
    # every state the store lists reads back whole, whatever the kill cut short
    for snap in db.snapshots():
        data = db.state_manifest(snap.id)
        assert data is not None
        reader = chunks.StateReader(store, Manifest.decode(data), snap.id)
        for name in reader.images():
            list(reader.extents(name))
    names = {s.name for s in db.snapshots()}
    assert names == ({"first"} if step == "snapshot" else set())
    # what it left goes once it is old enough to be no live save's
    old = time.time() - chunks.ORPHAN_AGE - 5
    for f in store.root.rglob("*"):
        if f.is_file() and f.name != ".lock":
            os.utime(f, (old, old))
    snapshots.sweep(home, db)
    listed = {d for s in db.snapshots() for d in Manifest.decode(db.state_manifest(s.id) or b"").digests()}
    kept = {bytes.fromhex(f.parent.name + f.name) for f in store.root.glob("??/*")}
    assert kept == listed and not list(store.root.glob("??/.*"))
    box = sandlot.get("c", home=home)
    box.start()  # its VM died with the process: it boots afresh
    if step == "snapshot":
        box.rollback("first")
        assert box.exec("recall", "k").stdout == "v\n"  # the state saved before the kill, whole
    box.snapshot("again")  # and the home goes on saving
    box.remove(force=True)


def test_the_storage_figures_and_a_collection_through_the_api_and_the_cli(home: Path, root: Path) -> None:
    box = fake_box(home, root)
    try:
        box.exec("remember", "k", "v")
        one, two = box.snapshot("one"), box.snapshot("two")  # the same memory: all but devices shared
        report = sandlot.storage.info(home=home)
        assert report.states == 2 and report.chunks > 0 and report.garbage_chunks == 0
        assert report.dedup_ratio > 1.5 and report.logical_bytes > report.stored_bytes
        env = {**os.environ, "SANDLOT_HOME": str(home)}
        shown = subprocess.run([sys.executable, "-m", "sandlot.cli", "storage", "--json"], env=env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert json.loads(shown.stdout) == report.to_json()
        two.remove()
        one.remove()
        assert sandlot.storage.info(home=home).garbage_chunks == 0  # a removal collects at once
        # a save or a load in progress: an explicit gc says so
        with chunks.ChunkStore(home).using(), pytest.raises(SavedStateError, match="saves or loads use it"):
            sandlot.storage.gc(home=home, wait=0.2)
        gone = subprocess.run([sys.executable, "-m", "sandlot.cli", "storage", "gc"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert gone.returncode == 0 and gone.stdout.startswith("removed 0 chunks")
        with pytest.raises(sandlot.InvalidArgument, match="wait"):
            sandlot.storage.gc(home=home, wait=float("nan"))
    finally:
        box.remove(force=True)


def test_the_metrics_show_an_admin_the_chunk_store_and_a_namespaced_key_nothing_of_it(
    home: Path, root: Path
) -> None:
    import httpx

    from tests.support.inproc import serving

    box = fake_box(home, root)
    try:
        box.snapshot("one")
        with serving(home) as srv:
            admin = httpx.get(
                f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=30
            )
            tenant = srv.key("tenant", namespace="team-a")
            theirs = httpx.get(
                f"{srv.url}/metrics", headers={"Authorization": f"Bearer {tenant}"}, timeout=30
            )
        totals = chunks.chunk_totals(BoxStore(home / "sandlot.db"))
        assert f"sandlot_storage_stored_bytes {float(totals['stored_bytes'])}" in admin.text
        assert f"sandlot_storage_states {float(totals['states'])}" in admin.text
        # no tier: nothing held there, nothing sent, and the counters are there all the same
        assert "sandlot_storage_tier_bytes 0.0" in admin.text
        assert "sandlot_storage_tier_sent_bytes_total 0.0" in admin.text
        assert theirs.status_code == 200 and "sandlot_storage" not in theirs.text
    finally:
        box.remove(force=True)


def test_an_archive_carries_a_state_as_chunks_and_an_incremental_one_only_what_changed(
    tmp_path: Path, home: Path, root: Path
) -> None:
    import tarfile

    import zstandard

    box = fake_box(home, root)
    other = tmp_path / "other-home"
    try:
        box.exec("remember", "k1", "one")
        s1 = box.snapshot("one")
        box.exec("remember", "k2", "two")
        s2 = box.snapshot("two")
        full, inc = tmp_path / "s1.sandlot", tmp_path / "s2.sandlot"
        s1.export(full)
        s2.export(inc, since="one")

        def members(path: Path) -> list[str]:
            with open(path, "rb") as f, tarfile.open(fileobj=zstandard.ZstdDecompressor().stream_reader(f),
                                                     mode="r|") as tar:  # fmt: skip
                return [m.name for m in tar]

        full_chunks = [m for m in members(full) if m.startswith("chunks/")]
        inc_members = members(inc)
        inc_chunks = [m for m in inc_members if m.startswith("chunks/")]
        assert members(full)[:2] == ["manifest.json", "state"] and "disk.qcow2" in members(full)
        store = BoxStore(home / "sandlot.db")
        d1 = Manifest.decode(store.state_manifest(s1.id) or b"").digests()
        d2 = Manifest.decode(store.state_manifest(s2.id) or b"").digests()
        assert {bytes.fromhex(m.removeprefix("chunks/")) for m in full_chunks} == d1
        assert {bytes.fromhex(m.removeprefix("chunks/")) for m in inc_chunks} == d2 - d1  # only what changed
        assert 0 < len(inc_chunks) < len(d2)
        assert "layer0.qcow2" in inc_members and "disk.qcow2" not in inc_members
        with pytest.raises(InvalidArgument, match="import the base's archive first"):
            sandlot.import_snapshot(inc, home=other, start=False)
        assert sandlot.list_snapshots(home=other) == []
        sandlot.import_snapshot(full, home=other, start=False)
        moved = sandlot.import_snapshot(inc, home=other, name="moved")
        assert moved.exec("recall", "k1").stdout == "one\n" and moved.exec("recall", "k2").stdout == "two\n"
        moved.remove(force=True)
        with pytest.raises(InvalidArgument, match="no base of"):
            s1.export(tmp_path / "x.sandlot", since="two")  # a base is taken before, not after
    finally:
        box.remove(force=True)


def test_an_archive_whose_chunk_was_altered_is_refused_and_nothing_is_added(
    tmp_path: Path, home: Path, root: Path
) -> None:
    import io
    import tarfile

    import zstandard

    box = fake_box(home, root)
    other = tmp_path / "other-home"
    try:
        box.exec("remember", "k", "v")
        archive = box.snapshot("s").export(tmp_path / "s.sandlot")
        altered = tmp_path / "altered.sandlot"
        reading = zstandard.ZstdDecompressor()
        with (
            open(archive, "rb") as f,
            tarfile.open(fileobj=reading.stream_reader(f), mode="r|") as src,
            open(altered, "wb") as out,
            zstandard.ZstdCompressor().stream_writer(out) as zw,
            tarfile.open(fileobj=zw, mode="w|") as dst,
        ):
            done = False
            for m in src:
                data = src.extractfile(m).read()  # type: ignore[union-attr]
                if m.name.startswith("chunks/") and not done:
                    data = zstandard.ZstdCompressor(write_content_size=True).compress(b"not the chunk")
                    m.size, done = len(data), True
                dst.addfile(m, io.BytesIO(data))
        with pytest.raises(CorruptSnapshot, match="does not match its hash"):
            sandlot.import_snapshot(altered, home=other, start=False)
        assert sandlot.list_snapshots(home=other) == []
        assert not list((other / "layers").glob("*")) if (other / "layers").exists() else True
    finally:
        box.remove(force=True)


def test_an_archive_imported_through_a_server_is_the_importers_whatever_box_it_came_from(
    tmp_path: Path, home: Path, root: Path
) -> None:
    import httpx

    from tests.support.inproc import serving

    box = fake_box(home, root, labels={"sandlot.namespace": "team-b", "app": "web"})
    try:
        archive = box.snapshot("theirs").export(tmp_path / "theirs.sandlot")
    finally:
        box.remove(force=True)
    with serving(tmp_path / "server-home") as srv:
        key = {"Authorization": f"Bearer {srv.key('tenant', namespace='team-a')}"}
        r = httpx.post(f"{srv.url}/v1/snapshots/import", params={"start": "false"},
                       content=archive.read_bytes(), headers=key, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        listed = httpx.get(f"{srv.url}/v1/snapshots", headers=key, timeout=30).json()
        assert [s["name"] for s in listed["snapshots"]] == ["theirs"]  # the importer sees what it imported
        started = httpx.post(f"{srv.url}/v1/snapshots/theirs/start", json={}, headers=key, timeout=60)
        assert started.status_code == 201, started.text
        [made] = started.json()["boxes"]
        assert made["labels"]["sandlot.namespace"] == "team-a"
        httpx.delete(f"{srv.url}/v1/boxes/{made['id']}", params={"force": "true"}, headers=key, timeout=60)
