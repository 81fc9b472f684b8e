"""Port 49999 of an E2B sandbox: the code interpreter's ``/execute`` and ``/contexts``,
answered by sandlot's own interpreter (``box.run_code`` and its code contexts).

``/execute`` streams one JSON object a line, as ``e2b-code-interpreter`` parses
them: ``stdout``/``stderr`` (``text``, ``timestamp``), ``result`` (the result's
formats as fields: ``text``, ``html``, ``png``... and ``is_main_result``), ``error``
(``name``, ``value``, ``traceback``), then ``number_of_executions``. So rich
results, languages and interpreter state kept through snapshot, fork and rollback
come with it. A client that leaves mid-cell interrupts the cell. The answer's head goes
at once, before the default context is set up (its first cell starts its kernel): a
sandbox killed meanwhile, or mid-cell, breaks the stream off, as E2B's does when its
sandbox goes, and the SDK then finds the sandbox gone (``is_running``) and says it was
killed.

Cells run where E2B's run: in the home of the user its other calls run as (``user``
where the image has it: ``sandlot serve --e2b-user``), as the box's own user (root in
most images, as E2B's Jupyter server runs as root), the default context included,
unless a template's cells started it already.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ... import records
from ...api.box import AsyncBox
from ...api.code import CodeContext, Execution, Result, context_id
from ...core.validate import check_env
from ...errors import CodeContextNotFound, CodeTimeout, InvalidArgument, SandlotError

BODY_LIMIT = 8 << 20  # bytes of one /execute or /contexts request
QUEUED_LIMIT = 16 << 20  # bytes of a cell's output waiting for a slow client; more is dropped, saying so
LANGUAGES = {"python": "python", "py": "python", "javascript": "javascript", "js": "javascript",
             "typescript": "typescript", "ts": "typescript", "r": "r", "java": "java",
             "bash": "bash"}  # fmt: skip


DEFAULT_LANGUAGES = ("python", "javascript")  # the default contexts E2B's sandboxes list


RunsAs = Callable[[AsyncBox, Request], Awaitable[tuple[str | None, str]]]
READY_KEPT = 4096  # boxes whose default contexts are known to be set up, at most


class Interpreter:
    def __init__(self, box_of: Callable[[Request], Awaitable[AsyncBox]], runs_as: RunsAs) -> None:
        self.box_of = box_of
        self.runs_as = runs_as  # who a call runs as, and that user's home: where cells start
        self.ready: dict[tuple[str, str], None] = {}  # (box, context): oldest first
        self.setting_up: dict[str, asyncio.Lock] = {}

    async def serve(self, path: str, request: Request) -> Response:
        box = await self.box_of(request)
        method = request.method
        if path == "/health":
            return Response(status_code=204)
        if path == "/execute" and method == "POST":
            return await self.execute(box, await _json(request), request)
        if path == "/contexts" and method == "POST":
            body = await _json(request)
            language = _language(body.get("language"))
            _, home = await self.runs_as(box, request)
            ctx = await box.create_code_context(language=language, cwd=_str(body, "cwd") or home)
            return JSONResponse(_context(ctx))
        if path == "/contexts" and method == "GET":
            running = {c.id: _context(c) for c in await box.list_code_contexts()}  # oldest first
            # E2B's sandboxes have a default context of Python and one of JavaScript from
            # their start, listed first; sandlot starts each on its first cell, and lists it
            # before, in the home of the user cells start in
            _, home = await self.runs_as(box, request)
            defaults = []
            for language in DEFAULT_LANGUAGES:
                cid = context_id(None, language)
                defaults.append(running.pop(cid, {"id": cid, "language": language, "cwd": home}))
            return JSONResponse([*defaults, *running.values()])
        if path.startswith("/contexts/"):
            rest = path[len("/contexts/") :]
            named, _, action = rest.partition("/")
            if method == "DELETE" and not action:
                await box.remove_code_context(named)
                return Response(status_code=204)
            if method == "POST" and action == "restart":
                await box.restart_code_context(named)
                return Response(status_code=204)
            if method == "POST" and action == "interrupt":
                await box.interrupt_code_context(named)
                return Response(status_code=204)
        return JSONResponse({"code": 404, "message": f"no route {method} {path}"}, status_code=404)

    async def default_context(self, box: AsyncBox, request: Request, language: str) -> None:
        """Set the box's default context for ``language`` up as E2B's runs, in the call's
        user's home, before its first cell (once a box: one found running, from a
        template's cells or an earlier call, is left as it is)."""
        cid = context_id(None, language)
        if (box.id, cid) in self.ready:
            return
        try:
            async with self.setting_up.setdefault(box.id, asyncio.Lock()):
                if (box.id, cid) not in self.ready:
                    if all(c.id != cid for c in await box.list_code_contexts()):
                        _, home = await self.runs_as(box, request)
                        await box.create_code_context(language=language, cwd=home, id=cid)
                    self.ready[box.id, cid] = None
                    while len(self.ready) > READY_KEPT:
                        self.ready.pop(next(iter(self.ready)))
        finally:  # a set-up that failed leaves no lock behind (its box's next cell tries again)
            self.setting_up.pop(box.id, None)

    async def execute(self, box: AsyncBox, body: dict[str, Any], request: Request) -> Response:
        code = body.get("code")
        if not isinstance(code, str):
            raise InvalidArgument("code is a string")
        context = _str(body, "context_id")
        language = _language(body.get("language")) if body.get("language") else "python"
        env = check_env(body.get("env_vars"), "env_vars") or None  # for this cell alone, as E2B's sets them
        lines: asyncio.Queue[bytes | None] = asyncio.Queue()
        # a client that reads slower than the cell prints; a sandbox gone mid-cell
        backlog = {"bytes": 0, "dropping": False, "gone": False}

        def put(kind: str, **fields: Any) -> None:
            line = json.dumps({"type": kind, **fields}).encode() + b"\n"
            if kind in ("stdout", "stderr") and backlog["bytes"] + len(line) > QUEUED_LIMIT:
                records.TALLY.add("interpreter", "dropped_bytes", box.id, len(line))
                if not backlog["dropping"]:  # said once; output flows again once half drained
                    backlog["dropping"] = True
                    note = (
                        f"[sandlot: output dropped: over {QUEUED_LIMIT >> 20} MiB waiting for the client]\n"
                    )
                    lines.put_nowait(
                        json.dumps({"type": "stderr", "text": note, "timestamp": _now()}).encode() + b"\n"
                    )
                return
            backlog["bytes"] += len(line)
            lines.put_nowait(line)

        def on_result(result: Result) -> None:
            put("result", **result_fields(result))

        async def cell() -> None:
            try:
                if not context:
                    await self.default_context(box, request, language)
                execution: Execution = await box.run_code(
                    code, language=language, context=context, env=env,
                    on_stdout=lambda text: put("stdout", text=text, timestamp=_now()),
                    on_stderr=lambda text: put("stderr", text=text, timestamp=_now()), on_result=on_result,
                )  # fmt: skip
                died = execution.error is not None and execution.error.name == "KernelDied"
                if died and await _gone(box):  # its interpreter ended with its sandbox
                    backlog["gone"] = True
                else:
                    _ended(put, execution)
            except CodeTimeout as e:
                partial = getattr(e, "execution", None)
                put("error", name="TimeoutError", value=str(e), traceback="")
                if isinstance(partial, Execution) and partial.execution_count is not None:
                    put("number_of_executions", execution_count=partial.execution_count)
            except CodeContextNotFound as e:
                put("error", name="ContextNotFound", value=str(e), traceback="")
            except SandlotError as e:
                if await _gone(box):
                    backlog["gone"] = True
                else:
                    put("error", name=type(e).__name__, value=str(e), traceback="")
            finally:
                lines.put_nowait(None)

        task = asyncio.ensure_future(cell())

        async def stream() -> AsyncIterator[bytes]:
            try:
                while (line := await lines.get()) is not None:
                    backlog["bytes"] = max(0, backlog["bytes"] - len(line))
                    if backlog["dropping"] and backlog["bytes"] < QUEUED_LIMIT // 2:
                        backlog["dropping"] = False
                    yield line
                if backlog["gone"]:
                    raise SandboxGone(f"sandbox {box.id} ended mid-cell")
            finally:
                if not task.done():  # the client left mid-cell: stop the cell
                    task.cancel()
                    with contextlib.suppress(SandlotError, asyncio.CancelledError):
                        await box.interrupt_code_context(context or context_id(None, language))

        return StreamingResponse(stream(), media_type="application/x-ndjson")


class SandboxGone(Exception):
    """Raised in a cell's stream to break its answer off (uvicorn then closes the
    connection mid-body); not a fault of the server, so not logged as one."""


class _NotLoggedGone(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # (anyio's task group)
            exc = exc.exceptions[0]
        return not isinstance(exc, SandboxGone)


logging.getLogger("uvicorn.error").addFilter(_NotLoggedGone())


async def _gone(box: AsyncBox) -> bool:
    """Whether a cell's sandbox is no longer running (removed, killed, stopped)."""
    try:
        return await box.refresh() != "running"
    except SandlotError:
        return True


def _ended(put: Callable[..., None], execution: Execution) -> None:
    if execution.error is not None:
        e = execution.error
        put("error", name=e.name, value=e.value, traceback=e.traceback)
    if execution.execution_count is not None:
        put("number_of_executions", execution_count=execution.execution_count)


def result_fields(result: Result) -> dict[str, Any]:
    """A result's fields as the SDK's ``Result(**fields)`` takes them. A text in quotes
    loses them, as E2B's interpreter gives it (a string's value ``'bar'`` is ``bar``:
    code written for E2B compares ``execution.text`` with the bare string)."""
    fields: dict[str, Any] = {"is_main_result": result.is_main_result}
    for name in ("text", "html", "markdown", "svg", "png", "jpeg", "latex", "json", "chart", "data"):
        value = getattr(result, name)
        if value is not None:
            fields[name] = value
    text = fields.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        fields["text"] = text[1:-1]
    extra = dict(result.extra)
    if "application/pdf" in extra:
        fields["pdf"] = extra.pop("application/pdf")
    if "application/javascript" in extra:
        fields["javascript"] = extra.pop("application/javascript")
    if extra:
        fields["extra"] = extra
    return fields


def _context(ctx: CodeContext) -> dict[str, Any]:
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}


def _language(value: Any) -> str:
    if value is None:
        return "python"
    if not isinstance(value, str) or value.lower() not in LANGUAGES:
        raise InvalidArgument(f"language {value!r} is not one this interpreter runs")
    return LANGUAGES[value.lower()]


def _str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{name} is a string")
    return value or None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z"


async def _json(request: Request) -> dict[str, Any]:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > BODY_LIMIT:
            raise InvalidArgument(f"the body is over {BODY_LIMIT} bytes")
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise InvalidArgument(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the body is a JSON object")
    return body
