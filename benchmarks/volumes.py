"""Named volume benchmarks (docs/volumes.md).

One Debian box mounts a named volume in ``copy`` mode (``/vol``), another volume
read-only (``/ro``, written by an earlier box), a shared volume (``/shared``) and a
host directory (``/host``), both shares over virtio-9p; its own disk (``/root``) is
the baseline, in the same box and run.
Measured, each over ``--runs``:

* ``sequential_write_MBps`` and ``sequential_read_MBps`` per place: ``--mb`` MiB of
  random bytes copied from memory with ``fsync`` at the end, then read back with the
  guest's caches dropped (the read-only volume is read only);
* ``stat_us``: ``os.stat`` of 1000 files, per file, with the guest's caches dropped
  first (the metadata round trips a place costs);
* ``ratios``: each place's figure over the box's own disk;
* ``fork_ms``: ``box.fork()`` of a box with ``copy`` volumes (the one the read-only
  mount reads, and one holding ``--fork-mb`` MiB) against a box without a volume that
  wrote as much to its own disk, the two forked in turn (the target: no dearer, as the
  copy is copy-on-write);
* ``snapshot_ms``: ``box.snapshot()`` of that box, whose save unmounts its two shares
  and mounts them again (its commands frozen meanwhile), against the box without a
  volume;
* ``gvisor``: where gVisor runs (root, runsc), the same places on a gVisor box (its
  own disk; the disk volumes served by a user-space ext4 on the host; the two shares
  as bind mounts), with their ratios, and its ``fork_ms`` with and without the
  ``--fork-mb`` volume; else why not.

    .venv/bin/python benchmarks/volumes.py [--runs 5] [--mb 256] [--fork-mb 1024] [--quick]
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import sandlot

from _common import debian_root, drop_home, emit, gvisor_unusable, host_facts, parser, scratch_home, summary

PLACES = {
    "own_disk": "/root/bench",
    "volume_copy": "/vol/bench",
    "volume_ro": "/ro/bench",
    "volume_shared": "/shared/bench",
    "host_dir": "/host/bench",
}

PROBE = """
import json, os, sys, time
place, mib, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def drop():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except PermissionError:  # gVisor has none: its reads may come from its own cache or the host's
        pass
if what == "write":
    os.makedirs(place, exist_ok=True)
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(f"{place}/big", "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    print(json.dumps({"s": time.perf_counter() - t0}))
elif what == "read":
    drop()
    t0 = time.perf_counter()
    with open(f"{place}/big", "rb") as f:
        while f.read(1 << 20):
            pass
    print(json.dumps({"s": time.perf_counter() - t0}))
elif what == "files":
    os.makedirs(f"{place}/many", exist_ok=True)
    for i in range(1000):
        open(f"{place}/many/{i}", "w").close()
    os.sync()
else:
    drop()
    t0 = time.perf_counter()
    for i in range(1000):
        os.stat(f"{place}/many/{i}")
    print(json.dumps({"us": (time.perf_counter() - t0) * 1e6 / 1000}))
"""


def probe(box: sandlot.Box, *args: Any) -> dict[str, Any]:
    r = box.exec("python3", "/root/probe.py", *map(str, args), timeout=1800)
    assert r.exit_code == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout) if r.stdout.strip() else {}
    return out


def fork_ms(with_volume: sandlot.Box, without: sandlot.Box, runs: int) -> tuple[list[float], list[float]]:
    """``box.fork()`` of each box in turn, ``runs`` times: what the host is doing meanwhile
    weighs on both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for box, out in zip((with_volume, without), times, strict=True):
            t0 = time.perf_counter()
            [child] = box.fork(1)
            out.append((time.perf_counter() - t0) * 1000)
            child.remove(force=True)
    return times


def snapshot_ms(box: sandlot.Box, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        snap = box.snapshot()
        times.append((time.perf_counter() - t0) * 1000)
        snap.remove()
    return times


def measure(box: sandlot.Box, places: dict[str, str], mib: int, runs: int) -> dict[str, dict[str, Any]]:
    """Each place's write (unless read-only), read and ``stat`` figures, in one box."""
    box.files.write("/root/probe.py", PROBE)
    figures: dict[str, dict[str, Any]] = {}
    for place, path in places.items():
        row: dict[str, Any] = {}
        if place != "volume_ro":
            writes = [mib / probe(box, path, mib, "write")["s"] for _ in range(runs)]
            row["sequential_write_MBps"] = summary(writes, 1, 1)
            probe(box, path, 0, "files")
        reads = [mib / probe(box, path, mib, "read")["s"] for _ in range(runs)]
        row["sequential_read_MBps"] = summary(reads, 1, 1)
        row["stat_us"] = summary([probe(box, path, 0, "stat")["us"] for _ in range(runs)], 1, 1)
        figures[place] = row
    return figures


def ratios_of(figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each place's medians over the box's own disk's."""
    base = figures["own_disk"]
    return {
        place: {k: round(float(row[k]["median"]) / float(base[k]["median"]), 2) for k in row}
        for place, row in figures.items() if place != "own_disk"
    }  # fmt: skip


def on_gvisor(root: Path, home: Path, shared: Path, mib: int, runs: int, fill: str) -> dict[str, Any]:
    """Every place on gVisor, against its own disk (a directory layer), where it runs."""
    why = gvisor_unusable(sandlot.Runtime.for_home(home).doctor())
    if why:
        return {"available": False, "reason": why}
    mounts = ["work:/vol", "reference:/ro:ro", "scratch:/shared", f"{shared}:/host"]
    with sandlot.Box(rootfs=root, memory_mib=512, home=home, volumes=mounts, engine="gvisor") as box:
        figures = measure(box, PLACES, mib, runs)
    with (
        sandlot.Box(rootfs=root, memory_mib=512, home=home, volumes={"big": "/big"}, engine="gvisor") as box,
        sandlot.Box(rootfs=root, memory_mib=512, home=home, engine="gvisor") as plain,
    ):
        plain.sh(fill.format("/root"), timeout=3600, check=True)
        with_volume, without = fork_ms(box, plain, runs)
    return {"available": True, "places": figures, "ratios": ratios_of(figures),
            "fork_ms": fork_figures(with_volume, without)}  # fmt: skip


def fork_figures(with_volume: list[float], without: list[float]) -> dict[str, Any]:
    fork: dict[str, Any] = {"with_volume_ms": summary(with_volume, 1, 0),
                            "without_ms": summary(without, 1, 0)}  # fmt: skip
    fork["ratio"] = round(float(fork["with_volume_ms"]["median"]) / float(fork["without_ms"]["median"]), 2)
    return fork


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--fork-mb", type=int, default=1024)
    args = ap.parse_args()
    runs, mib, fork_mib = (1, 8, 8) if args.quick else (args.runs, args.mb, args.fork_mb)
    home = scratch_home("bench-volumes-")
    volumes = sandlot.Volumes(home)
    shared = Path(tempfile.mkdtemp(prefix="bench-volumes-host-"))
    try:
        size_gb = max(1, -(-(mib * 2 + fork_mib + 256) // 1024))
        for name in ("work", "reference", "big"):  # sized for what the runs write
            volumes.create(name, size_gb=size_gb)
        volumes.create("scratch", shared=True)
        root = debian_root()
        # forking: a box whose copy volume holds fork_mib MiB, against one without a volume
        # that wrote as much to its own disk (the same guest memory: caches dropped in both)
        fill = (
            f"head -c {fork_mib << 20} /dev/urandom > {{}}/data && sync && "
            "{{ echo 3 > /proc/sys/vm/drop_caches; }} 2>/dev/null || true"  # gVisor has no drop_caches
        )
        # the first box writes the volume the next mounts read-only, and is the one forked
        first = {"reference": "/ro", "big": "/big"}
        with (
            sandlot.Box(rootfs=root, memory_mib=512, home=home, volumes=first) as writer,
            sandlot.Box(rootfs=root, memory_mib=512, home=home) as plain,
        ):
            writer.files.write("/root/probe.py", PROBE)
            probe(writer, "/ro/bench", mib, "write")
            probe(writer, "/ro/bench", 0, "files")
            writer.sh(fill.format("/big"), timeout=3600, check=True)
            plain.sh(fill.format("/root"), timeout=3600, check=True)
            with_volume, without = fork_ms(writer, plain, runs)
            saved_plain = snapshot_ms(plain, runs)
        mounts = ["work:/vol", "reference:/ro:ro", "scratch:/shared", f"{shared}:/host"]
        with sandlot.Box(rootfs=root, memory_mib=512, home=home, volumes=mounts) as box:
            accel = box.accel
            figures = measure(box, PLACES, mib, runs)
            saved_shares = snapshot_ms(box, runs)
        ratios = ratios_of(figures)
        gvisor = on_gvisor(root, home, shared, mib, runs, fill)
        fork = {**fork_figures(with_volume, without), "volume_mib": fork_mib}
        saves = {"with_shares_ms": summary(saved_shares, 1, 0), "without_ms": summary(saved_plain, 1, 0)}
        saves["ratio"] = round(
            float(saves["with_shares_ms"]["median"]) / float(saves["without_ms"]["median"]), 2
        )
    finally:
        drop_home(home)
        shutil.rmtree(shared, ignore_errors=True)
    emit({
        "benchmark": "volumes", "quick": args.quick, "host": host_facts(accel), "mib": mib,
        "places": figures, "ratios": ratios, "fork_ms": fork, "snapshot_ms": saves, "gvisor": gvisor,
    })  # fmt: skip


if __name__ == "__main__":
    main()
