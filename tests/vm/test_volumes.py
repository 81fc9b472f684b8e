"""Named volumes on real boxes: data that outlives its box, read-only mounts, one writer
at a time, forks that get copies, a rollback of a volume's content, a kill -9 of the VM
mid-write that loses nothing acknowledged, and a full volume that stays inside its box;
disk volumes on both engines (QEMU mounts each as a drive in its guest, gVisor serves
it with a user-space ext4 on the host), one volume read by both."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.core import layers, volumes

from tests.support.waiting import deadline_in, goes_past

pytestmark = pytest.mark.vm
ENGINES = pytest.mark.parametrize("engine", ["qemu", "gvisor"])


@pytest.fixture
def volume() -> Iterator[str]:
    name = f"vol-{os.urandom(3).hex()}"
    sandlot.volume.create(name, size_gb=0.0625, labels={"test": "volumes"})  # 64 MiB
    yield name
    for box in sandlot.list():
        if any(b["name"] == box.name for b in sandlot.volume.get(name).boxes):
            box.remove(force=True)
    sandlot.volume.remove(name)


@ENGINES
def test_a_volume_outlives_its_box_fills_up_inside_it_and_is_read_only_where_mounted_so(
    busybox_root: Path, volume: str, engine: str
) -> None:
    writer = sandlot.Box(rootfs=busybox_root, memory_mib=256, volumes={volume: "/data"}, engine=engine)
    writer.start()
    try:
        assert (
            writer.sh("grep ' /data ' /proc/mounts").stdout.split()[2]
            == {"qemu": "ext4", "gvisor": "9p"}[engine]
        )
        writer.sh("mkdir -p /data/notes && echo kept > /data/notes/a && sync", check=True)
        info = sandlot.volume.get(volume)
        assert info.holder == writer.name and info.boxes == [
            {"name": writer.name, "id": writer.id, "mode": "copy", "state": "running"}
        ]
        # one writer at a time: a second box in copy mode is refused, naming the first
        with pytest.raises(sandlot.VolumeInUse, match=writer.name) as busy:
            sandlot.Box(
                rootfs=busybox_root, memory_mib=256, volumes=[f"{volume}:/data"], engine=engine
            ).start()
        assert busy.value.boxes == [writer.name]
        # full: ENOSPC in the box, whose own disk goes on; the host holds what was written
        full = writer.sh("dd if=/dev/urandom of=/data/filler bs=1M count=100 2>&1; echo rc=$?").stdout
        assert "No space left on device" in full and "rc=1" in full, full
        assert writer.sh("echo fine > /root/own-disk && cat /root/own-disk").stdout == "fine\n"
        writer.sh("sync", check=True)  # written through to the host (gVisor's server holds it until then)
        host = sandlot.volume.get(volume).host_bytes
        assert 40 << 20 < host < 72 << 20, host  # at most the volume's size, plus metadata
        writer.sh("rm /data/filler && sync", check=True)
        with pytest.raises(sandlot.VolumeInUse, match=writer.name):
            sandlot.volume.remove(volume)
        writer.sh("echo in-the-page-cache > /data/notes/b", check=True)  # no sync: removal flushes it
    finally:
        writer.remove(force=True)
    # its box is gone, and what it wrote is the volume's, for a box of either engine
    assert sandlot.volume.get(volume).holder is None
    other = {"qemu": "gvisor", "gvisor": "qemu"}[engine]
    with sandlot.Box(
        rootfs=busybox_root, memory_mib=256, volumes=[f"{volume}:/data:ro"], engine=other
    ) as reader:
        assert reader.sh("cat /data/notes/a /data/notes/b").stdout == "kept\nin-the-page-cache\n"
        refused = reader.sh("(echo x > /data/notes/c) 2>&1; echo rc=$?").stdout
        assert "Read-only file system" in refused and "rc=1" in refused, refused
        assert reader.sh("ls /data").stdout.split() == ["lost+found", "notes"]


@ENGINES
def test_forks_get_copies_a_rollback_restores_and_an_export_carries_the_volume(
    busybox_root: Path, volume: str, tmp_path: Path, engine: str
) -> None:
    chain_before = set(layers.layers_dir(sandlot.Runtime.for_home().home).iterdir())
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, volumes={volume: "/data"}, engine=engine) as box:
        box.sh("echo one > /data/state && sync", check=True)
        snap = box.snapshot(name="one")
        box.sh("echo two > /data/state && sync", check=True)
        children = box.fork(4)
        try:
            for i, child in enumerate(children):
                assert child.sh("cat /data/state").stdout == "two\n"
                child.sh(f"echo child{i} > /data/state && sync", check=True)
            for i, child in enumerate(children):
                assert child.sh("cat /data/state").stdout == f"child{i}\n"
            assert box.sh("cat /data/state").stdout == "two\n"
            mounted = {b["name"]: b["mode"] for b in sandlot.volume.get(volume).boxes}
            assert mounted == {b.name: "copy" for b in (box, *children)}
            assert sandlot.volume.get(volume).holder == box.name  # forks write copies, never back
        finally:
            for child in children:
                child.remove(force=True)
        box.rollback(snap)
        assert box.sh("cat /data/state").stdout == "one\n"
        box.suspend()
        box.resume()
        assert box.sh("cat /data/state").stdout == "one\n"
        box.sh("echo three >> /data/state && sync", check=True)
        # an archive holds the volume as it was: a box started from it elsewhere has a copy
        archive = snap.export(tmp_path / "one.sandlot")
        snap.remove()
        moved = sandlot.import_snapshot(archive)
        assert isinstance(moved, sandlot.Box)
        imported = sandlot.get_snapshot(moved.inspect()["origin"])
        try:
            assert moved.sh("cat /data/state").stdout == "one\n"
            assert moved.name not in {b["name"] for b in sandlot.volume.get(volume).boxes}
        finally:
            moved.remove(force=True)
            imported.remove()
    with sandlot.Box(
        rootfs=busybox_root, memory_mib=256, volumes=[f"{volume}:/data:ro"], engine=engine
    ) as reader:
        assert reader.sh("cat /data/state").stdout == "one\nthree\n"
    sandlot.volume.remove(volume)
    sandlot.volume.create(volume, size_gb=0.0625)  # the fixture removes it again
    # what the removed volume, its boxes and its snapshot held is gone from the host
    left = set(layers.layers_dir(sandlot.Runtime.for_home().home).iterdir()) - chain_before
    assert len(left) == 2, left  # the new volume's own two files


@ENGINES
def test_kill9_of_the_vm_mid_write_loses_nothing_acknowledged(
    busybox_root: Path, volume: str, engine: str
) -> None:
    """QEMU, or the gVisor sandbox (its volume's server then writes back what it holds)."""
    box = sandlot.Box(rootfs=busybox_root, memory_mib=256, volumes={volume: "/data"}, engine=engine)
    box.start()
    try:
        # each number is appended and fsynced before it is printed: printed is acknowledged
        writer = box.spawn(
            "sh", "-c",
            "i=0; while true; do i=$((i+1)); echo $i | dd of=/data/log oflag=append conv=notrunc,fsync "
            "2>/dev/null && echo $i; done",
        )  # fmt: skip
        acknowledged = 0
        for line in writer.stdout.lines():
            acknowledged = int(line)
            if acknowledged >= 30:
                break
        os.kill(box.inspect()["vm_pid"], signal.SIGKILL)
        deadline = deadline_in(10)
        while sandlot.get(box.name).state != "crashed" and time.monotonic() < deadline:
            time.sleep(0.1)
        box.start()  # cold: its volume's top is as the VM left it
        kept = [int(n) for n in box.sh("cat /data/log").stdout.split()]
        assert kept[:acknowledged] == list(range(1, acknowledged + 1)), kept
    finally:
        box.remove(force=True)
    with sandlot.Box(
        rootfs=busybox_root, memory_mib=256, volumes=[f"{volume}:/data:ro"], engine=engine
    ) as reader:
        kept = [int(n) for n in reader.sh("cat /data/log").stdout.split()]
        assert kept[:acknowledged] == list(range(1, acknowledged + 1)), kept


def test_shared_volumes_and_host_directories_are_live_in_every_box_through_snapshots_and_forks(
    busybox_root: Path, tmp_path: Path
) -> None:
    name = f"shared-{os.urandom(3).hex()}"
    sandlot.volume.create(name, shared=True)
    where = Path(volumes.get_volume(sandlot.Runtime.for_home().store, name).layer)
    host = tmp_path / "host"
    host.mkdir()
    (host / "given").write_text("by the host\n")
    made: list[sandlot.Box] = []

    def mounted(box: sandlot.Box) -> list[str]:
        return sorted(line.split()[1] for line in box.sh("grep ' 9p ' /proc/mounts").stdout.splitlines())

    try:
        one = sandlot.Box(rootfs=busybox_root, memory_mib=256, volumes={name: "/s", str(host): "/h"})
        two = sandlot.Box(rootfs=busybox_root, memory_mib=256, volumes=[f"{name}:/s"])
        made += [one, two]
        one.start()
        two.start()
        # one live directory: each box sees what the other and the host write, at once
        one.sh("echo from-one > /s/one", check=True)
        assert two.sh("cat /s/one").stdout == "from-one\n"
        two.sh("echo from-two > /s/two", check=True)
        assert one.sh("cat /s/two /h/given").stdout == "from-two\nby the host\n"
        assert (where / "two").read_text() == "from-two\n"
        # a save unmounts the shares for its length: a file open under one refuses it,
        # naming the process, and the box goes on with its shares up
        pid = one.sh("sleep 600 > /s/held 2>&1 & echo $!").stdout.strip()
        with pytest.raises(sandlot.InvalidState, match=rf"/s cannot be unmounted.*pid {pid} \(sleep\)"):
            one.snapshot()
        assert mounted(one) == ["/h", "/s"] and one.sh("echo still > /s/still && cat /s/still").ok
        one.sh(f"kill {pid}; rm /s/held", check=True)
        snap = one.snapshot(name="shared")
        assert mounted(one) == ["/h", "/s"]  # up again before its commands ran on
        archive = snap.export(tmp_path / "shared.sandlot")
        # commands asked for during saves start after each thaw: none is lost, none hangs (a
        # command with a file open under a share when the save comes is let finish first,
        # for a second at most: these touch none, as a command caught so may refuse the save)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            asked = [pool.submit(one.sh, f"echo {i}") for i in range(24)]
            for _ in range(3):
                one.snapshot().remove()
            assert [f.result(timeout=120).stdout for f in asked] == [f"{i}\n" for i in range(24)]
        # a reader caught mid-file is let finish, and the save goes on
        reader = one.spawn("sh", "-c", "sleep 0.3 < /s/one", stdin=False)
        time.sleep(0.1)
        one.snapshot().remove()
        assert reader.wait(timeout=60) == 0
        one.sh("echo after-the-snapshot > /s/after", check=True)
        # a fork keeps the mounts: its children share the same directories, live
        children = one.fork(2)
        made += children
        for i, child in enumerate(children):
            assert mounted(child) == ["/h", "/s"]
            assert child.sh("cat /s/one /s/after").stdout == "from-one\nafter-the-snapshot\n"
            child.sh(f"echo {i} > /s/child{i} && echo {i} > /h/child{i}", check=True)
        assert two.sh("cat /s/child0 /s/child1").stdout == "0\n1\n"
        assert sorted(p.name for p in host.iterdir()) == ["child0", "child1", "given"]
        # a rollback takes the box back, and never what it shares
        one.rollback(snap)
        assert mounted(one) == ["/h", "/s"]
        assert one.sh("cat /s/after /s/child1").stdout == "after-the-snapshot\n1\n"
        # suspend and resume; pause, snapshot the paused box and unpause
        one.suspend()
        assert one.sh("cat /s/child0").stdout == "0\n" and mounted(one) == ["/h", "/s"]
        one.pause()
        one.snapshot(name="paused")
        one.unpause()
        assert mounted(one) == ["/h", "/s"] and one.sh("echo back > /s/back").ok
        assert (where / "back").read_text() == "back\n"
        info = sandlot.volume.get(name)
        assert info.kind == "shared" and sorted(b["name"] for b in info.boxes) == sorted(b.name for b in made)
    finally:
        for box in made:
            box.remove(force=True)
    sandlot.volume.remove(name)
    assert not where.exists()
    # an archive names its shares as requirements: a shared volume of that name in the home
    # that imports it, and a directory given for the host directory it shared
    with pytest.raises(sandlot.InvalidArgument, match=rf"shared volume of that name must be here.*{name}"):
        sandlot.import_snapshot(archive, start=False)
    sandlot.volume.create(name, shared=True)
    imported = sandlot.import_snapshot(archive, start=False)
    assert isinstance(imported, sandlot.Snapshot)
    try:
        with pytest.raises(sandlot.InvalidArgument, match="give the directory to share there"):
            imported.start(1)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "here").write_text("on this host\n")
        [moved] = imported.start(1, volumes={str(elsewhere): "/h"})
        try:
            assert mounted(moved) == ["/h", "/s"] and moved.sh("cat /h/here").stdout == "on this host\n"
            moved.sh("echo moved > /s/moved", check=True)
            assert (Path(volumes.get_volume(sandlot.Runtime.for_home().store, name).layer) / "moved").exists()
        finally:
            moved.remove(force=True)
    finally:
        imported.remove()
        sandlot.volume.remove(name)


def test_kill9_mid_save_leaves_no_share_down_past_the_freeze_lease(
    busybox_root: Path, tmp_path: Path
) -> None:
    """A process killed between unmounting a box's shares and saving it leaves the box
    frozen with them down: its agent mounts them again and thaws the commands when the
    freeze's lease (10 s of guest time) runs out, whoever comes next."""
    host = tmp_path / "host"
    host.mkdir()
    name = f"shares-crash-{os.urandom(3).hex()}"
    box = sandlot.create(rootfs=busybox_root, name=name, memory_mib=256, volumes={str(host): "/h"})
    box.start()
    try:
        box.sh("(while true; do date +%s >> /h/ticks; sleep 0.2; done) >/dev/null 2>&1 &", check=True)
        crash = f"import sandlot\nsandlot.get({name!r}).snapshot('crash')"
        env = {**os.environ, "SANDLOT_CRASH_AT": "snapshot.before-save"}
        r = subprocess.run(
            [sys.executable, "-c", crash], env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == -9, r.stderr
        again = sandlot.get(name)
        assert again.state == "running" and "crash" not in [s.name for s in again.snapshots()]
        # the next command waits out the lease (the commands are frozen), then sees the share
        assert " /h 9p " in again.sh("cat /proc/mounts", timeout=120).stdout

        def ticks() -> int:
            return len((host / "ticks").read_text().split())

        goes_past("the loop's ticks in the share", ticks, ticks())  # the loop writes the share again
        assert again.snapshot("after").name == "after"  # and a save goes through
    finally:
        box.remove(force=True)
