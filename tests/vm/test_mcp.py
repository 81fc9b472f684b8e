"""sandlot's tools over MCP, through the SDK's own client: ``sandlot mcp`` spawned as
a real stdio subprocess, and the ``/mcp`` endpoint of a real ``sandlot serve``
(its keys, their namespaces, the server's limits)."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

import sandlot
from sandlot import tools

from tests.support.serve import Served, create_key, serving

pytestmark = pytest.mark.vm

IMAGE = "mcp-test/busybox:1"
PY_IMAGE = "mcp-test/python:1"
SRC = str(Path(sandlot.__file__).resolve().parents[1])  # the subprocess runs this very sandlot


@pytest.fixture(scope="module")
def image(busybox_root: Path) -> str:
    sandlot.import_image(busybox_root, IMAGE)
    return IMAGE


def data(result: types.CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


def text(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def ok(client: Client, name: str, args: dict[str, Any]) -> types.CallToolResult:
    result = await client.call_tool(name, args)
    assert not result.is_error, f"{name} {args}: {text(result)}"
    return result


def stdio(*args: str) -> StdioServerParameters:
    env = {"SANDLOT_HOME": os.environ["SANDLOT_HOME"], "PYTHONPATH": SRC}
    return StdioServerParameters(command=sys.executable, args=["-m", "sandlot.cli", "mcp", *args], env=env)


def test_stdio_tools_on_real_boxes(image: str) -> None:
    tag = f"mcp{os.getpid()}"
    outsider = sandlot.Box(image, name=f"{tag}-outsider", memory_mib=256, keep=True).start()

    async def session() -> None:
        async with Client(stdio("--image", image, "--max-memory-mib", "512")) as client:
            listed = (await client.list_tools()).tools
            assert [t.name for t in listed] == tools.names()
            by_name = {t.name: t for t in listed}
            assert by_name["exec"].input_schema["required"] == ["box", "command"]
            assert by_name["create_box"].input_schema["properties"]["memory_mib"]["maximum"] == 512
            remove = by_name["remove_box"].annotations
            assert remove is not None and remove.destructive_hint

            made = await ok(client, "create_box", {"name": f"{tag}-a", "memory_mib": 256})
            assert data(made)["name"] == f"{tag}-a"
            box = f"{tag}-a"
            # boxes of stdio MCP are ordinary boxes of the home, labeled as its own
            assert [b.name for b in sandlot.list(labels={"sandlot.mcp": "stdio"})] == [box]

            r = await ok(client, "exec", {"box": box, "command": "echo out; echo err >&2; exit 3"})
            assert "exit code: 3" in text(r) and "out" in text(r) and "err" in text(r)
            assert data(r)["exit_code"] == 3

            # long output: its middle is cut, the whole is saved in the box and read back in pieces
            r = await ok(client, "exec", {"box": box, "command": "seq 1 30000"})
            saved = data(r)["stdout_file"]
            assert saved and saved in text(r) and "bytes cut" in text(r)
            expected = "".join(f"{i}\n" for i in range(1, 30001))
            whole = ""
            offset = 0
            while True:
                piece = await ok(client, "read_file", {"box": box, "path": saved, "offset": offset,
                                                       "length": 65536})  # fmt: skip
                part = data(piece)
                whole += part["content"]
                offset += part["length"]
                if not part["remaining"]:
                    break
            assert whole == expected

            await ok(client, "write_file", {"box": box, "path": "/work/notes.txt", "content": "first\n"})
            script = {"box": box, "path": "/work/run.sh", "content": "echo ran", "mode": "755"}
            await ok(client, "write_file", script)
            listing = await ok(client, "list_files", {"box": box, "path": "/work"})
            entries = {e["name"]: e for e in data(listing)["entries"]}
            assert entries["run.sh"]["mode"] == "0755" and entries["notes.txt"]["size"] == 6
            assert "ran" in text(await ok(client, "exec", {"box": box, "command": "/work/run.sh"}))

            # snapshot, change, roll back: the file is as it was
            await ok(client, "snapshot", {"box": box, "name": "clean"})
            await ok(client, "write_file", {"box": box, "path": "/work/notes.txt", "content": "second\n",
                                            "append": True})  # fmt: skip
            read = await ok(client, "read_file", {"box": box, "path": "/work/notes.txt"})
            assert data(read)["content"] == "first\nsecond\n"
            snaps = await ok(client, "list_snapshots", {"box": box})
            assert [s["name"] for s in data(snaps)["snapshots"]] == ["clean"]
            changed = await ok(client, "diff", {"box": box, "since": "clean", "paths": ["/work"]})
            assert data(changed)["changes"] == [
                {"path": "/work/notes.txt", "status": "modified", "fields": ["content"]}
            ]
            assert " first\n+second\n" in text(changed)
            await ok(client, "rollback", {"box": box, "snapshot": "clean"})
            read = await ok(client, "read_file", {"box": box, "path": "/work/notes.txt"})
            assert data(read)["content"] == "first\n"

            forked = await ok(client, "fork", {"box": box, "name": f"{tag}-kid"})
            kid = data(forked)["boxes"][0]["name"]
            assert kid.startswith(f"{tag}-kid-")
            r = await ok(client, "exec", {"box": kid, "command": "cat /work/notes.txt; hostname"})
            assert "first" in text(r)

            await ok(client, "suspend", {"box": box})
            assert sandlot.get(box).state == "suspended"
            await ok(client, "resume", {"box": box})
            assert "first" in text(await ok(client, "exec", {"box": box, "command": "cat /work/notes.txt"}))

            names = [b["name"] for b in data(await ok(client, "list_boxes", {}))["boxes"]]
            assert sorted(names) == sorted([box, kid])  # not the outsider: not the tools' box

            # errors: tool errors the model can read, and a protocol error for no such tool
            r = await client.call_tool("exec", {"box": outsider.name, "command": "true"})
            assert r.is_error and "no box" in text(r)
            r = await client.call_tool("exec", {"box": box})
            assert r.is_error and "missing required argument 'command'" in text(r)
            r = await client.call_tool("exec", {"box": box, "command": "true", "timeout": "soon"})
            assert r.is_error and "'timeout'" in text(r) and "soon" in text(r)
            r = await client.call_tool("create_box", {"memory_mib": 4096})
            assert r.is_error and "over the limit of 512" in text(r)
            r = await client.call_tool("read_file", {"box": box, "path": "/nope"})
            assert r.is_error and "GuestFileNotFoundError" in text(r)
            with pytest.raises(MCPError, match=r"unknown tool 'exex' \(did you mean 'exec'\?\)"):
                await client.call_tool("exex", {"box": box, "command": "true"})

            for name in (kid, box):
                await ok(client, "remove_box", {"box": name})
            assert (await ok(client, "list_boxes", {})).structured_content == {"boxes": []}

    try:
        asyncio.run(session())
    finally:
        for b in sandlot.list():
            if b.name.startswith(tag):
                b.remove(force=True)


def test_stdio_run_code_keeps_state_and_reports_errors(debian_root: Path) -> None:
    sandlot.import_image(debian_root, PY_IMAGE)
    tag = f"mcpcode{os.getpid()}"

    async def session() -> None:
        async with Client(stdio("--image", PY_IMAGE)) as client:
            box = data(await ok(client, "create_box", {"name": tag, "memory_mib": 512}))["name"]
            r = await ok(client, "run_code", {"box": box, "code": "x = 6\nprint('side')\nx * 7"})
            assert "side" in text(r) and "42" in text(r)
            assert data(r)["results"][0]["text"] == "42" and data(r)["error"] is None
            r = await ok(client, "run_code", {"box": box, "code": "x + 1"})  # state persists
            assert "7" in text(r)
            r = await ok(client, "run_code", {"box": box, "code": "1 / 0"})
            assert data(r)["error"]["name"] == "ZeroDivisionError" and "ZeroDivisionError" in text(r)
            picture = "class P:\n    def _repr_png_(self):\n        return b'\\x89PNG\\r\\n\\x1a\\nxyz'\nP()"
            r = await ok(client, "run_code", {"box": box, "code": picture})
            (image,) = [c for c in r.content if c.type == "image"]
            assert image.mime_type == "image/png" and base64.b64decode(image.data) == b"\x89PNG\r\n\x1a\nxyz"
            sleeper = {"box": box, "code": "import time\ntime.sleep(30)", "timeout": 5}
            r = await ok(client, "run_code", sleeper)
            assert data(r)["timed_out"] and "TIMED OUT" in text(r)
            assert "7" in text(await ok(client, "run_code", {"box": box, "code": "x + 1"}))  # kept
            # bash: a shell whose cd and variables persist from call to call, unlike exec's
            await ok(client, "run_code", {"box": box, "code": "cd /tmp; N=5", "language": "bash"})
            r = await ok(client, "run_code", {"box": box, "code": "echo $N $PWD", "language": "bash"})
            assert data(r)["stdout"] == "5 /tmp\n"
            await ok(client, "remove_box", {"box": box})

    try:
        asyncio.run(session())
    finally:
        for b in sandlot.list():
            if b.name.startswith(tag):
                b.remove(force=True)
        sandlot.remove_image(PY_IMAGE)  # and the automatic template of its first boot


# -- over HTTP, behind the server's keys ---------------------------------------------------------


@pytest.fixture(scope="module")
def served(image: str) -> Iterator[Served]:
    home = Path(os.environ["SANDLOT_HOME"])
    args = ("--mcp-image", image, "--mcp-max-boxes", "2", "--mcp-max-memory-mib", "512")
    with serving(home, args=args) as s:
        yield s


@asynccontextmanager
async def http_client(served: Served, key: str | None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx2.Timeout(30, read=300)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        Client(streamable_http_client(f"{served.url}/mcp", http_client=http)) as client,
    ):
        yield client


def test_http_refuses_without_a_valid_key(served: Served) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in ({}, {"Authorization": "Bearer sk-sl-nope-nope"}, {"Authorization": "Basic eDp5"}):
        r = httpx.post(f"{served.url}/mcp", json=body, headers={**headers, **auth}, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "unauthorized"

    async def refused() -> None:
        # the SDK's client reports the refused request as an MCP error (inside its task groups)
        with pytest.raises(BaseExceptionGroup) as caught:
            async with http_client(served, "sk-sl-nope-nope") as client:
                await client.list_tools()
        assert caught.value.subgroup(lambda e: isinstance(e, MCPError)) is not None

    asyncio.run(refused())


def test_http_tools_act_within_the_keys_namespace(served: Served) -> None:
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**6}"
    key_a = create_key(served.home, f"mcp-a-{tag}", "--namespace", f"mcp-a-{tag}")
    key_b = create_key(served.home, f"mcp-b-{tag}", "--namespace", f"mcp-b-{tag}")

    async def session() -> None:
        async with http_client(served, key_a) as a, http_client(served, key_b) as b:
            assert [t.name for t in (await a.list_tools()).tools] == tools.names()
            made = await ok(a, "create_box", {"memory_mib": 256})  # the server's default image
            box = data(made)["name"]
            assert data(made)["image"] == IMAGE
            r = await ok(a, "exec", {"box": box, "command": "echo hello > /tmp/h; cat /tmp/h"})
            assert "hello" in text(r)
            await ok(a, "write_file", {"box": box, "path": "/tmp/x", "content": "eA==", "encoding": "base64"})
            assert data(await ok(a, "read_file", {"box": box, "path": "/tmp/x"}))["content"] == "x"
            await ok(a, "snapshot", {"box": box, "name": "s1"})
            await ok(a, "write_file", {"box": box, "path": "/tmp/x", "content": "y"})
            changed = await ok(a, "diff", {"box": box, "since": "s1", "paths": ["/tmp/x"], "patch": False})
            assert [c["path"] for c in data(changed)["changes"]] == ["/tmp/x"]
            await ok(a, "rollback", {"box": box, "snapshot": "s1"})
            assert data(await ok(a, "read_file", {"box": box, "path": "/tmp/x"}))["content"] == "x"

            # the other namespace sees none of it, and cannot reach it by name
            assert (await ok(b, "list_boxes", {})).structured_content == {"boxes": []}
            r = await b.call_tool("exec", {"box": box, "command": "true"})
            assert r.is_error and "no box" in text(r)
            r = await b.call_tool("remove_box", {"box": box})
            assert r.is_error and "no box" in text(r)

            # the server's limits: two boxes at most, 512 MiB each, and only within the key's quotas
            await ok(a, "fork", {"box": box})
            r = await a.call_tool("create_box", {"memory_mib": 256})
            assert r.is_error and "at most 2 boxes" in text(r)
            r = await a.call_tool("create_box", {"memory_mib": 1024})
            assert r.is_error and "over the limit of 512" in text(r)

            names = [x["name"] for x in data(await ok(a, "list_boxes", {}))["boxes"]]
            assert len(names) == 2
            for name in names:
                await ok(a, "remove_box", {"box": name})

        # each tool call was audited as the REST request it became, under the key's name
        with served.client() as admin:
            entries = admin.get("/v1/audit", params={"key": f"mcp-a-{tag}"}).json()["entries"]
        actions = {e["action"] for e in entries}
        assert {"POST /v1/boxes", "POST /v1/boxes/{box}/exec", "DELETE /v1/boxes/{box}"} <= actions

    try:
        asyncio.run(session())
    finally:  # boxes made over MCP are durable: a failed run must not leave them running
        for b in sandlot.list(labels={"sandlot.namespace": f"mcp-a-{tag}"}):
            b.remove(force=True)
