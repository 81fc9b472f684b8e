"""The parts of a collection of the tier that need no bucket (``core/tiergc.py``): a home
catching up with the collections since its last look, and when a lock is a dead one's.
tests/unit/test_tier.py collects a real S3-compatible server's bucket."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from sandlot import pids
from sandlot.core import tiergc
from sandlot.errors import CorruptSnapshot


class Bucket:
    """Objects by key, as ``Tier.get`` gives them."""

    def __init__(self, objects: dict[str, object]) -> None:
        self.objects = {k: json.dumps(v).encode() for k, v in objects.items()}

    def key(self, *parts: str) -> str:
        return "/".join(parts)

    def names(self, under: str) -> list[str]:
        return [k[len(under) + 1 :] for k in self.objects if k.startswith(under + "/")]

    def get(self, key: str) -> tuple[bytes, str] | None:
        data = self.objects.get(key)
        return None if data is None else (data, "etag")


def record(chunks: list[str], states: tuple[str, ...] = (), files: tuple[str, ...] = ()) -> dict[str, object]:
    return {"chunks": chunks, "states": list(states), "files": list(files)}


def caught_up(bucket: Bucket, root: Path) -> list[tiergc.Forget]:
    told: list[tiergc.Forget] = []
    tiergc.catch_up(bucket, root, told.append)  # type: ignore[arg-type]
    return told


def test_a_home_forgets_what_each_collection_since_its_last_look_deleted(tmp_path: Path) -> None:
    a, b, c = "aa" * 32, "bb" * 32, "cc" * 32
    bucket = Bucket({"gc/generation.json": {"generation": 2}, "gc/1.json": record([a], ("s1",)),
                     "gc/2.json": record([b], (), ("f1",))})  # fmt: skip
    (told,) = caught_up(bucket, tmp_path)
    assert not told.everything and told.chunks == {bytes.fromhex(a), bytes.fromhex(b)}
    assert told.states == {"s1"} and told.files == {"f1"}
    assert caught_up(bucket, tmp_path) == []  # nothing since
    bucket.objects.update({"gc/generation.json": json.dumps({"generation": 3}).encode(),
                           "gc/3.json": json.dumps(record([c])).encode()})  # fmt: skip
    (told,) = caught_up(bucket, tmp_path)
    assert told.chunks == {bytes.fromhex(c)}  # only the newer one's


def test_a_home_that_cannot_tell_what_was_deleted_forgets_everything(tmp_path: Path) -> None:
    for objects in (
        {"gc/generation.json": {"generation": 1}},  # counted, its record not written (a kill between)
        {"gc/generation.json": {"generation": 1}, "gc/1.json": {"chunks": "not a list of hashes"}},
        {"gc/generation.json": {"generation": 1}, "gc/1.json": {"chunks": [], "states": "s1", "files": []}},
        {"gc/generation.json": {"generation": tiergc.RECORDS_KEPT + 1}},  # further behind than kept
    ):
        (told,) = caught_up(Bucket(objects), tmp_path / str(len(os.listdir(tmp_path))))
        assert told.everything, objects
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / tiergc.SEEN_FILE).write_text("7")
    (told,) = caught_up(Bucket({}), tmp_path / "back")  # the count went back: another bucket
    assert told.everything


def test_a_declaration_that_is_not_lists_of_names_stops_a_collection() -> None:
    good = {"home": "h1", "states": ["s1"], "boxes": ["b1"]}
    assert tiergc.declarations(Bucket({"homes/h1.json": good})) == {"h1": {"states": {"s1"}, "boxes": {"b1"}}}
    for bad in ({**good, "states": "s1"}, {**good, "boxes": [1]}, {"home": "h1"}):
        with pytest.raises(CorruptSnapshot, match=r"declaration h1\.json .* malformed"):
            tiergc.declarations(Bucket({"homes/h1.json": bad}))  # type: ignore[arg-type]


def test_a_lock_is_dead_once_old_or_once_its_process_is_gone_from_this_host() -> None:
    pid, start = pids.me()
    here, now = socket.gethostname(), time.time()
    assert not tiergc.dead({"host": here, "pid": pid, "start": start, "at": now})
    assert tiergc.dead({"host": here, "pid": pid, "start": "0", "at": now})  # that pid, another process
    assert not tiergc.dead({"host": "elsewhere", "pid": 1, "start": "0", "at": now})  # cannot tell: alive
    assert tiergc.dead({"host": "elsewhere", "pid": 1, "start": "0", "at": now - tiergc.STALE - 1})
    assert tiergc.dead({})
