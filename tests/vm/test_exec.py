"""Exec in a real microVM (TCG here): streams, exit codes, signals, identity,
stdin, big outputs, concurrency, PTYs, timeouts and background processes."""

from __future__ import annotations

import hashlib
import signal
import threading
import time

import pytest

import sandlot
from sandlot import Box

from tests.support.waiting import deadline_in, scaled, wait_for

pytestmark = pytest.mark.vm


def test_echo_round_trip(bb_box: Box) -> None:
    r = bb_box.exec("echo", "hello", "world")
    assert r.exit_code == 0
    assert r.stdout == "hello world\n"
    assert r.stderr == ""
    assert r.ok and r.returncode == 0


def test_exit_codes_and_signals(bb_box: Box) -> None:
    assert bb_box.exec("sh", "-c", "exit 42").exit_code == 42
    r = bb_box.exec("sh", "-c", "kill -TERM $$")
    assert r.signal == signal.SIGTERM and r.exit_code == 128 + signal.SIGTERM
    with pytest.raises(sandlot.CommandFailed) as info:
        bb_box.exec("sh", "-c", "echo oops >&2; exit 3", check=True)
    assert info.value.result.exit_code == 3 and "oops" in str(info.value)


def test_env_cwd_and_user(bb_box: Box) -> None:
    r = bb_box.exec("sh", "-c", 'echo "$FOO|$HOME|$PATH"', env={"FOO": "bar baz"})
    assert r.stdout.startswith("bar baz|/root|/usr/local/sbin")
    assert bb_box.exec("pwd", cwd="/etc").stdout == "/etc\n"
    assert bb_box.exec("id", "-u", user="agent").stdout == "1000\n"
    r = bb_box.exec("sh", "-c", "id -u; id -g; echo $HOME; echo $USER", user="agent")
    assert r.stdout.split() == ["1000", "1000", "/home/agent", "agent"]
    assert bb_box.exec("id", "-G", user="agent").stdout.split() == ["1000", "100"]  # supplementary 'users'
    assert bb_box.exec("sh", "-c", "id -u; id -g", user="1234:5678").stdout.split() == ["1234", "5678"]
    assert bb_box.exec("id", "-g", user="agent:users").stdout == "100\n"


def test_exec_errors_are_typed(bb_box: Box) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-binary"):
        bb_box.exec("no-such-binary")
    with pytest.raises(sandlot.GuestFileNotFoundError, match="/does/not/exist"):
        bb_box.exec("true", cwd="/does/not/exist")
    with pytest.raises(sandlot.GuestError, match="unknown user"):
        bb_box.exec("true", user="nobody-here")
    with pytest.raises(PermissionError):
        bb_box.exec("/etc/passwd")
    with pytest.raises(sandlot.InvalidArgument):
        bb_box.exec()
    with pytest.raises(sandlot.InvalidArgument):
        bb_box.exec("echo", "a\0b")
    with pytest.raises(sandlot.InvalidArgument):
        bb_box.exec("true", env={"A=B": "x"})
    with pytest.raises(sandlot.InvalidArgument):
        bb_box.exec("true", cwd="relative")
    with pytest.raises(sandlot.InvalidArgument):
        bb_box.exec("true", timeout=-1)
    assert bb_box.exec("true").ok  # still fine


def test_stdin_streaming(bb_box: Box) -> None:
    assert bb_box.exec("tr", "a-z", "A-Z", stdin="hello").stdout == "HELLO"
    blob = bytes(range(256)) * 20000  # 5 MB, binary
    r = bb_box.exec("sha256sum", stdin=blob)
    assert r.stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    # no stdin given: the command reads /dev/null and does not hang
    assert bb_box.exec("cat").stdout == ""


def test_input_for_a_process_that_already_ended_is_dropped_not_refused(bb_box: Box) -> None:
    # the race of a command that exits before its stdin arrives (many execs at once
    # through sandlot serve hit it): the input goes nowhere, as into a closed pipe
    p = bb_box.spawn("sh", "-c", "exit 4")
    assert p.wait() == 4
    p.write_stdin(b"too late\n" * 1000)
    p.close_stdin()
    assert p.wait() == 4
    for _ in range(10):
        assert bb_box.exec("sh", "-c", "exit 5", stdin=b"x" * 100_000).exit_code == 5


def test_spawn_interactive_stdin(bb_box: Box) -> None:
    p = bb_box.spawn("sh", "-c", 'while read line; do echo "got $line"; done')
    p.write_stdin("one\n")
    lines = p.stdout.lines()
    assert next(lines) == b"got one\n"
    p.write_stdin(b"two\n")
    assert next(lines) == b"got two\n"
    p.close_stdin()
    assert p.wait() == 0


def test_10mb_on_both_streams_at_once(bb_box: Box) -> None:
    r = bb_box.exec(
        "sh",
        "-c",
        "(dd if=/dev/zero bs=1M count=10 2>/dev/null &) ; head -c 10485760 /dev/zero | tr '\\0' e >&2",
    )
    assert r.exit_code == 0
    assert r.stdout_bytes == bytes(10 << 20)
    assert r.stderr_bytes == b"e" * (10 << 20)


def test_binary_safe_output(bb_box: Box) -> None:
    r = bb_box.exec("sh", "-c", "printf '\\000\\001\\377\\n\\r'; printf '\\377' >&2")
    assert r.stdout_bytes == b"\x00\x01\xff\n\r"
    assert r.stderr_bytes == b"\xff"
    assert r.stderr == "\ufffd"  # text view replaces undecodable bytes


def test_32_concurrent_execs_with_heavy_output(bb_box: Box) -> None:
    results: dict[int, sandlot.ExecResult] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = bb_box.exec(
                "sh",
                "-c",
                f"dd if=/dev/zero bs=64k count=16 2>/dev/null; echo {i} >&2; head -c 1048576 /dev/zero >&2",
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(results) == 32
    for i, r in results.items():
        assert r.exit_code == 0
        assert r.stdout_bytes == bytes(1 << 20)
        assert r.stderr_bytes == f"{i}\n".encode() + bytes(1 << 20)


def test_timeout_kills_and_box_stays_usable(bb_box: Box) -> None:
    t0 = time.monotonic()
    with pytest.raises(sandlot.ExecTimeout) as info:
        bb_box.exec("sh", "-c", "echo started; sleep 1000 & sleep 1000", timeout=5)
    assert time.monotonic() - t0 < 5 + scaled(15)
    assert info.value.stdout == b"started\n"
    # the whole process group died, including the background sleep
    assert bb_box.exec("sh", "-c", "pgrep -f 'sleep 1000' || true").stdout == ""
    assert bb_box.exec("echo", "still here").stdout == "still here\n"


def test_background_process_survives_its_exec(bb_box: Box) -> None:
    r = bb_box.exec("sh", "-c", "(sleep 5; echo late > /tmp/bg.txt) > /dev/null 2>&1 & echo $!")
    assert r.exit_code == 0
    pid = r.stdout.strip()
    assert bb_box.exec("kill", "-0", pid).ok  # still running after the exec returned
    deadline = deadline_in(20)
    while time.monotonic() < deadline and not bb_box.files.exists("/tmp/bg.txt"):
        time.sleep(0.2)
    assert bb_box.files.read("/tmp/bg.txt") == b"late\n"
    # even one that keeps the output pipe open does not block the exec forever
    t0 = time.monotonic()
    r = bb_box.exec("sh", "-c", "sleep 30 & echo parent-done")
    assert r.stdout == "parent-done\n" and time.monotonic() - t0 < scaled(10)
    bb_box.exec("sh", "-c", "pkill -f 'sleep 30' || true")


def test_kill_spawned_process(bb_box: Box) -> None:
    p = bb_box.spawn("sh", "-c", "echo ready; sleep 1000")
    assert next(iter(p.stdout)) == b"ready\n"
    p.kill()
    assert p.wait(timeout=20) == 128 + signal.SIGKILL
    res = p.result()
    assert res.signal == signal.SIGKILL


def test_zombies_are_reaped(bb_box: Box) -> None:
    bb_box.exec("sh", "-c", "for i in 1 2 3 4 5; do (true &) ; done")
    zombies = "grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l"
    wait_for("the orphans reaped", lambda: bb_box.exec("sh", "-c", zombies).stdout.strip() == "0", 30)


def test_python_in_debian_box(py_box: Box) -> None:
    r = py_box.exec("python3", "-c", "import sys, platform; print(6*7, platform.machine())")
    assert r.stdout == "42 x86_64\n"
    r = py_box.exec("python3", "-c", "import os; print(os.getuid(), os.environ['HOME'])", user="agent")
    assert r.stdout == "1000 /home/agent\n"
