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


class SocketServer:
    """A listening socket served on a thread of its own, a connection at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError


class Upstream(SocketServer):
    """A TCP server on 127.0.0.1 that records what it received and answers 'pong'."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.port = self.sock.getsockname()[1]

    def handle(self, conn: socket.socket) -> None:
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
    tmp_path: Path,
    policy: Policy,
    request: bytes,
    then: bytes = b"",
    *,
    transparent: int | None = None,
    more: list[str] | None = None,
) -> tuple[bytes, dict]:
    """Run one proxy process on one connection, as QEMU does; return what the guest
    read and the decision logged. ``transparent``: the port of a straight connection;
    ``more``: more arguments."""
    write_policy(tmp_path / "policy.json", policy)
    guest, theirs = socket.socketpair()
    argv = [sys.executable, "-m", "sandlot.net.proxy", str(tmp_path / "policy.json"), str(tmp_path / "log")]
    if transparent is not None:
        argv += ["--transparent", str(transparent)]
    argv += more or []
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


def test_the_hosts_loopback_by_name_only_on_the_ports_listed_for_127_0_0_1(
    tmp_path: Path, upstream: Upstream
) -> None:
    from sandlot.net.dns import handle
    from sandlot.net.policy import HOST_NAME, Denied, resolve

    lookup = FakeLookup()
    listed = Policy.build("allowlist", [f"127.0.0.1:{upstream.port}"])
    request = (f"GET http://{HOST_NAME}:{upstream.port}/v2/ HTTP/1.1\r\nHost: {HOST_NAME}:{upstream.port}\r\n"
               "\r\n").encode()  # fmt: skip
    out, entry = through_proxy(tmp_path, listed, request)
    assert out == b"pong" and entry["decision"] == "allowed" and entry["address"] == "127.0.0.1"
    assert upstream.received[-1].startswith(b"GET /v2/ HTTP/1.1\r\n")
    reply, _ = handle(dns_query(HOST_NAME, 1), listed, lookup, {})
    assert reply is not None and dns_reply(reply)[1:] == (NOERROR, [("10.0.2.100", 10)])
    # another port, the name alone, public mode, open mode's own resolver: never
    name_only = Policy.build("allowlist", [f"{HOST_NAME}:80"])
    refused = [(listed, upstream.port + 1), (name_only, 80), (Policy.build("public"), 80),
               (Policy.build("public", [HOST_NAME]), 443)]  # fmt: skip
    for policy, port in refused:
        with pytest.raises(Denied, match=r"the host's 127\.0\.0\.1"):
            resolve(policy, HOST_NAME.upper() + ".", port, lookup=lookup)
    out, entry = through_proxy(tmp_path, Policy.build("public"), connect(f"{HOST_NAME}:{upstream.port}"))
    assert out.startswith(b"HTTP/1.1 403") and entry["decision"] == "denied"
    assert lookup.asked == []  # never looked up on the host


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
                b"CONNECT [::1 HTTP/1.1\r\n\r\n", b"CONNECT [::1]junk HTTP/1.1\r\n\r\n",
                b"CONNECT a/../../b.example.com:443 HTTP/1.1\r\n\r\n",
                b"GET http://a b/ HTTP/1.1\r\n\r\n"]:  # fmt: skip
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


# -- DNS --------------------------------------------------------------------------------


def dns_query(
    name: str, qtype: int = 1, *, ident: int = 0x1234, qclass: int = 1, extra: bytes = b""
) -> bytes:
    """A standard query as a stub resolver sends it (RD set); ``extra``: additional records."""
    qname = b"".join(len(x).to_bytes(1, "big") + x.encode() for x in name.split(".")) + b"\x00"
    header = (
        ident.to_bytes(2, "big")
        + b"\x01\x00\x00\x01\x00\x00\x00\x00"
        + (b"\x00\x01" if extra else b"\x00\x00")
    )
    return header + qname + qtype.to_bytes(2, "big") + qclass.to_bytes(2, "big") + extra


EDNS_OPT = b"\x00\x00\x29\x04\xd0\x00\x00\x00\x00\x00\x00"  # what dig and glibc add


def dns_reply(msg: bytes) -> tuple[int, int, list[tuple[str, int]]]:
    """(id, rcode, [(address, ttl)]) of a response (asserting it is one)."""
    assert msg[2] & 0x80, "not a response"
    ident, rcode = int.from_bytes(msg[:2], "big"), msg[3] & 0x0F
    qd, an = int.from_bytes(msg[4:6], "big"), int.from_bytes(msg[6:8], "big")
    p = 12
    for _ in range(qd):
        while msg[p]:
            p += 1 + msg[p]
        p += 5
    answers = []
    for _ in range(an):
        assert msg[p : p + 2] == b"\xc0\x0c"  # the question's name
        rtype, ttl = int.from_bytes(msg[p + 2 : p + 4], "big"), int.from_bytes(msg[p + 6 : p + 10], "big")
        size = int.from_bytes(msg[p + 10 : p + 12], "big")
        assert rtype == 1 and size == 4
        answers.append((socket.inet_ntoa(msg[p + 12 : p + 16]), ttl))
        p += 12 + size
    assert p == len(msg)
    return ident, rcode, answers


class FakeLookup:
    """The host's resolver, for names the tests choose; records what it was asked."""

    def __init__(self, **names: list[str]) -> None:
        self.names = names
        self.asked: list[str] = []

    def __call__(self, host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        from sandlot.net.policy import LookupFailed

        self.asked.append(host)
        key = host.replace(".", "_").replace("-", "_")
        if key not in self.names:
            raise LookupFailed(f"cannot resolve {host}", temporary=key.startswith("flaky"))
        return [ip(a) for a in self.names[key]]


NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 1, 2, 3, 4


def test_dns_queries_are_parsed_strictly() -> None:
    from sandlot.net.dns import Malformed, parse_query

    q = parse_query(dns_query("API.Example.com", 1, extra=EDNS_OPT))
    assert (q.id, q.name, q.qtype) == (0x1234, "api.example.com", 1)
    assert q.wire == dns_query("API.Example.com")[12:]  # echoed as asked, case included
    good = dns_query("example.com")
    bad = {
        "short": good[:11],
        "response": good[:2] + b"\x81" + good[3:],
        "two questions": good[:5] + b"\x02" + good[6:],
        "an answer": good[:7] + b"\x01" + good[8:],
        "pointer": good[:12] + b"\xc0\x0c\x00\x01\x00\x01",
        "bad byte": dns_query("exa mple.com"),
        "non-ascii": good[:12] + b"\x04ex\xe9m\x03com\x00\x00\x01\x00\x01",
        "root": good[:12] + b"\x00\x00\x01\x00\x01",
        "truncated name": good[:20],
        "no type": good[:-2],
        "class CH": dns_query("version.bind", 16, qclass=3),
        "trailing bytes": good + b"junk",
        "too long": dns_query(".".join(["a" * 63] * 4)),
        "label too long": good[:12] + b"\x40" + b"a" * 64 + b"\x00\x00\x01\x00\x01",
    }
    for what, msg in bad.items():
        with pytest.raises(Malformed) as err:
            parse_query(msg)
        assert err.value.rcode == FORMERR, what
    with pytest.raises(Malformed) as err:
        parse_query(good[:2] + b"\x11" + good[3:])  # opcode 2 (STATUS)
    assert err.value.rcode == NOTIMP


def test_dns_answers_allowed_names_with_the_proxy_address_only() -> None:
    from sandlot.net.addresses import PROXY_ADDRESS
    from sandlot.net.dns import ANSWER_ADDRESS, handle

    assert ANSWER_ADDRESS == PROXY_ADDRESS
    lookup = FakeLookup(localhost=["127.0.0.1", "::1"], api_example=["93.184.216.34"], inside=["10.1.2.3"])
    listed = Policy.build("allowlist", ["localhost", "127.0.0.1", "api.example", "*.svc.example"])

    def ask(
        policy: Policy, name: str, qtype: int = 1
    ) -> tuple[int, list[tuple[str, int]], dict[str, object]]:
        reply, entry = handle(dns_query(name, qtype, ident=7), policy, lookup)
        assert reply is not None
        ident, rcode, answers = dns_reply(reply)
        assert ident == 7 and entry["rcode"] == ["NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN"][rcode]
        return rcode, answers, entry

    rcode, answers, entry = ask(listed, "LocalHost")
    assert (rcode, answers) == (NOERROR, [("10.0.2.100", 10)])
    assert entry["decision"] == "allowed" and entry["address"] == "127.0.0.1" and entry["method"] == "DNS"
    assert ask(listed, "api.example")[:2] == (NOERROR, [("10.0.2.100", 10)])
    # a listed name pointing at a private address the box was not given
    rcode, answers, entry = ask(Policy.build("allowlist", ["localhost"]), "localhost")
    assert (rcode, answers, entry["decision"]) == (NXDOMAIN, [], "denied")
    assert "127.0.0.1" in str(entry["reason"]) and "not a public address" in str(entry["reason"])
    # names not listed: refused before anything is looked up, whatever the type
    lookup.asked.clear()
    for name, qtype in [
        ("blocked.example", 1),
        ("blocked.example", 28),
        ("svc.example", 15),
        ("pi.example", 1),
    ]:
        rcode, answers, entry = ask(listed, name, qtype)
        assert (rcode, answers, entry["decision"]) == (NXDOMAIN, [], "denied"), name
        assert "allowlist" in str(entry["reason"])
    assert lookup.asked == []
    # listed names: AAAA and other types are empty answers, with no lookup either
    for name, qtype in [("localhost", 28), ("a.svc.example", 16), ("api.example", 65)]:
        assert ask(listed, name, qtype)[:2] == (NOERROR, []), (name, qtype)
    assert lookup.asked == []
    # the host's resolver: a name that does not exist, one it cannot resolve now
    assert ask(listed, "x.svc.example")[0] == NXDOMAIN
    assert ask(Policy.build("public"), "flaky.example")[0] == SERVFAIL
    # public: any name, but never one resolving inside; addresses are not names
    public = Policy.build("public")
    assert ask(public, "api.example")[:2] == (NOERROR, [("10.0.2.100", 10)])
    for name in ["inside", "localhost"]:
        assert ask(public, name)[0] == NXDOMAIN, name
    lookup.asked.clear()
    for name in ["127.1", "1.2.3.4", "8.8.8.8"]:
        assert ask(public, name)[0] == NXDOMAIN, name
    assert lookup.asked == []
    # open (a guest restored from another mode's snapshot): the host's answer, IPv4 only
    assert ask(Policy.build("open"), "localhost")[:2] == (NOERROR, [("127.0.0.1", 10)])


def test_dns_ports_of_name_and_address_rules_must_meet() -> None:
    from sandlot.net.dns import handle

    lookup = FakeLookup(api_example=["127.0.0.1"])
    for allow, answered in [
        (["api.example:8443", "127.0.0.1:8443"], True),
        (["api.example", "127.0.0.1:8443"], True),
        (["api.example:8443", "127.0.0.1"], True),
        (["api.example:443", "127.0.0.1:8443"], False),  # no port both rules allow
    ]:
        reply, _ = handle(dns_query("api.example"), Policy.build("allowlist", allow), lookup)
        assert reply is not None
        assert (dns_reply(reply)[1] == NOERROR) is answered, allow


def test_dns_refuses_malformed_messages_without_failing() -> None:
    from sandlot.net.dns import handle

    def broken(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        raise RuntimeError("resolver bug")

    public = Policy.build("public")
    reply, entry = handle(dns_query("exa mple.com", ident=9), public, broken)
    assert reply is not None and dns_reply(reply)[:2] == (9, FORMERR) and entry["decision"] == "denied"
    assert handle(b"\x00", public, broken)[0] is None  # not even an id to answer
    reply, entry = handle(dns_query("example.com"), public, broken)
    assert reply is not None and dns_reply(reply)[1] == SERVFAIL and "resolver bug" in str(entry["reason"])
    nothing = Policy.build("allowlist")
    for size in range(0, 40):  # every truncation of a valid query
        msg = dns_query("a.example", extra=EDNS_OPT)[:size]
        reply, entry = handle(msg, nothing, broken)
        assert reply is None or dns_reply(reply)[1] in (FORMERR, NXDOMAIN)


class DnsProcess:
    """One DNS process on one connection, run as QEMU runs it."""

    def __init__(self, tmp_path: Path, policy: Policy) -> None:
        self.policy_path, self.log_path = tmp_path / "policy.json", tmp_path / "log"
        write_policy(self.policy_path, policy)
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandlot.net.dns", str(self.policy_path), str(self.log_path)],
            stdin=theirs, stdout=theirs, stderr=theirs,
        )  # fmt: skip
        theirs.close()
        self.sock.settimeout(20)

    def ask(self, msg: bytes) -> bytes:
        self.sock.sendall(len(msg).to_bytes(2, "big") + msg)
        head = self.sock.recv(2, socket.MSG_WAITALL)
        return self.sock.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)

    def close(self) -> list[dict[str, object]]:
        """The decisions it logged, once it has ended."""
        self.sock.shutdown(socket.SHUT_WR)
        try:
            rest = self.sock.recv(1)
        except ConnectionResetError:  # it left before reading all we sent
            rest = b""
        self.sock.close()
        assert rest == b"" and self.proc.wait(20) == 0
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines()]


def test_dns_process_answers_several_queries_per_connection(tmp_path: Path) -> None:
    # only names this host resolves itself (localhost) or refuses unasked: no query leaves it
    dns = DnsProcess(tmp_path, Policy.build("allowlist", ["localhost", "127.0.0.1"]))
    assert dns_reply(dns.ask(dns_query("localhost", ident=1))) == (1, NOERROR, [("10.0.2.100", 10)])
    assert dns_reply(dns.ask(b"\x00\x02garbage"))[:2] == (2, FORMERR)
    assert dns_reply(dns.ask(dns_query("blocked.example", ident=3)))[:2] == (3, NXDOMAIN)
    # the policy is read for each query: a change applies to the connection's next one
    write_policy(dns.policy_path, Policy.build("allowlist", ["localhost"]))
    assert dns_reply(dns.ask(dns_query("localhost", ident=4)))[:2] == (4, NXDOMAIN)
    log = dns.close()
    assert [e["decision"] for e in log] == ["allowed", "denied", "denied", "denied"]
    assert [e.get("host") for e in log] == ["localhost", None, "blocked.example", "localhost"]
    assert "not a public address" in str(log[3]["reason"]) and "allowlist" in str(log[2]["reason"])


def test_dns_process_ends_a_connection_whose_framing_is_lost(tmp_path: Path) -> None:
    dns = DnsProcess(tmp_path, Policy.build("public"))
    dns.sock.sendall(b"\xff\xff" + b"\x00" * 100)  # a length no query has: where would the next begin?
    assert dns.close() == []


def test_the_guest_asks_the_host_for_names_where_qemus_resolver_is_out_of_reach(tmp_path: Path) -> None:
    from sandlot.engine.base import NetSpec as NetConfig
    from sandlot.engine.qemu.command import VMConfig, build_command

    def kernel_and_netdev(net: NetConfig) -> tuple[str, str]:
        cfg = VMConfig(kernel=tmp_path, initrd=tmp_path, disk=tmp_path, run_dir=tmp_path, state_dir=tmp_path,
                       network=net)  # fmt: skip
        cmd = build_command(cfg, "qemu")
        return cmd[cmd.index("-append") + 1], cmd[cmd.index("-netdev") + 1]

    append, netdev = kernel_and_netdev(NetConfig(restrict=True, proxy_command="p", dns_command="d"))
    assert "sandlot.net=1 sandlot.dns=relay" in append
    assert "guestfwd=tcp:10.0.2.100:3128-cmd:p" in netdev and "guestfwd=tcp:10.0.2.100:53-cmd:d" in netdev
    append, netdev = kernel_and_netdev(NetConfig(restrict=False, dns_command="d"))  # open
    assert "sandlot.net=1" in append and "sandlot.dns" not in append
    assert "guestfwd=tcp:10.0.2.100:53-cmd:d" in netdev  # for a guest restored from a proxied box
    boxes = NetConfig(proxy_command="p", guest_forwards=(("10.0.2.101", 5432, "p --box a,b 5432"),))
    assert "guestfwd=tcp:10.0.2.101:5432-cmd:p --box a,,b 5432" in kernel_and_netdev(boxes)[1]


def test_box_entries_name_a_box_and_one_of_its_ports() -> None:
    policy = Policy.build(None, ["box:web:8000", "box:Db.main:5432", "pypi.org"])
    assert policy.mode == "allowlist"
    assert [str(r) for r in policy.allow] == ["box:web:8000", "box:Db.main:5432", "pypi.org"]
    assert Policy.from_json(policy.to_json()) == policy
    assert policy.boxes() == ["web", "Db.main"]
    assert policy.box_named("web") == policy.box_named("WEB.box.internal.") == "web"
    assert policy.box_named("db.main.box.internal") == "Db.main"
    assert policy.box_named("db.main") is None  # a plain name of more than one label is a host outside
    assert policy.box_named("nobody.box.internal") is None and policy.box_named("pypi.org") is None
    assert policy.allows_box("web", 8000) and not policy.allows_box("web", 8001)
    assert not policy.allows_box("Db.main", 8000) and not policy.allows_box("db.main", 5432)
    assert not Policy.build("allowlist", ["pypi.org"]).allows_box("web", 8000)
    # a box entry is no name, address or port of the internet
    assert policy.ports() == (0,) and not policy.allows_name("web", 8000)
    for bad in [
        "box:web",
        "box::80",
        "box:web:0",
        "box:web:http",
        "box:-web:80",
        "box:a/b:80",
        "box:web:99999",
    ]:
        with pytest.raises(InvalidArgument, match="allow entry"):
            Policy.build("allowlist", [bad])
    with pytest.raises(InvalidArgument, match="no meaning"):
        Policy.build("open", ["box:web:80"])
    with pytest.raises(InvalidArgument, match="at most 100"):
        Policy.build("allowlist", [f"box:b{i}:80" for i in range(101)])


def test_names_in_the_box_domain_are_never_looked_up_on_the_host() -> None:
    from sandlot.net.dns import handle
    from sandlot.net.policy import Denied, resolve

    lookup = FakeLookup()
    policy = Policy.build("public", ["box:web:8000", "box:late:80"])
    with pytest.raises(Denied, match="names that box"):
        resolve(policy, "nobody.box.internal", 80, lookup=lookup)
    boxes = {"web": "10.0.2.101"}  # "late" was named after the VM started: no address of its own
    answers = {}
    questions = [("web.box.internal", 1), ("web", 1), ("late.box.internal", 1), ("web.box.internal", 28),
                 ("nobody.box.internal", 1), ("box.internal", 1)]  # fmt: skip
    for name, qtype in questions:
        reply, _ = handle(dns_query(name, qtype), policy, lookup, boxes)
        assert reply is not None
        answers[name, qtype] = dns_reply(reply)[1:]
    assert answers["web.box.internal", 1] == (NOERROR, [("10.0.2.101", 10)])
    assert answers["web", 1] == (NOERROR, [("10.0.2.101", 10)])
    assert answers["late.box.internal", 1] == (NOERROR, [("10.0.2.100", 10)])  # through the proxy
    assert answers["web.box.internal", 28] == (NOERROR, [])
    assert answers["nobody.box.internal", 1] == (NXDOMAIN, [])
    assert answers["box.internal", 1] == (NXDOMAIN, [])
    assert lookup.asked == []


def test_box_addresses_are_in_the_guest_network_and_bounded() -> None:
    from sandlot.net.addresses import MAX_BOXES, PROXY_ADDRESS, box_address

    addresses = [box_address(n) for n in range(MAX_BOXES)]
    assert addresses[0] == "10.0.2.101" and addresses[-1] == "10.0.2.200" and PROXY_ADDRESS not in addresses
    with pytest.raises(ValueError):
        box_address(MAX_BOXES)


class FakeLink(SocketServer):
    """A box link on a unix socket that answers as the real one does, and then
    echoes what it gets: what the proxy sends and reads, as a guest would see it."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.answer = answer
        self.requests: list[dict[str, object]] = []
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen()
        super().__init__(sock)

    def handle(self, conn: socket.socket) -> None:
        line = b""
        while not line.endswith(b"\n"):
            line += conn.recv(1)
        self.requests.append(json.loads(line))
        conn.sendall(self.answer)
        while self.answer == b"ok\n" and (data := conn.recv(4096)):
            conn.sendall(b"echo:" + data)


def link_file(tmp_path: Path, sock: Path) -> Path:
    from sandlot.net.boxlink import LinkInfo

    info = LinkInfo(home=str(tmp_path), box="b0x1d", socket=str(sock), python=sys.executable, addresses={})
    (tmp_path / "link.json").write_text(json.dumps(info.to_json()))
    return tmp_path / "link.json"


@pytest.mark.parametrize(
    ("answer", "status", "decision"),
    [
        (b"ok\n", b"HTTP/1.1 200", "allowed"),
        (b"denied not in this namespace\n", b"HTTP/1.1 403", "denied"),
        (b"failed port 8000 refused\n", b"HTTP/1.1 502", "failed"),
    ],
)
def test_proxy_reaches_boxes_through_the_homes_link(
    tmp_path: Path, answer: bytes, status: bytes, decision: str
) -> None:
    link = FakeLink(tmp_path / "link.sock", answer)
    policy = Policy.build("allowlist", ["box:web:8000"])
    more = ["--link", str(link_file(tmp_path, tmp_path / "link.sock"))]
    then = b"hello" if decision == "allowed" else b""
    out, entry = through_proxy(tmp_path, policy, connect("web.box.internal:8000"), then=then, more=more)
    assert out.startswith(status) and entry["decision"] == decision and entry["box"] == "web", (out, entry)
    assert link.requests == [{"from": "b0x1d", "box": "web", "port": 8000}]
    if decision == "allowed":
        assert out.endswith(b"echo:hello")
    else:
        assert answer.split(b" ", 1)[1].strip().decode() in entry["reason"]
    # straight to the box's own address: no request to read, the bytes go as they are
    out, entry = through_proxy(tmp_path, policy, b"hi", more=[*more, "--box", "web", "8000"])
    assert entry["decision"] == decision and out == (b"echo:hi" if decision == "allowed" else b"")
    # a port the policy does not name never reaches the link
    link.requests.clear()
    out, entry = through_proxy(tmp_path, policy, connect("web.box.internal:9000"), more=more)
    assert out.startswith(b"HTTP/1.1 403") and "port 9000 of box web" in entry["reason"]
    out, entry = through_proxy(tmp_path, policy, b"hi", more=[*more, "--box", "web", "9000"])
    assert out == b"" and entry["decision"] == "denied" and link.requests == []
    link.sock.close()


def test_proxy_of_a_box_started_without_a_link_refuses_boxes(tmp_path: Path) -> None:
    out, entry = through_proxy(tmp_path, Policy.build("allowlist", ["box:web:80"]), connect("web:80"))
    assert out.startswith(b"HTTP/1.1 403") and "without a box link" in entry["reason"]


def test_proxy_arguments_old_and_new() -> None:
    from sandlot.net.proxy import Args

    assert Args.parse(["p", "POL", "LOG"]) == Args(Path("POL"), "LOG")
    assert Args.parse(["p", "POL", "LOG", "--transparent", "443"]) == Args(
        Path("POL"), "LOG", transparent=443
    )
    assert Args.parse(["p", "POL", "LOG", "--link", "L", "--box", "db.main", "5432"]) == Args(
        Path("POL"), "LOG", link=Path("L"), box=("db.main", 5432)
    )
    for bad in (["p", "POL"], ["p", "POL", "LOG", "--box", "web"], ["p", "POL", "LOG", "--what", "1"]):
        assert Args.parse(bad) is None


def test_the_homes_link_refuses_what_it_cannot_check_and_runs_once(tmp_path: Path) -> None:
    import time

    sock = tmp_path / "link.sock"
    argv = [sys.executable, "-m", "sandlot.api.boxlink", str(tmp_path / "home"), str(sock)]
    link = subprocess.Popen(argv)
    try:
        for _ in range(300):
            if sock.exists():
                break
            time.sleep(0.05)
        assert subprocess.run(argv, timeout=60).returncode == 0  # the home has a link: the second one leaves

        def ask(request: bytes) -> bytes:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(sock))
                s.sendall(request)
                return s.recv(4096)

        assert ask(b"not json\n") == b"denied malformed request\n"
        assert ask(b'{"from": "x", "box": "web", "port": 0}\n') == b"denied malformed request\n"
        assert ask(b'{"from": "f00d", "box": "web", "port": 80}\n') == b"denied no box f00d\n"
        assert link.poll() is None
    finally:
        link.terminate()
        link.wait(10)
