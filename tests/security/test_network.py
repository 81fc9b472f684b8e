"""What a box can reach, by network mode, tested from inside real boxes.

Every server here listens on the host's 127.0.0.1; an HTTPS server with a test CA
stands in for an allowed API. Boxes reach the host only through QEMU's user
networking (10.0.2.2 is the host's loopback) and the egress proxy; nothing here
sends traffic to any other address (the proxy refuses before it connects). The
only name the host is made to resolve is ``localhost`` (from its /etc/hosts);
every other name asked is one the policy refuses before any lookup.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.config import default_home, runtime_dir
from sandlot.engine import hostcgroup
from sandlot.net.egress import egress_socket

from tests.conftest import TEST_ENGINE
from tests.support.egress import egress_log, logged
from tests.support.servers import LocalServer, QuietHandler
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm


class HostService(LocalServer):
    """An HTTP(S) server on the host's 127.0.0.1 that counts the requests it got."""

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        hits: list[str] = []

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                body = b"host-only-data"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.hits = hits
        super().__init__(Handler, context)


@pytest.fixture(scope="module")
def service() -> Iterator[HostService]:
    s = HostService()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tls_service(test_ca: Path) -> Iterator[HostService]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(test_ca / "server.pem", test_ca / "server.key")
    s = HostService(ctx)
    yield s
    s.close()


# What a program in the box tries; prints one JSON line per attempt. The proxy is
# used explicitly (and for 127.0.0.1 too, which NO_PROXY would otherwise exempt).
PROBE = r"""
import json, socket, sys, urllib.request
proxy = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://10.0.2.100:3128"}))
def attempt(kind, target):
    try:
        if kind == "direct":
            host, port = target.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5).close()
            return "connected"
        if kind == "dns":
            return socket.getaddrinfo(target, 443)[0][4][0]
        if kind == "proxy":
            return proxy.open("http://" + target + "/probe", timeout=20).read().decode()
    except Exception as exc:
        code = getattr(exc, "code", None)
        return f"refused:{code or type(exc).__name__}"
for line in sys.stdin:
    kind, target = line.split()
    print(json.dumps([kind, target, attempt(kind, target)]), flush=True)
"""

# HTTPS with a given server name, "connect": through a CONNECT tunnel to HOST:PORT;
# "straight": to the proxy address on PORT itself (as after sandlot's DNS answered)
TLS_WITH_NAME = r"""
import socket, ssl, sys
how, target, name = sys.argv[1], sys.argv[2], sys.argv[3]
if how == "connect":
    s = socket.create_connection(("10.0.2.100", 3128), timeout=20)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            print("refused:closed"); sys.exit()
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        print("refused:" + head.split()[1].decode()); sys.exit()
ctx = ssl.create_default_context(cafile="/root/ca.pem")
ctx.check_hostname = False  # the test is about what the proxy lets through, by server name
try:
    if how != "connect":
        s = socket.create_connection(("10.0.2.100", int(target)), timeout=20)
    t = ctx.wrap_socket(s, server_hostname=name)
    t.sendall(b"GET /tls HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := t.recv(4096):
        data += chunk
    print(data.split(b"\r\n\r\n", 1)[1].decode())
except (ssl.SSLError, OSError) as exc:
    print("refused:" + type(exc).__name__)
"""


# Asks the box's resolver (the relay at 127.0.0.53) directly, so nothing in the
# image (an /etc/hosts) answers instead; prints one JSON line per question:
# [kind, argument, result, seconds].
DNS_ASK = r"""
import json, socket, struct, sys, time
TYPES = {"A": 1, "AAAA": 28, "MX": 15}
RCODES = ["NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED"]
def ask(msg, timeout):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    s.sendto(msg, ("127.0.0.53", 53))
    try:
        r = s.recv(4096)
    except TimeoutError:
        return "timeout"
    if r[:2] != msg[:2]:
        return "wrong id"
    qd, an = struct.unpack(">HH", r[4:8])
    p = 12
    for _ in range(qd):
        while r[p]:
            p += 1 + r[p]
        p += 5
    addresses = []
    for _ in range(an):
        rtype, _, ttl, size = struct.unpack(">HHIH", r[p + 2 : p + 12])
        addresses.append(socket.inet_ntoa(r[p + 12 : p + 16]) + f"/{ttl}" if rtype == 1 else str(rtype))
        p += 12 + size
    return ":".join([RCODES[r[3] & 15], *addresses])
def question(name, qtype):
    labels = b"".join(bytes([len(x)]) + x.encode() for x in name.split("."))
    return struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", qtype, 1)
for line in sys.stdin:
    kind, arg = line.split()
    t = time.monotonic()
    if kind == "getaddrinfo":
        try:
            infos = socket.getaddrinfo(arg, 443, type=socket.SOCK_STREAM)
            result = ",".join(sorted({a[4][0] for a in infos}))
        except socket.gaierror as exc:
            result = "refused:" + str(exc.errno)
    elif kind == "raw":
        result = ask(bytes.fromhex(arg), 2)
    else:
        result = ask(question(arg, TYPES[kind]), 10)
    print(json.dumps([kind, arg, result, round(time.monotonic() - t, 3)]), flush=True)
"""


def ask_dns(box: sandlot.Box, *questions: tuple[str, str]) -> dict[tuple[str, str], tuple[str, float]]:
    """``(type, name)``, ``("getaddrinfo", name)`` or ``("raw", hex)`` -> (result, seconds)."""
    stdin = "".join(f"{k} {t}\n" for k, t in questions)
    r = box.exec("python3", "-c", DNS_ASK, stdin=stdin, timeout=120)
    assert r.returncode == 0, r.stderr
    return {(k, t): (v, s) for k, t, v, s in map(json.loads, r.stdout.splitlines())}


# Run with .check(): a box's first python3 under TCG, beside two other test runs, has
# taken over 20 s to start; its server then listens after it
WAIT_FOR_8000 = """
import socket, time
deadline = time.monotonic() + 120
while True:
    try:
        socket.create_connection(("127.0.0.1", 8000), 1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise SystemExit("nothing listens on port 8000")
        time.sleep(0.1)
"""


def probe(box: sandlot.Box, *attempts: tuple[str, str]) -> dict[tuple[str, str], str]:
    stdin = "".join(f"{k} {t}\n" for k, t in attempts)
    # NO_PROXY exempts 127.0.0.1 and localhost: cleared, so they are asked of the proxy
    r = box.exec("python3", "-c", PROBE, stdin=stdin, timeout=120, env={"NO_PROXY": "", "no_proxy": ""})
    assert r.returncode == 0, r.stderr
    return {(k, t): v for k, t, v in map(json.loads, r.stdout.splitlines())}


def interfaces(box: sandlot.Box) -> list[str]:
    """The box's network interfaces, as its programs see them (on either engine)."""
    r = box.exec("python3", "-c", "import socket; print(*sorted(n for _, n in socket.if_nameindex()))")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_no_network_card_by_default(debian_root: Path) -> None:
    with sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256) as box:
        assert interfaces(box) == ["lo"]
        assert box.inspect()["network"] == {"mode": "none", "allow": [], "ports": []}
    with pytest.raises(sandlot.InvalidArgument, match="network card"):
        sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, ports=[8080])


def test_public_mode_never_reaches_the_hosts_loopback(debian_root: Path, service: HostService) -> None:
    before = len(service.hits)
    with sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="public") as box:
        p = service.port
        out = probe(
            box,
            ("direct", f"10.0.2.2:{p}"),  # the host's loopback through QEMU's gateway
            ("proxy", f"127.0.0.1:{p}"),
            ("proxy", f"localhost:{p}"),
            ("proxy", f"10.0.2.2:{p}"),
            ("proxy", "169.254.169.254:80"),  # a cloud metadata service
            ("proxy", "192.168.1.1:80"),
        )
        assert out[("direct", f"10.0.2.2:{p}")].startswith("refused"), out
        for key, value in out.items():
            if key[0] == "proxy":
                assert value == "refused:403", (key, value)
        reasons = [e["reason"] for e in logged(box, lambda log: len(log) >= 5)]
        assert len(reasons) == 5 and all("not" in str(r) for r in reasons), reasons
        # any name may be asked in public mode, but not one that points at the host's loopback
        answers = ask_dns(box, ("A", "localhost"))
        assert answers[("A", "localhost")][0] == "NXDOMAIN", answers
        assert "not a public address" in str(egress_log(box)[-1]["reason"])
        assert box.exec("sh", "-c", "echo $HTTPS_PROXY").stdout.strip() == "http://10.0.2.100:3128"
    assert len(service.hits) == before  # nothing arrived


def test_allowlist_lets_through_only_what_is_listed(
    debian_root: Path, service: HostService, tls_service: HostService, test_ca: Path
) -> None:
    allow = [f"127.0.0.1:{service.port}", "localhost", f"127.0.0.1:{tls_service.port}"]
    with sandlot.Box(
        rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="allowlist", allow=allow
    ) as box:
        other = HostService()  # a service the box was not given
        try:
            out = probe(
                box,
                ("proxy", f"127.0.0.1:{service.port}"),
                ("proxy", f"127.0.0.1:{other.port}"),
                ("proxy", "example.com:80"),  # a name not listed: refused before any lookup
                ("proxy", "1.1.1.1:80"),  # a raw address not listed: refused before any connection
                ("direct", f"10.0.2.2:{service.port}"),
            )
            assert out[("proxy", f"127.0.0.1:{service.port}")] == "host-only-data"
            assert out[("proxy", f"127.0.0.1:{other.port}")] == "refused:403"
            assert out[("proxy", "example.com:80")] == "refused:403"
            assert out[("proxy", "1.1.1.1:80")] == "refused:403"
            assert out[("direct", f"10.0.2.2:{service.port}")].startswith("refused")
            assert other.hits == []
        finally:
            other.close()
        # HTTPS to an allowed API (the test CA stands in for the public ones)
        tunnel = f"localhost:{tls_service.port}"
        box.files.write("/root/ca.pem", (test_ca / "ca.pem").read_bytes())
        ok = box.exec("python3", "-c", TLS_WITH_NAME, "connect", tunnel, "localhost")
        assert ok.stdout.strip() == "host-only-data", ok.stdout + ok.stderr
        # a program that ignores HTTPS_PROXY connects straight to the address sandlot's DNS
        # gives allowed names: routed by its TLS server name, on a port the allowlist names
        ok = box.exec("python3", "-c", TLS_WITH_NAME, "straight", str(tls_service.port), "localhost")
        assert ok.stdout.strip() == "host-only-data", ok.stdout + ok.stderr
        hits, seen = len(tls_service.hits), len(egress_log(box))
        bad = box.exec("python3", "-c", TLS_WITH_NAME, "straight", str(tls_service.port), "evil.example")
        assert bad.stdout.startswith("refused"), bad.stdout + bad.stderr
        # (the line of the allowed connection before it may land after ``seen`` was read: the
        # proxy writes a connection's line once it is done with it)
        after = logged(box, lambda log: any(e.get("host") == "evil.example" for e in log[seen:]))[seen:]
        refused = [
            (e.get("transparent"), e.get("decision")) for e in after if e.get("host") == "evil.example"
        ]
        assert len(tls_service.hits) == hits and refused == [(True, "denied")], after
        # the same tunnel with a server name not on the list is cut before any byte reaches the API
        hits = len(tls_service.hits)
        bad = box.exec("python3", "-c", TLS_WITH_NAME, "connect", tunnel, "evil.example")
        assert bad.stdout.startswith("refused"), bad.stdout + bad.stderr
        assert len(tls_service.hits) == hits
        # a listed name that resolves to a private address is refused unless that address is listed
        box.set_network(allow=["localhost"])
        again = box.exec("python3", "-c", TLS_WITH_NAME, "connect", tunnel, "localhost")
        assert again.stdout.strip() == "refused:403"
        private = "not a public address"
        decisions = logged(box, lambda log: bool(log) and private in str(log[-1].get("reason")))
        assert private in str(decisions[-1]["reason"]), decisions[-1]


def test_dns_answers_allowed_names_only_and_never_with_a_private_address(debian_root: Path) -> None:
    # localhost is listed, but not the address it resolves to
    with sandlot.Box(
        rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="allowlist", allow=["localhost"]
    ) as box:
        box.files.write("/etc/hosts", b"")  # names are asked of DNS, whatever the image has
        assert ask_dns(box, ("A", "localhost"))[("A", "localhost")][0] == "NXDOMAIN"
        reason = str(egress_log(box)[-1]["reason"])
        assert "127.0.0.1" in reason and "not a public address" in reason, reason
        box.set_network(allow=["localhost", "127.0.0.1"])  # refusals are not kept: this applies at once
        bad_count = "4242010000020000000000000000"  # a header claiming two questions, and none
        out = ask_dns(
            box,
            ("A", "localhost"),  # listed, and its address too: the answer is sandlot's proxy
            ("A", "LocalHost"),  # kept by the relay for the answer's TTL: not asked of the host again
            ("getaddrinfo", "localhost"),  # what programs do
            ("AAAA", "localhost"),  # IPv4 only: an empty answer
            ("A", "blocked.example"),  # not listed: refused, and never looked up on the host
            ("AAAA", "blocked.example"),
            ("getaddrinfo", "blocked.example"),
            ("raw", bad_count),
            ("raw", "4242"),  # too short to answer: dropped
            ("MX", "localhost"),  # the relay is still there
        )
        assert out[("A", "localhost")][0] == "NOERROR:10.0.2.100/10", out
        assert out[("A", "LocalHost")][0] == "NOERROR:10.0.2.100/10", out
        assert out[("getaddrinfo", "localhost")][0] == "10.0.2.100", out
        assert out[("AAAA", "localhost")][0] == "NOERROR", out
        assert out[("A", "blocked.example")][0] == "NXDOMAIN", out
        refused, seconds = out[("getaddrinfo", "blocked.example")]
        assert refused.startswith("refused:") and seconds < 3, out  # at once, not after a timeout
        assert out[("raw", bad_count)][0] == "FORMERR", out
        assert out[("raw", "4242")][0] == "timeout", out
        assert out[("MX", "localhost")][0] == "NOERROR", out
        log = [e for e in egress_log(box) if e.get("method") == "DNS"]
        asked = [(e.get("host"), e.get("type"), e["decision"]) for e in log]
        assert asked.count(("localhost", "A", "allowed")) == 1, asked
        assert ("blocked.example", "A", "denied") in asked and ("localhost", "MX", "allowed") in asked
        assert not any(t == "AAAA" for _, t, _ in asked)  # the relay answers those itself
        assert any("malformed" in str(e.get("reason")) for e in log)
        assert all(e.get("address") in (None, "127.0.0.1") for e in log)  # what was checked, not answered

        # the relay outlives a kill from inside the box, and a fork's copy asks the fork's host side
        box.exec("python3", "-c", KILL_RELAY, check=True)
        assert ask_dns(box, ("A", "localhost"))[("A", "localhost")][0] == "NOERROR:10.0.2.100/10"
        kid = box.fork()[0]
        try:
            assert ask_dns(kid, ("MX", "localhost"))[("MX", "localhost")][0] == "NOERROR"
            assert [e.get("type") for e in egress_log(kid)] == ["MX"]
        finally:
            kid.remove(force=True)


KILL_RELAY = """
import os, signal, time
def relays():
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{p}/comm").read().strip() == "sandlot-dns":
                found.append(int(p))
        except OSError:
            pass
    return found
old = relays()
assert len(old) == 1, old
os.kill(old[0], signal.SIGKILL)
for _ in range(100):
    if relays() and relays() != old:
        break
    time.sleep(0.05)
else:
    raise SystemExit("no new relay")
"""


def decided_in_last_exec(box: sandlot.Box) -> dict[str, int]:
    """The egress decisions the box's recorder shows for its last exec (the log's lines
    are written as each connection ends: waited for a moment)."""
    deadline = time.monotonic() + 10
    while True:
        last = [s for s in box.timeline() if s.kind == "exec"][-1]
        if last.egress or time.monotonic() > deadline:
            return last.egress or {}
        time.sleep(0.2)


def test_policy_changes_apply_to_a_running_box(debian_root: Path, service: HostService) -> None:
    with sandlot.Box(
        rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="allowlist", record=True
    ) as box:
        target = ("proxy", f"127.0.0.1:{service.port}")
        assert probe(box, target)[target] == "refused:403"  # an empty allowlist lets nothing out
        assert decided_in_last_exec(box).get("denied") == 1  # the flight recorder's step shows it
        box.set_network(allow=[f"127.0.0.1:{service.port}"])
        assert probe(box, target)[target] == "host-only-data"
        assert decided_in_last_exec(box).get("allowed") == 1
        assert sandlot.get(box.name).inspect()["network"]["allow"] == [f"127.0.0.1:{service.port}"]
        box.set_network("public", allow=[])
        assert probe(box, target)[target] == "refused:403"
        with pytest.raises(sandlot.InvalidState, match="network card"):
            box.set_network("none")
        with pytest.raises(sandlot.InvalidState, match="network card"):
            box.set_network("open")


def test_guest_connections_go_through_the_homes_egress_server_and_survive_its_death(
    debian_root: Path, service: HostService
) -> None:
    """A QEMU VM's connections to the proxy go over its egress port to the home's
    egress server (the guest's connect hook sends them to its egress child); a gVisor box's
    forwarder runs the relay per connection, which hands each to that server. With the
    server killed (-9) connections still work: a VM's go through QEMU's user network
    (``FALLBACK_ADDRESS``), each in a helper of its own, and the next box's start
    brings a server back, to which the VM's port connects again."""
    sock = egress_socket(runtime_dir(), default_home())

    def servers() -> list[int]:
        out = subprocess.run(["pgrep", "-f", f"sandlot.net.egress {sock}"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def port_state(box: sandlot.Box, want: str) -> None:
        """Wait until the guest's side of the egress port says ``want`` (QEMU only)."""
        if TEST_ENGINE != "qemu":
            return
        deadline = deadline_in(30)
        while (state := box.exec("cat", "/run/sandlot/egress").stdout.strip()) != want:
            assert time.monotonic() < deadline, f"the egress port is {state!r}, not {want!r}"
            time.sleep(0.2)

    allow = [f"127.0.0.1:{service.port}"]
    target = ("proxy", f"127.0.0.1:{service.port}")
    with sandlot.Box(  # booted: the port's sessions are counted since a boot, not since a template's
        rootfs=debian_root,
        engine=TEST_ENGINE,
        memory_mib=256,
        network="allowlist",
        allow=allow,
        template=False,
    ) as box:
        cmdline = network_process(box)
        assert b"sandlot-fdrelay" in cmdline and str(sock).encode() in cmdline
        port_state(box, "ready 1")
        if TEST_ENGINE == "qemu":
            assert str(sock.with_suffix(".mux")).encode() in cmdline
        assert probe(box, target)[target] == "host-only-data"
        [server] = servers()
        os.kill(server, signal.SIGKILL)
        deadline = deadline_in(10)
        while servers():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        port_state(box, "away")
        assert probe(box, target)[target] == "host-only-data"  # a helper of its own served it
        assert servers() == []  # nothing started one: a VM's start does
        with sandlot.Box(
            rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="allowlist", allow=allow
        ) as other:
            assert probe(other, target)[target] == "host-only-data"
        assert len(servers()) == 1
        port_state(box, "ready 2")  # QEMU connected again to the new server
        assert probe(box, target)[target] == "host-only-data"


def network_process(box: sandlot.Box) -> bytes:
    """The command line of the process that runs the box's guest connections: QEMU's,
    or the forwarder of a gVisor box (``sandlot.net.forwarder``)."""
    if TEST_ENGINE == "qemu":
        return Path(f"/proc/{box.inspect()['vm_pid']}/cmdline").read_bytes()
    state = Path(box.inspect()["paths"]["dir"])
    pid = next(state.rglob("forwarder.pid")).read_text().split()[0]
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_open_mode_reaches_the_host_as_documented(debian_root: Path, service: HostService) -> None:
    with sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="open") as box:
        target = ("direct", f"10.0.2.2:{service.port}")
        assert probe(box, target)[target] == "connected"
        assert box.exec("sh", "-c", "echo ${HTTPS_PROXY:-unset}").stdout.strip() == "unset"
        assert box.exec("cat", "/etc/resolv.conf").stdout == "nameserver 10.0.2.3\n"  # QEMU's resolver


def test_published_ports_are_on_the_hosts_loopback_and_survive_a_rollback(debian_root: Path) -> None:
    with sandlot.Box(
        rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="allowlist", ports=[(0, 8000)]
    ) as box:
        box.sh("cd /tmp && echo served-from-box > index.html")
        box.sh("cd /tmp && nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
        box.exec("python3", "-c", WAIT_FOR_8000, timeout=180).check()
        address, port = box.port(8000)
        assert address == "127.0.0.1" and port > 0
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=20).read() == b"served-from-box\n"
        snap = box.snapshot("with-server")
        box.sh("rm /tmp/index.html")
        box.rollback(snap)  # the server process and its file come back; the port is published again
        address, port = box.port(8000)
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=20).read() == b"served-from-box\n"
        kid = snap.start()[0]  # a child has the card and the policy, not the parent's host ports
        try:
            assert kid.inspect()["network"] == {"mode": "allowlist", "allow": [], "ports": []}
            assert "eth0" in interfaces(kid)
        finally:
            kid.remove(force=True)
        snap_rm = sandlot.get_snapshot(snap.id)
        snap_rm.remove()


def test_cli_publishes_ports_and_changes_the_policy(debian_root: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandlot.cli", *args], capture_output=True, text=True,
                              timeout=180)  # fmt: skip

    name = f"web-{os.urandom(3).hex()}"
    r = cli("run", "-d", "--name", name, "-p", "8000", "--network", "allowlist", "--allow", "pypi.org",
            "--engine", TEST_ENGINE, "--rootfs", str(debian_root), "-m", "256", "--", "python3", "-m",
            "http.server", "8000")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == name, r.stderr
    try:
        box = sandlot.get(name)
        box.exec("python3", "-c", WAIT_FOR_8000, timeout=180).check()
        r = cli("port", name, "8000")
        assert r.returncode == 0 and r.stdout.startswith("8000/tcp -> 127.0.0.1:"), r.stdout + r.stderr
        host_port = int(r.stdout.strip().rsplit(":", 1)[1])
        assert urllib.request.urlopen(f"http://127.0.0.1:{host_port}/", timeout=20).status == 200
        r = cli("network", name, "--allow", "*.pythonhosted.org:443")
        assert r.returncode == 0 and json.loads(r.stdout)["allow"] == ["*.pythonhosted.org:443"], r.stderr
        r = cli("network", name, "--network", "none")
        assert r.returncode == 125 and "stop() it first" in r.stderr
        r = cli(
            "run", "--rm", "--engine", TEST_ENGINE, "--rootfs", str(debian_root), "-p", "8000", "--", "true"
        )
        assert r.returncode == 125 and "network card" in r.stderr
    finally:
        sandlot.get(name).remove(force=True)


# From a box to another box's ports, by the names sandlot's DNS answers for boxes:
# through the egress proxy ("proxy"), straight to the address DNS gave ("direct"),
# and a raw exchange in which the server speaks first ("banner": no request, so
# nothing in it could name where it goes). One JSON line per attempt.
BOX_PROBE = r"""
import json, socket, sys, urllib.request
proxy = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://10.0.2.100:3128"}))
def attempt(kind, target):
    host, port = target.rsplit(":", 1)
    try:
        if kind == "proxy":
            return proxy.open(f"http://{target}/", timeout=60).read().decode().strip()
        s = socket.create_connection((host, int(port)), timeout=60)
        if kind == "direct":
            s.sendall(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data.split(b"\r\n\r\n")[-1].decode().strip() or "closed"
    except Exception as exc:
        return f"refused:{getattr(exc, 'code', None) or type(exc).__name__}"
for line in sys.stdin:
    kind, target = line.split()
    print(json.dumps([kind, target, attempt(kind, target)]), flush=True)
"""

# A greeting on 7000 to whoever connects (a server that speaks first, as SSH, SMTP or MySQL do)
BANNER = """
import socket
s = socket.create_server(("127.0.0.1", 7000))
while True:
    c, _ = s.accept()
    c.sendall(b"banner-from-box\\n")
    c.close()
"""


def box_probe(box: sandlot.Box, *attempts: tuple[str, str]) -> dict[tuple[str, str], str]:
    stdin = "".join(f"{k} {t}\n" for k, t in attempts)
    r = box.exec("python3", "-c", BOX_PROBE, stdin=stdin, timeout=300, env={"NO_PROXY": "", "no_proxy": ""})
    assert r.returncode == 0, r.stderr
    return {(k, t): v for k, t, v in map(json.loads, r.stdout.splitlines())}


def box_link_process(home: Path) -> int | None:
    """The pid of the home's box link (``python -m sandlot.api.boxlink HOME SOCKET``)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if b"sandlot.api.boxlink" in argv and str(home).encode() in argv:
                    return int(proc.name)
    return None


def test_a_box_reaches_only_the_ports_of_other_boxes_its_policy_names(debian_root: Path) -> None:
    tag = os.urandom(3).hex()
    web, other = f"web-{tag}", f"other-{tag}"
    ns = {"sandlot.namespace": f"team-{tag}"}
    # the service box has no network card: its ports are reached through its agent, on its loopback
    server = sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, name=web, labels=ns)
    client = sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, name=f"client-{tag}",
                         labels=ns,
                         allow=[f"box:{web}:8000", f"box:{web}:7000", f"box:{other}:8000"])  # fmt: skip
    # a box of another namespace may name the same port: it is refused
    elsewhere = {"sandlot.namespace": f"else-{tag}"}
    stranger = sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, name=f"stranger-{tag}",
                           labels=elsewhere, allow=[f"box:{web}:8000"])  # fmt: skip
    try:
        server.start()
        server.sh("cd /tmp && echo served-from-box > index.html")
        for port in ("8000", "9000"):
            server.spawn("sh", "-c", f"cd /tmp && exec python3 -m http.server {port} --bind 127.0.0.1")
        server.spawn("python3", "-c", BANNER)
        server.exec("python3", "-c", WAIT_FOR_8000, timeout=180).check()
        client.start()
        assert "eth0" not in interfaces(server)
        host = f"{web}.box.internal"
        out = box_probe(
            client,
            ("proxy", f"{host}:8000"),
            ("proxy", f"{web}:8000"),  # the plain box name, as a one-label host
            ("direct", f"{host}:8000"),
            ("banner", f"{host}:7000"),
            ("proxy", f"{host}:9000"),  # a port the policy does not name, though something listens
            ("direct", f"{host}:9000"),
            ("proxy", f"{host}:22"),
            ("proxy", f"{other}.box.internal:8000"),  # named, but no such box in the namespace
            ("proxy", f"nobody-{tag}.box.internal:8000"),  # never named: refused, and never looked up
        )
        assert out[("proxy", f"{host}:8000")] == "served-from-box", out
        assert out[("proxy", f"{web}:8000")] == "served-from-box", out
        assert out[("direct", f"{host}:8000")] == "served-from-box", out
        assert out[("banner", f"{host}:7000")] == "banner-from-box", out
        assert out[("proxy", f"{host}:9000")] == "refused:403", out
        assert out[("direct", f"{host}:9000")] == "refused:ConnectionRefusedError", out
        assert out[("proxy", f"{host}:22")] == "refused:403", out
        assert out[("proxy", f"{other}.box.internal:8000")] == "refused:403", out
        assert out[("proxy", f"nobody-{tag}.box.internal:8000")] == "refused:403", out
        # the home's link runs in a host cgroup of its own, not in that of the client box
        # whose proxy started it: it counts against no box's limits
        link = box_link_process(sandlot.Runtime.for_home().home)
        assert link is not None
        where = Path(f"/proc/{link}/cgroup").read_text()
        if hostcgroup.detect().trees:
            assert f"/sandlot/helper-boxlink-{link}" in where, where
        answers = ask_dns(client, ("A", host), ("A", f"nobody-{tag}.box.internal"))
        assert answers[("A", host)][0].startswith("NOERROR:10.0.2.101/"), answers
        assert answers[("A", f"nobody-{tag}.box.internal")][0] == "NXDOMAIN", answers
        denied = logged(client, lambda log: sum(e.get("decision") == "denied" for e in log) >= 2)
        reasons = [str(e.get("reason")) for e in denied if e.get("decision") == "denied"]
        assert any("port 9000 of box" in r for r in reasons), reasons
        assert any(f"no box named {other}" in r for r in reasons), reasons
        # a port the policy names but nothing listens on: the proxy says so (502), the box is unharmed
        client.set_network(allow=[f"box:{web}:8000", f"box:{web}:8001"])
        out = box_probe(client, ("proxy", f"{host}:8001"), ("proxy", f"{host}:8000"))
        assert out == {("proxy", f"{host}:8001"): "refused:502", ("proxy", f"{host}:8000"): "served-from-box"}
        # a policy change applies to the next connection, the address DNS gave included
        client.set_network(allow=[f"box:{web}:8001"])
        out = box_probe(client, ("direct", f"{host}:8000"), ("proxy", f"{host}:8000"))
        assert out[("direct", f"{host}:8000")] in ("closed", "refused:ConnectionResetError"), out
        assert out[("proxy", f"{host}:8000")] == "refused:403", out
        client.stop()  # the link outlives the box whose proxy started it
        assert box_link_process(sandlot.Runtime.for_home().home) == link
        stranger.start()
        out = box_probe(stranger, ("proxy", f"{host}:8000"), ("direct", f"{host}:8000"))
        assert out[("proxy", f"{host}:8000")] == "refused:403", out
        assert out[("direct", f"{host}:8000")] in ("closed", "refused:ConnectionResetError"), out
        refused = f"no box named {web} in the namespace"
        log = logged(stranger, lambda log: any(refused in str(e.get("reason")) for e in log))
        reasons = [str(e.get("reason")) for e in log]
        assert any(refused in r for r in reasons), reasons
    finally:
        for box in (client, stranger, server):
            with contextlib.suppress(sandlot.SandlotError):
                box.remove(force=True)
