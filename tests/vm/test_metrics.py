"""Metrics on real boxes: the home's sampler process samples a running box (host and
guest figures, from the real agent), the history reads back with its rates, the
sampler goes once no box runs, and a real ``sandlot serve``'s ``/metrics`` parses with
Prometheus' own parser and shows a key only its namespace's boxes."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import sandlot
from sandlot.config import try_flock
from sandlot.core import metrics
from sandlot.core.metrics import metrics_lock

from tests.conftest import TEST_ENGINE
from tests.support.serve import create_key, serving, shared_home
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vm
NS = "sandlot.namespace"  # the label of a key's namespace


def sampler_running(home: Path) -> bool:
    fd = try_flock(metrics_lock(home))
    if fd is None:
        return True
    os.close(fd)
    return False


def test_a_running_box_is_sampled_from_host_and_guest(
    tmp_path: Path, busybox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_METRICS_EVERY", "1")
    monkeypatch.setenv("SANDLOT_METRICS_GUEST_EVERY", "1")
    home = shared_home(tmp_path)
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, engine=TEST_ENGINE, home=home) as box:
        wait_for("a first sample", lambda: box.metrics())
        for _ in range(5):
            box.exec("true")
        box.sh("dd if=/dev/zero of=/root/blob bs=1M count=8 2>/dev/null && sync")
        before = box.metrics()[-1]
        got = wait_for("a sample after them", lambda: [s for s in box.metrics() if s["at"] > before["at"]])
        now = got[-1]
        assert now["state"] == "running" and now["cpu_seconds"] > 0 and now["pss_bytes"] > 0
        assert now["rss_bytes"] >= now["pss_bytes"] // 2 and now["disk_bytes"] > 0
        # a VM's kernel has the box's memory; gVisor's reports its own figure for the sandbox
        most = 256 << 20 if TEST_ENGINE == "qemu" else 1 << 40
        assert 200 << 20 < now["guest_memory_total_bytes"] <= most
        assert 0 < now["guest_memory_used_bytes"] < now["guest_memory_total_bytes"]
        first = box.metrics()[0]
        assert now["execs"] >= first["execs"] + 6  # five trues and the sh
        if TEST_ENGINE == "qemu":  # a virtio disk the guest counts; gVisor has none
            assert now["disk_written_bytes"] >= first["disk_written_bytes"] + (8 << 20)
        history = box.metrics()
        assert [s["at"] for s in history] == sorted(s["at"] for s in history)
        assert all(s["cpu_percent"] is None or 0 <= s["cpu_percent"] <= 100 * 2 for s in history[1:])
        assert any(s["exec_start_ms"] for s in history[1:])  # commands started in between, with their time
    assert sampler_running(home)  # it goes IDLE_S after the last VM (tests/unit/test_metrics.py)
    assert (
        metrics.samples(sandlot.Runtime.for_home(home).store, box.id) == []
    )  # the removed box's went with it


def test_prometheus_metrics_parse_and_show_a_key_its_namespace(
    tmp_path: Path, busybox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_METRICS_EVERY", "1")
    monkeypatch.setenv("SANDLOT_METRICS_GUEST_EVERY", "1")
    home = shared_home(tmp_path)
    team = create_key(home, "team-a", "--namespace", "a")
    with serving(home) as served:
        admin = sandlot.connect(served.url, api_key=served.api_key)
        ours = admin.create(rootfs=str(busybox_root), name="theirs", memory_mib=256, labels={NS: "a"})
        other = admin.create(rootfs=str(busybox_root), name="others", memory_mib=256)
        try:
            ours.start()
            wait_for("a sample", lambda: ours.metrics())

            def scrape(key: str | None) -> dict[str, list]:
                r = httpx.get(f"{served.url}/metrics", headers=served.headers(key), timeout=30)
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
                return {f.name: f.samples for f in text_string_to_metric_families(r.text)}

            seen = scrape(team)
            cpu = seen["sandlot_box_cpu_seconds"]
            assert [(s.labels["name"], s.name) for s in cpu] == [("theirs", "sandlot_box_cpu_seconds_total")]
            assert cpu[0].value > 0 and seen["sandlot_box_guest_memory_total_bytes"][0].value > 200 << 20
            assert {s.labels["state"]: s.value for s in seen["sandlot_boxes"]} == {"running": 1}
            every = scrape(None)  # the admin key sees both boxes
            states = {s.labels["state"]: s.value for s in every["sandlot_boxes"]}
            assert states == {"running": 1, "created": 1}
            assert httpx.get(f"{served.url}/metrics", timeout=30).status_code == 401  # no key, no figures
        finally:
            ours.remove(force=True)
            other.remove(force=True)
