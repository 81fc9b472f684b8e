"""A model of the OpenAI Agents SDK that answers from a script: each turn's reply is the
next step (tool calls, or the final text), and every input it was given is kept, so a
test drives ``Runner.run`` with no network and no API key and reads what the tools
answered."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from agents import ModelResponse, Usage
from agents.models.interface import Model
from openai.types.responses import (
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

_ids = itertools.count(1)


def call(name: str, **arguments: Any) -> ResponseFunctionToolCall:
    """A call of a function tool (``exec_command``, ``write_stdin``...)."""
    n = next(_ids)
    return ResponseFunctionToolCall(
        type="function_call", id=f"fc_{n}", call_id=f"call_{n}", name=name, arguments=json.dumps(arguments)
    )


def patch(text: str) -> ResponseCustomToolCall:
    """A call of the apply_patch tool (a custom tool: its input is the patch itself)."""
    n = next(_ids)
    return ResponseCustomToolCall(
        type="custom_tool_call", id=f"ct_{n}", call_id=f"call_{n}", name="apply_patch", input=text
    )


def say(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg_{next(_ids)}", type="message", role="assistant", status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )  # fmt: skip


class ScriptedModel(Model):
    def __init__(self, steps: list[list[Any]]) -> None:
        self.steps = list(steps)
        self.inputs: list[Any] = []
        self.tools: list[str] = []

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                           *args: Any, **kwargs: Any) -> ModelResponse:  # fmt: skip
        self.inputs.append(input)
        self.tools = [t.name for t in tools]
        output = self.steps.pop(0) if self.steps else [say("done")]
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")

    def outputs(self) -> dict[str, str]:
        """What each tool call answered, by its call id."""
        found: dict[str, str] = {}
        for given in self.inputs:
            for item in given if isinstance(given, list) else []:
                kind = item.get("type") if isinstance(item, dict) else None
                if kind in ("function_call_output", "custom_tool_call_output"):
                    out = item["output"]
                    found[item["call_id"]] = out if isinstance(out, str) else json.dumps(out)
        return found


def add_file(name: str, line: str) -> ResponseCustomToolCall:
    """An apply_patch call that adds a file of one line (no newline at its end)."""
    return patch(f"*** Begin Patch\n*** Add File: {name}\n+{line}\n*** End Patch\n")


def workspace_agent(model: ScriptedModel, readme: bytes) -> Any:
    """A ``SandboxAgent`` of ``model`` with the shell and filesystem capabilities, its
    manifest a README.md of ``readme``."""
    from agents.sandbox import Manifest, SandboxAgent
    from agents.sandbox.capabilities import Filesystem, Shell
    from agents.sandbox.entries import File

    return SandboxAgent(
        name="dev", instructions="work in the workspace", model=model, capabilities=[Shell(), Filesystem()],
        default_manifest=Manifest(entries={"README.md": File(content=readme)}),
    )  # fmt: skip


async def run_to_state(
    agent: Any, client: Any, options: Any, final: str, max_turns: int = 10
) -> dict[str, Any]:
    """``Runner.run`` of ``agent`` on a sandbox ``client`` (tracing off), checked to end with
    ``final``; the session's state as the SDK serializes it (what a later resume takes)."""
    from agents import RunConfig, Runner
    from agents.run_config import SandboxRunConfig

    config = RunConfig(sandbox=SandboxRunConfig(client=client, options=options), tracing_disabled=True)
    result = await Runner.run(agent, "do it", run_config=config, max_turns=max_turns)
    assert result.final_output == final
    state: dict[str, Any] = result.to_state().to_json()["sandbox"]["session_state"]
    return state
