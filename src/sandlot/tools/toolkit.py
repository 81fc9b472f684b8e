"""``Toolkit``: where the tools find boxes and make new ones, what they may do, and
the code behind each tool.

A toolkit works on the boxes of a backend (``api/backend.py``): a home of this host,
a ``sandlot serve`` (an ``AsyncClient``), a fleet. Every tool goes through the one
``AsyncBox`` API, so a server's keys, namespaces, quotas and audit apply to tool
calls as to any other request."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..api.backend import Backend
from ..api.box import AsyncBox, boxes_of
from ..api.desktop import AsyncDesktop, check_size
from ..api.events import record_refusal
from ..api.files import FileInfo
from ..api.local import LocalBackend
from ..api.process import ExecResult
from ..errors import (
    BoxNotFound,
    CodeTimeout,
    ExecTimeout,
    Forbidden,
    InvalidArgument,
    QuotaExceeded,
    SandlotError,
    SnapshotNotFound,
)
from . import specs
from .results import ImagePart, Part, TextPart, ToolResult, json_text
from .specs import Args, ToolError, ToolInputError

Format = Literal["openai", "anthropic", "mcp"]
FORMATS = ("openai", "anthropic", "mcp")
OUTPUT_DIR = "/tmp/sandlot-output"  # where exec keeps the whole of an output it had to cut
MAX_IMAGE = 5 << 20  # bytes of an image read_file shows (what the model APIs take)
MAX_ENTRIES = 1000  # entries list_files shows
MAX_LISTED = 500  # changes diff lists in its structured answer
IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"))  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What the tools may create, on top of anything the home or server enforces.

    ``max_boxes``: boxes the toolkit sees at once (create_box and fork refuse more);
    ``max_memory_mib`` and ``max_cpus``: per box; ``images``: the images create_box
    may boot (None: any); ``max_timeout``: seconds an exec or a code cell may be given."""

    max_boxes: int | None = None
    max_memory_mib: int | None = None
    max_cpus: int | None = None
    images: tuple[str, ...] | None = None
    max_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_boxes", "max_memory_mib", "max_cpus", "max_timeout"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or value <= 0):
                raise InvalidArgument(f"Limits.{name} must be a positive number, not {value!r}")
        if self.max_memory_mib is not None and self.max_memory_mib < 64:
            raise InvalidArgument(f"Limits.max_memory_mib must be at least 64, not {self.max_memory_mib}")
        if self.images is not None:
            if isinstance(self.images, str) or not all(isinstance(i, str) and i for i in self.images):
                raise InvalidArgument("Limits.images must be a sequence of image references")
            object.__setattr__(self, "images", tuple(self.images))


def unwrap(target: Any) -> Any:
    """The async object behind a sync one (``Box``, ``Client``)."""
    aio = getattr(type(target), "aio", None)
    return target.aio if isinstance(aio, property) else target


class Toolkit:
    """The tools bound to where they act.

    ``target``: a box (sync or async, however it is reached: the *default box*, which
    the box tools act on when a call gives no ``box``; create_box makes new boxes
    beside it), a client (``sandlot.connect``: that server's boxes, as its key sees
    them; a fleet's), a backend, or None (the boxes of ``home``, ``$SANDLOT_HOME`` by
    default).

    ``image``: what create_box boots when the call names none. ``limits``: see
    ``Limits``. ``labels``: put on every box create_box makes (forks carry them too);
    with ``own_only`` the tools see and touch only boxes carrying all of them, so an
    agent cannot reach the other boxes of the home. ``output_limit``: bytes of each
    of an exec's stdout and stderr shown (the whole is saved in the box beyond it).
    """

    def __init__(
        self,
        target: Any = None,
        *,
        image: str | None = None,
        limits: Limits | None = None,
        labels: Mapping[str, str] | None = None,
        own_only: bool = False,
        output_limit: int = 16384,
        home: str | os.PathLike[str] | None = None,
        display_size: tuple[int, int] | None = None,
        settle: float = 0.3,
    ) -> None:
        target = unwrap(target)
        self.default_box: AsyncBox | None = None
        self.backend: Backend
        if isinstance(target, AsyncBox):
            self.backend, self.default_box = target.ref.backend, target
        elif target is None:
            self.backend = LocalBackend.for_home(home)
        elif isinstance(target, Backend):
            self.backend = target
        elif isinstance(getattr(target, "backend", None), Backend):  # a client
            self.backend = target.backend
        else:
            raise InvalidArgument(f"tools act on a box, a client or a home, not {type(target).__name__}")
        if own_only and not labels:
            raise InvalidArgument("own_only needs labels: the boxes of the toolkit are those carrying them")
        if output_limit < 1024:
            raise InvalidArgument(f"output_limit must be at least 1024 bytes, not {output_limit}")
        self.image = image
        self.limits = limits or Limits()
        self.labels = dict(labels or {})
        self.own_only = own_only
        self.output_limit = output_limit
        if display_size is not None:
            display_size = check_size(display_size)
        if not 0 <= settle <= 10:
            raise InvalidArgument(f"settle is from 0 to 10 seconds, not {settle!r}")
        self.display_size = display_size
        self.settle = settle
        # box id -> its desktop: one VNC session a box, kept across calls (each call finds
        # its box anew, and a new handle's desktop would open a session of its own)
        self.desktops: dict[str, AsyncDesktop] = {}
        self.creating = asyncio.Lock()  # creations in turn, so two cannot both pass max_boxes
        self.handlers: dict[str, Callable[[Any], Awaitable[ToolResult]]] = {
            "create_box": self.create_box, "list_boxes": self.list_boxes, "exec": self.exec,
            "run_code": self.run_code, "read_file": self.read_file, "write_file": self.write_file,
            "list_files": self.list_files, "snapshot": self.snapshot, "list_snapshots": self.list_snapshots,
            "rollback": self.rollback, "diff": self.diff, "fork": self.fork, "suspend": self.suspend,
            "timeline": self.timeline, "rewind": self.rewind,
            "resume": self.resume, "computer": self.computer, "remove_box": self.remove_box,
        }  # fmt: skip
        assert set(self.handlers) == set(specs.BY_NAME), "every tool has its handler"

    # -- schemas and dispatch ----------------------------------------------------------------

    def names(self) -> list[str]:
        return [t.name for t in specs.TOOLS]

    def schemas(
        self, format: Format = "openai", *, tools: Iterable[str] | None = None
    ) -> list[dict[str, Any]]:
        """The tools' definitions in ``format``, their schemas showing this toolkit's
        default image and box and its limits. ``tools``: only these (by name)."""
        box = self.default_box.name if self.default_box is not None else None
        return render(format, tools, default_image=self.image, limits=self.limits, default_box=box)

    async def call(
        self, name: str, arguments: Mapping[str, Any] | str | None = None, *, raise_errors: bool = True
    ) -> ToolResult:
        """Run the tool ``name`` with ``arguments`` (a mapping, or the JSON text of one).

        Bad input raises ``UnknownTool`` or ``ToolInputError`` before anything runs;
        an operation that fails raises its sandlot error (``BoxNotFound``,
        ``GuestFileNotFoundError``...). With ``raise_errors=False`` every sandlot
        error comes back as a result with ``is_error`` set, its text saying what went
        wrong, ready to hand to the model."""
        try:
            tool = specs.spec(name)
            args = self.check_limits(tool.name, tool.validate(arguments))
            if tool.name not in STEPS:
                return await self.handlers[tool.name](args)
            # on a box that records, the call and what it did is one step of its timeline
            box = await self.box(getattr(args, "box", None))
            async with box.as_step("tool", tool=tool.name, arguments=step_arguments(args)):
                return await self.handlers[tool.name](args)
        except SandlotError as e:
            if raise_errors:
                raise
            return ToolResult.failed(e)

    def check_limits(self, tool: str, args: Args) -> Args:
        """``args`` within the limits: a default over a limit comes down to it, a value
        the call gave over one is refused."""
        lim = self.limits
        given = args.model_fields_set
        lowered: dict[str, Any] = {}
        for key, most in (
            ("timeout", lim.max_timeout),
            ("memory_mib", lim.max_memory_mib),
            ("cpus", lim.max_cpus),
        ):
            value = getattr(args, key, None)
            if most is not None and value is not None and value > most and key not in given:
                lowered[key] = int(most) if isinstance(value, int) else most
        if lowered:
            args = args.model_copy(update=lowered)
        timeout = getattr(args, "timeout", None)
        if lim.max_timeout is not None and timeout is not None and timeout > lim.max_timeout:
            raise ToolInputError(f"{tool}: timeout {timeout:g}s is over the limit of {lim.max_timeout:g}s "
                                 "here", tool=tool, problems=["timeout"])  # fmt: skip
        if isinstance(args, specs.CreateBox):
            image = args.image or self.image
            if image is None:
                raise ToolInputError("create_box: give an image (there is no default image here)", tool=tool,
                                     problems=["missing required argument 'image'"])  # fmt: skip
            if lim.images is not None and args.image is not None and args.image not in lim.images:
                raise Forbidden(f"create_box: image {args.image!r} is not allowed here; the images are: "
                                + ", ".join(lim.images))  # fmt: skip
            if lim.max_memory_mib is not None and args.memory_mib > lim.max_memory_mib:
                most = lim.max_memory_mib
                raise ToolInputError(f"create_box: memory_mib {args.memory_mib} is over the limit of {most} "
                                     "here", tool=tool, problems=["memory_mib"])  # fmt: skip
            if lim.max_cpus is not None and args.cpus > lim.max_cpus:
                raise ToolInputError(f"create_box: cpus {args.cpus} is over the limit of {lim.max_cpus} here",
                                     tool=tool, problems=["cpus"])  # fmt: skip
        return args

    async def room_for(self, n: int) -> None:
        """Refuse ``n`` more boxes past ``max_boxes`` (call with ``creating`` held)."""
        most = self.limits.max_boxes
        if most is None:
            return
        have = len(await self.visible())
        if have + n > most:
            refused = QuotaExceeded(f"at most {most} boxes at once here: {have} exist and {n} more were "
                                    "asked; remove_box one first", limit="boxes", value=most)  # fmt: skip
            if isinstance(self.backend, LocalBackend):  # a server's own refusals are its to record
                await record_refusal(str(refused), self.labels, home=self.backend.runtime.home)
            raise refused

    # -- boxes ------------------------------------------------------------------------------

    async def visible(self) -> list[AsyncBox]:
        return await boxes_of(self.backend, labels=self.labels if self.own_only else None)

    def mine(self, box: AsyncBox) -> bool:
        labels = box.info.get("labels") or {}
        return not self.own_only or all(labels.get(k) == v for k, v in self.labels.items())

    async def box(self, key: str | None) -> AsyncBox:
        """The box a call names, or the default box; others' boxes (``own_only``) as none."""
        if key is None:
            if self.default_box is None:
                raise ToolInputError("no box given: pass `box`, the name create_box returned (list_boxes "
                                     "lists them)", problems=["missing required argument 'box'"])  # fmt: skip
            return self.default_box
        if self.default_box is not None and key in (self.default_box.name, self.default_box.id):
            return self.default_box
        box = AsyncBox.bound(await self.backend.find(key))
        if not self.mine(box):
            raise BoxNotFound(f"no box {key!r}", box=key)
        return box

    async def create_box(self, a: specs.CreateBox) -> ToolResult:
        options: dict[str, Any] = {"memory_mib": a.memory_mib, "cpus": a.cpus, "network": a.network}
        for key in ("name", "env", "workdir"):
            if getattr(a, key) is not None:
                options[key] = getattr(a, key)
        if self.labels:
            options["labels"] = dict(self.labels)
        async with self.creating:
            await self.room_for(1)
            box = AsyncBox.bound(self.backend.describe(a.image or self.image, options, keep=True))
            await box.start()
        data = summary(box)
        text = (f"Created box {box.name!r} (id {box.id}, image {data['image']}, {data['memory_mib']} MiB): "
                f"it is {box.state}. Pass box={box.name!r} to the other tools.")  # fmt: skip
        return ToolResult([TextPart(text)], data)

    async def list_boxes(self, a: specs.ListBoxes) -> ToolResult:
        boxes = [summary(b) for b in await self.visible()]
        if not boxes:
            return ToolResult([TextPart("No boxes: create_box makes one.")], {"boxes": []})
        lines = [f"{b['name']}  id={b['id']}  {b['state']}  image={b['image']}  {b['memory_mib']} MiB"
                 for b in boxes]  # fmt: skip
        return ToolResult([TextPart("\n".join(lines))], {"boxes": boxes})

    # -- commands ---------------------------------------------------------------------------

    async def exec(self, a: specs.Exec) -> ToolResult:
        box = await self.box(a.box)
        timed_out = False
        try:
            r = await box.exec("/bin/sh", "-c", a.command, env=a.env, cwd=a.cwd, user=a.user, stdin=a.stdin,
                               timeout=a.timeout)  # fmt: skip
        except ExecTimeout as e:
            timed_out = True
            r = ExecResult(("/bin/sh", "-c", a.command), -1, e.stdout, e.stderr)
        token = f"exec-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        out_text, out_file = await self.clipped(box, r.stdout_bytes, f"{token}.stdout", "stdout")
        err_text, err_file = await self.clipped(box, r.stderr_bytes, f"{token}.stderr", "stderr")
        if timed_out:
            head = f"TIMED OUT after {a.timeout:g}s: the command was killed. Output until then:"
        else:
            head = f"exit code: {r.exit_code}"
            if r.signal:
                head += f" (killed by signal {r.signal})"
            if r.oom_killed:
                head += " (the box ran out of memory: the out-of-memory killer ended a process)"
        parts = [head]
        if out_text:
            parts.append(f"stdout:\n{out_text}")
        if err_text:
            parts.append(f"stderr:\n{err_text}")
        if not out_text and not err_text:
            parts.append("(no output)")
        data = {"exit_code": None if timed_out else r.exit_code, "signal": r.signal, "timed_out": timed_out,
                "stdout": out_text, "stderr": err_text, "stdout_file": out_file, "stderr_file": err_file,
                "duration": round(r.duration, 3)}  # fmt: skip
        return ToolResult([TextPart("\n".join(parts))], data)

    async def clipped(self, box: AsyncBox, data: bytes, name: str, what: str) -> tuple[str, str | None]:
        """``data`` as text, its middle cut out past ``output_limit``; the whole then saved
        in the box (returned: the text, and the file's path if it was cut)."""
        if len(data) <= self.output_limit:
            return data.decode("utf-8", "replace"), None
        head = self.output_limit // 4
        tail = self.output_limit - head
        path = f"{OUTPUT_DIR}/{name}"
        try:
            await box.files.write(path, data)
            where = (f"The whole {what} is in {path}: read_file with path={path!r} and offset={head} reads "
                     "on from where the first part stops.")  # fmt: skip
        except Exception as e:
            path, where = "", f"(It could not be saved in the box: {e}.)"
        cut = len(data) - head - tail
        note = f"\n[... {cut} bytes cut: {what} has {len(data)} bytes in all, shown are the first {head} " \
               f"and the last {tail}. {where}]\n"  # fmt: skip
        text = data[:head].decode("utf-8", "replace") + note + data[-tail:].decode("utf-8", "replace")
        return text, path or None

    async def run_code(self, a: specs.RunCode) -> ToolResult:
        box = await self.box(a.box)
        try:
            execution = await box.run_code(a.code, language=a.language, context=a.context, timeout=a.timeout)
        except CodeTimeout as e:
            kept = "its variables are lost" if e.state_lost else "the context keeps its variables"
            result = self.execution_result(e.execution)
            note = TextPart(f"TIMED OUT after {a.timeout:g}s: the cell was interrupted; {kept}.")
            return ToolResult([note, *result.content], {**result.data, "timed_out": True})
        return self.execution_result(execution)

    def execution_result(self, execution: Any) -> ToolResult:
        """A code cell's ``Execution`` as text and images: output, results, the error."""
        limit = self.output_limit
        parts: list[Part] = []
        text: list[str] = []
        stdout, stderr = clip_text(execution.stdout or "", limit), clip_text(execution.stderr or "", limit)
        if stdout:
            text.append(f"stdout:\n{stdout}")
        if stderr:
            text.append(f"stderr:\n{stderr}")
        results = []
        for res in execution.results:
            formats = [f for f in ("text", "markdown", "html", "svg", "png", "jpeg", "latex", "json")
                       if getattr(res, f, None) is not None]  # fmt: skip
            results.append({"formats": formats, "is_main_result": bool(res.is_main_result),
                            "text": res.text})  # fmt: skip
            shown = res.markdown or res.text or res.latex
            if shown is None and res.json is not None:
                shown = json_text(res.json)
            if shown is None and res.html is not None and res.png is None and res.jpeg is None:
                shown = res.html
            label = "result" if res.is_main_result else "display"
            if shown is not None:
                text.append(f"{label}:\n{clip_text(shown, limit)}")
            for fmt, mime in (("png", "image/png"), ("jpeg", "image/jpeg")):
                if getattr(res, fmt, None):
                    flush(parts, text)
                    parts.append(ImagePart(getattr(res, fmt), mime))
        err = execution.error
        if err is not None:
            trace = clip_text(err.traceback or "", limit)
            text.append(f"error: {err.name}: {err.value}" + (f"\n{trace}" if trace else ""))
        if not text and not parts:
            text.append("(no output)")
        flush(parts, text)
        data = {"stdout": stdout, "stderr": stderr, "results": results,
                "error": {"name": err.name, "value": err.value, "traceback": err.traceback} if err else None,
                "execution_count": execution.execution_count}  # fmt: skip
        return ToolResult(parts, data)

    # -- files ------------------------------------------------------------------------------

    async def read_file(self, a: specs.ReadFile) -> ToolResult:
        box = await self.box(a.box)
        info = await box.files.stat(a.path)
        if info.is_dir:
            raise ToolError(f"read_file: {a.path} is a directory: list it with list_files", tool="read_file")
        if a.encoding == "image":
            if info.size > MAX_IMAGE:
                raise ToolError(f"read_file: {a.path} has {info.size} bytes, over the {MAX_IMAGE} an image "
                                "may have here", tool="read_file")  # fmt: skip
            raw = await box.files.read(a.path)
            mime = sniff_image(raw)
            if mime is None:
                raise ToolError(
                    f"read_file: {a.path} is not a PNG, JPEG, GIF or WebP image", tool="read_file"
                )
            b64 = base64.b64encode(raw).decode()
            return ToolResult([TextPart(f"{a.path}: {mime}, {len(raw)} bytes"), ImagePart(b64, mime)],
                              {"path": a.path, "size": len(raw), "mime_type": mime})  # fmt: skip
        raw = b"".join([c async for c in box.files.iter_read(a.path, offset=a.offset, length=a.length)])
        end = a.offset + len(raw)
        left = max(info.size - end, 0)
        data: dict[str, Any] = {"path": a.path, "size": info.size, "offset": a.offset, "length": len(raw),
                                "remaining": left}  # fmt: skip
        if a.encoding == "base64":
            data["content_base64"] = content = base64.b64encode(raw).decode()
        else:
            if b"\x00" in raw:
                raise ToolError(f"read_file: {a.path} looks binary (it has NUL bytes): read it with "
                                "encoding='base64'", tool="read_file")  # fmt: skip
            data["content"] = content = raw.decode("utf-8", "replace")
        whole = a.offset == 0 and left == 0
        head = (
            f"{a.path} ({info.size} bytes)" if whole else f"{a.path}: bytes {a.offset}-{end} of {info.size}"
        )
        if left:
            head += f"; {left} more: read_file with offset={end} for the next part"
        return ToolResult([TextPart(f"{head}\n{content}")], data)

    async def write_file(self, a: specs.WriteFile) -> ToolResult:
        box = await self.box(a.box)
        if a.encoding == "base64":
            try:
                payload = base64.b64decode(a.content, validate=True)
            except binascii.Error:
                raise ToolInputError("write_file: content is not valid base64", tool="write_file",
                                     problems=["content"]) from None  # fmt: skip
        else:
            payload = a.content.encode()
        mode = int(a.mode, 8) if a.mode is not None else None
        await box.files.write(a.path, payload, mode=mode, append=a.append)
        verb = "Appended" if a.append else "Wrote"
        return ToolResult([TextPart(f"{verb} {len(payload)} bytes to {a.path}.")],
                          {"path": a.path, "bytes": len(payload), "append": a.append})  # fmt: skip

    async def list_files(self, a: specs.ListFiles) -> ToolResult:
        box = await self.box(a.box)
        entries = await box.files.list(a.path)
        shown = entries[:MAX_ENTRIES]
        lines = [entry_line(e) for e in shown]
        if len(entries) > len(shown):
            lines.append(f"[... and {len(entries) - len(shown)} more entries]")
        text = f"{a.path}: {len(entries)} entries\n" + "\n".join(lines) if entries else f"{a.path} is empty"
        return ToolResult([TextPart(text)], {"path": a.path, "entries": [entry_json(e) for e in shown],
                                             "total": len(entries)})  # fmt: skip

    # -- live state ---------------------------------------------------------------------------

    async def snapshot(self, a: specs.Snapshot) -> ToolResult:
        box = await self.box(a.box)
        snap = await box.snapshot(a.name)
        key = snap.name or snap.id
        text = f"Snapshot {key!r} of box {box.name!r} taken (id {snap.id}). rollback with snapshot={key!r} " \
               "returns the box to this moment."  # fmt: skip
        return ToolResult([TextPart(text)], snapshot_json(snap, box.name))

    async def list_snapshots(self, a: specs.ListSnapshots) -> ToolResult:
        box = await self.box(a.box)
        snaps = [snapshot_json(s, box.name) for s in await box.snapshots()]
        if not snaps:
            return ToolResult([TextPart(f"Box {box.name!r} has no snapshots.")], {"snapshots": []})
        lines = [f"{s['name'] or '-'}  id={s['id']}  {s['size']} bytes  taken {s['created']}" for s in snaps]
        return ToolResult([TextPart("\n".join(lines))], {"snapshots": snaps})

    async def rollback(self, a: specs.Rollback) -> ToolResult:
        box = await self.box(a.box)
        await box.rollback(await own_snapshot(box, a.snapshot))
        text = f"Box {box.name!r} is back at snapshot {a.snapshot!r}: memory, processes and disk."
        return ToolResult([TextPart(text)], {"box": box.name, "snapshot": a.snapshot})

    async def diff(self, a: specs.Diff) -> ToolResult:
        box = await self.box(a.box)
        if a.since is not None and a.against_box is not None:
            raise specs.ToolError("give since (a snapshot) or against_box, not both", tool="diff")
        if a.against_box is not None:
            side: Any = await self.box(a.against_box)
        else:
            side = await own_snapshot(box, a.since) if a.since is not None else None
        found = await box.diff(side, paths=a.paths)
        text = found.summary()
        if a.patch and found:
            patch = found.patch()
            if len(patch) > specs.MAX_PATCH:
                cut = len(patch) - specs.MAX_PATCH
                patch = patch[: specs.MAX_PATCH] + f"\n[... {cut} more characters: narrow it with paths]\n"
            text += "\n\n" + patch
        listed = [
            {k: v for k, v in (("path", c.path), ("status", c.status), ("fields", list(c.fields)),
                               ("renamed_from", c.renamed_from)) if v}
            for c in found.changes[:MAX_LISTED]
        ]  # fmt: skip
        data: dict[str, Any] = {
            "box": box.name,
            "from": found.a,
            "to": found.b,
            "stat": found.stat,
            "changes": listed,
        }
        if len(found) > MAX_LISTED:
            data["more"] = len(found) - MAX_LISTED
        return ToolResult([TextPart(text)], data)

    async def fork(self, a: specs.Fork) -> ToolResult:
        box = await self.box(a.box)
        async with self.creating:
            await self.room_for(a.n)
            kids = await box.fork(a.n, name=a.name)
        names = [k.name for k in kids]
        text = f"Forked box {box.name!r} into {', '.join(repr(n) for n in names)}: running copies of it as " \
               "it was, each going its own way from here."  # fmt: skip
        return ToolResult([TextPart(text)], {"box": box.name, "boxes": [summary(k) for k in kids]})

    async def timeline(self, a: specs.Timeline) -> ToolResult:
        box = await self.box(a.box)
        steps = await box.timeline(after=a.after, limit=a.limit)
        if not steps:
            said = "records no steps: it is not recording" if a.after == 0 else f"has no step after {a.after}"
            return ToolResult([TextPart(f"Box {box.name!r} {said}.")], {"box": box.name, "steps": []})
        listed = [
            {"step": s.seq, "kind": s.kind, "what": s.describe(), "outcome": s.outcome(),
             "seconds": round(s.duration, 3), "kept": s.kept, "name": s.name}
            for s in steps
        ]  # fmt: skip
        return ToolResult([TextPart("\n".join(str(s) for s in steps))], {"box": box.name, "steps": listed})

    async def rewind(self, a: specs.Rewind) -> ToolResult:
        box = await self.box(a.box)
        await box.rewind(a.step)
        text = f"Box {box.name!r} is back at the state just after step {a.step}: memory, processes and disk."
        return ToolResult([TextPart(text)], {"box": box.name, "step": a.step})

    async def suspend(self, a: specs.Suspend) -> ToolResult:
        box = await self.box(a.box)
        await box.suspend()
        return ToolResult([TextPart(f"Box {box.name!r} is suspended: resume brings it back.")],
                          {"box": box.name, "state": "suspended"})  # fmt: skip

    async def resume(self, a: specs.Resume) -> ToolResult:
        box = await self.box(a.box)
        await box.resume()
        return ToolResult(
            [TextPart(f"Box {box.name!r} is running again.")], {"box": box.name, "state": "running"}
        )

    async def computer(self, a: specs.Computer) -> ToolResult:
        box = await self.box(a.box)
        desk = self.desktops.get(box.id)
        if desk is None:
            desk = self.desktops[box.id] = box.desktop
        screen = await desk.size()  # its VNC session's, which says so at its start
        display = self.display_size or screen

        def on_screen(x: int, y: int) -> tuple[int, int]:
            if not (x < display[0] and y < display[1]):
                raise ToolInputError(f"computer: ({x}, {y}) is off the {display[0]}x{display[1]} screen",
                                     tool="computer", problems=["coordinate"])  # fmt: skip
            return (min(round(x * screen[0] / display[0]), screen[0] - 1),
                    min(round(y * screen[1] / display[1]), screen[1] - 1))  # fmt: skip

        def point(required: bool = False) -> tuple[int | None, int | None]:
            if a.coordinate is not None:
                return on_screen(*a.coordinate)
            if a.x is not None and a.y is not None:
                return on_screen(a.x, a.y)
            if required:
                raise missing("coordinate", "coordinate [x, y] (or x and y)")
            return None, None

        def missing(name: str, what: str) -> ToolInputError:
            return ToolInputError(f"computer: {a.action} needs {what}", tool="computer",
                                  problems=[f"missing required argument {name!r}"])  # fmt: skip

        def needs_text() -> str:
            if not a.text:
                raise missing("text", "text")
            return a.text

        act = a.action
        done: str = act
        if act == "screenshot":
            pass  # the screenshot below is the answer
        elif act == "cursor_position":
            cx, cy = await desk.cursor()
            dx, dy = round(cx * display[0] / screen[0]), round(cy * display[1] / screen[1])
            return ToolResult([TextPart(f"The pointer is at ({dx}, {dy}).")], {"x": dx, "y": dy})
        elif act in ("left_click", "right_click", "middle_click", "double_click", "triple_click", "click"):
            button = {"right_click": "right", "middle_click": "middle"}.get(act, a.button or "left")
            button = {"wheel": "middle"}.get(button, button)
            count = {"double_click": 2, "triple_click": 3}.get(act, 1)
            x, y = point()
            await desk.click(x, y, button=button, count=count)  # type: ignore[arg-type]
            done = f"{act} at ({x}, {y})" if x is not None else act
        elif act in ("mouse_move", "move"):
            x, y = point(required=True)
            await desk.move(x, y)  # type: ignore[arg-type]
        elif act in ("left_click_drag", "drag"):
            if act == "drag":
                if not a.path:
                    raise missing("path", "path [{x, y}, ...]")
                if any(set(p) != {"x", "y"} for p in a.path):
                    raise ToolInputError("computer: each point of a drag's path is {x, y}", tool="computer",
                                         problems=["path"])  # fmt: skip
                points = [on_screen(p["x"], p["y"]) for p in a.path]
            else:
                if a.start_coordinate is None:
                    raise missing("start_coordinate", "start_coordinate")
                end = point(required=True)
                points = [on_screen(*a.start_coordinate), (int(end[0] or 0), int(end[1] or 0))]
            await desk.drag(*points)
        elif act == "left_mouse_down":
            await desk.mouse_down()
        elif act == "left_mouse_up":
            await desk.mouse_up()
        elif act == "scroll":
            x, y = point()
            if a.scroll_x is not None or a.scroll_y is not None:  # OpenAI's, in pixels
                dx, dy = scroll_notches(a.scroll_x or 0), scroll_notches(a.scroll_y or 0)
            else:
                amount = a.scroll_amount or 3
                direction = a.scroll_direction or "down"
                dx = {"left": -amount, "right": amount}.get(direction, 0)
                dy = {"up": -amount, "down": amount}.get(direction, 0)
            if dx or dy:
                await desk.scroll(x, y, dx=dx, dy=dy)
        elif act == "type":
            await desk.type(needs_text())
        elif act == "key":
            await desk.key(needs_text())
        elif act == "keypress":
            if not a.keys:
                raise missing("keys", "keys")
            await desk.key("+".join(a.keys))
        elif act == "hold_key":
            key = needs_text()
            await desk.key_down(key)
            try:
                await asyncio.sleep(a.duration or 1.0)
            finally:
                await desk.key_up(key)
        elif act == "wait":
            await asyncio.sleep(a.duration if a.duration is not None else 1.0)
        if act not in ("screenshot", "wait") and self.settle:
            await asyncio.sleep(self.settle)
        png = await desk.screenshot(scale=display if display != screen else None)
        text = (
            f"{done}; the screen now ({display[0]}x{display[1]}):"
            if act != "screenshot"
            else (f"The screen ({display[0]}x{display[1]}):")
        )
        return ToolResult([TextPart(text), ImagePart(base64.b64encode(png).decode(), "image/png")],
                          {"action": act, "width": display[0], "height": display[1]})  # fmt: skip

    async def close_desktops(self) -> None:
        """End the VNC sessions this toolkit holds with its boxes' desktops (a dropped
        toolkit's would stay open in the boxes)."""
        desktops, self.desktops = list(self.desktops.values()), {}
        for desktop in desktops:
            with contextlib.suppress(SandlotError, OSError):
                await desktop.disconnect()

    async def remove_box(self, a: specs.RemoveBox) -> ToolResult:
        box = await self.box(a.box)
        name = box.name
        desktop = self.desktops.pop(box.id, None)
        if desktop is not None:
            await desktop.disconnect()
        await box.remove(force=True)
        if self.default_box is not None and box.id == self.default_box.id:
            self.default_box = None
        return ToolResult([TextPart(f"Box {name!r} is removed.")], {"box": name, "state": "removed"})


# -- rendering ---------------------------------------------------------------------------------


async def own_snapshot(box: AsyncBox, key: str) -> str:
    """The id of the box's own snapshot named or numbered ``key``: a name may also be
    taken by other boxes' snapshots."""
    snaps = await box.snapshots()
    found = [s for s in snaps if key in (s.name, s.id)] or [s for s in snaps if s.id.startswith(key)]
    if len(found) != 1:
        have = ", ".join(repr(s.name or s.id) for s in snaps) or "none"
        why = "is ambiguous" if found else "does not exist"
        raise SnapshotNotFound(
            f"snapshot {key!r} of box {box.name!r} {why}; its snapshots: {have}", box=box.name
        )
    return found[0].id


# the tools whose call is one step of a recording box's timeline: those that change the box
STEPS = frozenset({"exec", "run_code", "write_file", "computer"})
STEP_TEXT = 500  # characters of each text argument a step shows (a file's content is cut)


def step_arguments(args: Args) -> dict[str, Any]:
    """A tool call's arguments as its step shows them: long texts cut."""
    out = {}
    for k, v in args.model_dump(exclude_none=True).items():
        if k == "box":
            continue
        long = isinstance(v, str) and len(v) > STEP_TEXT
        out[k] = v[:STEP_TEXT] + f"... ({len(v)} chars)" if long else v
    return out


def scroll_notches(pixels: int) -> int:
    """Wheel notches for a scroll of ``pixels`` (OpenAI's unit): about 100 a notch, as
    Chromium scrolls, and at least one for any scroll at all."""
    if not pixels:
        return 0
    return (1 if pixels > 0 else -1) * max(1, round(abs(pixels) / 100))


def summary(box: AsyncBox) -> dict[str, Any]:
    """A box as the tools show it."""
    info = box.info
    return {"name": box.name, "id": box.id, "state": box.state, "image": info.get("image"),
            "memory_mib": info.get("memory_mib"), "cpus": info.get("cpus"), "network": info.get("network"),
            "created": stamp(info.get("created_at"))}  # fmt: skip


def snapshot_json(snap: Any, box: str) -> dict[str, Any]:
    return {
        "id": snap.id,
        "name": snap.name,
        "box": box,
        "size": snap.size,
        "created": stamp(snap.created_at),
    }


def stamp(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else None


def entry_line(e: FileInfo) -> str:
    name = e.name + ("/" if e.is_dir else "")
    if e.is_symlink and e.link_target:
        name += f" -> {e.link_target}"
    return f"{e.type:7} {e.mode:04o} {e.size:>10}  {e.mtime:%Y-%m-%d %H:%M}  {name}"


def entry_json(e: FileInfo) -> dict[str, Any]:
    return {"name": e.name, "type": e.type, "size": e.size, "mode": f"{e.mode:04o}",
            "mtime": e.mtime.isoformat(), "link_target": e.link_target}  # fmt: skip


def clip_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}"


def flush(parts: list[Part], text: list[str]) -> None:
    """Move the text gathered so far into ``parts``, before an image (keeping their order)."""
    if text:
        parts.append(TextPart("\n".join(text)))
        text.clear()


def sniff_image(raw: bytes) -> str | None:
    for magic, mime in IMAGE_MAGIC:
        if raw.startswith(magic):
            return mime
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


# -- schemas -----------------------------------------------------------------------------------


def render(
    format: str,
    tools: Iterable[str] | None = None,
    *,
    default_image: str | None = None,
    default_box: str | None = None,
    limits: Limits | None = None,
) -> list[dict[str, Any]]:
    """The tools' definitions in ``format``: "openai" (Chat Completions function tools),
    "anthropic" (Messages API tools) or "mcp" (MCP ``Tool`` objects as JSON)."""
    if format not in FORMATS:
        raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    chosen = [specs.spec(n) for n in tools] if tools is not None else list(specs.TOOLS)
    lim = limits or Limits()
    out = []
    for t in chosen:
        schema = t.input_schema()
        props = schema["properties"]
        if "box" in props and t.name != "remove_box":
            props["box"]["description"] = (
                f"{specs.BOX_HELP.split('. ')[0]}. Leave it out for the default box, {default_box!r}."
                if default_box
                else specs.BOX_HELP.split(". ")[0] + ". Required: there is no default box here."
            )
            if not default_box:
                schema.setdefault("required", []).insert(0, "box")
        if t.name == "create_box":
            image = props["image"]
            if lim.images is not None:
                image["enum"] = list(lim.images)
            if default_image:
                image["description"] += f" The default image is {default_image!r}."
            else:
                image["description"] = (
                    image["description"].split(". ")[0] + ". Required: there is no default."
                )
                schema.setdefault("required", []).insert(0, "image")
            if lim.max_memory_mib is not None:
                props["memory_mib"]["maximum"] = lim.max_memory_mib
                props["memory_mib"]["default"] = min(props["memory_mib"]["default"], lim.max_memory_mib)
            if lim.max_cpus is not None:
                props["cpus"]["maximum"] = lim.max_cpus
            if lim.max_boxes is not None:
                t_desc = t.description + f" At most {lim.max_boxes} boxes may exist at once here."
            else:
                t_desc = t.description
        else:
            t_desc = t.description
        if lim.max_timeout is not None and "timeout" in props:
            props["timeout"]["maximum"] = lim.max_timeout
            props["timeout"]["default"] = min(props["timeout"]["default"], lim.max_timeout)
        if format == "openai":
            out.append({"type": "function", "function": {"name": t.name, "description": t_desc,
                                                         "parameters": schema}})  # fmt: skip
        elif format == "anthropic":
            out.append({"name": t.name, "description": t_desc, "input_schema": schema})
        else:
            annotations = {"title": t.title, "readOnlyHint": t.read_only, "destructiveHint": t.destructive,
                           "openWorldHint": False}  # fmt: skip
            out.append({"name": t.name, "title": t.title, "description": t_desc, "inputSchema": schema,
                        "annotations": annotations})  # fmt: skip
    return out
