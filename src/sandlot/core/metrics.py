"""Per-box metrics, sampled while boxes run and kept as a bounded history in the store.

One sampler per home (``python -m sandlot.core.sampler HOME``, holding
``HOME/metrics.lock``) is started with the first VM a launch brings up, like the
home's watcher, and exits once no VM of the home has run for ``IDLE_S`` seconds
(and ``IDLE_ROUNDS`` rounds). Every ``every()`` seconds (``$SANDLOT_METRICS_EVERY``, 10; 0 turns sampling off)
it writes one sample per running or paused box:

* from the host, without asking the guest: the VM's CPU seconds, resident and
  proportional memory (RSS, PSS: ``/proc``), and the bytes its disk layer takes;
* from the guest, in the agent's answer to CONTROL STATUS (``guest/agent/stats.c``),
  every ``guest_every()`` seconds (``$SANDLOT_METRICS_GUEST_EVERY``, 60): memory in
  use and in all, network and disk bytes as the guest kernel counts them, commands
  started, and their time from request to running. Asking is no activity (an idle
  box still sleeps at its ``idle_timeout``), but it costs the box CPU where the
  host's figures cost it none (``benchmarks/events.py``).

Counters are cumulative (as Prometheus has them); ``rates`` turns two samples into
per-second figures. Samples older than ``keep_s()`` (``$SANDLOT_METRICS_KEEP_S``, a
day) go, and a box's go with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import spawn_unless_locked
from ..protocol.wire import Tag
from .store import BoxStore

log = logging.getLogger("sandlot")

MODULE = "sandlot.core.sampler"  # the sampler process
DEFAULT_EVERY, DEFAULT_GUEST_EVERY, DEFAULT_KEEP_S = 10.0, 60.0, 86400.0
ASK_TIMEOUT = 3.0  # seconds the agent has to answer; past it, the sample has the host's figures only
IDLE_ROUNDS = 3  # rounds without a VM in the home before the sampler exits (and sampler.IDLE_S)

# the agent's STATUS fields and the names a sample gives them (bytes where the agent says KiB)
GUEST = {
    "guest_memory_total_bytes": (Tag.MEM_TOTAL_KB, 1024),
    "guest_memory_available_bytes": (Tag.MEM_AVAILABLE_KB, 1024),
    "net_rx_bytes": (Tag.NET_RX_BYTES, 1),
    "net_tx_bytes": (Tag.NET_TX_BYTES, 1),
    "disk_read_bytes": (Tag.DISK_READ_BYTES, 1),
    "disk_written_bytes": (Tag.DISK_WRITTEN_BYTES, 1),
    "execs": (Tag.EXECS, 1),
    "exec_start_us": (Tag.EXEC_START_US, 1),
}


def every() -> float:
    """Seconds between two samples (``$SANDLOT_METRICS_EVERY``; 0: no sampling)."""
    return _seconds("SANDLOT_METRICS_EVERY", DEFAULT_EVERY)


def guest_every() -> float:
    """Seconds between two samples that ask the guest too (``$SANDLOT_METRICS_GUEST_EVERY``):
    the host's figures cost the box nothing, an answer from its agent does."""
    return _seconds("SANDLOT_METRICS_GUEST_EVERY", DEFAULT_GUEST_EVERY)


def keep_s() -> float:
    """Seconds a sample is kept (``$SANDLOT_METRICS_KEEP_S``)."""
    return _seconds("SANDLOT_METRICS_KEEP_S", DEFAULT_KEEP_S)


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value >= 0 else default


def metrics_lock(home: Path) -> Path:
    return home / "metrics.lock"


def ensure(home: Path) -> None:
    """Start the home's sampler unless one runs (sampling off, it is still the home's
    keeper: ``core.keeper``). Never raises."""
    try:
        spawn_unless_locked(metrics_lock(home), MODULE, str(home), cwd="/")
    except OSError as exc:
        log.warning("could not start the metrics sampler of home %s: %s", home, exc)


def pss_bytes(pid: int | None) -> int | None:
    """A process's proportional set size (``/proc/PID/smaps_rollup``), None where unknown."""
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return None


def guest_figures(status: Any) -> dict[str, int | None]:
    """A sample's guest part from the agent's STATUS answer (``Fields``); None where it
    says nothing (an agent older than these fields)."""
    out: dict[str, int | None] = {}
    for name, (tag, scale) in GUEST.items():
        value = status.u64(tag, None) if status is not None else None
        out[name] = value * scale if value is not None else None
    total, available = out["guest_memory_total_bytes"], out["guest_memory_available_bytes"]
    out["guest_memory_used_bytes"] = (
        total - available if total is not None and available is not None else None
    )
    return out


def _per_s(key: str, before: dict[str, Any] | None, now: dict[str, Any]) -> float | None:
    """How fast counter ``key`` grew from ``before`` to ``now``; None where it cannot say."""
    if before is None:
        return None
    a, b, span = before.get(key), now.get(key), float(now["at"] - before["at"])
    if a is None or b is None or span <= 0 or b < a:  # a counter that went back: the box started again
        return None
    return (float(b) - float(a)) / span


def rates(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each sample with what changed since the last one before it that has the same
    figure, per second: ``cpu_percent`` (of one host CPU), ``net_rx_Bps``,
    ``net_tx_Bps``, ``disk_read_Bps``, ``disk_written_Bps``, ``execs_per_s``, and
    ``exec_start_ms`` (the mean time from request to running of the commands started
    in between). None for the first, in a sample without the guest's figures, and
    where a counter went back (the box was started again)."""
    out = []
    last: dict[str, dict[str, Any]] = {}  # counter: the last sample that had it
    for now in samples:
        d = dict(now)

        def per_s(key: str, now: dict[str, Any] = now) -> float | None:
            return _per_s(key, last.get(key), now)

        cpu = per_s("cpu_seconds")
        d["cpu_percent"] = round(cpu * 100, 1) if cpu is not None else None
        for key in ("net_rx", "net_tx", "disk_read", "disk_written"):
            r = per_s(f"{key}_bytes")
            d[f"{key}_Bps"] = round(r) if r is not None else None
        execs = per_s("execs")
        d["execs_per_s"] = round(execs, 3) if execs is not None else None
        started = per_s("exec_start_us")
        d["exec_start_ms"] = round(started / execs / 1000, 3) if started is not None and execs else None
        for key, value in now.items():
            if value is not None:
                last[key] = now
        out.append(d)
    return out


# -- the ``metrics`` table: functions that take the store first, as ``BoxStore``'s methods
# do, so that ``AsyncStore.call`` runs them on the store's thread


def add_samples(store: BoxStore, rows: Sequence[tuple[str, dict[str, Any]]], keep_s: float) -> None:
    """Add one sample per (box id, sample), and drop those older than ``keep_s``."""
    with store.transaction(durable=False) as db:
        db.executemany("INSERT INTO metrics (box_id, at, sample) VALUES (?, ?, ?)",
                       [(box_id, s["at"], json.dumps(s)) for box_id, s in rows])  # fmt: skip
        db.execute("DELETE FROM metrics WHERE at < ?", (time.time() - keep_s,))


def samples(
    store: BoxStore, box_id: str, *, since: float | None = None, limit: int = 10_000
) -> list[dict[str, Any]]:
    """A box's samples, oldest first: from Unix time ``since``, the newest ``limit``."""
    with store.reading() as db:
        rows = db.execute(
            "SELECT sample FROM (SELECT sample, at FROM metrics WHERE box_id = ? AND at >= ? "
            "ORDER BY at DESC LIMIT ?) ORDER BY at",
            (box_id, since if since is not None else 0.0, limit),
        ).fetchall()
    return [json.loads(r[0]) for r in rows]


def latest_samples(store: BoxStore) -> dict[str, dict[str, Any]]:
    """Each box's newest sample (box id: sample)."""
    with store.reading() as db:
        rows = db.execute(
            "SELECT m.box_id, m.sample FROM metrics m JOIN (SELECT box_id, MAX(at) AS at FROM metrics "
            "GROUP BY box_id) last ON m.box_id = last.box_id AND m.at = last.at"
        ).fetchall()
    return {r[0]: json.loads(r[1]) for r in rows}
