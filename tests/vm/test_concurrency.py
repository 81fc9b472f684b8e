"""Many boxes at once, on real VMs: every start, fork and snapshot of a storm
answers (slower under load, never lost), and a process that used boxes exits
without a warning. The larger variants (50+) are in ``benchmarks/concurrency.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import sandlot

from tests.support.names import unique

pytestmark = pytest.mark.vm
STORM_BASE = unique("storm-base")

IMAGE = "concurrency/busybox:1"
N = 24


@pytest.fixture(scope="module")
def image(busybox_root: Path) -> Iterator[str]:
    """A busybox image whose automatic template exists: every start below is a restore."""
    sandlot.import_image(busybox_root, IMAGE)
    with sandlot.Box(IMAGE, memory_mib=256) as first:  # its first boot saves the template
        first.exec("true")
    with sandlot.Box(IMAGE, memory_mib=256) as second:
        assert second.inspect()["origin"] is not None  # restored, not booted
    yield IMAGE


def remove_all(prefix: str) -> None:
    for b in sandlot.list():
        if b.name.startswith(prefix):
            b.remove(force=True)


def run_threads(jobs: list[tuple[Callable[[int], None], int]], timeout: float) -> None:
    """Run every job at once, each on a thread of its own, and wait for them all."""
    threads = [threading.Thread(target=fn, args=(i,)) for fn, i in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_24_starts_from_one_template_at_once_from_threads(image: str) -> None:
    errors: list[BaseException] = []
    answered: list[float] = []
    t0 = time.monotonic()

    def start(i: int) -> None:
        try:
            box = sandlot.Box(image, name=f"thr-{i}", memory_mib=256, keep=True).start()
            assert box.exec("echo", str(i)).stdout == f"{i}\n"
            answered.append(time.monotonic() - t0)
        except BaseException as exc:
            errors.append(exc)

    try:
        run_threads([(start, i) for i in range(N)], timeout=600)
        assert not errors, f"{len(errors)} of {N} failed: {errors[0]!r}"
        assert len(answered) == N
        states = {b.name: b.state for b in sandlot.list() if b.name.startswith("thr-")}
        assert len(states) == N and set(states.values()) == {"running"}
    finally:
        remove_all("thr-")


def test_24_starts_from_separate_processes(image: str) -> None:
    cli = [sys.executable, "-m", "sandlot.cli"]
    procs = [
        subprocess.Popen(
            [*cli, "run", "-d", "--name", f"proc-{i}", "-m", "256", image, "sleep", "1000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(N)
    ]
    try:
        results = [(p.wait(600), p.stdout.read() if p.stdout else "", p.stderr.read() if p.stderr else "")
                   for p in procs]  # fmt: skip
        failed = [(code, err) for code, _out, err in results if code != 0]
        assert not failed, f"{len(failed)} of {N} failed: {failed[0]}"
        boxes = [sandlot.get(f"proc-{i}") for i in range(N)]
        assert all(b.state == "running" for b in boxes)
        assert all(b.exec("true").ok for b in boxes)
    finally:
        remove_all("proc-")


def test_a_mixed_storm_of_starts_forks_snapshots_and_removes(image: str) -> None:
    """Starts, forks, snapshots and removes on the same template and boxes at once:
    every operation either succeeds or is refused with a typed error, and the
    store ends consistent (every box answers, no snapshot half made)."""
    base = sandlot.Box(image, name=STORM_BASE, memory_mib=256, keep=True).start()
    errors: list[BaseException] = []
    refused: list[BaseException] = []

    def guard(fn: Callable[[int], None]) -> Callable[[int], None]:
        def run(i: int) -> None:
            try:
                fn(i)
            except sandlot.InvalidState as exc:  # e.g. removed meanwhile: refused, said why
                refused.append(exc)
            except BaseException as exc:
                errors.append(exc)

        return run

    @guard
    def start(i: int) -> None:
        b = sandlot.Box(image, name=f"storm-s{i}", memory_mib=256, keep=True).start()
        b.exec("true")
        if i % 2:
            b.remove(force=True)

    @guard
    def fork(i: int) -> None:
        kids = base.fork(2, name=f"storm-f{i}")
        for k in kids:
            assert k.exec("true").ok

    @guard
    def snapshot(i: int) -> None:
        snap = base.snapshot(f"storm-{i}")
        snap.start(1, name=f"storm-r{i}")[0].exec("true")

    jobs: list[tuple[Callable[[int], None], int]] = (
        [(start, i) for i in range(8)] + [(fork, i) for i in range(3)] + [(snapshot, i) for i in range(3)]
    )
    try:
        run_threads(jobs, timeout=900)
        assert not errors, f"{len(errors)} operations failed: {errors[0]!r}"
        assert not refused, f"refused: {refused[0]!r}"
        boxes = [b for b in sandlot.list() if b.name.startswith("storm-")]
        assert len(boxes) == 1 + 4 + 3 * 2 + 3
        assert all(b.state == "running" and b.exec("true").ok for b in boxes)
        assert {s.name for s in base.snapshots() if s.name} >= {f"storm-{i}" for i in range(3)}
    finally:
        remove_all("storm-")


SLOW_CALLBACK = re.compile(r"^Executing <.*> took \d+\.\d+ seconds$")
# a boot that hung under load and was tried again says so as it happens: not an exit's leak
BOOT_AGAIN = re.compile(r"box \S+: its guest never opened the agent's port .*; booting it again$")

CLEAN_EXIT = """
import asyncio, sandlot
root = {root!r}
with sandlot.Box(rootfs=root, memory_mib=256) as box:     # the sync API's loop thread
    box.exec("true")
    p = box.spawn("sleep", "100")                       # a process left running, and its stream
    kept = sandlot.Box(rootfs=root, memory_mib=256, keep=True).start()
async def main():
    async with sandlot.AsyncBox(rootfs=root, memory_mib=256) as b:   # a loop of the program's own
        await b.exec("true")
        again = await sandlot.AsyncBox.get(kept.name)
        await again.exec("true")
asyncio.run(main())
kept.exec("true")
print(kept.name)
"""


def test_a_process_that_used_boxes_exits_without_a_warning(busybox_root: Path) -> None:
    code = textwrap.dedent(CLEAN_EXIT).format(root=str(busybox_root))
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    r = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    try:
        assert r.returncode == 0, r.stderr
        # asyncio's debug mode also reports callbacks slower than 0.1 s: a busy host, not a leak
        noise = [ln for ln in r.stderr.splitlines()
                 if ln.strip() and not SLOW_CALLBACK.match(ln) and not BOOT_AGAIN.search(ln)]  # fmt: skip
        assert not noise, "stderr at exit:\n" + r.stderr
    finally:
        name = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else None
        if name:
            sandlot.get(name).remove(force=True)
