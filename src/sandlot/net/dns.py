"""DNS for boxes behind the egress proxy: names are answered from the policy, on the host.

In the ``public`` and ``allowlist`` modes the guest cannot reach any resolver:
the agent relays each query its programs send to 127.0.0.53 (UDP, what glibc,
musl and Go speak) over a TCP connection to 10.0.2.100:53, which QEMU forwards
(``guestfwd ... cmd:``) to ``python -m sandlot.net.dns POLICY LOG``, served as
the egress proxy's connections are (``egress``: in the home's egress server, or
as a process of its own). It reads
length-prefixed DNS messages (RFC 1035 over TCP) until the connection ends, and
reads the policy file afresh for each, so ``set_network`` applies at once.

For an ``A`` query the name is checked before anything is looked up (a name the
box may not reach never leaves the host), then resolved on the host, and the
answer is given only if one of its addresses is one the box may reach: a
listed name resolving to the host's loopback or a private network is answered
NXDOMAIN unless that address is listed too. The answer is the proxy address
(10.0.2.100), never the real one: every connection goes through the proxy,
which resolves and checks again, so the guest learns nothing it could connect
to directly and an answer cannot be rebound somewhere else. Its TTL is short,
since the policy can change. ``AAAA`` and other types are answered empty for
names the box may reach (the guest network is IPv4 only) and NXDOMAIN for the
rest; a malformed query gets FORMERR. Each decision is a JSON line in LOG, the
egress log, with ``"method": "DNS"``, through the box's ledger (``ledger``: the log
bounded and folded); a question past the box's DNS rate (``--limits``) is answered
REFUSED at once, and a connection past the box's open connections is closed.

A box a ``box:NAME:PORT`` rule names (``NAME.box.internal``, or plain ``NAME``) is
answered with the address its VM gave that box when it started (``--link FILE``,
``boxlink.LinkInfo``), where QEMU hands connections to the proxy for that box;
one named later, with the proxy address. Names under ``box.internal`` no rule
names are NXDOMAIN, and never asked of the host.

In ``open`` mode the guest uses QEMU's own resolver (10.0.2.3) and does not come
here, unless it was restored from a snapshot of a box in another mode: then its
A queries are answered with the host's own answer, IPv4 addresses only.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from .addresses import PROXY_ADDRESS
from .boxlink import LinkInfo
from .ledger import HelperOptions, Ledger, Limits
from .policy import (
    Denied,
    IPAddress,
    LookupFailed,
    Policy,
    adopt_guest_connection,
    is_box_host,
    lookup_host,
    normalize_host,
    read_policy,
    resolve,
)
from .relay import guest_connection

ANSWER_ADDRESS = PROXY_ADDRESS
TTL = 10  # seconds: the policy can change (the agent's relay keeps an answer this long)
IDLE_TIMEOUT = 10.0  # between queries on one connection
MAX_MESSAGE = 4096  # a query is one question; EDNS may add a few dozen bytes

A, AAAA, CLASS_IN = 1, 28, 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
TYPES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA", 33: "SRV",
         64: "SVCB", 65: "HTTPS", 255: "ANY"}  # fmt: skip
_NAME_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")

Lookup = Callable[[str], list[IPAddress]]
Entry = dict[str, object]  # a line of the egress log


class Malformed(Exception):
    """A message that is not a query this responder answers; ``rcode`` says how to refuse it."""

    def __init__(self, why: str, rcode: int = FORMERR) -> None:
        super().__init__(why)
        self.rcode = rcode


class Question(NamedTuple):
    id: int
    flags: int  # the query's header flags (its RD bit is echoed)
    name: str  # as matched: lower case, no trailing dot
    qtype: int
    wire: bytes  # the question section as sent, echoed in the answer


def parse_query(msg: bytes) -> Question:
    """The one question of a standard query, or Malformed."""
    if len(msg) < 12:
        raise Malformed("shorter than a DNS header")
    flags = int.from_bytes(msg[2:4], "big")
    qdcount, ancount, nscount, arcount = (int.from_bytes(msg[i : i + 2], "big") for i in range(4, 12, 2))
    if flags & 0x8000:
        raise Malformed("a response, not a query")
    if (flags >> 11) & 0xF != 0:
        raise Malformed(f"opcode {(flags >> 11) & 0xF} is not QUERY", NOTIMP)
    if qdcount != 1 or ancount or nscount:
        raise Malformed(f"{qdcount} questions, {ancount} answers, {nscount} authority records")
    p, labels = 12, []
    while True:
        if p >= len(msg):
            raise Malformed("the name runs past the message")
        size = msg[p]
        if size == 0:
            p += 1
            break
        if size > 63:  # a compression pointer (none can precede the first name) or reserved
            raise Malformed("a compressed or extended label in the question")
        label = msg[p + 1 : p + 1 + size]
        if len(label) < size or not _NAME_BYTES.issuperset(label):
            raise Malformed("a label with bytes no host name has")
        labels.append(label.decode("ascii"))
        p += 1 + size
    if not labels or p - 12 > 255:
        raise Malformed("an empty or overlong name")
    if len(msg) < p + 4:
        raise Malformed("the question has no type and class")
    qtype, qclass = int.from_bytes(msg[p : p + 2], "big"), int.from_bytes(msg[p + 2 : p + 4], "big")
    if qclass != CLASS_IN:
        raise Malformed(f"class {qclass} is not IN")
    if len(msg) > p + 4 and not arcount:  # only additional records (EDNS's OPT) may follow
        raise Malformed("bytes after the question")
    name = normalize_host(".".join(labels))
    return Question(int.from_bytes(msg[:2], "big"), flags, name, qtype, msg[12 : p + 4])


def build_response(q: Question, rcode: int, addresses: Sequence[str] = ()) -> bytes:
    """The answer to ``q``: A records for ``addresses`` (none: an empty answer)."""
    flags = 0x8000 | (q.flags & 0x0100) | 0x0080 | rcode  # QR, RD as asked, RA
    out = q.id.to_bytes(2, "big") + flags.to_bytes(2, "big")
    out += b"\x00\x01" + len(addresses).to_bytes(2, "big") + b"\x00\x00\x00\x00" + q.wire
    for address in addresses:
        # the name: a pointer to the question's, at offset 12
        out += b"\xc0\x0c" + A.to_bytes(2, "big") + CLASS_IN.to_bytes(2, "big") + TTL.to_bytes(4, "big")
        out += b"\x00\x04" + socket.inet_aton(address)
    return out


def error_response(msg: bytes, rcode: int) -> bytes | None:
    """A reply with no question to a message that has none we could read (None: not
    even an id to answer)."""
    if len(msg) < 2:
        return None
    opcode_rd = msg[2] & 0x79 if len(msg) > 2 else 0
    return msg[:2] + bytes([0x80 | opcode_rd, 0x80 | rcode]) + b"\x00" * 8


def decide(
    policy: Policy, q: Question, lookup: Lookup = lookup_host, boxes: Mapping[str, str] | None = None
) -> tuple[int, list[str], Entry]:
    """(rcode, addresses to answer, what to log) for a well-formed question;
    ``boxes``: the guest address of each box (by name) the VM has one for."""
    entry: Entry = {}
    box = policy.box_named(q.name) if policy.proxied else None
    if box is not None:
        if q.qtype != A:
            return NOERROR, [], entry
        address = (boxes or {}).get(box, ANSWER_ADDRESS)
        entry.update(box=box, answer=address)
        return NOERROR, [address], entry
    if is_box_host(q.name):
        entry["reason"] = f"no box:NAME:PORT entry of this box's policy names {q.name}"
        return NXDOMAIN, [], entry
    if policy.mode == "open":
        if q.qtype != A:
            return NOERROR, [], entry
        v4 = [str(ip) for ip in lookup(q.name) if ip.version == 4]
        entry["address"] = ", ".join(v4[:3])
        return NOERROR, v4[:8], entry
    if q.name.rsplit(".", 1)[-1].isdigit():
        # no top-level domain is numeric (RFC 1123 2.1): it is an address (the host's
        # resolver would take "127.1" for one), and the box may not ask for it by name
        entry["reason"] = f"{q.name} is an address, not a name"
        return NXDOMAIN, [], entry
    if q.qtype != A:
        if policy.name_ports(q.name):
            return NOERROR, [], entry
        entry["reason"] = f"{q.name} is not on this box's allowlist"
        return NXDOMAIN, [], entry
    ip = resolve(policy, q.name, lookup=lookup)
    entry.update(address=str(ip), answer=ANSWER_ADDRESS)
    return NOERROR, [ANSWER_ADDRESS], entry


def refused(msg: bytes, why: str) -> tuple[bytes | None, Entry]:
    """The reply to a question past the box's rate (REFUSED, at once) and its log entry."""
    entry: Entry = {"time": round(time.time(), 3), "method": "DNS", "decision": "refused",
                    "rcode": RCODES[REFUSED], "reason": f"limit: {why}"}  # fmt: skip
    try:
        q = parse_query(msg)
    except Malformed:
        return error_response(msg, REFUSED), entry
    entry.update(host=q.name, type=TYPES.get(q.qtype, str(q.qtype)))
    return build_response(q, REFUSED), entry


def handle(
    msg: bytes, policy: Policy, lookup: Lookup = lookup_host, boxes: Mapping[str, str] | None = None
) -> tuple[bytes | None, Entry]:
    """The reply to one message and its log entry; never raises."""
    entry: Entry = {"time": round(time.time(), 3), "method": "DNS"}
    try:
        q = parse_query(msg)
    except Malformed as exc:
        entry.update(decision="denied", rcode=RCODES[exc.rcode], reason=f"malformed query: {exc}")
        return error_response(msg, exc.rcode), entry
    entry.update(host=q.name, type=TYPES.get(q.qtype, str(q.qtype)))
    addresses: list[str] = []
    try:
        rcode, addresses, more = decide(policy, q, lookup, boxes)
        entry.update(more, decision="denied" if "reason" in more else "allowed")
    except LookupFailed as exc:
        rcode = SERVFAIL if exc.temporary else NXDOMAIN
        entry.update(decision="failed", reason=str(exc))
    except Denied as exc:
        rcode = NXDOMAIN
        entry.update(decision="denied", reason=str(exc))
    except Exception as exc:  # a bug costs this answer, not the rest of the connection's
        rcode = SERVFAIL
        entry.update(decision="failed", reason=f"{type(exc).__name__}: {exc}")
    entry["rcode"] = RCODES[rcode]
    return build_response(q, rcode, addresses), entry


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve(
    conn: socket.socket,
    policy_path: Path,
    ledger: Ledger,
    lookup: Lookup = lookup_host,
    boxes: Mapping[str, str] | None = None,
) -> None:
    """Answer length-prefixed queries on ``conn`` until it ends or stays idle."""
    conn.settimeout(IDLE_TIMEOUT)
    rate = ledger.limits.dns
    while True:
        head = _recv_exact(conn, 2)
        size = int.from_bytes(head, "big") if head else 0
        msg = _recv_exact(conn, size) if 0 < size <= MAX_MESSAGE else None
        if msg is None:
            return  # ended, or a size no query has: the framing cannot be trusted further
        if ledger.admit("dns"):
            reply, entry = handle(msg, read_policy(policy_path), lookup, boxes)
        else:
            reply, entry = refused(msg, f"more than {rate.per_s:g} questions a second (burst {rate.burst:g})")
        ledger.record(entry)
        if reply is not None:
            conn.sendall(len(reply).to_bytes(2, "big") + reply)


class Args(NamedTuple):
    """``POLICY LOG [--link FILE] [--limits SPEC]`` (``--limits``: the box's bounds,
    ``ledger.Limits``, else this process's)."""

    policy: Path
    log: Path
    link: Path | None = None
    limits: Limits | None = None

    @classmethod
    def parse(cls, argv: list[str]) -> Args | None:
        opts = HelperOptions.parse(argv[3:]) if len(argv) >= 3 else None
        if opts is None or opts.rest:
            return None
        return cls(Path(argv[1]), Path(argv[2]), opts.link, opts.limits)


def main(argv: list[str]) -> int:
    """``Args``: one connection, handed over by QEMU as descriptors 0-2."""
    if Args.parse(argv) is None:
        return 2
    handle_connection(adopt_guest_connection(), argv)
    return 0


def handle_connection(conn: socket.socket, argv: list[str]) -> None:
    """Serve one guest connection as ``main`` with ``argv`` would (the egress server
    runs this in a thread of its own); the connection is closed at the end."""
    with guest_connection(conn), contextlib.suppress(OSError):  # a broken connection just ends it
        args = Args.parse(argv)
        if args is None:
            return
        ledger = Ledger(args.log, args.limits or Limits.default())
        with ledger.slot("dns") as served:
            if not served:
                return  # the relay in the box answers its client SERVFAIL
            info = LinkInfo.read(args.link) if args.link is not None else None
            serve(conn, args.policy, ledger, boxes=info.addresses if info else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
