"""One OpenAI Agents SDK run (a ``SandboxAgent`` of 20 tool calls by a scripted model:
shell commands and apply_patch edits) through sandlot's own sandbox client, against the
same run through the SDK's E2B client on sandlot serve's E2B face, and through the SDK's
Docker client where a Docker daemon answers; in one run, on one host, both sandlot
paths from the same template. For each: the run's wall time (the session's box made
from the template, the calls, and the session's end, which pauses it), the calls alone,
the pause at the end (on sandlot, the box suspended with its memory), and a resume in
this process to a first command (its processes running again).

    .venv/bin/python benchmarks/frameworks.py [--quick] [--calls N] [--runs N]
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import sandlot

import _common  # noqa: F401 - puts the repository on the path
from _common import debian_root, drop_home, emit, host_facts, parser, scratch_home, summary
from tests.support.serve import create_key, serving


def script(calls: int) -> list[list[Any]]:
    """``calls`` turns of one tool call each, then the final answer: two in three a shell
    command (a line appended to a log and the log counted), the third a file added by
    apply_patch; the first starts a process the resumed session must find running."""
    from tests.support.scripted_model import add_file, call, say

    start = "nohup sleep 900 >/dev/null 2>&1 & echo $! > sleeper.pid"
    turns: list[list[Any]] = [[call("exec_command", cmd=start)]]
    for n in range(1, calls):
        if n % 3 == 2:
            turns.append([add_file(f"note-{n}.txt", f"note {n}")])
        else:
            turns.append([call("exec_command", cmd=f"echo step {n} >> log.txt && wc -l < log.txt")])
    return [*turns, [say("done")]]


class Timed:
    """The scripted model, with the time of each of its turns (the last one asked for is
    the end of the calls: what follows it is the session's end)."""

    def __init__(self, calls: int) -> None:
        from tests.support.scripted_model import ScriptedModel

        self.model = ScriptedModel(script(calls))
        self.asked: list[float] = []
        ask = self.model.get_response

        async def get_response(*args: Any, **kwargs: Any) -> Any:
            self.asked.append(time.perf_counter())
            return await ask(*args, **kwargs)

        self.model.get_response = get_response  # type: ignore[method-assign]


async def one_run(client: Any, options: Any, calls: int) -> tuple[dict[str, float], Any, dict[str, Any]]:
    """A run to its end (paused), then a resume to a first command; its times, the
    resumed session (ended: paused again) and the session's state."""
    from tests.support.scripted_model import run_to_state, workspace_agent

    timed = Timed(calls)
    agent = workspace_agent(timed.model, b"# bench\n")
    t0 = time.perf_counter()
    state = await run_to_state(agent, client, options, "done", max_turns=calls + 2)
    t_end = time.perf_counter()
    t1 = time.perf_counter()
    session = await client.resume(client.deserialize_session_state(state))
    async with session:
        found = await session.exec("kill -0 $(cat sleeper.pid) && echo alive && wc -l < log.txt")
        t_resumed = time.perf_counter()
    assert found.stdout.decode().split()[0] == "alive", found
    times = {"wall_s": t_end - t0, "calls_s": timed.asked[-1] - timed.asked[0],
             "first_call_s": timed.asked[0] - t0, "pause_s": t_end - timed.asked[-1],
             "resume_to_first_exec_s": t_resumed - t1}  # fmt: skip
    return times, session, state


def figures(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {k: summary([s[k] for s in samples], 1.0, 3) for k in samples[0]}


async def native(template: str, home: Any, calls: int, runs: int) -> dict[str, Any]:
    from sandlot.integrations.openai_agents import SandlotSandboxClient, SandlotSandboxClientOptions

    client = SandlotSandboxClient(home=home)
    options = SandlotSandboxClientOptions(template=template, on_exit="suspend")
    samples = []
    for _ in range(runs):
        times, session, _ = await one_run(client, options, calls)
        samples.append(times)
        await (await client.box_of(session)).remove(force=True)
    return figures(samples)


async def through_e2b(template: str, calls: int, runs: int) -> dict[str, Any]:
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from e2b import Sandbox

    options = E2BSandboxClientOptions(sandbox_type="e2b", template=template, timeout=600, pause_on_exit=True)
    samples = []
    for _ in range(runs):
        times, _, state = await one_run(E2BSandboxClient(), options, calls)
        samples.append(times)
        Sandbox.kill(state["sandbox_id"])
    return figures(samples)


async def docker(calls: int, runs: int) -> dict[str, Any]:
    """The SDK's Docker client, where a daemon answers; else why not."""
    try:
        import docker as docker_sdk

        docker_sdk.from_env(timeout=5).ping()
    except Exception as e:  # no daemon here, no socket, no SDK: the reason is the figure
        return {"available": False, "why": f"{type(e).__name__}: {str(e)[:200]}"}
    from agents.sandbox.sandboxes.docker import DockerSandboxClient, DockerSandboxClientOptions

    client = DockerSandboxClient(docker_sdk.from_env())
    options = DockerSandboxClientOptions(image="python:3.12-slim")
    samples = [(await one_run(client, options, calls))[0] for _ in range(runs)]
    return {"available": True, **figures(samples)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--calls", type=int, default=None, help="tool calls a run (default 20; 4 with --quick)")
    p.add_argument("--runs", type=int, default=None, help="runs of each client (default 5; 1 with --quick)")
    args = p.parse_args()
    calls = args.calls or (4 if args.quick else 20)
    runs = args.runs or (1 if args.quick else 5)
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    home = scratch_home("bench-agents-", kept=True)
    try:
        sandlot.template(rootfs=str(debian_root()), name="agents", memory_mib=512, home=home)
        with serving(home) as served:
            key = create_key(home, "bench", "--admin", "--e2b")
            os.environ.update({"E2B_API_URL": f"{served.url}/e2b", "E2B_SANDBOX_URL": f"{served.url}/e2b",
                               "E2B_API_KEY": key})  # fmt: skip
            doc: dict[str, Any] = {"benchmark": "frameworks", "quick": args.quick}
            doc |= {"calls": calls, "runs": runs}
            doc["native"] = asyncio.run(native("agents", home, calls, runs))
            doc["e2b_face"] = asyncio.run(through_e2b("agents", calls, runs))
            doc["docker"] = asyncio.run(docker(calls, runs))
        doc["host"] = host_facts(sandlot.Runtime.for_home(home).prepare().accel)
        face, own = doc["e2b_face"], doc["native"]
        doc["ratios"] = {f"e2b_face_over_native_{k}": round(face[k]["median"] / own[k]["median"], 2)
                         for k in ("wall_s", "calls_s", "pause_s", "resume_to_first_exec_s")}  # fmt: skip
        emit(doc)
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
