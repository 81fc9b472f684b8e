"""smolagents' CodeAgent with its code run in a sandlot box, through sandlot serve's
E2B face: smolagents' own E2B executor, unchanged.

    pip install 'smolagents[e2b,openai]'
    sandlot serve --e2b-template TEMPLATE      # boxes start from this template's memory
    export E2B_API_URL=http://127.0.0.1:7070/e2b E2B_SANDBOX_URL=http://127.0.0.1:7070/e2b
    export E2B_API_KEY=$(sandlot keys create --name smolagents --e2b)
    export OPENAI_API_KEY=...                  # OPENAI_BASE_URL: any OpenAI-compatible server
    python examples/frameworks/smolagents_e2b.py

The template needs python3 (for plots, matplotlib; sandlot's interpreter serves the
Jupyter kernel's results without a Jupyter server). The agent's variables live on in
the box's interpreter from one step to the next, as in E2B."""

import os

from smolagents import CodeAgent, OpenAIServerModel

model = OpenAIServerModel(
    model_id=os.environ.get("MODEL", "gpt-4.1-mini"),
    api_base=os.environ.get("OPENAI_BASE_URL"),
    api_key=os.environ["OPENAI_API_KEY"],
)
with CodeAgent(tools=[], model=model, executor_type="e2b", max_steps=6) as agent:
    answer = agent.run(
        "Compute the 20th Fibonacci number, then tell me which Linux kernel release "
        "the machine that computed it runs. Answer as a dict with keys fib20 and kernel."
    )
print("answer:", answer)
