"""The store on a filesystem that runs full, for real (a tmpfs of its own): a write
that finds no room gives the store's reserve back and goes through, so the row that
says how an operation ended is written; without a reserve it is ``NoSpace``, and the
database stays whole either way. No VM: the store alone."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.core import leases
from sandlot.core.store import ROOM_BYTES, ROOM_FILE, AsyncStore, BoxStore


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def lease(box_id: str, note_bytes: int) -> dict[str, object]:
    now = time.time()
    return {"box_id": box_id, "seconds": 60.0, "until": now + 60, "key_id": None,
            "key_name": "x" * note_bytes, "namespace": None, "created_at": now}  # fmt: skip


def whole(db_path: Path) -> bool:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return bool(db.execute("PRAGMA integrity_check").fetchone()[0] == "ok")
    finally:
        db.close()


def test_a_write_on_a_full_filesystem_takes_the_reserve_then_fails_clearly(small_fs: Path) -> None:
    store = BoxStore(small_fs / "sandlot.db")
    room = small_fs / ROOM_FILE
    assert room.stat().st_size == ROOM_BYTES  # made at open, the filesystem having plenty
    st = os.statvfs(small_fs)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize), str(small_fs / "filler")], check=True)
    assert os.statvfs(small_fs).f_bavail == 0
    db = AsyncStore(lambda: store)

    async def writes() -> None:
        await db.call(leases.put_row, lease("a", 1 << 20))  # needs new pages: the reserve is given
        assert not room.exists()
        assert [r["box_id"] for r in await db.call(leases.rows)] == ["a"]
        with pytest.raises(sandlot.NoSpace, match=f"the filesystem of {small_fs} is full"):
            for i in range(20):  # no reserve left: the next growth fails, and says why
                await db.call(leases.put_row, lease(f"b{i}", 1 << 20))
        assert "a" in [r["box_id"] for r in await db.call(leases.rows)]  # what was written stays

    asyncio.run(writes())
    assert whole(small_fs / "sandlot.db")
    (small_fs / "filler").unlink()

    async def again() -> None:  # with room again, writes work: no transaction was left open
        await db.call(leases.drop, "a")
        assert "a" not in [r["box_id"] for r in await db.call(leases.rows)]

    asyncio.run(again())
    store.hold_room()  # and the reserve is made again
    assert room.stat().st_size == ROOM_BYTES
    assert whole(small_fs / "sandlot.db")
