"""``sandlot.tools`` without VMs: the schemas in every format are valid JSON Schema
and describe every tool; dispatch refuses bad input with errors naming the problem,
before anything runs; limits show in the schemas and hold in the calls; results
take the shapes the model APIs and MCP want (a fake box stands in for a VM)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonschema
import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from sandlot import tools
from sandlot.api.files import FileInfo
from sandlot.api.process import ExecResult
from sandlot.errors import BoxNotFound, Forbidden, QuotaExceeded
from sandlot.mcp.server import build, to_mcp
from sandlot.tools import Limits, ToolInputError, Toolkit, UnknownTool
from sandlot.tools.toolkit import Backend

EXPECTED = ["create_box", "list_boxes", "exec", "run_code", "read_file", "write_file", "list_files",
            "snapshot", "list_snapshots", "rollback", "fork", "suspend", "resume", "remove_box"]  # fmt: skip


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
    }
    bad = {
        "create_box": [{"image": "x", "memory_mib": 32}, {"image": "x", "name": "-bad"},
                       {"image": "x", "network": "open"}],
        "exec": [{"box": "dev"}, {"box": "dev", "command": "ls", "timeout": 0},
                 {"box": "dev", "command": "ls", "cmd": "ls"}, {"box": "dev", "command": 3}],
        "read_file": [{"box": "dev", "path": "relative"}, {"box": "dev", "path": "/a", "length": 0}],
        "write_file": [{"box": "dev", "path": "/a", "content": "x", "mode": "999"}],
        "fork": [{"box": "dev", "n": 9}],
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


def test_dispatch_names_each_problem_before_anything_runs() -> None:
    kit = Toolkit(NoBoxes())
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


def test_errors_come_back_as_results_for_the_model() -> None:
    kit = Toolkit(NoBoxes())
    r = asyncio.run(kit.call("exec", {"box": "gone", "command": "ls"}, raise_errors=False))
    assert r.is_error and isinstance(r.error, BoxNotFound)
    assert r.text == "Error (BoxNotFound): no box 'gone'"
    assert r.data["error"]["code"] == "box_not_found"
    r = asyncio.run(kit.call("exec", {}, raise_errors=False))
    assert r.is_error and "missing required argument 'command'" in r.text
    block = r.to_anthropic("toolu_1")
    assert block["is_error"] is True and block["tool_use_id"] == "toolu_1"


def test_limits_show_in_the_schemas_and_hold_in_calls() -> None:
    limits = Limits(max_boxes=1, max_memory_mib=256, max_cpus=2, images=("a:1", "b:2"), max_timeout=30)
    kit = Toolkit(FakeBackend(), image="a:1", limits=limits)
    schema = {e["name"]: e["input_schema"] for e in kit.schemas("anthropic")}
    create = schema["create_box"]["properties"]
    assert create["image"]["enum"] == ["a:1", "b:2"] and "'a:1'" in create["image"]["description"]
    assert create["memory_mib"]["maximum"] == 256 and create["memory_mib"]["default"] == 256
    assert create["cpus"]["maximum"] == 2
    assert schema["exec"]["properties"]["timeout"]["maximum"] == 30
    assert "image" not in schema["create_box"].get("required", [])
    assert "image" in Toolkit(FakeBackend()).schemas("anthropic")[0]["input_schema"]["required"]

    with pytest.raises(Forbidden, match="image 'c:3' is not allowed here; the images are: a:1, b:2"):
        asyncio.run(kit.call("create_box", {"image": "c:3"}))
    with pytest.raises(ToolInputError, match="memory_mib 512 is over the limit of 256"):
        asyncio.run(kit.call("create_box", {"memory_mib": 512}))
    with pytest.raises(ToolInputError, match="timeout 60s is over the limit of 30s"):
        asyncio.run(kit.call("exec", {"box": "x", "command": "ls", "timeout": 60}))
    made = asyncio.run(kit.call("create_box", {}))  # defaults over a limit come down to it
    assert made.data["memory_mib"] == 256 and made.data["image"] == "a:1"
    with pytest.raises(QuotaExceeded, match="at most 1 boxes") as caught:
        asyncio.run(kit.call("create_box", {"image": "b:2"}))
    assert caught.value.limit == "boxes"


def test_a_single_box_agent_names_no_box() -> None:
    box = FakeBox("solo")
    kit = Toolkit(FakeBackend([box]))
    kit.default_box = box
    schema = kit.schemas("openai", tools=["exec"])[0]["function"]["parameters"]
    assert schema["required"] == ["command"] and "'solo'" in schema["properties"]["box"]["description"]
    r = asyncio.run(kit.call("exec", {"command": "echo hi"}))
    assert r.text == "exit code: 0\nstdout:\necho hi" and r.data["exit_code"] == 0


def test_long_output_is_cut_and_kept_whole_in_the_box() -> None:
    box = FakeBox("dev", stdout=b"".join(b"line %d\n" % i for i in range(20000)))
    kit = Toolkit(FakeBackend([box]), output_limit=4096)
    r = asyncio.run(kit.call("exec", {"box": "dev", "command": "seq"}))
    path = r.data["stdout_file"]
    assert path.startswith("/tmp/sandlot-output/exec-") and path.endswith(".stdout")
    assert box.written[path] == box.stdout
    assert r.text.startswith("exit code: 0\nstdout:\nline 0\n")
    assert f"read_file with path={path!r} and offset=1024" in r.text
    assert r.text.endswith("line 19999\n") and len(r.data["stdout"]) < 4096 + 400
    assert r.data["stderr_file"] is None


def test_code_cells_give_text_and_images() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n-fake-").decode()
    execution = Execution(
        results=[Result(text="<Figure>", png=png), Result(text="42", is_main_result=True)],
        stdout="computing\n",
        error=ExecutionError("ZeroDivisionError", "division by zero", "Traceback ...\nZeroDivisionError"),
        execution_count=3,
    )
    r = Toolkit(NoBoxes()).execution_result(execution)
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


def test_mcp_server_lists_the_tools_and_answers_calls() -> None:
    box = FakeBox("dev")

    async def kit_for(ctx: Any) -> Toolkit:
        return Toolkit(FakeBackend([box]), image="a:1")

    async def session() -> None:
        async with Client(build(kit_for)) as client:
            listed = (await client.list_tools()).tools
            assert [t.name for t in listed] == EXPECTED
            assert all(t.annotations is not None and t.annotations.title == t.title for t in listed)
            r = await client.call_tool("exec", {"box": "dev", "command": "echo hi"})
            assert not r.is_error and r.content[0].text.endswith("echo hi")  # type: ignore[union-attr]
            assert r.structured_content is not None and r.structured_content["exit_code"] == 0
            r = await client.call_tool("exec", {"box": "dev", "command": 7})
            assert r.is_error and "argument 'command'" in r.content[0].text  # type: ignore[union-attr]
            with pytest.raises(MCPError, match="unknown tool 'nope'"):
                await client.call_tool("nope", {})

    asyncio.run(session())


# -- fakes: a box that echoes its command, without a VM ------------------------------------------


@dataclass(frozen=True)
class Result:
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    json: Any = None
    latex: str | None = None
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecutionError:
    name: str
    value: str
    traceback: str


@dataclass
class Execution:
    results: list[Result]
    stdout: str = ""
    stderr: str = ""
    error: ExecutionError | None = None
    execution_count: int | None = None


class FakeFiles:
    def __init__(self, box: FakeBox) -> None:
        self.box = box

    async def write(self, path: str, data: bytes, **kw: Any) -> int:
        self.box.written[path] = data
        return len(data)

    async def stat(self, path: str) -> FileInfo:
        size = len(self.box.written.get(path, b""))
        return FileInfo(path, path.rsplit("/", 1)[-1], "file", size, 0o644, 0, 0, datetime.now(UTC))


class FakeBox:
    def __init__(self, name: str, stdout: bytes | None = None) -> None:
        self.name = self.id = name
        self.stdout = stdout
        self.written: dict[str, bytes] = {}
        self.files = FakeFiles(self)
        self.state = "running"
        self.info = {"labels": {}, "image": "a:1", "memory_mib": 256, "cpus": 1, "network": "none",
                     "created_at": 1.7e9}  # fmt: skip

    async def exec(self, *argv: str, **kw: Any) -> ExecResult:
        return ExecResult(tuple(argv), 0, self.stdout if self.stdout is not None else argv[-1].encode())


class FakeBackend(Backend):
    def __init__(self, boxes: list[FakeBox] | None = None) -> None:
        self.boxes = {b.name: b for b in boxes or []}

    async def create(self, image: str | None, options: dict[str, Any]) -> Any:
        box = FakeBox(options.get("name") or f"box{len(self.boxes)}")
        box.info.update(image=image, memory_mib=options["memory_mib"])
        self.boxes[box.name] = box
        return box

    async def get(self, key: str) -> Any:
        if key not in self.boxes:
            raise BoxNotFound(f"no box {key!r}", box=key)
        return self.boxes[key]

    async def list(self, labels: Any) -> list[Any]:
        return list(self.boxes.values())


class NoBoxes(FakeBackend):
    pass
