"""A box's egress record on the host: its log (``egress.log``), bounded, and its rates.

Every egress helper of a box (the proxy and the DNS answerer: threads of the home's
egress server, or processes of their own where none takes a connection) goes through
the box's ledger, a small state file beside the log (``egress.ledger``) held with
``flock`` for each step, so that all of them, in whichever process, draw on the same
buckets and write one log:

* ``admit(kind)``: a DNS question (``"dns"``) or a new connection (``"conn"``), if the
  box's rate allows it (a token bucket on the wall clock). Past it the helper refuses
  at once (DNS ``REFUSED``, the proxy's ``429``): a refusal, never a queue;
* ``slot()``: one of the box's ``open`` places for a connection being served, an OFD
  lock on one byte of ``egress.slots`` (``egress.dns.slots`` for DNS connections), which
  the kernel gives back when the connection's descriptor closes, however its process
  ends;
* ``record(entry)``: a decision's line, written as it is while the box has written
  fewer than ``lines`` lines in the current ``FOLD_WINDOW``; past that, counted
  under what it was about (``records.fold_key``: ``*.example.com`` for any name below
  it) and written as one line with the count once the window ends ("refused 3,817
  lookups of *.example.com in the last 10 s"): by the box's next decision, or by
  ``flush``, which the home's keeper calls for every running box;
* the log is renamed to ``egress.log.1`` (replacing the one before, whose lines are
  dropped) once it holds half the box's bound, so the two stay under the bound.

The totals (``Totals``: lines written, decisions folded, lines dropped by rotation,
questions and connections refused) stay in the state file, where the home's keeper
reads them (``totals``) to tell the box's events and the metrics. A state file that
cannot be read (a process killed while writing it) starts over: the log and the
bounds hold whatever the counts say.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..records import (
    FOLD_KEYS,
    FOLD_WINDOW,
    SETTINGS,
    Bucket,
    Rate,
    bounds,
    fold_key,
    fold_summary,
    parse_helper_spec,
)

STATE_SUFFIX = ".ledger"
DEFAULT_LINES = int(SETTINGS["SANDLOT_EGRESS_LINES"][0])
SLOTS_SUFFIX = ".slots"
STATE_MAX = 1 << 16  # bytes of state read; FOLD_KEYS bounds what is written well under it
ROTATED = ".1"


@dataclass(frozen=True, slots=True)
class Limits:
    """A box's egress bounds, as its VM's helpers are told them (``--limits``)."""

    dns: Rate
    connections: Rate
    open: int
    log_bytes: int
    lines: int = DEFAULT_LINES  # verbatim a window (a VM's helpers started before it: the default)

    @classmethod
    def default(cls) -> Limits:
        """From this process's environment (``records.bounds``)."""
        b = bounds()
        return cls(b.dns, b.connections, b.connections_open, b.egress_log_bytes, b.egress_lines)

    @classmethod
    def parse(cls, spec: str) -> Limits:
        """``records.Bounds.helper_spec``'s form; ValueError otherwise."""
        f = parse_helper_spec(spec)
        try:
            lines = int(f.get("lines", DEFAULT_LINES))
            return cls(Rate.parse(f["dns"]), Rate.parse(f["conn"]), int(f["open"]), int(f["log"]), lines)
        except (KeyError, ValueError):
            raise ValueError(f"not a helper's limits: {spec!r}") from None


@dataclass(frozen=True, slots=True)
class HelperOptions:
    """What every egress helper's command line may say after ``POLICY LOG``: ``--link
    FILE`` (``boxlink.LinkInfo``) and ``--limits SPEC`` (``Limits``); the words left for
    the helper's own options, in order."""

    link: Path | None
    limits: Limits | None
    rest: list[str]

    @classmethod
    def parse(cls, words: list[str]) -> HelperOptions | None:
        """None where ``--link`` or ``--limits`` lacks its value or ``--limits`` is not one."""
        link, limits, rest, i = None, None, [], 0
        while i < len(words):
            if words[i] in ("--link", "--limits"):
                if i + 1 == len(words):
                    return None
                if words[i] == "--link":
                    link = Path(words[i + 1])
                else:
                    try:
                        limits = Limits.parse(words[i + 1])
                    except ValueError:
                        return None
                i += 2
            else:
                rest.append(words[i])
                i += 1
        return cls(link, limits, rest)


@dataclass(slots=True)
class Totals:
    """What a box's egress record did since the box's log began (cumulative)."""

    lines: int = 0  # lines written (folded lines included)
    folded: int = 0  # decisions counted into a folded line instead of a line of their own
    dropped: int = 0  # lines dropped with a rotated file
    rotations: int = 0
    refused_dns: int = 0  # questions refused by the box's DNS rate
    refused_connections: int = 0  # connections refused by its connection rate
    refused_open: int = 0  # connections refused while ``open`` were served

    @classmethod
    def of(cls, data: Any) -> Totals:
        t = cls()
        if isinstance(data, dict):
            for name in asdict(t):
                value = data.get(name)
                if isinstance(value, int) and value >= 0:
                    setattr(t, name, value)
        return t


@dataclass(slots=True)
class _State:
    buckets: dict[str, Bucket] = field(default_factory=dict)
    window: float = 0.0  # when the current window began (wall clock)
    written: int = 0  # lines written verbatim in it
    folds: dict[str, list[Any]] = field(default_factory=dict)  # key: [count, first, last, reason]
    lines: list[int] = field(default_factory=lambda: [0, 0])  # in the log, in its rotated file
    totals: Totals = field(default_factory=Totals)
    log_bytes: int = 0  # the box's bound, as its helpers were told it (0: not yet known)

    @classmethod
    def load(cls, raw: bytes) -> _State:
        s = cls()
        try:
            data = json.loads(raw) if raw else {}
            s.buckets = {k: Bucket(float(v[0]), float(v[1])) for k, v in data.get("buckets", {}).items()}
            s.window, s.written = float(data.get("window", 0.0)), int(data.get("written", 0))
            s.folds = {str(k): list(v) for k, v in data.get("folds", {}).items() if len(v) == 4}
            lines = data.get("lines", [0, 0])
            s.lines = [int(lines[0]), int(lines[1])]
            s.totals = Totals.of(data.get("totals"))
            s.log_bytes = int(data.get("log_bytes", 0))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return cls()
        return s

    def dump(self) -> bytes:
        return json.dumps({
            "buckets": {k: [round(b.tokens, 3), b.at] for k, b in self.buckets.items()},
            "window": self.window,
            "written": self.written,
            "folds": self.folds,
            "lines": self.lines,
            "totals": asdict(self.totals),
            "log_bytes": self.log_bytes,
        }, separators=(",", ":")).encode()  # fmt: skip


class Ledger:
    """The egress record of the box whose log is ``log``."""

    def __init__(self, log: Path, limits: Limits, clock: Callable[[], float] = time.time) -> None:
        self.log = log
        self.limits = limits
        self.clock = clock  # the wall clock: a bucket's state outlives processes
        self.state_path = log.with_suffix(STATE_SUFFIX)
        self.slots_path = log.with_suffix(SLOTS_SUFFIX)
        self.written = b""  # the state as this object last wrote it

    @contextlib.contextmanager
    def _held(self, write: bool = True, helper: bool = True) -> Iterator[_State]:
        """The state, locked; ``helper``: held by one of the box's helpers, which know the
        box's bound (the keeper's flush, which does not, keeps the one they wrote)."""
        fd = os.open(self.state_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for microseconds by whoever has it
            state = _State.load(os.pread(fd, STATE_MAX, 0))
            if helper or not state.log_bytes:
                state.log_bytes = self.limits.log_bytes
            yield state
            if write:
                data = state.dump()
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
                self.written = data
        finally:
            os.close(fd)  # and with it the lock

    def admit(self, kind: str) -> bool:
        """Whether the box may ask one more DNS question (``"dns"``) or open one more
        connection (``"conn"``) now; a refusal is counted."""
        rate = self.limits.dns if kind == "dns" else self.limits.connections
        now = self.clock()
        with self._held() as s:
            self._roll(s, now)
            bucket = s.buckets.setdefault(kind, Bucket.full(rate, now))
            if bucket.take(rate, now):
                return True
            if kind == "dns":
                s.totals.refused_dns += 1
            else:
                s.totals.refused_connections += 1
            return False

    def refused_open(self) -> None:
        with self._held() as s:
            s.totals.refused_open += 1

    @contextlib.contextmanager
    def slot(self, kind: str = "conn") -> Iterator[bool]:
        """One of the box's places for a connection being served, for the block; False
        (counted) where all ``open`` are taken. DNS connections (``"dns"``: one a question,
        from the box's relay) have places of their own, so that a box holding its proxy
        connections open can still look names up."""
        path = self.slots_path if kind == "conn" else self.slots_path.with_suffix(f".{kind}{SLOTS_SUFFIX}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            got = _take_slot(fd, self.limits.open)
            if not got:
                self.refused_open()
            yield got
        finally:
            os.close(fd)  # gives the place back

    def record(self, entry: dict[str, Any]) -> None:
        """Write a decision's line, or count it into its window's folded line."""
        now = self.clock()
        with self._held() as s:
            self._roll(s, now)
            if s.written < self.limits.lines:
                s.written += 1
                self._write(s, [entry])
                return
            method, decision = str(entry.get("method", "?")), str(entry.get("decision", "?"))
            key = f"{method}|{decision}|{fold_key(str(entry.get('host') or '') or None)}"
            if key not in s.folds and len(s.folds) >= FOLD_KEYS:
                key = f"{method}|{decision}|*"
            fold = s.folds.setdefault(key, [0, now, now, str(entry.get("reason", ""))[:200]])
            fold[0] += 1
            fold[2] = now
            s.totals.folded += 1

    def flush(self) -> tuple[Totals, bool, bytes]:
        """Write the folded lines of a window that has ended (the keeper's round); the
        totals, whether folded decisions wait for their window's end, and the state as
        the flush left it (what the keeper compares the next round's with)."""
        with self._held(helper=False) as s:
            self._roll(s, self.clock())
            totals, waiting = s.totals, bool(s.folds)
        return totals, waiting, self.written

    def totals(self) -> Totals:
        with self._held(write=False, helper=False) as s:
            return s.totals

    def _roll(self, s: _State, now: float) -> None:
        """Start a new window if the current one has ended, writing its folded lines."""
        if now - s.window < FOLD_WINDOW and now >= s.window:
            return
        if s.folds:
            lines = []
            for key, (count, first, last, reason) in sorted(s.folds.items()):
                method, decision, host = key.split("|", 2)
                lines.append({
                    "time": round(last, 3), "method": method, "decision": decision, "host": host,
                    "folded": count, "since": round(first, 3), "window_s": FOLD_WINDOW,
                    "reason": reason, "summary": fold_summary(method, decision, count, host, FOLD_WINDOW),
                })  # fmt: skip
            s.folds = {}
            self._write(s, lines)
        s.window, s.written = now, 0

    def _write(self, s: _State, entries: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(e) + "\n" for e in entries).encode()
        try:
            size = os.stat(self.log).st_size
        except OSError:
            size = 0
        # rotated before the write that would take it past half: each file stays under half
        if size and size + len(data) > s.log_bytes // 2:
            with contextlib.suppress(OSError):
                os.replace(self.log, rotated(self.log))
                s.totals.dropped += s.lines[1]
                s.totals.rotations += 1
                s.lines = [0, s.lines[0]]
        try:
            with open(self.log, "ab") as f:
                f.write(data)
        except OSError:
            return  # a full disk: the decision stands, its line is lost
        s.lines[0] += len(entries)
        s.totals.lines += len(entries)


def rotated(log: Path) -> Path:
    """Where a box's log goes when it rotates."""
    return Path(str(log) + ROTATED)


# struct flock, as fcntl(2) takes it on Linux (short, short, off_t, off_t, pid_t, padded)
_FLOCK = struct.Struct("hhqqi4x")


def _take_slot(fd: int, places: int) -> bool:
    """An OFD write lock on one byte of the first ``places`` of ``fd``'s file, tried
    from a random place on; False if every one is held. Where the kernel has no OFD
    locks, every connection gets a place."""
    setlk = getattr(fcntl, "F_OFD_SETLK", None)
    if setlk is None:
        return True
    start = random.randrange(places)
    for i in range(places):
        place = (start + i) % places
        try:
            fcntl.fcntl(fd, setlk, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, place, 1, 0))
            return True
        except BlockingIOError:
            continue
        except OSError as exc:
            if exc.errno in (11, 13):  # EAGAIN, EACCES: held by another
                continue
            return True  # a file system without locks: no bound to keep here
    return False
