"""Anthropic's cookbook pattern for a code interpreter on E2B (Claude's tool use, with an
``execute_python`` tool run in ``e2b-code-interpreter``'s sandbox), on a sandlot box
through sandlot serve's E2B face. The model analyses a CSV it is given, and the charts
its code draws come back as PNG files.

    pip install anthropic e2b-code-interpreter
    sandlot serve --e2b-template TEMPLATE      # a template with python3, pandas, matplotlib
    export E2B_API_URL=http://127.0.0.1:7070/e2b E2B_SANDBOX_URL=http://127.0.0.1:7070/e2b
    export E2B_API_KEY=$(sandlot keys create --name cookbook --e2b)
    export ANTHROPIC_API_KEY=...
    python examples/frameworks/anthropic_cookbook.py [CHART_DIR]"""

import os
import sys
from pathlib import Path

from _cookbook import DATA, SALES, TASK, save_charts
from anthropic import Anthropic
from e2b_code_interpreter import Sandbox

TOOLS = [{
    "name": "execute_python",
    "description": "Execute python code in a Jupyter notebook cell and return the result, stdout and errors.",
    "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}]  # fmt: skip
charts = Path(sys.argv[1] if len(sys.argv) > 1 else ".")


def execute_python(sandbox: Sandbox, code: str) -> tuple[str, bool]:
    execution = sandbox.run_code(code)
    save_charts(execution, charts)
    if execution.error:
        return f"{execution.error.name}: {execution.error.value}\n{execution.error.traceback}", True
    return f"result: {execution.text}\nstdout: {''.join(execution.logs.stdout)}", False


client = Anthropic()
with Sandbox.create() as sandbox:
    sandbox.files.write(DATA, SALES)
    messages: list = [{"role": "user", "content": TASK}]
    while True:
        response = client.messages.create(
            model=os.environ.get("MODEL", "claude-sonnet-4-5"),
            max_tokens=4096,
            tools=TOOLS,
            messages=messages,
        )
        messages.append({"role": "assistant", "content": response.content})
        if response.stop_reason != "tool_use":
            break
        results = []
        for block in response.content:
            if block.type == "tool_use":
                output, failed = execute_python(sandbox, block.input["code"])
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": output,
                                "is_error": failed})  # fmt: skip
        messages.append({"role": "user", "content": results})
print("model:", "".join(block.text for block in response.content if block.type == "text"))
