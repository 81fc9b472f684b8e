"""A box held by a full home (``core.room``): its mark, and the keeper's look at it,
with a stand-in engine (tests/vm/test_full_disk.py holds a real QEMU guest)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandlot.core import room
from sandlot.core.state import BoxState
from sandlot.errors import NoSpace


def test_a_mark_names_its_vm_and_is_made_without_a_block(tmp_path: Path) -> None:
    room.write_mark(tmp_path, 4242, 1700000000.5, 123)
    assert room.marked(tmp_path) and os.path.islink(room.mark_of(tmp_path))  # in the inode
    assert room.read_mark(tmp_path, 4242) == {"pid": 4242, "since": 1700000000.5, "free_bytes": 123}
    assert room.read_mark(tmp_path, 4243) is None  # another VM's: it holds nothing
    assert room.read_mark(tmp_path, None) is None
    room.mark_of(tmp_path).unlink()
    os.symlink("not a mark", room.mark_of(tmp_path))
    assert room.marked(tmp_path) and room.read_mark(tmp_path, 4242) is None
    assert [p.name for p in tmp_path.iterdir()] == [room.MARK]  # no temporary name left


def test_the_room_a_held_box_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDLOT_MIN_FREE_MIB", raising=False)
    assert room.room_needed() == 64 << 20
    monkeypatch.setenv("SANDLOT_MIN_FREE_MIB", "0")  # never less than what the store's room gives back
    assert room.room_needed() == room.LEAST_ROOM > 8 << 20
    err = room.refusal(Path("/"), "dev", {"since": 0.0})
    assert isinstance(err, NoSpace) and err.errno == 28 and err.box == "dev"
    assert "box dev is stopped with a disk write held" in str(err) and "16 MiB free" in str(err)


@dataclass
class VMRef:
    pid: int


@dataclass
class Rec:
    id: str
    name: str
    vm: VMRef | None
    state: BoxState = BoxState.RUNNING
    engine: str = "qemu"


@dataclass
class Engine:
    held: set[int] = field(default_factory=set)
    asked: list[int] = field(default_factory=list)

    def held_for_room(self, ref: VMRef | None, where: Any) -> bool:
        assert ref is not None
        self.asked.append(ref.pid)
        return ref.pid in self.held

    def let_run(self, ref: VMRef, where: Any) -> None:
        self.held.discard(ref.pid)


@dataclass
class Runtime:
    home: Path
    eng: Engine

    def box_dir(self, box_id: str) -> Path:
        (self.home / box_id).mkdir(exist_ok=True)
        return self.home / box_id

    def engine(self, name: str) -> Engine:
        return self.eng

    def placement(self, rec: Rec, name: str) -> None:
        return None


@dataclass
class Store:
    events: list[tuple[str, str, bool]] = field(default_factory=list)

    async def add_event(self, event: Any, box_id: str, labels: Any = None, *, told: bool = False) -> bool:
        self.events.append((box_id, event.kind, told))
        return True


def test_the_keeper_holds_a_box_while_the_home_is_full_and_lets_it_run_with_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SANDLOT_MIN_FREE_MIB", raising=False)
    free = {"bytes": 10 << 30}
    monkeypatch.setattr(room, "free_bytes", lambda path: free["bytes"])
    engine, db = Engine(held={11}), Store()
    rt = Runtime(tmp_path, engine)
    watch = room.RoomWatch(rt, db)  # type: ignore[arg-type]
    boxes: list[Any] = [Rec("a", "held", VMRef(11)), Rec("b", "fine", VMRef(12)),
                        Rec("c", "stopped", None, BoxState.STOPPED)]  # fmt: skip

    asyncio.run(watch.round(boxes))
    assert engine.asked == []  # a home with room: no VM is asked anything

    free["bytes"] = 1 << 20
    for _ in range(2):  # held: marked and told once, however many rounds see it
        asyncio.run(watch.round(boxes))
    assert engine.asked == [11, 12, 11, 12]
    assert room.read_mark(rt.box_dir("a"), 11) is not None and not room.marked(rt.box_dir("b"))
    assert db.events == [("a", "disk_full", True)]  # told in the store's room

    free["bytes"] = 10 << 30  # room again: the round after the home was low still looks
    asyncio.run(watch.round(boxes))
    assert 11 not in engine.held and not room.marked(rt.box_dir("a"))
    assert db.events[-1] == ("a", "disk_room", False)
    engine.asked.clear()
    asyncio.run(watch.round(boxes))
    assert engine.asked == []  # and then no more


def test_a_mark_whose_box_was_let_run_elsewhere_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(room, "free_bytes", lambda path: 10 << 30)
    engine, db = Engine(), Store()
    rt = Runtime(tmp_path, engine)
    room.write_mark(rt.box_dir("a"), 11, 0.0, 0)
    asyncio.run(room.RoomWatch(rt, db).round([Rec("a", "held", VMRef(11))]))  # type: ignore[arg-type,list-item]
    assert engine.asked == [11] and not room.marked(rt.box_dir("a")) and db.events == []
