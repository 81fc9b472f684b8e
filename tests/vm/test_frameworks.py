"""The agent frameworks built on E2B's SDKs, unchanged, against a real ``sandlot serve``'s
E2B face: smolagents' E2B executor, LangChain Deep Agents' E2B backend
(``langchain-e2b``), and ``e2b-code-interpreter`` as OpenAI's and Anthropic's cookbooks
use it. Each test runs its example in ``examples/frameworks/`` as a user would, in a
process of its own, with the environment the example's docstring names; the model is a
scripted one on 127.0.0.1 (``tests/support/scripted_llm.py``) in OpenAI's or Anthropic's
wire form, and what the sandbox answered is read back from what the model was shown.

The sandboxes start from a sandlot template of Debian's Jupyter stack (pandas,
matplotlib) with E2B's user ``user``, which the server names for E2B's own default
templates (``--e2b-template``): the frameworks and cookbooks ask for none."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sandlot

from tests.conftest import TEST_ENGINE
from tests.support import roots
from tests.support.scripted_llm import ScriptedLLM, scripted_llm, text, tool
from tests.support.serve import create_key, serving

pytestmark = pytest.mark.vm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"


@pytest.fixture(scope="module")
def frameworks() -> Iterator[dict[str, Any]]:
    """A server whose E2B default templates are a Jupyter-stack template of a key's
    namespace, the scripted model, and the environment both point the examples at."""
    home = Path(os.environ["SANDLOT_HOME"])
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**6}"
    template = f"frameworks-{tag}"
    sandlot.template(rootfs=str(roots.jupyter_root()), name=template, memory_mib=768, home=home,
                     engine=TEST_ENGINE, setup=["useradd -m -s /bin/bash user"],
                     labels={"sandlot.namespace": f"frameworks-{tag}"})  # fmt: skip
    try:
        with serving(home, args=("--e2b-template", template)) as served, scripted_llm() as llm:
            key = create_key(home, f"frameworks-{tag}", "--namespace", f"frameworks-{tag}", "--e2b")
            env = {**os.environ, **llm.env(), "E2B_API_KEY": key,
                   "E2B_API_URL": f"{served.url}/e2b", "E2B_SANDBOX_URL": f"{served.url}/e2b"}  # fmt: skip
            yield {"env": env, "llm": llm, "served": served, "key": key}
    finally:
        with contextlib.suppress(Exception):
            sandlot.Snapshot.get(template, home=home).remove()


def run_example(frameworks: dict[str, Any], name: str, script: list[dict[str, Any]], *args: str) -> str:
    """Run ``examples/frameworks/NAME`` against the server and the scripted model; its
    output, after checking it left no sandbox behind."""
    llm: ScriptedLLM = frameworks["llm"]
    llm.play(script)
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=frameworks["env"], cwd=EXAMPLES,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert len(llm.requests) == len(script), llm.seen()[-3000:]  # every turn was asked for, once
    listed = httpx.get(f"{frameworks['served'].url}/e2b/sandboxes", headers={"X-API-Key": frameworks["key"]})
    assert listed.status_code == 200 and listed.json() == [], listed.text  # the example's sandbox was killed
    return r.stdout


def test_smolagents_code_agent_runs_its_steps_in_a_sandbox_through_its_e2b_executor(
    frameworks: dict[str, Any],
) -> None:
    first = (
        "Thought: compute it in the sandbox, and look at the machine.\n<code>\n"
        "import platform\nfib = [0, 1]\nfor _ in range(19):\n    fib.append(fib[-1] + fib[-2])\n"
        "kernel = platform.release()\nimport getpass, os\n"
        "print('fib20 is', fib[20], 'as', getpass.getuser(), 'in', os.getcwd())\n</code>"
    )
    # the second step uses what the first defined: the variables live on in the box
    second = "Thought: answer.\n<code>\nfinal_answer({'fib20': fib[20], 'kernel': kernel})\n</code>"
    out = run_example(frameworks, "smolagents_e2b.py", [text(first), text(second)])
    shown = frameworks["llm"].seen()
    assert "fib20 is 6765 as root in /home/user" in shown  # where E2B's Jupyter runs its cells
    answer = out.split("answer:", 1)[1].strip()
    assert answer.startswith("{'fib20': 6765, 'kernel': '") and "'kernel': ''" not in answer, out


def test_deep_agents_write_run_edit_and_search_in_a_sandbox_through_langchain_e2b(
    frameworks: dict[str, Any],
) -> None:
    program = (
        "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else i)\n"
    )
    script = [
        tool("write_file", file_path="/home/user/fizzbuzz.py", content=program),
        tool("execute", command="python3 fizzbuzz.py | tail -3 && whoami && pwd"),
        tool(
            "edit_file",
            file_path="/home/user/fizzbuzz.py",
            old_string="else 'Fizz'",
            new_string="else 'fizz'",
        ),
        tool("read_file", file_path="/home/user/fizzbuzz.py"),
        tool("grep", pattern="fizz", path="/home/user"),
        tool("glob", pattern="*.py", path="/home/user"),
        tool("ls", path="/home/user"),
        tool("execute", command="python3 /home/user/fizzbuzz.py | head -3; exit 3"),
        text("fizzbuzz.py prints lower-case fizz now."),
    ]
    out = run_example(frameworks, "deepagents_e2b.py", script)
    results = [m for m in frameworks["llm"].requests[-1]["messages"] if m["role"] == "user"]
    replies = [b.get("content") for m in results[1:] for b in m["content"] if b.get("type") == "tool_result"]
    flat = [json.dumps(r) for r in replies]
    assert len(flat) == 8, flat
    assert "Updated file /home/user/fizzbuzz.py" in flat[0] or "fizzbuzz.py" in flat[0], flat[0]
    assert "14" in flat[1] and "FizzBuzz" in flat[1] and "user" in flat[1] and "/home/user" in flat[1], flat[
        1
    ]
    assert "fizz" in flat[3] and "else 'Fizz'" not in flat[3], flat[3]  # read back after the edit
    assert "fizzbuzz.py" in flat[4] and "fizzbuzz.py" in flat[5] and "fizzbuzz.py" in flat[6], flat[4:7]
    assert "fizz" in flat[7] and "3" in flat[7], flat[7]  # the exit code is reported to the model
    assert "else 'fizz'" in out.split("in the box:", 1)[1], out  # the box holds the edited file


def _cookbook(frameworks: dict[str, Any], name: str, tmp_path: Path) -> None:
    analysis = (
        "import pandas as pd\nimport matplotlib.pyplot as plt\n"
        "df = pd.read_csv('/home/user/sales.csv')\n"
        "df.plot(x='month', y='revenue', kind='bar')\nplt.show()\nprint(len(df), 'months')\n"
        "df.loc[df.revenue.idxmax(), 'month']"
    )
    script = [
        tool("execute_python", code=analysis),
        tool("execute_python", code="df.revenue.sum() / undefined_name"),  # an error the model is told of
        tool("execute_python", code="int(df.revenue.sum())"),  # the cell's state outlived the error
        text("March is the best month: 210."),
    ]
    out = run_example(frameworks, name, script, str(tmp_path))
    shown = frameworks["llm"].seen()
    assert re.search(r"\bMar\b", shown) and "4 months" in shown, shown[-3000:]  # E2B's text: unquoted
    assert "NameError" in shown and "undefined_name" in shown, shown[-3000:]
    assert "585" in shown, shown[-3000:]
    charts = sorted(tmp_path.glob("chart-*.png"))
    assert len(charts) == 1 and charts[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out
    assert charts[0].stat().st_size > 5000  # a drawn chart, not an empty image
    assert "March is the best month" in out


def test_the_openai_cookbooks_code_interpreter_loop(frameworks: dict[str, Any], tmp_path: Path) -> None:
    _cookbook(frameworks, "openai_cookbook.py", tmp_path)


def test_the_anthropic_cookbooks_code_interpreter_loop(frameworks: dict[str, Any], tmp_path: Path) -> None:
    _cookbook(frameworks, "anthropic_cookbook.py", tmp_path)
