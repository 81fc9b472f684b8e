"""The MCP server of sandlot's tools, on the SDK's low-level ``Server``: the tools'
schemas are ``sandlot.tools``' own (one pydantic model per tool), not derived from
Python signatures, so every face shows the same tools."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError

from ..errors import SandlotError
from ..tools import specs
from ..tools.results import ImagePart, ToolResult
from ..tools.toolkit import Toolkit
from ..version import __version__

log = logging.getLogger("sandlot.mcp")

INSTRUCTIONS = (
    "sandlot runs code in sandboxes: Linux microVMs isolated from the host. create_box makes one and "
    "returns its name; pass that name as `box` to exec (shell commands), run_code (Python, bash, "
    "JavaScript, notebook-like), "
    "read_file, write_file and list_files. snapshot saves a box's whole running state, rollback returns to "
    "it, fork copies a running box, diff lists what changed in a box's files since a snapshot. Remove "
    "boxes you no longer need with remove_box."
)

ToolkitFor = Callable[[ServerRequestContext[Any, Any]], Awaitable[Toolkit]]


def build(toolkit_for: ToolkitFor, *, name: str = "sandlot") -> Server[Any]:
    """An MCP server whose tool calls run on the toolkit ``toolkit_for`` gives for each
    request (one for a stdio session; the caller's, by its API key, over HTTP)."""

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        kit = await toolkit_for(ctx)
        return types.ListToolsResult(tools=[types.Tool.model_validate(t) for t in kit.schemas("mcp")])

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name not in specs.BY_NAME:
            # not a tool's failure but a request for one that does not exist: a protocol error
            try:
                specs.spec(params.name)
            except specs.UnknownTool as e:
                raise MCPError(types.INVALID_PARAMS, str(e)) from None
        try:
            kit = await toolkit_for(ctx)
            result = await kit.call(params.name, params.arguments or {}, raise_errors=False)
        except SandlotError as e:
            result = ToolResult.failed(e)
        except Exception as e:  # a bug of ours: the client hears of it, the server goes on
            log.exception("tool %s failed", params.name)
            result = ToolResult.failed(
                SandlotError(f"internal error in {params.name}: {type(e).__name__}: {e}")
            )
        return to_mcp(result)

    return Server(
        name,
        version=__version__,
        title="sandlot",
        description="Hardware-isolated microVM sandboxes: run commands and code, keep files, snapshot, fork.",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def to_mcp(result: ToolResult) -> types.CallToolResult:
    """A tool's result as MCP content: its text, its images (``ImageContent``), and its
    facts as ``structuredContent``."""
    content: list[types.ContentBlock] = [
        types.ImageContent(data=p.data, mime_type=p.mime_type) if isinstance(p, ImagePart)
        else types.TextContent(text=p.text)
        for p in result.content
    ]  # fmt: skip
    structured = result.data if isinstance(result.data, dict) else None
    return types.CallToolResult(content=content, structured_content=structured, is_error=result.is_error)
