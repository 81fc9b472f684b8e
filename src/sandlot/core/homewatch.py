"""A home's watcher: once the home is removed, the VMs launched in it end.

Every box's VM, a warm pool's included, is a detached process: it outlives the
processes that use it, and the home's store is how any later one finds it. When
the home goes (``rm -rf $SANDLOT_HOME``), so do its rows, disks and saved
states: no command, recovery or refill can reach its VMs again, and each would
run on, holding its memory, until the host restarts. So they end, all of them,
ordinary boxes too: a box is durable against the exit of the processes that use
it, not against the removal of the home that holds it, and whatever it still had
is gone with that home already (QEMU keeps an unlinked disk, which nobody can
open again).

    python -m sandlot.core.homewatch HOME

One watcher per home, not a process per VM: every launch makes sure the home has
one (``ensure``; it holds ``HOME/watch.lock``, so a home made again at the same
path, with a lock file of its own, gets a watcher of its own). It

* wakes when an entry of the home, or the home itself, is removed or renamed
  (inotify), and looks anyway every ``CHECK_EVERY`` seconds (a file system that
  reports no such events, a home reached through a symlink that was removed);
  the home is gone once its store is (``orphans.home_gone``), and still is
  ``CONFIRM_S`` later: then it ends every VM launched in it and exits;
* every ``SWEEP_EVERY`` seconds also ends the VMs of any other removed home (a
  home whose watcher was not running: killed, or never started by the sandlot
  that launched them), and exits once no VM of its own home is left.

Every VM is checked on its own before it is ended: never one whose home is there.
Its cost: one idle Python process per home with VMs (measured: 20 MiB of PSS,
28 MiB resident), a ``stat`` every ``CHECK_EVERY`` seconds and a read of this
user's command lines in /proc every ``SWEEP_EVERY`` seconds. Measured, a VM of a
removed home ended 0.5 s after ``rm -rf`` began (``CONFIRM_S``, and milliseconds).
"""

from __future__ import annotations

import logging
import os
import select
import sys
import time
from pathlib import Path

from ..config import (
    IN_DELETE,
    IN_DELETE_SELF,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    drain,
    inotify,
    spawn_unless_locked,
    try_flock,
)
from .orphans import box_vms, end_vm, home_gone
from .runtime import Runtime

log = logging.getLogger("sandlot")

MODULE = "sandlot.core.homewatch"
CHECK_EVERY = 2.0  # seconds between looks at the home, where inotify says nothing
SWEEP_EVERY = 30.0  # seconds between scans of the host's processes
# A store missing for this long is no store being replaced (unlinked, then made again,
# as a tool that rewrites it may do): its home was removed.
CONFIRM_S = 0.5


def watch_lock(home: Path) -> Path:
    return home / "watch.lock"


def ensure(home: Path) -> None:
    """Start the home's watcher unless one runs (it holds its lock). Never raises: a
    home without one only loses the prompt end of its VMs, should it be removed."""
    try:
        spawn_unless_locked(watch_lock(home), MODULE, str(home), cwd="/")
    except OSError as exc:
        log.warning("could not start the watcher of home %s: %s", home, exc)


def _wait(notify: int | None, timeout: float) -> None:
    """Until inotify has news (read and dropped: the home is looked at anyway) or ``timeout``."""
    if notify is None:
        time.sleep(timeout)
        return
    ready, _, _ = select.select([notify], [], [], timeout)
    if ready:
        drain(notify)


def sweep(rt: Runtime, home: Path) -> int:
    """End the VMs of every removed home (each home found gone twice, ``CONFIRM_S``
    apart); the number of ``home``'s that run on."""
    vms = box_vms(rt)
    doomed = [b for b in vms if home_gone(b.home)]
    if doomed:
        time.sleep(CONFIRM_S)
    ended = [b for b in doomed if home_gone(b.home)]
    for b in ended:
        end_vm(rt, b)
    return sum(1 for b in vms if b.home == home and b not in ended)


class Watcher:
    def __init__(self, home: Path, lock: int) -> None:
        self.home = home
        self.rt = Runtime.for_home(home)  # for its engines: its store is never opened here
        self.lock = lock

    def run(self) -> None:
        notify = inotify(self.home, IN_MOVED_FROM | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF)
        next_sweep = 0.0
        while True:
            gone = home_gone(self.home)
            now = time.monotonic()
            if gone or now >= next_sweep:
                mine = sweep(self.rt, self.home)
                # gone before the sweep and after it: the sweep found it gone and ended every
                # VM of the home it saw (one launched since has a new watcher, see ``ensure``)
                if (gone and home_gone(self.home)) or (mine == 0 and not self.stay()):
                    return
                next_sweep = now + SWEEP_EVERY
            _wait(notify, CHECK_EVERY)

    def stay(self) -> bool:
        """No VM of the home runs: let the lock go, then look once more. A launch makes
        sure of a watcher after its VM exists: one that found the lock still held has a
        VM this look sees, and the watcher stays if it gets its lock back (else the
        watcher that launch started has it)."""
        os.close(self.lock)
        if not any(b.home == self.home for b in box_vms(self.rt)):
            return False
        try:
            lock = try_flock(watch_lock(self.home))
        except OSError:  # no home to hold a lock in: it went meanwhile
            sweep(self.rt, self.home)
            return False
        if lock is None:
            return False
        self.lock = lock
        return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m {MODULE} HOME", file=sys.stderr)
        return 2
    home = Path(argv[0])
    try:
        lock = try_flock(watch_lock(home))
    except OSError:  # no home to hold a lock in: removed before this started
        sweep(Runtime.for_home(home), home)
        return 0
    if lock is None:
        return 0  # the home has its watcher
    Watcher(home, lock).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
