"""``box.files.watch`` on a real guest: the agent's inotify channel under the guest's
own kernel, through the sync API. The finer event semantics are checked against the
agent on the host in ``tests/unit/test_watch_agent.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot import Box, FileEvent, Watch

pytestmark = pytest.mark.vm

D = "/tmp/watched"


@pytest.fixture
def tree(bb_box: Box) -> Iterator[str]:
    bb_box.files.mkdir(D)
    yield D
    bb_box.files.remove(D, recursive=True, missing_ok=True)
    assert inotify_fds(bb_box) == 0  # every test's watches were freed in the box


def inotify_fds(box: Box) -> int:
    out = box.exec("sh", "-c", "ls -l /proc/1/fd | grep -c inotify").stdout
    return int(out.strip() or 0)


def take(w: Watch, n: int, timeout: float = 10.0) -> list[tuple[str, str, bool, str | None]]:
    out = []
    for _ in range(n):
        e = w.next_event(timeout)
        assert e is not None, f"the watch ended after {out}"
        out.append((e.type, e.path, e.is_dir, e.old_path))
    return out


def test_create_modify_delete_and_move(bb_box: Box, tree: str) -> None:
    with bb_box.files.watch(tree) as w:
        bb_box.exec("sh", "-c", f"echo one > {tree}/a && mkdir {tree}/out-and-in").check()
        assert take(w, 3) == [("created", f"{tree}/a", False, None), ("modified", f"{tree}/a", False, None),
                              ("created", f"{tree}/out-and-in", True, None)]  # fmt: skip
        # 1 MiB in 256 writes: one event when the writes took less than the settle time
        # (250 ms), and never more than one per settle time while the file is open
        started = time.monotonic()
        bb_box.exec("dd", "if=/dev/zero", f"of={tree}/a", "bs=4096", "count=256").check()
        writing = time.monotonic() - started  # at least how long the file was open
        bb_box.exec("mv", f"{tree}/a", f"{tree}/b").check()
        got = take(w, 1)
        modified = 0
        while got == [("modified", f"{tree}/a", False, None)]:
            modified += 1
            got = take(w, 1)
        assert 1 <= modified <= 1 + writing / 0.25, (modified, writing)
        assert got == [("moved", f"{tree}/b", False, f"{tree}/a")]
        bb_box.exec("mv", f"{tree}/b", "/tmp/outside").check()  # out of the tree: deleted
        assert take(w, 1) == [("deleted", f"{tree}/b", False, None)]
        bb_box.exec("mv", "/tmp/outside", f"{tree}/c").check()  # into it: created
        assert take(w, 1) == [("created", f"{tree}/c", False, None)]
        bb_box.exec("rm", f"{tree}/c").check()
        assert take(w, 1) == [("deleted", f"{tree}/c", False, None)]
        bb_box.files.write(f"{tree}/d", "atomic")  # a temporary renamed over the path
        got = take(w, 3)
        assert got[-1][:2] == ("moved", f"{tree}/d") and got[-1][3].startswith(f"{tree}/.d.")
        assert inotify_fds(bb_box) == 1
    assert w.closed
    assert inotify_fds(bb_box) == 0


def test_recursive_watches_new_directories_and_what_they_hold(bb_box: Box, tree: str) -> None:
    with bb_box.files.watch(tree) as w:
        # made faster than a watch can be added on each level: the scan reports them once
        bb_box.exec(
            "sh", "-c", f"mkdir -p {tree}/n1/n2/n3 && : > {tree}/n1/n2/n3/f && : > {tree}/n1/g"
        ).check()
        got = take(w, 5)
        assert sorted(p for _t, p, _d, _o in got) == [f"{tree}/n1", f"{tree}/n1/g", f"{tree}/n1/n2",
                                                      f"{tree}/n1/n2/n3", f"{tree}/n1/n2/n3/f"]  # fmt: skip
        assert {t for t, _p, _d, _o in got} == {"created"}
        bb_box.exec("mv", f"{tree}/n1", f"{tree}/m1").check()
        assert take(w, 1) == [("moved", f"{tree}/m1", True, f"{tree}/n1")]
        bb_box.exec("rm", f"{tree}/m1/n2/n3/f").check()  # followed under its new name
        assert take(w, 1) == [("deleted", f"{tree}/m1/n2/n3/f", False, None)]
    with bb_box.files.watch(tree, recursive=False) as w:
        bb_box.exec("sh", "-c", f": > {tree}/m1/deep && : > {tree}/top").check()
        assert take(w, 1) == [("created", f"{tree}/top", False, None)]


def test_a_reader_that_falls_behind_gets_an_overflow_event(bb_box: Box, tree: str) -> None:
    with bb_box.files.watch(tree) as w:
        # 12000 names of 40 bytes: about 550 KiB of events, twice the box's queue, unread
        bb_box.exec("sh", "-c", f"cd {tree} && seq 1 12000 | sed 's/^/a-file-with-a-long-name-number-/' "
                    "| xargs touch").check()  # fmt: skip
        events: list[FileEvent] = []
        with pytest.raises(TimeoutError):  # read all there is
            while e := w.next_event(5):
                events.append(e)
        # what was dropped is said: once, or again if the reader fell behind again
        overflows = [e for e in events if e.type == "overflow"]
        assert overflows and set(overflows) == {FileEvent("overflow", tree, True)}
        created = [e for e in events if e.type == "created"]
        assert 3000 < len(created) < 12000 and len(created) + len(overflows) == len(events)
        bb_box.exec("touch", f"{tree}/after").check()  # the watch goes on
        assert take(w, 1) == [("created", f"{tree}/after", False, None)]


def test_closing_frees_the_watch_and_missing_paths_raise(bb_box: Box, tree: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        bb_box.files.watch(f"{tree}/missing").start()
    assert isinstance(info.value, sandlot.GuestFileNotFoundError)
    with pytest.raises(FileNotFoundError):
        for _ in bb_box.files.watch(f"{tree}/missing"):
            pass
    w = bb_box.files.watch(tree).start()
    bb_box.exec("touch", f"{tree}/x").check()
    for e in w:  # a break out of the loop closes the watch, as it closes a generator
        assert e == FileEvent("created", f"{tree}/x")
        break
    assert w.closed and inotify_fds(bb_box) == 0
    with bb_box.files.watch(tree) as w:  # and the next one works
        bb_box.exec("rm", f"{tree}/x").check()
        assert take(w, 1) == [("deleted", f"{tree}/x", False, None)]


def test_a_watched_file_follows_its_path(bb_box: Box, tree: str) -> None:
    bb_box.files.write(f"{tree}/f.txt", "1")
    with bb_box.files.watch(f"{tree}/f.txt") as w:
        bb_box.exec("sh", "-c", f"echo sibling > {tree}/other && echo 2 >> {tree}/f.txt").check()
        assert take(w, 1) == [("modified", f"{tree}/f.txt", False, None)]
        bb_box.exec("rm", f"{tree}/f.txt").check()
        assert take(w, 1) == [("deleted", f"{tree}/f.txt", False, None)]


def test_settle_returns_once_every_change_made_before_it_has_been_read(bb_box: Box, tree: str) -> None:
    """A barrier through the watch's channel: what the box changed before ``settle()`` has
    reached whoever reads the watch when it returns (inotify's events leave the guest after
    the change's own answer)."""
    import threading

    seen: list[FileEvent] = []
    with bb_box.files.watch(tree) as w:

        def read() -> None:
            while (event := w.next_event()) is not None:
                seen.append(event)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for n in range(5):
            bb_box.files.write(f"{tree}/f{n}", b"x")
            bb_box.exec("sh", "-c", f"mkdir {tree}/d{n} && echo y > {tree}/d{n}/../g{n}")
            assert w.settle(30)
            paths = {e.path for e in seen}
            assert {f"{tree}/f{n}", f"{tree}/d{n}", f"{tree}/g{n}"} <= paths, (n, seen)
    reader.join(30)


def test_the_watch_ends_when_its_directory_goes_or_the_box_stops(busybox_root: Path) -> None:
    async def main() -> None:
        async with sandlot.AsyncBox(rootfs=busybox_root, memory_mib=256) as box:
            await box.files.mkdir("/tmp/w")
            async with box.files.watch("/tmp/w") as w:
                await box.exec("rmdir", "/tmp/w")
                assert [e async for e in w] == [FileEvent("deleted", "/tmp/w", True)]
            w = box.files.watch("/tmp")
            await w.start()
            await box.stop()
            assert await asyncio.wait_for(w.next_event(), 30) is None  # ended, not raised
            assert [e async for e in w] == []

    asyncio.run(main())
