"""``sandlot mcp``: sandlot's tools as an MCP server over stdio (docs/mcp.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from .common import app, fail

if TYPE_CHECKING:
    from ..tools import Limits

MaxBoxes = Annotated[int | None, typer.Option(help="Boxes the tools may have at once.", min=1)]
MaxMemory = Annotated[int | None, typer.Option(help="Memory (MiB) a box the tools create may have.", min=64)]
MaxCpus = Annotated[int | None, typer.Option(help="CPUs a box the tools create may have.", min=1)]
AllowImage = Annotated[
    list[str] | None, typer.Option(help="An image create_box may boot (repeat it; default: any).")
]
MaxTimeout = Annotated[
    float | None, typer.Option(help="Seconds an exec or a code cell may be given at most.", min=1)
]


def limits(
    max_boxes: int | None,
    max_memory_mib: int | None,
    max_cpus: int | None,
    allow_image: list[str] | None,
    max_timeout: float | None,
) -> Limits:
    """The tools' limits from the options of ``sandlot mcp`` or ``sandlot serve --mcp-*``."""
    from ..errors import InvalidArgument
    from ..tools import Limits

    try:
        images = tuple(allow_image) if allow_image else None
        return Limits(max_boxes=max_boxes, max_memory_mib=max_memory_mib, max_cpus=max_cpus, images=images,
                      max_timeout=max_timeout)  # fmt: skip
    except InvalidArgument as e:
        raise fail(e, 2) from None


@app.command("mcp")
def mcp_command(
    image: Annotated[
        str | None, typer.Option(help="The image create_box boots when a call names none.")
    ] = None,
    max_boxes: MaxBoxes = None,
    max_memory_mib: MaxMemory = None,
    max_cpus: MaxCpus = None,
    allow_image: AllowImage = None,
    max_timeout: MaxTimeout = None,
    all_boxes: Annotated[
        bool,
        typer.Option("--all-boxes", help="Let the tools reach every box of the home, not just theirs."),
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(help="Act on the boxes of this sandlot serve (key: $SANDLOT_API_KEY), not this home's."),
    ] = None,
) -> None:
    """Serve sandlot's tools to an MCP client over stdin and stdout.

    The client starts this command itself (Claude Desktop, Claude Code, an IDE: see
    docs/mcp.md). Its boxes are ordinary boxes of this home, labeled sandlot.mcp=stdio;
    the tools see only those unless --all-boxes.
    """
    from ..errors import SandlotError
    from ..mcp import stdio

    bounds = limits(max_boxes, max_memory_mib, max_cpus, allow_image, max_timeout)
    target = None
    if url is not None:
        from ..api.client import AsyncClient

        try:
            target = AsyncClient(url)
        except SandlotError as e:
            raise fail(e, 2) from None
    stdio.serve(stdio.toolkit(image=image, limits=bounds, all_boxes=all_boxes, target=target))
