"""File watching (``files.watch``) against the agent run on the host, under ASan and
UBSan: the event semantics in milliseconds, without a VM. The same paths on a real
box are in ``tests/vm/test_watch.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from sandlot.api.files import AsyncWatch, FileEvent
from sandlot.errors import GuestFileNotFoundError
from sandlot.records import Rate

from tests.support.hostagent import HostAgent, Watcher, connected

Test = Callable[[Watcher, Path, HostAgent], Awaitable[None]]


def run(tmp_path: Path, test: Test) -> None:
    async def go() -> None:
        async with connected(tmp_path, kind="sanitize") as (conn, agent):
            tree = tmp_path / "tree"
            tree.mkdir()
            await test(Watcher(conn), tree, agent)
            await asyncio.sleep(0.1)
            assert "ERROR: AddressSanitizer" not in agent.stderr()
            assert "runtime error" not in agent.stderr()

    asyncio.run(go())


async def events(w: AsyncWatch, n: int, timeout: float = 10.0) -> list[tuple[str, str, bool, str | None]]:
    out = []
    for _ in range(n):
        e = await w.next_event(timeout)
        assert e is not None, f"the watch ended after {out}"
        out.append((e.type, e.path, e.is_dir, e.old_path))
    return out


async def quiet(w: AsyncWatch, wait: float = 0.4) -> None:
    with pytest.raises(TimeoutError):
        e = await w.next_event(wait)
        pytest.fail(f"unexpected event {e}")


def inotify_fds(agent: HostAgent) -> int:
    pid = agent.proc.pid
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            count += "inotify" in os.readlink(f"/proc/{pid}/fd/{fd}")
    return count


async def freed(agent: HostAgent) -> None:
    """Until the agent has let its last inotify instance go: a closed watch tells it, and
    it frees the instance when it next runs (10 s at most)."""
    deadline = time.monotonic() + 10
    while inotify_fds(agent):
        assert time.monotonic() < deadline, "the agent kept an inotify instance"
        await asyncio.sleep(0.05)


def test_unit_create_modify_delete_and_moves(tmp_path: Path) -> None:
    async def test(files: Watcher, tree: Path, agent: HostAgent) -> None:
        outside = tree.parent / "outside"
        async with files.watch(tree) as w:
            (tree / "a").write_bytes(b"x" * 1_000_000)  # one write of 1 MB: one event, not hundreds
            assert await events(w, 2) == [("created", f"{tree}/a", False, None),
                                          ("modified", f"{tree}/a", False, None)]  # fmt: skip
            with open(tree / "a", "ab") as f:
                for _ in range(200):
                    f.write(b"y" * 4096)
                    f.flush()
            assert await events(w, 1) == [("modified", f"{tree}/a", False, None)]
            (tree / "a").rename(tree / "b")
            assert await events(w, 1) == [("moved", f"{tree}/b", False, f"{tree}/a")]
            (tree / "b").rename(outside)
            assert await events(w, 1) == [("deleted", f"{tree}/b", False, None)]
            outside.rename(tree / "c")
            assert await events(w, 1) == [("created", f"{tree}/c", False, None)]
            (tree / "c").unlink()
            assert await events(w, 1) == [("deleted", f"{tree}/c", False, None)]
            (tree / "d").touch()  # created, and closed without a write: no "modified"
            os.chmod(tree / "d", 0o600)  # attributes are not reported
            assert await events(w, 1) == [("created", f"{tree}/d", False, None)]
            await quiet(w)
            assert inotify_fds(agent) == 1
        assert w.closed
        await freed(agent)  # closing the watch frees the agent's inotify instance

    run(tmp_path, test)


def test_unit_recursive_trees_follow_new_and_moved_directories(tmp_path: Path) -> None:
    async def test(files: Watcher, tree: Path, agent: HostAgent) -> None:
        (tree / "old").mkdir()
        async with files.watch(tree) as w:
            # a tree made faster than its watches can be added: nothing inside is lost
            os.makedirs(tree / "n1" / "n2" / "n3")
            (tree / "n1" / "n2" / "n3" / "f").write_text("x")
            (tree / "n1" / "g").write_text("x")
            got = await events(w, 5)
            with pytest.raises(
                TimeoutError
            ):  # and the "modified" of files written before their watch held, or not
                while e := await w.next_event(0.5):
                    got.append((e.type, e.path, e.is_dir, e.old_path))
            created = [p for t, p, _d, _o in got if t == "created"]
            assert sorted(created) == [f"{tree}/n1", f"{tree}/n1/g", f"{tree}/n1/n2", f"{tree}/n1/n2/n3",
                                       f"{tree}/n1/n2/n3/f"]  # fmt: skip
            assert {t for t, _p, _d, _o in got} <= {"created", "modified"}
            # a directory moved within the tree keeps being watched under its new name
            (tree / "n1").rename(tree / "m1")
            assert await events(w, 1) == [("moved", f"{tree}/m1", True, f"{tree}/n1")]
            (tree / "m1" / "n2" / "h").touch()
            assert await events(w, 1) == [("created", f"{tree}/m1/n2/h", False, None)]
            # moved out: deleted, and no longer heard of
            shutil.move(tree / "m1", tree.parent / "gone")
            assert await events(w, 1) == [("deleted", f"{tree}/m1", True, None)]
            (tree.parent / "gone" / "n2" / "later").touch()
            await quiet(w)
            # moved in: created, with what it holds
            shutil.move(tree.parent / "gone", tree / "back")
            got = await events(w, 7)
            assert got[0] == ("created", f"{tree}/back", True, None)
            moved_in = [("/back", True), ("/back/g", False), ("/back/n2", True), ("/back/n2/h", False),
                        ("/back/n2/later", False), ("/back/n2/n3", True),
                        ("/back/n2/n3/f", False)]  # fmt: skip
            assert {(t, p[len(str(tree)) :], d) for t, p, d, _o in got} == {
                ("created", p, d) for p, d in moved_in
            }
            (tree / "back" / "n2" / "n3" / "f").unlink()
            assert await events(w, 1) == [("deleted", f"{tree}/back/n2/n3/f", False, None)]
            shutil.rmtree(tree / "old")
            assert await events(w, 1) == [("deleted", f"{tree}/old", True, None)]

        async with files.watch(tree, recursive=False) as w:
            (tree / "back" / "deep").touch()
            (tree / "top").touch()
            assert await events(w, 1) == [("created", f"{tree}/top", False, None)]

    run(tmp_path, test)


def test_unit_a_file_is_watched_by_its_path(tmp_path: Path) -> None:
    async def test(files: Watcher, tree: Path, agent: HostAgent) -> None:
        f = tree / "f.txt"
        f.write_text("1")
        async with files.watch(f) as w:
            (tree / "other").write_text("x")  # a sibling: not reported
            f.write_text("2")
            assert await events(w, 1) == [("modified", str(f), False, None)]
            (tree / "new").write_text("3")
            (tree / "new").replace(f)  # replaced by a rename, as files.write does
            assert await events(w, 1) == [("moved", str(f), False, f"{tree}/new")]
            f.unlink()
            assert await events(w, 1) == [("deleted", str(f), False, None)]
            f.write_text("4")  # the path comes back
            assert await events(w, 2) == [("created", str(f), False, None), ("modified", str(f), False, None)]

    run(tmp_path, test)


def test_unit_the_watch_ends_when_its_root_goes_and_missing_paths_raise(tmp_path: Path) -> None:
    async def test(files: Watcher, tree: Path, agent: HostAgent) -> None:
        with pytest.raises(GuestFileNotFoundError):
            await files.watch(tree / "missing").start()
        with pytest.raises(FileNotFoundError):
            async for _ in files.watch(tree / "missing"):
                pass
        (tree / "sub").mkdir()
        got = []
        async with files.watch(tree / "sub") as w:
            shutil.rmtree(tree / "sub")
            async for e in w:
                got.append(e)
        assert got == [FileEvent("deleted", f"{tree}/sub", True)]
        assert await w.next_event() is None
        (tree / "sub").mkdir()
        async with files.watch(tree / "sub") as w:
            (tree / "sub").rename(tree / "elsewhere")
            assert [e async for e in w] == [FileEvent("deleted", f"{tree}/sub", True)]
        await freed(agent)

    run(tmp_path, test)


def test_unit_a_host_that_does_not_read_gets_one_overflow(tmp_path: Path) -> None:
    async def test(files: Watcher, tree: Path, agent: HostAgent) -> None:
        async with files.watch(tree) as w:
            for i in range(20000):  # far more than the agent's queue of 256 KiB holds
                os.close(os.open(tree / f"file-with-a-long-name-{i:06d}", os.O_CREAT | os.O_WRONLY))
            await asyncio.sleep(0.5)
            got: list[FileEvent] = []
            while (e := await w.next_event(10.0)) is not None and e.type != "overflow":
                got.append(e)
            assert e is not None and e == FileEvent("overflow", str(tree), True)
            assert 2000 < len(got) < 20000 and {e.type for e in got} == {"created"}
            (tree / "after").touch()  # and then it goes on
            assert await events(w, 1) == [("created", f"{tree}/after", False, None)]

    run(tmp_path, test)


def test_unit_a_watch_sends_no_more_than_its_rate_and_says_overflow_for_the_rest(tmp_path: Path) -> None:
    async def test(files: Watcher, tree: Path, agent: HostAgent) -> None:
        async with files.watch(tree, rate=Rate(50, 20)) as w:
            t0 = time.monotonic()
            for i in range(500):  # a box churning files, as fast as it can
                os.close(os.open(tree / f"f{i}", os.O_CREAT | os.O_WRONLY))
            got: list[FileEvent] = []
            with contextlib.suppress(TimeoutError):
                while (e := await w.next_event(1.0)) is not None:
                    got.append(e)
            took = time.monotonic() - t0
            # what was dropped is said as inotify's own overflow says it, each time records went
            overflows = [e for e in got if e.type == "overflow"]
            assert overflows and set(overflows) == {FileEvent("overflow", str(tree), True)}
            assert 20 <= len(got) <= 20 + 50 * took + 5 and len(got) < 500, (len(got), took)
            await asyncio.sleep(0.5)  # the rate refills: events flow again
            (tree / "after").touch()
            assert await events(w, 1) == [("created", f"{tree}/after", False, None)]

    run(tmp_path, test)
