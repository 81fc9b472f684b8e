"""``box.run_code``: a stateful code interpreter inside the box.

A code context is one interpreter process in the box (``guest/interpreter.py``,
copied in on first use and run with the image's ``python3``). Its variables live
in the box's memory, so they survive what the box's memory survives: a snapshot
and its rollback, each child of a fork (diverging from there), a suspend and a
resume by another process, an export and an import on another home. A reboot
ends them, as it ends every process.

The side where the box runs (this process for a local box, a server or a fleet
node for others: the contexts are backend operations, ``api/contract.py``)
reaches a context through the agent's relay to the context's Unix socket; one
relay per context, box and event loop carries every cell, so a warm cell costs
one round trip. Cells of one context run one after another.

>>> ex = await box.run_code("x = 41\\nx + 1")              # doctest: +SKIP
>>> ex.text, ex.execution_count
('42', 1)
>>> ex = await box.run_code("import matplotlib.pyplot as plt; plt.plot([1, 3, 2])")
>>> ex.results[-1].png[:8]                                  # base64 of a PNG
'iVBORw0K'
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import functools
import hashlib
import inspect
import json
import re
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from .. import records
from ..core.validate import check_env, check_user, guest_path
from ..errors import (
    CodeContextNotFound,
    CodeTimeout,
    ConnectionLost,
    GuestOSError,
    InterpreterError,
    InvalidArgument,
    InvalidState,
    ProtocolError,
    Unsupported,
)
from .bridge import RelayDuplex, open_relay
from .process import AsyncProcess, ExecResult

if TYPE_CHECKING:
    from .fs import FileInfo

ROOT = "/run/sandlot/code"  # a tmpfs the agent mounts: contexts end with the boot they started in
# The host keeps a bounded part of what a cell sends (``SANDLOT_CODE_OUTPUT_MIB`` of its
# output, the first bytes, as the interpreter in the box keeps its own first 8 MiB, and as
# much of its results), whatever the box's interpreter does: its code runs in that very
# process and may lift the box's own limit. A message longer than the bound is skipped; a cell's messages
# wait in a short queue, so a cell faster than its reader is slowed, never buffered.
CELL_QUEUE = 8  # messages of a cell read from its context and not yet taken
START_TIMEOUT = 300.0  # a Jupyter kernel importing IPython under emulation takes tens of seconds
CONNECT_TIMEOUT = 30.0
INTERRUPT_GRACE = 3.0  # how long a timed-out cell has to stop after its interrupt
CONTEXT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LANGUAGE = re.compile(r"^[a-z0-9][a-z0-9+#._-]{0,31}$")

MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/json": "json",
    "text/latex": "latex",
    # sandlot's interpreter's own, for E2B's result.chart and result.data
    "application/vnd.sandlot.chart+json": "chart",
    "application/vnd.sandlot.data+json": "data",
}
JSON_MIMES = ("application/json", "application/vnd.sandlot.chart+json", "application/vnd.sandlot.data+json")


@dataclass(frozen=True)
class Result:
    """One value a cell showed: the last expression's (``is_main_result``) or one it
    passed to ``display()``, or a figure. Each format it offers has its field (PNG
    and JPEG as base64 text); ``extra`` holds MIME types without a field. A matplotlib
    figure shown by sandlot's kernel comes with its ``chart``: its data read back from
    what it drew, as E2B's code interpreter gives it (``{"type": "line" | "scatter" |
    "bar" | "pie" | "box_and_whisker" | "superchart" | "unknown", "title", "elements",
    ...}``); a pandas DataFrame with its columns as ``data`` (``{column: [values]}``)."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    json: Any = None
    latex: str | None = None
    chart: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_bundle(cls, data: Mapping[str, Any], main: bool) -> Result:
        known: dict[str, Any] = {MIME_FIELDS[m]: v if m in JSON_MIMES else _text(v) for m, v in data.items()
                 if m in MIME_FIELDS}  # fmt: skip
        extra = {m: v for m, v in data.items() if m not in MIME_FIELDS}
        return cls(**known, is_main_result=main, extra=extra)

    def formats(self) -> list[str]:
        """The formats this result has, e.g. ``["text", "png"]``."""
        names = [f for f in MIME_FIELDS.values() if getattr(self, f) is not None]
        return names + list(self.extra)

    def to_bundle(self) -> dict[str, Any]:
        """The result as a MIME bundle, the form Jupyter uses."""
        out = {m: getattr(self, f) for m, f in MIME_FIELDS.items() if getattr(self, f) is not None}
        return {**out, **self.extra}

    def image(self) -> bytes | None:
        """The PNG or JPEG bytes, if the result is an image."""
        data = self.png or self.jpeg
        return base64.b64decode(data) if data else None


def _text(value: Any) -> str:
    if isinstance(value, list):  # Jupyter may split text into lines
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class ExecutionError:
    """The exception a cell raised: its type's ``name``, its ``value`` (message) and
    the formatted ``traceback``. ``KernelDied`` means the interpreter itself exited."""

    name: str
    value: str
    traceback: str


@dataclass
class Execution:
    """What a cell did: its results, its output, its error, its number in the context."""

    results: list[Result] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    error: ExecutionError | None = None
    execution_count: int | None = None

    @property
    def text(self) -> str | None:
        """The text of the main result (the last expression's value), if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": [dict(r.to_bundle(), is_main_result=r.is_main_result) for r in self.results],
            "stdout": self.stdout,
            "stderr": self.stderr,
            "error": None if self.error is None else vars(self.error).copy(),
            "execution_count": self.execution_count,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Execution:
        results = []
        for r in data.get("results") or []:
            bundle = {k: v for k, v in r.items() if k != "is_main_result"}
            results.append(Result.from_bundle(bundle, bool(r.get("is_main_result"))))
        error = data.get("error")
        return cls(
            results=results,
            stdout=str(data.get("stdout") or ""),
            stderr=str(data.get("stderr") or ""),
            error=ExecutionError(str(error["name"]), str(error["value"]), str(error["traceback"]))
            if error
            else None,
            execution_count=data.get("execution_count"),
        )


@dataclass(frozen=True)
class CodeContext:
    """An interpreter in the box: ``kernel`` is "builtin" (sandlot's own) or
    "jupyter:NAME" (the image's Jupyter kernel NAME)."""

    id: str
    language: str
    cwd: str
    kernel: str

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> CodeContext:
        return cls(str(info["id"]), str(info["language"]), str(info["cwd"]), str(info["kernel"]))


OutputCallback = Callable[[str], Any]
ResultCallback = Callable[[Result], Any]
ContextArg = CodeContext | str | None


class CodeFiles(Protocol):
    """What the interpreter needs of a box's files (``AsyncFiles``)."""

    async def read(self, path: str) -> bytes: ...

    async def write(self, path: str, data: bytes, *, mode: int | None = None) -> int: ...

    async def exists(self, path: str) -> bool: ...

    async def list(self, path: str) -> list[FileInfo]: ...

    async def mkdir(self, path: str, *, parents: bool = True) -> None: ...

    async def chmod(self, path: str, mode: int) -> None: ...

    async def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> None: ...


@dataclass(frozen=True)
class CodeBox:
    """What the interpreter needs of a box: its files and commands, where the box runs."""

    id: str
    files: CodeFiles
    spawn: Callable[..., Awaitable[AsyncProcess]]
    exec: Callable[..., Awaitable[ExecResult]]


def context_id(context: ContextArg, language: str) -> str:
    if context is None:
        return f"default-{check_language(language)}"
    cid = context.id if isinstance(context, CodeContext) else context
    if not isinstance(cid, str) or not CONTEXT_ID.match(cid):
        raise InvalidArgument(f"not a code context id: {cid!r}")
    return cid


def check_language(language: object) -> str:
    if not isinstance(language, str) or not LANGUAGE.match(language):
        raise InvalidArgument(f"language must be a name such as 'python' or 'bash', not {language!r}")
    return language


# the languages of sandlot's own kernels (guest/interpreter.py)
BUILTIN_LANGUAGES = ("python", "bash", "javascript", "typescript")


def check_kernel(kernel: object, language: str) -> str:
    """``None`` is sandlot's own kernel for Python, and for any other language the image's
    Jupyter kernel for it where the image has one, else sandlot's own (bash; JavaScript
    and TypeScript on the image's node); "builtin" is sandlot's own kernel, "jupyter" the
    image's Jupyter kernel for the language, "jupyter:NAME" its kernel NAME."""
    if kernel is None:
        return "builtin" if language == "python" else "auto"
    if kernel == "builtin":
        if language not in BUILTIN_LANGUAGES:
            raise InvalidArgument(
                f"sandlot's builtin kernels run {', '.join(BUILTIN_LANGUAGES)}, not {language}; "
                "use kernel='jupyter'"
            )
        return "builtin"
    if kernel == "jupyter":
        return "jupyter:"
    if isinstance(kernel, str) and kernel.startswith("jupyter:") and CONTEXT_ID.match(kernel[8:]):
        return kernel
    raise InvalidArgument(f"kernel must be None, 'builtin', 'jupyter' or 'jupyter:NAME', not {kernel!r}")


def takes_env(cid: str, facts: Mapping[str, Any], box: str) -> None:
    """Refuse a cell's ``env`` where its context (``facts``: its interpreter's info) would
    run the cell without it: an interpreter of an earlier sandlot, which ignores what it
    does not know (a context kept running in a box from before), or an image's Jupyter
    kernel of another language than Python."""
    if "env" not in (facts.get("features") or []):
        raise Unsupported(
            f"code context {cid!r} runs an interpreter of an earlier sandlot, which cannot set "
            "environment variables for one cell: restart the context (restart_code_context) "
            "or set them when it is created",
            box=box,
        )
    if facts.get("language") != "python" and "cell-env" not in (facts.get("features") or []):
        raise Unsupported(
            f"environment variables for one cell are set in sandlot's own kernels and in Jupyter kernels "
            f"of Python, R, bash and JavaScript; code context {cid!r} runs {facts.get('language')} in the "
            f"image's Jupyter kernel {str(facts.get('kernel', ''))[8:]}: give them to "
            "create_code_context(env=...)",
            box=box,
        )


@functools.cache
def _script() -> tuple[bytes, str]:
    data = resources.files("sandlot.guest").joinpath("interpreter.py").read_bytes()
    return data, f"{ROOT}/interpreter-{hashlib.sha256(data).hexdigest()[:12]}.py"


class KernelLink:
    """One connection to a context's interpreter: requests out, events back, routed
    to their cell by request id."""

    def __init__(self, duplex: RelayDuplex, box: str = "") -> None:
        self._duplex = duplex
        self._cells: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self._infos: list[asyncio.Future[dict[str, Any]]] = []
        self.facts: dict[str, Any] | None = None  # the interpreter's info, once asked for (known_facts)
        self.closed = False
        self.box = box
        self.max_line = records.bounds().code_output_bytes + (64 << 10)  # a whole cell's output, framed
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        buf = bytearray()
        skipping = 0  # bytes of an overlong message being skipped
        try:
            while chunk := await self._duplex.read():
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    if skipping:
                        self._skipped(skipping + end - start)
                        skipping = 0
                    else:
                        await self._route(json.loads(buf[start:end]))
                    start = end + 1
                del buf[:start]
                if len(buf) > self.max_line:
                    skipping += len(buf)
                    buf.clear()
        except (ValueError, ConnectionLost, GuestOSError, InvalidState):
            pass  # a broken link (or a box stopped under it) ends like a closed one: every waiter hears below
        finally:
            self.closed = True
            for q in self._cells.values():
                while True:  # every cell hears the end, a full queue too (its last message goes)
                    try:
                        q.put_nowait(None)
                        break
                    except asyncio.QueueFull:
                        q.get_nowait()
            for f in self._infos:
                if not f.done():
                    f.set_exception(ConnectionLost("the code context's connection closed"))

    def _skipped(self, size: int) -> None:
        """A message past the bound: dropped, counted, and said to the cells running."""
        records.TALLY.add("interpreter", "dropped_bytes", self.box, size)
        for q in self._cells.values():
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait({"ev": "dropped", "bytes": size})

    async def _route(self, event: dict[str, Any]) -> None:
        if event.get("ev") == "info":
            while self._infos:
                f = self._infos.pop(0)
                if not f.done():
                    f.set_result(event)
                    return
            return
        q = self._cells.get(str(event.get("id")))
        if q is not None:
            await q.put(event)

    async def send(self, message: dict[str, Any]) -> None:
        if self.closed:
            raise ConnectionLost("the code context's connection closed")
        await self._duplex.write((json.dumps(message) + "\n").encode())

    def cell(self, rid: str) -> asyncio.Queue[dict[str, Any] | None]:
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(CELL_QUEUE)
        self._cells[rid] = q
        return q

    def forget(self, rid: str) -> None:
        self._cells.pop(rid, None)

    async def info(self, timeout: float = CONNECT_TIMEOUT) -> dict[str, Any]:
        f: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._infos.append(f)
        await self.send({"op": "info"})
        async with asyncio.timeout(timeout):
            return await f

    async def known_facts(self) -> dict[str, Any]:
        """The interpreter's info (its language, kernel, features), asked once a link."""
        if self.facts is None:
            self.facts = await self.info()
        return self.facts

    async def closed_within(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._reader)
        return self.closed


# links by event loop (a link's tasks belong to one), then by (box id, context id)
_links: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], KernelLink]] = (
    weakref.WeakKeyDictionary()
)


class Interpreter:
    """The code contexts of one box, for one event loop."""

    def __init__(self, box: CodeBox) -> None:
        self.box = box
        self._links = _links.setdefault(asyncio.get_running_loop(), {})

    # ---- contexts --------------------------------------------------------------

    async def create(
        self,
        *,
        language: str = "python",
        cwd: str | None = None,
        kernel: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        id: str | None = None,
    ) -> CodeContext:
        language = check_language(language)
        if id is not None:
            id = context_id(id, language)
            try:
                await self._info(id)
            except CodeContextNotFound:
                pass
            else:
                raise InvalidArgument(f"a code context {id!r} exists in this box")
        options = {
            "kernel": check_kernel(kernel, language),
            "cwd": guest_path(cwd) if cwd is not None else None,
            "env": check_env(env),
            "user": check_user(user),
        }
        return await self._start(id or f"ctx-{uuid.uuid4().hex[:12]}", language, options)

    async def list(self) -> list[CodeContext]:
        try:
            entries = await self.box.files.list(ROOT)
        except FileNotFoundError:
            return []
        found = []
        for e in entries:
            if e.is_dir:
                # (a context still starting has no info yet)
                with contextlib.suppress(CodeContextNotFound, FileNotFoundError, ValueError, KeyError):
                    info = await self._info(e.name)
                    found.append((float(info.get("created") or 0), e.name, CodeContext.from_info(info)))
        return [ctx for _, _, ctx in sorted(found, key=lambda item: item[:2])]  # oldest first

    async def interrupt(self, context: ContextArg) -> None:
        cid = context_id(context, "python")
        link = await self._link(cid, start=False)
        await link.send({"op": "interrupt"})

    async def restart(self, context: ContextArg) -> CodeContext:
        cid = context_id(context, "python")
        info = await self._info(cid)
        await self._stop(cid)
        return await self._start(cid, str(info["language"]), info.get("options") or {})

    async def remove(self, context: ContextArg) -> None:
        cid = context_id(context, "python")
        await self._info(cid)
        await self._stop(cid)
        await self.box.files.remove(f"{ROOT}/{cid}", recursive=True, missing_ok=True)

    async def _info(self, cid: str) -> dict[str, Any]:
        try:
            info = json.loads(await self.box.files.read(f"{ROOT}/{cid}/info.json"))
        except FileNotFoundError:
            raise CodeContextNotFound(
                f"no code context {cid!r} in box {self.box.id} (removed, or the box rebooted since)",
                box=self.box.id,
            ) from None
        if not isinstance(info, dict):
            raise ProtocolError(f"code context {cid!r} has a malformed info.json")
        return info

    async def _stop(self, cid: str) -> None:
        """End the context's interpreter: asked to shut down, else killed."""
        try:
            link = await self._link(cid, start=False)
        except (CodeContextNotFound, GuestOSError):
            return  # not running: nothing to stop
        await link.send({"op": "shutdown"})
        if not await link.closed_within(10.0):
            with contextlib.suppress(ConnectionLost):
                await link.send({"op": "kill"})
            await link.closed_within(5.0)
        self._links.pop((self.box.id, cid), None)

    async def _start(self, cid: str, language: str, options: Mapping[str, Any]) -> CodeContext:
        script = await self._install()
        # the options go into the context's info.json, so a restart starts it the same way
        kernel = str(options.get("kernel") or "builtin")
        argv = ["python3", script, "start", "--root", ROOT, "--id", cid, "--language", language,
                "--kernel", kernel, "--options", json.dumps(options)]  # fmt: skip
        exec_options: dict[str, Any] = {"timeout": START_TIMEOUT}
        for name in ("cwd", "env", "user"):
            if options.get(name):
                exec_options[name] = options[name]
        try:
            res = await self.box.exec(*argv, **exec_options)
        except FileNotFoundError:
            res = None
        if res is None or res.exit_code == 127:
            raise InterpreterError(
                f"box {self.box.id} has no python3 on its PATH: the code interpreter needs an image with "
                "Python 3 (any version from 3.8; no packages needed)",
                box=self.box.id,
            )
        if res.exit_code != 0:
            why = res.stderr.strip().splitlines()[-1:] or [f"exit code {res.exit_code}"]
            raise InterpreterError(f"code context {cid!r} did not start: {why[0]}", box=self.box.id)
        try:
            return CodeContext.from_info(json.loads(res.stdout.strip().splitlines()[-1]))
        except (ValueError, KeyError, IndexError):
            raise ProtocolError(f"code context {cid!r} started but reported {res.stdout[-200:]!r}") from None

    async def _install(self) -> str:
        data, path = _script()
        files = self.box.files
        if not await files.exists(path):
            await files.mkdir(ROOT, parents=True)
            await files.chmod(ROOT, 0o1777)  # each context makes its own 0700 directory here
            await files.write(path, data, mode=0o644)
        return path

    async def _link(self, cid: str, *, start: bool, language: str = "python") -> KernelLink:
        key = (self.box.id, cid)
        link = self._links.get(key)
        if link is not None and not link.closed:
            return link
        sock = f"{ROOT}/{cid}/sock"
        try:
            duplex = await open_relay(self.box.spawn, sock, CONNECT_TIMEOUT)
        except GuestOSError as e:
            if e.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                raise
            # not running: the default context starts on first use, a context whose
            # interpreter died starts again as it was made
            try:
                info = await self._info(cid)
            except CodeContextNotFound:
                if not (start and cid.startswith("default-")):
                    raise
                await self._start(cid, language, {"kernel": check_kernel(None, language)})
            else:
                if not start:
                    raise CodeContextNotFound(f"code context {cid!r} is not running", box=self.box.id) from e
                await self._start(cid, str(info["language"]), info.get("options") or {})
            duplex = await open_relay(self.box.spawn, sock, CONNECT_TIMEOUT)
        link = KernelLink(duplex, self.box.id)
        self._links[key] = link
        return link

    # ---- cells -----------------------------------------------------------------

    async def run(
        self,
        code: str,
        *,
        language: str = "python",
        context: ContextArg = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        if not isinstance(code, str):
            raise InvalidArgument(f"code must be a str, not {type(code).__name__}")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
        cid = context_id(context, language)
        given = check_env(env)
        link = await self._link(cid, start=True, language=check_language(language))
        if given:
            takes_env(cid, await link.known_facts(), self.box.id)
        rid = uuid.uuid4().hex
        events = link.cell(rid)
        execution = Execution()
        callbacks = Callbacks(on_stdout, on_stderr, on_result, Budget(self.box.id))
        try:
            await link.send({"op": "run", "id": rid, "code": code, **({"env": given} if given else {})})
            try:
                async with asyncio.timeout(timeout):
                    finished = await _collect(events, execution, callbacks)
            except TimeoutError:
                await self._stop_cell(cid, rid, link, events, execution, callbacks, timeout)
            if not finished:
                await self._lost(cid, execution)
        finally:
            link.forget(rid)
        return execution

    async def _stop_cell(
        self,
        cid: str,
        rid: str,
        link: KernelLink,
        events: asyncio.Queue[dict[str, Any] | None],
        execution: Execution,
        callbacks: Callbacks,
        timeout: float | None,
    ) -> NoReturn:
        """A cell past its timeout: interrupt it; if it will not stop, end its interpreter.
        The interrupt names the cell: one that has not started yet (queued behind another
        cell of the context) ends at once as interrupted, and the one running goes on."""
        with contextlib.suppress(ConnectionLost):
            await link.send({"op": "interrupt", "id": rid})
        stopped = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(INTERRUPT_GRACE):
                stopped = await _collect(events, execution, callbacks)
        if stopped:
            raise CodeTimeout(
                f"the cell ran past its timeout of {timeout}s and was interrupted; "
                "the context keeps its state",
                execution,
                box=self.box.id,
            )
        with contextlib.suppress(ConnectionLost):
            await link.send({"op": "kill"})
        await link.closed_within(INTERRUPT_GRACE)
        self._links.pop((self.box.id, cid), None)
        raise CodeTimeout(
            f"the cell ran past its timeout of {timeout}s and did not stop when interrupted; its "
            "interpreter was ended and its state is lost (the next cell starts a new one)",
            execution,
            state_lost=True,
            box=self.box.id,
        )

    async def _lost(self, cid: str, execution: Execution) -> None:
        """The link closed before the cell finished: the interpreter died, or the link did."""
        self._links.pop((self.box.id, cid), None)
        with contextlib.suppress(Exception):
            link = await self._link(cid, start=False)
            await link.info(5.0)
            raise ConnectionLost(
                f"the connection to code context {cid!r} broke during the cell (the box was rolled back, "
                "stopped or restored?); the interpreter still runs",
                box=self.box.id,
            )
        execution.error = ExecutionError(
            "KernelDied",
            f"the interpreter of code context {cid!r} exited during this cell (os._exit, a crash or the "
            "OOM killer); its variables are lost and the next cell starts a new interpreter",
            "",
        )


@dataclass
class Budget:
    """What the host keeps of one cell (``SANDLOT_CODE_OUTPUT_MIB``): its first bytes of
    output, and as many bytes of its results while they fit; the rest is dropped, counted,
    and said at the end of its stderr (a cell's error is always kept)."""

    box: str = ""
    room: int = field(default_factory=lambda: records.bounds().code_output_bytes)
    results_room: int = field(default_factory=lambda: records.bounds().code_output_bytes)
    dropped: int = 0
    cut: bool = False  # the output was cut: none of what follows is kept (no holes in it)

    def take(self, size: int) -> bool:
        """Room for ``size`` bytes of output."""
        if size <= self.room and not self.cut:
            self.room -= size
            return True
        self.cut = True
        self.dropped += size
        return False

    def take_result(self, size: int) -> bool:
        """Room for a result of ``size`` bytes."""
        if size <= self.results_room:
            self.results_room -= size
            return True
        self.dropped += size
        return False

    def note(self) -> str:
        records.TALLY.add("interpreter", "dropped_bytes", self.box, self.dropped)
        mib = records.bounds().code_output_bytes / records.MIB
        return (f"\n[sandlot: output truncated: the host kept this cell's first {mib:g} MiB of output, and "
                f"of results (SANDLOT_CODE_OUTPUT_MIB), and dropped {self.dropped:,} bytes]\n")  # fmt: skip


@dataclass(frozen=True)
class Callbacks:
    on_stdout: OutputCallback | None
    on_stderr: OutputCallback | None
    on_result: ResultCallback | None
    budget: Budget = field(default_factory=Budget)

    async def call(self, fn: Callable[[Any], Any] | None, value: Any) -> None:
        if fn is not None:
            got = fn(value)
            if inspect.isawaitable(got):
                await got


async def _collect(
    events: asyncio.Queue[dict[str, Any] | None], execution: Execution, callbacks: Callbacks
) -> bool:
    """Fold a cell's events into ``execution`` until it is done (True) or its link
    closed first (False)."""
    budget = callbacks.budget
    out, err = [execution.stdout], [execution.stderr]  # joined once: a cell sends many parts
    try:
        return await _fold(events, execution, callbacks, budget, out, err)
    finally:
        execution.stdout, execution.stderr = "".join(out), "".join(err)


async def _fold(
    events: asyncio.Queue[dict[str, Any] | None],
    execution: Execution,
    callbacks: Callbacks,
    budget: Budget,
    out: list[str],
    err: list[str],
) -> bool:
    while True:
        event = await events.get()
        if event is None:
            return False
        kind = event.get("ev")
        if kind == "stream":
            text = str(event.get("text", ""))
            if not budget.take(len(text)):
                continue
            if event.get("name") == "stderr":
                err.append(text)
                await callbacks.call(callbacks.on_stderr, text)
            else:
                out.append(text)
                await callbacks.call(callbacks.on_stdout, text)
        elif kind == "result":
            if not budget.take_result(len(json.dumps(event.get("data") or {}))):
                continue
            result = Result.from_bundle(event.get("data") or {}, bool(event.get("main")))
            execution.results.append(result)
            await callbacks.call(callbacks.on_result, result)
        elif kind == "dropped":
            budget.cut, budget.dropped = True, budget.dropped + int(event.get("bytes") or 0)
        elif kind == "error":
            execution.error = ExecutionError(
                str(event.get("name", "Error")), str(event.get("value", "")), str(event.get("traceback", ""))
            )
        elif kind == "done":
            execution.execution_count = int(event.get("count") or 0) or None
            if budget.dropped:
                note = budget.note()
                err.append(note)
                await callbacks.call(callbacks.on_stderr, note)
                budget.dropped = 0
            return True


def context_json(ctx: CodeContext) -> dict[str, Any]:
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd, "kernel": ctx.kernel}


def result_json(result: Result) -> dict[str, Any]:
    return dict(result.to_bundle(), is_main_result=result.is_main_result)


async def code_event(event: dict[str, Any], callbacks: Callbacks) -> Execution | None:
    """One event of a cell run by a host elsewhere (``api/host.py``'s ``code_messages``):
    passed to its callback; the execution at the end (an error at the end is raised, a
    CodeTimeout with its execution so far)."""
    from ..errors import from_dict

    kind = event.get("type")
    if kind == "stdout":
        await callbacks.call(callbacks.on_stdout, str(event.get("text", "")))
    elif kind == "stderr":
        await callbacks.call(callbacks.on_stderr, str(event.get("text", "")))
    elif kind == "result":
        bundle = dict(event.get("result") or {})
        main = bool(bundle.pop("is_main_result", False))
        await callbacks.call(callbacks.on_result, Result.from_bundle(bundle, main))
    elif kind == "execution":
        return Execution.from_dict(event.get("execution") or {})
    elif kind == "error":
        err = from_dict(dict(event.get("error") or {}))
        if isinstance(err, CodeTimeout) and isinstance(err.execution, dict):
            err.execution = Execution.from_dict(err.execution)
        raise err
    return None
