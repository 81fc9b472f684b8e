"""Floods: a box's guest drives each record it can make the host write, as fast as it
can for a few seconds, and the host holds (docs/api.md, "What a guest can make the
host write"). For each record the test asserts that the host's bytes (or rows) stay
under the bound all through the flood, that the host processes serving it keep their
memory, that a neighbour box's exec latency stays within twice its quiet p99
(``tests/support/neighbour.py``), and that what was folded, dropped or refused is
reported: in the box's ``records_dropped`` events and in the counts ``GET /metrics``
exposes (``api.metrics.bounded``).

The boxes run on ``SANDLOT_TEST_ENGINE`` (qemu, or gvisor in the suite's gVisor pass),
in a home of the module's own whose bounds are small (``BOUNDS``), so that each flood
reaches its bound in seconds: the same code as the defaults, which only take longer to
reach. One flooding box (Debian, python3) and one neighbour (busybox) serve every test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sandlot
from sandlot import records
from sandlot.api.metrics import bounded

from tests.conftest import TEST_ENGINE
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
from tests.support.neighbour import neighbour_latency, quiet_p99
from tests.support.serve import serving, shared_home
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm

FLOOD_S = 5.0  # each flood's length, in the guest
BOUNDS = {**SMALL_BOUNDS, "SANDLOT_AUTO_TEMPLATE": "0"}
MEMORY_SLACK_MIB = 24.0  # a host process's resident growth a flood may cause (allocator, caches)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home of the module's own, whose processes (the egress server, the keeper) start
    with ``BOUNDS`` in their environment."""
    saved = {k: os.environ.get(k) for k in BOUNDS}
    os.environ.update(BOUNDS)
    home = shared_home(tmp_path_factory.mktemp("floods"))
    try:
        yield home
    finally:
        for b in sandlot.list(home=home):
            b.remove(force=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def neighbour(home: Path, busybox_root: Path) -> Iterator[sandlot.Box]:
    with sandlot.Box(rootfs=busybox_root, memory_mib=128, engine=TEST_ENGINE, home=home) as box:
        yield box


@pytest.fixture
def quiet(neighbour: sandlot.Box, flood: sandlot.Box) -> float:
    """The neighbour's quiet p99 just before the test's flood, with the flooding box up and
    idle: the host's load from other work moves over minutes, so each flood is held to the
    neighbour's latency of its own moment."""
    neighbour.exec("true")
    return quiet_p99(neighbour, 20)


@pytest.fixture(scope="module")
def flood(home: Path, debian_root: Path) -> Iterator[sandlot.Box]:
    with sandlot.Box(rootfs=debian_root, memory_mib=384, engine=TEST_ENGINE, home=home, name="flood",
                     network="allowlist", allow=["box:flood:8000"]) as box:  # fmt: skip
        box.exec("true")
        yield box


def run_in(box: sandlot.Box, script: str, *args: str) -> dict[str, Any]:
    r = box.exec("python3", "-c", script, str(FLOOD_S), *args, timeout=FLOOD_S + 120)
    assert r.exit_code == 0, r.stderr[-2000:]
    got: dict[str, Any] = json.loads(r.stdout)
    return got


class Watched:
    """A record's size on the host every 0.1 s while a flood runs, and the memory of the
    host processes that serve it before and after."""

    def __init__(self, size: Callable[[], int], processes: dict[str, int | None]) -> None:
        self.size = size
        self.processes = processes
        self.sizes: list[int] = []
        self.before = {k: rss_mib(p) or 0.0 for k, p in processes.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sizes.append(self.size())
            self._stop.wait(0.1)

    def __enter__(self) -> Watched:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sizes.append(self.size())

    def assert_flat(self) -> None:
        for name, pid in self.processes.items():
            now = rss_mib(pid)
            assert now is not None, f"the {name} went away during the flood"
            grew = now - self.before[name]
            assert grew < MEMORY_SLACK_MIB, f"the {name} grew by {grew:.1f} MiB during the flood"


def told(
    box: sandlot.Box, record: str, since: int, key: str | tuple[str, ...], timeout: float = 30.0
) -> dict[str, Any]:
    """The detail of the box's ``records_dropped`` events about ``record`` after event id
    ``since``, summed, once one has said ``key`` (the home's keeper tells within a round,
    then at most once every ``keeper.TELL_EVERY`` seconds: all of it is in the counts).
    ``timeout`` is the reference host's: a loaded host's keeper tells later, and a count
    that came just after a tell waits out a whole window (10 s) and a round first."""
    deadline = deadline_in(timeout)
    while True:
        found = [e for e in box.events(after=since, follow=False) if e.kind == "records_dropped"
                 and e.detail.get("record") == record]  # fmt: skip
        total: dict[str, Any] = {}
        for e in found:
            for k, v in e.detail.items():
                total[k] = total.get(k, 0) + v if isinstance(v, int) else v
            total.setdefault("reasons", []).append(e.reason)
        keys = (key,) if isinstance(key, str) else key
        if any(total.get(k) for k in keys) or time.monotonic() > deadline:
            assert any(total.get(k) for k in keys), (
                f"no records_dropped event of {record} said {key}: {found}"
            )
            return total
        time.sleep(0.5)


def folded_lines(box: sandlot.Box) -> list[dict[str, Any]]:
    """The folded lines of the box's egress log, once its window has ended (the keeper
    writes them within a round of its end)."""
    log = Path(box.inspect()["paths"]["dir"]) / "egress.log"
    deadline = time.monotonic() + records.FOLD_WINDOW + 5
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        folded = [json.loads(line) for line in lines if '"folded"' in line]
        if folded or time.monotonic() > deadline:
            assert folded, "no folded line in the egress log"
            return folded
        time.sleep(0.5)


def last_id(box: sandlot.Box) -> int:
    ids = [e.id for e in box.events(follow=False)]
    return ids[-1] if ids else 0


def counted(home: Path, box: sandlot.Box, record: str, key: str, at_least: int, timeout: float = 10.0) -> int:
    """What the counts ``GET /metrics`` shows say of ``record``'s ``key``, once at least
    ``at_least`` (the keeper stores them each round)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        n: int = asyncio.run(bounded(home)).get(box.id, {}).get(record, {}).get(key, 0)
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.5)


def egress_bytes(box: sandlot.Box) -> Callable[[], int]:
    d = Path(box.inspect()["paths"]["dir"])
    return lambda: sum(records.on_host(d / n) for n in ("egress.log", "egress.log.1"))


def test_a_dns_flood_is_refused_past_its_rate_and_its_log_stays_bounded(
    home: Path, flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    since = last_id(flood)
    log_bound = records.bounds().egress_log_bytes
    with (
        Watched(egress_bytes(flood), {"egress server": helper_pid("sandlot.net.egress", home)}) as w,
        neighbour_latency(neighbour, "a DNS flood", quiet),
    ):
        got = run_in(flood, DNS_FLOOD)
    print(f"\nDNS flood: {got}, log {max(w.sizes):,} bytes at most of {log_bound:,}")
    assert got.get("5", 0) > 0 and got.get("3", 0) > 0  # REFUSED past the rate; NXDOMAIN within it
    assert got.get("timeout", 0) <= sum(got.values()) // 20  # refused at once, not queued
    assert max(w.sizes) <= log_bound
    w.assert_flat()
    said = told(flood, "egress_log", since, "refused_dns")
    assert said["refused_dns"] > 0 and any("SANDLOT_DNS_RATE" in r for r in said["reasons"])
    folded = folded_lines(flood)
    assert any("lookups of *.example.com in the last 10 s" in f["summary"] for f in folded), folded[:3]
    assert counted(home, flood, "egress_log", "refused_dns", got["5"]) >= got["5"]


def test_a_connect_flood_hears_429_past_its_rate_and_its_log_stays_bounded(
    home: Path, flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    since = last_id(flood)
    with (
        Watched(egress_bytes(flood), {"egress server": helper_pid("sandlot.net.egress", home)}) as w,
        neighbour_latency(neighbour, "a CONNECT flood", quiet),
    ):
        got = run_in(flood, CONNECT_FLOOD)
    print(f"\nCONNECT flood: {got}, log {max(w.sizes):,} bytes at most")
    assert got.get("429", 0) > 0 and got.get("403", 0) > 0
    assert max(w.sizes) <= records.bounds().egress_log_bytes
    w.assert_flat()
    said = told(flood, "egress_log", since, "refused_connections")
    assert said["refused_connections"] > 0
    assert counted(home, flood, "egress_log", "refused_connections", got["429"]) >= got["429"]


def test_a_console_flood_keeps_the_newest_of_the_console_within_its_bound(
    home: Path, flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    since = last_id(flood)
    box_dir = Path(flood.inspect()["paths"]["dir"])

    def console() -> int:  # what the box's console takes on the host, whatever is in its directory
        files = [box_dir / "console.log", *(box_dir / "console").glob("*")]
        return sum(records.on_host(p) for p in files if p.is_file())

    bound = records.bounds().console_bytes
    with (
        Watched(console, {"keeper": helper_pid("sandlot.core.sampler", home)}) as w,
        neighbour_latency(neighbour, "a console flood", quiet),
    ):
        got = run_in(flood, CONSOLE_FLOOD, str(2 * bound))
    print(f"\nconsole flood: {got}, console {max(w.sizes):,} bytes at most of {bound:,}")
    # the guest wrote past where the keeper cuts, or (gVisor: a tmpfs of the bound's size)
    # was refused; the host never held more than the bound
    assert got["bytes"] > bound // 2 or got["errors"] > 0
    assert max(w.sizes) <= bound
    w.assert_flat()
    said = told(flood, "console", since, "dropped_bytes")
    assert said["dropped_bytes"] > 0 and "SANDLOT_CONSOLE_LOG_MIB" in said["reasons"][0]
    assert flood.exec("echo", "after").stdout == "after\n"  # the box goes on


def test_a_box_s_happenings_past_its_event_rate_fold_into_one_event(
    home: Path, flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    """Commands that run past their timeout, from four threads as fast as they can: each
    is an event of the box, within its rate; past it they are folded and told as one."""
    since = last_id(flood)
    rate = records.bounds().events
    with neighbour_latency(neighbour, "a flood of events", quiet):
        asked = commands_past_their_timeout(flood, FLOOD_S)
    time.sleep(1.5 / rate.per_s)  # a token back: the next event tells what was folded
    with contextlib.suppress(sandlot.ExecTimeout):
        flood.exec("sleep", "5", timeout=0.01)
    kinds = [e.kind for e in flood.events(after=since, follow=False)]
    written = kinds.count("command_timeout")
    print(f"\nevents flood: {asked + 1} timeouts, {written} events written")
    assert asked > written and written <= rate.burst + rate.per_s * (FLOOD_S + 5)
    said = told(flood, "events", since, "folded")
    assert said["folded"] + written == asked + 1
    assert counted(home, flood, "events", "folded", said["folded"]) >= said["folded"]


def test_a_watch_of_churning_files_sends_no_more_than_its_rate_and_says_overflow(
    home: Path, flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    flood.files.mkdir("/tmp/churn", parents=True)
    seen: list[str] = []
    done = threading.Event()
    rate = records.bounds().watch

    def read() -> None:
        with flood.files.watch("/tmp/churn") as w:
            ready.set()
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    e = w.next_event(0.5)
                    if e is None:
                        return
                    seen.append(e.type)

    ready = threading.Event()
    reader = threading.Thread(target=read, daemon=True)
    with (
        Watched(lambda: len(seen), {"this process": os.getpid()}) as w,
        neighbour_latency(neighbour, "a churn of watched files", quiet),
    ):
        reader.start()
        assert ready.wait(60)
        t0 = time.monotonic()
        got = run_in(flood, CHURN, "/tmp/churn")
        time.sleep(1)
        took = time.monotonic() - t0
        done.set()
        reader.join(30)
    print(f"\nwatch flood: {got['files']} files made and removed, {len(seen)} events, "
          f"{seen.count('overflow')} overflows")  # fmt: skip
    assert 3 * got["files"] > len(seen)  # created, modified, deleted: were they all sent
    assert len(seen) <= rate.burst + rate.per_s * took + 10
    assert "overflow" in seen
    w.assert_flat()
    assert counted(home, flood, "watch", "overflow", seen.count("overflow")) >= seen.count("overflow")


def test_a_cell_that_lifts_the_interpreters_own_limit_is_bounded_on_the_host(
    flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    """The interpreter in the box keeps its first 8 MiB of a cell's output; a cell runs in
    that very process and can lift it. The host keeps its own bound."""
    flood.run_code("1")
    code = (
        "import __main__, time\n__main__.OUTPUT_LIMIT = 1 << 40\n"
        f"end = time.time() + {FLOOD_S}\nn = 0\n"
        "while time.time() < end:\n    print('x' * 4095)\n    n += 1\nprint('lines', n)"
    )
    bound = records.bounds().code_output_bytes
    with (
        Watched(lambda: 0, {"this process": os.getpid()}) as w,
        neighbour_latency(neighbour, "a cell's output", quiet),
    ):
        ex = flood.run_code(code, timeout=FLOOD_S + 120)
    print(f"\ncell flood: kept {len(ex.stdout):,} bytes of stdout, stderr ends {ex.stderr[-200:]!r}")
    assert len(ex.stdout) <= bound and ex.stdout.startswith("x" * 4095)
    assert "dropped" in ex.stderr and "SANDLOT_CODE_OUTPUT_MIB" in ex.stderr
    assert int(ex.stderr.split("dropped ")[1].split(" bytes")[0].replace(",", "")) > 4 * bound
    w.assert_flat()
    assert flood.run_code("21 * 2").text == "42"  # the context goes on


def test_box_link_connections_are_held_to_the_box_s_open_connections(
    home: Path, flood: sandlot.Box, neighbour: sandlot.Box, quiet: float
) -> None:
    server = flood.spawn("python3", "-u", "-c", HOLDER)
    try:
        assert next(server.stdout.lines(), b"").strip() == b"listening"
        # the box link started before the clock
        first = "import socket; socket.create_connection(('flood.box.internal', 8000), 30)"
        flood.exec("python3", "-c", first, timeout=120).check()
        since = last_id(flood)
        # (a connection is taken by the forwarder or QEMU at once; the link starts behind it)
        deadline = time.monotonic() + 60
        while (link := helper_pid("sandlot.api.boxlink", home)) is None:
            assert time.monotonic() < deadline, "no box link runs"
            time.sleep(0.2)
        settled(link)  # its memory is measured from there: not its start's
        processes = {"box link": link, "egress server": helper_pid("sandlot.net.egress", home)}
        with (
            Watched(egress_bytes(flood), processes) as w,
            neighbour_latency(neighbour, "a flood of box link connections", quiet),
        ):
            got = run_in(flood, LINK_FLOOD)
        print(f"\nbox link flood: {got}")
        bounds = records.bounds()
        assert got["held_at_end"] <= bounds.connections_open
        assert got.get("closed", 0) > 0  # refused past the open connections, or the rate
        assert max(w.sizes) <= bounds.egress_log_bytes
        w.assert_flat()
        # refused past the open connections, or (a slow host) by the rate before they filled
        said = told(flood, "egress_log", since, ("refused_open", "refused_connections"))
        assert said.get("refused_open", 0) + said.get("refused_connections", 0) > 0
    finally:
        server.kill()


def test_a_guest_makes_no_audit_row_only_a_key_s_calls_do(home: Path, flood: sandlot.Box) -> None:
    """Through a real ``sandlot serve`` on the flooding box's home: a key's exec that floods
    DNS, the console and the disk is one audit row, however much the guest did."""
    with serving(home) as served, served.client() as c:
        before = c.get("/v1/audit", params={"box": flood.id}).json()["entries"]
        flooding = "\n".join(
            [DNS_FLOOD.replace("sys.argv[1]", "'2'"), CONSOLE_FLOOD.replace("sys.argv[1]", "'2'")]
        )
        r = c.post(f"/v1/boxes/{flood.id}/exec", json={"argv": ["python3", "-c", flooding], "timeout": 120},
                   timeout=180)  # fmt: skip
        assert r.status_code == 200, r.text
        time.sleep(2)  # what the keeper does after it is no key's call either
        after = c.get("/v1/audit", params={"box": flood.id}).json()["entries"]
        metrics = httpx.get(f"{served.url}/metrics", headers=served.headers(), timeout=30).text
    new = after[len(before) :] if len(after) >= len(before) else after
    assert [e["action"] for e in new] == ["POST /v1/boxes/{box}/exec"], new
    assert (
        f'sandlot_box_records_bounded_total{{box="{flood.id}",name="flood",record="egress_log",what="refused_dns"}}'
        in metrics
    )
