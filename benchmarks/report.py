"""The engines side by side (issue 15): the same workloads, in one run, on every
engine this host has, and on the host itself under ``bwrap`` as the floor.

Engines (columns): QEMU with KVM where KVM really works, QEMU with TCG, gVisor
(``runsc``), and the host process in a bubblewrap sandbox over the same root
filesystem (Debian with python3), so every column runs the same binaries; that
sandbox is kept running with a small exec server in it, so its commands start
and answer the way an engine's agent's do. The floor runs before the engines and
after them, and keeps the better figure of each workload. An
engine this host lacks is a column that says why.

Workloads (rows): start -> first exec (a cold boot, no template); exec ``true``;
a CPU-bound Python loop; sha256 of 100 MB; unpacking a wheel (pygments, taken
from this environment) and importing from it; writing (with fsync) and reading
100 MB; snapshot; restore -> first exec (a rollback); fork 8 -> all answer; the
idle PSS of a fresh 256 MiB box (the engine's whole process tree). The
workloads run in 512 MiB boxes. Timed from
the host around each command, as a user sees it. A cell an engine cannot fill
says why.

Writes ``report.json``, ``report.md`` (a table with each figure's ratio to the
host floor) and PNG charts (matplotlib) into ``--out`` (default
``benchmarks/out/report-<date>``), and prints the JSON document.

    .venv/bin/python benchmarks/report.py [--out DIR] [--engines qemu-tcg,gvisor,host] [--quick]
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import sandlot
from sandlot import AsyncBox

from _common import (
    CACHE,
    box_pss_mib,
    debian_root,
    drop_home,
    emit,
    gvisor_unusable,
    host_facts,
    parser,
    scratch_home,
    summary,
    tree_pss_mib,
)
from network import CLIENT, host_client, serve

HOST = "host"  # the floor's column
ENGINES = ("qemu-kvm", "qemu-tcg", "gvisor", HOST)
BOX_OPTIONS = {
    "qemu-kvm": {"engine": "qemu", "accel": "kvm"},
    "qemu-tcg": {"engine": "qemu", "accel": "tcg"},
    "gvisor": {"engine": "gvisor"},
}
LABELS = {"qemu-kvm": "QEMU-KVM", "qemu-tcg": "QEMU-TCG", "gvisor": "gVisor", HOST: "host (bwrap)"}

# (key, row label, unit of the table: "ms", "s" or "MiB")
WORKLOADS = (
    ("start_to_first_exec", "start -> first exec", "ms"),
    ("exec_true_p50", "exec `true` p50", "ms"),
    ("exec_true_p99", "exec `true` p99", "ms"),
    ("cpu_python_loop", "CPU-bound Python loop", "s"),
    ("sha256_100MB", "sha256 of {mb} MB", "s"),
    ("wheel_unpack_import", "unpack a wheel, import from it", "s"),
    ("file_write_100MB", "write {mb} MB (fsync)", "s"),
    ("file_read_100MB", "read {mb} MB", "s"),
    ("snapshot", "snapshot", "ms"),
    ("restore_to_first_exec", "restore -> first exec", "ms"),
    ("fork_8_all_answer", "fork {fork} -> all answer", "s"),
    ("http_direct", "HTTP request to the host, direct", "ms"),
    ("http_proxied", "HTTP request through the egress proxy", "ms"),
    ("proxy_over_direct", "the proxy's cost over direct", "ms"),
    ("restore_net_to_first_exec", "restore -> first exec, with a network card", "ms"),
    ("idle_pss", "idle PSS (256 MiB box)", "MiB"),
)
NO_SAVED_STATE = "a host process has no saved state"
MEMORY_MIB = 512  # the workloads' boxes (python3 and 100 MB files)
IDLE_MEMORY_MIB = 256  # the idle box whose host memory is read, as in benchmarks/core.py
BENCH = "/var/tmp/bench"  # the workloads' directory, inside every box and sandbox


@dataclasses.dataclass
class Sizes:
    boots: int = 5
    execs: int = 200
    reps: int = 3
    loop: int = 3_000_000  # iterations of the Python loop (about a second on the host here)
    mb: int = 100  # the size of the sha256 and file workloads, in MB (10**6 bytes)
    snapshots: int = 5
    fork: int = 8
    settle: float = 5.0  # seconds an idle box rests before its PSS is read
    requests: int = 50  # HTTP requests per path, each on a new connection

    @classmethod
    def quick(cls) -> Sizes:
        return cls(boots=2, execs=20, reps=1, loop=200_000, mb=8, snapshots=2, fork=2, settle=1.0, requests=5)


@dataclasses.dataclass
class Column:
    """One engine's results: workload key -> cell (figures, or why there are none)."""

    cells: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def put(self, key: str, seconds: list[float] | None = None, **cell: Any) -> None:
        if seconds is not None:
            cell = {**summary(seconds, digits=4), **cell}
        self.cells[key] = cell

    def why_not(self, keys: list[str], reason: str, error: bool = False) -> None:
        for key in keys:
            self.cells.setdefault(key, {"error" if error else "skipped": reason})


# -- the workloads, as shell commands every column runs the same way ----------------------


def cpu_loop(n: int) -> list[str]:
    return ["python3", "-c", f"s = 0\nfor i in range({n}):\n    s += i * i\nprint(s)"]


def wheel_import(run: int) -> list[str]:
    code = (
        "import sys, zipfile\n"
        f"d = '{BENCH}/wheel-{run}'\n"
        f"zipfile.ZipFile('{BENCH}/pygments.whl').extractall(d)\n"
        "sys.path.insert(0, d)\n"
        "from pygments import highlight\n"
        "from pygments.formatters.html import HtmlFormatter\n"
        "from pygments.lexers.python import PythonLexer\n"
        "assert 'span' in highlight('x = [i * i for i in range(9)]', PythonLexer(), HtmlFormatter())\n"
    )
    return ["python3", "-c", code]


def make_wheel() -> Path:
    """A wheel of pygments (pure Python, about 1 MB zipped, 1,000 files unpacked), made
    once from this environment's copy; the import runs with the image's python3."""
    import pygments

    src = Path(pygments.__file__).parent
    dest = CACHE / f"bench-pygments-{pygments.__version__}.whl"
    if not dest.exists():
        tmp = dest.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(src.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    z.write(f, Path("pygments") / f.relative_to(src))
        tmp.rename(dest)
    return dest


class Failed(Exception):
    """A workload's command failed: its cell says so."""


# -- a box of one engine --------------------------------------------------------------------


async def check(box: AsyncBox, argv: list[str]) -> None:
    r = await box.exec(*argv)
    if not r.ok:
        raise Failed(f"{argv[0]} exited {r.exit_code}: {r.stderr.strip()[-300:]}")


async def timed(box: AsyncBox, argv: list[str]) -> float:
    t0 = time.perf_counter()
    await check(box, argv)
    return time.perf_counter() - t0


async def measure(col: Column, keys: list[str], work: Callable[[], Awaitable[None]]) -> None:
    """Run one workload; a failure becomes the reason in its cells, and the run goes on."""
    try:
        await work()
    except (sandlot.SandlotError, Failed, OSError, AssertionError) as exc:
        col.why_not(keys, f"{type(exc).__name__}: {exc}"[:300], error=True)


Work = Callable[[AsyncBox], Awaitable[None]]


class EngineRun:
    """The workloads on boxes of one engine, filling one column."""

    def __init__(self, name: str, root: Path, home: Path, wheel: Path, sz: Sizes) -> None:
        self.col, self.sz, self.wheel = Column(), sz, wheel
        self.opts: dict[str, Any] = {"rootfs": root, "memory_mib": MEMORY_MIB, "template": False,
                                     "home": home, **BOX_OPTIONS[name]}  # fmt: skip

    async def run(self) -> Column:
        await measure(self.col, ["start_to_first_exec"], self.boots)
        await self.on_a_box([(["exec_true_p50", "exec_true_p99"], self.execs),
                             (["cpu_python_loop"], self.cpu), (["sha256_100MB"], self.sha),
                             (["wheel_unpack_import"], self.wheel_import),
                             (["file_write_100MB", "file_read_100MB"], self.files)])  # fmt: skip
        # Live state on a fresh box: gVisor's checkpoint grows with the commands a sandbox
        # has run (architecture.md), and the runs above should not weigh on it.
        await self.on_a_box([(["snapshot"], self.snapshots), (["restore_to_first_exec"], self.restores),
                             (["fork_8_all_answer"], self.forks)])  # fmt: skip
        await measure(self.col, ["http_direct", "http_proxied", "proxy_over_direct"], self.requests)
        await measure(self.col, ["restore_net_to_first_exec"], self.network_restores)
        await measure(self.col, ["idle_pss"], self.idle)
        return self.col

    async def on_a_box(self, works: list[tuple[list[str], Work]]) -> None:
        box = AsyncBox(**self.opts)
        try:
            await box.start()
            await check(box, ["mkdir", "-p", BENCH])
            for keys, work in works:
                await measure(self.col, keys, functools.partial(work, box))
        except (sandlot.SandlotError, Failed, OSError) as exc:  # the box itself failed
            self.col.why_not(
                [k for keys, _ in works for k in keys], f"{type(exc).__name__}: {exc}"[:300], True
            )
        finally:
            await box.remove(force=True)

    async def boots(self) -> None:
        times = []
        async with AsyncBox(**self.opts):  # untimed: makes the base disk (or root) of the root filesystem
            pass
        for _ in range(self.sz.boots):
            box = AsyncBox(**self.opts)
            try:
                t0 = time.perf_counter()
                await box.start()
                await check(box, ["true"])
                times.append(time.perf_counter() - t0)
            finally:
                await box.remove(force=True)
        self.col.put("start_to_first_exec", times)

    async def execs(self, box: AsyncBox) -> None:
        s = summary([await timed(box, ["true"]) for _ in range(self.sz.execs)], digits=4)
        self.col.put("exec_true_p50", value=s["median"], n=s["n"])
        self.col.put("exec_true_p99", value=s["p99"], n=s["n"])

    async def cpu(self, box: AsyncBox) -> None:
        self.col.put(
            "cpu_python_loop", [await timed(box, cpu_loop(self.sz.loop)) for _ in range(self.sz.reps)]
        )

    async def sha(self, box: AsyncBox) -> None:
        await check(box, ["sh", "-c", f"head -c {self.sz.mb * 10**6} /dev/zero > {BENCH}/blob"])
        times = [await timed(box, ["sha256sum", f"{BENCH}/blob"]) for _ in range(self.sz.reps)]
        self.col.put("sha256_100MB", times)
        await check(box, ["rm", "-f", f"{BENCH}/blob"])

    async def wheel_import(self, box: AsyncBox) -> None:
        await box.files.upload(self.wheel, f"{BENCH}/pygments.whl")
        times = []
        for i in range(self.sz.reps):
            times.append(await timed(box, wheel_import(i)))
            await check(box, ["rm", "-rf", f"{BENCH}/wheel-{i}"])
        self.col.put("wheel_unpack_import", times)

    async def files(self, box: AsyncBox) -> None:
        writes, reads, f = [], [], f"{BENCH}/file"
        for _ in range(self.sz.reps):
            writes.append(await timed(box, dd(f"of={f}", self.sz.mb, "conv=fsync")))
            reads.append(await timed(box, dd(f"if={f}", self.sz.mb)))
            await check(box, ["rm", "-f", f])
        self.col.put("file_write_100MB", writes)
        self.col.put("file_read_100MB", reads)

    async def snapshots(self, box: AsyncBox) -> None:
        walls = []
        for _ in range(self.sz.snapshots):
            t0 = time.perf_counter()
            snap = await box.snapshot()
            walls.append(time.perf_counter() - t0)
            await snap.remove()
        self.col.put("snapshot", walls)

    async def restores(self, box: AsyncBox, key: str = "restore_to_first_exec") -> None:
        snap = await box.snapshot("report-base")
        walls = []
        for _ in range(self.sz.snapshots):
            t0 = time.perf_counter()
            await box.rollback(snap)
            await check(box, ["true"])
            walls.append(time.perf_counter() - t0)
        await snap.remove()
        self.col.put(key, walls)

    async def forks(self, box: AsyncBox) -> None:
        t0 = time.perf_counter()
        kids = await box.fork(self.sz.fork)
        try:
            await asyncio.gather(*(check(k, ["true"]) for k in kids))
            self.col.put("fork_8_all_answer", [time.perf_counter() - t0], children=self.sz.fork)
        finally:
            for k in kids:
                await k.remove(force=True)

    async def requests(self) -> None:
        """One HTTP server on the host's 127.0.0.1; a client in the box makes each request
        on a new connection: straight to it (open mode, the host at 10.0.2.2), then
        through the egress proxy of a box whose allowlist names it."""
        server = serve(b"big")
        port = server.server_address[1]
        try:
            async with AsyncBox(**self.opts, network="open") as box:
                direct = await box_requests(box, f"http://10.0.2.2:{port}", self.sz.requests)
            async with AsyncBox(**self.opts, network="allowlist", allow=[f"127.0.0.1:{port}"]) as box:
                proxied = await box_requests(box, f"http://127.0.0.1:{port}", self.sz.requests, PROXY)
        finally:
            server.shutdown()
        self.col.put("http_direct", direct, n=len(direct))
        self.col.put("http_proxied", proxied, n=len(proxied))
        over = summary(proxied, digits=4)["median"] - summary(direct, digits=4)["median"]
        self.col.put("proxy_over_direct", value=round(over, 4), note="median over median")

    async def network_restores(self) -> None:
        async with AsyncBox(**self.opts, network="allowlist") as box:
            await check(box, ["true"])
            await self.restores(box, key="restore_net_to_first_exec")

    async def idle(self) -> None:
        async with AsyncBox(**{**self.opts, "memory_mib": IDLE_MEMORY_MIB}) as box:
            await check(box, ["true"])
            await asyncio.sleep(self.sz.settle)
            self.col.put("idle_pss", value=box_pss_mib(await box.inspect()))


PROXY = "http://10.0.2.100:3128"  # the egress proxy's address in every box


async def box_requests(box: AsyncBox, url: str, runs: int, proxy: str | None = None) -> list[float]:
    """``runs`` requests from the box (network.py's client), each on a new connection:
    their seconds, timed in the box."""
    argv = ["python3", "-c", CLIENT, url, str(runs), "big", *([proxy] if proxy else [])]
    r = await box.exec(*argv, timeout=600, env={"NO_PROXY": "", "no_proxy": ""})
    if r.returncode != 0:
        raise Failed(f"the HTTP client failed: {r.stderr[-300:]}")
    latency: list[float] = json.loads(r.stdout)["latency"]
    return latency


def dd(target: str, mb: int, *extra: str) -> list[str]:
    """dd of ``mb`` MB between ``target`` and /dev/zero or /dev/null."""
    other = "if=/dev/zero" if target.startswith("of=") else "of=/dev/null"
    return ["dd", other, target, "bs=1000000", f"count={mb}", "status=none", *extra]


# -- the floor: the host process in a bubblewrap sandbox over the same root ----------------


# The floor's agent: a process in the sandbox that runs each command it is sent (a
# JSON argv per line) and answers its exit status, as the engines' agents do.
SERVER = """
import json, subprocess, sys
for line in sys.stdin:
    r = subprocess.run(json.loads(line), stdin=subprocess.DEVNULL, capture_output=True)
    print(json.dumps([r.returncode, r.stderr[-300:].decode(errors="replace")]), flush=True)
"""


class Bwrap:
    """A bubblewrap sandbox over the root filesystem (read-only, namespaces of its own,
    ``/var/tmp/bench`` a host directory), kept running with a small exec server in it:
    what an engine adds is measured against a host process that is started, and
    answers, the same way."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.prefix = ["bwrap", "--ro-bind", str(root), "/", "--proc", "/proc", "--dev", "/dev",
                       "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--bind", str(scratch), BENCH,
                       "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                       "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                       "--setenv", "HOME", "/tmp"]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> float:
        """Start the sandbox; the time to the first command's answer."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([*self.prefix, "python3", "-c", SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.run(["true"])
        return time.perf_counter() - t0

    def run(self, argv: list[str]) -> float:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        t0 = time.perf_counter()
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise Failed(f"the bwrap sandbox ended (status {self.proc.wait(10)})")
        code, err = json.loads(line)
        if code:
            raise Failed(f"{argv[0]} exited {code}: {err.strip()}")
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def run_host(root: Path, scratch: Path, wheel: Path, sz: Sizes) -> Column:
    """The floor's column; ``scratch`` on the file system of the boxes' disks."""
    col = Column()
    d = Path(tempfile.mkdtemp(prefix="report-bwrap-", dir=scratch))
    bw = Bwrap(root, d)

    def execs() -> None:
        bw.start()  # the page cache warm, as the engines' own first boots leave it
        bw.stop()
        starts = []
        for _ in range(sz.boots):
            starts.append(bw.start())
            bw.stop()
        col.put("start_to_first_exec", starts)
        bw.start()
        s = summary([bw.run(["true"]) for _ in range(sz.execs)], digits=4)
        col.put("exec_true_p50", value=s["median"], n=s["n"])
        col.put("exec_true_p99", value=s["p99"], n=s["n"])

    def sha() -> None:
        (d / "blob").write_bytes(bytes(sz.mb * 10**6))
        col.put("sha256_100MB", [bw.run(["sha256sum", f"{BENCH}/blob"]) for _ in range(sz.reps)])
        (d / "blob").unlink()

    def wheel_work() -> None:
        shutil.copy(wheel, d / "pygments.whl")
        times = []
        for i in range(sz.reps):
            times.append(bw.run(wheel_import(i)))
            shutil.rmtree(d / f"wheel-{i}")
        col.put("wheel_unpack_import", times)

    def files() -> None:
        writes, reads = [], []
        for _ in range(sz.reps):
            writes.append(bw.run(dd(f"of={BENCH}/file", sz.mb, "conv=fsync")))
            reads.append(bw.run(dd(f"if={BENCH}/file", sz.mb)))
            (d / "file").unlink()
        col.put("file_write_100MB", writes)
        col.put("file_read_100MB", reads)

    def idle() -> None:
        assert bw.proc is not None
        time.sleep(sz.settle)
        col.put("idle_pss", value=tree_pss_mib(bw.proc.pid), note="bwrap and its exec server (python3)")

    works: list[tuple[list[str], Callable[[], None]]] = [
        (["start_to_first_exec", "exec_true_p50", "exec_true_p99"], execs),
        (
            ["cpu_python_loop"],
            lambda: col.put("cpu_python_loop", [bw.run(cpu_loop(sz.loop)) for _ in range(sz.reps)]),
        ),
        (["sha256_100MB"], sha),
        (["wheel_unpack_import"], wheel_work),
        (["file_write_100MB", "file_read_100MB"], files),
        (["idle_pss"], idle),
    ]
    try:
        for keys, work in works:
            try:
                work()
            except (Failed, OSError, subprocess.SubprocessError, AssertionError) as exc:
                col.why_not(keys, f"{type(exc).__name__}: {exc}"[:300], error=True)
    finally:
        bw.stop()
        shutil.rmtree(d, ignore_errors=True)
    try:
        server = serve(b"big")
        try:
            latency = host_client(f"http://127.0.0.1:{server.server_address[1]}", sz.requests)["latency"]
        finally:
            server.shutdown()
        col.put("http_direct", latency, n=len(latency))
        col.put("http_proxied", latency, n=len(latency), note="no proxy: the same request, direct")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        col.why_not(["http_direct", "http_proxied"], f"{type(exc).__name__}: {exc}"[:300], error=True)
    col.why_not(["proxy_over_direct"], "a host process has no proxy")
    col.why_not(["snapshot", "restore_to_first_exec", "fork_8_all_answer", "restore_net_to_first_exec"],
                NO_SAVED_STATE)  # fmt: skip
    return col


def best_of(runs: list[Column]) -> dict[str, dict[str, Any]]:
    """Per workload, the cell with the lower figure (a cell without one only if all are)."""
    out: dict[str, dict[str, Any]] = {}
    for col in runs:
        for key, cell in col.cells.items():
            mine, best = value_of(cell), value_of(out.get(key, {}))
            if key not in out or (mine is not None and (best is None or mine < best)):
                out[key] = {**cell, "runs": len(runs)}
    return out


# -- which engines this host has ------------------------------------------------------------


def availability(wanted: list[str]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Each engine: usable here, or why not (from ``doctor``); and QEMU's accelerator."""
    report = sandlot.Runtime.for_home().doctor()
    accel = report.get("accel") or {}
    out: dict[str, dict[str, Any]] = {}
    for name in ENGINES:
        if name not in wanted:
            out[name] = {"available": False, "reason": "not asked for (--engines)"}
        elif name == "qemu-kvm" and accel.get("name") != "kvm":
            out[name] = {"available": False, "reason": f"no usable KVM: {accel.get('reason', 'unknown')}"}
        elif name == "qemu-tcg" and "version" not in (report.get("qemu") or {}):
            out[name] = {"available": False, "reason": f"no QEMU: {report.get('qemu')}"}
        elif name == "gvisor" and (why := gvisor_unusable(report)):
            out[name] = {"available": False, "reason": why}
        elif name == HOST and shutil.which("bwrap") is None:
            out[name] = {"available": False, "reason": "bwrap is not installed (apt package bubblewrap)"}
        else:
            out[name] = {"available": True}
    return out, accel.get("name")


# -- output ---------------------------------------------------------------------------------


def value_of(cell: dict[str, Any]) -> float | None:
    v = cell.get("median", cell.get("value"))
    return float(v) if isinstance(v, int | float) else None


def ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each engine's figure over the host floor's, per workload where both exist."""
    floor = results.get(HOST, {})
    out: dict[str, dict[str, float]] = {}
    for name, cells in results.items():
        if name == HOST:
            continue
        for key, cell in cells.items():
            mine, base = value_of(cell), value_of(floor.get(key, {}))
            if mine is not None and base:
                out.setdefault(name, {})[key] = round(mine / base, 2)
    return out


def shown(cell: dict[str, Any] | None, unit: str) -> str:
    if cell is None:
        return "-"
    v = value_of(cell)
    if v is None:
        return "n/a: " + str(cell.get("skipped") or cell.get("error") or "no figure").replace("|", "/")
    if unit == "MiB":
        return f"{v:.0f} MiB"
    return f"{v * 1000:.1f} ms" if unit == "ms" else f"{v:.2f} s"


def markdown(doc: dict[str, Any]) -> str:
    engines, results, rat = doc["engines"], doc["results"], doc["ratios_to_host"]
    cols = [n for n in ENGINES if engines[n]["available"]]
    lines = [
        f"Engines side by side ({'quick run' if doc['quick'] else 'full run'}, {doc['date']}; "
        f"{doc['host']['cpu']}, {doc['host']['cores']} cores). Medians; in brackets, the ratio to the "
        "host process under bwrap (the better of a run before the engines and one after: the "
        "host is shared, and this floor errs against the engines).",
        "",
        "| workload | " + " | ".join(LABELS[n] for n in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for key, label, unit in WORKLOADS:
        label = label.format(**doc["sizes"])
        row = []
        for n in cols:
            text = shown(results[n].get(key), unit)
            if n in rat and key in rat[n]:
                text += f" ({rat[n][key]:g}x)"
            row.append(text)
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    skipped = [n for n in ENGINES if not engines[n]["available"]]
    if skipped:
        lines.append("")
        lines += [f"- {LABELS[n]}: not run: {engines[n]['reason']}" for n in skipped]
    return "\n".join(lines) + "\n"


def charts(doc: dict[str, Any], out: Path) -> list[str]:
    """Three PNGs: the timed workloads (log scale), their ratios to the host floor, idle memory."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    results, rat = doc["results"], doc["ratios_to_host"]
    cols = [n for n in ENGINES if doc["engines"][n]["available"]]
    timed_rows = [(k, label.format(**doc["sizes"])) for k, label, unit in WORKLOADS if unit != "MiB"]
    written = []

    def bars(name: str, rows: list[tuple[str, str]], engines: list[str],
             value: Callable[[str, str], float | None], xlabel: str, log: bool,
             marks: tuple[float, ...] = ()) -> None:  # fmt: skip
        rows = [(k, label) for k, label in rows if any(value(n, k) for n in engines)]
        fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * len(rows) * max(1, len(engines)) / 2))
        height = 0.8 / max(1, len(engines))
        for i, n in enumerate(engines):
            ys = [r + i * height for r in range(len(rows))]
            vals = [value(n, k) for k, _ in rows]
            ax.barh([y for y, v in zip(ys, vals, strict=True) if v], [v for v in vals if v],
                    height=height, label=LABELS[n])  # fmt: skip
        ax.set_yticks([r + 0.4 - height / 2 for r in range(len(rows))], [label for _, label in rows])
        ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        for m in marks:
            ax.axvline(m, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        if len(rows) > 2:  # below the axis, clear of the bars
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(engines), fontsize="small")
        else:  # one row: the short bars leave the lower right free
            ax.legend(loc="lower right", fontsize="small")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    bars("times.png", timed_rows, cols, lambda n, k: value_of(results[n].get(k, {})),
         "seconds (median, log scale)", log=True)  # fmt: skip
    bars("ratios.png", timed_rows, [n for n in cols if n != HOST], lambda n, k: rat.get(n, {}).get(k),
         "times the host process under bwrap (log scale; lines at 1 and 1.3)",
         log=True, marks=(1.0, 1.3))  # fmt: skip
    bars("memory.png", [("idle_pss", "idle PSS")], cols, lambda n, k: value_of(results[n].get(k, {})),
         "MiB of host memory (PSS of the whole process tree)", log=False)  # fmt: skip
    return written


def default_out() -> Path:
    return Path(__file__).resolve().parent / "out" / f"report-{time.strftime('%Y%m%d-%H%M%S')}"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument(
        "--out", type=Path, default=None, help="the folder to write (default benchmarks/out/report-<date>)"
    )
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help=f"a comma-separated subset of {', '.join(ENGINES)}"
    )
    ap.add_argument(
        "--root", type=Path, default=None, help="a root filesystem with python3 (default: Debian's)"
    )
    ap.add_argument("--redraw", type=Path, default=None, metavar="DIR",
                    help="only write report.md and the charts again from DIR/report.json")  # fmt: skip
    args = ap.parse_args()
    if args.redraw:
        doc = json.loads((args.redraw / "report.json").read_text())
        (args.redraw / "report.md").write_text(markdown(doc))
        charts(doc, args.redraw)
        return
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(wanted) - set(ENGINES))
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    sz = Sizes.quick() if args.quick else Sizes()
    out = (args.out or default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = args.root or debian_root()
    if not (root / "usr" / "bin" / "python3").exists():
        ap.error(f"{root} has no /usr/bin/python3")
    wheel = make_wheel()
    engines, accel = availability(wanted)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    home = scratch_home("report-")
    try:
        floors: list[Column] = []
        # The host floor runs first and last, and each figure is the better of the two:
        # on a shared host, the floor at its least loaded (a ratio errs against the engine).
        order = [HOST] + [n for n in ENGINES if n != HOST] + [HOST]
        for name in order:
            if not engines[name]["available"]:
                continue
            t0 = time.perf_counter()
            print(f"report: {name}...", file=sys.stderr, flush=True)
            if name == HOST:
                floors.append(run_host(root, home, wheel, sz))
                results[name] = best_of(floors)
            else:
                results[name] = asyncio.run(EngineRun(name, root, home, wheel, sz).run()).cells
            engines[name]["run_s"] = round(engines[name].get("run_s", 0) + time.perf_counter() - t0, 1)
    finally:
        drop_home(home)
    loads = os.getloadavg()
    doc: dict[str, Any] = {
        "benchmark": "report",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {**host_facts(accel), "loadavg_at_end": [round(x, 2) for x in loads]},
        "sizes": {**dataclasses.asdict(sz), "memory_mib": MEMORY_MIB, "idle_memory_mib": IDLE_MEMORY_MIB},
        "root": str(root),
        "engines": engines,
        "workloads": [k for k, _, _ in WORKLOADS],
        "results": results,
    }
    doc["ratios_to_host"] = ratios(results)
    files = ["report.json", "report.md"]
    (out / "report.md").write_text(markdown(doc))
    try:
        files += charts(doc, out)
    except ImportError as exc:
        doc["charts_skipped"] = f"matplotlib is not installed ({exc}): pip install 'sandlot[dev]'"
    doc["out"] = str(out)
    doc["files"] = files
    (out / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
    emit(doc)


if __name__ == "__main__":
    main()
