"""sandlot's tools for language models, defined once: their schemas in the shapes
model APIs take, and one dispatcher that runs a model's tool calls on real boxes.

>>> import sandlot
>>> from sandlot import tools
>>> [t["function"]["name"] for t in tools.schemas("openai")][:3]
['create_box', 'list_boxes', 'exec']
>>> with sandlot.Box("python:3.12-slim") as box:                     # doctest: +SKIP
...     result = tools.call(box, "exec", {"command": "python3 -c 'print(6*7)'"})
...     print(result.text)
exit code: 0
stdout:
42

A single-box agent passes its box: the box tools act on it when a call names no
``box``. A multi-box agent passes a ``Toolkit`` (or a server's client, or
nothing for this home's boxes) and names the box in each call; create_box
returns the names. ``Toolkit`` also sets a default image, limits, and labels
that keep an agent to its own boxes. See docs/mcp.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..api import loop
from .results import ImagePart, Part, TextPart, ToolResult
from .specs import TOOLS, ToolError, ToolInputError, ToolSpec, UnknownTool
from .toolkit import Format, Limits, Toolkit, render


def schemas(format: Format = "openai", *, tools: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Every tool's definition (or only ``tools``) in ``format``: "openai" (function
    tools of Chat Completions), "anthropic" (tools of the Messages API) or "mcp"
    (MCP ``Tool`` objects as JSON). ``Toolkit.schemas`` adds a toolkit's default
    image, default box and limits."""
    return render(format, tools)


def names() -> list[str]:
    """The tools' names, in the order ``schemas`` lists them."""
    return [t.name for t in TOOLS]


def toolkit(target: Any) -> Toolkit:
    return target if isinstance(target, Toolkit) else Toolkit(target)


def call(
    target: Any, name: str, arguments: Mapping[str, Any] | str | None = None, *, raise_errors: bool = True
) -> ToolResult:
    """Run the tool call ``name(arguments)`` of a model and return its result (sync).

    ``target``: a ``Box`` of any transport (the default box of the call), a ``Client``,
    a ``Toolkit``, or None (this home's boxes). ``arguments``: a mapping, or the JSON
    text of one (as OpenAI's tool calls carry it). Bad input raises ``UnknownTool``
    or ``ToolInputError`` (both ``InvalidArgument``) naming the problem, before
    anything runs; a failed operation raises its sandlot error. ``raise_errors=False``
    returns every sandlot error as a result with ``is_error`` set instead, for the
    model to read."""
    return loop.run(toolkit(target).call(name, arguments, raise_errors=raise_errors))


async def call_async(
    target: Any, name: str, arguments: Mapping[str, Any] | str | None = None, *, raise_errors: bool = True
) -> ToolResult:
    """``call`` for async code: ``target`` an ``AsyncBox``,
    ``AsyncClient``, ``Toolkit`` or None."""
    return await toolkit(target).call(name, arguments, raise_errors=raise_errors)


__all__ = [
    "TOOLS",
    "Format",
    "ImagePart",
    "Limits",
    "Part",
    "TextPart",
    "ToolError",
    "ToolInputError",
    "ToolResult",
    "ToolSpec",
    "Toolkit",
    "UnknownTool",
    "call",
    "call_async",
    "names",
    "schemas",
]
