"""The web console (docs/console.md): the built files of ``server/console/`` at
``/console/``, over the ``/v1`` routes every client uses.

The page itself carries no secret and needs no key: it asks for one, keeps it in
the tab's session storage and sends it in the ``Authorization`` header of each
``/v1`` request (WebSockets, which a browser cannot give headers, offer it as a
subprotocol: ``state.key_from_subprotocols``). No cookie is ever read, so a
request another site makes in the user's browser carries no key (CSRF). Every
file is served with a strict Content-Security-Policy: scripts and styles only
from these files, no inline script, no frames, connections only to this server.
"""

from __future__ import annotations

import mimetypes
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from ..errors import NotFound

PREFIX = "/console"
ASSETS = resources.files("sandlot.server") / "console"
# 'self' covers ws: and wss: to this origin in CSP level 3 (every current browser).
# The terminal (xterm.js) writes the metrics of its character cells into <style>
# elements it makes, so style elements may be inline; style attributes in markup may
# not, and no markup is ever made from data (dom.js), so there is nothing to inject.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; style-src-elem 'self' 'unsafe-inline'; "
    "style-src-attr 'none'; img-src 'self' data: blob:; font-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # a page of another origin that opens the console keeps no handle on its window
    # (``window.opener`` is cut both ways): the key typed there is this window's alone
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",  # revalidated: a new sandlot's files are seen at once
}
TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".css": "text/css", ".html": "text/html",
         ".svg": "image/svg+xml", ".txt": "text/plain"}  # fmt: skip

pages = APIRouter(include_in_schema=False)  # no key: the page asks for one


def _asset(path: str) -> tuple[bytes, str]:
    """A file of the console by its path under ``/console/``; NotFound for anything
    else (no parent steps, no hidden files)."""
    parts = path.split("/") if path else ["index.html"]
    if any(not p or p.startswith(".") or "\\" in p for p in parts):  # "", ".", "..", hidden
        raise NotFound(f"no console file {path!r}")
    node = ASSETS
    for p in parts:
        node = node / p
    if not node.is_file():
        raise NotFound(f"no console file {path!r}")
    suffix = "." + parts[-1].rpartition(".")[2]
    media_type = TYPES.get(suffix) or mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
    return node.read_bytes(), media_type


@pages.get("/")
async def root() -> Response:
    return RedirectResponse(f"{PREFIX}/", status_code=307)


@pages.get(PREFIX)
async def console_bare() -> Response:
    return RedirectResponse(f"{PREFIX}/", status_code=307)


@pages.get(PREFIX + "/{path:path}")
async def console_file(path: str) -> Response:
    body, media_type = _asset(path)
    return Response(body, media_type=media_type, headers=HEADERS)
