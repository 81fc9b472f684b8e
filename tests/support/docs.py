"""The README's and docs' code blocks, as tests: read, checked and run.

A page's fenced ``python``, ``console`` and ``sh`` blocks run in order, as a reader
would type them: the Python ones in one namespace per page (top-level ``await`` runs
on the page's one event loop, as in an asyncio REPL), each ``$ command`` of a console
block (each line of a ``sh`` one) in bash, its shown output checked. A block
may be preceded by markers, HTML comments the rendered page does not show:

    <!-- docs-test: skip WHY -->       not run (it needs what no test has: say what)
    <!-- docs-test: setup CODE -->     CODE (Python, ``await`` allowed; or shell before a
                                       console block) runs first, unseen: a box the
                                       fragment uses
    <!-- docs-test: server -->         runs against a real ``sandlot serve`` on
                                       127.0.0.1: its URL and key replace the
                                       example's (``http://HOST:PORT``, ``sk-sl-...``),
                                       and are in $SANDLOT_URL/$SANDLOT_API_KEY
    <!-- docs-test: any-output -->     the output shown is an example (ids, times)
    <!-- docs-test: signature NAME --> a listing of NAME's parameters (``sandlot.Box(...)``):
                                       never run; its parameters must be NAME's

Every block, run or not, is also checked without a VM: Python compiles and the
``sandlot`` names it uses exist; each ``sandlot ...`` command line parses with the
real command line's parser (commands, options and their arguments).

``python -m tests.support.docs PAGE`` runs a page (the VM tier's test_docs.py calls
it with a fresh home) and prints one JSON line per block.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import faulthandler
import functools
import gc
import importlib
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*docs-test:\s*([\w-]+)(.*?)-->", re.S)
FENCE = re.compile(r"^```(\S*)\s*$")
LANGS = ("python", "console", "sh", "bash", "shell")
EXAMPLE_URL = re.compile(r"https?://[\w.-]+:\d+(?![\w.:])")  # http://10.0.0.5:7070, and .../mcp
EXAMPLE_KEY = re.compile(r"\bsk-sl-[\w.-]*")  # sk-sl-... or a real-looking one
TIMEOUT = 600.0
BLOCK_DEADLINE = float(os.environ.get("SANDLOT_DOCS_BLOCK_DEADLINE", 900))  # under test_docs.py's 1400 s


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[tuple[str, list[str]]]:
        """A console block's commands (a ``$ `` line, with ``\\`` continuations), each
        with the output lines shown under it."""
        out: list[tuple[str, list[str]]] = []
        lines = self.code.splitlines()
        if self.lang != "console":  # a script: every line is a command, nothing shown
            lines = [f"$ {line}" for line in lines if line.strip() and not line.lstrip().startswith("#")]
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if not line.startswith("$ "):
                if out:
                    out[-1][1].append(line)
                continue
            cmd = line[2:]
            while cmd.endswith("\\") and i < len(lines):
                cmd = cmd[:-1] + " " + lines[i].removeprefix("$ ").strip()
                i += 1
            out.append((cmd, []))
        return out


def blocks(page: Path) -> list[Block]:
    """The page's python and console blocks, with the markers just above each."""
    text = page.read_text()
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in LANGS:
            continue
        # the markers: comments that end right above the fence (blank lines between allowed)
        above = "\n".join(lines[:start]).rstrip()
        marks: dict[str, str] = {}
        while above.endswith("-->"):
            begin = above.rfind("<!--")
            mark = MARK.fullmatch(above[begin:])
            if not mark:
                break
            marks[mark.group(1)] = mark.group(2).strip()
            above = above[:begin].rstrip()
        found.append(Block(page, start + 1, lang, "\n".join(body) + "\n", marks))
    return found


# -- checks without a VM ---------------------------------------------------------------


def python(source: str, where: str) -> Any:
    """Python code as a reader's session compiles it: top-level ``await`` allowed."""
    return compile(source, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def compiled(block: Block) -> Any:
    return python(block.code, block.where)


def setup_problems(block: Block) -> list[str]:
    """A ``setup`` marker's code that would not even start: Python that does not
    compile, shell that bash cannot parse."""
    code = block.marks.get("setup")
    if code is None:
        return []
    if block.lang == "python":
        try:
            python(code, f"{block.where} (setup)")
        except SyntaxError as exc:
            return [f"setup: {exc}"]
        return []
    r = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True, timeout=30)
    return [f"setup: {r.stderr.strip()}"] if r.returncode else []


def python_names(block: Block) -> list[str]:
    """Problems with the ``sandlot`` names a Python block uses: modules, functions and
    classes it imports or reaches as ``sandlot.X`` (and ``fleet.X`` after ``from sandlot
    import fleet``), and keyword arguments they do not take."""
    tree = ast.parse(block.code)
    bound: dict[str, Any] = {}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "sandlot":
                    try:
                        bound[alias.asname or alias.name.split(".")[0]] = importlib.import_module(
                            alias.name if alias.asname else "sandlot"
                        )
                    except ImportError as exc:
                        problems.append(f"import {alias.name}: {exc}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sandlot":
            module = importlib.import_module(node.module or "sandlot")
            for alias in node.names:
                try:
                    value = getattr(module, alias.name)
                except AttributeError:
                    try:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        problems.append(f"from {node.module} import {alias.name}: no such name")
                        continue
                bound[alias.asname or alias.name] = value
    if "sandlot" not in bound and re.search(r"\bsandlot\.", block.code):
        bound["sandlot"] = importlib.import_module("sandlot")  # a fragment of a page that imported it

    def resolve(node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            if base is None or not inspect.ismodule(base):
                return None
            try:
                return getattr(base, node.attr)
            except AttributeError:
                with contextlib.suppress(ImportError):
                    return importlib.import_module(f"{base.__name__}.{node.attr}")
                problems.append(f"{ast.unparse(node)}: {base.__name__} has no {node.attr!r}")
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            resolve(node)
        if isinstance(node, ast.Call):
            target = resolve(node.func)
            if target is None or not callable(target):
                continue
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                if kw.arg is not None and kw.arg not in params:
                    problems.append(f"{ast.unparse(node.func)}(): no keyword argument {kw.arg!r}")
    return sorted(set(problems))


@functools.cache  # the whole command tree, built once per process
def _cli() -> Any:
    import typer

    cli = importlib.import_module("sandlot.cli")
    for name in cli.MODULES:
        importlib.import_module(f"sandlot.cli.{name}")
    common = importlib.import_module("sandlot.cli.common")
    return typer.main.get_command(common.app)


def command_lines(cmd: str) -> Iterator[list[str]]:
    """The ``sandlot ...`` commands of a shell line (pipes, ``;``, ``&&`` split it;
    redirections are not arguments)."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    words: list[str] = []
    redirected = False  # the word after > or < is a file, not an argument
    for token in [*lex, ";"]:
        if token and set(token) <= set("<>"):
            redirected = True
        elif token and set(token) <= set(";&|"):
            if words and words[0] == "sandlot":
                yield words[1:]
            words, redirected = [], False
        elif redirected:
            redirected = False
        else:
            words.append(token)


def signature_problems(block: Block) -> list[str]:
    """A documented signature against the real one: the same positional parameters in
    the same order, the same keyword-only ones."""
    target: Any = importlib.import_module("sandlot")
    for part in block.marks["signature"].split(".")[1:]:
        target = getattr(target, part)
    text = block.code.strip()
    listed = text[text.index("(") + 1 : text.rindex(")")]
    tree = ast.parse(f"def documented({listed}): pass")
    args = tree.body[0].args  # type: ignore[attr-defined]
    keywords = {a.arg for a in args.kwonlyargs} | ({"**" + args.kwarg.arg} if args.kwarg else set())
    documented = ([a.arg for a in [*args.posonlyargs, *args.args]], keywords)
    params = inspect.signature(target).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    taken |= {"**" + p.name for p in params if p.kind is p.VAR_KEYWORD}
    real = ([n for n in positional if n != "self"], taken)
    if documented != real:
        extra = sorted(documented[1] - real[1])
        missing = sorted(real[1] - documented[1])
        return [f"{block.marks['signature']}: positional {documented[0]} (real {real[0]}); "
                f"documented but not taken {extra}; taken but not documented {missing}"]  # fmt: skip
    return []


def parse_cli(argv: list[str]) -> None:
    """Parse ``sandlot ARGV`` as the command line would, down to its command, running
    nothing: a UsageError (typer's click) for an unknown command or option, a missing
    argument, a bad value."""
    command: Any = _cli()
    ctx: Any = None
    name, args = "sandlot", list(argv)
    while True:
        ctx = command.make_context(name, list(args), parent=ctx)
        rest = [*ctx._protected_args, *ctx.args]  # a group's: its subcommand and what follows
        if not hasattr(command, "resolve_command") or not rest:
            return
        name, command, args = command.resolve_command(ctx, rest)


def cli_problems(block: Block) -> list[str]:
    """Each ``sandlot`` command of a console block, parsed by the real command line."""
    from typer._click.exceptions import UsageError

    problems = []
    for cmd, shown in block.commands():
        # a line shown to exit 2 is an example of a usage error: it must be one
        expect_error = any(line.strip() == "exit 2" for line in shown)
        for args in command_lines(cmd):
            if "--help" in args or "-h" in args:
                continue
            try:
                parse_cli(args)
            except UsageError as exc:
                if not expect_error:
                    problems.append(f"`{cmd}`: {exc.format_message()}")
            else:
                if expect_error:
                    problems.append(f"`{cmd}`: shown as a usage error (exit 2), yet it parses")
    return problems


# -- running a page --------------------------------------------------------------------


def served(block: Block, code: str) -> str:
    """A ``server`` block's code with the real server's URL and key in place of the
    example's (``http://10.0.0.5:7070``, ``sk-sl-...``)."""
    if "server" not in block.marks:
        return code
    code = EXAMPLE_URL.sub(lambda _: os.environ["SANDLOT_URL"].rstrip("/"), code)
    return EXAMPLE_KEY.sub(lambda _: os.environ.get("SANDLOT_API_KEY", ""), code)


def _python(block: Block, namespace: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    """Run a Python block (its ``setup`` first) in the page's namespace. Top-level
    ``await`` (in the block or its setup) runs on the page's one event loop, as in an
    asyncio REPL, so an ``AsyncBox`` made by one block serves the next."""
    parts = [(block.marks["setup"], f"{block.where} (setup)")] if "setup" in block.marks else []
    for source, where in [*parts, (served(block, block.code), block.where)]:
        obj = python(source, where)
        if obj.co_flags & inspect.CO_COROUTINE:
            loop.run_until_complete(eval(obj, namespace))
        else:
            exec(obj, namespace)


def _console(block: Block) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if "setup" in block.marks:
        subprocess.run(["bash", "-ec", block.marks["setup"]], env=env, check=True, timeout=TIMEOUT)
    for cmd, shown in block.commands():
        script = served(block, re.sub(r"\s+#[^'\"]*$", "", cmd))  # a trailing comment is prose
        r = subprocess.run(["bash", "-o", "pipefail", "-c", script], env=env, capture_output=True,
                           text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        if r.returncode != 0:
            raise AssertionError(f"`{cmd}` exited {r.returncode}:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
        want = [line.strip() for line in shown if line.strip()]
        if want and "any-output" not in block.marks:
            got = [line.strip() for line in r.stdout.splitlines()]
            missing = [line for line in want if line not in got]
            if missing:
                raise AssertionError(f"`{cmd}` did not print {missing}; it printed:\n{r.stdout[-1500:]}")


@contextlib.contextmanager
def _deadline(block: Block, stdout: io.StringIO) -> Iterator[None]:
    """A block still running after BLOCK_DEADLINE seconds is reported as failed, with
    where every thread and every task of sandlot's event loop waits, and the page
    ends: a hang names its place instead of running into the test's timeout."""

    def report() -> None:
        where = io.StringIO()
        for loop in _event_loops():
            for task in asyncio.all_tasks(loop):
                print(f"{task.get_name()}:", *_awaiting(task.get_coro()), sep="\n  ", file=where)
        sys.stderr.write(f"--- {block.where} still running after {BLOCK_DEADLINE:.0f} s: the threads\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        error = f"still running after {BLOCK_DEADLINE:.0f} s; the event loops' tasks:\n{where.getvalue()}"
        print(json.dumps({"where": block.where, "result": "failed", "error": error[-12000:],
                          "stdout": stdout.getvalue()[-2000:]}), file=sys.__stdout__, flush=True)  # fmt: skip
        os._exit(3)

    timer = threading.Timer(BLOCK_DEADLINE, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _awaiting(coro: Any) -> list[str]:
    """Where a coroutine waits, outermost first: each frame down its ``await`` chain."""
    out = []
    while coro is not None and len(out) < 40:
        frame = next((f for a in ("cr_frame", "gi_frame", "ag_frame") if (f := getattr(coro, a, None))), None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = next(
            (c for a in ("cr_await", "gi_yieldfrom", "ag_await") if (c := getattr(coro, a, None))), None
        )
    return out


def _event_loops() -> list[asyncio.AbstractEventLoop]:
    """The sync API's loop (in its own thread) and the page's, for a hang's report."""
    return [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and not o.is_closed()]


def run_page(page: Path) -> Iterator[dict[str, Any]]:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    loop = asyncio.new_event_loop()
    try:
        yield from _run_blocks(page, namespace, loop)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def _run_blocks(
    page: Path, namespace: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> Iterator[dict[str, Any]]:
    for block in blocks(page):
        if "signature" in block.marks:
            yield {"where": block.where, "result": "skipped", "why": "a signature"}
            continue
        if "skip" in block.marks:
            yield {"where": block.where, "result": "skipped", "why": block.marks["skip"]}
            continue
        stdout = io.StringIO()
        began = time.monotonic()
        try:
            with contextlib.redirect_stdout(stdout), _deadline(block, stdout):
                if block.lang == "python":
                    _python(block, namespace, loop)
                else:
                    _console(block)
        except BaseException:
            yield {"where": block.where, "result": "failed", "error": traceback.format_exc(limit=8)[-4000:],
                   "stdout": stdout.getvalue()[-2000:]}  # fmt: skip
            return
        yield {"where": block.where, "result": "ok", "seconds": round(time.monotonic() - began, 1),
               "stdout": stdout.getvalue()[-2000:]}  # fmt: skip


if __name__ == "__main__":
    for outcome in run_page(Path(sys.argv[1]).resolve()):
        print(json.dumps(outcome), flush=True)
