"""Egress policy: where a box may connect, decided on the host, never in the guest.

Modes (``Box(network=...)``):

* ``none``: the box has no network card at all (the default).
* ``public``: HTTP and HTTPS to the internet through sandlot's egress proxy; never
  the host's loopback, link-local addresses (169.254.0.0/16, the cloud metadata
  service among them), private or otherwise non-global ranges, unless ``allow``
  lists them. What a name resolves to is checked, and the checked address is
  the one connected to (a name cannot be re-resolved to somewhere else).
* ``allowlist``: like ``public``, but only to the names and networks in ``allow``.
* ``open``: QEMU's user networking unrestricted: anything the host can reach,
  its own 127.0.0.1 included (as 10.0.2.2). For trusted code only.

``allow`` entries: ``"example.com"``, ``"*.example.com"`` (its subdomains),
either with ``":PORT"``; ``"203.0.113.7"``, ``"10.1.0.0/16"``, ``"[::1]:8443"``
(addresses and networks, optionally with a port). A listed network is reachable
even if private or loopback: listing it is the explicit opt-in.
``"box:NAME:PORT"``: that TCP port of the box named NAME in the same namespace,
and nothing else of it. The box asks for it as ``NAME.box.internal`` (or plain
``NAME``, a name of one label): through the proxy, or straight, since sandlot's
DNS answers the name with an address of its own for that box (``addresses.box_address``).
The connection goes through the other box's agent (``sandlot.net.boxlink``), so
the service needs no network card and may listen on its loopback only.
``host.sandlot.internal`` is the host's own loopback (127.0.0.1), by name: what a
box's program asks for, where it needs a name (Docker in a box pulling from a
registry on the host); reachable only on the ports ``allow`` lists for 127.0.0.1
itself (``"127.0.0.1:5000"``), since the name alone opens nothing of the host's.

``resolve`` is the one decision for a name: the egress proxy asks it for the
address to connect to, and the box's DNS (``sandlot.net.dns``) whether to
answer a name at all.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import InvalidArgument
from .addresses import MAX_BOXES

MODES = ("none", "public", "allowlist", "open")
PROXIED = ("public", "allowlist")  # the modes whose traffic goes through the egress proxy

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
BOX_DOMAIN = "box.internal"  # NAME.box.internal is box NAME (.internal: ICANN's private-use domain)
HOST_NAME = "host.sandlot.internal"  # the host's loopback, on the ports allow lists for 127.0.0.1
HOST_LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
BOX_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # a box's name (the store's rule too)


def normalize_host(host: str) -> str:
    """A host name as matched: lower case, no trailing dot (IDNA names arrive encoded)."""
    return host.strip().rstrip(".").lower()


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


_HOST_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")


def valid_host(host: str) -> bool:
    """A host a box may ask for: an IP address, or a DNS name (normalized; ``_``
    allowed, as some hosts have it). Anything else (``/``, ``..``, spaces) is refused
    before it reaches a resolver, a log or a file name."""
    if parse_ip(host) is not None:
        return True
    return 0 < len(host) <= 253 and all(_HOST_LABEL.match(label) for label in host.split("."))


def split_host_port(text: str) -> tuple[str, str | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> (host, port text or None);
    ValueError if the brackets are malformed. A bare IPv6 address has no port."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError("unclosed '['")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("expected ':PORT' after ']'")
        return host, rest[1:] if rest else None
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, None


def parse_ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


# NamedTuples, not dataclasses: the proxy imports this module once per guest
# connection, and dataclasses' imports alone cost it 8 ms.
class Rule(NamedTuple):
    """One ``allow`` entry: a name (``*.`` for subdomains) or a network, and a port or
    any; or a port of another box (``box``, with a port always)."""

    name: str | None = None
    network: IPNetwork | None = None
    port: int | None = None
    box: str | None = None

    @classmethod
    def parse(cls, text: str) -> Rule:
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(f"an allow entry must be a non-empty string, not {text!r}")
        raw = text.strip()
        if raw.startswith("box:"):
            box, _, box_port = raw[4:].rpartition(":")
            if not BOX_NAME.match(box) or not box_port:
                raise InvalidArgument(
                    f"allow entry {raw!r}: a box entry is box:NAME:PORT, NAME a box's name "
                    "(1-63 letters, digits, '_', '.' or '-') and PORT one of its TCP ports"
                )
            return cls(box=box, port=_port(raw, box_port))
        try:
            host, port_text = split_host_port(raw)
        except ValueError as exc:
            raise InvalidArgument(f"allow entry {raw!r}: {exc}") from None
        port = None if port_text is None else _port(raw, port_text)
        try:
            return cls(network=ipaddress.ip_network(host, strict=False), port=port)
        except ValueError:
            pass
        name = normalize_host(host)
        bare = name[2:] if name.startswith("*.") else name
        if not _valid_name(bare) or "*" in bare:
            raise InvalidArgument(
                f"allow entry {raw!r} is neither a host name (or *.domain) nor an address or network"
            )
        return cls(name=name, port=port)

    def matches_name(self, host: str, port: int) -> bool:
        if self.name is None or (self.port is not None and self.port != port):
            return False
        if self.name.startswith("*."):
            return host.endswith(self.name[1:]) and host != self.name[2:]
        return host == self.name

    def matches_address(self, ip: IPAddress, port: int) -> bool:
        if self.network is None or (self.port is not None and self.port != port):
            return False
        return ip.version == self.network.version and ip in self.network

    def __str__(self) -> str:
        if self.box is not None:
            return f"box:{self.box}:{self.port}"
        net = self.network
        if net is not None and net.num_addresses == 1:
            what = str(net.network_address)  # an address reads back as written
        else:
            what = self.name if self.name is not None else str(net)
        if self.port is None:
            return what
        return f"[{what}]:{self.port}" if ":" in what else f"{what}:{self.port}"


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InvalidArgument(f"allow entry {entry!r}: {text!r} is not a port number")
    return int(text)


def is_public_address(ip: IPAddress) -> bool:
    """A global unicast address: not loopback, link-local, private, shared (CGNAT),
    multicast, reserved or unspecified (IPv4-mapped IPv6 is judged as IPv4)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class Policy(NamedTuple):
    """A box's egress policy; see the module's description."""

    mode: str = "none"
    allow: tuple[Rule, ...] = ()

    @classmethod
    def build(cls, mode: str | bool | None, allow: Any = None) -> Policy:
        """Validate user input: ``mode`` one of MODES (True means ``public``, False or
        None ``none``, or ``allowlist`` when only ``allow`` is given)."""
        if mode is True:
            mode = "public"
        elif mode is None or mode is False:
            mode = "allowlist" if allow else "none"
        if mode not in MODES:
            raise InvalidArgument(f"network must be one of {', '.join(MODES)}, not {mode!r}")
        if isinstance(allow, str):
            allow = [allow]
        rules = tuple(Rule.parse(a) for a in (allow or ()))
        if rules and mode in ("none", "open"):
            raise InvalidArgument(f"allow= has no meaning with network={mode!r}")
        policy = cls(mode=mode, allow=rules)
        named = len(policy.boxes())
        if named > MAX_BOXES:
            raise InvalidArgument(f"allow= names {named} boxes; at most {MAX_BOXES} may be")
        return policy

    @property
    def has_nic(self) -> bool:
        return self.mode != "none"

    @property
    def proxied(self) -> bool:
        return self.mode in PROXIED

    def allows_name(self, host: str, port: int) -> bool:
        """May the box ask for ``host:port`` by name (before resolving it)?"""
        host = normalize_host(host)
        if self.mode == "public":
            return True
        if self.mode == "allowlist":
            return any(r.matches_name(host, port) for r in self.allow)
        return self.mode == "open"

    def ports(self, port: int | None = None) -> tuple[int, ...]:
        """The ports to check for ``port``: itself, or for None (any port) those the
        rules name and 0, which none can name: rules compare ports only for equality,
        so 0 decides as every port they do not name would."""
        if port is not None:
            return (port,)
        return (0, *sorted({r.port for r in self.allow if r.port is not None and r.box is None}))

    def name_ports(self, host: str, port: int | None = None) -> tuple[int, ...]:
        """Those of ``ports(port)`` the box may ask for ``host`` on; empty: the name is refused."""
        return tuple(p for p in self.ports(port) if self.allows_name(host, p))

    def box_named(self, host: str) -> str | None:
        """The box ``host`` stands for: ``NAME.box.internal``, or a plain ``NAME`` of one
        label, where a ``box:`` rule names NAME (DNS names are case-insensitive, the
        first rule wins); None for any other host."""
        host = normalize_host(host)
        if host.endswith("." + BOX_DOMAIN):
            host = host[: -len(BOX_DOMAIN) - 1]
        elif "." in host:
            return None
        return next((r.box for r in self.allow if r.box is not None and r.box.lower() == host), None)

    def allows_box(self, box: str, port: int) -> bool:
        """May the box connect to ``port`` of box ``box``?"""
        return self.mode in PROXIED and any(r.box == box and r.port == port for r in self.allow)

    def boxes(self) -> list[str]:
        """The boxes ``box:`` rules name, each once, in their order."""
        return list(dict.fromkeys(r.box for r in self.allow if r.box is not None))

    def allows_address(self, ip: IPAddress, port: int, *, name_allowed: bool) -> bool:
        """May the box connect to ``ip:port``? ``name_allowed``: it was reached through
        a name this policy allows (an address alone must be listed, in allowlist mode)."""
        if self.mode == "open":
            return True
        if any(r.matches_address(ip, port) for r in self.allow):
            return True
        if self.mode == "public" or (self.mode == "allowlist" and name_allowed):
            return is_public_address(ip)
        return False

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "allow": [str(r) for r in self.allow]}

    @classmethod
    def from_json(cls, data: Any) -> Policy:
        if not isinstance(data, dict):
            raise InvalidArgument("a network policy must be an object")
        return cls.build(data.get("mode"), data.get("allow") or None)


class Denied(Exception):
    """The policy refuses this destination; the message says why."""


class LookupFailed(Denied):
    """The host could not resolve an allowed name. ``temporary``: it may resolve
    later (the resolver failed), rather than not existing."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


def lookup_host(host: str) -> list[IPAddress]:
    """What ``host`` resolves to on the host, each address once, in the resolver's order."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
        missing = isinstance(exc, socket.gaierror) and exc.errno in (socket.EAI_NONAME, socket.EAI_NODATA)
        raise LookupFailed(f"cannot resolve {host}: {exc}", temporary=not missing) from None
    seen: list[IPAddress] = []
    for info in infos:
        ip = parse_ip(str(info[4][0]))
        if ip is not None and ip not in seen:
            seen.append(ip)
    return seen


def resolve(
    policy: Policy,
    host: str,
    port: int | None = None,
    *,
    lookup: Callable[[str], list[IPAddress]] = lookup_host,
) -> IPAddress:
    """The address the box may reach ``host`` at on ``port``, or Denied with the
    reason. The name is checked before it is looked up, so a refused name never
    leaves the host. ``port`` None: on any port (a DNS answer does not know the
    port it will be used with)."""
    on = f" port {port}" if port is not None else ""
    if is_box_host(host):
        raise Denied(f"{host}{on}: no box:NAME:PORT entry of this box's policy names that box")
    if normalize_host(host) == HOST_NAME:  # never looked up: it is the host's loopback
        if policy.mode in PROXIED and any(
            policy.allows_address(HOST_LOOPBACK, p, name_allowed=False) for p in policy.ports(port)
        ):
            return HOST_LOOPBACK
        raise Denied(f"{host} (the host's 127.0.0.1){on}: allow lists no 127.0.0.1{on}")
    literal = parse_ip(host)
    if literal is not None:
        if any(policy.allows_address(literal, p, name_allowed=False) for p in policy.ports(port)):
            return literal
        raise Denied(f"{literal}{on} is not allowed ({policy.mode})")
    ports = policy.name_ports(host, port)
    if not ports:
        raise Denied(f"{host}{on} is not on this box's allowlist")
    seen = lookup(host)
    for ip in seen:
        if any(policy.allows_address(ip, p, name_allowed=True) for p in ports):
            return ip
    shown = ", ".join(str(ip) for ip in seen[:3]) or "nothing"
    raise Denied(f"{host} resolves to {shown}: not a public address this box may reach")


def is_box_host(host: str) -> bool:
    """A name in sandlot's domain for boxes: never looked up on the host."""
    host = normalize_host(host)
    return host == BOX_DOMAIN or host.endswith("." + BOX_DOMAIN)


def adopt_guest_connection() -> socket.socket:
    """The guest connection QEMU gave a helper it runs (``guestfwd ... cmd:``) as
    descriptors 0-2, which are then pointed at /dev/null: nothing of the helper's
    may be written into the connection."""
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    conn = socket.socket(fileno=os.dup(0))
    os.dup2(devnull, 2)
    os.dup2(devnull, 1)
    os.close(0)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the interpreter's own messages
    return conn


def write_policy(path: Path, policy: Policy) -> None:
    """Replace the policy file atomically: the proxy reads it at every connection,
    so a change applies to the next connection of a running box."""
    from ..config import atomic_write  # not at the top: the proxy imports this module per connection

    atomic_write(path, json.dumps(policy.to_json()).encode(), mode=0o644)


def read_policy(path: Path) -> Policy:
    """The policy in force; a missing or damaged file denies everything."""
    try:
        return Policy.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return Policy(mode="allowlist")
