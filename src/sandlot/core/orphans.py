"""VMs that no home owns: box VM processes on this host that no sandlot home can
ever reach again.

A box's VM is a detached host process, by design: it outlives every sandlot
process, and whichever process reads the box next finds it through its row. So a
VM is an orphan when nothing can find it that way:

* its home was removed (``rm -rf $SANDLOT_HOME``, or moved away): its store is
  gone (``home_gone``), with every row, disk and saved state. The home's watcher
  (``core.homewatch``) ends these within seconds, and any watcher ends those of
  a home whose own watcher was not running then;
* its home's store has no row for it (``Why.NO_ROW``: rows are written before a
  VM starts and deleted after it ends, so only a crash of sandlot's own making
  leaves one), or the row of its box names another VM (``Why.NOT_ITS_ROW``).
  These are only listed (``sandlot doctor``) and ended when asked
  (``--kill-orphans``, ``end``): their home is there, so nothing is ended behind
  its back.

VMs are found by their command lines (``Engine.vm_of``, for the engines whose
VMs are host processes): the state directory a VM was launched with is
``HOME/boxes/BOX_ID`` (``Runtime.box_of``). Only this user's processes in this
mount namespace are looked at (``pids.processes``): a path on the command line of
a container's process names a file of the container's, which this host may not
have. Blocking; no event loop. From Python::

    from sandlot.core import orphans

    for o in orphans.find():  # what ``sandlot doctor`` lists
        print(o.box.ref.pid, o.rss_bytes, o.box.home, o.why)
    orphans.end(orphans.find())  # ``sandlot doctor --kill-orphans``
"""

from __future__ import annotations

import contextlib
import enum
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import pids
from ..engine import names
from ..engine.base import Placement, VMRef
from ..errors import HostSetupError
from .boxrecord import recorded_vms, store_path
from .runtime import AGENT_PORTS, Runtime

# A VM whose box's row names another process may be one a launch has just started:
# the launcher records it the moment it exists (``Launcher._record_vm``), well within this.
LAUNCH_GRACE_S = 30.0


class Why(enum.StrEnum):
    HOME_REMOVED = "its home was removed"
    NO_ROW = "its home has no box of its id"
    NOT_ITS_ROW = "its box's row names another VM"


@dataclass(frozen=True, slots=True)
class BoxVM:
    """A box's VM process found on the host, and the home and box it was launched for."""

    engine: str
    ref: VMRef
    state_dir: Path
    home: Path
    box_id: str


@dataclass(frozen=True, slots=True)
class Orphan:
    box: BoxVM
    why: Why
    rss_bytes: int | None  # its resident memory, when found

    def to_json(self) -> dict[str, Any]:
        b = self.box
        return {"engine": b.engine, "pid": b.ref.pid, "rss_bytes": self.rss_bytes, "home": str(b.home),
                "box_id": b.box_id, "why": self.why.value,
                "home_removed": self.why is Why.HOME_REMOVED}  # fmt: skip


def home_gone(home: Path) -> bool:
    """Whether ``home`` was removed: its store is not there. Only a file that is not
    there says so; any other error (a permission, an I/O error) proves nothing, and a
    VM is never ended on a doubt."""
    try:
        store_path(home).stat()
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def box_vms(rt: Runtime, processes: Iterable[pids.Process] | None = None) -> list[BoxVM]:
    """The VM processes of every box on this host (this user's), whichever home they
    were launched for. ``processes``: where to look (default: the host's)."""
    engines = [rt.engine(name) for name in names()]
    out = []
    for p in pids.processes() if processes is None else processes:
        for engine in engines:
            vm = engine.vm_of(p)
            found = Runtime.box_of(vm[1]) if vm is not None else None
            if vm is not None and found is not None:
                out.append(BoxVM(engine.name, *vm, *found))
                break
    return out


def find(rt: Runtime | None = None, processes: Iterable[pids.Process] | None = None) -> list[Orphan]:
    """Every VM on this host that no home owns (see the module's text), by home.
    ``processes``: where to look (default: the host's)."""
    rt = rt or Runtime.for_home()
    rows: dict[Path, dict[str, VMRef | None] | None] = {}
    out = []
    for b in box_vms(rt, processes):
        engine = rt.engine(b.engine)
        why = Why.HOME_REMOVED
        if not home_gone(b.home):
            if b.home not in rows:
                rows[b.home] = recorded_vms(store_path(b.home))
            known = rows[b.home]
            if known is None or (b.box_id in known and known[b.box_id] == b.ref):
                continue  # owned, or a store that cannot be read, which proves nothing
            why = Why.NO_ROW if b.box_id not in known else Why.NOT_ITS_ROW
            age = pids.age(b.ref.start)
            if why is Why.NOT_ITS_ROW and age is not None and age < LAUNCH_GRACE_S:
                continue
            if not engine.alive(b.ref, b.box_id):
                continue  # ended (its box removed) while the rows were read
        out.append(Orphan(b, why, engine.usage(b.ref)["rss_bytes"]))
    return sorted(out, key=lambda o: (str(o.box.home), o.box.ref.pid))


def end_vm(rt: Runtime, b: BoxVM, *, box_gone: bool = True) -> None:
    """SIGKILL a box's VM, and (``box_gone``: no row names the box, so nothing else of it
    runs) remove what it left on the host: its engine's state, its sockets. A box whose
    row names another VM keeps them: they are that VM's."""
    engine = rt.engine(b.engine)
    engine.kill_now(b.ref, b.box_id)
    if not box_gone:
        return
    with contextlib.suppress(HostSetupError):  # the runtime directory is no longer ours
        run_dir = rt.run_dir(b.box_id)
        engine.forget(Placement(b.box_id, b.box_id, b.state_dir, run_dir, AGENT_PORTS))
        shutil.rmtree(run_dir, ignore_errors=True)


def end(orphans: Iterable[Orphan], rt: Runtime | None = None) -> list[Orphan]:
    """End the VMs of ``orphans`` (from ``find``); those that were still running."""
    rt = rt or Runtime.for_home()
    ended = []
    for o in orphans:
        if rt.engine(o.box.engine).alive(o.box.ref, o.box.box_id):
            end_vm(rt, o.box, box_gone=o.why is not Why.NOT_ITS_ROW)
            ended.append(o)
    return ended
