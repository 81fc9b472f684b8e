"""Metrics (``core.metrics``): samples of running boxes kept in the store, bounded, with
their rates; and OpenTelemetry spans of operations. On the fake engine; real VMs, the
sampler process and Prometheus' parser are in ``tests/vm/test_metrics.py``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.core import metrics, sampler
from sandlot.core.runtime import Runtime
from sandlot.core.service import core_for

from tests.support.fake_engine import register

register()
REPO = Path(__file__).resolve().parents[2]


def test_rates_turn_counters_into_per_second_figures_and_say_none_where_they_cannot() -> None:
    samples = [
        {"at": 100.0, "cpu_seconds": 1.0, "net_rx_bytes": 0, "execs": 10, "exec_start_us": 5000},
        {"at": 110.0, "cpu_seconds": 3.0, "net_rx_bytes": 10_000, "execs": 30, "exec_start_us": 45_000},
        {"at": 120.0, "cpu_seconds": 0.5, "net_rx_bytes": None, "execs": 2, "exec_start_us": 100},
    ]  # the third: the box was started again
    first, second, third = metrics.rates(samples)
    assert first["cpu_percent"] is None and first["execs_per_s"] is None
    assert second["cpu_percent"] == 20.0 and second["net_rx_Bps"] == 1000
    assert second["execs_per_s"] == 2.0 and second["exec_start_ms"] == 2.0  # 40 ms over 20 commands
    assert third["cpu_percent"] is None and third["net_rx_Bps"] is None and third["execs_per_s"] is None
    assert [s["at"] for s in (first, second, third)] == [100.0, 110.0, 120.0]
    # the host's figures every sample, the guest's every few: a guest rate spans from the
    # last sample that had the figure
    host_only = {"at": 105.0, "cpu_seconds": 2.0, "net_rx_bytes": None, "execs": None, "exec_start_us": None}
    _, b, c = metrics.rates([samples[0], host_only, samples[1]])
    assert b["cpu_percent"] == 20.0 and b["net_rx_Bps"] is None and b["execs_per_s"] is None
    assert c["cpu_percent"] == 20.0 and c["net_rx_Bps"] == 1000 and c["execs_per_s"] == 2.0


def test_the_guest_is_asked_every_guest_interval_and_the_host_every_round(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer from the agent costs the box CPU (benchmarks/events.py), the host's
    figures do not: each round samples the host, every minute the guest too."""
    monkeypatch.setenv("SANDLOT_METRICS_GUEST_EVERY", "60")
    asks: list[bool] = []
    real = sampler.sample_box

    async def spied(core: Any, rec: Any, ask_guest: bool = True) -> dict[str, Any]:
        asks.append(ask_guest)
        return await real(core, rec, ask_guest)

    monkeypatch.setattr(sampler, "sample_box", spied)

    async def main() -> int:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256,
                               keep=True)  # fmt: skip
        await box.start()
        core = core_for(Runtime.for_home(home))
        asked: dict[str, float] = {}
        for _ in range(3):
            await sampler.sample_home(core, asked)
        asked[box.id] -= 61  # a minute on
        await sampler.sample_home(core, asked)
        await sampler.sample_home(core, asked)
        samples = len(await box.metrics())
        await box.remove(force=True)
        await sampler.sample_home(core, asked)
        assert asked == {}  # a removed box is forgotten
        return samples

    assert asyncio.run(main()) == 5
    assert asks == [True, False, False, True, False]


def test_samples_are_kept_bounded_read_with_rates_and_go_with_their_box(home: Path, root: Path) -> None:
    async def main() -> None:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256,
                               keep=True)  # fmt: skip
        await box.start()
        core = core_for(Runtime.for_home(home))
        for _ in range(3):
            assert await sampler.sample_home(core) == 1
            await box.exec("true")
        got = await box.metrics()
        assert len(got) == 3 and [s["state"] for s in got] == ["running"] * 3
        assert got[0]["at"] < got[1]["at"] < got[2]["at"] and "cpu_percent" in got[1]
        assert len(await box.metrics(limit=2)) == 2 and (await box.metrics(limit=2))[-1] == got[-1]
        assert await box.metrics(since=time.time() + 60) == []
        with pytest.raises(sandlot.InvalidArgument):
            await box.metrics(limit=0)
        # past the kept time, the next round's write drops the old ones
        await core.db.call(metrics.add_samples, [(box.id, {"at": time.time()})], 0.5)
        await asyncio.sleep(0.6)
        await core.db.call(metrics.add_samples, [(box.id, {"at": time.time()})], 0.5)
        assert len(await box.metrics()) == 1
        await box.stop()
        before = len(await core.db.call(metrics.samples, box.id))
        assert await sampler.sample_home(core) == 0  # a stopped box is not sampled
        assert len(await core.db.call(metrics.samples, box.id)) == before
        await box.remove()
        assert await core.db.call(metrics.samples, box.id) == []

    asyncio.run(main())


def test_spans_of_operations_go_to_the_applications_tracer(home: Path, root: Path) -> None:
    """Where opentelemetry is installed, create, start, exec, snapshot, fork and stop are
    spans of the provider the application set up (in a process of its own here: a
    provider is set once per process)."""
    script = textwrap.dedent(f"""
        import asyncio, json
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        import sandlot
        from tests.support.fake_engine import register
        register()
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)

        async def main():
            box = sandlot.AsyncBox(rootfs={str(root)!r}, engine="fake", home={str(home)!r}, template=False,
                                   memory_mib=256, keep=True, name="traced")
            await box.start()
            await box.exec("true")
            await box.snapshot("s")
            kids = await box.fork(1)
            await box.stop()
            for b in [box, *kids]:
                await b.remove(force=True)

        asyncio.run(main())
        print(json.dumps([(s.name, dict(s.attributes)) for s in exporter.get_finished_spans()]))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    spans: list[tuple[str, dict[str, Any]]] = json.loads(out.stdout.splitlines()[-1])
    names = [n for n, _ in spans]
    for name in ("sandlot.create", "sandlot.start", "sandlot.exec", "sandlot.snapshot", "sandlot.fork",
                 "sandlot.stop", "sandlot.remove"):  # fmt: skip
        assert name in names, names
    start = next(attrs for n, attrs in spans if n == "sandlot.start")  # the box's (then its child's)
    assert start["sandlot.name"] == "traced" and len(start["sandlot.box"]) == 12
    assert dict(spans)["sandlot.exec"]["sandlot.command"] == "true"
    assert dict(spans)["sandlot.fork"]["sandlot.n"] == 1


def test_the_sampler_goes_once_no_vm_of_its_home_runs(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_METRICS_EVERY", "0.1")
    monkeypatch.setattr(sampler, "IDLE_S", 0.5)

    async def main() -> float:
        box = sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256,
                               keep=True)  # fmt: skip
        await box.start()
        running = asyncio.ensure_future(sampler.run(home))
        deadline = time.monotonic() + 30
        while len(await box.metrics()) < 2:  # sampling while the box runs
            assert not running.done() and time.monotonic() < deadline, "the sampler took no two samples"
            await asyncio.sleep(0.1)
        assert not running.done()
        await box.remove(force=True)
        t0 = time.monotonic()
        await asyncio.wait_for(running, 10)
        return time.monotonic() - t0

    # it goes within its idle time and a few looks; a loaded host (three workers of the
    # unit tier on two cores) stretches those, a sampler that stays would not end at all
    assert asyncio.run(main()) < 8
