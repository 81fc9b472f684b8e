"""The home's metrics sampler: ``python -m sandlot.core.sampler HOME`` (``core.metrics``
says what it samples and when; ``metrics.ensure`` starts it). A module of its own: it
runs the core, which the launcher that starts it is part of. It is the home's keeper
too (``core.keeper``: a round every second, with sampling on or off)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from ..config import try_flock
from ..protocol.wire import ControlOp
from .metrics import (
    ASK_TIMEOUT,
    IDLE_ROUNDS,
    add_samples,
    every,
    guest_every,
    guest_figures,
    keep_s,
    metrics_lock,
    pss_bytes,
)

log = logging.getLogger("sandlot")
IDLE_S = 30.0  # seconds without a VM in the home before the sampler exits (and IDLE_ROUNDS rounds)


async def sample_box(core: Any, rec: Any, ask_guest: bool = True) -> dict[str, Any]:
    """One sample of a box (a ``BoxRecord`` of a running or paused box); with
    ``ask_guest``, of a running one, with the guest's figures."""
    from .state import BoxState

    engine = core.rt.engine(rec.engine)
    disk = Path(rec.disk) if rec.disk else None

    def host() -> dict[str, Any]:
        usage = engine.usage(rec.vm)
        try:
            allocated = disk.stat().st_blocks * 512 if disk is not None else 0
        except OSError:
            allocated = None
        return {"cpu_seconds": usage["cpu_seconds"], "rss_bytes": usage["rss_bytes"],
                "pss_bytes": pss_bytes(rec.vm.pid if rec.vm else None), "disk_bytes": allocated}  # fmt: skip

    status = None
    if ask_guest and rec.state == BoxState.RUNNING:
        with contextlib.suppress(Exception):
            entry = await core.controller.find(rec.id)
            status = await asyncio.wait_for(core.controller.control(entry, ControlOp.STATUS), ASK_TIMEOUT)
    return {
        "at": time.time(),
        "state": str(rec.state),
        **await asyncio.to_thread(host),
        **guest_figures(status),
    }


async def sample_home(core: Any, asked: dict[str, float] | None = None) -> int:
    """Sample every running or paused box of the home once; how many boxes have a VM
    (those starting, stopping or being saved too). ``asked``: when each box's guest
    was last asked (kept by the caller): it is asked again once ``guest_every()``
    seconds have passed; without it, always."""
    from .state import LIVE, BoxState

    boxes = [r for r in await core.db.list() if r.state in LIVE and not r.options.get("pool")]
    due = [r for r in boxes if r.state in (BoxState.RUNNING, BoxState.PAUSED)]
    now = time.monotonic()
    ask = {r.id: asked is None or now - asked.get(r.id, -1e9) >= guest_every() - 0.5 for r in due}
    if asked is not None:
        asked.update({box_id: now for box_id, yes in ask.items() if yes})
        for gone in set(asked) - set(ask):
            del asked[gone]
    taken = await asyncio.gather(*(sample_box(core, r, ask[r.id]) for r in due), return_exceptions=True)
    rows = [(r.id, s) for r, s in zip(due, taken, strict=True) if isinstance(s, dict)]
    if rows:
        await core.db.call_unless_full(add_samples, rows, keep_s())
    return len(boxes)


async def run(home: Path) -> None:
    from .keeper import EVERY, Keeper
    from .orphans import home_gone
    from .runtime import Runtime
    from .service import core_for

    core = core_for(Runtime.for_home(home))
    keeper = Keeper(core)
    keeper.watch_consoles()
    idle = 0  # rounds without a VM in the home (or that failed)
    asked: dict[str, float] = {}
    next_sample = 0.0
    try:
        while idle < max(IDLE_ROUNDS, IDLE_S / EVERY) and not home_gone(home):
            started = time.monotonic()
            try:
                idle = 0 if await keeper.round() else idle + 1
            except Exception as exc:  # a busy store, a full disk: the next round tries again
                log.warning("records of home %s: %s", home, exc)
                idle += 1  # but not for ever
            if every() > 0 and started >= next_sample:
                next_sample = started + every()
                try:
                    await sample_home(core, asked)
                except Exception as exc:
                    log.warning("metrics of home %s: %s", home, exc)
            period = min(EVERY, every()) if every() > 0 else EVERY
            await asyncio.sleep(max(0.05, period - (time.monotonic() - started)))
    finally:
        keeper.close()
        await core.close()


def main(home: str) -> None:
    try:
        held = try_flock(metrics_lock(Path(home)))  # kept until the process ends
    except OSError:  # the home went before this started
        return
    if held is not None:  # else the home has its sampler
        asyncio.run(run(Path(home)))


if __name__ == "__main__":
    main(*sys.argv[1:2])
