"""``sandlot serve``: this home's boxes over HTTP and WebSocket (docs/server.md)."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Annotated

import typer

from .common import app, err, fail
from .mcp import AllowImage, MaxBoxes, MaxCpus, MaxMemory, MaxTimeout, limits

DNS_NAME = r"(?!-)[A-Za-z0-9-]{1,63}(\.(?!-)[A-Za-z0-9-]{1,63})*"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


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
    port: Annotated[int, typer.Option(help="Port to listen on.", min=0, max=65535)] = 7070,
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
    from ..server.app import create_app
    from ..server.state import Settings

    if (tls_cert is None) != (tls_key is None):
        raise fail("--tls-cert and --tls-key go together", 2)
    for f in (tls_cert, tls_key):
        if f is not None and not f.is_file():
            raise fail(f"{f} is not a file", 2)
    if port_domain is not None and not re.fullmatch(
        r"(?!-)[A-Za-z0-9-]{1,63}(\.(?!-)[A-Za-z0-9-]{1,63})*", port_domain
    ):
        raise fail(f"--port-domain {port_domain!r} is not a DNS name", 2)
    live_keys = [k for k in access.list_keys() if k.revoked_at is None]
    if no_auth and not _loopback(host):
        raise fail(f"--no-auth serves anyone who can reach {host}; it is refused off loopback", 2)
    if not _loopback(host) and not live_keys:
        raise fail(f"refusing to listen on {host} without API keys: create one with `sandlot keys create`", 2)
    if not no_auth and not live_keys:
        err.print("sandlot serve: no API keys exist yet; every API request gets 401 (/health, the docs "
                  "and preview URLs excepted) until `sandlot keys create --name NAME` makes one")  # fmt: skip
    mcp_limits = limits(mcp_max_boxes, mcp_max_memory_mib, mcp_max_cpus, mcp_allow_image, mcp_max_timeout)
    hooks, secret = webhook_settings(webhook or [], webhook_secret_file)
    scheme = "https" if tls_cert else "http"
    err.print(f"sandlot serve: {scheme}://{host}:{port} (docs at /docs)")
    settings = Settings(auth=not no_auth, body_timeout=body_timeout, port_domain=port_domain, mcp=not no_mcp,
                        mcp_image=mcp_image, mcp_limits=mcp_limits, heir=f"serve {host}:{port}",
                        lease=lease, webhooks=hooks, webhook_secret=secret)  # fmt: skip
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
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
    uvicorn.Server(config).run()
