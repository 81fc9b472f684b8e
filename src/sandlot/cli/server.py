"""``sandlot serve``: this home's boxes over HTTP and WebSocket (docs/server.md)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from .common import app, err, fail
from .mcp import AllowImage, MaxBoxes, MaxCpus, MaxMemory, MaxTimeout, limits


def listen(host: str, port: int, what: str) -> list[socket.socket]:
    """Sockets bound to ``host``:``port`` (0: any free port, the same for each), one for
    each address ``host`` stands for (``localhost``: 127.0.0.1 and ::1), as uvicorn binds
    them itself; a clear error where one cannot be."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise fail(f"cannot listen on {host}: {exc}", 2) from None
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys((f[0], f[1], f[2], "", f[4]) for f in found):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 one is its own
            sock.bind((address[0], port, *address[2:]))
            port = port or sock.getsockname()[1]
    except OSError as exc:
        for sock in bound:
            sock.close()
        raise fail(f"cannot listen on {host}:{port} for {what}: {exc.strerror or exc}", 2) from None
    return bound


def webhook_settings(urls: list[str], secret_file: Path | None) -> tuple[tuple[str, ...], bytes]:
    """The webhooks' URLs (http or https, each once) and their signing secret, checked."""
    from urllib.parse import urlsplit

    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise fail(f"--webhook {url!r} is not an http:// or https:// URL", 2)
    if secret_file is not None:
        try:
            secret = secret_file.read_bytes().strip()
        except OSError as exc:
            raise fail(f"--webhook-secret-file: {exc}", 2) from None
    else:
        secret = os.environ.get("SANDLOT_WEBHOOK_SECRET", "").encode()
    if urls and len(secret) < 16:
        raise fail("webhooks sign what they send: give a secret of 16 bytes or more "
                   "($SANDLOT_WEBHOOK_SECRET or --webhook-secret-file)", 2)  # fmt: skip
    return tuple(dict.fromkeys(urls)), secret


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on; a non-loopback one needs API keys.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port of the API and the console.", min=0, max=65535)] = 7070,
    content_port: Annotated[
        int | None,
        typer.Option(
            help="Port of boxes' content (port routes, previews, --port-domain hosts): an origin never "
            "the API's. Default: --port + 1.",
            min=0,
            max=65535,
        ),
    ] = None,
    content_url: Annotated[
        str | None,
        typer.Option(
            help="The content port's origin as browsers reach it, for the links the server hands out "
            "(behind a proxy: https://content.example.com)."
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            help="A host name the server answers to beyond loopback's (repeatable): any other Host is "
            "refused, so a name rebound to this address reaches nothing."
        ),
    ] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="An origin (https://app.example.com) whose pages may call the API; CORS answers it "
            "(repeatable). None by default."
        ),
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Serve HTTPS with this certificate (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="The certificate's private key (PEM).")] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Loopback only: serve without API keys.")
    ] = False,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds a request body may stall before the answer is 408.", min=1)
    ] = 60.0,
    port_domain: Annotated[
        str | None,
        typer.Option(
            help="Serve {port}-{box}.DOMAIN at the root path of that port of the box "
            "(a wildcard DNS name and certificate for *.DOMAIN point here)."
        ),
    ] = None,
    lease: Annotated[
        float,
        typer.Option(
            help="Seconds a box of a remote `with` block outlives its client's last renewal, "
            "unless its key sets another (10+).",
            min=10,
        ),
    ] = 60.0,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "warning",
    no_mcp: Annotated[bool, typer.Option("--no-mcp", help="Serve no MCP endpoint at /mcp.")] = False,
    mcp_image: Annotated[
        str | None, typer.Option(help="The image the MCP tools' create_box boots when a call names none.")
    ] = None,
    mcp_max_boxes: MaxBoxes = None,
    mcp_max_memory_mib: MaxMemory = None,
    mcp_max_cpus: MaxCpus = None,
    mcp_allow_image: AllowImage = None,
    mcp_max_timeout: MaxTimeout = None,
    e2b_user: Annotated[
        str,
        typer.Option(
            help="Who E2B's calls that name no user run as, where the box's image has that user "
            "(else the image's own user): E2B's templates run as 'user'. '' for the image's user always."
        ),
    ] = "user",
    e2b_template: Annotated[
        str | None,
        typer.Option(
            help="What E2B's own default templates (base, code-interpreter-v1: what the SDKs ask for "
            "when given none) start from: a sandlot template or snapshot of that name, else an image. "
            "Default: --mcp-image."
        ),
    ] = None,
    webhook: Annotated[
        list[str] | None,
        typer.Option(help="POST each event of the home to this URL, signed (repeatable; docs/events.md)."),
    ] = None,
    webhook_secret_file: Annotated[
        Path | None,
        typer.Option(help="The file holding the webhooks' signing secret (else $SANDLOT_WEBHOOK_SECRET)."),
    ] = None,
) -> None:
    """Serve this home's boxes over HTTP and WebSocket, with API keys and an audit trail."""
    import warnings

    import uvicorn

    # uvicorn 0.5x warns that "websockets" will later mean its sans-I/O variant; the
    # legacy one is what sandlot is tested on (pings, subprotocols, close codes)
    warnings.filterwarnings("ignore", message=".*`websockets` implementation is deprecated.*")

    from ..api import access
    from ..core.validate import check_user
    from ..errors import InvalidArgument
    from ..server.app import create_app
    from ..server.origins import check_content_url, check_host_name, check_origin, loopback
    from ..server.state import Settings

    if (tls_cert is None) != (tls_key is None):
        raise fail("--tls-cert and --tls-key go together", 2)
    for f in (tls_cert, tls_key):
        if f is not None and not f.is_file():
            raise fail(f"{f} is not a file", 2)
    try:
        if port_domain is not None:
            check_host_name(port_domain, "--port-domain", addresses=False)
        hosts = tuple(check_host_name(h) for h in allow_host or [])
        origins = tuple(check_origin(o) for o in allow_origin or [])
        content_url = check_content_url(content_url) if content_url is not None else None
        if e2b_user and (":" in e2b_user or e2b_user.isdigit()):
            raise InvalidArgument(f"--e2b-user is a user's name, not {e2b_user!r}")
        check_user(e2b_user or None)
    except InvalidArgument as exc:
        raise fail(exc, 2) from None
    if content_port is None:
        content_port = port + 1 if 0 < port < 65535 else 0
    if content_port == port and port != 0:
        raise fail(f"--content-port {content_port} is the API's: boxes' content needs a port of its own", 2)
    live_keys = [k for k in access.list_keys() if k.revoked_at is None]
    if no_auth and not loopback(host):
        raise fail(f"--no-auth serves anyone who can reach {host}; it is refused off loopback", 2)
    if not loopback(host) and not live_keys:
        raise fail(f"refusing to listen on {host} without API keys: create one with `sandlot keys create`", 2)
    if not no_auth and not live_keys:
        err.print("sandlot serve: no API keys exist yet; every API request gets 401 (/health, the docs "
                  "and preview URLs excepted) until `sandlot keys create --name NAME` makes one")  # fmt: skip
    mcp_limits = limits(mcp_max_boxes, mcp_max_memory_mib, mcp_max_cpus, mcp_allow_image, mcp_max_timeout)
    hooks, secret = webhook_settings(webhook or [], webhook_secret_file)
    scheme = "https" if tls_cert else "http"
    api_sockets = listen(host, port, "the API")
    try:
        content_sockets = listen(host, content_port, "boxes' content (--content-port)")
    except BaseException:
        for sock in api_sockets:
            sock.close()
        raise
    port, content_port = api_sockets[0].getsockname()[1], content_sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    err.print(f"sandlot serve: {scheme}://{shown}:{port} (docs at /docs); boxes' content at "
              f"{content_url or f'{scheme}://{shown}:{content_port}'}")  # fmt: skip
    settings = Settings(auth=not no_auth, body_timeout=body_timeout, port_domain=port_domain, mcp=not no_mcp,
                        mcp_image=mcp_image, mcp_limits=mcp_limits, heir=f"serve {host}:{port}",
                        lease=lease, webhooks=hooks, webhook_secret=secret, listen_host=host,
                        content_port=content_port, content_url=content_url, allow_hosts=hosts,
                        allow_origins=origins, e2b_user=e2b_user or None,
                        e2b_template=e2b_template or mcp_image)  # fmt: skip
    config = uvicorn.Config(
        create_app(settings),
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        log_level=log_level,
        loop="asyncio",  # the engine hands QEMU descriptors over asyncio's own sockets
        http="auto",  # httptools where installed, else h11
        ws="websockets",
        ws_ping_interval=15.0,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run(sockets=[*api_sockets, *content_sockets])
