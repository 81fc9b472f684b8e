"""``sandlot mcp``: the tools over stdio, for an MCP client that starts the server
itself (Claude Desktop, Claude Code, an IDE). Its boxes are ordinary boxes of the
home, labeled ``sandlot.mcp=stdio`` (``sandlot ls -a -f label=sandlot.mcp=stdio``)."""

from __future__ import annotations

import os
from typing import Any

import anyio
from mcp.server import ServerRequestContext
from mcp.server.stdio import stdio_server

from ..tools.toolkit import Limits, Toolkit
from .server import build

LABEL = ("sandlot.mcp", "stdio")


def toolkit(
    *,
    image: str | None = None,
    limits: Limits | None = None,
    all_boxes: bool = False,
    home: str | os.PathLike[str] | None = None,
    target: Any = None,
) -> Toolkit:
    """The toolkit of ``sandlot mcp``: boxes of ``home`` (or of the server ``target``,
    a client), labeled as its own; unless ``all_boxes``, it sees only those, so a
    client cannot reach the other boxes of the home."""
    if target is not None:
        # a server's key already bounds what the tools see; its own labels are the server's to set
        return Toolkit(target, image=image, limits=limits)
    return Toolkit(home=home, image=image, limits=limits, labels=dict([LABEL]), own_only=not all_boxes)


def serve(kit: Toolkit) -> None:
    """Serve ``kit``'s tools on stdin and stdout until the client closes them."""
    server = build(lambda ctx: _same(kit, ctx))

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


async def _same(kit: Toolkit, ctx: ServerRequestContext[Any, Any]) -> Toolkit:
    return kit
