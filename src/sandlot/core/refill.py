"""A warm pool's refiller (``core/pools.py``): a detached process, started by whoever
claims a pool VM, so the claimer never waits for the fill and may exit at any time.

    python -m sandlot.core.refill HOME TEMPLATE_ID

One runs per template at a time (it holds the pool's ``flock``); it fills one VM
after another until the pool is at its size, within the memory cap, and exits.
Killed at any point, it leaves rows that recovery removes (``core.recovery``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from ..config import try_flock
from ..errors import SandlotError
from .pools import FILL_TIMEOUT, pool_lock, pool_size
from .runtime import Runtime
from .service import core_for
from .state import BoxState

log = logging.getLogger("sandlot")


async def refill(home: Path, template_id: str) -> None:
    """Top the pool up while this process holds its lock; then look once more after
    letting go (a claim meanwhile saw the lock held and started no refiller)."""
    core = core_for(Runtime.for_home(home))
    try:
        for _ in range(3):
            fd = try_flock(pool_lock(home, template_id))
            if fd is None:
                return
            try:
                await core.pools.top_up(template_id)
            finally:
                os.close(fd)
            snap = await core.db.find_snapshot(template_id)
            if snap is None:
                return
            ready = [r for r in await core.pools.rows(template_id) if r.state == BoxState.POOLED]
            if len(ready) >= pool_size(snap):
                return
    finally:
        await core.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m sandlot.core.refill HOME TEMPLATE_ID", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    try:
        asyncio.run(asyncio.wait_for(refill(Path(argv[0]), argv[1]), FILL_TIMEOUT * 4))
    except (SandlotError, TimeoutError) as exc:
        log.warning("refilling the pool of %s: %s", argv[1], exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
