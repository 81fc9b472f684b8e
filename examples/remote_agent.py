"""An agent loop against a remote sandbox: the agent runs here, the box on a
``sandlot serve`` host, reached with an API key. Runs offline: it starts a
server on 127.0.0.1 for a scratch home, and a scripted "model" stands in for an
LLM (swap ``propose`` for a call to yours).

python examples/remote_agent.py [ROOTFS]

The loop: the model proposes a shell command, the box runs it, the output goes
back into the history, until the model says it is done. At a decision point the
agent snapshots the box and forks it, tries each candidate in its own child,
and carries on in the parent with the one that worked.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from _rootfs import rootfs

import sandlot
from sandlot.api import access

Step = tuple[str, str]  # (command, what it printed)


def propose(task: str, history: list[Step]) -> str | None:
    """The model: the next shell command for ``task`` given what happened so far, or
    None when it is done. Scripted here; an LLM call in a real agent."""
    script = [
        "mkdir -p /work && cd /work && printf 'b\\na\\nc\\na\\n' > words.txt && wc -l < words.txt",
        "sort -u /work/words.txt > /work/unique.txt && cat /work/unique.txt",
        'echo "$(wc -l < /work/unique.txt) unique of $(wc -l < /work/words.txt)" > /work/report.txt',
    ]
    return script[len(history)] if len(history) < len(script) else None


def serve(home: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """A server for ``home`` on a free loopback port, and an admin key for it."""
    _, key = access.create_key("agent", admin=True, home=home)  # admin: it may boot a local rootfs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SANDLOT_HOME": home}
    # boxes' content (port routes, previews) on a port of its own: any free one, since this
    # agent opens none
    argv = ["serve", "--port", str(port), "--content-port", "0"]
    server = subprocess.Popen([sys.executable, "-m", "sandlot.cli", *argv], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url, key
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("sandlot serve did not come up")


def main() -> None:
    home = tempfile.mkdtemp(prefix="sandlot-remote-agent-")
    server, url, key = serve(home)
    try:
        client = sandlot.connect(url, api_key=key)  # in a real setup: the sandbox host's URL
        task = "count the unique words in a file and write a report"
        with client.Box(rootfs=str(rootfs()), memory_mib=256) as box:
            history: list[Step] = []
            while (command := propose(task, history)) is not None:
                r = box.exec("sh", "-c", command, timeout=60)
                print(f"$ {command}\n{r.stdout}{r.stderr}", end="")
                history.append((command, r.stdout + r.stderr))
                if r.exit_code != 0:
                    history[-1] = (command, f"{r.stdout}{r.stderr}(exit {r.exit_code})")

            # a decision point: two ways to present the report, each tried in a fork
            box.snapshot("before-format")
            candidates = ["tr a-z A-Z < /work/report.txt", "no-such-formatter /work/report.txt"]
            children = box.fork(len(candidates))
            try:
                results = [child.exec("sh", "-c", c) for child, c in zip(children, candidates, strict=True)]
            finally:
                for child in children:
                    child.remove(force=True)
            best = next(c for c, r in zip(candidates, results, strict=True) if r.exit_code == 0)
            print(f"chose: {best}")
            final = box.exec("sh", "-c", best, check=True).stdout
            print(f"report: {final.strip()}")
            assert final.strip() == "3 UNIQUE OF 4"
            assert box.files.read_text("/work/report.txt").strip() == "3 unique of 4"
    finally:
        server.terminate()
        server.wait(15)
        shutil.rmtree(home, ignore_errors=True)  # its base disks and snapshots: scratch


if __name__ == "__main__":
    main()
