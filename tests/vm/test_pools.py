"""Warm pools on real VMs: claims re-identify the guest, the pool refills and drains,
exhaustion falls back to a plain restore, processes claiming at once never share a VM,
and kill -9 at each crash point of a claim and of a fill leaves no VM shared and none
orphaned (the next caller reconciles). Pools of 1-3 VMs of a 256 MiB busybox template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot import pids
from sandlot.core.pools import PoolInfo
from sandlot.core.store import BoxRecord

from tests.conftest import TEST_ENGINE
from tests.support.clock import set_while_read
from tests.support.names import unique
from tests.support.serve import serving
from tests.support.waiting import deadline_in, wait_for

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(TEST_ENGINE != "qemu", reason="warm pools are tested on QEMU (gVisor: not yet)"),
]
CRASHY, POOL_A, POOL_B = unique("crashy"), unique("pool-a"), unique("pool-b")

FACTS = "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s"


@pytest.fixture(scope="module")
def tmpl(busybox_root: Path) -> Iterator[sandlot.Snapshot]:
    t = sandlot.template(rootfs=busybox_root, memory_mib=256, name=f"pooltest-{os.getpid()}")
    try:
        yield t
    finally:
        cleanup(t)


def cleanup(t: sandlot.Snapshot) -> None:
    for b in sandlot.list():
        if b.info["origin"] == t.id:
            b.remove(force=True)
    if any(s.id == t.id for s in sandlot.list_snapshots()):
        sandlot.set_pool(t, 0, wait=True)
        t.remove()


@pytest.fixture(autouse=True)
def drained(tmpl: sandlot.Snapshot, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SANDLOT_POOL_REFILL", "0")  # a test that wants the refiller says so
    yield
    if any(s.id == tmpl.id for s in sandlot.list_snapshots()):
        sandlot.set_pool(tmpl, 0, wait=True)
    for b in sandlot.list():
        if b.info["origin"] == tmpl.id:
            b.remove(force=True)


def pool_rows(t: sandlot.Snapshot) -> list[BoxRecord]:
    """The pool's rows as stored, without recovering them (what a crash left)."""
    store = sandlot.Runtime.for_home().store
    return [r for r in store.list() if r.options.get("pool") == t.id]


def vm_alive(rec: BoxRecord) -> bool:
    return pids.alive(rec.vm_pid, rec.vm_start)


def the_pool(t: sandlot.Snapshot) -> PoolInfo:
    [p] = [p for p in sandlot.pools() if p.template_id == t.id]
    return p


def py(
    code: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandlot.cli", *args], capture_output=True, text=True,
                          timeout=180)  # fmt: skip


def test_exhaustion_falls_back_to_a_plain_restore(tmpl: sandlot.Snapshot) -> None:
    r = cli("pool", "set", tmpl.id, "1", "--wait")  # the command line's face of set_pool
    assert r.returncode == 0 and "ready 1" in r.stdout, r.stderr
    r = cli("pool", "ls", "--json")
    [listed] = [p for p in json.loads(r.stdout) if p["template_id"] == tmpl.id]
    assert (listed["size"], listed["ready"], listed["nominal_mib"]) == (1, 1, 256) and listed["pss_mib"] > 0
    r = cli("pool", "set", tmpl.id, "64")  # 64 VMs of 256 MiB: past the memory cap, refused
    assert r.returncode == 125 and "over the cap" in r.stderr, r.stderr
    [pooled] = pool_rows(tmpl)
    with sandlot.Box(template=tmpl) as first, sandlot.Box(template=tmpl) as second:
        assert first.id == pooled.id
        assert second.id != pooled.id and second.info["origin"] == tmpl.id  # restored afresh
        assert second.exec("echo", "ok").stdout == "ok\n" and first.exec("echo", "ok").stdout == "ok\n"
    assert the_pool(tmpl).ready == 0  # (no refiller in this test)


def test_two_processes_claiming_at_once_never_get_the_same_vm(tmpl: sandlot.Snapshot, tmp_path: Path) -> None:
    sandlot.set_pool(tmpl, 2, wait=True)
    pooled = {r.id for r in pool_rows(tmpl)}
    go = tmp_path / "go"
    code = f"""
        import os, sys, time, sandlot
        open(os.path.join({str(tmp_path)!r}, "ready-" + sys.argv[1]), "w").close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.005)
        b = sandlot.Box(template={tmpl.id!r}, keep=True)
        b.start()
        print(b.id, b.inspect()["vm_pid"], b.exec("cat", "/etc/machine-id").stdout.strip())
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(i)], stdout=subprocess.PIPE, text=True
        )
        for i in range(3)
    ]
    wait_for(
        "all three waiting at the start line",
        lambda: len(list(tmp_path.glob("ready-*"))) == 3,
        120,
        every=0.05,
    )
    go.touch()
    outs = [p.communicate(timeout=180)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ids, vm_pids, machine_ids = zip(*outs, strict=True)
    assert len(set(ids)) == 3 and len(set(vm_pids)) == 3 and len(set(machine_ids)) == 3
    assert len(set(ids) & pooled) == 2  # both pool VMs were claimed, each by one process
    assert pool_rows(tmpl) == []


@pytest.mark.parametrize("point", ["pool.claim-after-row", "pool.claim-after-resume"])
def test_kill9_mid_claim_leaves_nothing_shared_or_orphaned(tmpl: sandlot.Snapshot, point: str) -> None:
    sandlot.set_pool(tmpl, 2, wait=True)
    before = pool_rows(tmpl)
    r = py(f"import sandlot; sandlot.Box(template={tmpl.id!r}, name={CRASHY!r}, keep=True).start()",
           env={"SANDLOT_CRASH_AT": point})  # fmt: skip
    assert r.returncode == -9, r.stderr
    [claimed] = [x for x in pool_rows(tmpl) if x.state == "claiming"]
    assert claimed.name == CRASHY and vm_alive(claimed)
    # the next caller reconciles: the half-claimed VM goes, no box has it
    assert CRASHY not in {b.name for b in sandlot.list()}
    assert not vm_alive(claimed)
    [left] = pool_rows(tmpl)
    assert left.state == "pooled" and left.id in {x.id for x in before} and left.id != claimed.id
    with sandlot.Box(template=tmpl, name=CRASHY) as box:  # the name is free; the other VM serves
        assert box.id == left.id and box.exec("hostname").stdout == f"{CRASHY}\n"


def test_kill9_mid_fill_leaves_no_orphan(tmpl: sandlot.Snapshot) -> None:
    r = py(f"import sandlot; sandlot.set_pool({tmpl.id!r}, 1, wait=True)",
           env={"SANDLOT_CRASH_AT": "pool.fill-after-start", "SANDLOT_POOL_REFILL": "0"})  # fmt: skip
    assert r.returncode == -9, r.stderr
    [half] = pool_rows(tmpl)
    assert half.state == "running" and vm_alive(half)
    p = the_pool(tmpl)  # the next caller reconciles
    assert (p.size, p.ready, p.filling) == (1, 0, 0) and pool_rows(tmpl) == [] and not vm_alive(half)
    assert sandlot.set_pool(tmpl, 1, wait=True).ready == 1  # and filling works again


def test_sandlot_serve_claims_from_the_pool_and_tops_it_up(tmpl: sandlot.Snapshot) -> None:
    """A box created through the server from a template is a pool VM, and the server's
    own loop refills the pool (the detached refiller is off: SANDLOT_POOL_REFILL=0 is in
    the environment the server inherits)."""
    sandlot.set_pool(tmpl, 1, wait=True)
    [pooled] = pool_rows(tmpl)
    home = Path(os.environ["SANDLOT_HOME"])
    with serving(home) as served, served.client() as c:
        r = c.post("/v1/boxes", json={"template": tmpl.id, "name": f"served-{os.getpid()}"})
        assert r.status_code == 201, r.text
        box = r.json()
        assert box["id"] == pooled.id  # the ready VM, claimed
        run = c.post(f"/v1/boxes/{box['id']}/exec", json={"argv": ["hostname"]})
        assert run.status_code == 200 and run.json()["stdout"] == f"served-{os.getpid()}\n"
        deadline = deadline_in(120)
        while the_pool(tmpl).ready < 1:
            assert time.monotonic() < deadline, f"sandlot serve did not top the pool up: {the_pool(tmpl)}"
            time.sleep(1)
        [refilled] = pool_rows(tmpl)
        assert refilled.id != box["id"]
        assert c.delete(f"/v1/boxes/{box['id']}", params={"force": "true"}).status_code in (200, 204)


def test_claims_are_reidentified_and_the_pool_refills_drains_and_goes_with_its_template(
    tmpl: sandlot.Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Last: it removes the module's template.)"""
    t = tmpl
    try:
        info = sandlot.set_pool(t, 2, wait=True)
        assert (info.size, info.ready) == (2, 2) and info.pss_bytes > 0
        ready = pool_rows(t)
        assert [r.state for r in ready] == ["pooled", "pooled"] and all(map(vm_alive, ready))
        assert not [b for b in sandlot.list() if b.info["origin"] == t.id]  # no boxes, yet
        time.sleep(2)  # the clock of a paused VM stands still: the claim's HELLO sets it
        monkeypatch.setenv("SANDLOT_POOL_REFILL", "1")
        a = sandlot.Box(template=t.name, name=POOL_A, env={"CLAIMED": "a"}, keep=True)
        a.start()
        b = sandlot.Box(template=t, name=POOL_B, env={"CLAIMED": "b"}, keep=True)
        b.start()
        assert {a.id, b.id} == {r.id for r in ready}  # both were pool VMs
        asked = time.time()
        fa, fb = (x.sh(FACTS).stdout.split() for x in (a, b))
        answered = time.time()
        assert (fa[0], fb[0]) == (POOL_A, POOL_B)  # hostnames
        assert fa[1] != fb[1] and len(fa[1]) == 32  # machine-ids
        assert fa[2] != fb[2]  # the RNG was reseeded in each
        # the wall clock was set (left where it was paused, it would be 2 s behind)
        assert all(set_while_read(f[3], asked, answered) for f in (fa, fb)), (asked, fa[3], fb[3], answered)
        assert a.sh("echo $CLAIMED").stdout == "a\n" and b.sh("echo $CLAIMED").stdout == "b\n"
        assert a.inspect()["machine_id"] == fa[1]
        # the refiller (a detached process the claims started) brings the pool back to 2
        deadline = deadline_in(240)
        while the_pool(t).ready < 2:
            assert time.monotonic() < deadline, f"the pool did not refill: {the_pool(t)}"
            time.sleep(1)
        refilled = pool_rows(t)
        assert len(refilled) == 2 and not {r.id for r in refilled} & {a.id, b.id}
        drained = sandlot.set_pool(t, 0, wait=True)
        assert (drained.size, drained.ready) == (0, 0) and pool_rows(t) == []
        assert not [r for r in refilled if vm_alive(r)]  # their VMs are gone
        assert a.sh("echo still").stdout == "still\n"  # and the claimed boxes are not
        sandlot.set_pool(t, 1, wait=True)
        [last] = pool_rows(t)
        a.remove(force=True)
        b.remove(force=True)
        t.remove()  # removing the template removes its pool
        assert pool_rows(t) == [] and not vm_alive(last)
        assert not [p for p in sandlot.pools() if p.template_id == t.id]
    finally:
        cleanup(t)
