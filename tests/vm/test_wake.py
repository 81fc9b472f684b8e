"""Sleep when idle, wake on traffic (``wake_on_traffic=True``, ``api/port_keeper.py``):
a real box, a real HTTP server in it, real connections to its published port from this
host while it sleeps, the home's real port keeper process (killed with SIGKILL once).
The first test runs on gVisor too (scripts/test's gVisor pass)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import sandlot
from sandlot.api.port_hold import socket_path

from tests.conftest import TEST_ENGINE
from tests.support.serve import shared_home
from tests.support.waiting import scaled, wait_for

pytestmark = pytest.mark.vm

PAGE = "hello from a box that was asleep\n"


def get(port: int, timeout: float = 120) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=scaled(timeout)) as r:
        return r.read().decode()


def refused(port: int) -> bool:
    """The port takes no connection, or drops it without an answer."""
    try:
        get(port, timeout=10)
    except OSError:
        return True
    return False


def keeper_pid(home: Path) -> int | None:
    """The home's port keeper: the process that holds its lock."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"sandlot.api.port_keeper" in argv and str(home).encode() in argv:
                return int(pid)
    return None


def test_a_sleeping_box_wakes_on_a_connection_to_its_published_port(busybox_root: Path) -> None:
    # network="none": the port comes in through the agent, so the box needs no network card
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, ports=[8000], wake_on_traffic=True,
                     idle_timeout=3, engine=TEST_ENGINE) as box:  # fmt: skip
        home = sandlot.Runtime.for_home().home
        box.exec("sh", "-c", f"mkdir -p /www && printf '{PAGE}' > /www/index.html && httpd -p 8000 -h /www",
                 check=True)  # fmt: skip
        (published,) = box.ports()
        port = published["host"]
        assert port and published["guest"] == 8000
        assert get(port) == PAGE

        # an open connection is a user: the box stays awake past its idle_timeout
        with socket.create_connection(("127.0.0.1", port), timeout=30):
            time.sleep(scaled(8))
            assert box.refresh() == "running"
        wait_for("the idle box asleep", lambda: box.refresh() == "suspended", timeout=60)
        assert box.ports() == [published]  # still held, on the same host port

        # connections that come together while it sleeps wait for one resume, then pass
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda _: get(port), range(8))) == [PAGE] * 8
        assert box.refresh() == "running"
        woken = [e for e in box.events(follow=False) if e.kind == "resumed"]
        assert woken and woken[-1].by == "traffic", [(e.kind, e.by) for e in box.events(follow=False)]

        # a keeper killed holds the ports no more, until a call finds the box again
        pid = keeper_pid(home)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for("the killed keeper's port closed", lambda: refused(port), timeout=30)
        again = sandlot.Box.get(box.id)
        assert again.ports() == [published]  # the same port, bound anew
        box.suspend()
        assert get(port) == PAGE  # and the new keeper wakes the box

        # a stopped box is switched off: traffic does not start it, and its events say why
        box.stop()
        assert refused(port)
        failed = wait_for(
            "a wake_failed event", lambda: [e for e in box.events(follow=False) if e.kind == "wake_failed"]
        )
        assert "stopped" in (failed[-1].reason or "") and failed[-1].detail["port"] == 8000
    # removed: its port is let go at once
    wait_for("the removed box's port closed", lambda: refused(port), timeout=10)
    assert keeper_pid(home) is not None or not socket_path(home).exists()


def test_a_host_port_in_use_fails_the_start_with_its_name(busybox_root: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        box = sandlot.Box(rootfs=busybox_root, memory_mib=256, ports=[f"{port}:80"], wake_on_traffic=True)
        try:
            with pytest.raises(sandlot.InvalidState, match=f"cannot publish host port 127.0.0.1:{port}"):
                box.start()
            assert box.refresh() == "created"  # refused before it booted
        finally:
            box.remove(force=True)


def test_calls_that_come_together_share_the_resume_of_a_box_another_process_suspended(
    busybox_root: Path,
) -> None:
    """The keeper's case in one process: its session to the box outlived a suspend by
    another process (the idle watchdog), then many calls came at once. Each follows the
    one resume; none drops the session's reconnection for one of its own (which ended it
    as for a crash: BoxCrashed, 2 of 8 calls before the fix)."""

    async def main() -> None:
        async with sandlot.AsyncBox(rootfs=busybox_root, memory_mib=256) as box:
            await box.exec("true")
            script = f"import sandlot; sandlot.Box.get({box.id!r}).suspend()"
            # blocking the loop on purpose: the session's socket closes unread, as in a
            # keeper busy elsewhere when the watchdog suspends the box
            subprocess.run([sys.executable, "-c", script], check=True, timeout=scaled(120))  # noqa: ASYNC221
            results = await asyncio.gather(*(box.exec("echo", str(i)) for i in range(12)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]
            assert await box.refresh() == "running"

    asyncio.run(main())


def test_a_box_that_sleeps_is_put_to_sleep_when_the_host_runs_short_of_memory(
    busybox_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The home's real keeper (in its sampler process, started with this environment: a
    home of the test's own) under a low mark no host reaches, so every host is short."""
    home = shared_home(tmp_path)
    monkeypatch.setenv("SANDLOT_MEMORY_LOW_MIB", str(1 << 30))
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, idle_timeout=3600, home=home,
                     engine=TEST_ENGINE) as box:  # fmt: skip
        box.exec("sh", "-c", "echo 41 > /tmp/n && sleep 3").check()  # in use meanwhile: kept
        wait_for("the idle box put to sleep", lambda: box.refresh() == "suspended", timeout=120)
        slept = [e for e in box.events(follow=False) if e.kind == "suspended"]
        assert slept and all(e.by == "memory" for e in slept)  # maybe once before the command too
        assert "MiB available, under 1073741824 MiB" in (slept[-1].reason or "")
        assert box.exec("cat", "/tmp/n").stdout == "41\n"  # the next call wakes it, as it was


def test_a_woken_box_is_idle_from_its_wake_not_from_its_last_request_before_the_sleep(
    busybox_root: Path,
) -> None:
    """The guest's clock goes on from its sleep, so its agent counts the idle time from
    the last request before it: a new idle watchdog would put it back to sleep before
    the call that woke it arrived (a loaded host: CI's personal-apps example got a 502)."""
    with sandlot.Box(rootfs=busybox_root, memory_mib=256, idle_timeout=3600, engine=TEST_ENGINE) as box:
        box.exec("true")
        time.sleep(4)
        assert box.activity()[1] >= 3.5
        box.suspend()
        box.resume()
        busy, idle = box.activity()
        assert busy == 0 and idle < 3, idle
