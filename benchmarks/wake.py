"""Sleep when idle, wake on traffic (``wake_on_traffic=True``; docs/api.md, "Sleep when
idle, wake on traffic"): boxes from one busybox template whose HTTP server (busybox
``httpd``) and a counter (a shell loop that writes ``/www/count`` five times a second)
run from the template on, each with its port published and held by the home's port
keeper while it sleeps.

* wake: one box, suspended, then one HTTP request to its published port: the time to
  the reply's first byte; beside it, in the same run, a plain ``resume()`` and a first
  exec of the same box, suspended the same way;
* storm: ``--boxes`` boxes, all suspended, then one request to each at once: every
  reply checked, p50 and p99 of their times, and what the sleeping boxes held on the
  host before (the keeper's RSS; the VMs': none run) and on disk (the home);
* cycles: ``--cycles`` suspend-and-wake cycles of one box through its port, a file
  written in each: after every wake the counter has gone on from where it was and every
  file is there;
* sleepers: ``--sleepers`` boxes (1000 for issue 59's figure) made from the template and
  put to sleep one after another, each with its port held: what they hold while they all
  sleep (the host's memory against before them, the processes of sandlot and QEMU, the
  home on disk against the template) and the CPU the host spends on them over
  ``--idle-seconds``, then one of them woken by a request;
* deep: a box asleep past the storage tier's ``evict_after`` (moto's S3 server on
  127.0.0.1), with ``--resident-mib`` of memory of its own: a request wakes it lazily
  (``core/lazymem.py``), beside a resume that reads its whole memory first, and its
  memory checked whole at the end;
* quota: two boxes of a key with ``max_awake=1`` (docs/server.md, "Quotas"), one awake
  and idle, a request to the other: its wake first puts the idle one to sleep
  (``core/awake.py``), in the port keeper's process; the time to the first byte, beside
  the plain wake's.

    .venv/bin/python benchmarks/wake.py [--quick] [--boxes 50] [--cycles 100] [--runs 10]
                                        [--sleepers 1000] [--idle-seconds 30] [--resident-mib 96]
"""

from __future__ import annotations

import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sandlot
from sandlot.api.access import create_key
from sandlot.config import tree_bytes, try_flock
from sandlot.core import lazymem
from sandlot.core.access import KEY_LABEL
from sandlot.core.metrics import metrics_lock
from sandlot.core.pressure import MIN_IDLE

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary

SERVE = (
    "mkdir -p /www && echo hello > /www/index.html && httpd -p 8000 -h /www && "
    "(i=0; while :; do i=$((i+1)); echo $i > /www/.count && mv /www/.count /www/count; sleep 0.2; done) "
    ">/dev/null 2>&1 &"
)
TIMEOUT = 300.0


HOMES: list[Path] = []  # the homes of this run, whose events a failed request shows


def first_byte(port: int, path: str = "/index.html") -> tuple[float, bytes]:
    """Seconds from sending a request to the first byte of its reply, and the body."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=TIMEOUT) as reply:
            first = reply.read(1)
            took = time.monotonic() - t0
            return took, first + reply.read()
    except OSError as exc:  # what the boxes' events said of it, beside the client's error
        took = time.monotonic() - t0
        since = -took - 5
        said = [f"{ev.box_name}: {ev.kind} {ev.reason}" for home in HOMES
                for ev in sandlot.events(since=since, follow=False, home=home)]  # fmt: skip
        raise RuntimeError(f"port {port}{path}: {exc!r} after {took:.1f}s; events: {said}") from exc


def rss_once_filled() -> int:
    """The lazy memory helpers' RSS once their fills ended (each one's log says so)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        logs = [d / "helper.log" for d, _ in lazymem.helpers()]
        if all(log.exists() and " chunks in " in log.read_text(errors="replace") for log in logs):
            break
        time.sleep(0.1)
    return helpers_rss_kib()


def helpers_rss_kib() -> int:
    """RSS of the lazy memory helpers running, together (forked by their home's fork
    server, their command line is its: ``lazymem.helpers`` knows them)."""
    return sum(pid_rss_kib(str(pid)) for _, pid in lazymem.helpers())


def processes(name: str) -> list[tuple[str, list[bytes]]]:
    """The pids and command lines of the processes whose command line holds ``name``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if name.encode() in cmdline:
            out.append((pid, cmdline.rstrip(b"\0").split(b"\0")))
    return out


def pid_rss_kib(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kib(name: str) -> int:
    """RSS of the processes whose command line holds ``name``, together."""
    return sum(pid_rss_kib(pid) for pid, _ in processes(name))


def run(args: Any) -> dict[str, Any]:
    home = scratch_home("wake")
    HOMES.append(home)
    out: dict[str, Any] = {}
    try:
        tmpl = sandlot.template(rootfs=busybox_root(), memory_mib=256, setup=[SERVE], name="web", home=home)

        def box() -> sandlot.Box:
            return sandlot.Box(template=tmpl, ports=[8000], wake_on_traffic=True, home=home).start()

        # wake through the port, against a plain resume, on one box
        one = box()
        port = one.port(8000)[1]
        first_byte(port)
        woken, resumed = [], []
        for _ in range(args.runs):
            one.suspend()
            took, body = first_byte(port)
            assert body == b"hello\n", body
            woken.append(took)
            one.suspend()
            t0 = time.monotonic()
            one.resume()
            one.exec("true")
            resumed.append(time.monotonic() - t0)
        out["wake"] = {
            "request_to_first_byte_s": summary(woken, digits=3),
            "resume_to_first_exec_s": summary(resumed, digits=3),
            "over_resume": round(summary(woken)["median"] / max(summary(resumed)["median"], 1e-9), 2),
        }
        accel = one.accel

        # cycles: the counter goes on, the files stay
        last = 0
        for i in range(args.cycles):
            one.exec("sh", "-c", f"echo {i} > /www/f{i}")
            one.suspend()
            _, count = first_byte(port, "/count")
            n = int(count)
            assert n >= last, f"cycle {i}: the counter went back from {last} to {n}"
            last = n
            files = one.exec("sh", "-c", "ls /www | grep -c '^f'").stdout.strip()
            assert int(files) == i + 1, f"cycle {i}: {files} files of {i + 1}"
        out["cycles"] = {"cycles": args.cycles, "intact": True, "counter_at_end": last}
        one.remove(force=True)

        # quota: each wake past a quota of one awake box puts the other, idle, to sleep first
        key, _ = create_key("one-awake", max_awake=1, home=home)
        pair: list[sandlot.Box] = []
        # (a second past MIN_IDLE, not a fifth: in a suite's run on a loaded host, the awake box
        # was once not idle for MIN_IDLE by its agent's count 2.2 s after its start, and the
        # wake failed for the quota)
        for _ in range(2):  # the second's start puts the first, idle, to sleep
            time.sleep(MIN_IDLE + 1.0 if pair else 0)
            pair.append(sandlot.Box(template=tmpl, ports=[8000], wake_on_traffic=True, home=home,
                                    labels={KEY_LABEL: key.id}).start())  # fmt: skip
        pair_ports = [b.port(8000)[1] for b in pair]
        past_quota = []
        for i in range(args.runs):
            time.sleep(MIN_IDLE + 1.0)  # the awake one idle, so it may go
            took, body = first_byte(pair_ports[i % 2])
            assert body == b"hello\n", body
            past_quota.append(took)
            states = sorted(b.refresh() for b in pair)
            assert states == ["running", "suspended"], states
        out["quota"] = {
            "max_awake": 1,
            "request_to_first_byte_s": summary(past_quota, digits=3),
            "over_plain_wake": round(summary(past_quota)["median"] / max(summary(woken)["median"], 1e-9), 2),
        }
        for b in pair:
            b.remove(force=True)

        # storm: every box asleep, then one request to each at once
        boxes = [box() for _ in range(args.boxes)]
        ports = [b.port(8000)[1] for b in boxes]
        for p in ports:
            first_byte(p)
        for b in boxes:
            b.suspend()
        asleep = {
            "keeper_rss_MiB": round(rss_kib("sandlot.api.port_keeper") / 1024, 1),
            "qemu_rss_MiB": round(rss_kib("qemu-system") / 1024, 1),
            "home_MiB": round(tree_bytes(home) / (1 << 20), 1),
        }
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(ports)) as pool:
            replies = list(pool.map(first_byte, ports))
        wall = time.monotonic() - t0
        assert all(body == b"hello\n" for _, body in replies)
        times = [t for t, _ in replies]
        out["storm"] = {
            "boxes": args.boxes,
            "answered": len(replies),
            "asleep": asleep,
            "request_to_first_byte_s": summary(times, digits=3),
            "all_answered_s": round(wall, 3),
        }
        for b in boxes:
            b.remove(force=True)

        if args.sleepers:
            out["sleepers"] = sleepers(args, home, tmpl)
        out["deep"] = deep(args)
        out["host"] = host_facts(accel)
    finally:
        drop_home(home)
    return out


def cpu_seconds(name: str) -> dict[tuple[str, str], float]:
    """CPU seconds spent so far by each process whose command line holds ``name``, by its
    pid and what it runs (the module of ``python -m``, else the program)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(name.encode() in a for a in argv):
                what = argv[argv.index(b"-m") + 1] if b"-m" in argv else Path(argv[0].decode()).name.encode()
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[(pid, what.decode())] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sleepers(args: Any, home: Path, tmpl: sandlot.Snapshot) -> dict[str, Any]:
    """``--sleepers`` boxes asleep at once: what they hold, and what the host spends on them."""
    before_mib, home_before = available_mib(), tree_bytes(home)
    made: list[float] = []
    boxes = []
    for _ in range(args.sleepers):
        t0 = time.monotonic()
        b = sandlot.Box(template=tmpl, ports=[8000], wake_on_traffic=True, home=home).start()
        b.suspend()
        made.append(time.monotonic() - t0)
        boxes.append(b)
    # what the last suspends left settles: the metrics sampler ends once no VM has run in
    # the home for its IDLE_S (30 s); the figure is what stays, as long as they sleep
    settled = time.monotonic()
    while (fd := try_flock(metrics_lock(home))) is None:
        assert time.monotonic() - settled < 120, "the home's sampler never ended"
        time.sleep(1)
    os.close(fd)
    settled = time.monotonic() - settled
    mine = str(home)  # this home's processes alone: its helpers name it, its VMs' files are in it
    cpu0, t0 = cpu_seconds(mine), time.monotonic()
    time.sleep(args.idle_seconds)
    cpu1 = cpu_seconds(mine)
    took_s = time.monotonic() - t0
    # each process's own spending: one that ended meanwhile is counted up to the last
    # look, one that began from its start
    by_what: dict[str, float] = {}
    for p, now in cpu1.items():
        by_what[p[1]] = by_what.get(p[1], 0.0) + now - cpu0.get(p, 0.0)
    idle_cpu = sum(by_what.values()) / took_s
    held = {
        "boxes": len(boxes),
        "made_and_put_to_sleep_s": summary(made, digits=3),
        "host_memory_taken_MiB": round(before_mib - available_mib(), 1),
        "keeper_rss_MiB": round(rss_kib("sandlot.api.port_keeper") / 1024, 1),
        "home_processes_rss_MiB": round(rss_kib(mine) / 1024, 1),
        "home_added_MiB": round((tree_bytes(home) - home_before) / (1 << 20), 1),
        "home_added_per_box_MiB": round((tree_bytes(home) - home_before) / (1 << 20) / len(boxes), 2),
        "idle_cpu_percent_of_one_core": round(idle_cpu * 100, 2),
        "idle_cpu_percent_by_process": {w: round(c / took_s * 100, 2) for w, c in sorted(by_what.items())},
        "settled_after_s": round(settled, 1),
    }
    took, body = first_byte(boxes[len(boxes) // 2].port(8000)[1])
    assert body == b"hello\n", body
    held["one_woken_request_to_first_byte_s"] = round(took, 3)
    for b in boxes:
        b.remove(force=True)
    return held


def deep(args: Any) -> dict[str, Any]:
    """A box asleep past the tier's ``evict_after`` (its memory only in the bucket: moto's
    S3 server on 127.0.0.1), woken by a request: lazily (``core/lazymem.py``), beside a
    resume that reads its whole memory from the tier first, in the same run."""
    import tempfile

    from sandlot.config import try_flock
    from sandlot.core import pusher
    from sandlot.core.chunks import ChunkStore
    from sandlot.core.manifest import Manifest
    from sandlot.core.runtime import Runtime

    from tests.support.s3 import CREDENTIALS, s3_server

    os.environ.update(CREDENTIALS)
    home = scratch_home("wake-deep")
    HOMES.append(home)
    try:
        with tempfile.TemporaryDirectory() as work, s3_server(Path(work)) as s3:
            sandlot.storage.configure(s3.url("deep"), endpoint_url=s3.endpoint_url, evict_after=1.0,
                                      home=home)  # fmt: skip
            tmpl = sandlot.template(rootfs=busybox_root(), memory_mib=256, setup=[SERVE], name="web",
                                    home=home)  # fmt: skip
            box = sandlot.Box(template=tmpl, ports=[8000], wake_on_traffic=True, home=home).start()
            # memory of its own, in no other state of the home: a tmpfs of random bytes
            mib = args.resident_mib
            box.sh(f"mkdir -p /run/m && mount -t tmpfs tmpfs /run/m && "
                   f"dd if=/dev/urandom of=/run/m/blob bs=1M count={mib} 2>/dev/null")  # fmt: skip
            digest = box.exec("sha256sum", "/run/m/blob").stdout.split()[0]
            port = box.port(8000)[1]
            rt, store = Runtime.for_home(home), ChunkStore(home)

            def deep_sleep() -> int:
                """Suspend, and wait for the pusher to evict its memory: the chunks it read
                from the tier to wake."""
                box.suspend()
                state = rt.store.get(box.id).suspended or ""
                ram = Manifest.decode(rt.store.state_manifest(state) or b"", state).image("microvm.ram")
                deadline = time.monotonic() + TIMEOUT
                while all(store.path(d).exists() for d in ram.digests if d):
                    assert time.monotonic() < deadline, "the box's memory never left this host"
                    time.sleep(0.1)
                while (fd := try_flock(pusher.lock_path(home))) is None:  # its eviction ended
                    assert time.monotonic() < deadline, "the pusher never ended"
                    time.sleep(0.1)
                os.close(fd)
                return sum(1 for d in ram.digests if d and not store.path(d).exists())

            lazy, whole, remote, helper_rss, filled_rss = [], [], [], [], []
            for _ in range(1 if args.quick else args.runs):  # (a minute a run here)
                remote.append(deep_sleep())
                took, body = first_byte(port)
                assert body == b"hello\n", body
                lazy.append(took)
                helper_rss.append(helpers_rss_kib() / 1024)
                # every page of it, through the helper: what a lazy wake brought is the memory it left
                assert box.exec("sha256sum", "/run/m/blob").stdout.split()[0] == digest, "the memory changed"
                filled_rss.append(rss_once_filled() / 1024)
                deep_sleep()
                os.environ["SANDLOT_LAZY_RESTORE"] = "never"
                try:
                    t0 = time.monotonic()
                    box.resume()
                    box.exec("true")
                    whole.append(time.monotonic() - t0)
                finally:
                    del os.environ["SANDLOT_LAZY_RESTORE"]
            # this home's fork server (another home's may run beside), not its helpers: forked,
            # their command line is the server's
            helpers = {str(pid) for _, pid in lazymem.helpers()}
            server_rss = sum(pid_rss_kib(pid) for pid, _ in processes(f"--fork-server\0{home}\0")
                             if pid not in helpers) / 1024  # fmt: skip
            box.remove(force=True)
        return {
            "resident_MiB": args.resident_mib,
            "chunks_in_tier_only": summary([float(n) for n in remote]),
            "request_to_first_byte_s": summary(lazy, digits=3),
            "resume_read_whole_first_s": summary(whole, digits=3),
            "lazy_over_whole": round(summary(lazy)["median"] / max(summary(whole)["median"], 1e-9), 2),
            "helper_rss_MiB": round(summary(helper_rss)["median"], 1),  # at the first byte, mid-fill
            "helper_rss_filled_MiB": round(summary(filled_rss)["median"], 1),  # as long as the box runs
            "fork_server_rss_MiB": round(server_rss, 1),  # one per home, forking each helper warm
            "woken_lazily": min(helper_rss) > 0,  # auto: from lazymem.LAZY_FROM chunks in the tier only
            "memory_intact": True,
        }
    finally:
        drop_home(home)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--boxes", type=int, default=50)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--sleepers", type=int, default=0, help="boxes asleep at once (0: none)")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--resident-mib", type=int, default=96, help="memory of its own of the deep sleeper")
    args = ap.parse_args()
    if args.quick:
        args.boxes, args.cycles, args.runs, args.sleepers, args.idle_seconds = 3, 3, 2, 3, 3.0
        args.resident_mib = 72  # past lazymem.LAZY_FROM: the quick mode wakes it lazily too
    emit({"benchmark": "wake", "quick": args.quick, **run(args)})


if __name__ == "__main__":
    main()
