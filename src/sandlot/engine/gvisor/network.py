"""A gVisor box's network card: a network namespace of the box's own, with both ends
of a veth pair inside it.

- ``eth0`` is the box's: runsc (``--network=sandbox``) hands it to the sandbox's
  netstack, with the address and routes it has when the sandbox starts (QEMU's
  fixed ones: ``10.0.2.15/24``, default route through ``10.0.2.2``), and takes
  the address off the namespace's side. So they are set again before every start
  or restore.
- ``gw0`` is sandlot's: it holds the gateway and the helpers' addresses
  (``10.0.2.2``, ``10.0.2.3``, ``10.0.2.100`` and the linked boxes' addresses), on
  which the box's forwarder (``sandlot.net.forwarder``) listens with sockets it makes in
  this namespace. It is down and has no address while runsc starts, as runsc
  takes every interface that is up, and a local gateway address could not be the
  box's route.

Nothing routes between this namespace and the host's (no forwarding, no route out):
what the box reaches is what the forwarder's listeners take, as under QEMU's
restricted user networking. Open mode adds one ``iptables`` rule here, which sends
every other TCP connection of the box to the forwarder.

runsc 0.0~20221219 refuses ``--network=sandbox`` where
``/proc/sys/net/core/rmem_default`` exists, its sign of the host's root namespace;
Linux 6.x has that file in every namespace. So runsc runs in a mount namespace of
its own with a tmpfs over ``/proc/sys/net/core`` (``launcher``). Every runsc
command for the container runs in the box's namespace: the sandbox's control
socket is an abstract Unix socket, and those are per namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import HostSetupError
from ...net import netns
from ...net.addresses import GATEWAY_ADDRESS, GUEST_ADDRESS, PROXY_ADDRESS, RESOLVER_ADDRESS
from ..base import NetSpec

NETNS_DIR = Path("/run/netns")  # where ``ip netns`` keeps named namespaces
BOX_DEVICE = "eth0"
GATEWAY_DEVICE = "gw0"
GUEST_CIDR = f"{GUEST_ADDRESS}/24"
OPEN_PORT = 1  # where open mode's rule sends the box's other TCP connections (nothing else listens)
ETH_P_IP = 0x0800
PROBE_MARK = 0x5A4D  # the firewall mark of ``held_time_waits``'s probes, left untracked (``redirect``)


def forwarder_spec(net: NetSpec) -> dict[str, Any]:
    """What the box's forwarder serves (``sandlot.net.forwarder``), from the card the core asked for."""
    helpers = net.helpers()
    return {
        "listen": [list(h) for h in helpers],
        "publish": [list(f) for f in net.forwards],
        "open_port": 0 if net.restrict else OPEN_PORT,
        "addresses": sorted({PROXY_ADDRESS, *(address for address, _, _ in helpers)}),
        "dns_relay": net.dns_relay,
    }


def netns_path(cid: str) -> Path:
    return NETNS_DIR / cid


def exists(cid: str) -> bool:
    return netns_path(cid).exists()


def _run(argv: list[str], what: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise HostSetupError(f"{what}: {argv[0]} not found (apt-get install iproute2)") from exc
    except subprocess.TimeoutExpired as exc:
        raise HostSetupError(f"{what}: {argv[0]} took more than 30 s") from exc
    if check and proc.returncode != 0:
        raise HostSetupError(f"{what}: {' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _ip_batch(cid: str, commands: list[str], what: str) -> None:
    """Several ``ip`` commands in one process, in the box's namespace."""
    script = "\n".join(commands) + "\n"
    proc = subprocess.run(
        ["ip", "-n", cid, "-batch", "-"], input=script, capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0:
        raise HostSetupError(f"{what}: ip: {proc.stderr.strip()}")


def in_namespace(cid: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread of its own that entered the box's namespace."""
    failure: list[BaseException] = []

    def thread() -> None:
        fd = os.open(netns_path(cid), os.O_RDONLY | os.O_CLOEXEC)
        try:
            netns.enter(fd, cid)
            fn()
        except BaseException as exc:  # handed to the caller
            failure.append(exc)
        finally:
            os.close(fd)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    if failure:
        raise failure[0]


def _sysctls() -> None:
    for name in ("all", "default"):  # IPv4 only, as QEMU's user network here (ipv6=off)
        with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as f:
            f.write("1")


def prepare(cid: str, *, open_mode: bool, rules: Path) -> None:
    """Before runsc starts or restores the sandbox: the namespace and its veth pair
    (made once), the box's address and route on ``eth0``, ``gw0`` down and bare, and
    the namespace's ``iptables`` rules where they are not as wanted yet (``rules``:
    the file that records which were made for the namespace, as a restore in place
    keeps the namespace, and two ``iptables`` runs cost it ~15 ms)."""
    made = not exists(cid)
    if made:
        _run(["ip", "netns", "add", cid], "making the box's network namespace")
        with contextlib.suppress(FileNotFoundError):
            in_namespace(cid, _sysctls)  # a kernel without IPv6 has nothing to turn off
    have = _run(["ip", "-n", cid, "-o", "link", "show"], "listing the box's interfaces").stdout
    batch = []
    if f" {GATEWAY_DEVICE}@" not in have:
        batch.append(f"link add {BOX_DEVICE} type veth peer name {GATEWAY_DEVICE}")
    batch += [
        f"link set {GATEWAY_DEVICE} down",
        f"addr flush dev {GATEWAY_DEVICE}",
        f"addr replace {GUEST_CIDR} dev {BOX_DEVICE}",
        "link set lo up",
        f"link set {BOX_DEVICE} up",
        f"route replace default via {GATEWAY_ADDRESS} dev {BOX_DEVICE} onlink",
    ]
    _ip_batch(cid, batch, "configuring the box's network")
    wanted = "open" if open_mode else "restricted"
    try:
        have_rules = rules.read_text()
    except OSError:
        have_rules = ""
    if made or have_rules != wanted:
        redirect(cid, open_mode)
        rules.write_text(wanted)


def redirect(cid: str, open_mode: bool) -> None:
    """Open mode's rule: every TCP connection of the box but to the helpers' address
    goes to the forwarder, which makes it from the host. Other modes have none.
    Every mode gets a rule that only turns connection tracking on in the namespace
    (a rule that asks for it is what does): ``held_time_waits`` reads the tracked
    connections; and one that leaves its probes untracked (else open mode's NAT
    would give a probe that clashes with a redirected connection another port)."""
    iptables = shutil.which("iptables")
    if iptables is None:
        if open_mode:
            raise HostSetupError("network='open' on gVisor needs iptables (apt-get install iptables)")
        return
    ns = ["nsenter", f"--net={netns_path(cid)}", iptables, "-w", "-t", "nat"]
    _run([*ns, "-F", "PREROUTING"], "clearing the box's redirect", check=open_mode)
    kept = [  # in every mode: what ``held_time_waits`` reads and sends
        (
            "mangle",
            ["PREROUTING", "-m", "conntrack", "--ctstate", "INVALID", "-j", "RETURN"],
        ),  # changes nothing
        ("raw", ["OUTPUT", "-m", "mark", "--mark", str(PROBE_MARK), "-j", "NOTRACK"]),
    ]
    for table, rule in kept:
        at = [ns[0], ns[1], iptables, "-w", "-t", table]
        if _run([*at, "-C", *rule], "checking the box's connection tracking", check=False).returncode != 0:
            _run([*at, "-A", *rule], "tracking the box's connections", check=False)
    if open_mode:
        rule = ["-A", "PREROUTING", "-i", GATEWAY_DEVICE, "-p", "tcp", "!", "-d", PROXY_ADDRESS,
                "-j", "REDIRECT", "--to-ports", str(OPEN_PORT)]  # fmt: skip
        _run([*ns, *rule], "redirecting the box's connections (open mode)")


def started(cid: str, addresses: list[str]) -> None:
    """Once the sandbox runs (its netstack took ``eth0``): ``gw0`` up, with the gateway
    and the helpers' addresses."""
    batch = [f"addr replace {GATEWAY_ADDRESS}/24 dev {GATEWAY_DEVICE}"]
    batch += [
        f"addr replace {a}/32 dev {GATEWAY_DEVICE}"
        for a in [RESOLVER_ADDRESS, *addresses]
        if a != GATEWAY_ADDRESS
    ]
    batch.append(f"link set {GATEWAY_DEVICE} up")
    _ip_batch(cid, batch, "giving the box's gateway its addresses")


# The TCP states of a connection whose box side is still connected (the host's side
# in TIME_WAIT means the box's has ended)
LIVE_STATES = ("established", "syn-sent", "syn-recv", "fin-wait-1", "fin-wait-2", "close-wait", "last-ack",
               "closing")  # fmt: skip


def _ss(cid: str, *args: str) -> list[str]:
    states = [word for state in LIVE_STATES for word in ("state", state)]
    argv = ["nsenter", f"--net={netns_path(cid)}", "ss", *args, "-t", "-n", "-H", *states]
    return [line for line in _run(argv, "listing the box's connections").stdout.splitlines() if line.strip()]


def reset_connections(cid: str) -> int:
    """Abort every live TCP connection of the namespace's side (sandlot's ends of the
    box's connections): each is sent a reset, so the box's netstack holds no connected
    endpoint, which it could not save. Returns how many there were."""
    return len(_ss(cid, "-K"))


def connections(cid: str) -> int:
    """How many live TCP connections the namespace's side holds."""
    return len(_ss(cid))


def remove(cid: str) -> None:
    """The namespace goes (its veth pair with it). Idempotent."""
    if exists(cid):
        _run(["ip", "netns", "delete", cid], "removing the box's network namespace", check=False)


def launcher(cid: str) -> list[str]:
    """What ``runsc run`` and ``runsc restore`` are run under (see the module's doc)."""
    return ["nsenter", f"--net={netns_path(cid)}", "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mount -t tmpfs none /proc/sys/net/core && exec "$@"', "sh"]  # fmt: skip


def entered(cid: str) -> list[str]:
    """What every other runsc command for the container is run under."""
    return ["nsenter", f"--net={netns_path(cid)}"]


# -- the box's endpoints in TIME_WAIT --------------------------------------------------
#
# gVisor cannot save an endpoint in TIME_WAIT either, and ends the sandbox trying. The
# box holds one where it sent the first FIN and its peer then closed normally. sandlot's
# own ends answer such a close with a reset (``sandlot.net.relay``), but a close from
# both sides at once, or a peer of sandlot's that died, still leaves one. The netstack
# shows no endpoint to the outside, so they are found by asking: for every connection
# the namespace's connection tracking saw closed, a bare ACK is sent to the box's side
# as from its peer. An endpoint that is gone answers with a reset; one in TIME_WAIT
# answers with an ACK or not at all (RFC 793), and a reset would not end it (RFC 1337).

PROBE_SECONDS = 0.2
_TCP_ACK, _TCP_RST = 0x10, 0x04
_BOX_PACKED = socket.inet_aton(GUEST_ADDRESS)
ENDED = {"TIME_WAIT", "LAST_ACK", "CLOSE"}  # tracked states after which the box may be in TIME_WAIT
ADDRESS_KEYS = ("src", "dst", "sport", "dport")


class Flow(NamedTuple):
    """A connection of the box's, as the box sees it: its port, the peer's address
    and port (where open mode's rule redirected it, the address it was going to)."""

    box_port: int
    peer: str
    peer_port: int


def closed_flows(conntrack: str) -> set[Flow]:
    """The box's TCP connections that connection tracking (``conntrack``: the text of
    ``/proc/net/nf_conntrack``) saw end: candidates for ``held_time_waits`` only."""
    flows = set()
    for line in conntrack.splitlines():
        words = line.split()
        if "tcp" not in words[:3] or not ENDED.intersection(words):
            continue
        # the original direction's src, dst, sport, dport, then the reply's
        values = [w.partition("=")[2] for w in words if w.partition("=")[0] in ADDRESS_KEYS]
        if len(values) != 8:
            continue
        src, dst, sport, dport = values[:4]
        if src == GUEST_ADDRESS:  # the box connected out
            flows.add(Flow(int(sport), dst, int(dport)))
        elif dst == GUEST_ADDRESS:  # a connection to the box (published ports)
            flows.add(Flow(int(dport), src, int(sport)))
    return flows


def host_time_waits(proc_net_tcp: str) -> set[Flow]:
    """The same, for the namespace's own sockets in TIME_WAIT whose peer is the box
    (``proc_net_tcp``: the text of ``/proc/net/tcp``)."""
    flows = set()
    for line in proc_net_tcp.splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "06":  # TIME_WAIT
            peer, peer_port = _hex_address(local)
            box, box_port = _hex_address(remote)
            if box == GUEST_ADDRESS:
                flows.add(Flow(box_port, peer, peer_port))
    return flows


def _hex_address(text: str) -> tuple[str, int]:
    address, port = text.split(":")
    return socket.inet_ntoa(int(address, 16).to_bytes(4, "little")), int(port, 16)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # no connection tracking in this kernel
        return ""


def internet_checksum(data: bytes) -> int:
    """RFC 1071's one's-complement sum, as TCP's checksum field takes it."""
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def bare_ack(src: str, sport: int, dst: str, dport: int) -> bytes:
    """An IPv4 packet holding a TCP ACK with no data (the kernel fills in the IP
    header's checksum, identification and length)."""
    tcp = bytearray(sport.to_bytes(2, "big") + dport.to_bytes(2, "big") + bytes(8))
    tcp += bytes([5 << 4, _TCP_ACK]) + (65535).to_bytes(2, "big") + bytes(4)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + bytes([0, 6]) + len(tcp).to_bytes(2, "big")
    tcp[16:18] = internet_checksum(pseudo + bytes(tcp)).to_bytes(2, "big")
    ip = bytes([0x45, 0]) + bytes(2) + bytes(4) + bytes([64, 6]) + bytes(2)
    return ip + socket.inet_aton(src) + socket.inet_aton(dst) + bytes(tcp)


def _unanswered(flows: set[Flow]) -> list[Flow]:
    """Of ``flows``, those whose box side did not answer a bare ACK with a reset. The
    answers are read off ``gw0`` as the box sent them (a packet socket): before the
    namespace routes them or open mode's rule rewrites them, which it does not for a
    reset it finds out of its window."""
    waiting = {(f.box_port, f.peer_port): f for f in flows}
    with (
        socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP)) as answers,
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP) as raw,
    ):
        answers.bind((GATEWAY_DEVICE, ETH_P_IP))
        raw.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, PROBE_MARK)
        for f in flows:
            raw.sendto(bare_ack(f.peer, f.peer_port, GUEST_ADDRESS, f.box_port), (GUEST_ADDRESS, 0))
        deadline = time.monotonic() + PROBE_SECONDS
        while waiting and (left := deadline - time.monotonic()) > 0:
            answers.settimeout(left)
            try:
                packet = answers.recv(256)
            except TimeoutError:
                break
            if len(packet) < 40 or packet[9] != socket.IPPROTO_TCP or packet[12:16] != _BOX_PACKED:
                continue
            tcp = packet[(packet[0] & 0x0F) * 4 :]
            if len(tcp) >= 14 and tcp[13] & _TCP_RST:
                waiting.pop((int.from_bytes(tcp[0:2], "big"), int.from_bytes(tcp[2:4], "big")), None)
    return sorted(waiting.values())


def held_time_waits(cid: str) -> list[Flow]:
    """The box's connections whose endpoint is still in TIME_WAIT, which no saved state
    can hold (see above). Where the namespace tracks no connections (no iptables), the
    host side's own TIME_WAITs are the candidates: a close from both sides at once
    leaves one on each."""
    found: list[Flow] = []

    def probe() -> None:  # /proc/thread-self: this thread's namespace, not the process's
        flows = closed_flows(_read("/proc/thread-self/net/nf_conntrack"))
        flows |= host_time_waits(_read("/proc/thread-self/net/tcp"))
        if flows:
            found.extend(_unanswered(flows))

    in_namespace(cid, probe)
    return found
