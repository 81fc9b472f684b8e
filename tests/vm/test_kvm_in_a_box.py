"""sandlot's KVM path, tested here although this host has no usable KVM: sandlot runs in a
box with nested virtualization (tests/support/kvmhost.py), where its accelerator probe
finds a working ``/dev/kvm``, and its boxes run with ``-accel kvm -cpu host``. Each
branch of the engine that only KVM takes runs there: the probe's "usable KVM", the
host CPU model, transparent huge pages left on, no translation cache in the host
cgroup's memory, the admission line's KVM width, device set 4 (no PIT) under KVM, and
live state saved and loaded by KVM (snapshot, rollback, fork, suspend, resume, export,
warm pools). A state exported there is refused by this TCG host, saying why.

The inner boxes are as slow as TCG ones, or slower: KVM inside a TCG box runs its
guest on QEMU's emulated SVM. These tests show what the KVM path does, not its speed
(``benchmarks/nested.py`` gives its figures beside TCG in the same box)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandlot

from tests.support.benchmarks import run_quick
from tests.support.kvmhost import BUSYBOX, KVM_GUEST, inner_cli, kvm_host, run_inner

# The inner run below has 1200 s (close to 7 min on a loaded 2-core host, each boot on the
# emulated KVM near a minute); pytest's own bound on the test that sets it up sits above it,
# so that a slow run ends with the inner deadline's reason and its output, not a bare timeout
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def host() -> Iterator[sandlot.Box]:
    with kvm_host() as box:
        yield box


def test_the_inner_sandlot_chooses_kvm_and_says_why(host: sandlot.Box) -> None:
    r = inner_cli(host, "doctor", "--json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["kvm_precheck"] == "ok"
    assert report["accel"]["name"] == "kvm"
    assert report["accel"]["reason"] == "KVM: /dev/kvm usable, CPU has vmx/svm, probe boot answered"
    assert "advice" not in report["accel"]  # aslr=False gains nothing on KVM
    assert report["auto"]["engine"] == "qemu" and "KVM" in report["auto"]["why"]
    # a box's own boxes could have it too: the emulated SVM is passed on by -cpu host
    assert report["nested_virt"]["available"] and "nested=1" in report["nested_virt"]["why"]


# One inner run, asserted on by the tests below: a cold boot (a template's), a warm
# pool's restore, and every live-state operation on the claimed box. Each boot on the
# emulated KVM costs close to a minute, which is why they share it.
LIFE = f"""
import json, time
from pathlib import Path
import sandlot
from sandlot.core.admission import default_slots

def out(**kw):
    print(json.dumps(kw), flush=True)

def timed(fn):
    t = time.monotonic()
    value = fn()
    return value, round(time.monotonic() - t, 2)

# a template's cold boot, with a process that every box from it has (and its limits), and a
# KVM of its own: under KVM, the CPU's vendor module and -cpu host's SVM (the host's nested=1)
tmpl, boot_s = timed(lambda: sandlot.template(rootfs={BUSYBOX!r}, memory_mib=256, pids_limit=32, name="kvm",
                                              nested_virt=True, setup=["sleep 1000 >/dev/null 2>&1 &"],
                                              template=False))
_, fill_s = timed(lambda: sandlot.set_pool(tmpl, 1, wait=True))
pooled = {{r.id for r in sandlot.Runtime.for_home().store.list() if r.options.get("pool") == tmpl.id}}
out(step="template", boot_s=boot_s, fill_s=fill_s, pooled=len(pooled))
with sandlot.Box(template=tmpl) as box:  # its pids_limit is the template's
    sleeper = box.exec("pidof", "sleep").stdout.strip()
    info = box.inspect()
    pid = info["vm_pid"]
    status = Path(f"/proc/{{pid}}/status").read_text().splitlines()
    out(step="claim", claimed=box.id in pooled, accel=box.accel, sleeper=bool(sleeper),
        argv=[a.decode() for a in Path(f"/proc/{{pid}}/cmdline").read_bytes().split(b"\\0")],
        thp=[line.split(":")[1].strip() for line in status if line.startswith("THP_enabled")],
        memory_max=Path(info["host_cgroup"]["paths"][0], "memory.max").read_text().strip(),
        slots=default_slots("kvm"))
    box.files.write("/root/kvm_guest", Path({KVM_GUEST!r}).read_bytes(), mode=0o755)
    own = box.exec("/root/kvm_guest", timeout=300)
    out(step="nested", stdout=own.stdout, stderr=own.stderr, exit_code=own.exit_code)
    box.files.write("/root/note", b"written on KVM")
    out(step="exec", stdout=box.exec("sh", "-c", "grep -c ^processor /proc/cpuinfo; cat /root/note").stdout)
    try:
        box.exec("sh", "-c", "bomb() {{ bomb | bomb & }}; bomb; sleep 100", timeout=6)
    except sandlot.ExecTimeout:
        pass
    out(step="limits", pids_max=box.sh("cat /sys/fs/cgroup/sandlot/pids.max").stdout.strip(),
        after=box.exec("echo", "fine").stdout)
    snap, snapshot_s = timed(lambda: box.snapshot("kvm"))
    box.files.write("/root/after", b"later")
    _, rollback_s = timed(lambda: box.rollback(snap))
    out(step="rollback", snapshot_s=snapshot_s, rollback_s=rollback_s,
        after_exists=box.exec("test", "-e", "/root/after").exit_code == 0,
        sleeper=box.exec("pidof", "sleep").stdout.strip() == sleeper)
    children, fork_s = timed(lambda: box.fork(2))
    for i, c in enumerate(children):
        c.files.write("/root/mine", str(i).encode())
    out(step="fork", fork_s=fork_s, hostnames=len({{c.exec("hostname").stdout for c in children}}),
        accel=[c.accel for c in children], own=[c.files.read("/root/mine").decode() for c in children],
        sleepers=[c.exec("pidof", "sleep").stdout.strip() == sleeper for c in children])
    for c in children:
        c.remove(force=True)
    _, suspend_s = timed(lambda: (box.suspend(), box.resume()))
    out(step="suspend", seconds=suspend_s, state=box.refresh(),
        sleeper=box.exec("pidof", "sleep").stdout.strip() == sleeper)
    out(step="export", path=str(snap.export("/root/kvm-state.tar.zst")))
sandlot.set_pool(tmpl, 0, wait=True)
"""


@pytest.fixture(scope="module")
def life(host: sandlot.Box) -> dict[str, dict[str, Any]]:
    return {s["step"]: s for s in run_inner(host, LIFE, timeout=1200)}


def test_boxes_run_on_kvm_with_its_branches_and_limits(life: dict[str, dict[str, Any]]) -> None:
    claim = life["claim"]
    assert life["template"]["pooled"] == 1 and claim["claimed"] and claim["accel"] == "kvm"
    assert claim["sleeper"]  # the template's process, in the box claimed from its pool
    argv = claim["argv"]
    assert argv[argv.index("-accel") + 1] == "kvm" and argv[argv.index("-cpu") + 1] == "host"
    assert "pit=off" in argv[argv.index("-M") + 1]  # device set 4 under KVM: no PIT
    assert claim["thp"] == ["1"]  # KVM keeps huge pages for the guest's page walks
    assert int(claim["memory_max"]) == (256 + 256) << 20  # guest RAM + 256 MiB: no TCG code cache
    assert claim["slots"] >= 4  # the admission line is wider under KVM
    assert life["exec"]["stdout"] == "1\nwritten on KVM"
    # nested virtualization under KVM: the box's own VM runs (its live state was saved with
    # its commands frozen, as below)
    assert life["nested"] == {"step": "nested", "stdout": "KVM\n", "stderr": "", "exit_code": 0}
    assert life["limits"] == {"step": "limits", "pids_max": "32", "after": "fine\n"}


def test_live_state_on_kvm(life: dict[str, dict[str, Any]]) -> None:
    assert life["rollback"]["after_exists"] is False and life["rollback"]["sleeper"] is True
    fork = life["fork"]
    assert fork["hostnames"] == 2 and fork["accel"] == ["kvm", "kvm"] and fork["own"] == ["0", "1"]
    assert fork["sleepers"] == [True, True]  # each child has the parent's processes
    assert life["suspend"]["state"] == "running" and life["suspend"]["sleeper"] is True


def test_a_state_saved_under_kvm_is_refused_here_saying_why(
    host: sandlot.Box, life: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    archive = tmp_path / "kvm-state.tar.zst"
    archive.write_bytes(host.files.read(life["export"]["path"]))
    with pytest.raises(sandlot.IncompatibleSnapshot, match="saved under kvm; this host runs boxes under tcg"):
        sandlot.import_snapshot(archive, start=False)


REFUSED = f"""
import json
import sandlot
try:
    sandlot.Box(rootfs={BUSYBOX!r}, memory_mib=256, nested_virt=True, name="never").start()
except sandlot.Unsupported as exc:
    print(json.dumps({{"refused": str(exc), "boxes": [b.name for b in sandlot.list(all=True)]}}))
"""


def test_a_kvm_host_without_nested_support_refuses_nested_boxes_naming_the_setting(host: sandlot.Box) -> None:
    """The host setting, as a host without nested support has it: the box's kvm_amd
    (or kvm_intel) module's ``nested`` parameter reads N (a file bound over it; the module itself is
    untouched). The inner sandlot runs its boxes on KVM, and refuses one that asks for
    nested virtualization before anything is made."""
    vendor = host.exec("sh", "-c", "cd /sys/module && ls -d kvm_amd kvm_intel 2>/dev/null").stdout.split()
    assert len(vendor) == 1, vendor  # the CPU vendor's module, loaded at the box's boot
    module = vendor[0]
    param = f"/sys/module/{module}/parameters/nested"
    host.exec("sh", "-c", f"echo N > /tmp/nested-off && mount --bind /tmp/nested-off {param}", check=True)
    try:
        [outcome] = run_inner(host, REFUSED)
        report = json.loads(inner_cli(host, "doctor", "--json").stdout)
    finally:
        host.exec("umount", param, check=True)
    assert f"{module} module runs with nested=N" in outcome["refused"]
    assert f"options {module} nested=1" in outcome["refused"] and "accel='tcg'" in outcome["refused"]
    assert outcome["boxes"] == []  # refused before the box was made
    assert report["accel"]["name"] == "kvm" and report["nested_virt"]["available"] is False


def test_the_nested_benchmark_quick_mode_runs_in_this_box(host: sandlot.Box) -> None:
    """benchmarks/nested.py, in its quick mode, in the tier's box (so CI boots one, not two)."""
    doc = run_quick("nested", "--box", host.id)
    assert doc["outer_box_given"] is True
    assert doc["inner"]["accel"]["name"] == "kvm" and doc["kvm_in_box"]["accel"] == "kvm"
    assert doc["tcg_on_host"]["accel"] == "tcg"
    assert all(ratio > 0 for ratio in doc["ratio_kvm_in_box_over_tcg_on_host"].values())
