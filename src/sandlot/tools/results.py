"""What a tool call answers: text for the model (and images), plus the same facts as
JSON for programs, in the shapes OpenAI's and Anthropic's APIs take back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import SandlotError


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    data: str  # base64
    mime_type: str  # image/png, image/jpeg, image/gif or image/webp


Part = TextPart | ImagePart


@dataclass
class ToolResult:
    """The answer of one tool call.

    ``content``: what the model should see, text and images in order. ``data``: the
    same as JSON (``structuredContent`` over MCP). ``is_error``: the call failed
    (the text says why); ``error`` is then the exception, where there was one."""

    content: list[Part] = field(default_factory=list)
    data: Any = None
    is_error: bool = False
    error: SandlotError | None = None

    @property
    def text(self) -> str:
        """The text parts, joined by blank lines."""
        return "\n\n".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.content if isinstance(p, ImagePart)]

    @classmethod
    def failed(cls, error: SandlotError) -> ToolResult:
        """The result of a call that raised ``error``: its class and message for the model."""
        data = {"error": {"type": type(error).__name__, **error.to_dict()}}
        return cls([TextPart(f"Error ({type(error).__name__}): {error}")], data, is_error=True, error=error)

    def to_openai(self) -> str:
        """The ``content`` of an OpenAI ``tool`` message (Chat Completions), or the
        ``output`` of a ``function_call_output`` (Responses): text only, so each image is
        named there (``to_openai_parts`` gives images as input parts)."""
        parts = [p.text if isinstance(p, TextPart) else f"[image: {p.mime_type}]" for p in self.content]
        return "\n\n".join(parts)

    def to_openai_parts(self) -> list[dict[str, Any]]:
        """The ``output`` of a Responses API ``function_call_output`` as input parts,
        images included (``input_image`` data URLs)."""
        return [
            {"type": "input_text", "text": p.text}
            if isinstance(p, TextPart)
            else {"type": "input_image", "image_url": f"data:{p.mime_type};base64,{p.data}"}
            for p in self.content
        ]

    def to_anthropic(self, tool_use_id: str) -> dict[str, Any]:
        """A ``tool_result`` block of the Messages API answering ``tool_use_id``, images included."""
        blocks: list[dict[str, Any]] = [
            {"type": "text", "text": p.text}
            if isinstance(p, TextPart)
            else {"type": "image", "source": {"type": "base64", "media_type": p.mime_type, "data": p.data}}
            for p in self.content
            if not (isinstance(p, TextPart) and not p.text)
        ]
        out: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id, "content": blocks}
        if self.is_error:
            out["is_error"] = True
        return out

    def __str__(self) -> str:
        return self.to_openai()


def json_text(data: Any) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False, default=str)
