"""``api/loop.py``'s helpers for tasks: ``cancel_and_reap``, which every place that runs
tasks side by side (webhooks, bridges, a fleet's merged events) ends them with."""

from __future__ import annotations

import asyncio

import pytest

from sandlot.api.loop import cancel_and_reap


def test_every_task_is_ended_and_its_error_taken() -> None:
    ended: list[str] = []

    async def sleeper() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.append("sleeper")

    async def failed() -> None:
        raise RuntimeError("boom")

    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # cleans up before it goes
            ended.append("slow")
            raise

    async def main() -> None:
        tasks = [asyncio.ensure_future(c()) for c in (sleeper, failed, slow_to_end)]
        await asyncio.sleep(0.01)
        await cancel_and_reap(tasks)
        assert all(t.done() for t in tasks) and sorted(ended) == ["sleeper", "slow"]
        await cancel_and_reap([])

    asyncio.run(main())  # and asyncio reports no "exception was never retrieved"


def test_the_callers_own_cancellation_is_not_swallowed() -> None:
    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                await asyncio.sleep(0.2)
                return

    async def caller() -> None:
        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0.01)  # begun: a task cancelled before its first step never runs
        await cancel_and_reap([task])

    async def main() -> None:
        outer = asyncio.ensure_future(caller())
        await asyncio.sleep(0.05)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer

    asyncio.run(main())
