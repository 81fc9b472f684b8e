"""Which origin serves what, and what every request meets before any route.

``sandlot serve`` listens twice (docs/server.md, "Origins"):

- the API listener (``--port``): ``/v1``, the console, ``/mcp``, ``/e2b``, the docs;
- the content listener (``--content-port``): what boxes serve, through port routes
  (``/v1/boxes/{box}/ports/{port}/...``), preview URLs (``/p/{token}/...``) and the
  ``--port-domain`` hosts.

A box's page is written by an agent, or by code it ran. A browser runs it on the origin
it came from: on the API's, it could call the API with the user's network position (a
``--no-auth`` server) or reach the console's window. So neither listener serves the
other's paths, whatever a proxy in front sends it (421, naming where they are).

Before routing, each listener checks the ``Host`` header against the names it answers
to: loopback's (and any address literal, for a server bound beyond loopback), the
``--allow-host`` names, and on the content listener the ``--port-domain`` hosts and
``--content-url``'s. DNS rebinding points a site's own name at 127.0.0.1, so a browser
sends that site's requests here under its name: they reach nothing (421). An address
literal cannot be rebound. On the API listener a request a browser made for a page of
another origin is refused (``Origin``, ``Sec-Fetch-Site``) unless ``--allow-origin``
names that origin, which CORS then answers too; every answer there forbids framing and
cross-origin embedding.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import InvalidArgument, RequestError, SandlotError
from .state import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DNS_NAME = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*")
LOOPBACK_NAMES = frozenset({"localhost"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
HOST_ROUTE = "sandlot.host_route"  # in the scope of a request that came by a port host (bridge.HostRoutes)
PREVIEW_PATH = re.compile(r"^/p/[^/]+(/|$)")
PORT_PATH = re.compile(r"^/v1/boxes/[^/]+/ports/[^/]+(/|$)")
# On the API listener: no page of another origin frames an answer, embeds it (a script or
# an image of a box's file), or keeps a handle on the console's window.
API_HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"x-content-type-options", b"nosniff"),
)


class Misdirected(RequestError):
    """A request to a listener that does not serve it: a host name it does not answer to,
    or a path of the other listener."""

    code, status = "misdirected_request", 421


# -- names and origins ------------------------------------------------------------------------


def split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port) of a ``Host`` header: the name in lower case, an IPv6 address
    without its brackets; None where it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, close, rest = value[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    elif value.count(":") > 1:
        return None  # an IPv6 address is bracketed in a Host header
    else:
        name, _, port_text = value.partition(":")
    if not name:
        return None
    if not port_text:
        return name, None
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        return None
    return name, int(port_text)


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def check_host_name(value: str, option: str = "--allow-host", *, addresses: bool = True) -> str:
    """A host name or (with ``addresses``) an address a listener may answer to
    (``--allow-host``), in lower case; InvalidArgument for anything else (a port, a
    wildcard, a URL)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{option} takes a host name, not {value!r}")
    name = value.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if _address(name) is not None:
        if not addresses:
            raise InvalidArgument(f"{option} {value!r} is an address: it takes a DNS name")
        return name
    if "*" in name:
        raise InvalidArgument(f"{option} {value!r}: give each name; a wildcard would answer the names "
                              "DNS rebinding uses")  # fmt: skip
    if ":" in name or "/" in name:
        raise InvalidArgument(f"{option} {value!r} is not a host name (give the name alone, without a port "
                              "or a scheme)")  # fmt: skip
    if not DNS_NAME.fullmatch(name) or len(name) > 253:
        raise InvalidArgument(f"{option} {value!r} is not a host name")
    return name


def check_origin(value: str, option: str = "--allow-origin") -> str:
    """An origin (``scheme://host[:port]``, http or https) in the form browsers send it in
    ``Origin``: lower case, without a default port; InvalidArgument for anything else."""
    if not isinstance(value, str) or value.strip() in ("*", "null", ""):
        raise InvalidArgument(f"{option} takes one origin, such as https://app.example.com, not {value!r}")
    found = _origin(value.strip())
    if found is None:
        raise InvalidArgument(f"{option} {value!r} is not an origin: scheme://host[:port] (http or https), "
                              "with no path, query or user")  # fmt: skip
    return found


def _origin(value: str) -> str | None:
    """``value`` as a normalized origin, or None where it is not one."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or value.endswith("#"):
        return None
    name = parts.hostname
    if _address(name) is None and not DNS_NAME.fullmatch(name):
        return None
    shown = f"[{name}]" if ":" in name else name
    if port is None or port == DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{shown}"
    return f"{parts.scheme}://{shown}:{port}"


def check_content_url(value: str) -> str:
    """``--content-url``: the content listener's origin as browsers reach it."""
    return check_origin(value, "--content-url")


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a page of ``origin`` is this listener's own, as the request's ``Host`` names
    it. A Host without a port was sent to the default port (browsers leave it out), so the
    origin's port must be its scheme's default; a proxy in front keeps the port the client
    used (nginx: ``Host $http_host``)."""
    found = _origin(origin)
    parsed = split_host(host or "")
    if found is None or parsed is None:
        return False
    parts = urlsplit(found)
    name, port = parsed
    scheme_port = DEFAULT_PORTS[parts.scheme]
    return parts.hostname == name and (parts.port or scheme_port) == (port or scheme_port)


@dataclass(frozen=True)
class Names:
    """The host names one listener answers to."""

    names: frozenset[str]
    any_address: bool  # every address literal (a server bound beyond loopback), not loopback's alone
    port_hosts: re.Pattern[str] | None = None  # {port}-{box}.DOMAIN: the content listener's

    def serves(self, host: str | None) -> bool:
        if host is None:
            return True  # no Host (HTTP/1.0): not a browser's request
        parsed = split_host(host)
        if parsed is None:
            return False
        name = parsed[0]
        if name in self.names:
            return True
        ip = _address(name)
        if ip is not None:
            return self.any_address or ip.is_loopback
        return self.port_hosts is not None and self.port_hosts.match(name) is not None


def loopback(host: str) -> bool:
    """Whether listening on ``host`` (an address, or a name resolved here) reaches this
    machine's loopback alone."""
    if host == "localhost":
        return True
    ip = _address(host.strip("[]"))
    if ip is not None:
        return ip.is_loopback
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except OSError:
        return False


def checked(settings: Settings) -> Settings:
    """``settings`` with its names and origins checked (InvalidArgument, saying which) and
    in the form requests are compared with."""
    if settings.content_port is not None and not 0 <= settings.content_port <= 65535:
        raise InvalidArgument(f"the content port must be a TCP port, not {settings.content_port}")
    if settings.port_domain is not None:
        check_host_name(settings.port_domain, "--port-domain", addresses=False)
    return dataclasses.replace(
        settings,
        allow_hosts=tuple(dict.fromkeys(check_host_name(h) for h in settings.allow_hosts)),
        allow_origins=tuple(dict.fromkeys(check_origin(o) for o in settings.allow_origins)),
        content_url=check_content_url(settings.content_url) if settings.content_url else None,
    )


@dataclass(frozen=True)
class Layout:
    """The names each listener answers to, from a server's (checked) settings."""

    api: Names
    content: Names

    @classmethod
    def of(cls, settings: Settings) -> Layout:
        names = set(LOOPBACK_NAMES) | set(settings.allow_hosts)
        bound = settings.listen_host.strip("[]").lower()
        if bound and _address(bound) is None:
            names.add(bound)  # listening on a name: that name is served
        any_address = not loopback(settings.listen_host)
        content = set(names)
        if settings.content_url:
            content.add(urlsplit(settings.content_url).hostname or "")
        pattern = port_host_pattern(settings.port_domain) if settings.port_domain else None
        return cls(Names(frozenset(names), any_address), Names(frozenset(content), any_address, pattern))


def port_host_pattern(domain: str) -> re.Pattern[str]:
    """``{port}-{box}.{domain}`` (the box's id, or a lower-case name), with any port."""
    return re.compile(rf"^(\d{{1,5}})-([a-z0-9][a-z0-9_.-]*)\.{re.escape(domain.lower())}(?::\d+)?$")


# -- where a request belongs ------------------------------------------------------------------


def content_path(path: str) -> bool:
    """Whether ``path`` is box content: a port route or a preview URL."""
    return bool(PREVIEW_PATH.match(path) or PORT_PATH.match(path))


def content_base(settings: Settings, scheme: str, host: str | None) -> str:
    """The content listener's origin, as the client that sent ``host`` (over ``scheme``)
    reaches the server: ``--content-url``, else the same scheme and host name at the
    content port."""
    if settings.content_url:
        return settings.content_url
    parsed = split_host(host or "")
    name = parsed[0] if parsed else "127.0.0.1"
    shown = f"[{name}]" if ":" in name else name
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    return f"{scheme}://{shown}:{settings.content_port}"


def port_host_origin(base: str, domain: str, port: int, box_id: str) -> str:
    """The origin of ``port`` of a box on its own host, on the content listener at ``base``."""
    parts = urlsplit(base)
    at = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{port}-{box_id}.{domain}{at}"


def e2b_domain(base: str, domain: str) -> str:
    """The ``domain`` E2B's SDKs build a sandbox port's host from (``https://{port}-{id}.
    {domain}``): the port domain, with the content listener's port where it is not 443."""
    port = urlsplit(base).port
    return domain if port in (None, 443) else f"{domain}:{port}"


def browser_refusal(headers: dict[str, str], method: str, allowed: frozenset[str], *,
                    api: bool) -> str | None:  # fmt: skip
    """Why a request a browser made for a page of another origin is refused; None for any
    other request. Browsers name the page's origin (``Origin``) on every cross-origin
    request but a plain GET, and say how the request relates to the page
    (``Sec-Fetch-Site``) on all; other clients send neither. On the API the only pages
    admitted are its own (the console's), a link followed at the top level of a window,
    and the ``allowed`` origins'."""
    origin = headers.get("origin")
    if origin is not None and _origin(origin) in allowed:
        return None
    if origin is not None and not same_origin(origin, headers.get("host")):
        return f"a request of a page of {origin} is refused: not this server's origin"
    site = headers.get("sec-fetch-site")
    if not api or site in (None, "same-origin", "none"):
        return None
    navigates = headers.get("sec-fetch-mode") == "navigate" and headers.get("sec-fetch-dest") == "document"
    if method in ("GET", "HEAD") and navigates:
        return None  # a link followed at the top of a window: the page that had it reads nothing
    return (f"a request a browser made for a page of another origin (Sec-Fetch-Site: {site}) is refused "
            "by the API; only its own pages may call it")  # fmt: skip


# -- the front of each listener ---------------------------------------------------------------


class Front:
    """ASGI, the outermost layer of one listener: a ``Host`` it does not answer to is
    refused before any route (421; a WebSocket's handshake too), and ``headers`` go on
    every answer."""

    def __init__(self, app: ASGIApp, names: Names, what: str, refuse: Callable[[SandlotError], ASGIApp],
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:  # fmt: skip
        self.app = app
        self.names = names
        self.what = what  # "the API" / "boxes' content": for the refusal's message
        self.refuse = refuse
        self.headers = tuple(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self.headers:
            send = _adding(send, self.headers)
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if self.names.serves(host):
            await self.app(scope, receive, send)
            return
        err = Misdirected(f"{host!r} is not a name this server answers to for {self.what}: a name that "
                          "resolves here is not enough (DNS rebinding); start the server with "
                          "--allow-host NAME for a name of its own")  # fmt: skip
        await deny(scope, receive, send, err, self.refuse)


def _adding(send: Send, headers: tuple[tuple[bytes, bytes], ...]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] in ("http.response.start", "websocket.http.response.start"):
            present = {k.lower() for k, _ in message.get("headers", ())}
            extra = [(k, v) for k, v in headers if k not in present]
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return sending


async def deny(scope: Scope, receive: Receive, send: Send, err: SandlotError,
               refuse: Callable[[SandlotError], ASGIApp]) -> None:  # fmt: skip
    """Answer ``err`` as ``refuse`` shapes it: on HTTP as the response, on a WebSocket as
    the handshake's answer where the server can give one (else a 403)."""
    if scope["type"] == "http":
        await refuse(err)(scope, receive, send)
        return
    if "websocket.http.response" in (scope.get("extensions") or {}):
        response = refuse(err)

        async def as_handshake(message: Message) -> None:
            await send({**message, "type": message["type"].replace("http.", "websocket.http.", 1)})

        await response({**scope, "type": "http"}, receive, as_handshake)
        return
    await send({"type": "websocket.close", "code": 1008})


class Listeners:
    """ASGI: each connection to the app of the listener it came in on (its local port);
    the lifespan to the API's, which holds the server's state."""

    def __init__(self, api: ASGIApp, content: ASGIApp, content_port: int | None, fastapi: Any) -> None:
        self.api = api
        self.content = content
        self.content_port = content_port
        self.fastapi = fastapi  # the routes of both (their schema, for the tests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.content_port is not None:
            local = scope.get("server")
            if local is not None and local[1] == self.content_port:
                await self.content(scope, receive, send)
                return
        await self.api(scope, receive, send)
