"""OpenAI's cookbook pattern for a code interpreter on E2B (a chat-completions tool loop
whose ``execute_python`` tool runs in ``e2b-code-interpreter``'s sandbox), on a sandlot
box through sandlot serve's E2B face. The model analyses a CSV it is given, and the
charts its code draws come back as PNG files.

    pip install openai e2b-code-interpreter
    sandlot serve --e2b-template TEMPLATE      # a template with python3, pandas, matplotlib
    export E2B_API_URL=http://127.0.0.1:7070/e2b E2B_SANDBOX_URL=http://127.0.0.1:7070/e2b
    export E2B_API_KEY=$(sandlot keys create --name cookbook --e2b)
    export OPENAI_API_KEY=...                  # OPENAI_BASE_URL: any OpenAI-compatible server
    python examples/frameworks/openai_cookbook.py [CHART_DIR]"""

import json
import os
import sys
from pathlib import Path

from _cookbook import DATA, SALES, TASK, save_charts
from e2b_code_interpreter import Sandbox
from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "execute_python",
    "description": "Execute python code in a Jupyter notebook cell and return the result, stdout and errors.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}}]  # fmt: skip
charts = Path(sys.argv[1] if len(sys.argv) > 1 else ".")


def execute_python(sandbox: Sandbox, code: str) -> str:
    execution = sandbox.run_code(code)
    save_charts(execution, charts)
    if execution.error:
        return f"{execution.error.name}: {execution.error.value}\n{execution.error.traceback}"
    return json.dumps({"result": execution.text, "stdout": "".join(execution.logs.stdout)})


client = OpenAI()
with Sandbox.create() as sandbox:
    sandbox.files.write(DATA, SALES)
    messages: list = [{"role": "user", "content": TASK}]
    while True:
        response = client.chat.completions.create(
            model=os.environ.get("MODEL", "gpt-4.1-mini"), messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            code = json.loads(call.function.arguments)["code"]
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": execute_python(sandbox, code)}
            )
print("model:", message.content)
