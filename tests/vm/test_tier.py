"""The storage tier with real VMs: a box suspended on one home, pushed to a real
S3-compatible server on 127.0.0.1 (moto's, tests/support/s3.py), pulled by a second
home on this machine and resumed there with the same id and name, its processes
running on from where they were and its files as they were; and a snapshot whose
chunks were evicted here, rolled back to from the bucket. The fake engine's tests of
the same paths (every fault among them) are tests/unit/test_tier.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.core.tier import home_id

from tests.support.s3 import CREDENTIALS, S3Server, s3_server

pytestmark = pytest.mark.vm

# written aside and renamed: a read never falls between the file's truncation and its write
COUNTER = (
    "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/n.tmp; mv /root/n.tmp /root/n; sleep 0.2; done'"
    " >/dev/null 2>&1 &"
)


@pytest.fixture
def tier_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Server, list[Path]]]:
    """Two homes sharing the tests' kernel, agent and initramfs, and one bucket prefix."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SANDLOT_STORAGE_PUSH", "0")  # (the background pusher: tests/unit/test_tier.py)
    shared = sandlot.Runtime.for_home().home
    sandlot.Runtime.for_home().prepare()
    with s3_server(tmp_path) as s3:
        homes = []
        for name in ("a", "b"):
            home = tmp_path / name
            home.mkdir()
            for d in ("kernels", "agent", "initramfs"):
                (home / d).symlink_to(shared / d)
            sandlot.storage.configure(s3.url("vm"), endpoint_url=s3.endpoint_url, home=home)
            homes.append(home)
        try:
            yield s3, homes
        finally:
            for home in homes:
                for box in sandlot.list(all=True, home=home):
                    box.remove(force=True)


def count(box: sandlot.Box) -> int:
    return int(box.exec("cat", "/root/n").stdout)


@pytest.mark.parametrize("engine", ["qemu", "gvisor"])
def test_a_suspended_box_resumes_on_another_home_with_its_processes_and_files(
    tier_homes: tuple[S3Server, list[Path]], busybox_root: Path, engine: str
) -> None:
    """Its disk goes too: every layer (a frozen one under its top, where a file of the
    frozen one was deleted) and the image's root (on gVisor: directories, as trees)."""
    _, (a, b) = tier_homes
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True, name="traveller", home=a, engine=engine)
    box.start()
    box.files.write("/root/old", "deleted after the snapshot")
    box.snapshot("under")
    box.files.remove("/root/old")
    box.files.write("/root/notes", "written on home a")
    box.sh(COUNTER)
    deadline = time.monotonic() + 60
    while box.exec("test", "-s", "/root/n").returncode != 0:
        assert time.monotonic() < deadline, "the counter never started"
        time.sleep(0.2)
    before = count(box)
    box.suspend()
    report = sandlot.storage.push("traveller", release=True, home=a)
    assert report.files >= 2 and sandlot.list(home=a) == []
    moved = sandlot.storage.pull("traveller", home=b)
    assert (moved.id, moved.name, moved.state) == (box.id, "traveller", "suspended")
    assert moved.files.read_text("/root/notes") == "written on home a"  # resumes it
    assert not moved.files.exists("/root/old")
    assert moved.exec("cat", "/etc/passwd").stdout.startswith("root:")  # the image's root came too
    deadline = time.monotonic() + 30
    while (now := count(moved)) <= before:  # the same counter goes on, from where it was
        assert time.monotonic() < deadline, f"the counter stayed at {now} (suspended at {before})"
        time.sleep(0.2)
    assert now < before + 1000  # not started over: a process that ran on home a
    assert sandlot.storage.boxes(home=a)[0]["holder"] == home_id(b)
    with pytest.raises(sandlot.BoxElsewhere):
        sandlot.storage.pull("traveller", home=a)


@pytest.mark.parametrize("engine", ["qemu", "gvisor"])
def test_a_snapshot_whose_chunks_left_this_host_rolls_back_from_the_bucket(
    tier_homes: tuple[S3Server, list[Path]], busybox_root: Path, engine: str
) -> None:
    """On gVisor too: its checkpoint's chunks go to the bucket and come back from it."""
    _, (a, _) = tier_homes
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True, name="evicted", home=a, engine=engine)
    box.start()
    box.files.write("/root/f", "before")
    box.sh("mkdir -p /run/m && mount -t tmpfs tmpfs /run/m && echo in-memory > /run/m/m")
    snap = box.snapshot("cold")
    box.files.write("/root/f", "after")
    before = sandlot.storage.info(home=a).local_bytes
    assert sandlot.storage.evict(older_than=0, home=a).chunks > 0
    assert sandlot.storage.info(home=a).local_bytes < before
    box.rollback(snap)
    assert box.files.read_text("/root/f") == "before"
    assert box.exec("cat", "/run/m/m").stdout == "in-memory\n"


def test_a_box_asleep_past_evict_after_leaves_this_host_and_a_request_wakes_it_lazily(
    tier_homes: tuple[S3Server, list[Path]], busybox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deep sleep, then a wake from the tier on traffic: the guest runs while its
    memory is read through the helper's FUSE mount (``core/lazymem.py``), which ends
    when the box sleeps again."""
    import contextlib
    import urllib.request

    from sandlot.config import runtime_dir
    from sandlot.core.chunks import ChunkStore
    from sandlot.core.manifest import Manifest
    from sandlot.core.runtime import Runtime

    from tests.support.waiting import scaled

    s3, (a, _) = tier_homes
    monkeypatch.setenv("SANDLOT_STORAGE_PUSH", "1")  # the pusher, which keeps the deep sleep's time
    sandlot.storage.configure(s3.url("vm"), endpoint_url=s3.endpoint_url, evict_after=1.0, home=a)
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True, name="deep", ports=[8000],
                      wake_on_traffic=True, home=a).start()  # fmt: skip
    box.sh("mkdir -p /www && httpd -p 8000 -h /www")
    box.sh(COUNTER.replace("/root/n", "/www/n"))
    # memory of its own (lazymem.LAZY_FROM chunks and more), in no other state: read lazily
    box.sh("mkdir -p /run/m && mount -t tmpfs tmpfs /run/m && dd if=/dev/urandom of=/run/m/b bs=1M count=72")
    blob = box.exec("sha256sum", "/run/m/b").stdout
    port = box.port(8000)[1]

    def get() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/n", timeout=scaled(120)) as r:
                return int(r.read())
        except OSError as exc:  # why the wake failed, as the box's events say
            # the keeper resets the connection before it writes why (a wake_failed event, where
            # it was not the guest port that refused): a moment for it to be written
            deadline = time.monotonic() + 5
            while True:
                seen = sandlot.events(box=box.id, follow=False, home=a)
                if any(ev.kind == "wake_failed" for ev in seen) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            said = [f"{ev.kind}: {ev.reason}" for ev in seen]
            console = box.logs(lines=15)
            raise AssertionError(f"{exc!r}; the box's events: {said[-6:]}; its console:\n{console}") from exc

    def helpers() -> list[Path]:
        """The helpers serving this box's memory, each with its mount up."""
        mounts = Path("/proc/mounts").read_text()
        out = []
        for d in runtime_dir().glob("lazy-*"):
            with contextlib.suppress(OSError):
                if str(rt.box_dir(box.id)) in (d / "request").read_text() and f" {d / 'mnt'} " in mounts:
                    out.append(d)
        return out

    deadline = time.monotonic() + 60
    while box.exec("test", "-s", "/www/n").returncode != 0:
        assert time.monotonic() < deadline, "the counter never started"
        time.sleep(0.2)
    rt, store = Runtime.for_home(a), ChunkStore(a)
    assert helpers() == []  # started from a boot: nothing to read lazily
    for cycle in range(2):
        box.files.write(f"/root/f{cycle}", f"cycle {cycle}")
        before = get()
        box.suspend()
        state = rt.store.get(box.id).suspended
        ram = Manifest.decode(rt.store.state_manifest(state) or b"", state).image("microvm.ram")
        deadline = time.monotonic() + scaled(60)
        while all(store.path(d).exists() for d in ram.digests if d):  # the pusher evicts it
            assert time.monotonic() < deadline, "the sleeping box's memory never left this host"
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while helpers():  # the last wake's helper ended with its VM
            assert time.monotonic() < deadline, helpers()
            time.sleep(0.1)
        after = get()  # wakes it from the tier
        assert before <= after < before + 1000, (before, after)  # the same counter, not started over
        while get() <= before:  # and it goes on
            assert time.monotonic() < deadline + scaled(30), "the counter stopped"
            time.sleep(0.1)
        assert len(helpers()) == 1  # its memory is read through the helper
        for i in range(cycle + 1):
            assert box.files.read_text(f"/root/f{i}") == f"cycle {i}"
    assert box.exec("sha256sum", "/run/m/b").stdout == blob  # every page, through the helper
    box.suspend()
    deadline = time.monotonic() + 30
    while helpers():  # asleep again: the helper ended with its VM
        assert time.monotonic() < deadline, helpers()
        time.sleep(0.1)
    assert (rt.box_dir(box.id) / "memory-touched").stat().st_size > 0  # the next wake's first fetches


def test_a_killed_memory_helper_ends_its_box_as_a_crash_never_a_hang(
    tier_homes: tuple[S3Server, list[Path]], busybox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper is part of the VM: killed, the guest's next read of memory it served
    fails, QEMU ends, and the box says it crashed (docs/storage.md)."""
    import os
    import signal
    import subprocess

    from sandlot.core import lazymem
    from sandlot.core.runtime import Runtime

    _, (a, _) = tier_homes
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, keep=True, name="fragile", home=a).start()
    box.suspend()
    monkeypatch.setenv("SANDLOT_LAZY_RESTORE", "always")  # lazy from this host's own chunks
    box.resume()
    assert box.exec("echo", "up").stdout == "up\n"
    (pid,) = [pid for d, pid in lazymem.helpers()
              if str(Runtime.for_home(a).box_dir(box.id)) in (d / "request").read_text()]  # fmt: skip
    os.kill(pid, signal.SIGKILL)
    subprocess.run(["sh", "-c", "sync; echo 1 > /proc/sys/vm/drop_caches"], check=False)  # pages read again
    with pytest.raises(sandlot.SandlotError):
        for _ in range(50):  # each read of memory the page cache let go fails
            box.exec("sh", "-c", "cat /proc/meminfo > /dev/null; ls -R / > /dev/null", timeout=60)
            time.sleep(0.2)
    assert box.refresh() == "crashed"
