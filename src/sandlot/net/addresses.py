"""What the guest sees of sandlot's network: the address where the egress proxy
and the DNS answerer listen, and the environment that points programs at the
proxy. Every engine must route these to the helpers the core names in its
``NetSpec``; they are the guest's side of the contract, not an engine's.

This module imports nothing: the proxy and the DNS answerer, started once per
guest connection, read it.
"""

from __future__ import annotations

# QEMU's user networking (libslirp) gives the guest 10.0.2.15 behind a virtual
# gateway 10.0.2.2 (the host's loopback, seen from the guest) with a resolver at
# 10.0.2.3; a gVisor box's namespace gives it the same (engine/gvisor/network.py).
# sandlot's helpers answer at an address of that network.
GUEST_ADDRESS = "10.0.2.15"
GATEWAY_ADDRESS = "10.0.2.2"
RESOLVER_ADDRESS = "10.0.2.3"
PROXY_ADDRESS = "10.0.2.100"
# The helpers answer here too, where a VM's egress port makes the proxy address the
# guest's own (``sandlot.net.mux``): its way out when the port's host end is away.
FALLBACK_ADDRESS = "10.0.2.99"
PROXY_PORT = 3128
DNS_PORT = 53
# Boxes a box may reach (``box:NAME:PORT``) answer at addresses of their own, so a
# connection to one needs no name inside it to be routed (a database's protocol
# has none): the n-th box the policy names when the VM starts is at BOX_BASE + n.
BOX_BASE = "10.0.2.101"
MAX_BOXES = 100


def box_address(n: int) -> str:
    """The guest address of the ``n``-th box a policy names (from 0)."""
    if not 0 <= n < MAX_BOXES:
        raise ValueError(f"only {MAX_BOXES} boxes have an address")
    head, _, last = BOX_BASE.rpartition(".")
    return f"{head}.{int(last) + n}"


def proxy_env() -> dict[str, str]:
    """What makes proxy-aware programs (pip, curl, git, npm, requests...) use the egress proxy."""
    url = f"http://{PROXY_ADDRESS}:{PROXY_PORT}"
    no_proxy = "localhost,127.0.0.1,::1"
    return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
            "NO_PROXY": no_proxy, "no_proxy": no_proxy}  # fmt: skip
