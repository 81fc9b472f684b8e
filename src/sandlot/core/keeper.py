"""The home's keeper of what guests make the host write (``sandlot.records``).

A round every ``EVERY`` seconds, in the home's sampler process (``core.sampler``: one
per home, alive while a VM of the home runs), over every box with a VM:

* its console log (``Engine.console_log``: QEMU appends the guest's serial port to it,
  a gVisor sandbox's init its own words) is cut to its newest quarter once it passes
  half the box's bound (``records.keep_newest``, in place: the writer keeps its descriptor). A
  gVisor box's console directory is bound into the sandbox, on a tmpfs of the bound's
  size, where nothing but the log belongs: any other file there is removed;
* its egress ledger (``net.ledger``) writes the folded lines of a window that ended
  (a box that went quiet still has them said), and its counts are read: where it was
  written to since the last round, or folded lines wait;
* what each record folded, dropped or refused since the box's events last told of it
  becomes one ``records_dropped`` event, and the counts go to the store's ``records``
  table, which ``GET /metrics`` reads;
* the events the store folded for a box that went quiet are told
  (``BoxStore.flush_event_folds``);
* the host's memory (``core.pressure``): under its low mark, the home's least recently
  used idle box among those that sleep anyway is put to sleep;
* every ``HOME_EVERY`` seconds, the home's guest logs together (every box's console
  and egress logs) are held to ``SANDLOT_GUEST_LOGS_MIB``: past it, rotated egress logs
  go first, largest first, then the largest logs are cut to their newest half.

The consoles are watched between rounds too (inotify, ``IN_MODIFY``): a console that
grows is looked at within ``CONSOLE_LOOK`` seconds, and cut to its newest quarter once
past half its bound, so a guest writing its serial port as fast as it can (measured
under TCG: 0.3-0.6 MiB/s from one loop) does not take it past the bound (2 MiB: the
keeper has over a second to run). A host too busy to run the keeper for that long lets
a QEMU console pass its bound until it does (measured: 0.4 MiB for a bound of 0.25, with
the unit tests' three workers beside two VMs on 2 cores). What a tmpfs bounds on gVisor
it bounds at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import records
from ..config import drain
from ..net.ledger import Ledger, Limits, Totals, rotated
from .events import Draft
from .pressure import MemoryWatch
from .room import RoomWatch
from .store import BoxStore

log = logging.getLogger("sandlot")

EVERY = 1.0  # seconds between rounds
HOME_EVERY = 5.0  # seconds between two looks at the home's guest logs together
CONSOLE_LOOK = 0.05  # seconds between two looks at the consoles that inotify says grew
IN_MODIFY = 0x2
EGRESS_LOG = "egress.log"
UNTOLD = ("lines", "rotations")  # an egress ledger's counts that are no loss
TELL_EVERY = records.FOLD_WINDOW  # seconds between two events of one record of one box
KEPT = ("egress_log", "console", "home_logs")  # the records this keeper tells of
ADDED = ("console", "home_logs")  # counted by the keeper itself, added to what the store has


def untold(counts: dict[str, Any], told: dict[str, Any]) -> bool:
    """Whether a record's stored counts hold more than its events have told."""
    return any(isinstance(v, int) and v > told.get(k, 0) for k, v in counts.items())


def tell(record: str, new: dict[str, int], limits: records.Bounds) -> str:
    """What a record's new counts say, in words."""
    parts = []
    if record == "egress_log":
        if new.get("refused_dns"):
            parts.append(f"refused {new['refused_dns']:,} DNS questions past {limits.dns.per_s:g} a second "
                         "(SANDLOT_DNS_RATE)")  # fmt: skip
        if new.get("refused_connections"):
            parts.append(f"refused {new['refused_connections']:,} connections past "
                         f"{limits.connections.per_s:g} a second (SANDLOT_CONNECTION_RATE)")  # fmt: skip
        if new.get("refused_open"):
            parts.append(f"refused {new['refused_open']:,} connections while "
                         f"{limits.connections_open} were open (SANDLOT_CONNECTIONS_OPEN)")  # fmt: skip
        if new.get("folded"):
            parts.append(f"folded {new['folded']:,} egress decisions into counted lines")
        if new.get("dropped"):
            parts.append(f"dropped the {new['dropped']:,} oldest lines of the egress log "
                         f"(SANDLOT_EGRESS_LOG_MIB: {limits.egress_log_bytes / records.MIB:g})")  # fmt: skip
    elif record == "console":
        parts.append(f"dropped the oldest {new.get('dropped_bytes', 0):,} bytes of the console log "
                     f"(SANDLOT_CONSOLE_LOG_MIB: {limits.console_bytes / records.MIB:g})")  # fmt: skip
        if new.get("removed_files"):
            parts.append(f"removed {new['removed_files']} files the guest made in its console directory")
    elif record == "home_logs":
        mib = limits.home_logs_bytes / records.MIB
        parts.append(f"dropped {new.get('dropped_bytes', 0):,} bytes of this box's logs: the home's guest "
                     f"logs passed SANDLOT_GUEST_LOGS_MIB ({mib:g})")  # fmt: skip
    return "; ".join(parts) or f"{record} reached its bound"


class Keeper:
    """One home's rounds (``round``), with what it has counted itself (consoles, the
    home's bound) between them."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.rt = core.rt
        self.bounds = records.bounds()
        self.limits = Limits.default()  # what flushing a ledger needs of its box's limits
        # box: record: what this process counted itself (consoles, the home's bound) since
        # it last stored it; counted from the loop and from the threads of a round
        self.counted: dict[str, dict[str, dict[str, int]]] = {}
        self._counting = threading.Lock()
        self.told_at: dict[tuple[str, str], float] = {}
        self.consoles: dict[str, tuple[Path, int]] = {}  # box: its console log and inode, watched
        self._notify: int | None = None
        self._libc: Any = None
        self.ledgers: dict[str, tuple[bytes, bool]] = {}  # box: its ledger's state as flushed, folds waiting
        self.home_at = 0.0
        self.room = RoomWatch(core.rt, core.db)
        self.memory = MemoryWatch(core)

    def count(self, box: str, record: str, what: str, n: int) -> None:
        if n > 0:
            with self._counting:
                counts = self.counted.setdefault(box, {}).setdefault(record, {})
                counts[what] = counts.get(what, 0) + n

    def take_counted(self, box: str) -> dict[str, dict[str, int]]:
        """What this process counted of ``box`` since it was last taken."""
        with self._counting:
            return {k: v for k, v in self.counted.pop(box, {}).items() if v}

    def watch_consoles(self) -> None:
        """Look at the consoles as soon as they grow (on the running loop), besides the
        rounds; where inotify cannot be had, the rounds alone keep them."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            return
        self._notify, self._libc = fd, libc
        loop = asyncio.get_running_loop()
        looking = False

        def look() -> None:
            nonlocal looking
            looking = False
            for box, (path, _) in list(self.consoles.items()):
                self._cut_console(box, path)

        def woke() -> None:
            nonlocal looking
            drain(fd)
            if not looking:
                looking = True
                loop.call_later(CONSOLE_LOOK, look)

        loop.add_reader(fd, woke)

    def close(self) -> None:
        if self._notify is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._notify)
            os.close(self._notify)
            self._notify = None

    def _watch(self, box: str, path: Path) -> None:
        """Watch a box's console (again where it is a new file: a gVisor box's after its
        console's tmpfs was mounted anew)."""
        try:
            inode = path.stat().st_ino
        except OSError:
            return
        if self.consoles.get(box) == (path, inode):
            return
        self.consoles[box] = (path, inode)
        if self._notify is not None:
            self._libc.inotify_add_watch(self._notify, os.fsencode(path), IN_MODIFY)

    def _forget(self, live: set[str]) -> None:
        for box in set(self.consoles) - live:
            del self.consoles[box]  # inotify drops the watch of a file that is removed
        for box in set(self.ledgers) - live:
            del self.ledgers[box]

    def _cut_console(self, box: str, console: Path) -> None:
        """Cut a console past half its bound to its newest quarter: the other half is room
        for what the guest writes before the next look."""
        if records.on_host(console) > self.bounds.console_bytes // 2:
            cut = records.keep_newest(console, self.bounds.console_bytes // 4)
            self.count(box, "console", "dropped_bytes", cut)

    async def round(self) -> int:
        """One round; how many boxes have a VM."""
        from .state import LIVE

        boxes = [r for r in await self.core.db.list() if r.state in LIVE and not r.options.get("pool")]
        known = await self.core.db.call(BoxStore.records)
        for rec in boxes:
            try:
                console = self.rt.engine(rec.engine).console_log(self.rt.placement(rec, rec.name))
                self._watch(rec.id, console)
                self._cut_console(rec.id, console)
                egress = await asyncio.to_thread(self._files, rec, console)
                await self._tell(rec, known.get(rec.id, {}), egress)
            except Exception as exc:  # one box's trouble is its own
                log.warning("records of box %s: %s", rec.name, exc)
        try:
            await self.room.round(boxes)
        except Exception as exc:  # the next round looks again
            log.warning("held boxes of home %s: %s", self.rt.home, exc)
        try:
            await self.memory.round(boxes)
        except Exception as exc:  # the next round looks again
            log.warning("boxes of home %s under memory pressure: %s", self.rt.home, exc)
        self._forget({r.id for r in boxes})
        if time.monotonic() - self.home_at >= HOME_EVERY:
            self.home_at = time.monotonic()
            await asyncio.to_thread(self._home, [r.id for r in boxes])
        await self.core.db.call_unless_full(BoxStore.flush_event_folds)
        return len(boxes)

    def _files(self, rec: Any, console: Path) -> Totals | None:
        """Empty a gVisor box's console directory of all but its log, flush the box's
        egress ledger; its totals, None where nothing was written to it since the last
        round and no folded line waits (blocking)."""
        if console.parent.name == "console":  # the gVisor sandbox's own directory: only its log
            with contextlib.suppress(OSError):
                for other in console.parent.iterdir():
                    if other.name != console.name:
                        if other.is_dir() and not other.is_symlink():
                            shutil.rmtree(other, ignore_errors=True)
                        else:
                            with contextlib.suppress(OSError):
                                other.unlink()
                        self.count(rec.id, "console", "removed_files", 1)
        egress = self.rt.box_dir(rec.id) / EGRESS_LOG
        state = egress.with_suffix(".ledger")
        try:
            now = state.read_bytes()  # (unlocked: a state read mid-write differs, and is flushed)
        except OSError:
            return None  # no egress yet
        seen = self.ledgers.get(rec.id)
        # by its content, not its time: a helper's write in the same tick of the file
        # system's clock as the last flush leaves the time as it was (CI: the refusals of a
        # connection flood, counted just after a round, were never told)
        if seen is not None and seen[0] == now and not seen[1]:
            return None
        totals, waiting, flushed = Ledger(egress, self.limits).flush()
        self.ledgers[rec.id] = (flushed, waiting)
        return totals

    async def _tell(self, rec: Any, known: dict[str, dict[str, Any]], egress: Totals | None) -> None:
        """Store each record's counts; where they moved since the box was last told, and
        not within ``TELL_EVERY``, tell it. Counts that moved within it are told once it
        has passed, whether or not they moved again (a flood that ended right after an
        earlier one was told would otherwise never be)."""
        current = self.take_counted(rec.id)
        if egress is not None:
            current["egress_log"] = {k: v for k, v in asdict(egress).items() if k not in UNTOLD}
        for record in KEPT:
            stored = known.get(record, {})
            if record not in current and untold(stored.get("counts", {}), stored.get("told", {})):
                current[record] = {} if record in ADDED else dict(stored["counts"])
        now = time.monotonic()
        for record, counts in current.items():
            before = known.get(record, {})
            if record in ADDED:  # counted here: add to what the store has
                counts = {k: before.get("counts", {}).get(k, 0) + counts.get(k, 0)
                          for k in {*counts, *before.get("counts", {})}}  # fmt: skip
            told = before.get("told", {})
            new = {k: v - told.get(k, 0) for k, v in counts.items() if v > told.get(k, 0)}
            due = new and now - self.told_at.get((rec.id, record), -1e9) >= TELL_EVERY
            if counts == before.get("counts") and not due:
                continue
            event = None
            if due:
                self.told_at[(rec.id, record)] = now
                event = Draft("records_dropped", tell(record, new, self.bounds),
                              {"record": record, **new}, "sandlot")  # fmt: skip
            await self.core.db.call_unless_full(BoxStore.note_records, rec.id, record, counts, event)

    def _home(self, live: list[str]) -> None:
        """Hold the home's guest logs to their bound (blocking)."""
        logs: list[tuple[int, Path, str]] = []
        for box_dir in self._box_dirs():
            for path in (box_dir / EGRESS_LOG, rotated(box_dir / EGRESS_LOG), box_dir / "console.log",
                         box_dir / "console" / "console.log"):  # fmt: skip
                size = records.on_host(path)
                if size:
                    logs.append((size, path, box_dir.name))
        total = sum(size for size, _, _ in logs)
        if total <= self.bounds.home_logs_bytes:
            return
        # the rotated files first, then the largest logs: halved, newest kept
        logs.sort(key=lambda t: (not t[1].name.endswith(".1"), -t[0]))
        for size, path, box in logs:
            if total <= self.bounds.home_logs_bytes * 0.9:
                break
            freed = 0
            if path.name.endswith(".1"):
                with contextlib.suppress(OSError):
                    path.unlink()
                    freed = size
            else:
                freed = records.keep_newest(path, size // 2)
            total -= freed
            if box in live:
                self.count(box, "home_logs", "dropped_bytes", freed)

    def _box_dirs(self) -> list[Path]:
        try:
            return [p for p in self.rt.boxes_dir.iterdir() if p.is_dir()]
        except OSError:
            return []
