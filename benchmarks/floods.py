"""Floods: each record a box's guest can make the host write, driven as fast as the
guest can for a fixed time (docs/api.md, "What a guest can make the host write").

For each record: the guest's rate (what it asked for, a second), the host's record
sampled every 0.25 s all through the flood (bytes; rows for events; resident MiB of
this process for a cell), its growth a second before the record reached half its
bound (where a log starts to rotate or be cut) and after, its largest size against
the bound, what the box's ``records_dropped`` events said was folded, dropped or
refused, the host memory of the processes serving it before and after, and a
neighbour box's ``exec true`` p50 and p99 during the flood against its quiet p99
(measured first, with the flooding box up and idle).

* ``dns``: lookups of random names the policy refuses, from 4 threads, straight to
  the box's resolver (the record: ``egress.log`` and its rotated file);
* ``connect``: ``CONNECT``s the policy refuses, from 4 threads (the same record);
* ``console``: the guest's console, written as fast as it can (``console.log``; on
  gVisor the console directory the sandbox's init writes to);
* ``events``: commands that run past their timeout, from 4 host threads, each a
  ``command_timeout`` event (rows of the box in the ``events`` table);
* ``watch``: files made and removed in a watched directory (the events the host's
  watcher gets, in bytes of their paths);
* ``interpreter``: a cell that lifts the box's own output limit and prints as fast as
  it can (this process's resident memory, and the bytes the host kept of the cell);
* ``boxlink``: connections from the box to a port of its own through the box link,
  each held open, from 8 threads (the egress log; the box link's memory).

The bounds are the defaults unless the environment says otherwise; ``--quick`` (CI)
floods 3 s each with small bounds (``SMALL_BOUNDS``), so that each is reached.

    .venv/bin/python benchmarks/floods.py [--seconds 10] [--engine qemu|gvisor] [--quick]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sandlot
from sandlot import records
from sandlot.records import on_host

from _common import debian_root, drop_home, emit, host_facts, parser, scratch_home, summary
from tests.support.floods import (
    CHURN,
    CONNECT_FLOOD,
    CONSOLE_FLOOD,
    DNS_FLOOD,
    HOLDER,
    LINK_FLOOD,
    SMALL_BOUNDS,
    commands_past_their_timeout,
    helper_pid,
    rss_mib,
    settled,
)
from tests.support.neighbour import exec_samples, exec_times


def bound(name: str) -> int | None:
    """The bound of a record, in bytes (rows for events); None: none in bytes."""
    b = records.bounds()
    return {
        "dns": b.egress_log_bytes,
        "connect": b.egress_log_bytes,
        "boxlink": b.egress_log_bytes,
        "console": b.console_bytes,
        "events": b.events_per_box,
        "interpreter": b.code_output_bytes,
    }.get(name)


class Sampler:
    """A record's size every 0.25 s, from a thread, while a flood runs."""

    def __init__(self, size: Callable[[], float]) -> None:
        self.size = size
        self.points: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(Exception):
                self.points.append((time.monotonic() - t0, float(self.size())))
            if self._stop.wait(0.25):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def rates(self, limit: int | None) -> dict[str, Any]:
        """Growth a second before the record reached half of ``limit`` (where a bounded
        log rotates or is cut) and after; its largest size."""
        pts = self.points
        if len(pts) < 2:
            return {"host_per_s_before_bound": None, "host_per_s_after_bound": None, "host_max": None}
        start = pts[0]
        half = limit / 2 if limit is not None else float("inf")
        at = next((i for i, (_, v) in enumerate(pts) if v - start[1] >= half), None)

        def slope(a: tuple[float, float], b: tuple[float, float]) -> float | None:
            return round((b[1] - a[1]) / (b[0] - a[0]), 1) if b[0] > a[0] else None

        out = {"host_max": max(v for _, v in pts), "reached_half_bound_at_s": None}
        if at is None:
            return {**out, "host_per_s_before_bound": slope(start, pts[-1]), "host_per_s_after_bound": None}
        out["reached_half_bound_at_s"] = round(pts[at][0], 2)
        return {**out, "host_per_s_before_bound": slope(start, pts[at]),
                "host_per_s_after_bound": slope(pts[at], pts[-1])}  # fmt: skip


def said(box: sandlot.Box, since: int) -> list[dict[str, Any]]:
    """What the box's ``records_dropped`` events told since event id ``since``."""
    return [{"reason": e.reason, **e.detail} for e in box.events(after=since, follow=False)
            if e.kind == "records_dropped"]  # fmt: skip


def last_event(box: sandlot.Box) -> int:
    ids = [e.id for e in box.events(follow=False)]
    return ids[-1] if ids else 0


class Bench:
    def __init__(self, box: sandlot.Box, other: sandlot.Box, seconds: float, quiet_p99_ms: float) -> None:
        self.box, self.other, self.seconds = box, other, seconds
        self.quiet_p99_ms = quiet_p99_ms
        self.box_dir = Path(box.inspect()["paths"]["dir"])

    def guest(self, script: str, *args: str) -> dict[str, Any]:
        r = self.box.exec("python3", "-c", script, str(self.seconds), *args, timeout=self.seconds + 180)
        return json.loads(r.stdout) if r.exit_code == 0 else {"error": r.stderr[-500:]}

    def flood(
        self,
        name: str,
        size: Callable[[], float],
        drive: Callable[[], dict[str, Any]],
        asked: Callable[[dict[str, Any]], float],
        helpers: dict[str, int | None],
    ) -> dict[str, Any]:
        since = last_event(self.box)
        memory = {k: mib(rss_mib(p)) for k, p in helpers.items()}
        t0 = time.monotonic()
        with exec_samples(self.other, 0.1) as lat, Sampler(size) as sampled:
            guest = drive()
        took = time.monotonic() - t0
        time.sleep(2)  # the home's keeper tells within a round
        lat_ms = summary(lat, 1e3, 1) if lat else None
        out: dict[str, Any] = {
            "seconds": round(took, 1),
            "guest": guest,
            "guest_rate_per_s": round(asked(guest) / self.seconds, 1),
            "bound": bound(name),
            **sampled.rates(bound(name)),
            "host_memory_MiB_before_after": {k: [memory[k], mib(rss_mib(p))] for k, p in helpers.items()},
            "neighbour_exec_ms": lat_ms,
            "neighbour_median_within_2x_quiet_p99": within(lat_ms, self.quiet_p99_ms),
            "reported": said(self.box, since),
        }
        print(f"{name}: guest {guest}, host max {out['host_max']}, bound {out['bound']}", file=sys.stderr)
        return out

    def egress_bytes(self) -> int:
        return on_host(self.box_dir / "egress.log") + on_host(self.box_dir / "egress.log.1")

    def console_bytes(self) -> int:
        files = [self.box_dir / "console.log", *(self.box_dir / "console").glob("*")]
        return sum(on_host(p) for p in files if p.is_file())


# a cell that lifts the interpreter's own limit (its code runs in that process) and prints
LOUD_CELL = """import __main__, time
__main__.OUTPUT_LIMIT = 1 << 40
end = time.time() + {seconds}
n = 0
while time.time() < end:
    print("x" * 1023)
    n += 1
n
"""


def mib(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def within(lat_ms: dict[str, Any] | None, quiet_p99_ms: float) -> bool:
    """The neighbour's median during a flood is within twice its quiet p99."""
    return bool(lat_ms and lat_ms["median"] <= 2 * quiet_p99_ms)


def asked_total(g: dict[str, Any]) -> float:
    return 0.0 if "error" in g else float(sum(v for k, v in g.items() if k != "held_at_end"))


def run(seconds: float, engine: str, quick: bool) -> dict[str, Any]:
    home = scratch_home("bench-floods-", kept=True)
    results: dict[str, Any] = {}
    try:
        root = debian_root()
        with (
            sandlot.Box(
                rootfs=root,
                memory_mib=384,
                engine=engine,
                name="flood",
                network="allowlist",
                allow=["box:flood:8000"],
                home=home,
            ) as box,  # fmt: skip
            sandlot.Box(rootfs=root, memory_mib=256, engine=engine, home=home) as other,
        ):
            results["accel"] = box.accel
            box.exec("true")
            quiet = summary(exec_times(other, 15 if quick else 60), 1e3, 1)
            b = Bench(box, other, seconds, quiet["p99"])
            egress = {"egress_server": helper_pid("sandlot.net.egress", home)}
            results["dns"] = b.flood("dns", b.egress_bytes, lambda: b.guest(DNS_FLOOD), asked_total, egress)
            connect = lambda: b.guest(CONNECT_FLOOD)  # noqa: E731
            results["connect"] = b.flood("connect", b.egress_bytes, connect, asked_total, egress)
            keeper = {"keeper": helper_pid("sandlot.core.sampler", home)}
            results["console"] = b.flood("console", b.console_bytes, lambda: b.guest(CONSOLE_FLOOD),
                                         lambda g: g.get("bytes", 0), keeper)  # fmt: skip

            def timeouts() -> dict[str, Any]:
                return {"commands_timed_out": commands_past_their_timeout(box, seconds)}

            here = {"this_process": os.getpid()}
            rows = lambda: sum(1 for _ in box.events(follow=False))  # noqa: E731
            results["events"] = b.flood("events", rows, timeouts, lambda g: g["commands_timed_out"], here)

            seen = {"events": 0, "bytes": 0, "overflow": 0}

            def churn() -> dict[str, Any]:
                box.files.mkdir("/tmp/churn", parents=True)
                done, ready = threading.Event(), threading.Event()

                def read() -> None:
                    with box.files.watch("/tmp/churn") as w:
                        ready.set()
                        while not done.is_set():
                            with contextlib.suppress(TimeoutError):
                                e = w.next_event(0.5)
                                if e is None:
                                    return
                                seen["events"] += 1
                                seen["bytes"] += len(e.path) + len(e.type)
                                seen["overflow"] += e.type == "overflow"

                reader = threading.Thread(target=read, daemon=True)
                reader.start()
                ready.wait(60)
                try:
                    return b.guest(CHURN, "/tmp/churn")
                finally:
                    time.sleep(1)
                    done.set()
                    reader.join(30)

            files = lambda g: 3 * g.get("files", 0)  # noqa: E731  (created, modified, deleted)
            results["watch"] = b.flood("watch", lambda: seen["bytes"], churn, files, here)
            results["watch"]["host_watcher"] = dict(seen)

            kept: dict[str, Any] = {}

            def cell() -> dict[str, Any]:
                ex = box.run_code(LOUD_CELL.format(seconds=seconds), timeout=seconds + 180)
                kept.update(stdout=len(ex.stdout), stderr_tail=ex.stderr[-300:])
                return {"lines": int(ex.text) if ex.text and ex.text.isdigit() else None}

            box.run_code("1")  # the interpreter started before the clock
            resident = lambda: (rss_mib(os.getpid()) or 0) * (1 << 20)  # noqa: E731
            printed = lambda g: (g["lines"] or 0) * 1024  # noqa: E731
            results["interpreter"] = b.flood("interpreter", resident, cell, printed, here)
            results["interpreter"]["host_kept"] = kept

            server = box.spawn("python3", "-u", "-c", HOLDER)
            next(server.stdout.lines(), b"")
            first = "import socket; socket.create_connection(('flood.box.internal', 8000), 30)"
            box.exec("python3", "-c", first, timeout=120)  # the box link started before the clock
            deadline = time.monotonic() + 60  # the link starts behind the first connection
            while helper_pid("sandlot.api.boxlink", home) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            settled(helper_pid("sandlot.api.boxlink", home))  # its memory from there, not its start's
            link = {"box_link": helper_pid("sandlot.api.boxlink", home), **egress}
            connections = lambda: b.guest(LINK_FLOOD)  # noqa: E731
            results["boxlink"] = b.flood("boxlink", b.egress_bytes, connections, asked_total, link)
            server.kill()
            for r in results.values():
                if isinstance(r, dict):
                    r["neighbour_quiet_exec_ms"] = quiet
    finally:
        drop_home(home)
    return results


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--seconds", type=float, default=10.0, help="each flood's length")
    ap.add_argument("--engine", default=os.environ.get("SANDLOT_TEST_ENGINE", "qemu"))
    args = ap.parse_args()
    if args.quick:
        for k, v in SMALL_BOUNDS.items():
            os.environ.setdefault(k, v)
    seconds = 3.0 if args.quick else args.seconds
    t = time.monotonic()
    floods = run(seconds, args.engine, args.quick)
    accel = floods.pop("accel", None)
    emit({
        "benchmark": "floods",
        "quick": args.quick,
        "engine": args.engine,
        "seconds_each": seconds,
        "bounds": {k: os.environ.get(k) for k in SMALL_BOUNDS if os.environ.get(k)},
        "floods": floods,
        "took_s": round(time.monotonic() - t, 1),
        "host": host_facts(accel),
    })  # fmt: skip


if __name__ == "__main__":
    main()
