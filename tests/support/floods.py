"""What a flooding guest runs (``python3 -c PROGRAM SECONDS [ARGS]``), shared by
``tests/security/test_floods.py`` and ``benchmarks/floods.py``: each drives one record
of the host as fast as the guest can for SECONDS, and prints one JSON line of what it
did and what it was answered. And what both read of the host while a flood runs."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

# Bounds small enough that each flood reaches its own in seconds: the same code as the
# defaults, which only take longer to reach
SMALL_BOUNDS = {
    "SANDLOT_EGRESS_LOG_MIB": "0.25",
    "SANDLOT_EGRESS_LINES": "20",  # a slow guest asks fewer than the default 100 in 10 s
    # the keeper cuts a console past half its bound: the other half is what a guest writing
    # 0.3-0.6 MiB a second under TCG may add while a host this busy gets the keeper to run
    "SANDLOT_CONSOLE_LOG_MIB": "1",
    # under TCG on a loaded host a guest asks 50-120 questions a second from four threads,
    # and opens 11-200 connections a second: well past these, however loaded the host
    "SANDLOT_DNS_RATE": "5,10",
    "SANDLOT_CONNECTION_RATE": "2,5",
    "SANDLOT_CONNECTIONS_OPEN": "4",
    "SANDLOT_EVENT_RATE": "1,4",
    "SANDLOT_WATCH_RATE": "20,40",  # a loaded TCG guest makes and removes ~50 files a second
    "SANDLOT_CODE_OUTPUT_MIB": "0.5",
}


def rss_mib(pid: int | None) -> float | None:
    """A process's resident memory (None: no such process)."""
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def settled(pid: int | None, timeout: float = 30.0) -> None:
    """Until a process that has just started (it imports sandlot's core) holds its memory:
    two readings half a second apart within half a MiB."""
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    last = rss_mib(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = rss_mib(pid)
        if now is None or last is None or abs(now - last) < 0.5:
            return
        last = now


def commands_past_their_timeout(box: Any, seconds: float, threads: int = 4) -> int:
    """Commands that run past their timeout (each a ``command_timeout`` event of the box),
    from ``threads`` threads as fast as they go, for ``seconds``; how many ran."""
    ran, lock = [0], threading.Lock()
    end = time.monotonic() + seconds

    def one() -> None:
        from sandlot import ExecTimeout

        while time.monotonic() < end:
            with contextlib.suppress(ExecTimeout):
                box.exec("sleep", "5", timeout=0.01)
            with lock:
                ran[0] += 1

    running = [threading.Thread(target=one) for _ in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join()
    return ran[0]


def helper_pid(module: str, home: Path) -> int | None:
    """The pid of ``home``'s helper process running ``module``: its egress server (named on
    its command line by its socket), box link or sampler (by the home). Where several
    run, the one left a moment later: the others were started beside it, found its lock
    taken and exit. (The shell that started one, ``sh -c '"$0" -m "$@" &' PYTHON MODULE
    ...``, names the module too, and is gone at once: it is not one.)"""
    word = str(home)
    if module == "sandlot.net.egress":
        from sandlot.config import runtime_dir
        from sandlot.net.egress import egress_socket

        word = str(egress_socket(runtime_dir(), home))
    deadline = time.monotonic() + 5
    while True:
        found = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                with contextlib.suppress(OSError):
                    argv = (p / "cmdline").read_bytes().split(b"\0")
                    runs = b"-m" in argv[:-1] and argv[argv.index(b"-m") + 1] == module.encode()
                    if runs and word.encode() in argv:
                        found.append(int(p.name))
        if len(found) <= 1 or time.monotonic() > deadline:
            return min(found) if found else None
        time.sleep(0.1)


DNS_FLOOD = r"""
import json, os, socket, struct, sys, threading, time
end = time.monotonic() + float(sys.argv[1])
counts, lock = {}, threading.Lock()
def question(name):
    labels = b"".join(bytes([len(x)]) + x.encode() for x in name.split("."))
    return struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)
def run(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    i = 0
    while time.monotonic() < end:
        i += 1
        s.sendto(question(f"q{n}x{i}.flood.example.com"), ("127.0.0.53", 53))
        try:
            rcode = str(s.recv(4096)[3] & 15)
        except TimeoutError:
            rcode = "timeout"
        with lock:
            counts[rcode] = counts.get(rcode, 0) + 1
threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(counts))
"""

CONNECT_FLOOD = r"""
import json, socket, sys, threading, time
end = time.monotonic() + float(sys.argv[1])
counts, lock = {}, threading.Lock()
def run(n):
    i = 0
    while time.monotonic() < end:
        i += 1
        try:
            s = socket.create_connection(("10.0.2.100", 3128), timeout=10)
            s.sendall(f"CONNECT c{n}x{i}.flood.example.com:443 HTTP/1.1\r\n\r\n".encode())
            head = s.recv(64)
            status = head.split()[1].decode() if head.startswith(b"HTTP/") else "closed"
            s.close()
        except OSError as exc:
            status = type(exc).__name__
        with lock:
            counts[status] = counts.get(status, 0) + 1
threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(counts))
"""

# gVisor's init logs to a directory of the host bound into the sandbox (its /dev/console
# is the sandbox's own): a guest writes there; a QEMU guest's console is its serial port
CONSOLE_FLOOD = r"""
import json, os, sys, time
# the flood's length, then on (up to 20 times as long) until it has written the byte goal
# if one is given: a console under load is slow, and a flood that never crosses the
# bound proves nothing
start = time.monotonic()
end = start + float(sys.argv[1])
goal = int(sys.argv[2]) if len(sys.argv) > 2 else 0
cap = start + 20 * float(sys.argv[1])
line = b"x" * 4095 + b"\n"
targets = ["/dev/console"]
if os.path.isdir("/.sandlot-console"):
    targets = ["/.sandlot-console/console.log", "/.sandlot-console/fill"]
written = errors = 0
fds = [os.open(t, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) for t in targets]
while (now := time.monotonic()) < end or (written < goal and errors == 0 and now < cap):
    for fd in fds:
        try:
            written += os.write(fd, line * 16)
        except OSError:
            errors += 1
            time.sleep(0.001)
print(json.dumps({"bytes": written, "errors": errors}))
"""

CHURN = r"""
import json, os, sys, time
end = time.monotonic() + float(sys.argv[1])
n = 0
while time.monotonic() < end:
    p = f"{sys.argv[2]}/f{n % 64}"
    with open(p, "w") as f:
        f.write("x")
    os.unlink(p)
    n += 1
print(json.dumps({"files": n}))
"""

# a server of the box's own that keeps every connection it takes open, and a flood of
# connections to it through the box link (box:flood:8000), each held
HOLDER = r"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8000))
s.listen(4096)
print("listening", flush=True)
held = []
while True:
    held.append(s.accept())
"""
LINK_FLOOD = r"""
import json, socket, sys, threading, time
end = time.monotonic() + float(sys.argv[1])
held, counts, lock = [], {}, threading.Lock()
def run():
    while time.monotonic() < end:
        try:
            s = socket.create_connection(("flood.box.internal", 8000), timeout=10)
            s.settimeout(1)
            try:  # a refused one is closed by the proxy at once
                what = "closed" if s.recv(1) == b"" else "data"
            except TimeoutError:
                what = "held"
                with lock:
                    held.append(s)
        except OSError as exc:
            what = type(exc).__name__
            time.sleep(0.05)
        with lock:
            counts[what] = counts.get(what, 0) + 1
threads = [threading.Thread(target=run) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
time.sleep(2)  # a connection refused late (a loaded host) is closed by now
alive = 0
for s in held:  # still open: nothing to read yet, and no end
    s.setblocking(False)
    try:
        alive += s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        alive += 1
    except OSError:
        pass
counts["held_at_end"] = alive
print(json.dumps(counts))
"""
