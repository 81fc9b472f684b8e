"""The code interpreter in real boxes: values, rich output, errors, streaming,
interrupt, timeout, restart, contexts, the Jupyter kernel of an image, and its
state through snapshot, rollback, fork, suspend and export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot

from tests.conftest import TEST_ENGINE
from tests.support import roots
from tests.support.names import unique

pytestmark = pytest.mark.vm
INTERPRETER_STATE = unique("interpreter-state")


@pytest.fixture(scope="module")
def jupyter_box() -> Iterator[sandlot.Box]:
    """Debian with python3-ipykernel, matplotlib and pandas (on the suite's engine: the
    full suite runs these on gVisor, where they take a third of TCG's time; a gVisor
    box's files are a host directory, as large as the host lets it be)."""
    disk = {} if TEST_ENGINE == "gvisor" else {"disk_size_gb": 4}
    with sandlot.Box(rootfs=roots.jupyter_root(), memory_mib=768, engine=TEST_ENGINE, **disk) as box:
        yield box


def test_values_output_and_errors_with_tracebacks(py_box: sandlot.Box) -> None:
    ctx = py_box.create_code_context()
    ex = py_box.run_code("x = 41\nx + 1", context=ctx)
    assert ex.text == "42" and ex.error is None and ex.execution_count == 1
    assert [r.is_main_result for r in ex.results] == [True]

    ex = py_box.run_code("print('out'); import os, sys; print('err', file=sys.stderr); os.system('echo sub')",
                         context=ctx)  # fmt: skip
    assert ex.stdout == "out\nsub\n" and ex.stderr == "err\n" and ex.text == "0"
    assert ex.execution_count == 2

    ex = py_box.run_code("def f():\n    return 1 / 0\n\nf()", context=ctx)
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    assert 'File "<cell 3>", line 2, in f' in ex.error.traceback and "return 1 / 0" in ex.error.traceback
    assert "interpreter.py" not in ex.error.traceback  # the kernel's own frames are left out

    ex = py_box.run_code("def broken(:", context=ctx)
    assert ex.error is not None and ex.error.name == "SyntaxError" and ex.results == []

    ex = py_box.run_code("display({'a': 1}); y = 2", context=ctx)  # display() without IPython
    assert [(r.text, r.is_main_result) for r in ex.results] == [("{'a': 1}", False)]
    ex = py_box.run_code("import asyncio\nawait asyncio.sleep(0.01)\nx * 2", context=ctx)
    assert ex.text == "82"  # top-level await
    py_box.remove_code_context(ctx)


def test_ipythons_shell_escapes_and_magics(py_box: sandlot.Box) -> None:
    """What cells of E2B's (IPython) kernel may hold that is not Python: agents'
    frameworks send ``!pip install``, and notebooks ``%matplotlib inline``."""
    ctx = py_box.create_code_context()
    ex = py_box.run_code("n = 3\n!echo got {n * 2} $n; echo err >&2; exit 4\n_exit_code", context=ctx)
    assert ex.error is None and ex.stdout == "got 6 3\nerr\n" and ex.text == "4"
    ex = py_box.run_code(
        "files = !echo a; echo b\nif files:\n    !echo {len(files)} '{print}'\nfiles.n", context=ctx
    )
    assert ex.error is None and ex.text == "'a\\nb'" and ex.stdout == "2 {print}\n", ex
    ex = py_box.run_code("%%writefile /tmp/cell.txt\nfrom a cell\n", context=ctx)
    assert ex.stdout == "Writing /tmp/cell.txt\n"
    ex = py_box.run_code("%%bash\ncat /tmp/cell.txt\necho $((1 + 2))", context=ctx)
    assert ex.stdout == "from a cell\n3\n" and ex.error is None
    magics = "%matplotlib inline\n%cd /tmp\n%env GREETING=hi\nimport os\nos.getcwd(), os.environ['GREETING']"
    ex = py_box.run_code(magics, context=ctx)
    assert ex.error is None and ex.text == "('/tmp', 'hi')" and ex.stdout == "/tmp\nenv: GREETING=hi\n"
    ex = py_box.run_code("%pip --version", context=ctx)
    assert ex.error is None and ("pip" in ex.stdout or "No module named pip" in ex.stdout), ex
    ex = py_box.run_code("%timeit 1", context=ctx)
    assert ex.error is not None and ex.error.name == "UsageError" and "%timeit" in ex.error.value
    indented = "\n        y = 2\n        !echo indented\n        y * 21\n"  # a cell indented as a whole
    ex = py_box.run_code(indented, context=ctx)
    assert ex.error is None and ex.text == "42" and ex.stdout == "indented\n", ex
    ex = py_box.run_code("x = 1 +\n!echo no", context=ctx)  # neither Python nor IPython: the cell's error
    assert ex.error is not None and ex.error.name == "SyntaxError" and "line 1" in ex.error.traceback
    py_box.remove_code_context(ctx)


def test_streaming_callbacks_see_output_as_it_comes(py_box: sandlot.Box) -> None:
    seen: list[tuple[float, str, str]] = []
    t0 = time.monotonic()
    ex = py_box.run_code(
        "import time, sys\nprint('first', flush=True)\ntime.sleep(5)\nprint('oops', file=sys.stderr)\n"
        "display(7)\n'last'",
        on_stdout=lambda s: seen.append((time.monotonic() - t0, "out", s)),
        on_stderr=lambda s: seen.append((time.monotonic() - t0, "err", s)),
        on_result=lambda r: seen.append((time.monotonic() - t0, "result", r.text or "")),
    )
    merged: list[tuple[str, str]] = []  # output comes in batches: "first" and "\n" may be two
    for _, kind, text in seen:
        if merged and kind == merged[-1][0] != "result":
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    assert merged == [("out", "first\n"), ("err", "oops\n"), ("result", "7"), ("result", "'last'")]
    first_at, total = seen[0][0], time.monotonic() - t0
    assert first_at < total - 1.0, "the first line came only with the end of the cell"  # (5 s apart)
    assert ex.stdout == "first\n" and ex.text == "'last'"


def test_interrupt_keeps_state_and_timeout_interrupts(py_box: sandlot.Box) -> None:
    import threading

    ctx = py_box.create_code_context()
    py_box.run_code("kept = 'yes'", context=ctx)
    looping = threading.Event()  # the interrupt is for the cell that runs: once it does

    def interrupt_it() -> None:
        if looping.wait(120):
            py_box.interrupt_code_context(ctx)

    threading.Thread(target=interrupt_it, daemon=True).start()
    ex = py_box.run_code("import time\nprint('looping', flush=True)\nwhile True: time.sleep(0.1)",
                         context=ctx, timeout=120, on_stdout=lambda _: looping.set())  # fmt: skip
    assert ex.error is not None and ex.error.name == "KeyboardInterrupt"
    assert py_box.run_code("kept", context=ctx).text == "'yes'"

    with pytest.raises(sandlot.CodeTimeout) as info:
        py_box.run_code("print('started', flush=True)\nimport time\ntime.sleep(60)", context=ctx, timeout=5)
    assert not info.value.state_lost and info.value.execution.stdout == "started\n"
    assert py_box.run_code("kept", context=ctx).text == "'yes'"

    # a cell that ignores SIGINT: its interpreter is ended, the context starts afresh
    with pytest.raises(sandlot.CodeTimeout) as info:
        py_box.run_code("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
                        context=ctx, timeout=5)  # fmt: skip
    assert info.value.state_lost
    ex = py_box.run_code("kept", context=ctx)
    assert ex.error is not None and ex.error.name == "NameError"
    py_box.remove_code_context(ctx)


def test_restart_two_contexts_and_unknown_ids(py_box: sandlot.Box) -> None:
    a = py_box.create_code_context(cwd="/tmp")
    b = py_box.create_code_context(env={"WHO": "b"})
    py_box.run_code("v = 'a'", context=a)
    py_box.run_code("v = 'b'", context=b)
    assert py_box.run_code("v", context=a).text == "'a'"
    assert py_box.run_code("import os; (v, os.environ['WHO'])", context=b).text == "('b', 'b')"
    assert py_box.run_code("import os; os.getcwd()", context=a).text == "'/tmp'"
    assert {a.id, b.id} <= {c.id for c in py_box.list_code_contexts()}

    again = py_box.restart_code_context(a)
    assert again.id == a.id and again.cwd == "/tmp"
    ex = py_box.run_code("v", context=a)
    assert ex.error is not None and ex.error.name == "NameError" and ex.execution_count == 1
    assert py_box.run_code("import os; os.getcwd()", context=a).text == "'/tmp'"  # same settings

    py_box.remove_code_context(b)
    assert b.id not in {c.id for c in py_box.list_code_contexts()}
    with pytest.raises(sandlot.CodeContextNotFound):
        py_box.run_code("1", context=b)
    with pytest.raises(sandlot.CodeContextNotFound):
        py_box.run_code("1", context="no-such-context")
    with pytest.raises(sandlot.InvalidArgument):
        py_box.run_code("1", context="../etc")
    with pytest.raises(sandlot.InvalidArgument):
        py_box.run_code(b"1")  # type: ignore[arg-type]
    with pytest.raises(sandlot.InvalidArgument):
        py_box.create_code_context(language="python", kernel="other")
    py_box.remove_code_context(a)


def test_hostile_cells_leave_the_box_usable(py_box: sandlot.Box) -> None:
    ctx = py_box.create_code_context()
    ex = py_box.run_code(
        "import sys\nfor i in range(400000): sys.stdout.write('x' * 99 + '\\n')", context=ctx
    )
    assert len(ex.stdout) == 8 << 20  # bounded: 40 MB printed, 8 MiB kept
    assert "output truncated" in ex.stderr and ex.error is None

    py_box.run_code("state = 1", context=ctx)
    ex = py_box.run_code("import os; os._exit(3)", context=ctx)
    assert ex.error is not None and ex.error.name == "KernelDied"
    ex = py_box.run_code("'state' in globals()", context=ctx)  # started again, empty
    assert ex.text == "False" and ex.execution_count == 1
    assert py_box.exec("true").exit_code == 0
    py_box.remove_code_context(ctx)


def test_an_image_without_python_or_kernel_says_so(bb_box: sandlot.Box, py_box: sandlot.Box) -> None:
    with pytest.raises(sandlot.InterpreterError, match="no python3"):
        bb_box.run_code("1")
    with pytest.raises(sandlot.InterpreterError, match="no Jupyter kernel for r"):
        py_box.create_code_context(language="r")
    no_node = r"no Jupyter kernel for javascript.*no node \(Node.js\)"
    with pytest.raises(sandlot.InterpreterError, match=no_node):
        py_box.run_code("1", language="javascript")
    with pytest.raises(sandlot.InvalidArgument, match="builtin kernels run python, bash, javascript"):
        py_box.create_code_context(language="r", kernel="builtin")
    with pytest.raises(sandlot.InterpreterError, match="no Jupyter kernel for python"):
        py_box.run_code("1", context=py_box.create_code_context(kernel="jupyter"))


def test_bash_cells_in_sandlots_own_kernel_on_any_image(py_box: sandlot.Box) -> None:
    """``language="bash"`` on an image with no Jupyter kernel: one bash per context, its
    variables, functions and working directory kept from cell to cell; a cell's own
    variables (E2B's ``envs``), put back after it; a failing last command is the cell's
    error; a timeout interrupts the cell and the shell goes on."""
    assert py_box.run_code("N=41; inc() { echo $(( $1 + 1 )); }; cd /tmp", language="bash").error is None
    ex = py_box.run_code("inc $N; pwd; echo to-stderr >&2", language="bash")
    assert (ex.stdout, ex.stderr, ex.error) == ("42\n/tmp\n", "to-stderr\n", None)
    assert py_box.run_code("echo $STAGE", language="bash", env={"STAGE": "eval"}).stdout == "eval\n"
    assert py_box.run_code("echo ${STAGE:-unset}", language="bash").stdout == "unset\n"
    ex = py_box.run_code("test -e /nope", language="bash")
    assert ex.error is not None and (ex.error.name, ex.error.value) == ("ExitCode", "1")
    with pytest.raises(sandlot.CodeTimeout):
        py_box.run_code("sleep 60; echo never", language="bash", timeout=2)
    assert py_box.run_code("echo $N", language="bash").stdout == "41\n"
    (ctx,) = [c for c in py_box.list_code_contexts() if c.id == "default-bash"]
    assert (ctx.language, ctx.kernel) == ("bash", "builtin")
    py_box.remove_code_context(ctx)


def test_javascript_and_typescript_cells_on_the_images_node(jupyter_box: sandlot.Box) -> None:
    """``language="javascript"`` and ``"typescript"`` where the image has node and no
    Jupyter kernel for them: sandlot's kernel on Node's REPL (top-level await, static
    imports, the last value as the result), TypeScript through the image's typescript
    package (Debian's node-typescript)."""
    ex = jupyter_box.run_code("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)",
                              language="javascript")  # fmt: skip
    assert (ex.stdout, ex.error) == ("function\n", None)
    assert jupyter_box.run_code("await Promise.resolve('Hello World!')", language="javascript").text == \
        "Hello World!"  # fmt: skip
    assert jupyter_box.run_code("const n = 20 + 1; n * 2", language="javascript").text == "42"
    assert jupyter_box.run_code("n", language="javascript").text == "21"  # kept
    ex = jupyter_box.run_code("process.env.STAGE", language="javascript", env={"STAGE": "eval"})
    assert ex.text == "eval"
    ex = jupyter_box.run_code("null.x", language="javascript")
    assert ex.error is not None and ex.error.name == "TypeError" and "at cell:1" in ex.error.traceback
    ex = jupyter_box.run_code("const message: string = 'Hello, World!'; console.log(message)",
                              language="typescript")  # fmt: skip
    assert (ex.stdout, ex.error) == ("Hello, World!\n", None)
    kernels = {c.language: c.kernel for c in jupyter_box.list_code_contexts()}
    assert kernels["javascript"] == kernels["typescript"] == "builtin"
    for language in ("javascript", "typescript"):
        jupyter_box.remove_code_context(f"default-{language}")


def test_rich_display_with_matplotlib_pandas_and_ipython(jupyter_box: sandlot.Box) -> None:
    ex = jupyter_box.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nNone", timeout=300
    )
    assert ex.error is None, ex.error
    (fig,) = ex.results
    png = fig.image()
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n") and not fig.is_main_result
    assert fig.chart is not None and fig.chart["type"] == "line" and fig.chart["title"] == "t"
    assert fig.chart["elements"] == [{"label": "Line 0", "points": [[0, 1], [1, 3], [2, 2]]}]

    ex = jupyter_box.run_code(
        "import pandas as pd\n"
        "pd.DataFrame({'a': [1, 2], 'b': ['x', 'y'], 't': pd.to_datetime(['2024-05-01', None])})",
        timeout=300,
    )
    (df,) = ex.results
    assert df.is_main_result and df.html is not None and "<table" in df.html and "a" in (df.text or "")
    assert df.data == {"a": [1, 2], "b": ["x", "y"], "t": ["2024-05-01T00:00:00", None]}

    ex = jupyter_box.run_code(
        "from IPython.display import display, HTML, Markdown\ndisplay(HTML('<b>hi</b>'), Markdown('# t'))",
        timeout=300,
    )
    assert [(r.html, r.markdown) for r in ex.results] == [("<b>hi</b>", None), (None, "# t")]


CHARTS = """
import datetime
import matplotlib.pyplot as plt
plt.bar(["A", "B", "C"], [100, 200, 300], label="Sold")
plt.xlabel("Author"); plt.ylabel("Books [n]"); plt.title("Sales")
plt.show()
fig, ax = plt.subplots()
ax.boxplot([[85, 90, 78, 92, 88], [95, 89, 76, 91, 84, 87]], labels=["A", "B"], patch_artist=True)
plt.show()
plt.pie([90, 10], labels=["yes", "no"], startangle=90)
plt.show()
day = datetime.date(2024, 5, 1)
plt.plot([day, day + datetime.timedelta(days=1)], [1.5, 2.5], label="level")
plt.yscale("log"); plt.xlabel("Day (UTC)")
plt.show()
fig, (left, right) = plt.subplots(1, 2)
fig.suptitle("Both")
left.scatter([1, 2], [3, 4], label="dots")
right.plot([1, 2], ["low", "high"])
plt.show()
plt.figure()
plt.gca().add_artist(plt.Circle((0, 0), 1))
plt.title("circle")
plt.show()
print("shown")  # each show() a result of its own, in order with the output
"""


def test_a_figures_data_comes_with_its_picture_as_a_chart(jupyter_box: sandlot.Box) -> None:
    """What E2B's code interpreter gives as ``result.chart``: each figure's data read back
    from what it drew, by kind, with its title, axes' labels, units, ticks and scales."""
    ex = jupyter_box.run_code(CHARTS, timeout=300)
    assert ex.error is None and ex.stdout == "shown\n", (ex.error, ex.stdout)
    charts = [r.chart for r in ex.results]
    assert all(r.png for r in ex.results) and all(charts)
    bar, box, pie, line, both, unknown = charts  # type: ignore[misc]
    assert (bar["type"], bar["title"], bar["x_label"], bar["y_unit"]) == ("bar", "Sales", "Author", "n")
    assert bar["elements"] == [
        {"label": k, "group": "Sold", "value": v} for k, v in (("A", 100), ("B", 200), ("C", 300))
    ]
    assert box["type"] == "box_and_whisker"
    fields = ("label", "min", "first_quartile", "median", "third_quartile", "max", "outliers")
    assert [tuple(e[f] for f in fields) for e in box["elements"]] == [
        ("A", 78, 85, 88, 90, 92, []),
        ("B", 84, 84.75, 88, 90.5, 95, [76]),
    ]
    assert [(e["label"], e["angle"], e["radius"]) for e in pie["elements"]] == [
        ("yes", 324, 1),
        ("no", 36, 1),
    ]
    assert (line["type"], line["x_scale"], line["y_scale"], line["x_unit"]) == (
        "line",
        "datetime",
        "log",
        "UTC",
    )
    assert line["elements"] == [{"label": "level", "points": [["2024-05-01", 1.5], ["2024-05-02", 2.5]]}]
    assert all(isinstance(t, str) for t in line["x_ticks"]) and all(
        isinstance(t, float) for t in line["y_ticks"]
    )
    assert (both["type"], both["title"]) == ("superchart", "Both")
    scatter, categorical = both["elements"]
    assert scatter["type"] == "scatter" and scatter["elements"] == [
        {"label": "dots", "points": [[1, 3], [2, 4]]}
    ]
    assert categorical["y_scale"] == "categorical" and categorical["y_tick_labels"] == ["low", "high"]
    assert unknown == {"type": "unknown", "title": "circle", "elements": []}


def test_the_images_jupyter_kernel_speaks_through_the_same_execution(jupyter_box: sandlot.Box) -> None:
    ctx = jupyter_box.create_code_context(kernel="jupyter")
    assert ctx.kernel == "jupyter:python3" and ctx.language == "python"
    ex = jupyter_box.run_code("x = 41\nprint('out')\nx + 1", context=ctx, timeout=120)
    assert ex.text == "42" and ex.stdout == "out\n" and ex.execution_count == 1
    ex = jupyter_box.run_code("1 / 0", context=ctx, timeout=120)
    assert ex.error is not None and ex.error.name == "ZeroDivisionError" and "1 / 0" in ex.error.traceback
    ex = jupyter_box.run_code("from IPython.display import HTML\nHTML('<i>j</i>')", context=ctx, timeout=120)
    assert ex.results[0].html == "<i>j</i>"
    with pytest.raises(sandlot.CodeTimeout) as info:
        jupyter_box.run_code("import time\ntime.sleep(60)", context=ctx, timeout=5)
    assert not info.value.state_lost
    assert jupyter_box.run_code("x", context=ctx, timeout=60).text == "41"
    jupyter_box.remove_code_context(ctx)


def _py(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))  # fmt: skip


# a cell that reads the variables it was given, starts a command that reads one, and
# sets one itself; what it saw, as JSON on its stdout
ENV_CELL = """import json, os, subprocess
seen = [os.environ.get(k) for k in ("STAGE", "KEPT", "SET")]
os.environ["SET"] = "by the cell"
child = subprocess.run(["sh", "-c", 'echo "$STAGE"'], capture_output=True, text=True).stdout
print(json.dumps([seen, child]))"""
ENV_AFTER = """import json, os; print(json.dumps([os.environ.get(k) for k in ("STAGE", "KEPT", "SET")]))"""


STARTUP = "/tmp/ipython-startup-test/profile_default/startup"
SAVES_SHOW = roots.IMAGES_STARTUP + 'GREETING = "from a startup file"\n'


def test_an_images_ipython_startup_files_run_before_the_first_cell(jupyter_box: sandlot.Box) -> None:
    """IPython's startup files (``$IPYTHONDIR/profile_default/startup/*.py``, by name) run in
    a new context of sandlot's kernel, as IPython runs them: E2B's template shows an image
    saved to a path this way. One that fails is told on the first cell's stderr, and the
    others run all the same."""
    jupyter_box.sh(
        f"mkdir -p {STARTUP} && echo 'raise RuntimeError(\"broken on purpose\")' > {STARTUP}/00-bad.py"
    )
    jupyter_box.files.write(f"{STARTUP}/10-images.py", SAVES_SHOW)
    ctx = jupyter_box.create_code_context(env={"IPYTHONDIR": STARTUP.rsplit("/", 2)[0]})
    try:
        ex = jupyter_box.run_code(
            "import numpy\nfrom PIL import Image\n"
            "Image.fromarray((numpy.ones((8, 8, 3)) * 200).astype('uint8')).save('/tmp/saved.png')\nGREETING",
            context=ctx,
        )
        assert ex.error is None, ex.error
        assert "the startup file" in ex.stderr and "broken on purpose" in ex.stderr
        assert ex.results[0].png and ex.text == "'from a startup file'"
        assert "startup file" not in jupyter_box.run_code("1", context=ctx).stderr  # told once
    finally:
        jupyter_box.remove_code_context(ctx)
        jupyter_box.sh("rm -rf /tmp/ipython-startup-test /tmp/saved.png")


def test_a_cells_own_environment_goes_with_it(py_box: sandlot.Box, jupyter_box: sandlot.Box) -> None:
    """``run_code(env=...)`` (E2B's ``envs``): the cell, and what it starts, see the
    variables; after it each is as it was (unset again, or the context's), but for one the
    cell set itself: in sandlot's kernel and in an image's Jupyter Python kernel alike."""
    for box, kernel in ((py_box, None), (jupyter_box, "jupyter")):
        ctx = box.create_code_context(kernel=kernel, env={"KEPT": "the context's"})
        given = {"STAGE": "eval", "KEPT": "the cell's", "SET": "given"}
        ex = box.run_code(ENV_CELL, context=ctx, env=given)
        assert ex.error is None, (kernel, ex.error)
        assert json.loads(ex.stdout) == [["eval", "the cell's", "given"], "eval\n"], kernel
        after = box.run_code(ENV_AFTER, context=ctx)
        assert json.loads(after.stdout) == [None, "the context's", "by the cell"], kernel
        assert box.run_code("1 + 1", context=ctx).execution_count == 3  # the settings are no cells
        box.remove_code_context(ctx)
    with pytest.raises(sandlot.InvalidArgument, match="environment variable name"):
        py_box.run_code("1", env={"A=B": "x"})
    with pytest.raises(sandlot.InvalidArgument, match="env must be a mapping"):
        py_box.run_code("1", env=["STAGE=eval"])  # type: ignore[arg-type]


def test_state_survives_rollback_fork_suspend_and_export(debian_root: Path, other_home: Path,
                                                         tmp_path: Path) -> None:  # fmt: skip
    # keep=True: another process resumes it, and must not take it for an abandoned box
    box = sandlot.Box(rootfs=debian_root, memory_mib=256, name=INTERPRETER_STATE, keep=True)
    try:
        _state_survives(box.start(), other_home, tmp_path)
    finally:
        box.remove(force=True)
        for s in sandlot.list_snapshots():
            if s.box_name == INTERPRETER_STATE:
                s.remove()


def _state_survives(box: sandlot.Box, other_home: Path, tmp_path: Path) -> None:
    box.run_code("x = 41")
    box.run_code("Y=41; cd /tmp", language="bash")  # a shell's state, in sandlot's bash kernel
    snap = box.snapshot()
    box.run_code("x = 0")
    box.run_code("Y=0; cd /", language="bash")
    box.rollback(snap)
    assert box.run_code("x + 1").text == "42"
    assert box.run_code("echo $Y $PWD", language="bash").stdout == "41 /tmp\n"

    kids = box.fork(4)
    try:
        for i, kid in enumerate(kids):
            kid.run_code(f"x = {i * 100}")
        assert [k.run_code("x + 1").text for k in kids] == ["1", "101", "201", "301"]
        assert box.run_code("x + 1").text == "42"
    finally:
        for kid in kids:
            kid.remove(force=True)

    box.suspend()
    got = _py(f"""
        import sandlot
        box = sandlot.get({box.id!r})
        box.resume()
        print(box.run_code("x + 1").text)
    """)
    assert got.returncode == 0 and got.stdout.strip() == "42", got.stderr

    archive = box.snapshot().export(tmp_path / "box.sandlot")
    moved = sandlot.import_snapshot(archive, home=other_home, name="moved")
    assert isinstance(moved, sandlot.Box)
    try:
        assert moved.run_code("x + 1").text == "42"
    finally:
        moved.remove(force=True)


def test_the_servers_code_route_streams_a_cell_as_json_lines(debian_root: Path) -> None:
    """``POST /v1/boxes/{box}/code`` for clients of other languages (the Python client's
    cells, on every transport, are ``tests/vm/test_contract.py``'s)."""
    import httpx

    from tests.support.serve import serving

    with serving(Path(os.environ["SANDLOT_HOME"])) as served, \
            sandlot.connect(served.url, api_key=served.api_key) as client, \
            client.Box(rootfs=debian_root, memory_mib=256) as box, \
            httpx.Client(base_url=served.url, headers=served.headers(), timeout=60) as http:  # fmt: skip
        # the route itself: JSON lines as the cell goes, the execution last
        with http.stream("POST", f"/v1/boxes/{box.id}/code", json={"code": "print(1)\n2"}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        # stream text comes in as many chunks as the kernel's flusher cut it into (print writes
        # "1" and "\n" apart, and a flush may fall between them): all of it before the result
        kinds = [e["type"] for e in lines]
        runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
        assert runs == ["stdout", "result", "execution"]
        assert "".join(e["text"] for e in lines if e["type"] == "stdout") == "1\n"
        assert lines[-1]["execution"]["results"][0] == {"text/plain": "2", "is_main_result": True}
        # a cell's own environment, through the route and the client
        cell = {"code": "import os; os.environ['STAGE']", "env": {"STAGE": "eval"}}
        with http.stream("POST", f"/v1/boxes/{box.id}/code", json=cell) as r:
            last = [json.loads(line) for line in r.iter_lines() if line][-1]
        assert last["execution"]["results"][0]["text/plain"] == "'eval'"
        assert box.run_code("os.environ['STAGE']", env={"STAGE": "client"}).text == "'client'"
        assert box.run_code("'STAGE' in os.environ").text == "False"
        bad = http.post(f"/v1/boxes/{box.id}/code", json={"code": 1})
        assert bad.status_code == 400 and "code" in bad.text  # names the field
        denied = http.post(f"/v1/boxes/{box.id}/code", json={"code": "1"}, headers={"Authorization": ""})
        assert denied.status_code == 401
