"""``sandlot.tools`` without VMs: the schemas in every format are valid JSON Schema
and describe every tool; dispatch refuses bad input with errors naming the problem,
before anything runs; limits show in the schemas and hold in the calls; results
take the shapes the model APIs and MCP want. The boxes are real ``Box`` objects of
a home on the fake engine (the real core, its agent faked), reached locally and
through ``sandlot serve``'s application served in this process."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

import sandlot
from sandlot import tools
from sandlot.api.backend import Backend
from sandlot.api.box import AsyncBox
from sandlot.api.code import Execution, ExecutionError, Result
from sandlot.api.http import HttpBackend
from sandlot.api.local import LocalBackend
from sandlot.errors import BoxNotFound, Forbidden, QuotaExceeded
from sandlot.mcp.server import build, to_mcp
from sandlot.tools import Limits, ToolInputError, Toolkit, UnknownTool

from tests.support.fake_engine import fake_rootfs, register
from tests.support.inproc import serving

EXPECTED = ["create_box", "list_boxes", "exec", "run_code", "read_file", "write_file", "list_files",
            "snapshot", "list_snapshots", "rollback", "diff", "fork", "timeline", "rewind", "suspend",
            "resume", "computer", "remove_box"]  # fmt: skip


def params_of(fmt: str, entry: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    if fmt == "openai":
        assert entry["type"] == "function" and set(entry) == {"type", "function"}
        f = entry["function"]
        return f["name"], f["description"], f["parameters"]
    if fmt == "anthropic":
        assert set(entry) == {"name", "description", "input_schema"}
        return entry["name"], entry["description"], entry["input_schema"]
    return entry["name"], entry["description"], entry["inputSchema"]


@pytest.mark.parametrize("fmt", ["openai", "anthropic", "mcp"])
def test_every_tool_has_a_valid_schema_in_every_format(fmt: str) -> None:
    listed = tools.schemas(fmt)  # type: ignore[arg-type]
    json.dumps(listed)  # plain JSON, nothing else
    assert [params_of(fmt, e)[0] for e in listed] == EXPECTED == tools.names()
    for entry in listed:
        name, description, schema = params_of(fmt, entry)
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name)  # what OpenAI and Anthropic accept
        assert len(description) > 40, name
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        for prop, sub in schema["properties"].items():
            assert sub.get("description"), f"{name}.{prop} has no description"
            assert "title" not in sub and "anyOf" not in sub, f"{name}.{prop}: {sub}"
            for example in sub.get("examples", []):
                jsonschema.validate(example, sub)  # the examples obey their own schema
            if "default" in sub:
                jsonschema.validate(sub["default"], sub)
        for required in schema.get("required", []):
            assert required in schema["properties"]


def test_schemas_and_validation_agree() -> None:
    """What the JSON Schema accepts the dispatcher accepts, and the other way round."""
    schemas = {e["name"]: e["input_schema"] for e in tools.schemas("anthropic")}
    good = {
        "create_box": {"image": "python:3.12-slim", "name": "a-1", "memory_mib": 256, "env": {"A": "b"}},
        "exec": {"box": "dev", "command": "ls", "timeout": 5, "env": {"X": "1"}},
        "read_file": {"box": "dev", "path": "/etc/hosts", "offset": 10, "encoding": "base64"},
        "write_file": {"box": "dev", "path": "/a", "content": "x", "mode": "0755"},
        "fork": {"box": "dev", "n": 3},
        "computer": {
            "box": "desk",
            "action": "left_click_drag",
            "start_coordinate": [1, 2],
            "coordinate": [3, 4],
        },
    }
    bad = {
        "create_box": [{"image": "x", "memory_mib": 32}, {"image": "x", "name": "-bad"},
                       {"image": "x", "network": "open"}],
        "exec": [{"box": "dev"}, {"box": "dev", "command": "ls", "timeout": 0},
                 {"box": "dev", "command": "ls", "cmd": "ls"}, {"box": "dev", "command": 3}],
        "read_file": [{"box": "dev", "path": "relative"}, {"box": "dev", "path": "/a", "length": 0}],
        "write_file": [{"box": "dev", "path": "/a", "content": "x", "mode": "999"}],
        "fork": [{"box": "dev", "n": 9}],
        "computer": [{"action": "fly"}, {"action": "left_click", "coordinate": [1]},
                     {"action": "left_click", "coordinate": [-1, 5]},
                     {"action": "scroll", "scroll_amount": 0},
                     {"action": "drag", "path": [{"x": 1, "y": 2}]}, {"action": "wait", "duration": 31}],
    }  # fmt: skip
    for name, args in good.items():
        jsonschema.validate(args, schemas[name])
        tools.TOOLS[tools.names().index(name)].validate(args)
    for name, cases in bad.items():
        for args in cases:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(args, schemas[name])
            with pytest.raises(ToolInputError):
                tools.TOOLS[tools.names().index(name)].validate(args)


def refused(kit: Toolkit, name: str, args: Any) -> ToolInputError | UnknownTool:
    with pytest.raises((ToolInputError, UnknownTool)) as caught:
        asyncio.run(kit.call(name, args))
    return caught.value


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home on the fake engine whose images a:1 and b:2 are a fake root file system."""
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    home = tmp_path / "home"
    root = fake_rootfs(tmp_path)
    for name in ("a:1", "b:2"):
        sandlot.import_image(root, name, home=home)
    return home


Where = Callable[[], Backend]


@pytest.fixture(params=["local", "http"])
def where(request: pytest.FixtureRequest, home: Path) -> Iterator[Where]:
    """Where the tools find boxes, as a backend for the running loop: the home itself, or a
    server of it (``sandlot serve``'s application, served in this process)."""
    if request.param == "local":
        yield lambda: LocalBackend.for_home(home)
        return
    with serving(home) as srv:
        yield lambda: HttpBackend(srv.url, api_key=srv.api_key)


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


def test_dispatch_names_each_problem_before_anything_runs(home: Path) -> None:
    kit = Toolkit(home=home)
    e = refused(kit, "exex", {})
    assert isinstance(e, UnknownTool) and e.tool == "exex" and "did you mean 'exec'" in str(e)
    e = refused(kit, "exec", {"box": "dev"})
    assert isinstance(e, ToolInputError) and e.problems == ["missing required argument 'command'"]
    assert e.code == "invalid_argument" and e.to_dict()["tool"] == "exec"
    e = refused(kit, "exec", {"box": "dev", "cmd": "ls"})
    assert "unknown argument 'cmd' (did you mean 'command'?)" in str(e)
    e = refused(kit, "exec", {"box": "dev", "command": "ls", "timeout": "5"})
    assert "argument 'timeout': Input should be a valid number (got \"5\")" in str(e)
    e = refused(kit, "exec", {"box": "dev", "command": "ls", "timeout": 99999})
    assert "argument 'timeout'" in str(e) and "3600" in str(e)
    e = refused(kit, "read_file", {"box": "dev", "path": "etc/hosts"})
    assert "argument 'path'" in str(e)
    e = refused(kit, "exec", '{"box": "dev", "command": ')
    assert "not valid JSON" in str(e)
    e = refused(kit, "exec", ["ls"])
    assert "must be a JSON object, not list" in str(e)
    e = refused(kit, "exec", {"command": "ls"})  # no default box here
    assert "no box given" in str(e)
    e = refused(kit, "create_box", {})  # no default image here
    assert "give an image" in str(e)
    # the arguments as OpenAI's tool calls carry them: JSON text
    assert tools.TOOLS[2].validate('{"box": "dev", "command": "ls"}').model_dump()["command"] == "ls"


def test_errors_come_back_as_results_for_the_model(where: Where) -> None:
    async def main() -> None:
        kit = Toolkit(where())
        r = await kit.call("exec", {"box": "gone", "command": "ls"}, raise_errors=False)
        assert r.is_error and isinstance(r.error, BoxNotFound)
        assert r.text == "Error (BoxNotFound): no box 'gone'"
        assert r.data["error"]["code"] == "box_not_found"
        r = await kit.call("exec", {}, raise_errors=False)
        assert r.is_error and "missing required argument 'command'" in r.text
        block = r.to_anthropic("toolu_1")
        assert block["is_error"] is True and block["tool_use_id"] == "toolu_1"

    run(main)


def test_limits_show_in_the_schemas_and_hold_in_calls(where: Where) -> None:
    limits = Limits(max_boxes=1, max_memory_mib=256, max_cpus=2, images=("a:1", "b:2"), max_timeout=30)

    async def main() -> None:
        kit = Toolkit(where(), image="a:1", limits=limits, labels={"t": "limits"}, own_only=True)
        schema = {e["name"]: e["input_schema"] for e in kit.schemas("anthropic")}
        create = schema["create_box"]["properties"]
        assert create["image"]["enum"] == ["a:1", "b:2"] and "'a:1'" in create["image"]["description"]
        assert create["memory_mib"]["maximum"] == 256 and create["memory_mib"]["default"] == 256
        assert create["cpus"]["maximum"] == 2
        assert schema["exec"]["properties"]["timeout"]["maximum"] == 30
        assert "image" not in schema["create_box"].get("required", [])
        assert "image" in Toolkit(where()).schemas("anthropic")[0]["input_schema"]["required"]

        with pytest.raises(Forbidden, match="image 'c:3' is not allowed here; the images are: a:1, b:2"):
            await kit.call("create_box", {"image": "c:3"})
        with pytest.raises(ToolInputError, match="memory_mib 512 is over the limit of 256"):
            await kit.call("create_box", {"memory_mib": 512})
        with pytest.raises(ToolInputError, match="timeout 60s is over the limit of 30s"):
            await kit.call("exec", {"box": "x", "command": "ls", "timeout": 60})
        made = await kit.call("create_box", {})  # defaults over a limit come down to it
        assert (
            made.data["memory_mib"] == 256 and made.data["image"] == "a:1" and made.data["state"] == "running"
        )
        with pytest.raises(QuotaExceeded, match="at most 1 boxes") as caught:
            await kit.call("create_box", {"image": "b:2"})
        assert caught.value.limit == "boxes"
        backend = kit.backend
        if isinstance(backend, LocalBackend):  # the refusal is an event, as a server's is
            found = [e async for e in backend.events(box=None, since=None, after=None, follow=False)]
            refusal = [e for e in found if e.kind == "quota_refused"][-1]
            assert "at most 1 boxes" in (refusal.reason or "") and refusal.labels == {"t": "limits"}
        await kit.call("remove_box", {"box": made.data["name"]})

    run(main)


def test_a_single_box_agent_names_no_box_and_its_output_is_cut_and_kept_whole(where: Where) -> None:
    async def main() -> None:
        async with AsyncBox.bound(
            where().describe("a:1", {"memory_mib": 256}, keep=False), keep=False
        ) as box:
            kit = Toolkit(box, output_limit=4096)
            schema = kit.schemas("openai", tools=["exec"])[0]["function"]["parameters"]
            assert (
                schema["required"] == ["command"]
                and f"'{box.name}'" in schema["properties"]["box"]["description"]
            )
            r = await kit.call("exec", {"command": "echo hi"})
            assert r.text == "exit code: 0\nstdout:\nhi\n" and r.data["exit_code"] == 0
            r = await kit.call("exec", {"command": "lines 20000"})
            path = r.data["stdout_file"]
            assert path.startswith("/tmp/sandlot-output/exec-") and path.endswith(".stdout")
            whole = b"".join(b"line %d\n" % i for i in range(20000))
            assert await box.files.read(path) == whole  # kept in the box, whole
            assert r.text.startswith("exit code: 0\nstdout:\nline 0\n")
            assert f"read_file with path={path!r} and offset=1024" in r.text
            assert r.text.endswith("line 19999\n") and len(r.data["stdout"]) < 4096 + 400
            assert r.data["stderr_file"] is None
            r = await kit.call("read_file", {"path": path, "offset": 1024, "length": 100})
            assert r.data["content"] == whole[1024:1124].decode() and r.data["remaining"] > 0
            await kit.call("write_file", {"path": "/root/notes.md", "content": "hello"})
            listed = await kit.call("list_files", {"path": "/root"})
            assert [e["name"] for e in listed.data["entries"]] == ["notes.md"]
            snap = await kit.call("snapshot", {"name": "before"})
            await kit.call("write_file", {"path": "/root/notes.md", "content": "changed"})
            await kit.call("rollback", {"snapshot": snap.data["name"]})
            assert (await kit.call("read_file", {"path": "/root/notes.md"})).data["content"] == "hello"
            kids = await kit.call("fork", {"n": 2})
            assert len(kids.data["boxes"]) == 2
            for kid in kids.data["boxes"]:
                await kit.call("remove_box", {"box": kid["name"]})

    run(main)


def test_code_cells_give_text_and_images(home: Path) -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n-fake-").decode()
    execution = Execution(
        results=[Result(text="<Figure>", png=png), Result(text="42", is_main_result=True)],
        stdout="computing\n",
        error=ExecutionError("ZeroDivisionError", "division by zero", "Traceback ...\nZeroDivisionError"),
        execution_count=3,
    )
    r = Toolkit(home=home).execution_result(execution)
    kinds = [type(p).__name__ for p in r.content]
    assert kinds == ["TextPart", "ImagePart", "TextPart"]  # the image where the cell showed it
    assert r.images[0].mime_type == "image/png" and r.images[0].data == png
    assert "stdout:\ncomputing" in r.text and "result:\n42" in r.text
    assert "error: ZeroDivisionError: division by zero" in r.text
    assert r.data["execution_count"] == 3 and r.data["results"][0]["formats"] == ["text", "png"]
    anthropic = r.to_anthropic("t")["content"]
    assert anthropic[1] == {"type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": png}}  # fmt: skip
    assert r.to_openai_parts()[1] == {"type": "input_image", "image_url": f"data:image/png;base64,{png}"}
    assert "[image: image/png]" in r.to_openai()
    mcp = to_mcp(r)
    assert isinstance(mcp.content[1], types.ImageContent) and mcp.content[1].mime_type == "image/png"
    assert mcp.structured_content == r.data and not mcp.is_error


def test_mcp_server_lists_the_tools_and_answers_calls(where: Where) -> None:
    async def session() -> None:
        backend = where()

        async def kit_for(ctx: Any) -> Toolkit:
            return Toolkit(backend, image="a:1")

        async with Client(build(kit_for)) as client:
            listed = (await client.list_tools()).tools
            assert [t.name for t in listed] == EXPECTED
            assert all(t.annotations is not None and t.annotations.title == t.title for t in listed)
            made = await client.call_tool("create_box", {"name": "mcp-dev", "memory_mib": 256})
            assert not made.is_error and made.structured_content is not None
            r = await client.call_tool("exec", {"box": "mcp-dev", "command": "echo hi"})
            assert not r.is_error and r.content[0].text.endswith("hi\n")  # type: ignore[union-attr]
            assert r.structured_content is not None and r.structured_content["exit_code"] == 0
            r = await client.call_tool("exec", {"box": "mcp-dev", "command": 7})
            assert r.is_error and "argument 'command'" in r.content[0].text  # type: ignore[union-attr]
            r = await client.call_tool("read_file", {"box": "mcp-dev", "path": "/nope"})
            assert r.is_error and "GuestFileNotFoundError" in r.content[0].text  # type: ignore[union-attr]
            with pytest.raises(MCPError, match="unknown tool 'nope'"):
                await client.call_tool("nope", {})
            assert not (await client.call_tool("remove_box", {"box": "mcp-dev"})).is_error

    run(session)


def test_the_servers_mcp_endpoint_acts_within_the_keys_namespace(home: Path) -> None:
    """The MCP SDK's streamable HTTP client against the in-process server's ``/mcp``: the
    tool calls are REST requests of the caller's key, in its namespace."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    with serving(home) as srv:
        team = srv.key("team-a", namespace="a")

        async def session() -> None:
            headers = {"Authorization": f"Bearer {team}"}
            async with httpx2.AsyncClient(headers=headers, timeout=60) as http, \
                    Client(streamable_http_client(f"{srv.url}/mcp", http_client=http)) as client:  # fmt: skip
                made = await client.call_tool(
                    "create_box", {"image": "a:1", "name": "in-a", "memory_mib": 256}
                )
                assert not made.is_error, made.content
                r = await client.call_tool("exec", {"box": "in-a", "command": "echo from a"})
                assert not r.is_error and "from a" in r.content[0].text  # type: ignore[union-attr]

        run(session)
        admin = sandlot.connect(srv.url, api_key=srv.api_key)
        [box] = admin.list()
        assert box.name == "in-a" and box.info["labels"]["sandlot.namespace"] == "a"
        box.remove(force=True)
        admin.close()
