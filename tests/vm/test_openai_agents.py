"""sandlot as a sandbox of the OpenAI Agents SDK in a real box: a ``SandboxAgent`` driven
through ``Runner.run`` by a scripted model starts a web server in the background with
the shell tool, writes a page with apply_patch, and its session ends suspended; another
process resumes the session from its JSON state and finds the server still running,
reached in the box and through the exposed port from this host; on this host's home, and
through a ``sandlot serve``. One boot each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.integrations.openai_agents import SandlotSandboxClient, SandlotSandboxClientOptions

from tests.support.names import unique
from tests.support.scripted_model import ScriptedModel, add_file, call, run_to_state, say, workspace_agent
from tests.support.serve import serving

pytestmark = pytest.mark.vm
REPO = Path(__file__).resolve().parents[2]

RESUMED = """
import asyncio, json, sys
from urllib.parse import urlsplit
import httpx
from sandlot.integrations.openai_agents import SandlotSandboxClient

def fetch(endpoint, path):
    # the endpoint's host may be a name of a server's --port-domain: asked of 127.0.0.1 by that
    # name; a preview's token, given once in the query, comes back as a cookie
    u = urlsplit(endpoint)
    at, host = f"http://127.0.0.1:{u.port or 80}", {"Host": u.netloc}
    r = httpx.get(at + path + (f"?{u.query}" if u.query else ""), headers=host, timeout=60)
    if r.status_code == 307:
        cookie = r.headers["set-cookie"].split(";")[0]
        r = httpx.get(at + r.headers["location"], headers={**host, "Cookie": cookie}, timeout=60)
    return r.text

async def main():
    client = SandlotSandboxClient(sys.argv[2] or None)  # a server's key: $SANDLOT_API_KEY
    session = await client.resume(client.deserialize_session_state(json.loads(sys.argv[1])))
    async with session:
        inside = await session.exec(
            "python3 -c 'import urllib.request as u; print(u.urlopen(\\"http://127.0.0.1:8000/page.html\\").read().decode())'")
        end = await session.resolve_exposed_port(8000)
        outside = fetch(end.url_for("http"), "/page.html")
        print(json.dumps({"inside": inside.stdout.decode(), "code": inside.exit_code, "outside": outside,
                          "err": inside.stderr.decode()[-600:]}))
    await (await client.box_of(session)).remove(force=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def image(debian_root: Path) -> Iterator[str]:
    name = f"{unique('oa-agents')}:1"
    sandlot.import_image(debian_root, name, labels={"sandlot.test": "openai-agents"})
    try:
        yield name
    finally:
        sandlot.remove_image(name)


PORT_DOMAIN = "agents.sandlot.test"  # only ever sent as a Host header to 127.0.0.1


@pytest.mark.parametrize("where", ["local", "server"])
def test_a_paused_session_resumes_in_another_process_with_its_server_running(image: str, where: str) -> None:
    """On this host's home, and on a ``sandlot serve`` (its port reached at the port's own
    host of the server's --port-domain, signed)."""
    with contextlib.ExitStack() as stack:
        target, key = None, None
        if where == "server":
            served = stack.enter_context(serving(Path(os.environ["SANDLOT_HOME"]),
                                                 args=("--port-domain", PORT_DOMAIN)))  # fmt: skip
            target, key = served.url, served.api_key
        paused_and_resumed(image, target, key)


def paused_and_resumed(image: str, target: str | None, key: str | None) -> None:
    options = SandlotSandboxClientOptions(
        image=image, exposed_ports=(8000,), on_exit="suspend", memory_mib=512
    )
    # the server listening before the turn ends, as an agent checks it: a session that ends
    # (suspended) while python3 still starts would resume with a port that opens a moment later
    listening = "import socket, time\nwhile socket.socket().connect_ex(('127.0.0.1', 8000)): time.sleep(0.1)"
    serve = call(
        "exec_command", cmd=f'nohup python3 -m http.server 8000 >/dev/null 2>&1 & python3 -c "{listening}"'
    )
    model = ScriptedModel([[serve, add_file("page.html", "served from the box")], [say("serving")]])
    agent = workspace_agent(model, b"# site\n")

    async def run() -> dict[str, Any]:
        return await run_to_state(agent, SandlotSandboxClient(target, api_key=key), options, "serving")

    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    state = asyncio.run(run())
    box = sandlot.get(state["box_id"])  # the same home's, whichever way it was made
    try:
        assert box.state == "suspended"  # no VM now: its memory and processes are on disk
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "SANDLOT_API_KEY": key or ""}
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(RESUMED), json.dumps(state), target or ""],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        err = seen.pop("err")  # the inside request's stderr, should it fail
        assert seen == {"inside": "served from the box\n", "code": 0, "outside": "served from the box"}, err
    finally:
        for b in sandlot.list(labels=None):
            if b.id == state["box_id"]:
                b.remove(force=True)
