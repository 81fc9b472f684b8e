"""The comparison of two manifests (core/diffs.py) on made-up sides: what counts as a
change, what is read, renames, hard links, types, modes and the summary. The real
walk is tested against the agent in tests/unit/test_agent_host.py and in real boxes in
tests/vm/test_diffs.py."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from sandlot.api.diffs import Diff, side_arg
from sandlot.core import diffs
from sandlot.errors import InvalidArgument
from sandlot.protocol.wire import TreeEntry


def entry(path: str, ino: int, *, kind: int = stat.S_IFREG, mode: int = 0o644, size: int = 0,
          t: int = 1, uid: int = 0, target: str | None = None, rdev: int = 0) -> TreeEntry:  # fmt: skip
    return TreeEntry(path, kind | mode, uid, uid, 1, size, t, t, ino, rdev, target)


class FakeSide(diffs.Side):
    def __init__(self, label: str, files: dict[str, tuple[TreeEntry, bytes]]) -> None:
        super().__init__(label, None)  # type: ignore[arg-type]
        self.files = files
        self.read: list[str] = []

    async def walk(self, roots: Sequence[str]) -> dict[str, TreeEntry]:
        return {
            p: e
            for p, (e, _) in self.files.items()
            if any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)
        }

    async def chunks(self, path: str) -> AsyncIterator[bytes]:
        self.read.append(path)
        data = self.files[path][1]
        for i in range(0, len(data), 3):
            yield data[i : i + 3]


def side(label: str, *items: tuple[TreeEntry, bytes]) -> FakeSide:
    files = {"/": (entry("", 1, kind=stat.S_IFDIR, mode=0o755), b"")}
    for e, data in items:
        files["/" + e.path] = (e, data)
    return FakeSide(label, files)


def f(path: str, ino: int, data: bytes = b"", **kw: Any) -> tuple[TreeEntry, bytes]:
    return entry(path, ino, size=len(data), **kw), data


def compare(a: FakeSide, b: FakeSide, **kw: Any) -> dict[str, Any]:
    return asyncio.run(diffs.compare(a, b, **kw))


def by_path(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["path"]: c for c in found["changes"]}


def test_unchanged_files_are_not_read_and_touched_ones_with_equal_content_are_no_change() -> None:
    same, touched = f("same", 10, b"x\n"), f("touched", 11, b"y\n")
    a = side("a", same, touched)
    b = side("b", same, f("touched", 11, b"y\n", t=2))
    found = compare(a, b)
    assert found["changes"] == []
    assert "/same" not in a.read + b.read and a.read == b.read == ["/touched"]


def test_added_deleted_and_modified_text_get_unified_diffs() -> None:
    a = side("a", f("etc/motd", 10, b"hello\nworld\n"), f("gone.txt", 11, b"bye\n"), f("bin", 12, b"\0\1"))
    b = side(
        "b", f("etc/motd", 10, b"hello\nthere\n", t=2), f("new.txt", 13, b"hi"), f("bin", 12, b"\0\2", t=2)
    )
    found = by_path(compare(a, b))
    assert set(found) == {"/etc/motd", "/gone.txt", "/new.txt", "/bin"}
    motd = found["/etc/motd"]
    assert motd["status"] == "modified" and motd["fields"] == ["content"]
    assert motd["diff"].splitlines()[:2] == ["--- a/etc/motd", "+++ b/etc/motd"]
    assert "-world" in motd["diff"] and "+there" in motd["diff"]
    assert found["/gone.txt"]["status"] == "deleted" and "-bye" in found["/gone.txt"]["diff"]
    new = found["/new.txt"]
    assert new["status"] == "added" and new["old"] is None
    assert new["diff"].endswith("+hi\n\\ No newline at end of file\n")
    binary = found["/bin"]
    assert "diff" not in binary and binary["old"]["sha256"] != binary["new"]["sha256"]


def test_modes_owners_types_links_and_devices() -> None:
    a = side(
        "a",
        f("script", 10, b"#!/bin/sh\n", mode=0o644),
        f("owned", 11, b"", uid=0),
        f("link", 12, kind=stat.S_IFLNK, mode=0o777, target="old"),
        f("dev", 13, kind=stat.S_IFCHR, mode=0o600, rdev=(1 << 8) | 3),
        f("was-file", 14, b"data"),
    )
    b = side(
        "b",
        f("script", 10, b"#!/bin/sh\n", mode=0o755, t=2),
        f("owned", 11, b"", uid=1000, t=2),
        f("link", 12, kind=stat.S_IFLNK, mode=0o777, target="new", t=2),
        f("dev", 13, kind=stat.S_IFCHR, mode=0o600, rdev=(1 << 8) | 5, t=2),
        f("was-file", 15, kind=stat.S_IFDIR, mode=0o755),
    )
    found = by_path(compare(a, b))
    assert found["/script"]["fields"] == ["mode"] and "diff" not in found["/script"]
    assert (found["/script"]["old"]["mode"], found["/script"]["new"]["mode"]) == (0o644, 0o755)
    assert found["/owned"]["fields"] == ["owner"]
    assert found["/link"]["fields"] == ["target"] and found["/link"]["new"]["target"] == "new"
    assert found["/dev"]["fields"] == ["rdev"] and found["/dev"]["new"]["rdev"] == [1, 5]
    assert found["/was-file"]["fields"] == ["type", "mode"]
    assert found["/was-file"]["new"]["type"] == "dir"


def test_a_rename_keeps_its_inode_and_content_and_a_reused_inode_is_no_rename() -> None:
    a = side("a", f("old-name", 20, b"same\n"), f("freed", 21, b"one\n"))
    b = side("b", f("new-name", 20, b"same\n", t=2), f("reused", 21, b"two\n", t=2))
    found = by_path(compare(a, b))
    assert found["/new-name"]["status"] == "renamed"
    assert found["/new-name"]["renamed_from"] == "/old-name" and found["/new-name"]["fields"] == []
    assert "/old-name" not in found
    assert (found["/freed"]["status"], found["/reused"]["status"]) == ("deleted", "added")


def test_hard_links_are_each_their_path() -> None:
    a = side("a", f("one", 30, b"v1\n"), f("two", 30, b"v1\n"))
    b = side("b", f("one", 30, b"v2\n", t=2), f("two", 30, b"v2\n", t=2), f("three", 30, b"v2\n", t=2))
    found = by_path(compare(a, b))
    assert found["/one"]["status"] == found["/two"]["status"] == "modified"
    assert found["/three"]["status"] == "added"


def test_large_files_get_hashes_not_diffs_and_big_additions_only_their_size() -> None:
    big_a, big_b = b"a\n" * 2000, b"b\n" * 2000
    a = side("a", f("log", 40, big_a))
    b = side("b", f("log", 40, big_b, t=2), f("dataset", 41, b"z" * (2 * 1024 * 1024)))
    found = by_path(compare(a, b, text_limit=1000))
    assert "diff" not in found["/log"] and found["/log"]["fields"] == ["content"]
    assert found["/log"]["new"]["sha256"]
    assert "sha256" not in found["/dataset"]["new"] and found["/dataset"]["new"]["size"] == 2 * 1024 * 1024
    assert "/dataset" not in b.read


def test_paths_limit_the_walk_and_the_summary_counts() -> None:
    a = side("a", f("app/x", 50, b"1\n"), f("etc/y", 51, b"1\n"))
    b = side("b", f("app/x", 50, b"2\n", t=2), f("etc/y", 51, b"2\n", t=2))
    found = compare(a, b, paths=["/app", "/app/sub"])
    assert found["paths"] == ["/app"] and [c["path"] for c in found["changes"]] == ["/app/x"]
    d = Diff.from_json(found)
    assert len(d) == 1 and d.stat["modified"] == 1 and d.stat["lines_added"] == 1
    assert d.summary().splitlines()[0] == "M /app/x  +1 -1"
    assert "-1\n+2\n" in d.patch()


@pytest.mark.parametrize("bad", [["relative"], ["/a\0b"], [3]])
def test_paths_must_be_absolute(bad: list[Any]) -> None:
    with pytest.raises(InvalidArgument):
        diffs.check_paths(bad)


def test_sides_by_name() -> None:
    assert diffs.side_key(None, "image") == ("image", "")
    assert diffs.side_key("now", "image") == ("now", "")
    assert diffs.side_key("box:web", "now") == ("box", "web")
    assert diffs.side_key("snapshot:s1", "now") == ("snapshot", "s1")
    assert diffs.side_key("before-upgrade", "now") == ("snapshot", "before-upgrade")
    with pytest.raises(InvalidArgument):
        diffs.side_key("", "now")
    assert side_arg("x") == "x" and side_arg(None) is None
    with pytest.raises(InvalidArgument):
        side_arg(3)


def test_two_boxes_histories_are_trusted_only_before_they_split() -> None:
    """Two forks can each write a path to the same size within one tick of the guest's
    clock: equal metadata after the older box was made prove nothing, and are read."""
    old, recent = 1_000_000_000_000, 2_000_000_000_000  # ns: before and after the split at 1500 s
    a = side("fork a", f("inherited", 60, b"same\n", t=old), f("seed", 61, b"1\n", t=recent))
    b = side("fork b", f("inherited", 60, b"same\n", t=old), f("seed", 61, b"2\n", t=recent))
    a.box_id, a.born, b.box_id, b.born = "a" * 12, 1500.0, "b" * 12, 1600.0
    found = by_path(compare(a, b))
    assert list(found) == ["/seed"] and found["/seed"]["fields"] == ["content"]
    assert "/inherited" not in a.read + b.read
    b.box_id = a.box_id  # one box's history: its metadata are proof
    assert compare(a, b)["changes"] == []
    b.box_id, b.born = "b" * 12, None  # a side whose box is gone: every equal-looking path is read
    assert list(by_path(compare(a, b))) == ["/seed"] and "/inherited" in b.read


def test_without_stable_inodes_times_decide_and_renames_are_a_delete_and_an_add() -> None:
    """gVisor numbers inodes afresh in a restored sandbox."""
    a = side("a", f("kept", 70, b"k\n"), f("old-name", 71, b"m\n"))
    b = side("b", f("kept", 170, b"k\n"), f("new-name", 71, b"m\n", t=2))
    a.stable_ino = b.stable_ino = False
    found = by_path(compare(a, b))
    assert {p: c["status"] for p, c in found.items()} == {"/old-name": "deleted", "/new-name": "added"}
    assert "/kept" not in a.read + b.read


def test_one_answer_holds_so_much_diff_text_and_says_what_it_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(diffs, "DIFFS_LIMIT", 60)
    a = side("a", f("one", 80, b"a\n"), f("two", 81, b"b\n"))
    b = side("b", f("one", 80, b"A\n", t=2), f("two", 81, b"B\n", t=2))
    found = Diff.from_json(compare(a, b))
    first, second = found.changes
    assert first.diff and not first.diff_omitted
    assert second.diff is None and second.diff_omitted and "left out" in second.line()


def test_lines_that_look_like_headers_are_counted_as_lines() -> None:
    a = side("a", f("c.txt", 90, b"--x\nkeep\n"))
    b = side("b", f("c.txt", 90, b"++y\nkeep\n", t=2))
    found = Diff.from_json(compare(a, b))
    assert found.stat["lines_added"] == found.stat["lines_removed"] == 1
    assert found.changes[0].line() == "M /c.txt  +1 -1"
