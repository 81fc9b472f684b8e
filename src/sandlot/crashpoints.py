"""Named points where a test may have this process killed, as a crash would.

It sits below every layer (the engines' own steps have points too, as the core's).
Crash safety is tested the way SQLite tests it: kill the process at a chosen
point and check that the next process finds every box and snapshot whole. A
test sets ``SANDLOT_CRASH_AT`` to a point's name (``NAME#N``: its Nth
passage) in the environment of a process it means to lose; at that point the
process sends itself SIGKILL. Unset, a crash point costs one dict lookup.

The points are listed in ``POINTS``; an unknown name is refused at the first
crash point reached, so a renamed point cannot silently stop a test crashing.
"""

from __future__ import annotations

import os
import signal

POINTS = frozenset({
    "create.after-row",  # the row exists (state creating), the disk does not
    "create.before-disk",  # the row names the disk's file, which is not there yet
    "start.after-launch",  # the VM process exists and is recorded; the agent has not answered
    "stop.before-shutdown",  # the row says stopping; the VM still runs
    "snapshot.before-save",  # the new top layer is recorded; the VM has not switched to it
    "snapshot.after-save",  # the saved state is in place, its row is not
    # (gVisor) runsc checkpoint wrote the state and ended the sandbox; the restore has not begun
    "snapshot.after-checkpoint",
    "suspend.before-save",  # the row says suspending; nothing is saved yet
    "suspend.after-save",  # the suspended state is saved and recorded; the VM still exists
    "restore.after-launch",  # a VM loading a saved state exists; the guest has not run
    "fork.child-start",  # each child of a fork is about to start
    "export.mid-write",  # part of an archive is written
    "chunks.mid-write",  # a saved state's chunk is written under its temporary name, not renamed
    "chunks.mid-collect",  # the rows of chunks no state lists are deleted, their files not yet
    "remote.mid-push",  # some chunks are in the storage tier (and counted so), the rest not
    "remote.mid-pull",  # a box's disk files are pulled from the tier, its rows not written
    "tiergc.repacked",  # a collection wrote packs again and pointed the places at them; no record yet
    "tiergc.recorded",  # a collection of the tier recorded what it deletes; nothing is deleted yet
    "tiergc.deleted",  # a collection deleted what it recorded; its lock is still held
    "diff.sides-open",  # a diff's sides run (a snapshot's or the image's as a box of its own)
    "pool.fill-after-start",  # a pool VM runs (its HELLO done), not yet paused and ready
    "pool.claim-after-row",  # a claim's compare-and-swap is written; the pool VM is still paused
    "pool.claim-after-resume",  # the claimed VM runs again; its re-identifying HELLO is under way
    "fleet.export-after-save",  # a node wrote the archive of a box it holds for a move, not yet offered
    "fleet.import-after-start",  # a moved box runs on its target node, which has not answered yet
})  # fmt: skip

_passes: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Die here (SIGKILL) if ``SANDLOT_CRASH_AT`` names this point (and passage)."""
    wanted = os.environ.get("SANDLOT_CRASH_AT")
    if not wanted:
        return
    point, _, nth = wanted.partition("#")
    if point not in POINTS:
        raise RuntimeError(f"SANDLOT_CRASH_AT={wanted}: no crash point {point!r}")
    if point != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
