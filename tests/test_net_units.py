"""Egress policy and the egress proxy, on the host: the proxy runs as QEMU runs it
(a process whose descriptors 0-2 are the guest's connection) against servers on
127.0.0.1. What boxes do with them is in tests/security/."""

from __future__ import annotations

import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import InvalidArgument
from sandlot.net.policy import Policy, Rule, is_public_address, write_policy
from sandlot.net.proxy import client_hello_sni


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_rules_parse_names_wildcards_addresses_networks_and_ports() -> None:
    assert Rule.parse("PyPI.org.") == Rule(name="pypi.org")
    assert Rule.parse("*.example.com:443") == Rule(name="*.example.com", port=443)
    assert Rule.parse("10.1.0.0/16").network == ipaddress.ip_network("10.1.0.0/16")
    assert Rule.parse("[::1]:8443") == Rule(network=ipaddress.ip_network("::1"), port=8443)
    assert Rule.parse("127.0.0.1:80") == Rule(network=ipaddress.ip_network("127.0.0.1/32"), port=80)
    for bad in ["", "exa mple.com", "*.*.com", "a*.com", "host:0", "host:99999", "host:x", "[::1", "-a.com"]:
        with pytest.raises(InvalidArgument):
            Rule.parse(bad)
    with pytest.raises(InvalidArgument):
        Policy.build("open", ["example.com"])  # meaningless: nothing is filtered
    with pytest.raises(InvalidArgument):
        Policy.build("internet")
    assert Policy.build(None).mode == "none" and Policy.build(True).mode == "public"
    assert Policy.build(None, ["pypi.org"]).mode == "allowlist"


INTERNAL = ["127.0.0.1", "10.0.2.2", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
            "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fd00::1", "::ffff:127.0.0.1",
            "::ffff:10.0.0.1"]  # fmt: skip


def test_public_addresses_exclude_every_internal_range() -> None:
    for a in INTERNAL:
        assert not is_public_address(ip(a)), a
    for a in ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:1.1.1.1"]:
        assert is_public_address(ip(a)), a


def test_policies_decide_names_then_addresses() -> None:
    public = Policy.build("public", ["127.0.0.1:8080"])
    assert public.allows_name("anything.example", 443)
    assert public.allows_address(ip("1.1.1.1"), 443, name_allowed=False)
    assert not public.allows_address(ip("127.0.0.1"), 22, name_allowed=True)
    assert public.allows_address(ip("127.0.0.1"), 8080, name_allowed=False)  # listed: opted in
    allow = Policy.build("allowlist", ["pypi.org", "*.pythonhosted.org:443", "203.0.113.0/24"])
    assert allow.allows_name("PYPI.org", 80) and allow.allows_name("files.pythonhosted.org", 443)
    assert not allow.allows_name("pythonhosted.org", 443)  # *. means subdomains
    assert not allow.allows_name("files.pythonhosted.org", 80)
    assert not allow.allows_name("evil.example", 443)
    assert allow.allows_address(ip("1.1.1.1"), 443, name_allowed=True)
    assert not allow.allows_address(ip("1.1.1.1"), 443, name_allowed=False)  # a raw IP must be listed
    assert allow.allows_address(ip("203.0.113.9"), 443, name_allowed=False)
    assert not allow.allows_address(ip("10.0.0.1"), 443, name_allowed=True)  # DNS pointing inside
    assert Policy.from_json(json.loads(json.dumps(allow.to_json()))) == allow


def client_hello(server_name: str) -> bytes:
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_client_hello_server_name() -> None:
    assert client_hello_sni(client_hello("API.Example.com")) == "api.example.com"
    assert client_hello_sni(b"GET / HTTP/1.1\r\n\r\n") is None
    assert client_hello_sni(b"\x16\x03\x01\x00\x05\x01\x00") is None  # truncated


def connect(target: str) -> bytes:
    return f"CONNECT {target} HTTP/1.1\r\n\r\n".encode()


# -- the proxy process ------------------------------------------------------------------


class Upstream:
    """A TCP server on 127.0.0.1 that records what it received and answers 'pong'."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data and not data.startswith(b"\x16"):
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    self.received.append(data)
                    conn.sendall(b"pong")
                except OSError:
                    self.received.append(data)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.sock.close()


def through_proxy(  # type: ignore[type-arg]
    tmp_path: Path, policy: Policy, request: bytes, then: bytes = b"", *, transparent: int | None = None
) -> tuple[bytes, dict]:
    """Run one proxy process on one connection, as QEMU does; return what the guest
    read and the decision logged. ``transparent``: the port of a straight connection."""
    write_policy(tmp_path / "policy.json", policy)
    guest, theirs = socket.socketpair()
    argv = [sys.executable, "-m", "sandlot.net.proxy", str(tmp_path / "policy.json"), str(tmp_path / "log")]
    if transparent is not None:
        argv += ["--transparent", str(transparent)]
    proc = subprocess.Popen(argv, stdin=theirs, stdout=theirs, stderr=theirs)
    theirs.close()
    guest.settimeout(20)
    guest.sendall(request)
    out = b""
    if then:
        out = guest.recv(4096)
        guest.sendall(then)
    guest.shutdown(socket.SHUT_WR)
    while chunk := guest.recv(4096):
        out += chunk
    assert proc.wait(20) == 0
    lines = (tmp_path / "log").read_text().splitlines()
    (tmp_path / "log").unlink()
    return out, json.loads(lines[-1])


def test_proxy_tunnels_to_a_listed_address(tmp_path: Path, upstream: Upstream) -> None:
    policy = Policy.build("allowlist", [f"127.0.0.1:{upstream.port}"])
    out, entry = through_proxy(tmp_path, policy, connect(f"127.0.0.1:{upstream.port}"), then=b"ping\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") or out == b"pong"
    assert entry["decision"] == "allowed" and entry["address"] == "127.0.0.1"
    assert upstream.received[-1] == b"ping\r\n\r\n"


def test_proxy_denies_the_hosts_loopback_in_public_mode(tmp_path: Path, upstream: Upstream) -> None:
    for target in [f"127.0.0.1:{upstream.port}", f"localhost:{upstream.port}", f"[::1]:{upstream.port}",
                   "169.254.169.254:80", "10.0.2.2:80"]:  # fmt: skip
        out, entry = through_proxy(tmp_path, Policy.build("public"), connect(target))
        assert out.startswith(b"HTTP/1.1 403") and b"egress denied" in out, target
        assert entry["decision"] == "denied"
    assert upstream.received == []


def test_proxy_denies_names_not_listed_and_names_resolving_inside(tmp_path: Path, upstream: Upstream) -> None:
    policy = Policy.build("allowlist", ["localhost", "pypi.org"])
    out, entry = through_proxy(tmp_path, policy, connect(f"localhost:{upstream.port}"))
    assert out.startswith(b"HTTP/1.1 403") and "not a public address" in entry["reason"]
    out, entry = through_proxy(tmp_path, policy, b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403") and "allowlist" in entry["reason"]
    out, entry = through_proxy(tmp_path, policy, b"CONNECT 1.1.1.1:443 HTTP/1.1\r\n\r\n")  # raw IP
    assert out.startswith(b"HTTP/1.1 403")
    assert upstream.received == []


def test_proxy_checks_the_tls_server_name(tmp_path: Path, upstream: Upstream) -> None:
    policy = Policy.build("allowlist", [f"127.0.0.1:{upstream.port}", "allowed.example"])
    tunnel = connect(f"127.0.0.1:{upstream.port}")
    out, entry = through_proxy(tmp_path, policy, tunnel, then=client_hello("evil.example"))
    assert entry["decision"] == "denied" and "evil.example" in entry["reason"]
    assert upstream.received == [] and b"pong" not in out
    out, entry = through_proxy(tmp_path, policy, tunnel, then=client_hello("allowed.example"))
    assert entry["decision"] == "allowed" and upstream.received[-1].startswith(b"\x16")


def test_proxy_forwards_plain_http_one_request_per_connection(tmp_path: Path, upstream: Upstream) -> None:
    policy = Policy.build("allowlist", [f"127.0.0.1:{upstream.port}"])
    request = (f"GET http://127.0.0.1:{upstream.port}/simple/pip/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               "Proxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n").encode()  # fmt: skip
    out, entry = through_proxy(tmp_path, policy, request)
    assert out == b"pong" and entry["decision"] == "allowed"
    sent = upstream.received[-1]
    assert sent.startswith(b"GET /simple/pip/ HTTP/1.1\r\n")
    assert b"Proxy-Connection" not in sent and b"Connection: close" in sent and b"Accept: */*" in sent


def test_proxy_rejects_malformed_requests(tmp_path: Path) -> None:
    policy = Policy.build("public")
    for bad in [b"GET /relative HTTP/1.1\r\n\r\n", b"garbage\r\n\r\n", b"CONNECT host:99999 HTTP/1.1\r\n\r\n",
                b"CONNECT :443 HTTP/1.1\r\n\r\n", b"X" * 20000 + b"\r\n\r\n",
                b"CONNECT [::1 HTTP/1.1\r\n\r\n", b"CONNECT [::1]junk HTTP/1.1\r\n\r\n"]:  # fmt: skip
        out, entry = through_proxy(tmp_path, policy, bad)
        assert out.startswith(b"HTTP/1.1 403") and entry["decision"] == "denied", bad[:40]
        if bad.startswith(b"CONNECT ["):  # refused as malformed, not for what a garbled host resolved to
            assert "bad target" in entry["reason"], entry


def test_a_damaged_policy_file_denies_everything(tmp_path: Path, upstream: Upstream) -> None:
    from sandlot.net.policy import read_policy

    (tmp_path / "policy.json").write_text("{not json")
    assert read_policy(tmp_path / "policy.json") == Policy(mode="allowlist")
    assert read_policy(tmp_path / "missing.json") == Policy(mode="allowlist")


def test_straight_connections_are_routed_by_server_name_or_host(tmp_path: Path, upstream: Upstream) -> None:
    """What a program that ignores HTTP(S)_PROXY sends to the address sandlot's DNS gave it."""
    p = upstream.port
    policy = Policy.build("allowlist", [f"127.0.0.1:{p}", "allowed.example"])
    # HTTP: the Host header names where it goes; the request goes as it was sent
    request = f"GET /x HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n\r\n".encode()
    out, entry = through_proxy(tmp_path, policy, request, transparent=p)
    assert out == b"pong" and entry["decision"] == "allowed" and entry["transparent"] is True
    assert upstream.received[-1] == request
    out, entry = through_proxy(
        tmp_path, policy, b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n", transparent=p
    )
    assert out.startswith(b"HTTP/1.1 403") and entry["decision"] == "denied"
    # TLS: the server name; one not allowed, or none at all, is cut without a byte sent on
    hits = len(upstream.received)
    out, entry = through_proxy(tmp_path, policy, client_hello("evil.example"), transparent=p)
    assert out == b"" and entry["decision"] == "denied" and "evil.example" in entry["reason"]
    no_name = b"\x16\x03\x01\x00\x04\x01\x00\x00\x00"  # a (short) ClientHello with no server name
    out, entry = through_proxy(tmp_path, policy, no_name, transparent=p)
    assert entry["decision"] == "denied" and "server name" in entry["reason"]
    assert len(upstream.received) == hits
