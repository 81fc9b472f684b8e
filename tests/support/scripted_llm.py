"""A language model server on 127.0.0.1 that answers from a script, in OpenAI's
(``/v1/chat/completions``) and Anthropic's (``/v1/messages``) wire forms: programs
written for those APIs (frameworks, cookbooks, the examples) run unchanged with
``OPENAI_BASE_URL`` or ``ANTHROPIC_BASE_URL`` pointed at it, with no network and no key.

A script is a list of turns. The turn a request gets is the number of the assistant's
turns already in its conversation, so a framework that calls the model again with the
tools' results gets the next turn, and a repeated request gets the same one. Each turn
is ``{"text": ...}``, ``{"tools": [{"name": ..., "input": {...}}]}``, or both. Every
request is kept (``requests``), so a test reads what the sandbox answered the model."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.servers import LocalServer, QuietHandler

Turn = dict[str, Any]


def text(value: str) -> Turn:
    return {"text": value}


def tool(name: str, **arguments: Any) -> Turn:
    return {"tools": [{"name": name, "input": arguments}]}


class ScriptedLLM:
    def __init__(self, port: int) -> None:
        self.port = port
        self.script: list[Turn] = []
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What points OpenAI's and Anthropic's SDKs (and what is built on them) here."""
        return {"OPENAI_BASE_URL": f"{self.base_url}/v1", "OPENAI_API_KEY": "scripted",
                "ANTHROPIC_BASE_URL": self.base_url, "ANTHROPIC_API_KEY": "scripted"}  # fmt: skip

    def play(self, script: list[Turn]) -> None:
        with self.lock:
            self.script = list(script)
            self.requests = []

    def turn(self, request: dict[str, Any]) -> tuple[int, Turn]:
        with self.lock:
            self.requests.append(request)
            n = sum(1 for m in request.get("messages", []) if m.get("role") == "assistant")
            if n >= len(self.script):
                raise LookupError(f"the script has {len(self.script)} turns; turn {n + 1} was asked for")
            return n, self.script[n]

    def seen(self) -> str:
        """Every request's conversation as one text: what the model was shown."""
        return json.dumps([r.get("messages") for r in self.requests])


def _openai(n: int, turn: Turn, model: str) -> dict[str, Any]:
    calls = [{"id": f"call_{n}_{i}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["input"])}}
             for i, c in enumerate(turn.get("tools", []))]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("text")}
    if calls:
        message["tool_calls"] = calls
    return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}}  # fmt: skip


def _anthropic(n: int, turn: Turn, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": turn["text"]}] if turn.get("text") else []
    content += [{"type": "tool_use", "id": f"toolu_{n}_{i}", "name": c["name"], "input": c["input"]}
                for i, c in enumerate(turn.get("tools", []))]  # fmt: skip
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": "tool_use" if turn.get("tools") else "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 10}}  # fmt: skip


class _Handler(QuietHandler):
    llm: ScriptedLLM

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        path = self.path.split("?")[0].rstrip("/")
        try:
            if path.endswith("/chat/completions"):
                answer = _openai(*self.llm.turn(body), body.get("model", "scripted"))
                if body.get("stream"):
                    return self._openai_stream(answer)
            elif path.endswith("/messages"):
                if body.get("stream"):
                    raise LookupError("the scripted model answers Anthropic's messages unstreamed only")
                answer = _anthropic(*self.llm.turn(body), body.get("model", "scripted"))
            else:
                return self._send(404, {"error": {"message": f"no route {path}"}})
        except LookupError as e:
            return self._send(400, {"error": {"type": "invalid_request_error", "message": str(e)}})
        self._send(200, answer)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _openai_stream(self, answer: dict[str, Any]) -> None:
        """The same answer as one chunk of OpenAI's server-sent events."""
        choice = answer["choices"][0]
        delta = dict(choice["message"])
        for i, c in enumerate(delta.get("tool_calls", [])):
            c["index"] = i
        done = choice["finish_reason"]
        chunk = {**answer, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": done}]}  # fmt: skip
        data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def scripted_llm() -> Iterator[ScriptedLLM]:
    handler = type("Handler", (_Handler,), {})
    served = LocalServer(handler, None)
    llm = handler.llm = ScriptedLLM(served.port)
    try:
        yield llm
    finally:
        served.close()
