"""Diffs on real boxes: real edits (content, deletes, chmod, chown, symlinks, hard
links, renames, special files) between a snapshot and the box now, the box against
its image, forks against each other, a 1 GB tree, the CLI, and a diff's own boxes
gone after a kill -9 of the process that made them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.conftest import TEST_ENGINE
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm

# gVisor refuses to make device nodes (EPERM, even for root): a fifo stands in there.
# It numbers inodes afresh in a restored sandbox: a rename is a delete plus an add there.
GVISOR = TEST_ENGINE == "gvisor"
DEVICE, DEVICE_TYPE = ("p", "fifo") if GVISOR else ("c 1 3", "char")
RENAMED = (
    {"/work/old-name.txt": "deleted", "/work/new-name.txt": "added"}
    if GVISOR
    else {"/work/new-name.txt": "renamed"}
)

SETUP = """
set -e
mkdir -p /work/tree/sub /work/gone-dir/inner
printf 'line one\\nline two\\nline three\\n' > /work/notes.txt
printf 'stays\\n' > /work/same.txt
printf 'bye\\n' > /work/gone.txt
printf 'x\\n' > /work/gone-dir/inner/f
printf 'moving\\n' > /work/old-name.txt
printf '#!/bin/sh\\necho hi\\n' > /work/run.sh
printf 'owned\\n' > /work/owned.txt
head -c 3000 /dev/urandom > /work/blob.bin
ln -s notes.txt /work/link
ln /work/same.txt /work/hard
mknod /work/pipe p
echo in-tree > /work/tree/sub/deep.txt
"""

EDITS = """
set -e
printf 'line one\\nline 2\\nline three\\nline four\\n' > /work/notes.txt
rm /work/gone.txt
rm -r /work/gone-dir
mv /work/old-name.txt /work/new-name.txt
chmod 755 /work/run.sh
chown 1000:1000 /work/owned.txt
head -c 3000 /dev/urandom > /work/blob.bin
ln -sf same.txt /work/link
ln /work/same.txt /work/hard2
rm /work/pipe && mkdir /work/pipe
mknod /work/null2 DEVICE
printf 'new\\n' > /work/tree/added.txt
touch /work/same.txt
"""


@pytest.fixture(scope="module")
def edited(busybox_root: Path) -> Iterator[tuple[sandlot.Box, sandlot.Snapshot]]:
    """A box whose /work was edited in every way after snapshot ``before``."""
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, engine=TEST_ENGINE) as box:
        assert box.sh(SETUP).exit_code == 0
        snap = box.snapshot("before")
        r = box.sh(EDITS.replace("DEVICE", DEVICE))
        assert r.exit_code == 0, r.stderr
        yield box, snap


def test_every_kind_of_edit_since_a_snapshot(edited: tuple[sandlot.Box, sandlot.Snapshot]) -> None:
    box, snap = edited
    names_before = {b.name for b in sandlot.list()}
    d = box.diff(snap, paths="/work")
    got = {c.path: c for c in d}
    assert {p: c.status for p, c in got.items()} == {
        "/work/notes.txt": "modified",
        "/work/gone.txt": "deleted",
        "/work/gone-dir": "deleted",
        "/work/gone-dir/inner": "deleted",
        "/work/gone-dir/inner/f": "deleted",
        **RENAMED,
        "/work/run.sh": "modified",
        "/work/owned.txt": "modified",
        "/work/blob.bin": "modified",
        "/work/link": "modified",
        "/work/hard2": "added",
        "/work/pipe": "modified",
        "/work/null2": "added",
        "/work/tree/added.txt": "added",
    }, d.summary()  # /work/same.txt was only touched: no change; /work/hard is unchanged
    notes = got["/work/notes.txt"]
    assert notes.fields == ("content",)
    assert "-line two\n+line 2\n" in (notes.diff or "") and "+line four\n" in (notes.diff or "")
    if not GVISOR:
        assert got["/work/new-name.txt"].renamed_from == "/work/old-name.txt"
    assert got["/work/run.sh"].fields == ("mode",)
    assert (got["/work/run.sh"].old.mode, got["/work/run.sh"].new.mode) == (0o644, 0o755)  # type: ignore[union-attr]
    owned = got["/work/owned.txt"]
    assert owned.fields == ("owner",) and (owned.new.uid, owned.new.gid) == (1000, 1000)  # type: ignore[union-attr]
    blob = got["/work/blob.bin"]
    assert blob.diff is None and blob.fields == ("content",)
    assert blob.old.sha256 and blob.new.sha256 and blob.old.sha256 != blob.new.sha256  # type: ignore[union-attr]
    assert got["/work/link"].fields == ("target",) and got["/work/link"].new.target == "same.txt"  # type: ignore[union-attr]
    assert got["/work/pipe"].old.type == "fifo" and got["/work/pipe"].new.type == "dir"  # type: ignore[union-attr]
    assert got["/work/null2"].new.type == DEVICE_TYPE  # type: ignore[union-attr]
    if DEVICE_TYPE == "char":
        assert got["/work/null2"].new.rdev == (1, 3)  # type: ignore[union-attr]
    assert got["/work/gone.txt"].diff == "--- a/work/gone.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"
    assert (d.stat["renamed"], d.stat["deleted"]) == ((0, 5) if GVISOR else (1, 4))
    # the snapshot's box is gone again, and the snapshot is untouched
    assert {b.name for b in sandlot.list()} == names_before
    assert not box.diff(snap, snap)


def test_the_whole_box_against_a_snapshot_and_its_image(edited: tuple[sandlot.Box, sandlot.Snapshot]) -> None:
    box, snap = edited
    whole = box.diff(snap)
    assert {c.path for c in whole if not c.path.startswith("/work")} == set(), whole.summary()
    from_image = box.diff()  # the image to now: all of /work is new
    work = {c.path: c.status for c in from_image if c.path.startswith("/work")}
    assert work["/work"] == "added" and work["/work/notes.txt"] == "added"
    assert "/work/gone.txt" not in work
    # the other way round: the box now to its snapshot undoes the edits
    back = box.diff("now", snap, paths=["/work"])
    assert {c.path: c.status for c in back}["/work/gone.txt"] == "added"


def test_restore_one_file_and_one_tree_from_a_snapshot(edited: tuple[sandlot.Box, sandlot.Snapshot]) -> None:
    box, snap = edited
    box.files.restore("/work/gone.txt", from_=snap)
    assert box.files.read_text("/work/gone.txt") == "bye\n"
    box.files.restore("/work/gone-dir", from_=snap)
    assert box.files.read_text("/work/gone-dir/inner/f") == "x\n"
    box.files.restore("/work/notes.txt", from_=snap)
    assert box.files.read_text("/work/notes.txt").splitlines()[1] == "line two"
    left = {c.path for c in box.diff(snap, paths=["/work/gone.txt", "/work/gone-dir", "/work/notes.txt"])}
    assert left == set()
    with pytest.raises(sandlot.GuestFileNotFoundError):
        box.files.restore("/work/never-there", from_=snap)
    assert box.exec("cat", "/work/new-name.txt").stdout == "moving\n"  # nothing else was touched


def test_forks_compare_with_each_other_and_snapshots_with_snapshots(busybox_root: Path) -> None:
    long_name = "a-box-whose-name-is-as-long-as-a-name-may-be-" + "x" * 18  # 63: the most
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, engine=TEST_ENGINE, name=long_name) as box:
        box.sh("mkdir /app && echo base > /app/state")
        a, b = box.fork(2)
        try:
            a.sh("echo from-a > /app/state && echo a > /app/only-a")
            b.sh("echo from-b > /app/state && rm /app/state && echo b > /app/only-b")
            d = b.diff(a, paths="/app")  # fork a now to fork b now
            assert {c.path: c.status for c in d} == {
                "/app/state": "deleted",
                "/app/only-a": "deleted",
                "/app/only-b": "added",
            }
            sa, sb = a.snapshot("a1"), b.snapshot("b1")
            d2 = box.diff(sa, sb, paths="/app")  # two snapshots, neither of this box
            assert [(c.path, c.status) for c in d2] == [(c.path, c.status) for c in d]
        finally:
            a.remove(force=True)
            b.remove(force=True)


def test_a_1gb_tree_with_ten_changed_files(busybox_root: Path) -> None:
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, engine=TEST_ENGINE) as box:  # an 8 GB disk
        # 1000 files of 1 MiB, each its own: one random MiB and the file's name (random bytes
        # for each would be half a minute more of the guest's ChaCha20, emulated). On gVisor
        # the 2000 short processes that make them grow the checkpoint's own work past the
        # box's host memory bound (limits.CHECKPOINT_SLACK_MIB): this snapshot is its test
        block = 1 << 20
        made = box.sh(
            f"head -c {block} /dev/urandom > /tmp/block; for d in 0 1 2 3 4 5 6 7 8 9; do mkdir -p /data/$d; "
            "for f in $(seq 0 99); do { cat /tmp/block; echo $d/$f; } > /data/$d/$f; done; done; sync; "
            "du -sm /data | cut -f1",
            timeout=900,
        )
        assert made.exit_code == 0 and int(made.stdout) >= 1000 * block >> 20, made
        snap = box.snapshot("big")
        box.sh("for d in 0 1 2 3 4 5 6 7 8 9; do echo changed >> /data/$d/7; done")
        t = time.monotonic()
        d = box.diff(snap)
        took = time.monotonic() - t
        assert [c.path for c in d] == [f"/data/{i}/7" for i in range(10)], d.summary()
        # gVisor reads /dev/urandom short without fullblock; the size check is relative either way
        grown = [(c.path, c.fields, c.old.size, c.new.size) for c in d]  # type: ignore[union-attr]
        assert all(f == ("content",) and new == old + 8 for _, f, old, new in grown), grown
        assert d.raw["walked"]["b"] > 1000
        print(f"1 GB tree, 10 changes: {took:.2f} s ({d.seconds:.2f} s comparing)")


def test_cli_diff(edited: tuple[sandlot.Box, sandlot.Snapshot]) -> None:
    box, snap = edited
    cli = [sys.executable, "-m", "sandlot.cli", "diff", box.name, snap.id, "--path", "/work/tree"]
    stat = subprocess.run([*cli, "--stat"], capture_output=True, text=True, timeout=120)
    assert stat.returncode == 0, stat.stderr
    assert stat.stdout.splitlines()[0] == "A /work/tree/added.txt  +1 -0"
    as_json = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert [c["path"] for c in as_json["changes"]] == ["/work/tree/added.txt"]
    patch = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert patch.stdout == "--- /dev/null\n+++ b/work/tree/added.txt\n@@ -0,0 +1 @@\n+new\n"
    code = subprocess.run([*cli, "--exit-code"], capture_output=True, text=True, timeout=120)
    assert code.returncode == 1
    same = subprocess.run([*cli[:-3], snap.id, "--path", "/work/tree/sub", "--exit-code"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert same.returncode == 0 and same.stdout == ""
    bad = subprocess.run([*cli[:5], "no-such-snapshot"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no-such-snapshot" in bad.stderr


def test_kill9_mid_diff_leaves_no_box_of_its_own(edited: tuple[sandlot.Box, sandlot.Snapshot]) -> None:
    box, snap = edited
    names_before = {b.name for b in sandlot.list()}
    r = subprocess.run(
        [sys.executable, "-c", f"import sandlot; sandlot.get({box.name!r}).diff({snap.id!r})"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "SANDLOT_CRASH_AT": "diff.sides-open"},
    )  # fmt: skip
    assert r.returncode == -9, r.stderr
    deadline = deadline_in(60)
    while {b.name for b in sandlot.list()} != names_before:  # its holder died: recovery removes it
        assert time.monotonic() < deadline, {b.name for b in sandlot.list()} - names_before
        time.sleep(0.5)
    assert box.diff(snap, paths="/work/tree")  # and diffs go on
