"""A home's pusher: a detached process, started after each save of a home that has a
storage tier, so that the save never waits on the network and the process that saved
may exit at once (docs/storage.md).

    python -m sandlot.core.pusher HOME

One runs per home at a time (it holds ``chunks/.pusher.lock``). It sends the tier every
saved state the tier lacks and every suspended box of the home, whole (so that a host
that dies leaves its suspended boxes to be pulled by another home, nothing prepared in
advance but this), then keeps only the manifest here of cold states (the tier's
``evict_after``), and looks again until nothing is left to send. Where the tier evicts,
it then waits for the next state to turn cold (a box asleep that long: its deep sleep)
and evicts it, until no state of the home is left to cool; a save meanwhile pokes it
(``chunks/.pusher.poke``) to send that state at once; once it has evicted a state, it
starts the home's fork server (``core/forkserver.py``), so that the wake from it starts
its lazy restore's helper warm. Killed at any point, it leaves what it sent counted and
the rest for the next pusher.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from ..config import spawn_unless_locked, try_flock
from ..errors import SandlotError
from . import lazymem, tier
from .remote import Remote
from .runtime import Runtime
from .state import BoxState

log = logging.getLogger("sandlot")
ROUNDS = 5  # looks for more after a round that sent something (a save meanwhile)
POKE_POLL = 1.0  # seconds between looks at the poke file while waiting for a state to turn cold


def lock_path(home: Path) -> Path:
    return home / "chunks" / ".pusher.lock"


def poke_path(home: Path) -> Path:
    return home / "chunks" / ".pusher.poke"  # touched by each save: a waiting pusher looks again


def spawn(home: Path) -> bool:
    """Start the home's pusher unless it has no tier (or one runs already)."""
    if os.environ.get("SANDLOT_STORAGE_PUSH", "1") == "0":
        return False
    try:
        if tier.configured(home) is None:
            return False
    except SandlotError:
        return False
    lock_path(home).parent.mkdir(parents=True, exist_ok=True)
    poke_path(home).touch()
    return spawn_unless_locked(lock_path(home), "sandlot.core.pusher", str(home))


def push_all(home: Path) -> tuple[int, float]:
    """One round: states, suspended boxes, eviction. The chunks it sent, and the time
    its eviction went by."""
    rt = Runtime.for_home(home)
    looked = time.time()
    with Remote.of(rt) as remote:
        sent = remote.push().chunks
        for rec in rt.store.list():
            if rec.state != BoxState.SUSPENDED or not rec.suspended or rec.drives:
                continue
            if remote.box_pushed(rec):
                continue
            try:
                sent += remote.push_box(rec.id).chunks
            except SandlotError as exc:  # a box that cannot move (a volume): the others still go
                log.info("box %s stays on this host: %s", rec.name, exc)
        log.info("a round sent %d chunks", sent)  # (a log to read where a round took long)
        after = remote.tier.config.evict_after
        if after is not None:
            looked = time.time()
            evicted, freed = remote.evict(after, looked)
            log.info("evicted %d chunks of cold states (%d bytes)", evicted, freed)
            if evicted and lazymem.unavailable() is None:
                lazymem.start_fork_server(home)  # the next wake reads memory from the tier: its helper warm
    return sent, looked


def next_cold(home: Path, after: float) -> float | None:
    """When the home's next state turns cold after ``after`` (the time the last
    eviction went by), where its tier evicts them (else None)."""
    rt = Runtime.for_home(home)
    config = tier.configured(home)
    if config is None or config.evict_after is None:
        return None
    with Remote.of(rt) as remote:
        return remote.next_cold(config.evict_after, after)


def run(home: Path) -> int:
    fd = try_flock(lock_path(home))
    if fd is None:
        return 0
    try:
        while True:
            for _ in range(ROUNDS):
                sent, looked = push_all(home)
                if sent == 0:
                    break
                time.sleep(0.5)
            # a deep sleep: a box asleep for the tier's evict_after keeps only its manifest
            # here. Waited for in this process, which a save meanwhile pokes (``spawn``); a
            # state that turned cold while the round ran is due at once (not let go of)
            due = next_cold(home, looked)
            if due is None:
                return 0
            log.info("the next state cools in %.1f s", due - time.time())
            poked = _poked(home)
            while time.time() < due and _poked(home) == poked:
                time.sleep(min(POKE_POLL, max(0.0, due - time.time())))
    finally:
        os.close(fd)


def _poked(home: Path) -> float:
    try:
        return poke_path(home).stat().st_mtime
    except FileNotFoundError:
        return 0.0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m sandlot.core.pusher HOME", file=sys.stderr)
        return 2
    home = Path(argv[0])
    logging.basicConfig(level=logging.INFO, filename=str(home / "chunks" / "pusher.log"),
                        format="%(asctime)s %(levelname)s %(message)s")  # fmt: skip
    try:
        return run(home)
    except SandlotError as exc:  # the next save starts another: it goes on from here
        log.warning("pushing to the storage tier: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
