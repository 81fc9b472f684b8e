"""A home whose filesystem runs full, for real: a tmpfs of its own, filled with a file
but for a few MiB. Each way of writing saved state or disks (a snapshot, a fork, a
suspension, a template, an export, a new box's disk) fails with ``NoSpace`` naming
the filesystem; the running box keeps running, the store still lists exactly what
it did, nothing half-written is visible, and with room again each works."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import sandlot

from tests.support.images import build_layouts
from tests.support.registry import run_registry
from tests.support.roots import CACHE

pytestmark = pytest.mark.vm


@pytest.fixture
def small_home(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(the mount point of a 400 MiB tmpfs, a home on it that shares the tests' kernel,
    agent and initramfs caches)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem for the home needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(mnt)], check=True)
    home = mnt / "home"
    try:
        shared = sandlot.Runtime.for_home().home
        sandlot.Runtime.for_home(shared).prepare()
        home.mkdir()
        for d in ("kernels", "agent", "initramfs"):
            (home / d).symlink_to(shared / d)
        yield mnt, home
    finally:
        (mnt / "filler").unlink(missing_ok=True)
        with contextlib.suppress(sandlot.SandlotError):
            for box in sandlot.list(all=True, home=home):
                box.remove(force=True)
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path, leave: int = 4 << 20) -> Path:
    """Grow the filler until ``leave`` bytes are free (again: a failed write may have
    freed some, the store's room for one)."""
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    have = filler.stat().st_size if filler.exists() else 0
    if st.f_bavail * st.f_frsize > leave:
        size = have + st.f_bavail * st.f_frsize - leave
        subprocess.run(["fallocate", "-l", str(size), str(filler)], check=True)
    return filler


def visible(home: Path) -> set[str]:
    """What a reader of the home sees: saved states, disk layers and base disks (the
    hidden names are work in progress, which no reader takes)."""
    return {f"{d}/{p.name}" for d in ("snapshots", "layers", "bases") if (home / d).is_dir()
            for p in (home / d).iterdir() if not p.name.startswith(".")}  # fmt: skip


def test_a_full_home_fails_each_save_clearly_and_loses_nothing(
    small_home: tuple[Path, Path], busybox_root: Path, debian_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mnt, home = small_home
    box = sandlot.Box(rootfs=busybox_root, memory_mib=128, home=home, keep=True, template=False).start()
    box.exec("sh", "-c", "echo before > /root/mark").check()
    kept = box.snapshot("kept")  # saved before the disk filled: it must come through
    # memory no saved state holds yet: a save that adds only what changed would
    # otherwise fit in the MiB left (the room the guest's own disk writes need)
    box.sh("mkdir -p /mnt/noise && mount -t tmpfs tmpfs /mnt/noise && head -c 24m /dev/urandom >/mnt/noise/n")
    spare = sandlot.Box.create(rootfs=busybox_root, memory_mib=128, home=home, name="spare")
    spare_disk = Path(sandlot.Runtime.for_home(home).store.get(spare.id).disk or "")
    registry = contextlib.ExitStack()
    reg = registry.enter_context(run_registry(mnt.parent / "registry"))
    reg.push(build_layouts(CACHE, busybox_root)["busybox"], "test/busybox:1")
    filler = fill(mnt)
    spare.remove()  # what frees room works on a full disk: a box goes, with its disk
    assert not spare_disk.exists() and [b.name for b in sandlot.list(all=True, home=home)] == [box.name]
    before = visible(home)
    # by default a save does not begin on a home this full ...
    with pytest.raises(sandlot.NoSpace, match=r"snapshot of box .* was not begun: sandlot keeps 64 MiB"):
        box.snapshot("late")
    assert visible(home) == before and box.state == "running"
    monkeypatch.setenv("SANDLOT_MIN_FREE_MIB", "0")  # ... here each begins, and meets the full disk
    attempts: dict[str, Callable[[], Any]] = {
        "snapshot": lambda: box.snapshot("late"),
        "fork": lambda: box.fork(2),
        "suspend": box.suspend,
        "template": lambda: sandlot.template(rootfs=busybox_root, memory_mib=128, home=home, name="t"),
        "export": lambda: kept.export(mnt / "out.sandlot"),
        "new box": lambda: sandlot.Box(rootfs=debian_root, memory_mib=128, home=home, template=False).start(),
        "pull": lambda: sandlot.pull(f"{reg.host}/test/busybox:1", insecure=True, home=home),
    }
    for what, attempt in attempts.items():
        fill(mnt)
        # (an export writes where it is asked to: beside the home, on the same filesystem)
        with pytest.raises(sandlot.NoSpace, match=f"the filesystem of {mnt}(/home)?.* is full") as failed:
            attempt()
        assert failed.value.errno == 28 and failed.value.status == 507, what  # ENOSPC
        assert box.state == "running", what
        assert box.exec("cat", "/root/mark").stdout == "before\n", what
        assert [s.id for s in sandlot.list_snapshots(home=home)] == [kept.id], what
        assert [b.name for b in sandlot.list(all=True, home=home)] == [box.name], what
        assert sandlot.list_images(home=home) == [], what
        # a snapshot moves the box onto a new top layer before it saves: that layer is
        # the box's disk now (the one it was on is under it), not a leftover
        before.add(f"layers/{Path(sandlot.Runtime.for_home(home).store.get(box.id).disk or '').name}")
        assert visible(home) == before, what
    assert sorted(p.name for p in mnt.iterdir()) == ["filler", "home"]  # no archive, whole or in part
    filler.unlink()
    # with room again, each works
    assert box.snapshot("late").id != kept.id
    kids = box.fork(2)
    assert [k.exec("cat", "/root/mark").stdout for k in kids] == ["before\n", "before\n"]
    for k in kids:
        k.remove(force=True)
    box.suspend()
    box.resume()
    assert kept.export(mnt / "out.sandlot").stat().st_size > 0
    box.rollback(kept)
    assert box.exec("cat", "/root/mark").stdout == "before\n"
    pulled = sandlot.pull(f"{reg.host}/test/busybox:1", insecure=True, home=home)
    assert [i.digest for i in sandlot.list_images(home=home)] == [pulled.digest]
    registry.close()


def test_a_full_home_fails_a_gvisor_save_clearly(
    small_home: tuple[Path, Path], busybox_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runsc checkpoint on a full home: NoSpace, and the sandbox goes on (runsc ends a
    sandbox whose checkpoint fails: sandlot must refuse before)."""
    monkeypatch.setenv("SANDLOT_MIN_FREE_MIB", "0")  # past the core's own floor, to the engine's check
    mnt, home = small_home
    box = sandlot.Box(rootfs=busybox_root, engine="gvisor", memory_mib=256, home=home, keep=True,
                      template=False).start()  # fmt: skip
    box.exec("sh", "-c", "echo before > /root/mark").check()
    before = visible(home)
    filler = fill(mnt)  # a busybox sandbox's checkpoint is 45 KiB: it would fit
    for what, attempt in {"snapshot": lambda: box.snapshot("late"), "suspend": box.suspend}.items():
        fill(mnt)
        with pytest.raises(sandlot.NoSpace, match=f"the filesystem of {mnt}/home.* is full"):
            attempt()
        assert box.state == "running", what
        assert box.exec("cat", "/root/mark").stdout == "before\n", what
        assert sandlot.list_snapshots(home=home) == [], what
        before.add(f"layers/{Path(sandlot.Runtime.for_home(home).store.get(box.id).disk or '').name}")
        assert visible(home) == before, what  # the box's disk, as above, and nothing else
    filler.unlink()
    box.snapshot("late")
    assert box.exec("cat", "/root/mark").stdout == "before\n"


def test_a_guest_write_that_meets_a_full_home_is_held_then_goes_through(
    small_home: tuple[Path, Path], busybox_root: Path
) -> None:
    """The guest writes more than the home has room for: QEMU stops it with the write
    held. The box says so (an event), a new command is refused at once with ``NoSpace``
    rather than left to time out, and with room again the box runs on by itself: the
    command under way ends, and what it wrote is whole."""
    mnt, home = small_home
    box = sandlot.Box(rootfs=busybox_root, memory_mib=128, home=home, keep=True, template=False).start()
    box.exec("sh", "-c", "echo before > /root/mark && sync").check()
    since = max((e.id for e in box.events(follow=False)), default=0)
    filler = fill(mnt)
    writes = "head -c 24m /dev/urandom > /root/big && sync && md5sum /root/big"
    with ThreadPoolExecutor(1) as pool:
        writer = pool.submit(box.exec, "sh", "-c", writes, timeout=600)
        deadline = time.monotonic() + 90
        while not (held := [e for e in box.events(after=since, follow=False) if e.kind == "disk_full"]):
            assert not writer.done(), writer.result()  # 24 MiB cannot fit in 4
            assert time.monotonic() < deadline, "the box was not seen held"
            time.sleep(0.5)
        assert held[0].detail["free_bytes"] < 8 << 20 and held[0].by == "sandlot"
        t0 = time.monotonic()
        with pytest.raises(sandlot.NoSpace, match=r"disk write held .* runs on by itself") as e:
            box.exec("true", timeout=30)
        assert time.monotonic() - t0 < 10 and e.value.errno == 28 and e.value.status == 507
        assert box.state == "running" and not writer.done()
        filler.unlink()  # room again: nobody asks the box anything, it runs on
        r = writer.result(timeout=120)
    assert r.exit_code == 0, r.stderr
    kinds = [e.kind for e in box.events(after=since, follow=False)]
    assert kinds.count("disk_full") == 1 and "disk_room" in kinds, kinds
    assert box.exec("md5sum", "/root/big").stdout == r.stdout  # whole, as written
    assert box.exec("cat", "/root/mark").stdout == "before\n"
    box.remove(force=True)
