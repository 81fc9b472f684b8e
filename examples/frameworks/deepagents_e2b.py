"""LangChain's Deep Agents with an E2B sandbox as their backend (``langchain-e2b``),
on a sandlot box through sandlot serve's E2B face: the agent's shell (``execute``) and
its file tools (ls, read, write, edit, glob, grep) all run in the box.

    pip install langchain-e2b                  # with deepagents and langchain-anthropic
    sandlot serve --e2b-template TEMPLATE      # Sandbox.create() with no template starts from it
    export E2B_API_URL=http://127.0.0.1:7070/e2b E2B_SANDBOX_URL=http://127.0.0.1:7070/e2b
    export E2B_API_KEY=$(sandlot keys create --name deepagents --e2b)
    export ANTHROPIC_API_KEY=...
    python examples/frameworks/deepagents_e2b.py

The template needs bash and python3 (Deep Agents' file tools are python3 one-liners);
E2B's user ``user`` where it has one (``--setup 'useradd -m -s /bin/bash user'``),
whose home is the backend's working directory."""

import os

from deepagents import create_deep_agent
from e2b import Sandbox
from langchain_e2b import E2BSandbox

sandbox = Sandbox.create()
try:
    agent = create_deep_agent(
        model=f"anthropic:{os.environ.get('MODEL', 'claude-sonnet-4-5')}",
        backend=E2BSandbox(sandbox=sandbox),
        system_prompt="You are a careful engineer. Work in /home/user. Run what you write.",
    )
    task = "Write /home/user/fizzbuzz.py printing FizzBuzz for 1..15, run it, and make Fizz lower-case."
    result = agent.invoke({"messages": [{"role": "user", "content": task}]})
    print("agent:", result["messages"][-1].content)
    print("in the box:", sandbox.files.read("/home/user/fizzbuzz.py"), sep="\n")
finally:
    sandbox.kill()
