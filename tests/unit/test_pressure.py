"""Sleep under memory pressure (``core.pressure``): the home's keeper puts the least
recently used idle box among those that sleep anyway to sleep, one at a time, and
never a box in use or one that never sleeps. The fake engine's boxes through the real
core; the host's memory figures are the test's (``MemoryWatch.read``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.core import idle, pressure
from sandlot.core.keeper import Keeper
from sandlot.core.runtime import Runtime
from sandlot.core.service import core_for

from tests.support.fake_engine import fake_rootfs, register

GiB = 1 << 30


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    register()
    monkeypatch.setattr(idle, "spawn", lambda home, box_id: None)  # no idle watchdog: this test's keeper acts
    monkeypatch.setattr(pressure, "MIN_IDLE", 0.3)
    monkeypatch.setattr(pressure, "LOOK_EVERY", 0.0)
    monkeypatch.delenv("SANDLOT_MEMORY_LOW_MIB", raising=False)
    return tmp_path / "home"


def test_unit_the_low_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDLOT_MEMORY_LOW_MIB", raising=False)
    assert pressure.low_mark(128 * GiB) == 128 * GiB // 20
    assert pressure.low_mark(2 * GiB) == 256 << 20  # at least 256 MiB
    monkeypatch.setenv("SANDLOT_MEMORY_LOW_MIB", "0")
    assert pressure.low_mark(128 * GiB) == 0  # off
    monkeypatch.setenv("SANDLOT_MEMORY_LOW_MIB", "1024")
    assert pressure.low_mark(128 * GiB) == GiB
    figures = pressure.meminfo()  # this host's own
    assert 0 < figures["MemAvailable"] <= figures["MemTotal"]


def test_unit_under_pressure_the_least_recently_used_idle_box_that_sleeps_goes_to_sleep(
    home: Path, tmp_path: Path
) -> None:
    root = fake_rootfs(tmp_path)
    available = {"MemAvailable": 100 << 20, "MemTotal": 8 * GiB}  # under the mark: 410 MiB

    def box(**kw: Any) -> sandlot.AsyncBox:
        return sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256,
                                keep=True, **kw)  # fmt: skip

    async def main() -> None:
        never = box()  # its owner did not say it may sleep: idle the longest, left alone
        oldest = box(idle_timeout=3600)
        newer = box(idle_timeout=3600)
        busy = box(idle_timeout=3600)
        for b in (never, oldest, newer, busy):
            await b.start()
        await never.exec("true")
        await asyncio.sleep(0.6)
        await oldest.exec("true")
        await asyncio.sleep(0.4)
        await newer.exec("true")
        running = await busy.spawn("sleep", "30")  # in use, whatever its idle time
        await asyncio.sleep(0.5)

        keeper = Keeper(core_for(Runtime.for_home(home)))
        keeper.memory.read = lambda: available
        await keeper.round()
        assert keeper.memory.sleeping is not None
        await keeper.memory.sleeping
        states = [await b.refresh() for b in (never, oldest, newer, busy)]
        assert states == ["running", "suspended", "running", "running"]
        (event,) = [e async for e in oldest.events(follow=False) if e.kind == "suspended"]
        assert event.by == pressure.MEMORY and "100 MiB available, under 409 MiB" in (event.reason or "")

        # the next round, still under: the next of them
        await newer.exec("true")
        await asyncio.sleep(0.4)
        await keeper.round()
        assert keeper.memory.sleeping is not None
        await keeper.memory.sleeping
        assert await newer.refresh() == "suspended" and await busy.refresh() == "running"

        # memory back: nothing more sleeps, and the sleepers wake on their next call
        available["MemAvailable"] = 4 * GiB
        keeper.memory.sleeping = None
        await keeper.round()
        assert keeper.memory.sleeping is None
        assert (await oldest.exec("echo", "back")).stdout == "back\n"
        await running.kill()
        keeper.close()
        for b in (never, oldest, newer, busy):
            await b.remove(force=True)

    asyncio.run(main())


def test_unit_a_box_used_as_it_is_chosen_is_not_put_to_sleep(home: Path, tmp_path: Path) -> None:
    root = fake_rootfs(tmp_path)

    async def main() -> None:
        b = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256,
                             keep=True, idle_timeout=3600)  # fmt: skip
        await b.start()
        await asyncio.sleep(0.5)
        keeper = Keeper(core_for(Runtime.for_home(home)))
        keeper.memory.read = lambda: {"MemAvailable": 1 << 20, "MemTotal": 8 * GiB}
        chosen = await pressure.least_recently_used(keeper.core.controller, [await keeper.core.db.find(b.id)])
        assert chosen is not None
        await b.exec("true")  # a request between the look and the suspend: called off
        assert not await pressure.put_to_sleep(
            keeper.core.controller, keeper.core.live, chosen[0], chosen[1], "test", "the test's"
        )
        assert await b.refresh() == "running"
        keeper.close()
        await b.remove(force=True)

    asyncio.run(main())
