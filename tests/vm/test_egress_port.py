"""A QEMU VM's egress port (``net/mux.py``, ``guest/agent/egress.c``), in real boxes:
many connections at once with their own bytes, a download larger than every window,
and the port after each kind of restore (a fork's children, a rollback, a resume in
a new QEMU). The proxy's policy itself is tested in tests/security/test_network.py,
through the same port. Servers listen on the host's 127.0.0.1 only."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.conftest import TEST_ENGINE
from tests.support.servers import LocalServer, QuietHandler
from tests.support.waiting import deadline_in

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(TEST_ENGINE != "qemu", reason="the egress port is a QEMU VM's"),
]

BIG = bytes(range(256)) * (24 * 4096)  # 24 MiB: many times a stream's window
NO_PROXY = {"NO_PROXY": "", "no_proxy": ""}  # the box's exempts 127.0.0.1: asked of the proxy here


class Service(LocalServer):
    """Answers ``/echo/X`` with X, ``/big`` with BIG."""

    def __init__(self) -> None:
        class Handler(QuietHandler):
            def do_GET(self) -> None:
                body = BIG if self.path == "/big" else self.path.removeprefix("/echo/").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(Handler, None)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    s = Service()
    yield s
    s.close()


# Each request a connection of its own, all at once: each answer must be its own.
MANY = r"""
import concurrent.futures, hashlib, json, sys, urllib.request
port, n = int(sys.argv[1]), int(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://10.0.2.100:3128"}))
def get(path):
    return opener.open(f"http://127.0.0.1:{port}{path}", timeout=120).read()
with concurrent.futures.ThreadPoolExecutor(n + 1) as pool:
    big = pool.submit(get, "/big")
    small = list(pool.map(lambda i: get(f"/echo/{i}-{'x' * (i * 37)}"), range(n)))
    data = big.result()
print(json.dumps({"ok": [s == f"{i}-{'x' * (i * 37)}".encode() for i, s in enumerate(small)],
                  "big": hashlib.sha256(data).hexdigest(), "size": len(data)}))
"""


def state(box: sandlot.Box, want: str = "ready 1") -> str:
    """The guest's side of the port, once it says ``want`` (or what it says at 30 s):
    ``ready N`` once the N-th session since boot greeted it (so the tests' boxes boot,
    ``template=False``: a box restored from its tree's template counts on from the
    template's)."""
    deadline = deadline_in(30)
    while (said := box.exec("cat", "/run/sandlot/egress").stdout.strip()) != want:
        if time.monotonic() > deadline:
            return said
        time.sleep(0.2)
    return said


OPENER = (
    "import sys, urllib.request\n"
    "o = urllib.request.build_opener(urllib.request.ProxyHandler({'http': 'http://10.0.2.100:3128'}))"
)


def fetch(box: sandlot.Box, port: int, what: str) -> str:
    code = f"{OPENER}\nprint(o.open(sys.argv[1], timeout=60).read().decode())"
    r = box.exec("python3", "-c", code, f"http://127.0.0.1:{port}/echo/{what}", timeout=120, env=NO_PROXY)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# Where a connection to the proxy address lands in the guest, and whether the box's
# own servers may still take any port on every address.
WHERE = r"""
import json, socket
s = socket.create_connection(("10.0.2.100", 3128), timeout=30)
peer = s.getpeername()[0]
s.close()
bound = {}
for port in (80, 443, 3128, 53):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("0.0.0.0", port)); srv.listen(); bound[port] = "ok"
    except OSError as e:
        bound[port] = str(e)
    srv.close()
print(json.dumps({"peer": peer, "bound": bound}))
"""


OTHER_NETNS = r"""
import fcntl, socket, struct
s = socket.socket()
flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))  # SIOCSIFFLAGS: up
try:
    socket.create_connection(("10.0.2.100", 3128), timeout=10)
    print("connected")
except OSError as e:
    print(e.strerror)
"""


def test_the_port_takes_no_address_or_port_from_the_box(debian_root: Path, service: Service) -> None:
    """A connection to 10.0.2.100 is sent by the guest's connect hook to the egress
    child on the loopback; 10.0.2.100 stays QEMU's, and a server in the box can bind
    every port on every address, those of the proxy and the DNS answerer included."""
    allow = [f"127.0.0.1:{service.port}"]
    with sandlot.Box(
        rootfs=debian_root, memory_mib=256, network="allowlist", allow=allow, template=False
    ) as box:
        assert state(box) == "ready 1"
        r = box.exec("python3", "-c", WHERE)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["peer"] == "127.0.0.1"  # the hook's work: not QEMU's 10.0.2.100
        assert out["bound"] == {"80": "ok", "443": "ok", "3128": "ok", "53": "ok"}
        assert fetch(box, service.port, "still") == "still"
        # a network namespace of a container in the box: its connects are its own
        # (its loopback up, the proxy address has no route there: not sent to a listener)
        r = box.exec("unshare", "-n", "python3", "-c", OTHER_NETNS)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "Network is unreachable"


def test_many_connections_at_once_each_get_their_own_bytes(debian_root: Path, service: Service) -> None:
    allow = [f"127.0.0.1:{service.port}"]
    with sandlot.Box(
        rootfs=debian_root, memory_mib=512, network="allowlist", allow=allow, template=False
    ) as box:
        assert state(box) == "ready 1"
        r = box.exec("python3", "-c", MANY, str(service.port), "48", timeout=600, env=NO_PROXY)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert all(out["ok"]) and len(out["ok"]) == 48
        assert out["size"] == len(BIG) and out["big"] == hashlib.sha256(BIG).hexdigest()
        assert state(box) == "ready 1"  # nothing broke the session: still the port, not the slow way


def stop_downloads(box: sandlot.Box) -> None:
    """End the downloads the saved state had running, where they still run: a restore
    resets the connection one was in, which may end its loop first."""
    r = box.exec("sh", "-c", "test -s /run/downloads && { kill $(cat /run/downloads) 2>/dev/null; true; }")
    assert r.returncode == 0, r.stderr


def test_the_port_after_a_fork_a_rollback_and_a_resume(debian_root: Path, service: Service) -> None:
    """Each restore is a new QEMU whose port connects anew: the server greets it, the
    guest (saved mid-session) starts over, and connections go over the port again."""
    allow = [f"127.0.0.1:{service.port}"]
    with sandlot.Box(
        rootfs=debian_root, memory_mib=256, network="allowlist", allow=allow, template=False
    ) as box:
        assert state(box) == "ready 1"
        assert fetch(box, service.port, "before") == "before"
        # downloads running while the state is saved: the guest is likely mid-frame in it
        loop = f"while True: o.open('http://127.0.0.1:{service.port}/big', timeout=60).read()"
        code = f"{OPENER}\n{loop}"
        started = f'nohup python3 -c "{code}" >/dev/null 2>&1 & echo $! >/run/downloads'
        box.exec("sh", "-c", started, env=NO_PROXY)
        time.sleep(1)  # not a bound: the snapshot is taken whenever the download is
        snap = box.snapshot("egress")  # a live snapshot: the same QEMU goes on, its session too
        kids = box.fork(2)
        stop_downloads(box)  # each restore below starts with them running, then they stop: CI's CPU
        try:
            for n, kid in enumerate(kids):
                assert state(kid, "ready 2") == "ready 2"
                stop_downloads(kid)
                assert fetch(kid, service.port, f"child{n}") == f"child{n}"
                assert state(kid, "ready 2") == "ready 2"
        finally:
            for kid in kids:
                kid.remove(force=True)
        assert state(box) == "ready 1"
        box.rollback(snap)
        assert state(box, "ready 2") == "ready 2"
        stop_downloads(box)
        assert fetch(box, service.port, "rolled-back") == "rolled-back"
        box.suspend()
        box.resume()
        assert state(box, "ready 3") == "ready 3"
        assert fetch(box, service.port, "resumed") == "resumed"
