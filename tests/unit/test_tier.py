"""The storage tier under the chunk store (``core/tier.py``, ``core/remote.py``) against a
real S3-compatible server on 127.0.0.1 (moto's, started here; tests/support/s3.py), on
the fake engine, whose saves give the core memory by page as QEMU's do: pushes that
send only what the tier lacks, eviction and loads from the tier, a suspended box moving
to another home with its memory, leases that let one home have it, and every fault the
issue names (a server that fails, stalls or is gone, a chunk altered in the bucket, a
full disk, a kill -9 mid-push and mid-pull). tests/vm/test_tier.py moves a real VM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.core import chunks, packs, remote, tiergc
from sandlot.core.boxrecord import store_path
from sandlot.core.chunks import ChunkStore, KeptLater, digest
from sandlot.core.manifest import Manifest
from sandlot.core.store import BoxStore
from sandlot.core.tier import home_id
from sandlot.errors import BoxElsewhere, CorruptSnapshot, InvalidArgument, InvalidState, NoSpace, TierError

from tests.support.fake_engine import register
from tests.support.s3 import CREDENTIALS, FaultyProxy, S3Server, faulty_proxy, s3_server

register()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultyProxy]:
    with faulty_proxy(s3.endpoint_url) as p:
        yield p


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SANDLOT_STORAGE", raising=False)
    monkeypatch.setenv("SANDLOT_STORAGE_ATTEMPTS", "3")  # what fails for good fails sooner than with 5
    monkeypatch.setenv("SANDLOT_STORAGE_PUSH", "0")  # pushes when each test says (but the pusher's own test)


def homes(tmp_path: Path, proxy: FaultyProxy, n: int = 2) -> list[Path]:
    """Homes sharing one prefix of the bucket (one per test), through the proxy."""
    prefix = tmp_path.name
    out = []
    for i in range(n):
        home = tmp_path / f"home{i}"
        sandlot.storage.configure(f"s3://sandlot-tier/{prefix}", endpoint_url=proxy.url, home=home)
        out.append(home)
    return out


def fake_box(home: Path, root: Path, name: str) -> sandlot.Box:
    box = sandlot.Box(
        rootfs=root, engine="fake", home=home, template=False, memory_mib=256, keep=True, name=name
    )
    box.start()
    return box


def released(home: Path, root: Path, name: str) -> None:
    """A box of ``home`` that remembers ``k`` = ``v``, suspended and pushed whole: it left
    ``home``, and any home of the tier may pull it."""
    box = fake_box(home, root, name)
    box.exec("remember", "k", "v")
    box.suspend()
    sandlot.storage.push(name, release=True, home=home)


def objects(s3: S3Server, prefix: str) -> list[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_a_tier_is_configured_checked_and_shown(tmp_path: Path, proxy: FaultyProxy) -> None:
    home = tmp_path / "home"
    for bad in ("s3://", "http://bucket", "s3://UPPER/x", "s3://b"):
        with pytest.raises(InvalidArgument, match="s3://BUCKET"):
            sandlot.storage.configure(bad, home=home)
    with pytest.raises(InvalidArgument, match="endpoint_url"):
        sandlot.storage.configure("s3://sandlot-tier/x", endpoint_url="ftp://x", home=home)
    with pytest.raises(InvalidState, match="no storage tier"):
        sandlot.storage.push(home=home)
    sandlot.storage.configure("s3://sandlot-tier/x", endpoint_url=proxy.url, home=home)
    assert sandlot.storage.info(home=home).tier == "s3://sandlot-tier/x"
    doctor = sandlot.Runtime.for_home(home).storage_doctor()  # (what `sandlot doctor` shows under storage)
    assert doctor["tier"]["reachable"] is True and doctor["tier"]["url"] == "s3://sandlot-tier/x"
    assert doctor["lazy_restore"] == {"available": True, "why_not": None}  # (fuse3, /dev/fuse, mfusepy)
    proxy.stopped = True
    assert sandlot.Runtime.for_home(home).storage_doctor()["tier"]["reachable"] is False
    sandlot.storage.configure(None, home=home)
    assert sandlot.storage.info(home=home).tier is None


def test_a_push_sends_what_the_tier_lacks_once_and_an_evicted_state_loads_from_it(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    (home,) = homes(tmp_path, proxy, 1)
    box = fake_box(home, root, "ev")
    try:
        box.exec("remember", "k1", "one")
        s1 = box.snapshot("one")
        box.exec("remember", "k2", "two")
        box.snapshot("two")
        first = sandlot.storage.push(home=home)
        assert first.states == 2 and first.chunks > 0
        sent = sandlot.storage.totals(home=home)["tier_sent_bytes"]
        assert sent >= first.bytes > 0  # the chunks, and the manifests beside them
        assert len(objects(s3, f"{tmp_path.name}/states/")) == 2
        assert sandlot.storage.push(home=home).chunks == 0  # all of it there already
        before = sandlot.storage.info(home=home)
        assert before.remote_chunks == before.chunks and before.pushed_states == 2
        evicted = sandlot.storage.evict(older_than=0, home=home)
        assert evicted.chunks > 0
        assert sandlot.storage.info(home=home).local_bytes < before.local_bytes
        assert sandlot.storage.totals(home=home)["tier_received_bytes"] == 0
        box.rollback(s1)  # its chunks come back from the tier
        assert box.exec("recall", "k1").stdout == "one\n" and box.exec("recall", "k2").stdout == "\n"
        assert sandlot.storage.totals(home=home)["tier_received_bytes"] > 0  # the load's, counted
        with pytest.raises(InvalidArgument, match="older_than"):
            sandlot.storage.evict(home=home)
    finally:
        box.remove(force=True)


def test_a_suspended_box_moves_to_another_home_and_one_home_holds_it(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    a, b, c = homes(tmp_path, proxy, 3)
    box = fake_box(a, root, "mover")
    box.exec("remember", "k", "kept")
    box.suspend()
    first = sandlot.storage.push("mover", home=a)  # a copy in the tier: home a keeps it
    with pytest.raises(BoxElsewhere, match=f"held by home {home_id(a)}") as held:
        sandlot.storage.pull("mover", home=b)
    assert held.value.holder == home_id(a)
    assert sandlot.list(home=b) == []
    report = sandlot.storage.push("mover", release=True, home=a)  # it leaves home a
    assert report.files >= 2 and sandlot.list(home=a) == []  # its layer and the base below it
    moved = sandlot.storage.pull("mover", home=b)
    assert (moved.id, moved.name, moved.state) == (box.id, "mover", "suspended")
    assert moved.exec("recall", "k").stdout == "kept\n"  # resumed, its memory as it was
    assert sandlot.storage.boxes(home=c)[0]["holder"] == home_id(b)
    assert sandlot.storage.box(box.id, home=c) == sandlot.storage.boxes(home=c)[0]  # one box, by one read
    assert sandlot.storage.box("0" * 12, home=c) is None and sandlot.storage.box("../x", home=c) is None
    with pytest.raises(BoxElsewhere, match=f"held by home {home_id(b)}"):
        sandlot.storage.pull("mover", home=c)
    moved.suspend()
    again = sandlot.storage.push("mover", release=True, home=b)
    # the tier has what the box came with: only what changed goes (home b asks the tier
    # for the chunks it no longer knows are there, as the state it pulled went on resume)
    assert first.bytes > 0 and again.bytes < first.bytes, (again, first)
    back = sandlot.storage.pull(box.id, home=a)  # by id too
    assert back.exec("recall", "k").stdout == "kept\n"
    back.remove(force=True)


def test_two_homes_pulling_one_box_at_once_one_gets_it(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    a, b, c = homes(tmp_path, proxy, 3)
    released(a, root, "raced")
    outcomes: dict[Path, object] = {}

    def pull(home: Path) -> None:
        try:
            outcomes[home] = sandlot.storage.pull("raced", home=home)
        except BoxElsewhere as exc:
            outcomes[home] = exc

    threads = [threading.Thread(target=pull, args=(h,)) for h in (b, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    won = [h for h, o in outcomes.items() if not isinstance(o, BaseException)]
    lost = [o for o in outcomes.values() if isinstance(o, BoxElsewhere)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert lost[0].holder == home_id(won[0])
    loser = c if won[0] == b else b
    assert sandlot.list(home=loser) == []  # nothing half-pulled stays
    sandlot.get("raced", home=won[0]).remove(force=True)


def test_a_home_that_is_gone_lets_another_take_its_box_by_force(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    a, b = homes(tmp_path, proxy, 2)
    box = fake_box(a, root, "orphan")
    box.exec("remember", "k", "v")
    box.suspend()
    sandlot.storage.push("orphan", home=a)  # kept by a, which is then lost
    with pytest.raises(BoxElsewhere):
        sandlot.storage.pull("orphan", home=b)
    taken = sandlot.storage.pull("orphan", force=True, home=b)
    assert taken.exec("recall", "k").stdout == "v\n"
    taken.remove(force=True)
    box.remove(force=True)


def test_a_failing_or_stalling_server_is_retried_and_what_still_fails_is_clear(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    (home,) = homes(tmp_path, proxy, 1)
    box = fake_box(home, root, "flaky")
    try:
        box.exec("remember", "k", "v")
        box.snapshot("s")
        proxy.fail("PUT", "/packs/", status=500, times=2)  # a 500 mid-push: retried
        proxy.fail("PUT", "/states/", status=0, times=1)  # a dropped connection: retried
        proxy.fail("PUT", "/packs/", status=503, times=1, delay=1.0)  # a slow, busy server
        assert sandlot.storage.push(home=home).states == 1
        box.exec("remember", "k2", "v2")
        box.snapshot("t")
        proxy.fail("PUT", "/packs/", status=500, times=10_000)  # down for good: a clear error
        with pytest.raises(TierError, match=r"refused to write .*packs/"):
            sandlot.storage.push(home=home)
        assert sandlot.storage.info(home=home).pushed_states == 1  # nothing counted as sent that was not
        proxy.clear()
        proxy.stopped = True  # gone
        with pytest.raises(TierError, match=r"could not|refused"):
            sandlot.storage.push(home=home)
        proxy.stopped = False
        assert sandlot.storage.push(home=home).states == 1  # and it goes on where it stopped
    finally:
        box.remove(force=True)


def test_a_chunk_altered_in_the_bucket_is_refused_and_the_box_stays_suspended(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    a, b = homes(tmp_path, proxy, 2)
    released(a, root, "altered")
    moved = sandlot.storage.pull("altered", home=b)
    client = s3.client()
    for key in objects(s3, f"{tmp_path.name}/packs/"):
        body = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=s3.bucket, Key=key, Body=body[:-3] + b"xyz")  # each pack's last chunk
    with pytest.raises(CorruptSnapshot, match="in the storage tier is damaged"):
        moved.resume()
    assert sandlot.get("altered", home=b).state == "suspended"
    sandlot.get("altered", home=b).remove(force=True)


def test_a_failed_pull_leaves_no_box_and_lets_the_box_go_again(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    a, b, c = homes(tmp_path, proxy, 3)
    released(a, root, "pulled")
    proxy.fail("GET", "/packs/", status=500, times=10_000)
    with pytest.raises(TierError):
        sandlot.storage.pull("pulled", home=b)
    assert sandlot.list(home=b) == [] and not list((b / "layers").glob("*"))
    proxy.clear()
    assert sandlot.storage.pull("pulled", home=c).state == "suspended"  # let go by b's failure
    sandlot.get("pulled", home=c).remove(force=True)


PULLING = """
import os, sys
from tests.support.fake_engine import register
import sandlot
register()
os.environ["SANDLOT_CRASH_AT"] = sys.argv[3]
getattr(sandlot.storage, sys.argv[1])(*sys.argv[4:], home=sys.argv[2])
print("survived", flush=True)
"""


def test_a_kill_mid_push_or_mid_pull_loses_nothing(tmp_path: Path, proxy: FaultyProxy, root: Path) -> None:
    a, b = homes(tmp_path, proxy, 2)
    box = fake_box(a, root, "killed")
    box.exec("remember", "k", "v")
    box.suspend()
    env = {**os.environ, **CREDENTIALS}

    def run(*args: str) -> None:
        p = subprocess.run([sys.executable, "-c", PULLING, *args], env=env, capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).parents[2])  # fmt: skip
        assert p.returncode == -9 and "survived" not in p.stdout, p.stderr[-2000:]

    run("push", str(a), "remote.mid-push")  # some chunks sent, the box's row not
    assert sandlot.get("killed", home=a).state == "suspended"
    sandlot.storage.push("killed", release=True, home=a)  # sends the rest
    run("pull", str(b), "remote.mid-pull", "killed")  # the files pulled, the rows not written
    assert sandlot.list(home=b) == []
    moved = sandlot.storage.pull("killed", home=b)  # the same home takes it again: its lease is its own
    assert moved.exec("recall", "k").stdout == "v\n"
    moved.remove(force=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem for the home needs root")
def test_a_full_disk_fails_a_pull_clearly_and_leaves_nothing(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    a, _ = homes(tmp_path, proxy, 2)
    released(a, root, "big")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        small = mnt / "home"
        sandlot.storage.configure(f"s3://sandlot-tier/{tmp_path.name}", endpoint_url=proxy.url, home=small)
        assert sandlot.list(home=small) == []  # (its store made)
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        (mnt / "filler").write_bytes(bytes(max(0, free - (128 << 10))))  # a disk all but full
        with pytest.raises(NoSpace):
            sandlot.storage.pull("big", home=small)
        assert sandlot.list(home=small) == []
        assert not list(small.glob("layers/*")) and not list(small.glob("bases/*"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    assert sandlot.storage.pull("big", home=tmp_path / "home1").state == "suspended"  # it was let go
    sandlot.get("big", home=tmp_path / "home1").remove(force=True)


def test_the_pushed_states_and_chunks_are_counted_in_the_store(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    (home,) = homes(tmp_path, proxy, 1)
    box = fake_box(home, root, "counted")
    try:
        box.snapshot("s")
        sandlot.storage.push(home=home)
        totals = chunks.chunk_totals(BoxStore(home / "sandlot.db"))
        assert totals["remote_chunks"] == totals["chunks"] and totals["pushed_states"] == 1
        assert ChunkStore(home).tier() is not None
    finally:
        box.remove(force=True)


def test_a_home_whose_box_was_taken_by_force_does_not_run_it_too(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    a, b = homes(tmp_path, proxy, 2)
    box = fake_box(a, root, "twice")
    box.suspend()
    sandlot.storage.push("twice", home=a)  # kept by a, thought gone
    taken = sandlot.storage.pull("twice", force=True, home=b)
    with pytest.raises(BoxElsewhere, match=f"held by home {home_id(b)}"):
        box.resume()  # a comes back: the box runs on b now
    assert sandlot.get("twice", home=a).state == "suspended"
    taken.remove(force=True)
    box.remove(force=True)


def test_the_pusher_sends_each_save_and_each_suspended_box_in_the_background(
    tmp_path: Path, proxy: FaultyProxy, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setenv("SANDLOT_STORAGE_PUSH", "1")
    a, b = homes(tmp_path, proxy, 2)
    box = fake_box(a, root, "background")
    box.exec("remember", "k", "v")
    box.snapshot("s")
    box.suspend()  # nothing asked of the tier: the home's pusher sends both, the box whole

    def pushed() -> bool:
        info = sandlot.storage.info(home=a)
        return info.pushed_states == 2 and any(
            x["name"] == "background" for x in sandlot.storage.boxes(home=b)
        )

    deadline = time.monotonic() + 60
    while not pushed():
        assert time.monotonic() < deadline, (
            (a / "chunks" / "pusher.log").read_text()
            if (a / "chunks" / "pusher.log").exists()
            else "no pusher log"
        )
        time.sleep(0.2)
    assert sandlot.storage.boxes(home=b)[0]["holder"] == home_id(a)  # a holds it, as it runs there
    taken = sandlot.storage.pull("background", force=True, home=b)  # a's host is lost: b takes it
    assert taken.exec("recall", "k").stdout == "v\n"
    taken.remove(force=True)
    box.remove(force=True)


# -- collecting the tier (core/tiergc.py) ---------------------------------------------------


def states_in(s3: S3Server, tmp_path: Path) -> set[str]:
    return {k.rsplit("/", 1)[1] for k in objects(s3, f"{tmp_path.name}/states/")}


def test_a_collection_deletes_what_no_home_holds_and_keeps_what_any_needs(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    a, b = homes(tmp_path, proxy, 2)
    box = fake_box(a, root, "kept")
    other = fake_box(b, root, "theirs")
    try:
        box.exec("remember", "k", "one")
        s1 = box.snapshot("one")
        box.exec("remember", "big", "x" * 300_000)  # chunks of s2's own
        s2 = box.snapshot("two")
        s3_ = other.snapshot("theirs")
        sandlot.storage.push(home=a)
        sandlot.storage.push(home=b)
        assert states_in(s3, tmp_path) == {s1.id, s2.id, s3_.id}
        nothing = sandlot.storage.gc(tier=True, home=b).tier
        assert nothing is not None and (nothing.states, nothing.chunks) == (0, 0) and nothing.generation == 1
        packs_before = len(objects(s3, f"{tmp_path.name}/packs/"))
        s2.remove()
        # home a has not said it let s2 go: a collection by another home keeps it
        assert sandlot.storage.gc(tier=True, home=b).tier.states == 0  # type: ignore[union-attr]
        gone = sandlot.storage.gc(tier=True, home=a).tier  # home a says what it holds first
        assert gone is not None and gone.states == 1 and gone.chunks > 0 and gone.bytes_freed > 0
        assert gone.packs >= 1 and gone.dead_bytes == 0  # s2's own chunks: in packs of s2's own
        assert states_in(s3, tmp_path) == {s1.id, s3_.id}
        assert len(objects(s3, f"{tmp_path.name}/packs/")) == packs_before - gone.packs
        assert len(objects(s3, f"{tmp_path.name}/places/states/")) == 2  # s2's places went with it
        # what is left is whole: cold state evicted here loads from the tier
        sandlot.storage.evict(older_than=0, home=a)
        sandlot.storage.evict(older_than=0, home=b)
        box.rollback(s1)
        assert box.exec("recall", "k").stdout == "one\n" and box.exec("recall", "big").stdout == "\n"
        other.rollback(s3_)
        assert sandlot.storage.gc(tier=True, home=a).tier.chunks == 0  # type: ignore[union-attr]
    finally:
        box.remove(force=True)
        other.remove(force=True)


def test_a_home_forgets_the_chunks_a_collection_deleted_and_sends_them_again(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    """s1 goes to the tier; s2, which shares its chunks, stays here unpushed. Once s1 is
    removed and the tier collected, the shared chunks are gone from the bucket though
    this home had counted them as there: its next push sends them again."""
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "forgets")
    try:
        box.exec("remember", "k", "v")
        s1 = box.snapshot("one")
        sandlot.storage.push(home=a)
        s2 = box.snapshot("two")  # the same memory: its chunks are counted as the tier's
        s1.remove()
        collected = sandlot.storage.gc(tier=True, home=a).tier
        assert collected is not None and collected.states == 1 and collected.chunks > 0
        again = sandlot.storage.push(home=a)
        assert again.states == 1 and again.chunks == collected.chunks, (again, collected)
        rolls_back_from_the_tier(box, s2, a)
    finally:
        box.remove(force=True)


def rolls_back_from_the_tier(
    box: sandlot.Box, snap: sandlot.Snapshot, home: Path, key: str = "k", value: str = "v"
) -> None:
    """Every chunk of the home evicted, the box rolled back to ``snap`` (which remembers
    ``key`` = ``value``): its state comes from the tier, each chunk checked."""
    sandlot.storage.evict(older_than=0, home=home)
    box.exec("remember", key, "changed")
    box.rollback(snap)
    assert box.exec("recall", key).stdout.strip() == value


def test_a_state_whose_chunks_the_tier_held_before_sends_only_what_changed(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    """A box that sleeps, wakes and sleeps again: its first state is pushed, then removed
    and its chunks' rows and files collected here. The next state, of the same memory,
    sends no chunk: this home still knows the tier holds them. Once a collection of the
    tier deleted them, the home learns it, and the next push sends them again."""
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "sleeper")
    try:
        box.exec("remember", "k", "v")
        s1 = box.snapshot("one")
        first = sandlot.storage.push(home=a)
        assert first.chunks > 0
        s1.remove()
        sandlot.storage.gc(home=a)  # the rows and files of s1's chunks go here
        assert sandlot.storage.info(home=a).chunks == 0
        s2 = box.snapshot("two")
        again = sandlot.storage.push(home=a)
        assert (again.states, again.chunks) == (1, 0), again
        s2.remove()
        sandlot.storage.gc(home=a)
        collected = sandlot.storage.gc(tier=True, home=a).tier  # nothing lists them: they go
        assert collected is not None and collected.chunks == first.chunks, (collected, first)
        s3_ = box.snapshot("three")
        third = sandlot.storage.push(home=a)
        assert third.chunks == first.chunks, (third, first)
        rolls_back_from_the_tier(box, s3_, a)
    finally:
        box.remove(force=True)


def test_a_box_in_the_tier_keeps_its_state_until_the_home_that_holds_it_removed_it(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    a, b = homes(tmp_path, proxy, 2)
    released(a, root, "travels")  # let go: no home has it, any may pull it
    assert sandlot.storage.gc(tier=True, home=a).tier.states == 0  # type: ignore[union-attr]
    moved = sandlot.storage.pull("travels", home=b)
    assert sandlot.storage.gc(tier=True, home=a).tier.boxes == 0  # type: ignore[union-attr]
    assert moved.exec("recall", "k").stdout == "v\n"
    moved.remove(force=True)  # removed where it is held: nobody will pull it again
    argv = [sys.executable, "-m", "sandlot.cli", "storage", "gc", "--tier"]  # the CLI's face of it
    env = {**os.environ, "SANDLOT_HOME": str(b)}
    cli = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert cli.returncode == 0, cli.stderr
    said = re.search(
        r"tier: removed (\d+) chunks .*, (\d+) states, (\d+) disk files, (\d+) boxes", cli.stdout
    )
    assert said is not None, cli.stdout
    chunks, states, files, boxes = map(int, said.groups())
    assert (boxes, states) == (1, 1) and files >= 2 and chunks > 0
    assert sandlot.storage.boxes(home=a) == []
    assert objects(s3, f"{tmp_path.name}/leases/") == [] and objects(s3, f"{tmp_path.name}/files/") == []


def put_lock(s3: S3Server, tmp_path: Path, name: str, **lock: object) -> None:
    s3.client().put_object(
        Bucket=s3.bucket, Key=f"{tmp_path.name}/locks/{name}", Body=json.dumps(lock).encode()
    )


def test_a_collection_and_a_push_never_run_at_once(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "locked")
    try:
        box.snapshot("one")
        now = time.time()
        elsewhere = {"home": "h2", "host": "another-host", "pid": 1, "start": "1"}
        put_lock(s3, tmp_path, "push-elsewhere.json", **elsewhere, at=now)
        with pytest.raises(
            TierError, match=r"a push of the storage tier by home h2 .*another-host.* under way"
        ):
            sandlot.storage.gc(tier=True, home=a, wait=1)
        assert objects(s3, f"{tmp_path.name}/locks/gc.json") == []  # it let go of its own
        # a lock not written again for STALE seconds, or whose process is gone from this host: dead
        put_lock(s3, tmp_path, "push-elsewhere.json", **elsewhere, at=now - tiergc.STALE - 1)
        put_lock(s3, tmp_path, "push-here.json", home="h3", host=socket.gethostname(), pid=2**22 + 1,
                 start="1", at=now)  # fmt: skip
        assert sandlot.storage.gc(tier=True, home=a, wait=1).tier is not None
        assert objects(s3, f"{tmp_path.name}/locks/") == []  # the dead ones, deleted
        put_lock(s3, tmp_path, "gc.json", **elsewhere, at=now)
        monkeypatch.setattr(tiergc, "WAIT", 1.0)
        with pytest.raises(TierError, match="a collection of the storage tier by home h2"):
            sandlot.storage.push(home=a)
        assert sandlot.storage.info(home=a).pushed_states == 0
        # the push let go of its own lock; the collection's it waited for stays
        assert objects(s3, f"{tmp_path.name}/locks/") == [f"{tmp_path.name}/locks/gc.json"]
    finally:
        box.remove(force=True)


def test_a_kill_mid_collection_loses_nothing_and_the_next_one_ends_its_work(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "collected")
    env = {**os.environ, **CREDENTIALS}
    try:
        box.exec("remember", "k", "v")
        kept = box.snapshot("kept")
        box.exec("remember", "big", "y" * 300_000)
        dropped = box.snapshot("dropped")
        sandlot.storage.push(home=a)
        dropped.remove()
        for point in ("tiergc.recorded", "tiergc.deleted"):
            argv = [sys.executable, "-c", COLLECTING, str(a), point]
            p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
            assert p.returncode == -9 and "survived" not in p.stdout, p.stderr[-2000:]
            # its lock is left, its process gone: the next collection takes it over
            assert objects(s3, f"{tmp_path.name}/locks/gc.json")
            assert states_in(s3, tmp_path) == (
                {kept.id, dropped.id} if point == "tiergc.recorded" else {kept.id}
            )
        last = sandlot.storage.gc(tier=True, home=a, wait=5).tier
        assert last is not None and last.generation == 3 and last.chunks == 0  # the killed one deleted it all
        assert states_in(s3, tmp_path) == {kept.id}
        assert sandlot.storage.push(home=a).chunks == 0
        sandlot.storage.evict(older_than=0, home=a)
        box.rollback(kept)
        assert box.exec("recall", "k").stdout == "v\n" and box.exec("recall", "big").stdout == "\n"
    finally:
        box.remove(force=True)


REPO = Path(__file__).parents[2]
COLLECTING = """
import os, sys
from tests.support.fake_engine import register
import sandlot
from sandlot.core import packs
register()
packs.REPACK_DEAD_BYTES = 0  # (what the tests of rewritten packs set)
os.environ["SANDLOT_CRASH_AT"] = sys.argv[2]
sandlot.storage.gc(tier=True, home=sys.argv[1], wait=5)
print("survived", flush=True)
"""


def test_a_box_asleep_for_evict_after_leaves_this_host_with_no_call_after_its_suspend(
    tmp_path: Path, proxy: FaultyProxy, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deep sleep: the pusher the suspend started sends the box, waits out the tier's
    ``evict_after`` and keeps only the manifest here; then it ends. The wake reads the
    tier (the fake engine loads it whole; a VM's lazily: tests/vm/test_tier.py)."""
    from sandlot.config import try_flock
    from sandlot.core import pusher
    from sandlot.core.manifest import Manifest
    from sandlot.core.runtime import Runtime

    monkeypatch.setenv("SANDLOT_STORAGE_PUSH", "1")
    home = tmp_path / "home"
    sandlot.storage.configure(f"s3://sandlot-tier/{tmp_path.name}", endpoint_url=proxy.url, evict_after=2.0,
                              home=home)  # fmt: skip
    box = fake_box(home, root, "sleeper")
    box.exec("remember", "k", "v")
    box.suspend()
    asleep = time.monotonic()
    rt = Runtime.for_home(home)
    state = rt.store.get(box.id).suspended
    store = ChunkStore(home)
    digests = Manifest.decode(rt.store.state_manifest(state) or b"", state).digests()
    deadline = time.monotonic() + 60
    while all(store.path(d).exists() for d in digests):
        assert time.monotonic() < deadline, (home / "chunks" / "pusher.log").read_text()
        time.sleep(0.1)
    assert time.monotonic() - asleep >= 1.5  # not before its evict_after (less the suspend's own time)
    assert sandlot.storage.boxes(home=home)[0]["name"] == "sleeper"  # sent whole before
    while (fd := try_flock(pusher.lock_path(home))) is None:  # nothing left to cool: it ends
        assert time.monotonic() < deadline, "the pusher kept waiting with nothing left to cool"
        time.sleep(0.1)
    os.close(fd)
    assert box.exec("recall", "k").stdout == "v\n"  # woken from the tier
    assert sandlot.storage.totals(home=home)["tier_received_bytes"] > 0
    box.remove(force=True)


def test_a_state_that_turned_cold_while_an_eviction_ran_is_due_at_once(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    """The pusher waits for the next state to cool after its round's eviction: a state
    that cooled while that round ran (after the eviction looked, before the wait began)
    is due at once, not let go of (the pusher used to end then, the box left unevicted)."""
    from sandlot.core.runtime import Runtime

    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "cooling")
    box.exec("remember", "k", "v")
    box.suspend()
    rt = Runtime.for_home(a)
    stopped = rt.store.get(box.id).stopped_at
    assert stopped is not None
    with remote.Remote.of(rt) as r:
        assert r.next_cold(0.5, stopped + 0.4) == stopped + 0.5  # cold since: still due
        assert r.next_cold(0.5, stopped + 0.6) is None  # the eviction that looked then took it
        assert r.evict(0.5, stopped + 0.6)[0] > 0
    box.remove(force=True)


def test_chunks_go_to_the_tier_in_packs_and_a_state_comes_back_in_a_few_reads(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    """A state's new chunks go as one pack (not an object each) with its places, and a
    rollback to it once its chunks left this host reads runs of them in ranged reads; a
    second state sends only its own chunks, in a pack of its own."""
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "packed")
    big = os.urandom(350_000).hex()  # about 11 chunks of its own, none alike
    try:
        box.exec("remember", "big", big)
        one = box.snapshot("one")
        proxy.seen.clear()
        sent = sandlot.storage.push(home=a)
        puts = [p for m, p in proxy.seen if m == "PUT"]
        assert sent.chunks >= 10 and sent.states == 1
        assert len([p for p in puts if "/packs/" in p]) == 1 and not [p for p in puts if "/chunks/" in p]
        assert [p for p in puts if "/places/states/" in p] and [p for p in puts if "/states/" in p]
        box.exec("remember", "k", "v")
        box.snapshot("two")
        again = sandlot.storage.push(home=a)
        assert 0 < again.chunks < sent.chunks  # what changed, in a pack of its own
        assert len(objects(s3, f"{tmp_path.name}/packs/")) == 2
        sandlot.storage.evict(older_than=0, home=a)
        box.exec("remember", "big", "changed")
        proxy.seen.clear()
        box.rollback(one)
        gets = [p for m, p in proxy.seen if m == "GET" and "/packs/" in p]
        assert 1 <= len(gets) <= 4, gets  # runs of chunks, not a read each
        assert box.exec("recall", "big").stdout.strip() == big
    finally:
        box.remove(force=True)


def test_chunks_a_lazy_wake_fetches_are_kept_here_by_a_thread_of_their_own(
    tmp_path: Path, proxy: FaultyProxy, root: Path
) -> None:
    """``get_many`` with a ``KeptLater`` answers with the chunks' bytes and leaves their
    files to its thread (a lazy restore's VM waits on the answer, not on the disk): every
    one is kept once the block ends; past its limit a reader writes its own at once."""
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "kept")
    try:
        box.exec("remember", "big", os.urandom(350_000).hex())
        snap = box.snapshot("one")
        sandlot.storage.push(home=a)
        sandlot.storage.evict(older_than=0, home=a)
        store = ChunkStore(a)
        manifest = Manifest.decode(BoxStore(store_path(a)).state_manifest(snap.id) or b"", snap.id)
        wanted = sorted(d for d in manifest.digests() if not store.path(d).exists())
        assert len(wanted) >= 10
        half = len(wanted) // 2
        with KeptLater(store) as later:
            got = store.get_many([(d, None) for d in wanted[:half]], snap.id, keep=later)
            assert [digest(g) for g in got] == wanted[:half]
        assert all(store.path(d).exists() for d in wanted[:half])  # all kept when the block ended
        with KeptLater(store) as later:
            later.limit = 0  # nothing may wait: each is written by the reader
            store.get_many([(d, None) for d in wanted[half:]], snap.id, keep=later)
            assert all(store.path(d).exists() for d in wanted[half:])
        proxy.seen.clear()
        box.rollback(snap)  # from this host's disk: no read of the tier
        assert not [p for m, p in proxy.seen if m == "GET" and "/packs/" in p]
    finally:
        box.remove(force=True)


def test_a_pack_some_of_whose_chunks_are_still_listed_stays_and_its_dead_bytes_are_counted(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "partly")
    try:
        box.exec("remember", "big", os.urandom(300_000).hex())
        first = box.snapshot("first")
        sandlot.storage.push(home=a)
        box.exec("remember", "big", "gone")  # the next state lists few of the first's chunks
        second = box.snapshot("second")
        sandlot.storage.push(home=a)
        first.remove()
        gone = sandlot.storage.gc(tier=True, home=a).tier
        assert gone is not None and gone.states == 1 and gone.packs == 0 and gone.dead_bytes > 0
        assert len(objects(s3, f"{tmp_path.name}/packs/")) == 2  # the first's pack holds chunks of the second
        rolls_back_from_the_tier(box, second, a, "big", "gone")
    finally:
        box.remove(force=True)


def test_a_home_that_forgot_what_the_tier_holds_finds_its_evicted_state_by_its_places(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    """A home whose memory of the tier was wiped (a collection it could not follow) pushes
    its evicted state again: its chunks, only in the tier now, are found by the places
    sent with it, and nothing is sent twice."""
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "forgot")
    try:
        box.exec("remember", "k", "v")
        snap = box.snapshot("s")
        sandlot.storage.push(home=a)
        sandlot.storage.evict(older_than=0, home=a)
        remote.forget_remote(BoxStore(a / "sandlot.db"), everything=True)
        again = sandlot.storage.push(home=a)
        assert again.states == 1 and again.chunks == 0, again
        rolls_back_from_the_tier(box, snap, a)
    finally:
        box.remove(force=True)


def test_a_pack_whose_header_is_damaged_is_kept_by_a_collection_and_its_chunks_refused_by_name(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path
) -> None:
    """A collection deletes only what it can tell is garbage: a pack whose header it cannot
    read stays. A load that reads a damaged chunk of it names the chunk."""
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "damaged")
    try:
        box.exec("remember", "k", "v")
        snap = box.snapshot("s")
        sandlot.storage.push(home=a)
        client = s3.client()
        (key,) = objects(s3, f"{tmp_path.name}/packs/")
        body = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"NOTAPACK" + body[8:])
        sandlot.storage.evict(older_than=0, home=a)
        snap.remove()
        gone = sandlot.storage.gc(tier=True, home=a).tier
        assert gone is not None and gone.states == 1 and gone.packs == 0
        assert objects(s3, f"{tmp_path.name}/packs/") == [key]
        # the same bytes at the chunk's place, altered: refused by name
        client.put_object(Bucket=s3.bucket, Key=key, Body=body[:-3] + b"xyz")
        s2 = box.snapshot("t")
        sandlot.storage.push(home=a)
        sandlot.storage.evict(older_than=0, home=a)
        with pytest.raises(CorruptSnapshot, match=r"its chunk [0-9a-f]{64} in the storage tier is damaged"):
            box.rollback(s2)
        client.put_object(Bucket=s3.bucket, Key=key, Body=body[:40])  # cut short: its chunks past its end
        with pytest.raises(CorruptSnapshot, match=r"packs/[0-9a-f]{64} in the storage tier .*cut short"):
            box.rollback(s2)
    finally:
        box.remove(force=True)


def a_pack_mostly_dead(
    box: sandlot.Box, home: Path, s3: S3Server, tmp_path: Path
) -> tuple[sandlot.Snapshot, str]:
    """Two states pushed, the first removed: the second shares little of the first's pack,
    most of which is dead. The second (which remembers ``big`` = "gone", ``k`` = "v"), and
    the first's pack."""
    box.exec("remember", "big", os.urandom(300_000).hex())
    box.exec("remember", "k", "v")
    first = box.snapshot("first")
    sandlot.storage.push(home=home)
    (old,) = objects(s3, f"{tmp_path.name}/packs/")
    box.exec("remember", "big", "gone")
    second = box.snapshot("second")
    sandlot.storage.push(home=home)
    first.remove()
    return second, old


def test_a_pack_mostly_dead_is_written_again_and_homes_find_its_chunks_where_they_went(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removed state whose pack a later state shares: once the dead chunks are half of the
    pack, a collection writes its live chunks into a new pack, says where they went
    (``moved/``), points the later state's places at it and deletes the old pack. A home
    that still knows the old places reads the chunks at the new ones when its read finds
    the old pack gone, and learns them all when it catches up before a push; another home
    pulls the state by its new places."""

    monkeypatch.setattr(packs, "REPACK_DEAD_BYTES", 0)  # (the default waits for a MiB of them)
    a, b = homes(tmp_path, proxy, 2)
    box = fake_box(a, root, "repacked")
    try:
        second, old = a_pack_mostly_dead(box, a, s3, tmp_path)
        sandlot.storage.evict(older_than=0, home=a)
        report = sandlot.storage.gc(tier=True, home=a).tier
        assert report is not None and report.states == 1 and report.repacked == 1 and report.dead_bytes == 0
        assert report.bytes_freed > 300_000
        left = objects(s3, f"{tmp_path.name}/packs/")
        assert old not in left and len(left) == 2  # the second's own, and the first's live chunks
        moved = f"{tmp_path.name}/moved/{old.rsplit('/', 1)[1]}"
        assert objects(s3, f"{tmp_path.name}/moved/") == [moved]
        client = s3.client()
        body = client.get_object(Bucket=s3.bucket, Key=f"{tmp_path.name}/places/states/{second.id}")["Body"]
        assert old.rsplit("/", 1)[1] not in {
            p.pack.hex() for p in packs.decode_places(body.read(), "s").values()
        }
        # this home's places still say the old pack: a read finds it gone, and where it went
        proxy.seen.clear()
        box.exec("remember", "big", "changed")
        box.rollback(second)
        assert box.exec("recall", "big").stdout.strip() == "gone"
        assert box.exec("recall", "k").stdout.strip() == "v"
        assert [p for m, p in proxy.seen if m == "GET" and "/moved/" in p]
        # a push catches up with the collection: every place it knows is a pack the tier has
        sandlot.storage.push(home=a)
        known = packs.tier_places(BoxStore(a / "sandlot.db"), [bytes.fromhex(r[0]) for r in _all_digests(a)])
        assert known and old.rsplit("/", 1)[1] not in {p.pack.hex() for p in known.values()}
        # another home pulls the box: its state comes by its new places
        box.suspend()
        sandlot.storage.push("repacked", release=True, home=a)
        moved_box = sandlot.storage.pull("repacked", home=b)
        assert moved_box.exec("recall", "k").stdout.strip() == "v"
        assert moved_box.exec("recall", "big").stdout.strip() == "gone"
        moved_box.remove(force=True)
        # once the collection's record is dropped (the newest RECORDS_KEPT stay), its moves go too
        monkeypatch.setattr(tiergc, "RECORDS_KEPT", 1)
        sandlot.storage.gc(tier=True, home=b)
        assert objects(s3, f"{tmp_path.name}/moved/") == []
    finally:
        with contextlib.suppress(Exception):
            box.remove(force=True)


def _all_digests(home: Path) -> list[tuple[str]]:
    import sqlite3

    with contextlib.closing(sqlite3.connect(home / "sandlot.db")) as db:
        return [(bytes(r[0]).hex(),) for r in db.execute("SELECT digest FROM tier_places")]


def test_a_kill_while_a_collection_writes_packs_again_loses_nothing(
    tmp_path: Path, proxy: FaultyProxy, s3: S3Server, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed once the new packs, their ``moved/`` and the places pointing at them are
    written, before its record: the old pack is still there, and every state reads from
    either; the next collection writes it again and deletes it."""

    monkeypatch.setattr(packs, "REPACK_DEAD_BYTES", 0)
    (a,) = homes(tmp_path, proxy, 1)
    box = fake_box(a, root, "killed-repack")
    env = {**os.environ, **CREDENTIALS}
    try:
        second, old = a_pack_mostly_dead(box, a, s3, tmp_path)
        argv = [sys.executable, "-c", COLLECTING, str(a), "tiergc.repacked"]
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert p.returncode == -9 and "survived" not in p.stdout, p.stderr[-2000:]
        assert old in objects(s3, f"{tmp_path.name}/packs/")  # no record yet: nothing deleted
        rolls_back_from_the_tier(box, second, a, "big", "gone")
        last = sandlot.storage.gc(tier=True, home=a, wait=5).tier
        assert last is not None and last.repacked == 1 and old not in objects(s3, f"{tmp_path.name}/packs/")
        rolls_back_from_the_tier(box, second, a, "big", "gone")
        assert box.exec("recall", "k").stdout.strip() == "v"
    finally:
        box.remove(force=True)
