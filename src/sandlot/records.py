"""Bounds on what a box's guest can make the host write or do (docs/api.md, "What a
guest can make the host write").

A box is untrusted, and every record its guest can make the host keep is a way to
fill the host's disk or memory: the egress log (a line per DNS answer and proxy
decision), the console log, the events table, a watch's events, a cell's output,
the box link's connections. Each has a bound here, in bytes or rows, per box and
for the whole home, read from the environment of the process that starts the box
(or serves the record), with a default that no ordinary box comes near:

* logs rotate and keep the newest bytes (``egress_log_bytes``, ``console_bytes``;
  ``home_logs_bytes`` over every box of the home);
* decisions past a box's line budget (``egress_lines`` a ``FOLD_WINDOW``) are folded into
  one line with a count, by what they were about (``fold_key``, ``fold_summary``);
* tables drop their oldest rows (``events_per_box``, ``events_keep``);
* where a guest makes the host work, a rate with a burst (``Rate``, ``Bucket``):
  DNS questions and proxy connections per box (the guest gets a refusal past it,
  never a queue), events per box, a watch's events (past it the watcher gets
  ``overflow``, as from inotify).

Nothing is bounded silently: what was folded, dropped or refused is counted
(``Tally``: per record and box) and told as the box's ``records_dropped`` events and in
the Prometheus metrics.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import HostSetupError

FOLD_WINDOW = 10.0  # seconds: decisions are folded, and folds are told, per window
FOLD_KEYS = 32  # distinct folded lines per window; past it, "other names"
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``per_s`` a second on average, ``burst`` at once (a token bucket); a
    ``per_s`` of 0: no limit."""

    per_s: float
    burst: float

    @property
    def limited(self) -> bool:
        return self.per_s > 0

    def spec(self) -> str:
        return f"{self.per_s:g},{self.burst:g}"

    @classmethod
    def parse(cls, text: str, what: str = "a rate") -> Rate:
        """``RATE[,BURST]`` (BURST: 4 x RATE by default); ``InvalidArgument``-like
        ``ValueError`` naming ``what`` otherwise."""
        parts = text.replace(" ", "").split(",")
        try:
            if len(parts) > 2:
                raise ValueError
            per_s = float(parts[0])
            burst = float(parts[1]) if len(parts) == 2 else max(1.0, 4 * per_s)
        except ValueError:
            raise ValueError(f"{what} must be RATE[,BURST] (numbers), not {text!r}") from None
        if not (0 <= per_s < 1e9 and (per_s == 0 or 1 <= burst < 1e9)):
            raise ValueError(f"{what}: RATE must be 0 (no limit) or more, and BURST at least 1, not {text!r}")
        return cls(per_s, burst)


@dataclass(frozen=True, slots=True)
class Bounds:
    """Every bound of a home's guest-driven records (``bounds()`` reads them)."""

    egress_log_bytes: int  # a box's egress log and its rotated file together
    egress_lines: int  # lines a box's egress log takes verbatim a FOLD_WINDOW; past it, folded
    console_bytes: int  # a box's console log (the newest kept)
    home_logs_bytes: int  # every box's egress and console logs of the home together
    dns: Rate  # DNS questions a box asks the host
    connections: Rate  # new connections a box makes to the egress proxy (and its DNS)
    connections_open: int  # connections of a box the egress helpers serve at once
    events: Rate  # events a box's happenings add (a command's OOM kill or timeout)
    events_per_box: int  # events kept per box (the home keeps ``events_keep``)
    events_keep: int
    watch: Rate  # events a watch sends the host, per watcher
    code_output_bytes: int  # a cell's output the host keeps (stdout and stderr), and of its results
    desktop_pixels: int  # a desktop's screen, in pixels (4 bytes each on the host)

    def helper_spec(self) -> str:
        """What an egress helper is told of its box's bounds (``--limits``)."""
        return (
            f"dns={self.dns.spec()};conn={self.connections.spec()};open={self.connections_open};"
            f"log={self.egress_log_bytes};lines={self.egress_lines}"
        )


# (variable, default, what it is): read by ``bounds``, documented in docs/configuration.md
SETTINGS: dict[str, tuple[str, str]] = {
    "SANDLOT_EGRESS_LOG_MIB": ("8", "a box's egress log, MiB"),
    "SANDLOT_EGRESS_LINES": ("100", "lines of a box's egress log in 10 s before decisions are folded"),
    "SANDLOT_CONSOLE_LOG_MIB": ("2", "a box's console log, MiB"),
    "SANDLOT_GUEST_LOGS_MIB": ("1024", "every box's egress and console logs of a home, MiB"),
    "SANDLOT_DNS_RATE": ("100,400", "DNS questions per box"),
    "SANDLOT_CONNECTION_RATE": ("50,200", "egress connections per box"),
    "SANDLOT_CONNECTIONS_OPEN": ("256", "egress connections of a box served at once"),
    "SANDLOT_EVENT_RATE": ("5,50", "events per box"),
    "SANDLOT_EVENTS_PER_BOX": ("10000", "events kept per box"),
    "SANDLOT_EVENTS_KEEP": ("100000", "events kept per home"),
    "SANDLOT_WATCH_RATE": ("2000,10000", "a watch's events"),
    "SANDLOT_CODE_OUTPUT_MIB": ("16", "a cell's output kept by the host, MiB"),
    "SANDLOT_DESKTOP_MAX_PIXELS": ("33554432", "a desktop's screen, pixels"),
}


def bounds(env: Mapping[str, str] | None = None) -> Bounds:
    """The bounds in force (``env``: ``os.environ``); ``HostSetupError`` naming the
    variable whose value is not one."""
    env = os.environ if env is None else env

    def raw(name: str) -> str:
        return env.get(name, "").strip() or SETTINGS[name][0]

    def size(name: str, unit: int = 1, least: float = 0) -> int:
        text = raw(name)
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= least and value * unit < 1 << 62):
            raise HostSetupError(
                f"{name}={text!r}: {SETTINGS[name][1]} must be a number of at least {least:g}"
            )
        return int(value * unit)

    def rate(name: str) -> Rate:
        try:
            return Rate.parse(raw(name), f"{name} ({SETTINGS[name][1]}, a second)")
        except ValueError as exc:
            raise HostSetupError(str(exc)) from None

    return Bounds(
        egress_log_bytes=size("SANDLOT_EGRESS_LOG_MIB", MIB, 0.0625),
        egress_lines=size("SANDLOT_EGRESS_LINES", 1, 0),
        console_bytes=size("SANDLOT_CONSOLE_LOG_MIB", MIB, 0.0625),
        home_logs_bytes=size("SANDLOT_GUEST_LOGS_MIB", MIB, 1),
        dns=rate("SANDLOT_DNS_RATE"),
        connections=rate("SANDLOT_CONNECTION_RATE"),
        connections_open=size("SANDLOT_CONNECTIONS_OPEN", 1, 1),
        events=rate("SANDLOT_EVENT_RATE"),
        events_per_box=size("SANDLOT_EVENTS_PER_BOX", 1, 100),
        events_keep=size("SANDLOT_EVENTS_KEEP", 1, 1000),
        watch=rate("SANDLOT_WATCH_RATE"),
        code_output_bytes=size("SANDLOT_CODE_OUTPUT_MIB", MIB, 0.0625),
        desktop_pixels=size("SANDLOT_DESKTOP_MAX_PIXELS", 1, 64 * 64),
    )


def parse_helper_spec(spec: str) -> dict[str, str]:
    """``helper_spec``'s fields; ValueError if it is not one."""
    out = {}
    for part in spec.split(";"):
        key, sep, value = part.partition("=")
        if not sep or key not in ("dns", "conn", "open", "log", "lines"):
            raise ValueError(f"not a helper's limits: {spec!r}")
        out[key] = value
    return out


@dataclass(slots=True)
class Bucket:
    """A token bucket's state: ``tokens`` left at time ``at`` (a monotonic or wall
    clock, the caller's; a bucket kept in a file uses wall time)."""

    tokens: float
    at: float

    @classmethod
    def full(cls, rate: Rate, now: float) -> Bucket:
        return cls(rate.burst, now)

    def take(self, rate: Rate, now: float, n: float = 1.0) -> bool:
        """Take ``n`` tokens if there are (refilled at ``rate`` since ``at``)."""
        if not rate.limited:
            return True
        elapsed = max(0.0, now - self.at)  # a clock set back refills nothing
        self.tokens = min(rate.burst, self.tokens + elapsed * rate.per_s)
        self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


def fold_key(host: str | None) -> str:
    """What decisions about ``host`` are folded under: the name's last two labels
    (``*.example.com`` for any name below it, so random subdomains fold together), an
    address as itself, and no host as ``-``."""
    if not host:
        return "-"
    labels = host.rstrip(".").split(".")
    if labels[-1].isdigit() or ":" in host or len(labels) <= 2:
        return host
    return "*." + ".".join(labels[-2:])


def fold_summary(method: str, decision: str, count: int, key: str, seconds: float) -> str:
    """``refused 3,817 lookups of *.example.com in the last 10 s``."""
    verb = {"denied": "refused", "refused": "refused", "allowed": "allowed", "failed": "failed"}.get(
        decision, decision
    )
    what = {"DNS": "lookups of", "CONNECT": "CONNECTs to"}.get(method, "connections to")
    target = "other names" if key == "*" else key
    return f"{verb} {count:,} {what} {target} in the last {seconds:.0f} s"


# -- logs written by a process that holds them open (QEMU's console: ``O_APPEND``)

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_COLLAPSE_RANGE = 0x1, 0x2, 0x8


def on_host(path: str | os.PathLike[str]) -> int:
    """The bytes a log takes on the host: its size, less what was cut out of it in place
    (a hole)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def keep_newest(path: str | os.PathLike[str], keep: int) -> int:
    """Cut a log that a writer appends to (``O_APPEND``: QEMU's console, a sandbox's init)
    down to about its newest ``keep`` bytes, in place, under the writer's feet; the bytes
    given back. The head goes with ``FALLOC_FL_COLLAPSE_RANGE`` where the file system has
    it (ext4, XFS: the file shrinks, an appender's next write lands at the new end), else
    it is punched out (tmpfs, btrfs: the space is given back, the size stays and the head
    reads as zeros). Whole file-system blocks only, so up to a block more is kept."""
    import ctypes

    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        held = min(st.st_size, st.st_blocks * 512)
        block = st.st_blksize or 4096
        cut = (st.st_size - keep) // block * block
        if held <= keep or cut <= 0:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        if fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, 0, cut) == 0:
            return held - on_host(path)
        if fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, cut) == 0:
            return max(0, held - on_host(path))
        # neither (a file system without them): the log starts over, its newest bytes first
        os.lseek(fd, st.st_size - keep, os.SEEK_SET)
        tail = os.read(fd, keep)
        os.ftruncate(fd, 0)
        os.pwrite(fd, tail, 0)
        return max(0, held - len(tail))
    except OSError:
        return 0
    finally:
        os.close(fd)


# -- what a process bounded, for the Prometheus metrics of the process that serves them


class Tally:
    """Counts of what this process folded, dropped or refused, by (record, what, box):
    the records it holds itself (a cell's output, a watch's events, a desktop's
    screen). ``sandlot serve`` exposes them at ``/metrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}

    def add(self, record: str, what: str, box: str = "", n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            key = (record, what, box)
            self._counts[key] = self._counts.get(key, 0) + n

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._counts)


TALLY = Tally()
