"""Leases of the boxes remote ``with`` blocks make (``core/leases.py``,
``server/leases.py``, ``api/lease_keeper.py``): the server's app in this process over
the fake engine, real HTTP clients in this process and in others. A client killed
with -9 inside its block loses its box once the lease lapses, and the audit trail
says why; a client blocked in a long call keeps its box; one namespace cannot keep
another's boxes alive. (tests/vm/test_server.py does the same against a real
``sandlot serve`` with real VMs, across a restart of the server.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import sandlot
from sandlot.api import access
from sandlot.api import leases as api_leases
from sandlot.core import leases
from sandlot.core.store import BoxStore
from sandlot.errors import BoxNotFound, InvalidArgument

from tests.support.fake_engine import fake_rootfs, register
from tests.support.inproc import serving

# a client in another process: makes a with block's box, says its id, then waits to be killed
CLIENT = """
import sys, time, sandlot
client = sandlot.connect(sys.argv[1], api_key=sys.argv[2])
with client.Box(rootfs=sys.argv[3], memory_mib=256, lease=10) as box:
    print(box.id, flush=True)
    time.sleep(600)
"""


def test_the_store_s_leases(tmp_path: Path) -> None:
    store = BoxStore(tmp_path / "sandlot.db")
    try:
        a = leases.grant(store, "b1", 30, namespace="ns-a")
        leases.grant(store, "b2", 10, namespace="ns-b")
        assert a.until - a.created_at == 30 and leases.of(store, "b1") == a
        assert [x.box_id for x in leases.renew(store, ["b1", "b2", "nope"], namespace="ns-a")] == ["b1"]
        assert leases.of(store, "b2").until < leases.of(store, "b1").until  # type: ignore[union-attr]
        assert leases.lapsed(store) == []
        assert [x.box_id for x in leases.lapsed(store, now=time.time() + 20)] == ["b2"]
        for bad in (5, 8 * 24 * 3600, float("nan"), True, "60"):
            with pytest.raises(InvalidArgument, match="lease"):
                leases.grant(store, "b3", bad)  # type: ignore[arg-type]
        store.delete("b1")  # a box's removal takes its lease with it
        assert leases.of(store, "b1") is None
        # a starting server gives every lease one whole length from now
        leases.put_row(store, {**leases.of(store, "b2").__dict__, "until": time.time() - 5})  # type: ignore[union-attr]
        assert leases.lapsed(store) != []
        assert leases.give_time(store) == 1 and leases.lapsed(store) == []
    finally:
        store.close()


def test_a_key_sets_the_length_of_its_boxes_leases(tmp_path: Path) -> None:
    key, _ = access.create_key("ci", lease=120, home=tmp_path)
    assert key.lease == 120 and access.list_keys(tmp_path)[0].lease == 120
    with pytest.raises(InvalidArgument, match="lease"):
        access.create_key("cd", lease=1, home=tmp_path)
    assert api_leases.grant("b1", 10, home=tmp_path).seconds == 10


def test_a_killed_client_loses_its_box_and_a_blocked_one_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    home = tmp_path / "home"
    root = str(fake_rootfs(tmp_path))
    with serving(home) as srv, sandlot.connect(srv.url, api_key=srv.api_key) as client:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
        other = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url, srv.api_key or "", root],
                                 stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        try:
            assert other.stdout is not None
            dead_box = other.stdout.readline().strip()
            assert client.get(dead_box).state == "running"
            other.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            with client.Box(rootfs=root, memory_mib=256, lease=10) as box:
                # a call that blocks this thread for longer than the lease: the renewals
                # come from a thread of their own
                time.sleep(13)
                assert box.exec("true").exit_code == 0
                with pytest.raises(BoxNotFound):  # by now the killed client's box is gone
                    deadline = killed_at + 20
                    while time.monotonic() < deadline:
                        client.get(dead_box)
                        time.sleep(0.5)
                kept_id = box.id
            with pytest.raises(BoxNotFound):  # the block's end removed its box, as always
                client.get(kept_id)
        finally:
            with contextlib.suppress(ProcessLookupError):
                other.kill()
            other.wait()
        lapsed = [e for e in access.audit_log(box=dead_box, home=home) if e.action == "lease lapsed"]
        assert len(lapsed) == 1 and lapsed[0].detail["reason"] == "lease lapsed", lapsed
        assert lapsed[0].key_name is not None  # the key that held it
        # the REST face: a lease asked for, renewed; another namespace cannot renew it
        theirs = srv.key("theirs", namespace="ns-b")
        h = {"Authorization": f"Bearer {srv.api_key}"}
        r = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": root, "lease": 30}, headers=h, timeout=60)
        assert r.status_code == 201 and r.json()["lease"]["seconds"] == 30, r.text
        bid = r.json()["id"]
        r = httpx.post(f"{srv.url}/v1/leases/renew", json={"boxes": [bid, "nope"]}, headers=h)
        assert set(r.json()["leases"]) == {bid}
        r = httpx.post(f"{srv.url}/v1/leases/renew", json={"boxes": [bid]},
                       headers={"Authorization": f"Bearer {theirs}"})  # fmt: skip
        assert r.json()["leases"] == {}
        r = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": root, "lease": 5}, headers=h, timeout=60)
        assert r.status_code == 400 and "lease" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": root}, headers=h, timeout=60)
        assert "lease" not in r.json()  # a box nobody leases is kept until removed
        with pytest.raises(InvalidArgument, match="unknown box option"):
            client.Box(rootfs=root, ephemeral=True)  # the with block's to say, not the caller's
