"""Bounds on what a guest can make the host write (``sandlot.records``, ``net.ledger``,
``core.keeper``, the store's event budget): each piece on its own, with no VM. The
floods on real VMs, both engines, are ``tests/security/test_floods.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot import records
from sandlot.core import keeper as core_keeper
from sandlot.core import store as core_store
from sandlot.core.events import draft
from sandlot.core.keeper import Keeper
from sandlot.core.runtime import Runtime
from sandlot.core.service import core_for
from sandlot.net import dns, ledger, proxy
from sandlot.net.policy import Policy, write_policy

from tests.support.fake_engine import register

register()


def limits(**kw: Any) -> ledger.Limits:
    base = ledger.Limits(records.Rate(0, 1), records.Rate(0, 1), 64, 8 << 20)
    return dataclasses.replace(base, **kw)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- the settings


def test_every_setting_has_a_default_and_a_bad_one_is_an_error_naming_it() -> None:
    b = records.bounds({})
    assert b.egress_log_bytes == 8 << 20 and b.dns == records.Rate(100, 400) and b.events_keep == 100_000
    assert records.bounds({"SANDLOT_DNS_RATE": "10"}).dns == records.Rate(10, 40)  # burst: 4 x the rate
    assert records.bounds({"SANDLOT_DNS_RATE": "0"}).dns.limited is False
    assert records.bounds({"SANDLOT_EGRESS_LOG_MIB": "0.5"}).egress_log_bytes == 1 << 19
    for name, value in [("SANDLOT_DNS_RATE", "fast"), ("SANDLOT_CONNECTION_RATE", "5,0"),
                        ("SANDLOT_EGRESS_LOG_MIB", "-1"), ("SANDLOT_EVENTS_PER_BOX", "nan"),
                        ("SANDLOT_WATCH_RATE", "1,2,3")]:  # fmt: skip
        with pytest.raises(sandlot.HostSetupError, match=name):
            records.bounds({name: value})
    spec = b.helper_spec()
    parsed = ledger.Limits.parse(spec)
    assert parsed == ledger.Limits(b.dns, b.connections, b.connections_open, b.egress_log_bytes)
    with pytest.raises(ValueError):
        ledger.Limits.parse("dns=1;bogus=2")


def test_a_bucket_gives_its_burst_at_once_then_its_rate() -> None:
    rate = records.Rate(10, 5)
    b = records.Bucket.full(rate, 0.0)
    assert [b.take(rate, 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert b.take(rate, 0.1) and not b.take(rate, 0.1)  # 0.1 s: one more
    assert not b.take(rate, 0.05)  # a clock set back refills nothing
    assert records.Bucket(0, 0).take(records.Rate(0, 1), 0)  # no limit


def test_names_fold_under_their_last_two_labels() -> None:
    assert records.fold_key("a1.b2.flood.example.com") == "*.example.com"
    assert records.fold_key("example.com") == "example.com"
    assert records.fold_key("10.0.0.1") == "10.0.0.1" and records.fold_key(None) == "-"
    said = records.fold_summary("DNS", "denied", 3817, "*.example.com", 10)
    assert said == "refused 3,817 lookups of *.example.com in the last 10 s"
    assert (
        records.fold_summary("CONNECT", "allowed", 2, "*", 10)
        == "allowed 2 CONNECTs to other names in the last 10 s"
    )


# -- a box's egress ledger


def test_decisions_past_the_line_budget_fold_into_one_counted_line_per_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    log = tmp_path / "egress.log"
    led = ledger.Ledger(log, limits(lines=3), clock=lambda: clock[0])
    for i in range(50):
        led.record({"method": "DNS", "decision": "denied", "host": f"q{i}.flood.example.com", "reason": "no"})
    led.record({"method": "CONNECT", "decision": "denied", "host": "other.org"})
    assert len(lines(log)) == 3  # the budget's lines; the rest wait for the window's end
    clock[0] += records.FOLD_WINDOW + 1
    led.flush()
    folded = [e for e in lines(log) if "folded" in e]
    assert {(e["host"], e["folded"]) for e in folded} == {("*.example.com", 47), ("other.org", 1)}
    dns_line = next(e for e in folded if e["method"] == "DNS")
    assert dns_line["summary"] == "refused 47 lookups of *.example.com in the last 10 s"
    assert dns_line["reason"] == "no" and dns_line["since"] == 1000.0
    t = led.totals()
    assert t.folded == 48 and t.lines == 5
    led.record({"method": "DNS", "decision": "allowed", "host": "pypi.org"})  # a new window: verbatim
    assert lines(log)[-1]["host"] == "pypi.org"


def test_a_flood_of_distinct_names_folds_into_a_bounded_number_of_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "egress.log"
    clock = [1000.0]
    led = ledger.Ledger(log, limits(lines=0), clock=lambda: clock[0])
    for i in range(500):
        led.record({"method": "DNS", "decision": "denied", "host": f"x.name{i}.org"})
    clock[0] += 60
    led.flush()
    folded = lines(log)
    assert len(folded) == records.FOLD_KEYS + 1  # one a name, then "other names"
    assert sum(e["folded"] for e in folded) == 500 and folded[0]["host"] == "*"


def test_the_egress_log_rotates_and_the_two_files_stay_under_the_bound(tmp_path: Path) -> None:
    log = tmp_path / "egress.log"
    led = ledger.Ledger(log, limits(log_bytes=64 << 10))
    entry = {"method": "CONNECT", "decision": "denied", "host": "example.com", "reason": "x" * 100}
    for _ in range(3000):  # each line written: the window's budget is not reached in one call each
        led._write(ledger._State(log_bytes=64 << 10), [entry])
    on_disk = log.stat().st_size + ledger.rotated(log).stat().st_size
    assert on_disk <= 64 << 10


def test_rotations_drop_the_oldest_lines_and_count_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "egress.log"
    led = ledger.Ledger(log, limits(log_bytes=16 << 10, lines=10**9))
    for i in range(1000):
        led.record({"method": "DNS", "decision": "denied", "host": f"n{i}.example.com"})
    t = led.totals()
    kept = len(lines(log)) + len(lines(ledger.rotated(log)))
    assert t.rotations >= 2 and t.dropped == 1000 - kept and t.lines == 1000
    assert lines(log)[-1]["host"] == "n999.example.com"  # the newest are kept
    assert log.stat().st_size + ledger.rotated(log).stat().st_size <= 16 << 10


def test_past_its_rate_a_box_is_refused_and_the_refusals_are_counted(tmp_path: Path) -> None:
    led = ledger.Ledger(
        tmp_path / "egress.log", limits(dns=records.Rate(1, 20), connections=records.Rate(1, 5))
    )
    assert sum(led.admit("dns") for _ in range(30)) in (20, 21)
    assert sum(led.admit("conn") for _ in range(10)) in (5, 6)
    t = led.totals()
    assert t.refused_dns >= 9 and t.refused_connections >= 4


def test_the_open_connections_of_a_box_are_bounded_and_given_back_however_they_end(tmp_path: Path) -> None:
    led = ledger.Ledger(tmp_path / "egress.log", limits(open=2))
    with led.slot() as a, led.slot() as b:
        assert a and b
        with led.slot() as c:
            assert not c
    with led.slot() as d:
        assert d
    # a process that holds a place and is killed gives it back
    held = subprocess.Popen([sys.executable, "-c", textwrap_slots(tmp_path)], stdout=subprocess.PIPE)
    assert held.stdout is not None and held.stdout.readline() == b"held\n"
    with led.slot() as e, led.slot() as f:
        assert e and not f
    held.kill()
    held.wait()
    with led.slot() as g, led.slot() as h:
        assert g and h
    assert led.totals().refused_open == 2


PRELUDE = (
    "import sys, time\nfrom pathlib import Path\n"
    "from sandlot import records\nfrom sandlot.net import ledger\n"
)


def ledger_in_python(tmp_path: Path, places: int, log_bytes: int) -> str:
    """A script's lines that make ``led``, the ledger of ``tmp_path``'s log, in another process."""
    log = str(tmp_path / "egress.log")
    rates = "records.Rate(0, 1), records.Rate(0, 1)"
    return f"{PRELUDE}led = ledger.Ledger(Path({log!r}), ledger.Limits({rates}, {places}, {log_bytes}))\n"


def textwrap_slots(tmp_path: Path) -> str:
    return ledger_in_python(tmp_path, 2, 1 << 20) + (
        "with led.slot() as ok:\n    print('held' if ok else 'none', flush=True)\n    time.sleep(60)\n"
    )


def test_concurrent_writers_in_processes_keep_one_whole_log(tmp_path: Path) -> None:
    script = ledger_in_python(tmp_path, 8, 1 << 30) + (
        "for i in range(200):\n"
        "    led.record({'method': 'DNS', 'decision': 'allowed', 'host': f'{sys.argv[1]}-{i}'})\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)]) for n in range(3)]
    assert all(p.wait(60) == 0 for p in procs)
    led = ledger.Ledger(tmp_path / "egress.log", limits())
    written = lines(tmp_path / "egress.log")  # every line whole, whether verbatim or folded
    assert (
        sum(e.get("folded", 1) for e in written)
        + sum(f[0] for f in ledger._State.load((tmp_path / "egress.ledger").read_bytes()).folds.values())
        == 600
    )
    assert led.totals().lines == len(written)


# -- the helpers' refusals


def question(name: str) -> bytes:
    labels = b"".join(bytes([len(x)]) + x.encode() for x in name.split("."))
    msg = struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)
    return len(msg).to_bytes(2, "big") + msg


def test_a_dns_question_past_the_box_rate_is_refused_at_once(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    write_policy(policy, Policy(mode="allowlist"))
    spec = records.bounds({"SANDLOT_DNS_RATE": "0.001,3"}).helper_spec()
    answers = []
    for _ in range(5):  # a connection per question, as the agent's relay makes them
        ours, theirs = socket.socketpair()
        argv = ["dns", str(policy), str(tmp_path / "egress.log"), "--limits", spec]
        t = threading.Thread(target=dns.handle_connection, args=(theirs, argv))
        t.start()
        ours.sendall(question("a.flood.example.com"))
        ours.settimeout(10)
        reply = ours.recv(4096)
        answers.append(dns.RCODES[reply[2 + 3] & 15])
        ours.close()
        t.join(10)
    assert answers == ["NXDOMAIN"] * 3 + ["REFUSED"] * 2
    logged = lines(tmp_path / "egress.log")
    assert [e["decision"] for e in logged] == ["denied"] * 3 + ["refused"] * 2
    assert (
        "more than 0.001 questions a second" in logged[-1]["reason"]
        and logged[-1]["host"] == "a.flood.example.com"
    )


def test_a_proxy_connection_past_the_box_rate_hears_429_at_once(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    write_policy(policy, Policy(mode="allowlist"))
    spec = records.bounds({"SANDLOT_CONNECTION_RATE": "0.001,2"}).helper_spec()
    argv = ["proxy", str(policy), str(tmp_path / "egress.log"), "--limits", spec]
    heard = []
    for _ in range(3):
        ours, theirs = socket.socketpair()
        ours.sendall(b"CONNECT blocked.example.com:443 HTTP/1.1\r\n\r\n")
        t = threading.Thread(target=proxy.handle_connection, args=(theirs, argv))
        t.start()
        ours.settimeout(10)
        heard.append(ours.recv(4096).split(b"\r\n")[0])
        ours.close()
        t.join(10)
    assert heard == [b"HTTP/1.1 403 Forbidden"] * 2 + [b"HTTP/1.1 429 Too Many Requests"]
    last = lines(tmp_path / "egress.log")[-1]
    assert (
        last["decision"] == "refused"
        and last["host"] == "blocked.example.com"
        and last["method"] == "CONNECT"
    )


def test_old_helper_command_lines_still_parse() -> None:
    assert proxy.Args.parse(["p", "/pol", "/log", "--link", "/l"]) is not None
    assert dns.Args.parse(["d", "/pol", "/log", "--link", "/l"]) is not None
    assert dns.Args.parse(["d", "/pol", "/log", "--limits", "nonsense"]) is None


# -- logs cut in place


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_log_cut_in_place_keeps_its_newest_bytes_and_its_writer_appends_on(
    tmp_path: Path, where: str
) -> None:
    base = tmp_path if where == "disk" else Path("/dev/shm")
    path = base / f"sandlot-test-console-{os.getpid()}.log"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        os.write(fd, b"".join(f"{i:07d}\n".encode() for i in range(200_000)))  # 1.6 MB
        freed = records.keep_newest(path, 256 << 10)
        assert freed > 1_000_000 and records.on_host(path) < (256 << 10) + 8192
        os.write(fd, b"after\n")  # the writer's next line lands at the end
        os.close(fd)
        text = path.read_bytes().lstrip(b"\0").decode()
        assert text.endswith("0199999\nafter\n") and len(text) < (256 << 10) + 8192
        assert records.keep_newest(path, 256 << 10) == 0  # under the bound: nothing to do
    finally:
        path.unlink(missing_ok=True)


# -- the store: events per box


def running_box(home: Path, root: Path) -> str:
    """The id of a box started on the fake engine."""

    async def main() -> str:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, keep=True)
        await box.start()
        return box.id

    return asyncio.run(main())


def test_a_box_s_happenings_past_its_event_rate_fold_into_one_told_event(home: Path, root: Path) -> None:
    box_id = running_box(home, root)
    store = Runtime.for_home(home).store
    store.bounds = dataclasses.replace(store.bounds, events=records.Rate(0.001, 3))
    written = [store.add_event(draft("command_oom", "oom"), box_id) for _ in range(10)]
    assert written == [True] * 3 + [False] * 7
    assert store.flush_event_folds(older_than=60) == 0  # not yet: the fold is recent
    assert store.flush_event_folds(older_than=0) == 1
    told = [e for e in store.events(box=box_id) if e.kind == "records_dropped"]
    assert len(told) == 1 and told[0].detail["folded"] == 7 and told[0].detail["kinds"] == {"command_oom": 7}
    assert "folded 7 events of this box" in (told[0].reason or "") and told[0].by == "sandlot"
    assert store.records(box_id)[box_id]["events"]["counts"] == {"folded": 7}


def test_a_box_keeps_its_newest_events_and_says_it_dropped_the_others(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_store, "BOX_PRUNE_EVERY", 1)

    box_id = running_box(home, root)
    store = Runtime.for_home(home).store
    store.bounds = dataclasses.replace(store.bounds, events=records.Rate(0, 1), events_per_box=100)
    for i in range(150):
        store.add_event(draft("command_timeout", f"t{i}"), box_id)
    kept = store.events(box=box_id, limit=10_000)
    assert len(kept) <= 102 and kept[-1].kind == "records_dropped"
    assert kept[-2].reason == "t149"  # the newest are kept
    assert store.records(box_id)[box_id]["events"]["counts"]["dropped"] >= 48


# -- the home's keeper


def test_the_keeper_cuts_a_console_tells_the_box_and_counts_for_the_metrics(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_CONSOLE_LOG_MIB", "1")

    async def main() -> tuple[str, list[Any], dict[str, Any]]:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, keep=True)
        await box.start()
        rt = Runtime.for_home(home)
        console = rt.box_dir(box.id) / "console.log"
        with open(console, "ab") as f:
            f.write(b"x" * (3 << 20))
        log = rt.box_dir(box.id) / "egress.log"
        led = ledger.Ledger(log, limits(dns=records.Rate(0.001, 1)))
        led.admit("dns")
        led.admit("dns")  # refused
        keeper = Keeper(core_for(rt))
        assert await keeper.round() == 1
        assert records.on_host(console) <= 1 << 20
        await keeper.round()  # nothing new: nothing more told
        told = [e async for e in box.events(follow=False) if e.kind == "records_dropped"]
        return box.id, told, rt.store.records(box.id)[box.id]

    _, told, counts = asyncio.run(main())
    by = {e.detail["record"]: e for e in told}
    assert set(by) == {"console", "egress_log"}
    assert by["console"].detail["dropped_bytes"] >= 2 << 20
    assert "oldest" in (by["console"].reason or "") and "SANDLOT_CONSOLE_LOG_MIB" in (
        by["console"].reason or ""
    )
    assert by["egress_log"].detail == {"record": "egress_log", "refused_dns": 1}
    assert "refused 1 DNS questions" in (by["egress_log"].reason or "")
    assert counts["console"]["counts"]["dropped_bytes"] >= 2 << 20
    assert counts["egress_log"]["counts"]["refused_dns"] == 1


def test_a_refusal_counted_in_the_same_tick_as_the_keepers_flush_is_told(home: Path, root: Path) -> None:
    """The keeper flushes a box's ledger again only where it changed: a helper's write in
    the same tick of the file system's clock as the keeper's last flush leaves the file's
    time as it was, and is a change all the same (CI: a connection flood's refusals,
    counted just after a round, were never told)."""

    async def main() -> list[Any]:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, keep=True)
        await box.start()
        rt = Runtime.for_home(home)
        log = rt.box_dir(box.id) / "egress.log"
        led = ledger.Ledger(log, limits(connections=records.Rate(0.001, 1)))
        assert led.admit("conn")
        keeper = Keeper(core_for(rt))
        await keeper.round()  # flushed: nothing refused yet, nothing told
        state = log.with_suffix(".ledger")
        flushed = state.stat().st_mtime_ns
        assert not led.admit("conn")  # refused, and written...
        os.utime(state, ns=(flushed, flushed))  # ... within the flush's tick
        await keeper.round()
        return [e async for e in box.events(follow=False) if e.kind == "records_dropped"]

    told = asyncio.run(main())
    assert [e.detail for e in told] == [{"record": "egress_log", "refused_connections": 1}]


def test_counts_that_moved_within_the_tell_window_are_told_once_it_passes_though_nothing_moves_again(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box's record is told at most once every TELL_EVERY seconds; what moved within
    that window is told once it has passed, though the ledger stays as it was (CI: a
    connection flood right after a DNS flood was told never, its ledger quiet after it)."""
    monkeypatch.setattr(core_keeper, "TELL_EVERY", 0.3)

    async def main() -> list[Any]:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, keep=True)
        await box.start()
        rt = Runtime.for_home(home)
        rates = limits(dns=records.Rate(0.001, 1), connections=records.Rate(0.001, 1))
        led = ledger.Ledger(rt.box_dir(box.id) / "egress.log", rates)
        led.admit("dns")
        led.admit("dns")  # refused
        keeper = Keeper(core_for(rt))
        await keeper.round()  # told
        led.admit("conn")
        led.admit("conn")  # refused within the window: counted, not told yet
        await keeper.round()
        await asyncio.sleep(0.4)
        await keeper.round()  # the window passed; the ledger did not move since
        await keeper.round()  # told once
        return [e async for e in box.events(follow=False) if e.kind == "records_dropped"]

    told = [e.detail for e in asyncio.run(main())]
    assert told == [
        {"record": "egress_log", "refused_dns": 1},
        {"record": "egress_log", "refused_connections": 1},
    ]


# -- a cell's output, on the host


class FakeDuplex:
    """The relay to a context's interpreter, sending what a hostile one would."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.taken = 0

    async def read(self) -> bytes:
        await asyncio.sleep(0)
        if self.taken == len(self.chunks):
            await asyncio.sleep(3600)
        self.taken += 1
        return self.chunks[self.taken - 1]

    async def write(self, data: bytes) -> None:
        pass


def stream(text: str, rid: str = "c") -> bytes:
    return json.dumps({"ev": "stream", "id": rid, "name": "stdout", "text": text}).encode() + b"\n"


def test_the_host_keeps_a_bounded_part_of_a_cell_whatever_the_interpreter_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sandlot.api import code

    monkeypatch.setenv("SANDLOT_CODE_OUTPUT_MIB", "0.0625")  # 64 KiB
    line = "y" * 1000
    chunks = [stream(line) for _ in range(200)]  # 200 kB, past the guest's own limit lifted
    chunks.append(b"z" * (200 << 10))  # one message longer than the bound, in pieces
    chunks.append(b"z" * (200 << 10) + b"\n")
    chunks.append(
        json.dumps({"ev": "result", "id": "c", "data": {"text/plain": "42"}, "main": True}).encode() + b"\n"
    )
    chunks.append(json.dumps({"ev": "done", "id": "c", "count": 1}).encode() + b"\n")
    before = records.TALLY.snapshot().get(("interpreter", "dropped_bytes", "box1"), 0)

    async def main() -> tuple[Any, int]:
        duplex = FakeDuplex(chunks)
        link = code.KernelLink(duplex, "box1")  # type: ignore[arg-type]
        events = link.cell("c")
        await asyncio.sleep(0.05)
        held = duplex.taken  # nobody takes the cell's messages: the link stops reading
        seen: list[str] = []
        callbacks = code.Callbacks(seen.append, None, None, code.Budget("box1"))
        execution = code.Execution()
        assert await code._collect(events, execution, callbacks)
        return execution, held

    execution, held = asyncio.run(main())
    assert held <= code.CELL_QUEUE + 2
    assert len(execution.stdout) <= 64 << 10 and execution.stdout.startswith(line)
    assert execution.text == "42"  # a result that fits in what is left is kept
    assert "dropped" in execution.stderr and "SANDLOT_CODE_OUTPUT_MIB" in execution.stderr
    dropped = records.TALLY.snapshot()[("interpreter", "dropped_bytes", "box1")] - before
    assert dropped >= 200 * 1000 - (64 << 10) + (400 << 10)


def test_the_home_s_guest_logs_together_are_held_to_their_bound(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_GUEST_LOGS_MIB", "2")
    box_id = running_box(home, root)
    rt = Runtime.for_home(home)
    for name in (box_id, "gone1", "gone2"):  # a running box's, and what others left
        d = rt.box_dir(name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "egress.log").write_bytes(b"x" * (1 << 20))
        (d / "egress.log.1").write_bytes(b"y" * (1 << 20))
    (rt.box_dir(box_id) / "console.log").write_bytes(b"z" * (1 << 20))

    async def main() -> dict[str, dict[str, int]]:
        keeper = Keeper(core_for(rt))
        keeper._home([box_id])
        return keeper.take_counted(box_id)

    counted = asyncio.run(main())
    logs = [p for p in rt.boxes_dir.glob("*/*") if p.name.startswith(("egress.log", "console.log"))]
    assert sum(records.on_host(p) for p in logs) <= 2 << 20
    assert not any(p.name == "egress.log.1" for p in logs)  # the rotated ones went first
    assert counted["home_logs"]["dropped_bytes"] >= 1 << 20


def test_a_cell_whose_link_breaks_while_its_queue_is_full_hears_the_end() -> None:
    from sandlot.api import code

    chunks = [stream("x" * 10) for _ in range(code.CELL_QUEUE + 4)] + [b"not json\n"]

    async def main() -> bool:
        link = code.KernelLink(FakeDuplex(chunks), "box1")  # type: ignore[arg-type]
        events = link.cell("c")
        await asyncio.sleep(0.05)  # the queue fills; the link waits for room
        execution = code.Execution()
        return await asyncio.wait_for(code._collect(events, execution, code.Callbacks(None, None, None)), 10)

    assert asyncio.run(main()) is False  # the link closed: not a hang
