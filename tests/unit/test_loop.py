"""``api/loop.py``'s helpers for tasks: ``cancel_and_reap``, which every place that runs
tasks side by side (webhooks, bridges, a fleet's merged events) ends them with."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

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


@pytest.mark.parametrize("first", ["sandlot", "sandlot.api.loop", "concurrent.futures.thread"])
def test_the_recorders_settle_before_the_thread_pools_stop_whatever_was_imported_first(first: str) -> None:
    """Threading's exit hooks run last registered first: the flight recorder's (which takes
    a program's last checkpoints through the store's pool) must come before the one that
    stops the pools, or a script's last step is lost."""
    script = textwrap.dedent(f"""
        import importlib, threading
        importlib.import_module({first!r})
        import concurrent.futures.thread as pools, sandlot.api.loop as loop
        hooks = [getattr(h, "func", h) for h in threading._threading_atexits]
        print(hooks.index(loop._settle_recorders) > hooks.index(pools._python_exit))
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == "True", ran.stderr
