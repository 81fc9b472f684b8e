"""The tools, defined once: one pydantic model per tool gives both its JSON Schema
(what a model is shown) and the validation of what a model sends back.

A tool's description is all a model reads about it, so each says what the tool
does, what it returns, its limits and an example; each argument's description
says its unit, default and bounds."""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import InvalidArgument

BOX_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"  # the store's rule for box names
ABSOLUTE = r"^/"
MAX_TIMEOUT = 3600.0  # seconds: the most any exec or run_code may be given
MAX_READ = 1 << 20  # bytes one read_file returns at most
MAX_FORK = 8
MAX_PATCH = 20_000  # characters of unified diff one diff call returns at most
DEFAULT_MEMORY_MIB = 512


class ToolError(InvalidArgument):
    """A tool call that cannot be made as asked: nothing was run. ``tool`` names the tool."""

    def __init__(self, message: str, *, tool: str | None = None) -> None:
        super().__init__(message)
        self.tool = tool

    def _fields(self) -> dict[str, Any]:
        return {"tool": self.tool}


class UnknownTool(ToolError):
    """No tool has that name."""


class ToolInputError(ToolError):
    """The arguments do not fit the tool's schema; ``problems`` lists each, one line
    per argument (missing, unknown, of the wrong type or out of bounds)."""

    def __init__(self, message: str, *, tool: str | None = None, problems: list[str] | None = None) -> None:
        super().__init__(message, tool=tool)
        self.problems = list(problems or [])

    def _fields(self) -> dict[str, Any]:
        return {"tool": self.tool, "problems": self.problems}


class Args(BaseModel):
    """Arguments of one tool: strict types (a number is not a string), no unknown names."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


BOX_HELP = (
    "Name or id of the box to act on, as create_box or list_boxes return it. "
    "May be left out only when the session has a default box."
)


def box_field() -> Any:
    return Field(None, description=BOX_HELP, min_length=1, max_length=64, examples=["dev"])


class CreateBox(Args):
    image: str | None = Field(
        None,
        description="Image to boot, as a registry reference. Leave it out for the default image.",
        min_length=1,
        max_length=512,
        examples=["python:3.12-slim"],
    )
    name: str | None = Field(
        None,
        description="A name for the box (1-63 letters, digits, '_', '.' or '-', starting with a letter or "
        "digit), unique among boxes. Leave it out for a generated one.",
        pattern=BOX_NAME,
        examples=["analysis"],
    )
    memory_mib: int = Field(DEFAULT_MEMORY_MIB, description="Memory of the box in MiB.", ge=64, le=65536)
    cpus: int = Field(1, description="Virtual CPUs.", ge=1, le=64)
    network: Literal["none", "public"] = Field(
        "none",
        description="'none': no network at all (the safest). 'public': the internet, through sandlot's "
        "egress proxy (the host's own addresses and private networks stay out of reach).",
    )
    env: dict[str, str] | None = Field(
        None, description="Environment variables every command in the box gets.", examples=[{"DEBUG": "1"}]
    )
    workdir: str | None = Field(
        None, description="Absolute directory commands start in.", pattern=ABSOLUTE, examples=["/work"]
    )


class ListBoxes(Args):
    pass


class Exec(Args):
    box: str | None = box_field()
    command: str = Field(
        description="Shell command line, run with /bin/sh -c: pipes, redirections, && and ; work.",
        min_length=1,
        max_length=100_000,
        examples=["ls -la /etc && cat /etc/os-release"],
    )
    cwd: str | None = Field(
        None, description="Absolute directory to run in (default: the box's workdir).", pattern=ABSOLUTE
    )
    env: dict[str, str] | None = Field(None, description="Extra environment variables for this command.")
    stdin: str | None = Field(None, description="Text fed to the command's standard input.", max_length=65536)
    user: str | None = Field(
        None, description="User to run as, by name or uid (default: the image's user).", examples=["root"]
    )
    timeout: float = Field(
        60.0,
        description="Seconds before the command (and its children) is killed; the output so far is returned.",
        gt=0,
        le=MAX_TIMEOUT,
    )


class RunCode(Args):
    box: str | None = box_field()
    code: str = Field(
        description="The code of one cell. Variables, imports and functions persist between calls in the "
        "same context, as in a notebook. The value of the last expression is returned; matplotlib figures "
        "and other images come back as images.",
        min_length=1,
        max_length=1 << 20,
        examples=["import math\nmath.sqrt(2)"],
    )
    language: Literal["python", "bash", "javascript", "typescript"] = Field(
        "python",
        description="The language of the code: Python; bash (a shell whose variables and `cd` persist "
        "between calls, unlike exec's); JavaScript or TypeScript (Node.js in the box's image).",
    )
    context: str | None = Field(
        None,
        description="Id of a code context to run in (each has its own variables and working directory). "
        "Leave it out for the box's default context.",
        min_length=1,
        max_length=128,
    )
    timeout: float = Field(
        120.0, description="Seconds the cell may run before it is interrupted.", gt=0, le=MAX_TIMEOUT
    )


class ReadFile(Args):
    box: str | None = box_field()
    path: str = Field(description="Absolute path of the file in the box.", pattern=ABSOLUTE,
                      examples=["/etc/os-release"])  # fmt: skip
    offset: int = Field(0, description="Byte offset to start reading at.", ge=0)
    length: int = Field(
        65536, description=f"Bytes to read at most (up to {MAX_READ}); the answer says how many remain.",
        ge=1, le=MAX_READ,
    )  # fmt: skip
    encoding: Literal["text", "base64", "image"] = Field(
        "text",
        description="'text': the bytes as UTF-8 text. 'base64': the exact bytes, base64-encoded (for binary "
        "files). 'image': a PNG, JPEG, GIF or WebP file shown as an image (offset and length ignored).",
    )


class WriteFile(Args):
    box: str | None = box_field()
    path: str = Field(description="Absolute path of the file; missing parent directories are created.",
                      pattern=ABSOLUTE, examples=["/work/main.py"])  # fmt: skip
    content: str = Field(description="What to write: text, or base64 when encoding is 'base64'.",
                         max_length=8 << 20)  # fmt: skip
    encoding: Literal["text", "base64"] = Field("text", description="How content is encoded.")
    append: bool = Field(False, description="Add to the end of the file instead of replacing it.")
    mode: str | None = Field(
        None,
        description="Permission bits in octal, for a new file or to change them (default: 644 for a new "
        "file; an existing file keeps its own).",
        pattern=r"^0?[0-7]{3,4}$",
        examples=["755"],
    )


class ListFiles(Args):
    box: str | None = box_field()
    path: str = Field(
        "/", description="Absolute path of the directory.", pattern=ABSOLUTE, examples=["/work"]
    )


class Snapshot(Args):
    box: str | None = box_field()
    name: str | None = Field(
        None,
        description="A name for the snapshot, to roll back to it by name (same rule as box names).",
        pattern=BOX_NAME,
        examples=["before-upgrade"],
    )


class ListSnapshots(Args):
    box: str | None = box_field()


class Rollback(Args):
    box: str | None = box_field()
    snapshot: str = Field(description="Name or id of a snapshot of this box.", min_length=1, max_length=64,
                          examples=["before-upgrade"])  # fmt: skip


class Diff(Args):
    box: str | None = box_field()
    since: str | None = Field(
        None,
        description="Name or id of a snapshot of this box to compare with. Leave it out to compare with the "
        "box's image: everything changed since the box was made.",
        min_length=1,
        max_length=64,
        examples=["before-upgrade"],
    )
    against_box: str | None = Field(
        None,
        description="Another box (a sibling fork, say) to compare with instead of a snapshot: what this box "
        "has that the other has not.",
        pattern=BOX_NAME,
    )
    paths: list[Annotated[str, Field(pattern=ABSOLUTE)]] | None = Field(
        None, description="Only these absolute paths (files or directories).", max_length=32,
        examples=[["/work"]],
    )  # fmt: skip
    patch: bool = Field(
        True, description=f"Include the unified diffs of changed text files (at most {MAX_PATCH} characters)."
    )


class Fork(Args):
    box: str | None = box_field()
    n: int = Field(1, description=f"How many copies (1 to {MAX_FORK}).", ge=1, le=MAX_FORK)
    name: str | None = Field(
        None,
        description="Prefix of the copies' names, each followed by '-' and 6 random hex digits (default: the "
        "box's name).",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,55}$",
    )


class Timeline(Args):
    box: str | None = box_field()
    after: int = Field(0, description="Only the steps after this one (0: from the first).", ge=0)
    limit: int = Field(50, description="At most this many steps (the oldest first).", ge=1, le=500)


class Rewind(Args):
    box: str | None = box_field()
    step: str = Field(description="The step's number in the timeline, or its name.", min_length=1,
                      max_length=63, examples=["12"])  # fmt: skip


class Suspend(Args):
    box: str | None = box_field()


class Resume(Args):
    box: str | None = box_field()


class RemoveBox(Args):
    box: str = Field(description="Name or id of the box to delete.", min_length=1, max_length=64,
                     examples=["analysis"])  # fmt: skip


# the computer tool's actions: Anthropic's computer-use names, then OpenAI's
ComputerAction = Literal[
    "screenshot", "left_click", "right_click", "middle_click", "double_click", "triple_click",
    "mouse_move", "left_click_drag", "left_mouse_down", "left_mouse_up", "scroll", "type", "key",
    "hold_key", "wait", "cursor_position",
    "click", "move", "drag", "keypress",
]  # fmt: skip
Coordinate = Annotated[list[Annotated[int, Field(ge=0, le=16383)]], Field(min_length=2, max_length=2)]


PathPoint = dict[Literal["x", "y"], Annotated[int, Field(ge=0, le=16383)]]


class Computer(Args):
    box: str | None = box_field()
    action: ComputerAction = Field(
        description="What to do. screenshot; left_click, right_click, middle_click, double_click, "
        "triple_click (at coordinate, or where the pointer is); mouse_move; left_click_drag (from "
        "start_coordinate to coordinate); left_mouse_down, left_mouse_up; scroll (scroll_direction, "
        "scroll_amount at coordinate); type (text); key (text: 'ctrl+l', 'Return'); hold_key (text, "
        "duration); wait (duration); cursor_position. OpenAI's names work too: click (x, y, button), "
        "move, drag (path), keypress (keys), scroll (x, y, scroll_x, scroll_y in pixels)."
    )
    coordinate: Coordinate | None = Field(None, description="[x, y] in pixels of the screen you were shown.")
    start_coordinate: Coordinate | None = Field(None, description="Where left_click_drag starts: [x, y].")
    x: int | None = Field(None, description="x in pixels (OpenAI's click, move, scroll).", ge=0, le=16383)
    y: int | None = Field(None, description="y in pixels (OpenAI's click, move, scroll).", ge=0, le=16383)
    button: Literal["left", "right", "middle", "wheel", "back", "forward"] | None = Field(
        None, description="The button of a click (default left)."
    )
    path: list[PathPoint] | None = Field(
        None, description="The points of a drag, first to last: [{x, y}, ...].", min_length=2, max_length=64
    )
    text: str | None = Field(
        None,
        description="What to type (any Unicode; a newline is Enter), or the key of key/hold_key.",
        max_length=10000,
    )
    keys: list[Annotated[str, Field(min_length=1, max_length=40)]] | None = Field(
        None, description="Keys pressed together (keypress): ['CTRL', 'L'].", min_length=1, max_length=8
    )
    scroll_direction: Literal["up", "down", "left", "right"] | None = Field(
        None, description="Which way to scroll (default down)."
    )
    scroll_amount: int | None = Field(None, description="Notches to scroll (default 3).", ge=1, le=50)
    scroll_x: int | None = Field(
        None, description="Pixels to scroll right (negative: left).", ge=-9999, le=9999
    )
    scroll_y: int | None = Field(None, description="Pixels to scroll down (negative: up).", ge=-9999, le=9999)
    duration: float | None = Field(
        None, description="Seconds, for wait and hold_key (up to 30).", ge=0, le=30
    )

    @model_validator(mode="before")
    @classmethod
    def openai_type(cls, data: Any) -> Any:
        """OpenAI's computer_call actions name themselves with ``type``: take it as ``action``."""
        if isinstance(data, dict) and "type" in data and "action" not in data:
            data = {("action" if k == "type" else k): v for k, v in data.items()}
        return data


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    args: type[Args]
    read_only: bool = False
    destructive: bool = False
    on_box: bool = True  # it acts on one box, named by its ``box`` argument

    def input_schema(self) -> dict[str, Any]:
        """The JSON Schema (draft 2020-12) of the arguments, without pydantic's titles and
        with ``X | None`` arguments as plain optional ones."""
        return clean_schema(self.args.model_json_schema())

    def validate(self, arguments: Mapping[str, Any] | str | None) -> Args:
        """The arguments as this tool's model; ``ToolInputError`` naming each problem otherwise.
        A JSON string (what OpenAI's function calls carry) is parsed first."""
        if isinstance(arguments, str | bytes):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as e:
                raise ToolInputError(f"{self.name}: the arguments are not valid JSON: {e}", tool=self.name,
                                     problems=[str(e)]) from None  # fmt: skip
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            kind = type(arguments).__name__
            raise ToolInputError(f"{self.name}: the arguments must be a JSON object, not {kind}",
                                 tool=self.name, problems=["not an object"])  # fmt: skip
        try:
            return self.args.model_validate(dict(arguments))
        except ValidationError as e:
            errors = e.errors()
            missing = [str(err["loc"][0]) for err in errors if err.get("type") == "missing"]
            problems = [self.problem(err, missing) for err in errors]
            raise ToolInputError(f"{self.name}: " + "; ".join(problems), tool=self.name,
                                 problems=problems) from None  # fmt: skip

    def problem(self, err: Any, missing: list[str]) -> str:
        where = ".".join(str(p) for p in err.get("loc", ()))
        kind = err.get("type", "")
        known = ", ".join(self.args.model_fields)
        if kind == "missing":
            return f"missing required argument {where!r}"
        if kind == "extra_forbidden":
            # a misspelt argument is most likely the required one that is missing
            close = difflib.get_close_matches(where, missing, n=1, cutoff=0.3) or difflib.get_close_matches(
                where, list(self.args.model_fields), n=1
            )
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"unknown argument {where!r}{hint}; the arguments are: {known or 'none'}"
        got = json.dumps(err.get("input"), default=repr)
        if len(got) > 80:
            got = got[:77] + "..."
        return f"argument {where!r}: {err.get('msg', 'invalid')} (got {got})"


def clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
    for name, prop in schema.get("properties", {}).items():
        prop = dict(prop)
        prop.pop("title", None)
        branches = prop.pop("anyOf", None)
        if branches is not None:
            # ``X | None = None``: a model leaves such an argument out rather than send null
            [real] = [b for b in branches if b.get("type") != "null"]
            prop = {**real, **prop}
            if prop.get("default", 0) is None:
                del prop["default"]
        out["properties"][name] = prop
    if schema.get("required"):
        out["required"] = list(schema["required"])
    return out


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "create_box",
        "Create a sandbox",
        "Create and boot a new sandbox: a Linux microVM of its own (own kernel, disk and network), "
        "isolated from the host. It keeps running until remove_box; nothing you do in it can harm the "
        "host. Returns the box's name and id: pass the name as `box` to the other tools. Booting takes "
        'a second or two. Example: {"image": "python:3.12-slim", "name": "analysis"}.',
        CreateBox,
        on_box=False,
    ),
    ToolSpec(
        "list_boxes",
        "List sandboxes",
        "List the sandboxes you can use: name, id, state (running, suspended, stopped...), image, "
        "memory and when each was created.",
        ListBoxes,
        read_only=True,
        on_box=False,
    ),
    ToolSpec(
        "exec",
        "Run a shell command",
        "Run a shell command in a box and wait for it; returns its exit code, stdout and stderr. Each "
        "call is a fresh shell: `cd` and variables do not carry over (use `cd /dir && ...`, or the cwd "
        "argument); files do. Long output is cut to its beginning and end, and the whole of it is saved "
        "to a file in the box whose path the answer gives (read it with read_file). "
        'Example: {"box": "analysis", "command": "pip install pandas && python3 -c \'import pandas\'"}.',
        Exec,
    ),
    ToolSpec(
        "run_code",
        "Run code",
        "Run a cell of code in a box's interpreter, like a Jupyter notebook cell: state persists "
        "between calls, the value of the last expression is shown, and plots (matplotlib) and other "
        "images come back as images. Python by default; bash, JavaScript and TypeScript too (language). "
        "Returns stdout, stderr, the results, and the traceback if the code raised. The box's image "
        'needs Python 3. Example: {"box": "analysis", "code": '
        "\"import pandas as pd\\ndf = pd.read_csv('/work/data.csv')\\ndf.describe()\"}.",
        RunCode,
    ),
    ToolSpec(
        "read_file",
        "Read a file",
        "Read a file in a box: as text (default), as base64 for binary files, or as an image. Reads at "
        "most `length` bytes from `offset` and says how many bytes the file has, so a big file is read "
        'in pieces. Example: {"box": "analysis", "path": "/work/out.log", "offset": 65536}.',
        ReadFile,
        read_only=True,
    ),
    ToolSpec(
        "write_file",
        "Write a file",
        "Write a file in a box (replacing it atomically, or appending), creating missing parent "
        'directories. Text by default; base64 for binary content. Example: {"box": "analysis", '
        '"path": "/work/hello.py", "content": "print(\'hello\')\\n"}.',
        WriteFile,
    ),
    ToolSpec(
        "list_files",
        "List a directory",
        "List a directory in a box: each entry's name, type (file, dir, symlink), size, permissions and "
        'modification time. Example: {"box": "analysis", "path": "/work"}.',
        ListFiles,
        read_only=True,
    ),
    ToolSpec(
        "snapshot",
        "Snapshot a box",
        "Save the whole running state of a box: memory, running processes and disk. rollback returns "
        "the box to it later; take one before a risky step. The box keeps running. Example: "
        '{"box": "analysis", "name": "before-upgrade"}.',
        Snapshot,
    ),
    ToolSpec(
        "list_snapshots",
        "List a box's snapshots",
        "List the snapshots of a box, oldest first: name, id, size and when each was taken.",
        ListSnapshots,
        read_only=True,
    ),
    ToolSpec(
        "rollback",
        "Roll a box back",
        "Take a box back to one of its snapshots: memory, processes and disk become what they were "
        'then; everything since is lost. Same box name. Example: {"box": "analysis", '
        '"snapshot": "before-upgrade"}.',
        Rollback,
        destructive=True,
    ),
    ToolSpec(
        "diff",
        "What changed in a box's files",
        "List the files a box added, deleted, modified or renamed since one of its snapshots (since), "
        "since its image (the default), or against another box (against_box), with what changed about "
        "each (content, mode, owner, link target) and unified diffs of text files. Use it to review work "
        'before keeping it, or to compare forks. Example: {"box": "analysis", "since": "before-upgrade", '
        '"paths": ["/work"]}.',
        Diff,
        read_only=True,
    ),
    ToolSpec(
        "fork",
        "Fork a box",
        "Make running copies of a box as it is now (memory, processes and disk), to try different "
        "things in parallel; each copy then goes its own way. Returns the new boxes' names. Example: "
        '{"box": "analysis", "n": 2}.',
        Fork,
    ),
    ToolSpec(
        "timeline",
        "The steps taken in a box",
        "List the steps recorded in a box that records its timeline: each command, code cell, file "
        "write or tool call, with how it ended, how long it took and whether its state is kept (a "
        "checkpoint). Use it to find the step before something went wrong, then rewind to it. Example: "
        '{"box": "analysis", "after": 10}.',
        Timeline,
        read_only=True,
    ),
    ToolSpec(
        "rewind",
        "Rewind a box to a step",
        "Take a box that records its timeline back to the state just after one of its steps: memory, "
        "processes and disk. The steps after it stay in the timeline; their changes are gone from the "
        'box. Example: {"box": "analysis", "step": "12"}.',
        Rewind,
        destructive=True,
    ),
    ToolSpec(
        "suspend",
        "Suspend a box",
        "Save a box's running state to disk and stop its VM: it uses no CPU or memory until resume "
        "(or the next command in it), and its processes carry on where they were.",
        Suspend,
    ),
    ToolSpec(
        "resume",
        "Resume a box",
        "Bring a suspended box back, with its processes, as it was when it was suspended.",
        Resume,
    ),
    ToolSpec(
        "computer",
        "Use a box's desktop",
        "See and drive the desktop of a desktop box (its screen, mouse and keyboard), as a person "
        "would: screenshot shows the screen; the other actions click, type, press keys, scroll and "
        "drag at pixel coordinates of that screenshot, and answer with a new screenshot. Take a "
        "screenshot first, and after anything that changes the screen. Example: "
        '{"box": "desk", "action": "left_click", "coordinate": [512, 300]}.',
        Computer,
    ),
    ToolSpec(
        "remove_box",
        "Remove a box",
        "Delete a box for good: its VM, disk and files. Give the box explicitly. Example: "
        '{"box": "analysis"}.',
        RemoveBox,
        destructive=True,
    ),
)
BY_NAME = {t.name: t for t in TOOLS}


def spec(name: str) -> ToolSpec:
    """The tool named ``name``; ``UnknownTool`` (with the closest name) otherwise."""
    found = BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        close = difflib.get_close_matches(str(name), list(BY_NAME), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownTool(f"unknown tool {name!r}{hint}; the tools are: {', '.join(BY_NAME)}", tool=str(name))
    return found
