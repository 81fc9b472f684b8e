"""A box whose disk met a full host filesystem.

A guest's disk is a file of the home. When the home's filesystem has no room for a
write, QEMU does not fail it (a guest filesystem that gets EIO may remount itself
read-only, or lose what it had in flight): it stops the guest with the write held
(``Engine.held_for_room``), and the guest runs on as if nothing happened once it is
let run with room again. sandlot's part:

- the home's keeper (``core.keeper``, every second) asks the running boxes of a home
  that is low on room whether one is held; a held box gets a mark in its directory
  (``MARK``, made where no block is free) and a ``disk_full`` event, and once the home
  has room again (``room_needed``) it is let run, with a ``disk_room`` event;
- a command for a held box is refused at once with ``NoSpace`` (the controller looks
  for the mark: one ``lstat`` a call), rather than left to wait for a guest that does
  not run; a command under way when the guest stopped waits for it. A caller that
  finds room back before the keeper does lets the box run itself.

Whoever removes the mark lets the box run and tells it: of the keeper and a caller
that find room at once, one writes the event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import free_bytes
from ..errors import NoSpace, no_space
from .events import Draft

if TYPE_CHECKING:
    from .runtime import Runtime
    from .store import AsyncStore, BoxRecord

MARK = "held-for-room"  # a symbolic link: its target is what it says
MiB = 1 << 20
WATCH_BELOW = 512 * MiB  # free bytes under which the keeper asks the home's VMs whether one is held
# a held box is let run with no less free, whatever SANDLOT_MIN_FREE_MIB says: more than
# the store's room (``store.ROOM_BYTES``), which a full home's rows may give back
LEAST_ROOM = 16 * MiB


def min_free_bytes() -> int:
    """What sandlot keeps free on a home for the rows and saves it must still write
    (``SANDLOT_MIN_FREE_MIB``, 64)."""
    return int(float(os.environ.get("SANDLOT_MIN_FREE_MIB", "64")) * MiB)


def room_needed() -> int:
    """Free bytes a home must have before a held box is let run: with less, its held
    write would only stop it again."""
    return max(min_free_bytes(), LEAST_ROOM)


def mark_of(box_dir: Path) -> Path:
    return box_dir / MARK


def marked(box_dir: Path) -> bool:
    """Whether the box has a mark (of any VM): one ``lstat``."""
    return os.path.lexists(mark_of(box_dir))


def write_mark(box_dir: Path, pid: int, since: float, free: int) -> None:
    """The mark is a symbolic link whose target holds what it says: a short link lives
    in its inode, so it is made on a filesystem with no free block left."""
    tmp = box_dir / f".{MARK}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(f"{pid}:{since:.3f}:{free}", tmp)
    os.replace(tmp, mark_of(box_dir))


def read_mark(box_dir: Path, vm_pid: int | None) -> dict[str, Any] | None:
    """The box's mark, if it names the VM it runs on now (a mark left by a VM since
    stopped, or by a keeper that died, holds nothing)."""
    try:
        pid, since, free = os.readlink(mark_of(box_dir)).split(":")
        mark = {"pid": int(pid), "since": float(since), "free_bytes": int(free)}
    except (OSError, ValueError):
        return None
    return mark if vm_pid is not None and mark["pid"] == vm_pid else None


def refusal(home: Path, name: str, mark: dict[str, Any]) -> NoSpace:
    held_s = max(0.0, time.time() - mark["since"])
    return no_space(
        home,
        f"box {name} is stopped with a disk write held for {held_s:.0f}s: it runs on by itself "
        f"once the filesystem has {room_needed() / MiB:.0f} MiB free (SANDLOT_MIN_FREE_MIB)",
        box=name,
    )


async def hold(rt: Runtime, db: AsyncStore, rec: BoxRecord, free: int) -> None:
    """Mark a box the keeper found held, and tell it once."""
    assert rec.vm is not None
    box_dir = rt.box_dir(rec.id)
    if read_mark(box_dir, rec.vm.pid) is not None:
        return
    await asyncio.to_thread(write_mark, box_dir, rec.vm.pid, time.time(), free)
    why = (
        f"the filesystem of {rt.home} is full ({free / MiB:.0f} MiB free): the guest is "
        f"stopped with its disk write held until there are {room_needed() / MiB:.0f} MiB"
    )
    event = Draft("disk_full", why, {"free_bytes": free, "needed_bytes": room_needed()}, "sandlot")
    await db.add_event(event, rec.id, told=True)  # why the box stopped: in the store's room


async def let_run(rt: Runtime, db: AsyncStore, rec: BoxRecord, free: int) -> None:
    """Let a held box run on, and tell it if this caller took its mark."""
    assert rec.vm is not None
    box_dir = rt.box_dir(rec.id)
    mark = read_mark(box_dir, rec.vm.pid)
    took = False
    with contextlib.suppress(FileNotFoundError):
        mark_of(box_dir).unlink()
        took = mark is not None
    engine = rt.engine(rec.engine)
    await asyncio.to_thread(engine.let_run, rec.vm, rt.placement(rec, rec.name))
    if took and mark is not None:
        held_s = round(time.time() - mark["since"], 1)
        why = f"the filesystem has room again ({free / MiB:.0f} MiB free): the held write went through"
        await db.add_event(Draft("disk_room", why, {"free_bytes": free, "held_s": held_s}, "sandlot"), rec.id)


class RoomWatch:
    """The keeper's look at held boxes: while the home is low on room (and one round
    after), each running box's VM is asked; otherwise none is."""

    def __init__(self, rt: Runtime, db: AsyncStore) -> None:
        self.rt, self.db = rt, db
        self.low_before = False

    async def round(self, boxes: list[BoxRecord]) -> None:
        from .state import BoxState

        home = self.rt.home
        free = await asyncio.to_thread(free_bytes, home)
        low = free < WATCH_BELOW
        running = [r for r in boxes if r.state == BoxState.RUNNING and r.vm is not None]
        held = [r for r in running if marked(self.rt.box_dir(r.id))]
        if not (low or self.low_before or held):
            return
        self.low_before = low
        for rec in running:
            engine = self.rt.engine(rec.engine)
            where = self.rt.placement(rec, rec.name)
            if not await asyncio.to_thread(engine.held_for_room, rec.vm, where):
                with contextlib.suppress(FileNotFoundError):
                    mark_of(self.rt.box_dir(rec.id)).unlink()  # let run by a caller, or gone
                continue
            free = await asyncio.to_thread(free_bytes, home)
            if free >= room_needed():
                await let_run(self.rt, self.db, rec, free)
            else:
                await hold(self.rt, self.db, rec, free)
