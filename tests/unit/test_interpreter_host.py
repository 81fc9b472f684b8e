"""The box's interpreter (``sandlot.guest.interpreter``) run on the host, over its real
socket and JSON lines: how it answers an interrupt. The same paths in a box, through
the agent and every transport, are in tests/vm/test_interpreter.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.guest import interpreter


class Context:
    """A started context's socket, read a JSON line at a time."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(60)
        self.lines = self.sock.makefile("rb")

    def send(self, **msg: Any) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def until_done(self, rid: str) -> list[dict[str, Any]]:
        """The cell's events, through its ``done`` (other cells' are not expected here)."""
        got = []
        while True:
            ev = json.loads(self.lines.readline())
            assert ev.get("id") == rid, (rid, ev)
            got.append(ev)
            if ev["ev"] == "done":
                return got


def start(root: Path, *options: str, sigint_ignored: bool = False) -> tuple[Context, dict[str, Any]]:
    """A context started as the agent starts one (``sigint_ignored``: from a process that
    ignores SIGINT, as one started in the background by a shell does)."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    started = subprocess.run(
        [sys.executable, interpreter.__file__, "start", "--root", str(root), "--id", "ctx", *options],
        capture_output=True, text=True, timeout=60, cwd=root, preexec_fn=ignore,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    return Context(root / "ctx" / "sock"), json.loads(started.stdout)


@pytest.fixture
def context(tmp_path: Path) -> Iterator[Context]:
    ctx, info = start(tmp_path)
    try:
        yield ctx
    finally:
        ctx.sock.close()
        os.kill(info["pid"], signal.SIGKILL)


def run(ctx: Context, rid: str, code: str, sent: bool = False, **extra: Any) -> dict[str, Any]:
    """A cell's stdout, stderr, main result's text and error, from its events (``sent``:
    the cell is on its way already)."""
    if not sent:
        ctx.send(op="run", id=rid, code=code, **extra)
    events = ctx.until_done(rid)
    out: dict[str, Any] = {"stdout": "", "stderr": "", "text": None, "error": None}
    for e in events:
        if e["ev"] == "stream":
            out[e["name"]] += e["text"]
        elif e["ev"] == "result" and e["main"]:
            out["text"] = e["data"].get("text/plain")
        elif e["ev"] == "error":
            out["error"] = (e["name"], e["value"], e["traceback"])
    return out


def interrupted(ctx: Context, rid: str, code: str) -> dict[str, Any]:
    """Run ``code`` (which prints ``started`` first) and interrupt it once it has started."""
    ctx.send(op="run", id=rid, code=code)
    first = json.loads(ctx.lines.readline())
    assert first.get("text") == "started\n", first
    ctx.send(op="interrupt")
    return run(ctx, rid, "", sent=True)


def test_a_cell_interrupted_while_it_waits_never_runs_and_the_running_one_goes_on(context: Context) -> None:
    """A host's timeout names its cell: one still queued behind another ends at once as
    interrupted, without running, and the cell that runs is not the one interrupted."""
    context.send(op="run", id="a", code="import time\ntime.sleep(2)\nx = 1\nprint('a ran')")
    context.send(op="run", id="b", code="y = 2")
    context.send(op="interrupt", id="b")
    b_events = context.until_done("b")  # answered before a has finished
    assert [e["ev"] for e in b_events] == ["error", "done"] and b_events[0]["name"] == "KeyboardInterrupt"
    a_events = context.until_done("a")
    assert {"ev": "stream", "id": "a", "name": "stdout", "text": "a ran\n"} in a_events
    assert not [e for e in a_events if e["ev"] == "error"]
    context.send(op="run", id="c", code="print(x)\ny")
    c_events = context.until_done("c")
    assert [e["name"] for e in c_events if e["ev"] == "error"] == ["NameError"]  # b never ran
    context.send(op="interrupt", id="a")  # a cell that has ended: nothing to do
    context.send(op="run", id="d", code="import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert json.loads(context.lines.readline())["text"] == "started\n"
    context.send(op="interrupt", id="d")  # the running cell, named
    d_events = context.until_done("d")
    assert [e["name"] for e in d_events if e["ev"] == "error"] == ["KeyboardInterrupt"]
    context.send(op="run", id="e", code="x + 1")
    assert {"ev": "result", "id": "e", "data": {"text/plain": "2"}, "main": True} in context.until_done("e")


def test_an_interrupt_as_its_cell_starts_is_taken_however_the_cell_blocks(context: Context) -> None:
    """A SIGINT that lands between the interpreter's last look for signals and a blocking
    call is taken only when that call returns: the interrupt is sent again until the
    cell takes it. Each cell here would sleep a minute; the race is a narrow one, so it
    is run many times (before the fix, about one in a few hundred waited the minute)."""
    context.sock.settimeout(10)  # an answer within seconds, not after the minute
    for i in range(200):
        context.send(op="run", id=f"s{i}", code="import time\ntime.sleep(60)")
        context.send(op="interrupt", id=f"s{i}")  # before it starts, as it starts, or while it sleeps
        events = context.until_done(f"s{i}")
        assert [e["name"] for e in events if e["ev"] == "error"] == ["KeyboardInterrupt"], events


def test_a_cells_env_is_set_for_it_alone_and_put_back_after(context: Context) -> None:
    """``{"op": "run", "env": ...}``: the cell and what it starts see the variables; then
    each is as it was (unset again, or its earlier value) unless the cell set it itself,
    an interrupted cell's too. The interpreter says it takes ``env`` (``features``)."""
    context.send(op="info")
    assert "env" in json.loads(context.lines.readline())["features"]
    context.send(op="run", id="a", code="import os\nos.environ['KEPT'] = 'before'")
    context.until_done("a")
    cell = (
        "import json, os, subprocess\nos.environ['SET'] = 'by the cell'\n"
        "child = subprocess.run(['sh', '-c', 'echo $STAGE'], capture_output=True, text=True).stdout\n"
        "print(json.dumps([os.environ['STAGE'], os.environ['KEPT'], child]))"
    )
    context.send(op="run", id="b", code=cell, env={"STAGE": "eval", "KEPT": "the cell's", "SET": "given"})
    out = "".join(e["text"] for e in context.until_done("b") if e["ev"] == "stream")
    assert json.loads(out) == ["eval", "the cell's", "eval\n"]
    after = "[os.environ.get(k) for k in ('STAGE', 'KEPT', 'SET')]"
    context.send(op="run", id="c", code=after)
    results = [e["data"] for e in context.until_done("c") if e["ev"] == "result"]
    assert results == [{"text/plain": "[None, 'before', 'by the cell']"}]
    context.send(op="run", id="d", code="import time\nprint('started', flush=True)\ntime.sleep(60)",
                 env={"STAGE": "interrupted"})  # fmt: skip
    assert json.loads(context.lines.readline())["text"] == "started\n"
    context.send(op="interrupt", id="d")
    context.until_done("d")
    context.send(op="run", id="e", code="'STAGE' in os.environ")
    assert [e["data"] for e in context.until_done("e") if e["ev"] == "result"] == [{"text/plain": "False"}]


def test_a_cell_whose_environment_cannot_be_set_gets_that_error_and_the_context_goes_on(
    tmp_path: Path,
) -> None:
    """A kernel that cannot set a cell's ``env`` (a Jupyter kernel answering its silent
    execution with an error, or not within its deadline): the cell is not run, it ends
    with that error, and the context serves the next cell (it ended the context before)."""
    import contextlib
    import threading

    class Kernel:  # what Server asks of a kernel; the environment's setting fails
        count = 0

        @contextlib.contextmanager
        def environment(self, env: dict[str, str]) -> Iterator[None]:
            if env:
                raise interpreter.CellNotRun("the kernel could not set the cell's environment: error")
            yield

        def execute(self, code: str, cell: interpreter.Cell) -> int:
            self.count += 1
            return self.count

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "sock"))
    listener.listen(4)
    server = interpreter.Server(Kernel(), str(tmp_path), {})
    threading.Thread(target=server.serve, args=(listener,), daemon=True).start()
    context = Context(tmp_path / "sock")
    context.send(op="run", id="a", code="1", env={"STAGE": "eval"})
    events = context.until_done("a")
    assert [(e["ev"], e.get("name")) for e in events] == [("error", "CellNotRun"), ("done", None)]
    assert events[-1]["count"] == 0  # not run
    context.send(op="run", id="b", code="1")
    assert context.until_done("b")[-1] == {"ev": "done", "id": "b", "count": 1}
    context.sock.close()


@pytest.mark.parametrize(
    ("facts", "refused"),
    [
        ({"language": "python"}, "earlier sandlot"),
        (
            {"language": "ocaml", "kernel": "jupyter:ocaml-jupyter", "features": ["env"]},
            "runs ocaml in the image's Jupyter kernel ocaml-jupyter",
        ),
    ],
)
def test_a_cells_env_is_refused_where_its_context_would_run_the_cell_without_it(
    facts: dict[str, Any], refused: str
) -> None:
    """An interpreter of an earlier sandlot ignores a field it does not know, and env is
    set in Python contexts and sandlot's own kernels only (not in an image's Jupyter kernel of
    another language): the host asks the context first and refuses, with the way out."""
    from sandlot.api.code import takes_env
    from sandlot.errors import Unsupported

    with pytest.raises(Unsupported, match=refused):
        takes_env("ctx", facts, "box-1")
    takes_env("ctx", {"language": "python", "features": ["env"]}, "box-1")
    takes_env("ctx", {"language": "bash", "kernel": "builtin", "features": ["env", "cell-env"]}, "box-1")
    takes_env("ctx", {"language": "r", "kernel": "jupyter:ir", "features": ["env", "cell-env"]}, "box-1")


def test_ipythons_escapes_are_rewritten_line_for_line_and_python_is_left_alone() -> None:
    rewrite = interpreter.ipython_syntax
    assert rewrite("x = 1\ny = x % 2") is None  # no escape: nothing to rewrite
    assert rewrite("!pip install numpy") == "_sandlot_ipython.system('pip install numpy', capture=False)"
    assert rewrite("if ok:\n    out = !ls /\n%matplotlib inline") == (
        "if ok:\n    out = _sandlot_ipython.system('ls /', capture=True)\n"
        "_sandlot_ipython.magic('matplotlib', 'inline')"
    )
    assert rewrite("%%writefile -a a.txt\nline 1\nline 2") == (
        "_sandlot_ipython.cell_magic('writefile', '-a a.txt', 'line 1\\nline 2')"
    )
    escapes = interpreter.IPythonEscapes({"n": 3, "name": "x y"})
    expanded = escapes.expand("echo {n * 2} $n $HOME $$ '{print}' {nope(}")
    assert expanded == "echo 6 3 $HOME $ '{print}' {nope(}"
    assert escapes.system("echo a; echo b >&2; exit 2", capture=True) == ["a", "b"]
    assert escapes.namespace["_exit_code"] == 2
    with pytest.raises(interpreter.UsageError, match="%timeit"):
        escapes.magic("timeit", "1")


def test_sandlots_bash_kernel_keeps_the_shells_state_and_answers_as_a_kernel(tmp_path: Path) -> None:
    """``--language bash``: one bash per context, each cell sourced in it, so variables,
    functions and the working directory stay; the last command's failure is the cell's
    error; an interrupt ends the cell's command and the rest of the cell, not the shell;
    ``exit`` ends the kernel, and the context says so."""
    # (started from a process that ignores SIGINT: bash must not inherit that, or its cells
    # could not be interrupted; the whole suite runs so when its shell starts it in the background)
    ctx, info = start(tmp_path, "--language", "bash", "--kernel", "auto", sigint_ignored=True)
    try:
        assert info["kernel"] == "builtin" and info["language"] == "bash"
        assert run(ctx, "a", "X=5; greet() { echo hi $1; }; cd /tmp")["stdout"] == ""
        assert run(ctx, "b", "greet $X; pwd; echo oops >&2; printf 'no newline'") == {
            "stdout": "hi 5\n/tmp\nno newline", "stderr": "oops\n", "text": None, "error": None}  # fmt: skip
        assert run(ctx, "c", "echo $FOO", env={"FOO": "bar"})["stdout"] == "bar\n"
        assert run(ctx, "d", "echo ${FOO:-unset}")["stdout"] == "unset\n"  # put back after its cell
        assert run(ctx, "e", "false")["error"][:2] == ("ExitCode", "1")
        assert run(ctx, "f", "read line; echo got=$line")["stdout"] == "got=\n"  # no stdin: never waits
        assert (
            interrupted(ctx, "g", "echo started; sleep 30; echo not reached")["error"][0]
            == "KeyboardInterrupt"
        )
        ctx.sock.settimeout(10)  # an interrupt as the cell starts is sent again: seconds, never the 30
        for i in range(20):
            ctx.send(op="run", id=f"s{i}", code="sleep 30")
            ctx.send(op="interrupt", id=f"s{i}")  # before bash has begun the cell, as it begins, or in it
            assert run(ctx, f"s{i}", "", sent=True)["error"][0] == "KeyboardInterrupt"
        ctx.sock.settimeout(60)
        assert run(ctx, "h", "echo $X")["stdout"] == "5\n"
        died = ("KernelDied", "bash exited with status 3 during this cell")
        assert run(ctx, "i", "exit 3")["error"][:2] == died
    finally:
        ctx.sock.close()
        subprocess.run(["pkill", "-9", "-f", "--", f"--root {tmp_path} "], check=False)


@pytest.mark.skipif(not shutil.which("node"), reason="no node here (sandlot's JavaScript kernel runs on it)")
def test_sandlots_javascript_kernel_on_node_runs_cells_as_a_notebook_does(tmp_path: Path) -> None:
    """``--language javascript``: Node's REPL keeps globals and declarations from cell to
    cell, a cell may await at top level and import statically, the last expression's
    value is the result (a string without quotes), errors keep only the cell's frames,
    and an interrupt stops a busy loop and a wait alike."""
    ctx, info = start(tmp_path, "--language", "javascript", "--kernel", "builtin")
    try:
        assert info["kernel"] == "builtin"
        assert run(ctx, "a", "console.log('Hello, World!')")["stdout"] == "Hello, World!\n"
        assert run(ctx, "b", "  import { readFileSync } from 'fs'\n  console.log(typeof readFileSync)")[
            "stdout"] == "function\n"  # fmt: skip
        assert run(ctx, "c", "import fs from 'fs'; import * as p from 'path'; [typeof fs.statSync, p.sep]")[
            "text"] == "[ 'function', '/' ]"  # fmt: skip
        assert run(ctx, "d", "let x = 1\nconst y = await Promise.resolve(41)\nx + y")["text"] == "42"
        assert run(ctx, "e", "await Promise.resolve('Hello ' + (x + y))")["text"] == "Hello 42"
        assert run(ctx, "f", "process.env.FOO", env={"FOO": "bar"})["text"] == "bar"
        assert run(ctx, "g", "process.env.FOO ?? 'unset'")["text"] == "unset"
        name, value, tb = run(ctx, "h", "function f() { return z }\nf()")["error"]
        assert (name, value) == ("ReferenceError", "z is not defined")
        assert "at f (cell:1:16)" in tb and "node:" not in tb and "kernel.js" not in tb
        assert run(ctx, "i", "1 +")["error"][:2] == ("SyntaxError", "Unexpected end of input")
        html = "({[Symbol.for('Jupyter.display')]() { return {'text/html': '<b>x</b>'} }})"
        ctx.send(op="run", id="j", code=html)
        shown = {"ev": "result", "id": "j", "data": {"text/html": "<b>x</b>"}, "main": True}
        assert shown in ctx.until_done("j")
        broken = "({[Symbol.for('Jupyter.display')]() { throw new Error('bad display') }})"
        assert run(ctx, "j2", broken)["error"][:2] == ("Error", "bad display")  # the cell's, not the kernel's
        busy = "console.log('started'); while (true) {}"
        assert interrupted(ctx, "k", busy)["error"][0] == "KeyboardInterrupt"
        waits = "console.log('started'); await new Promise(() => {})"
        assert interrupted(ctx, "l", waits)["error"][0] == "KeyboardInterrupt"
        assert run(ctx, "m", "x")["text"] == "1"
        assert run(ctx, "n", "process.exit(2)")["error"][0] == "KernelDied"
    finally:
        ctx.sock.close()
        subprocess.run(["pkill", "-9", "-f", "--", f"--root {tmp_path} "], check=False)


def test_a_language_with_no_kernel_says_what_the_image_lacks(tmp_path: Path) -> None:
    from sandlot.api.code import BUILTIN_LANGUAGES

    # the host's list of sandlot's own kernels is the box's (the guest imports no sandlot)
    assert interpreter.BUILTIN_LANGUAGES == BUILTIN_LANGUAGES
    started = subprocess.run(
        [sys.executable, interpreter.__file__, "start", "--root", str(tmp_path), "--id", "r",
         "--language", "r", "--kernel", "auto"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode != 0 and "no Jupyter kernel for r" in started.stderr
    started = subprocess.run(
        [sys.executable, interpreter.__file__, "start", "--root", str(tmp_path), "--id", "js", "--language",
         "javascript", "--kernel", "auto"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": str(tmp_path)},
    )  # fmt: skip
    assert started.returncode != 0
    assert "no Jupyter kernel for javascript" in started.stderr and "no node (Node.js)" in started.stderr


@pytest.mark.skipif(not shutil.which("bash"), reason="no bash here")
def test_a_cells_own_variables_in_each_language_a_jupyter_kernel_may_speak() -> None:
    """``env_code``: what an image's Jupyter kernel of each language runs before and after a
    cell with its own variables; run here in bash, R and node where this host has them (R's
    in the E2B code interpreter's template: scripts/e2b_sdk_tests.py)."""
    env = {"STAGE": 'it\'s "quoted" $HOME \\ é', "KEPT": "given"}
    check = {
        "bash": ["bash", "-c"],
        "r": ["Rscript", "-e"],
        "javascript": ["node", "-e"],
    }
    show = {
        "bash": 'printf "%s|%s\\n" "$STAGE" "${KEPT-unset}"',
        "r": 'cat(Sys.getenv("STAGE"), "|", Sys.getenv("KEPT", unset = "unset"), "\\n", sep = "")',
        "javascript": "console.log((process.env.STAGE ?? '') + '|' + (process.env.KEPT ?? 'unset'))",
    }
    assert interpreter.env_code("ocaml", env) is None
    for language, argv in check.items():
        if not shutil.which(argv[0]):
            continue
        before, after = interpreter.env_code(language, env) or ("", "")
        script = "\n".join([before, show[language], after, show[language]])
        out = subprocess.run([*argv, script], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "KEPT": "the context's"})  # fmt: skip
        assert out.returncode == 0, (language, out.stderr)
        assert out.stdout.splitlines() == [f"{env['STAGE']}|given", "|the context's"], (language, out.stdout)
