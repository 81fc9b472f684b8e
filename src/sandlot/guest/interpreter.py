"""The code interpreter that runs inside a box. The host never imports this
module: it copies the file into the box (``/run/sandlot/code/``) and runs it
with the image's own ``python3``, so it uses the standard library only and
runs on any Python from 3.8 on.

One process is one code context: it keeps the variables of its cells in its
own memory, so a snapshot, a fork, a suspend or an export of the box carries
them as it carries every other process. It listens on a Unix socket of its
context's directory (``/run/sandlot/code/ID/sock``, mode 0700), which the host
reaches through the agent's relay. Messages are JSON lines::

    host -> kernel  {"op": "run", "id": R, "code": "...", "env": {...}}
                                                             run a cell ("env": set for it
                                                             alone; "features" has "env")
                    {"op": "interrupt"}                      SIGINT to the running cell
                    {"op": "info"}                           -> {"ev": "info", ...}
                    {"op": "shutdown"}                       end this context
                    {"op": "kill"}                           end it now (a cell ignoring interrupts)
    kernel -> host  {"ev": "stream", "id": R, "name": "stdout"|"stderr", "text": "..."}
                    {"ev": "result", "id": R, "data": {MIME: value}, "main": bool}
                    {"ev": "error", "id": R, "name": ..., "value": ..., "traceback": ...}
                    {"ev": "done", "id": R, "count": N}

A context runs either sandlot's own kernel (``--kernel builtin``: exec of the
cell's AST, the last expression's value as the main result, rich display
through ``_repr_*_`` methods, IPython, matplotlib and pandas where the image
has them) or a Jupyter kernel of the image (``--kernel jupyter:SPEC``: this
process then speaks the Jupyter messaging protocol to it over ZeroMQ, with the
pyzmq that every Jupyter kernel brings).

``python3 interpreter.py start --root DIR --id ID ...`` starts a context in
the background and prints one JSON line once it answers.
"""

from __future__ import annotations

import abc
import ast
import base64
import codecs
import contextlib
import errno
import json
import linecache
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# Imports above are what every context needs; the Jupyter bridge and error paths
# import theirs where they are used, since under emulation each module costs
# tens of milliseconds of the context's start.

# One cell's output beyond this is dropped (and counted): a cell that prints
# gigabytes costs the box nothing and the host a bounded amount.
OUTPUT_LIMIT = 8 << 20
FLUSH_BYTES = 64 << 10
FLUSH_SECONDS = 0.02
# an interrupt not taken is sent again, this often (the host waits 3 s before it ends the
# interpreter of a cell that will not stop)
INTERRUPT_AGAIN, INTERRUPT_AGAIN_EVERY = 10, 0.25

MIME_METHODS = [
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_json_", "application/json"),
    ("_repr_latex_", "text/latex"),
]
BINARY_MIMES = ("image/png", "image/jpeg")


def block_sigint() -> None:
    """Threads other than the main one never take SIGINT: an interrupt must land in
    the thread that runs the cell, to break its blocking calls."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def thread(target: Callable[..., None], *args: Any) -> threading.Thread:
    def run() -> None:
        block_sigint()
        target(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class Client:
    """One connection from the host (through the relay)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.open = True

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self.lock:
            if not self.open:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.open = False


class Cell:
    """Where a running cell's output goes, bounded, with stream output batched."""

    def __init__(self, client: Client, rid: str) -> None:
        self.client = client
        self.rid = rid
        self.lock = threading.Lock()
        self.pending: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.pending_bytes = 0
        self.sent = 0
        self.dropped = 0

    def stream(self, name: str, text: str) -> None:
        if not text:
            return
        with self.lock:
            room = max(OUTPUT_LIMIT - self.sent - self.pending_bytes, 0)
            size = len(text.encode("utf-8", "replace"))
            if size > room:  # keep what fits, cut at a character boundary
                text = text.encode("utf-8", "replace")[:room].decode("utf-8", "ignore")
                kept = len(text.encode("utf-8"))
                self.dropped += size - kept
                size = kept
                if not text:
                    return
            self.pending[name].append(text)
            self.pending_bytes += size
            full = self.pending_bytes >= FLUSH_BYTES
        if full:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            out = [(n, "".join(parts)) for n, parts in self.pending.items() if parts]
            self.pending = {"stdout": [], "stderr": []}
            self.sent += self.pending_bytes
            self.pending_bytes = 0
        for name, text in out:
            self.client.send({"ev": "stream", "id": self.rid, "name": name, "text": text})

    def result(self, data: dict[str, Any], main: bool) -> None:
        self.flush()
        self.client.send({"ev": "result", "id": self.rid, "data": data, "main": main})

    def error(self, name: str, value: str, tb: str) -> None:
        self.flush()
        self.client.send({"ev": "error", "id": self.rid, "name": name, "value": value, "traceback": tb})

    def done(self, count: int) -> None:
        self.flush()
        if self.dropped:
            note = f"\n[sandlot: output truncated: {self.dropped} bytes of this cell's output were dropped]\n"
            self.client.send({"ev": "stream", "id": self.rid, "name": "stderr", "text": note})
        self.client.send({"ev": "done", "id": self.rid, "count": count})


class Output:
    """The cell that output belongs to now (none between cells: then it is dropped)."""

    def __init__(self) -> None:
        self.cell: Cell | None = None
        self.fd_readers: list[FdCapture] = []

    def stream(self, name: str, text: str) -> None:
        cell = self.cell
        if cell is not None:
            cell.stream(name, text)

    def settle(self) -> None:
        """Wait until what the cell's processes wrote to fd 1 and 2 has reached the cell
        (0.5 s at most: a process left running may write on)."""
        deadline = time.monotonic() + 0.5
        for reader in self.fd_readers:
            reader.settle(deadline)


OUT = Output()


class TextStream:
    """``sys.stdout`` and ``sys.stderr`` during cells."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        OUT.stream(self.name, text)
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1 if self.name == "stdout" else 2

    @property
    def buffer(self) -> ByteStream:
        return ByteStream(self.name)


class ByteStream:
    """``sys.stdout.buffer``: bytes written to it are the cell's output as text."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, data: bytes) -> int:
        OUT.stream(self.name, bytes(data).decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        pass


class FdCapture:
    """fd 1 or 2 as a pipe whose reader passes what child processes and C code write
    to the running cell, so ``os.system`` output is part of the cell's output.

    A cell's end waits for that output with a mark written into the same pipe: a pipe
    keeps order, so what a finished process wrote is passed on before the reader meets
    the mark. (An empty pipe was not enough: the reader may have read the bytes and not
    yet passed them on, waiting for the GIL, and the cell's end dropped them.)"""

    # one write, so atomic in a pipe; no start of it is also its end (only its first byte
    # is NUL), so output that ends like its start cannot make a mark with the real one
    MARK = b"\0sandlot-settle-" + os.urandom(8).hex().encode() + b"\1"

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        self.fd = fd
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        self.r = r
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.marks = threading.Condition()
        self.marks_sent = self.marks_met = 0
        thread(self.pump)

    def settle(self, deadline: float) -> None:
        with self.marks:
            self.marks_sent += 1
            mine = self.marks_sent
        try:
            os.write(self.fd, self.MARK)
        except OSError:
            return
        with self.marks:
            self.marks.wait_for(lambda: self.marks_met >= mine, max(0.0, deadline - time.monotonic()))

    def pump(self) -> None:
        held = b""  # the start of a mark, perhaps, at the end of the last read
        while True:
            try:
                data = os.read(self.r, 65536)
            except InterruptedError:
                continue
            if not data:
                return
            *parts, held = (held + data).split(self.MARK)
            keep = next((n for n in range(min(len(held), len(self.MARK) - 1), 0, -1)
                         if self.MARK.startswith(held[-n:])), 0)  # fmt: skip
            parts.append(held[: len(held) - keep])
            held = held[len(held) - keep :]
            text = self.decoder.decode(b"".join(parts))
            if text:
                OUT.stream(self.name, text)
            if len(parts) > 1:
                with self.marks:
                    self.marks_met += len(parts) - 1
                    self.marks.notify_all()


# ---- rich display ------------------------------------------------------------


def b64(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode()
    return value


def figure_png(fig: Any) -> str:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def figure_bundle(fig: Any) -> dict[str, Any]:
    """A figure as PNG and, where its data can be read back, as a chart (after the PNG:
    drawing it is what sets its tick labels)."""
    data = {"image/png": figure_png(fig), "text/plain": repr(fig)}
    try:
        chart = bounded(chart_of(fig))
    except Exception:  # a figure of a kind no rule here reads: the picture alone
        chart = None
    if chart is not None:
        data[CHART_MIME] = chart
    return data


def is_figure(obj: Any) -> bool:
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


_ipython_formatter: Any = None


def ipython_format(obj: Any) -> dict[str, Any] | None:
    """IPython's own formatters, once the cell has imported IPython."""
    global _ipython_formatter
    if "IPython" not in sys.modules:
        return None
    try:
        if _ipython_formatter is None:
            from IPython.core.formatters import DisplayFormatter  # type: ignore[import-not-found]

            _ipython_formatter = DisplayFormatter()
        data, _ = _ipython_formatter.format(obj)
    except Exception:
        return None
    return {k: b64(v) for k, v in data.items()} if data else None


def mime_bundle(obj: Any) -> dict[str, Any]:
    """What a value looks like in each format it offers: the ``_repr_*_`` protocol
    of IPython and Jupyter, a matplotlib figure as PNG with its chart's data, a pandas
    DataFrame's columns, and ``repr`` as text."""
    if is_figure(obj):
        return figure_bundle(obj)
    data = formats(obj)
    table = table_data(obj)
    if table is not None:
        data[DATA_MIME] = table
    return data


def formats(obj: Any) -> dict[str, Any]:
    data = ipython_format(obj)
    if data:
        return data
    data = {}
    if not isinstance(obj, type):
        bundle = getattr(obj, "_repr_mimebundle_", None)
        if callable(bundle):
            try:
                got = bundle(include=None, exclude=None)
                if isinstance(got, tuple):
                    got = got[0]
                if isinstance(got, dict):
                    data.update({k: b64(v) for k, v in got.items()})
            except Exception:
                pass
        for method, mime in MIME_METHODS:
            fn = getattr(obj, method, None)
            if mime in data or not callable(fn):
                continue
            try:
                value = fn()
            except Exception:
                continue
            if isinstance(value, tuple):
                value = value[0]
            if value is not None:
                data[mime] = b64(value)
    if "text/plain" not in data:
        try:
            data["text/plain"] = repr(obj)
        except Exception as e:
            data["text/plain"] = f"<repr failed: {type(e).__name__}: {e}>"
    return data


def display(*objs: Any, **kwargs: Any) -> None:
    """Show each object as a result of the running cell (``display`` of IPython)."""
    raw = kwargs.get("raw", False)
    cell = OUT.cell
    if cell is None:
        return
    for obj in objs:
        if raw and isinstance(obj, dict):
            cell.result({k: b64(v) for k, v in obj.items()}, False)
        else:
            cell.result(mime_bundle(obj), False)


class ImportPatches:
    """Modules patched as they are imported: ``IPython.display.display`` routed here
    (without a running IPython shell it would only print the repr), and pyplot's
    ``show`` showing the open figures as the cell's results and closing them, as
    Jupyter's inline backend does (under Agg it would do nothing, and the next plot of
    the cell would draw on the same figure)."""

    def __init__(self) -> None:
        self.patches: dict[str, Callable[[Any], None]] = {
            "IPython.core.display_functions": self.display,
            "IPython.core.display": self.display,
            "IPython.display": self.display,
            "matplotlib.pyplot": self.pyplot,
        }

    @staticmethod
    def display(module: Any) -> None:
        if hasattr(module, "display"):
            module.display = display

    @staticmethod
    def pyplot(module: Any) -> None:
        shown = getattr(module, "show", None)
        if shown is None:
            return

        def show(*args: Any, **kwargs: Any) -> Any:
            cell = OUT.cell
            if cell is None or str(module.get_backend()).lower() != "agg":
                return shown(*args, **kwargs)
            OUT.settle()  # what the cell printed before comes before its figures
            show_figures(cell)
            return None

        module.show = show

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module: Any) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = patched  # type: ignore[method-assign]
        return spec


def show_figures(cell: Cell, skip: Any = None) -> None:
    """Each open matplotlib figure as a PNG result, then closed (what Jupyter's inline
    backend does), so ``plt.plot(...)`` shows without ``plt.show()``."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if fig is not skip:
                cell.result(figure_bundle(fig), False)
        plt.close("all")
    except Exception as e:
        cell.stream("stderr", f"[sandlot: could not render a figure: {e}]\n")


# ---- charts and tables: what a figure or a DataFrame holds, as data ------------
#
# A figure's data, read back from its artists, in the form E2B's code interpreter gives
# (its SDKs' ``result.chart``): a line, scatter, bar, pie or box-and-whisker chart, a
# "superchart" of a figure's several axes, or "unknown" (its title alone). A DataFrame's
# columns (``result.data``). Either is left out past CHART_BYTES, the picture stays.

CHART_MIME = "application/vnd.sandlot.chart+json"
DATA_MIME = "application/vnd.sandlot.data+json"
CHART_BYTES = 2 << 20
UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")  # "Time (s)", "Power [W]"


def bounded(value: Any) -> Any:
    """``value`` if its JSON is at most CHART_BYTES (and it is JSON), else None."""
    if value is None:
        return None
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return None
    return value if size <= CHART_BYTES else None


def plain(value: Any) -> Any:
    """A number, date or label of a chart or table as JSON has it: numpy's scalars as
    Python's, dates as ISO text, NaN and infinities as null."""
    import datetime

    if type(value).__name__ == "datetime64":  # (its item() is an int of nanoseconds)
        return None if str(value) == "NaT" else str(value.astype("datetime64[s]"))
    try:
        if value != value:  # NaN, pandas' NaT
            return None
    except Exception:  # (an object whose != is no bool)
        pass
    if isinstance(value, (datetime.date, datetime.datetime)):  # pandas' Timestamp too
        return value.isoformat()
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):  # numpy's scalars
        with contextlib.suppress(TypeError, ValueError):
            value = value.item()
    if isinstance(value, float):  # (NaN went above)
        return value if value not in (float("inf"), float("-inf")) else None
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    return str(value)


def pairs(xs: Any, ys: Any) -> list[tuple[Any, Any]]:
    """``zip`` of two sequences (its ``strict=`` is Python 3.10's; this file runs on 3.8)."""
    return [(xs[i], ys[i]) for i in range(min(len(xs), len(ys)))]


def tidy(value: Any, digits: int = 10) -> float:
    """A value read from a drawing's geometry, to ``digits`` significant digits (so that
    the same value read from two artists compares equal)."""
    return float(f"{float(value):.{digits}g}")


def table_data(obj: Any) -> dict[str, list[Any]] | None:
    pandas = sys.modules.get("pandas")
    if pandas is None or not isinstance(obj, pandas.DataFrame):
        return None
    try:
        columns = obj.to_dict(orient="list")
        table: dict[str, list[Any]] | None = bounded(
            {str(k): [plain(v) for v in vs] for k, vs in columns.items()}
        )
    except Exception:
        return None
    return table


def chart_of(fig: Any) -> dict[str, Any] | None:
    """The figure's chart, or None for a figure with no data drawn."""
    axes = fig.get_axes()
    if not axes or not any(ax.has_data() for ax in axes):
        return None
    if len(axes) == 1:
        return axes_chart(axes[0])
    suptitle = getattr(fig, "_suptitle", None)  # (Figure.get_suptitle is matplotlib 3.8's)
    title = suptitle.get_text() if suptitle is not None else ""
    return {"type": "superchart", "title": title or None, "elements": [axes_chart(ax) for ax in axes]}


def drawn(ax: Any) -> list[Any]:
    """What the cell drew on the axes, texts aside."""
    from matplotlib.text import Text

    children = getattr(ax, "_children", None)  # (matplotlib 3.5 on: in the order drawn)
    if children is None:
        children = [*ax.lines, *ax.collections, *ax.patches, *ax.images, *ax.artists]
    return [a for a in children if not isinstance(a, Text)]


def is_rule(line: Any) -> bool:
    """A horizontal or vertical line of two points (``axhline``, ``axvline``): no data."""
    x, y = line.get_xdata(), line.get_ydata()
    return len(x) == 2 and len(y) == 2 and (x[0] == x[1] or y[0] == y[1])


def chart_kind(ax: Any) -> str:
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import PathPatch, Rectangle, Wedge

    artists = drawn(ax)
    if all(isinstance(a, Line2D) for a in artists):
        return "line"
    if all(isinstance(a, (PathPatch, Line2D)) for a in artists):
        return "box_and_whisker"
    artists = [a for a in artists if not (isinstance(a, Line2D) and is_rule(a))]
    for kind, types in (("scatter", PathCollection), ("pie", Wedge), ("bar", Rectangle)):
        if all(isinstance(a, types) for a in artists):
            return kind
    return "unknown"


def axes_chart(ax: Any) -> dict[str, Any]:
    kind = chart_kind(ax)
    chart: dict[str, Any] = {"type": kind, "title": ax.get_title() or None, "elements": []}
    if kind in ("pie", "unknown"):
        if kind == "pie":
            chart["elements"] = [
                {"label": w.get_label(), "angle": abs(tidy(w.theta2 - w.theta1, 6)), "radius": plain(w.r)}
                for w in ax.patches
            ]
        return chart
    for axis in ("x", "y"):
        label = getattr(ax, f"get_{axis}label")() or None
        unit = UNIT.search(label) if label else None
        chart[f"{axis}_label"] = label
        chart[f"{axis}_unit"] = (unit.group(1) or unit.group(2)) if unit else None
    if kind in ("line", "scatter"):
        for axis in ("x", "y"):
            chart.update(scale_of(ax, axis))
        if kind == "line":
            lines = [line for line in ax.get_lines() if not is_rule(line)]
            chart["elements"] = [
                {"label": line_label(line.get_label(), "_child", "Line"),
                 "points": [[plain(x), plain(y)] for x, y in pairs(line.get_xdata(), line.get_ydata())]}
                for line in lines
            ]  # fmt: skip
        else:
            chart["elements"] = [
                {"label": c.get_label(), "points": [[plain(x), plain(y)] for x, y in c.get_offsets()]}
                for c in ax.collections
            ]
    elif kind == "bar":
        bars(ax, chart)
    else:
        boxes(ax, chart)
    return chart


def line_label(label: str, auto: str, name: str) -> str:
    """matplotlib's own name of an unlabelled artist (``_child0``), as E2B's: ``Line 0``."""
    return f"{name} {label[len(auto) :]}" if label.startswith(auto) else label


def converter_of(axis: Any) -> Any:
    get = getattr(axis, "get_converter", None)  # (matplotlib 3.10 on)
    return get() if callable(get) else getattr(axis, "converter", None)


def scale_of(ax: Any, name: str) -> dict[str, Any]:
    """An axis's ticks, their labels and its scale: "datetime", "categorical", or
    matplotlib's scale ("linear", "log", "symlog", "logit"...)."""
    axis = getattr(ax, f"{name}axis")
    kind = type(converter_of(axis)).__name__
    ticks = list(axis.get_ticklocs())
    labels = [t.get_text() for t in axis.get_ticklabels()]
    if kind.endswith("DateConverter"):
        from matplotlib.dates import num2date

        stamps = [num2date(t).isoformat() for t in ticks]  # type: ignore[no-untyped-call]
        return {f"{name}_ticks": stamps, f"{name}_tick_labels": labels, f"{name}_scale": "datetime"}
    scale = "categorical" if kind == "StrCategoryConverter" else getattr(ax, f"get_{name}scale")()
    values = [plain(float(t)) for t in ticks]
    return {f"{name}_ticks": values, f"{name}_tick_labels": labels, f"{name}_scale": scale}


def tick_label(axis: Any, at: float) -> str:
    """The label of the tick at ``at`` (a bar's category), else the value itself."""
    for loc, text in pairs(axis.get_ticklocs(), axis.get_ticklabels()):
        if abs(loc - at) < 1e-9 and text.get_text():
            return str(text.get_text())
    return f"{at:g}"


def bars(ax: Any, chart: dict[str, Any]) -> None:
    """Each bar: its group (the container's label), its category and its value. Of
    horizontal bars (``barh``) the axes' labels are swapped, so that x is the categories'."""
    flipped = False
    for container in ax.containers:
        group = line_label(container.get_label() or "", "_container", "Group")
        rects = [r for r in container if hasattr(r, "get_height")]
        if not rects:
            continue
        orientation = getattr(container, "orientation", None)
        if orientation is None:  # (matplotlib before 3.4): bars of one height lie
            orientation = (
                "horizontal" if len({r.get_height() for r in rects}) == 1 and len(rects) > 1 else "vertical"
            )
        for r in rects:
            if orientation == "horizontal":
                flipped = True
                label, value = tick_label(ax.yaxis, r.get_y() + r.get_height() / 2), r.get_width()
            else:
                label, value = tick_label(ax.xaxis, r.get_x() + r.get_width() / 2), r.get_height()
            chart["elements"].append({"label": label, "group": group, "value": plain(value)})
    if flipped:
        swap_axes(chart)


def swap_axes(chart: dict[str, Any]) -> None:
    chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
    chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]


def upright_boxes(ax: Any, spans: list[list[float]]) -> bool:
    """Whether the boxes stand (values on y): a median line runs across a box, level,
    from one side to the other; else, boxes of one width stand and of several, lie."""
    for line in ax.lines:
        x, y = [tidy(v) for v in line.get_xdata()], [tidy(v) for v in line.get_ydata()]
        if len(x) != 2 or len(y) != 2:
            continue
        for low, high, bottom, top in spans:
            if y[0] == y[1] and sorted(x) == [low, high] and bottom < y[0] < top:
                return True
            if x[0] == x[1] and sorted(y) == [bottom, top] and low < x[0] < high:
                return False
    return len({round(s[1] - s[0], 9) for s in spans}) == 1


def box_at(spans: list[list[float]], position: float) -> int | None:
    """The index of the box whose span of positions holds ``position``."""
    return next((i for i, s in enumerate(spans) if s[0] - 1e-9 <= position <= s[1] + 1e-9), None)


def boxes(ax: Any, chart: dict[str, Any]) -> None:
    """Each box of a ``boxplot(patch_artist=True)``, from its drawing: the box's edges are
    the quartiles, the line across it the median, the lines from its edges the whiskers
    (min and max) and the markers beyond them the outliers."""
    spans = []  # per box: (position's low, high, first quartile, third quartile)
    for patch in ax.patches:
        v = patch.get_path().vertices
        xs, ys = [tidy(x) for x in v[:, 0]], [tidy(y) for y in v[:, 1]]
        spans.append([min(xs), max(xs), min(ys), max(ys)])
    if not spans:
        return
    upright = upright_boxes(ax, spans)
    if not upright:  # lying (values on x): read as if they stood
        spans = [[s[2], s[3], s[0], s[1]] for s in spans]
        swap_axes(chart)
    names = [t.get_text() for t in (ax.xaxis if upright else ax.yaxis).get_ticklabels()]
    found: list[dict[str, Any]] = [{"outliers": []} for _ in spans]
    for line in ax.lines:
        pos, val = [tidy(x) for x in line.get_xdata()], [tidy(y) for y in line.get_ydata()]
        if not upright:
            pos, val = val, pos
        if not pos:
            continue
        if line.get_linestyle() in ("None", "", " ", "none"):  # markers alone: the fliers
            for p, y in pairs(pos, val):
                j = box_at(spans, p)
                if j is not None:
                    found[j]["outliers"].append(y)
            continue
        i = box_at(spans, pos[0])
        if i is None or len(val) != 2:
            continue
        low, high, q1, q3 = spans[i]
        if val[0] == val[1]:
            if q1 <= val[0] <= q3 and pos[0] <= low + 1e-9 and pos[1] >= high - 1e-9:
                found[i]["median"] = val[0]
        elif max(val) == q1:
            found[i]["min"] = min(val)
        elif min(val) == q3:
            found[i]["max"] = max(val)
    for i, (s, f) in enumerate(pairs(spans, found)):
        chart["elements"].append({
            "label": names[i] if i < len(names) else str(i),
            "min": f.get("min", s[2]), "first_quartile": s[2], "median": f.get("median"),
            "third_quartile": s[3], "max": f.get("max", s[3]), "outliers": sorted(f["outliers"]),
        })  # fmt: skip


# ---- IPython's syntax: shell escapes and magics --------------------------------

# What a cell of E2B's (IPython) kernel may write that is not Python, and agents'
# frameworks send (smolagents installs packages with ``!pip install``; notebooks start
# with ``%matplotlib inline``): ``!cmd`` and ``x = !cmd``, the line magics below and the
# cell magics ``%%bash``, ``%%sh`` and ``%%writefile``. Only a cell that does not parse
# as Python is rewritten, line for line, so tracebacks keep their line numbers.
ESCAPE = re.compile(r"^(?P<indent>[ \t]*)(?:(?P<target>[A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*=\s*)?"
                    r"(?P<kind>!|%(?!%))(?P<rest>.*)$")  # fmt: skip
QUIET_MAGICS = ("matplotlib", "config", "load_ext", "reload_ext", "autoreload", "precision")


class ShellLines(list):  # type: ignore[type-arg]
    """What ``x = !cmd`` gives: its output's lines, as IPython's ``SList`` (``.s``, ``.n``)."""

    @property
    def s(self) -> str:
        return " ".join(self)

    @property
    def n(self) -> str:
        return "\n".join(self)

    @property
    def l(self) -> list[str]:  # noqa: E743 (IPython's name)
        return list(self)


def ipython_syntax(code: str) -> str | None:
    """``code`` with IPython's escapes as calls of ``_sandlot_ipython``; None where it
    has none."""
    lines = code.split("\n")
    first = lines[0].strip()
    if first.startswith("%%"):
        name, _, line = first[2:].partition(" ")
        body = "\n".join(lines[1:])
        return f"_sandlot_ipython.cell_magic({name!r}, {line.strip()!r}, {body!r})"
    changed = False
    for i, text in enumerate(lines):
        m = ESCAPE.match(text)
        if m is None:
            continue
        rest = m.group("rest").strip()
        if m.group("kind") == "!":
            call = f"_sandlot_ipython.system({rest!r}, capture={m.group('target') is not None})"
        else:
            name, _, line = rest.partition(" ")
            call = f"_sandlot_ipython.magic({name!r}, {line.strip()!r})"
        target = f"{m.group('target')} = " if m.group("target") else ""
        lines[i] = f"{m.group('indent')}{target}{call}"
        changed = True
    return "\n".join(lines) if changed else None


class IPythonEscapes:
    """What the rewritten cell calls, in the kernel's namespace as ``_sandlot_ipython``."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace

    def expand(self, command: str) -> str:
        """IPython's expansion of a shell line: ``{expression}`` and ``$name`` from the
        cell's variables (``$$`` for a ``$``); what does not evaluate stays as written."""

        def braces(m: re.Match[str]) -> str:
            expression = m.group(1).strip()
            if expression.isidentifier() and expression not in self.namespace:
                return m.group(0)  # awk's '{print}' stays as written
            try:
                return str(eval(expression, self.namespace))
            except Exception:
                return m.group(0)

        def dollar(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1)
            return str(self.namespace[name]) if name in self.namespace else m.group(0)

        return re.sub(r"\$\$|\$([A-Za-z_]\w*)", dollar, re.sub(r"\{([^{}]+)\}", braces, command))

    def system(self, command: str, capture: bool = False) -> Any:
        """``!command``: run in the shell with its output (stderr with it) the cell's,
        its exit status in ``_exit_code``; ``x = !command``: its lines instead."""
        import subprocess

        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        argv = [shell, "-c", self.expand(command)]
        sys.stdout.flush()
        if capture:
            proc = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            self.namespace["_exit_code"] = proc.returncode
            return ShellLines(proc.stdout.decode("utf-8", "replace").splitlines())
        code = subprocess.call(argv, stdout=1, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.namespace["_exit_code"] = code
        return None

    def magic(self, name: str, line: str) -> Any:
        if name in ("pip", "pip3"):
            return self.system(f"{sys.executable} -m pip {line}")
        if name == "cd":
            os.chdir(os.path.expanduser(self.expand(line) or "~"))
            print(os.getcwd())
            return None
        if name == "pwd":
            return os.getcwd()
        if name == "env":
            return self.env(self.expand(line))
        if name in QUIET_MAGICS:  # figures are the cell's results already; the rest are settings
            return None
        raise UsageError(
            f"Line magic function `%{name}` not found (sandlot's kernel serves "
            "%pip, %cd, %pwd, %env and !commands; %matplotlib and %config do nothing)."
        )

    def env(self, line: str) -> Any:
        if not line:
            return dict(os.environ)
        name, sep, value = line.partition("=") if "=" in line else line.partition(" ")
        if not sep:
            return os.environ.get(name.strip())
        os.environ[name.strip()] = value.strip()
        print(f"env: {name.strip()}={value.strip()}")
        return None

    def cell_magic(self, name: str, line: str, body: str) -> Any:
        if name in ("bash", "sh"):
            self.script("/bin/" + name, body)
            return None
        if name == "writefile":
            args = line.split()
            append = "-a" in args or "--append" in args
            paths = [a for a in args if not a.startswith("-")]
            if len(paths) != 1:
                raise UsageError("%%writefile takes one path (and -a to append)")
            path = os.path.expanduser(self.expand(paths[0]))
            existed = os.path.exists(path)
            with open(path, "a" if append else "w") as f:
                f.write(body if body.endswith("\n") or not body else body + "\n")
            print(f"{'Appending to' if append else 'Overwriting' if existed else 'Writing'} {paths[0]}")
            return None
        raise UsageError(
            f"Cell magic `%%{name}` not found (sandlot's kernel serves %%bash, %%sh and %%writefile)."
        )

    def script(self, shell: str, body: str) -> None:
        """A cell of shell script: its output the cell's; a failing script is not an error
        of the cell (as in IPython)."""
        import subprocess

        sys.stdout.flush()
        proc = subprocess.Popen([shell], stdin=subprocess.PIPE, stdout=1, stderr=2)
        proc.communicate(body.encode())
        self.namespace["_exit_code"] = proc.returncode


class UsageError(Exception):
    """IPython's error for a magic it does not have."""


# ---- the builtin kernel ------------------------------------------------------


# A cell's own environment variables (``{"op": "run", "env": ...}``), as E2B's code
# interpreter sets them: set before the cell, and after it each name is put back as it
# was (removed if it was unset) unless the cell changed it itself. Python run by the
# kernel's interpreter, so sandlot's kernel and an image's Jupyter Python kernel share it;
# the names begin with __sandlot and go at the end.
ENV_SET = """__sandlot_env = ({given}, {{k: __import__('os').environ.get(k) for k in {given}}})
__import__('os').environ.update(__sandlot_env[0])"""
ENV_RESTORE = """for __sandlot_k, __sandlot_v in __sandlot_env[1].items():
    if __import__('os').environ.get(__sandlot_k) == __sandlot_env[0][__sandlot_k]:
        if __sandlot_v is None:
            __import__('os').environ.pop(__sandlot_k, None)
        else:
            __import__('os').environ[__sandlot_k] = __sandlot_v
del __sandlot_env, __sandlot_k, __sandlot_v"""


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def env_code(language: str, env: dict[str, str]) -> tuple[str, str] | None:
    """The code that sets ``env`` for one cell in a kernel of ``language``, and the code
    that puts it back after (see ENV_SET); None for a language this does not know."""
    language = language.lower()
    if language == "python":
        return ENV_SET.format(given=json.dumps(env)), ENV_RESTORE
    if language == "bash":
        before = "".join(
            f'if [ -n "${{{k}+x}}" ]; then __sandlot_was_{k}=1 __sandlot_old_{k}="${k}"; '
            f"else __sandlot_was_{k}=; fi; export {k}={shell_quote(v)}; "
            for k, v in sorted(env.items())
        )
        after = "".join(
            f'if [ "${{{k}-}}" = {shell_quote(v)} ]; then if [ -n "$__sandlot_was_{k}" ]; '
            f'then export {k}="$__sandlot_old_{k}"; else unset {k}; fi; fi; '
            f"unset __sandlot_was_{k} __sandlot_old_{k}; "
            for k, v in sorted(env.items())
        )
        return before, after
    if language == "r":  # (JSON's string escapes but ``\/``, which it does not write, are R's)
        given = ", ".join(f"`{k}` = {json.dumps(v, ensure_ascii=False)}" for k, v in env.items())
        names = ", ".join(json.dumps(k) for k in env)
        return (
            f".sandlot_env <- list(new = c({given}), "
            f"old = Sys.getenv(c({names}), unset = NA, names = TRUE)); "  # (named: one name too)
            "invisible(do.call(Sys.setenv, as.list(.sandlot_env$new)))",
            "for (.sandlot_k in names(.sandlot_env$new)) if (identical(Sys.getenv(.sandlot_k, unset = NA), "
            "unname(.sandlot_env$new[.sandlot_k]))) { if (is.na(.sandlot_env$old[.sandlot_k])) "
            "Sys.unsetenv(.sandlot_k) else do.call(Sys.setenv, as.list(.sandlot_env$old[.sandlot_k])) }; "
            "rm(.sandlot_env, .sandlot_k)",
        )
    if language in ("javascript", "typescript"):
        return (
            f"globalThis.__sandlot_env = {{ given: {json.dumps(env)}, before: {{}} }};"
            " for (const [k, v] of Object.entries(globalThis.__sandlot_env.given)) {"
            " globalThis.__sandlot_env.before[k] = k in process.env ? process.env[k] : null;"
            " process.env[k] = v; }",
            "for (const [k, v] of Object.entries(globalThis.__sandlot_env.given)) {"
            " if (process.env[k] === v) {"
            " const b = globalThis.__sandlot_env.before[k]; if (b === null) delete process.env[k];"
            " else process.env[k] = b; } } delete globalThis.__sandlot_env;",
        )
    return None


def cell_env(value: Any) -> dict[str, str]:
    """A run's ``env``: names and values that are strings (the host checked them)."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str) and "\0" not in v}


def run_startup_files(namespace: dict[str, Any]) -> list[str]:
    """IPython's startup files (``$IPYTHONDIR/profile_default/startup/*.py``, by name: an
    image's, such as E2B's code interpreter template's), run in a new context's namespace
    before its first cell, as IPython runs them. One that fails (SystemExit too) does not
    stop the others or the context: what each said is returned."""
    import traceback

    root = os.environ.get("IPYTHONDIR") or os.path.join(os.path.expanduser("~"), ".ipython")
    folder = os.path.join(root, "profile_default", "startup")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    except OSError:
        return []
    failures = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                exec(compile(f.read(), path, "exec"), namespace)
        except BaseException as e:  # (a startup file never ends its context)
            lines = traceback.format_exception(type(e), e, e.__traceback__)
            failures.append(f"[the startup file {path} failed]\n{''.join(lines)}")
    return failures


class BuiltinKernel:
    interrupts_again = True  # (Server.interrupt_again)

    def __init__(self) -> None:
        self.count = 0
        self.interrupts_taken = 0
        signal.signal(signal.SIGINT, self.take_interrupt)
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        self.loop: Any = None
        import builtins

        builtins.display = display  # type: ignore[attr-defined]
        sys.meta_path.insert(0, ImportPatches())
        self.startup_failures = run_startup_files(self.namespace)  # told on the first cell's stderr

    def compile_cell(self, code: str, filename: str) -> list[Any]:
        flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
        tree = ast.parse(code, filename, "exec")
        units: list[Any] = []
        body = tree.body
        last = body[-1] if body and isinstance(body[-1], ast.Expr) else None
        if last is not None:
            body = body[:-1]
        if body:
            units.append(("exec", compile(ast.Module(body=body, type_ignores=[]), filename, "exec", flags)))
        if last is not None:
            expr = ast.Expression(body=last.value)
            units.append(("eval", compile(expr, filename, "eval", flags)))
        return units

    def python_of(self, code: str, filename: str) -> str:
        """The cell as Python: as it is, dedented (a cell indented as a whole, as code
        pasted from inside a block or a string is: IPython takes it so), or with IPython's
        escapes rewritten where it has them (a cell that is none of these raises the
        SyntaxError of the cell as written)."""
        try:
            ast.parse(code, filename, "exec")
            return code
        except SyntaxError:
            import textwrap

            dedented = textwrap.dedent(code)
            if dedented != code:
                with contextlib.suppress(SyntaxError):
                    ast.parse(dedented, filename, "exec")
                    return dedented
            rewritten = ipython_syntax(dedented)
            if rewritten is None:
                raise
            self.namespace.setdefault("_sandlot_ipython", IPythonEscapes(self.namespace))
            try:
                ast.parse(rewritten, filename, "exec")
            except SyntaxError:
                ast.parse(code, filename, "exec")  # the error as the cell was written
                raise
            return rewritten

    @contextlib.contextmanager
    def environment(self, env: dict[str, str]) -> Any:
        """``env`` set for the cell that runs inside (ENV_SET), in this process."""
        if not env:
            yield
            return
        given = json.dumps(env)
        scratch: dict[str, Any] = {}
        exec(ENV_SET.format(given=given), scratch)
        try:
            yield
        finally:
            exec(ENV_RESTORE, scratch)

    def run_unit(self, code: Any) -> Any:
        value = eval(code, self.namespace)
        if code.co_flags & 0x80:  # CO_COROUTINE: the cell awaited at top level
            import asyncio

            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            value = self.loop.run_until_complete(value)
        return value

    def execute(self, code: str, cell: Cell) -> int:
        if self.startup_failures:
            sys.stderr.write("".join(self.startup_failures))
            self.startup_failures = []
        self.count += 1
        filename = f"<cell {self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        value: Any = None
        try:
            for kind, unit in self.compile_cell(self.python_of(code, filename), filename):
                result = self.run_unit(unit)
                if kind == "eval":
                    value = result
        except BaseException as e:  # the cell's error, KeyboardInterrupt and SystemExit included
            OUT.settle()
            show_figures(cell)
            cell.error(type(e).__name__, str(e), self.format_traceback(e, filename))
            return self.count
        OUT.settle()
        if value is not None:
            self.namespace["_"] = value
            try:
                data = mime_bundle(value)
            except BaseException as e:
                cell.error(type(e).__name__, str(e), self.format_traceback(e, filename))
                return self.count
            show_figures(cell, skip=value)
            cell.result(data, True)
        else:
            show_figures(cell)
        return self.count

    def format_traceback(self, e: BaseException, filename: str) -> str:
        tb = e.__traceback__
        # leave out this kernel's own frames: the traceback starts in the cell
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
            tb = tb.tb_next
        if isinstance(e, SyntaxError):
            tb = None
        import traceback

        return "".join(traceback.format_exception(type(e), e, tb))

    def interrupt(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def take_interrupt(self, signum: int, frame: Any) -> None:
        """Python's own SIGINT handler, counted: ``Server.interrupt`` sees whether the
        cell took its interrupt."""
        self.interrupts_taken += 1
        raise KeyboardInterrupt

    def close(self) -> None:
        pass


# ---- a Jupyter kernel of the image -------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
KERNEL_DIRS = [
    "/usr/local/share/jupyter/kernels",
    "/usr/share/jupyter/kernels",
    os.path.join(sys.prefix, "share/jupyter/kernels"),
    os.path.expanduser("~/.local/share/jupyter/kernels"),
]


def kernelspecs() -> dict[str, dict[str, Any]]:
    """The Jupyter kernels this image has, by name."""
    found: dict[str, dict[str, Any]] = {}
    for base in KERNEL_DIRS:
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name, "kernel.json")
            try:
                with open(path) as f:
                    spec = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(spec, dict) and isinstance(spec.get("argv"), list):
                spec["resource_dir"] = os.path.dirname(path)
                found.setdefault(name, spec)
    return found


def find_kernelspec(wanted: str, language: str) -> Any:
    specs = kernelspecs()
    if wanted and wanted in specs:
        return wanted, specs[wanted]
    if not wanted:
        for name, spec in specs.items():
            if str(spec.get("language", "")).lower() == language.lower():
                return name, spec
    have = ", ".join("{} ({})".format(n, s.get("language")) for n, s in specs.items()) or "none"
    which = f"kernel {wanted!r}" if wanted else f"kernel for {language}"
    raise LookupError(f"this image has no Jupyter {which}; it has: {have}")


class JupyterKernel:
    """A Jupyter kernel of the image, spoken to over its ZeroMQ sockets (IPC files
    in the context's private directory, so no network is needed)."""

    interrupts_again = False  # (it takes its interrupts itself)

    def __init__(self, spec_name: str, language: str, directory: str) -> None:
        self.name, spec = find_kernelspec(spec_name, language)
        self.language = str(spec.get("language") or language)
        try:
            import zmq  # type: ignore[import-not-found]
        except ImportError:
            raise LookupError(f"this image has the Jupyter kernel {self.name} but no pyzmq") from None
        self.zmq = zmq
        self.count = 0
        self.key = os.urandom(16).hex().encode()
        self.session = os.urandom(16).hex()
        self.interrupt_mode = spec.get("interrupt_mode", "signal")
        base = os.path.join(directory, "kernel")
        conn = {
            "transport": "ipc",
            "ip": base,
            "shell_port": 1,
            "iopub_port": 2,
            "stdin_port": 3,
            "control_port": 4,
            "hb_port": 5,
            "key": self.key.decode(),
            "signature_scheme": "hmac-sha256",
            "kernel_name": self.name,
        }
        conn_file = os.path.join(directory, "connection.json")
        with open(conn_file, "w") as f:
            json.dump(conn, f)
        argv = [
            a.replace("{connection_file}", conn_file).replace("{resource_dir}", spec["resource_dir"])
            for a in spec["argv"]
        ]
        env = dict(os.environ)
        env.update(spec.get("env") or {})
        import subprocess

        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        ctx = zmq.Context.instance()
        self.shell = ctx.socket(zmq.DEALER)
        self.shell.connect(f"ipc://{base}-1")
        self.control = ctx.socket(zmq.DEALER)
        self.control.connect(f"ipc://{base}-4")
        self.iopub = ctx.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(f"ipc://{base}-2")
        self.wait_ready(120.0)

    def sign(self, parts: list[bytes]) -> bytes:
        import hashlib
        import hmac

        h = hmac.new(self.key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.hexdigest().encode()

    def send(self, sock: Any, msg_type: str, content: dict[str, Any]) -> str:
        msg_id = os.urandom(16).hex()
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "username": "sandlot",
            "session": self.session,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
            "version": "5.3",
        }
        parts = [json.dumps(p).encode() for p in (header, {}, {}, content)]
        sock.send_multipart([b"<IDS|MSG>", self.sign(parts), *parts])
        return msg_id

    def recv(self, sock: Any) -> dict[str, Any] | None:
        frames = sock.recv_multipart()
        try:
            i = frames.index(b"<IDS|MSG>")
        except ValueError:
            return None
        parts = frames[i + 2 : i + 6]
        import hmac

        if len(parts) < 4 or not hmac.compare_digest(self.sign(parts), frames[i + 1]):
            return None  # not signed with our key: not from our kernel
        header, parent, _, content = (json.loads(p) for p in parts)
        return {"header": header, "parent": parent, "content": content, "type": header.get("msg_type")}

    def died(self) -> int | None:
        return self.proc.poll()

    def wait_ready(self, timeout: float) -> None:
        """Ask kernel_info until the kernel answers and its iopub reaches us (a SUB
        socket misses what was published before it joined)."""
        zmq = self.zmq
        deadline = time.monotonic() + timeout
        replied = published = False
        while not (replied and published):
            if self.died() is not None:
                raise RuntimeError(f"the Jupyter kernel {self.name} exited with status {self.died()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Jupyter kernel {self.name} did not answer within {timeout:.0f}s")
            self.send(self.shell, "kernel_info_request", {})
            poller = zmq.Poller()
            poller.register(self.shell, zmq.POLLIN)
            poller.register(self.iopub, zmq.POLLIN)
            for sock, _ in poller.poll(500):
                msg = self.recv(sock)
                if msg and msg["type"] == "kernel_info_reply":
                    replied = True
                elif msg and sock is self.iopub:
                    published = True

    @contextlib.contextmanager
    def environment(self, env: dict[str, str]) -> Any:
        """``env`` set for the cell that runs inside, by the kernel itself, in its language
        (``env_code``: the host sends ``env`` only to a kernel whose language it knows)."""
        code = env_code(self.language, env) if env else None
        if code is None:
            yield
            return
        try:
            self.quietly(code[0])
        except RuntimeError as e:
            raise CellNotRun(str(e)) from None
        try:
            yield
        finally:
            if self.died() is None:
                with contextlib.suppress(KernelDied, RuntimeError):
                    self.quietly(code[1])

    def execute_request(self, code: str, *, silent: bool) -> str:
        """Send ``code`` to run: a cell (counted, in the history) or, ``silent``, not.
        stop_on_error False: the host sends one cell at a time, and an error in one must
        not make the kernel drop the next, which may already be on its way."""
        return self.send(
            self.shell,
            "execute_request",
            {"code": code, "silent": silent, "store_history": not silent, "user_expressions": {},
             "allow_stdin": False, "stop_on_error": False},
        )  # fmt: skip

    def quietly(self, code: str, timeout: float = 60.0) -> None:
        """Run ``code`` in the kernel outside the cells: silent, not counted, not in its history."""
        zmq = self.zmq
        msg_id = self.execute_request(code, silent=True)
        poller = zmq.Poller()
        poller.register(self.shell, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = poller.poll(200)
            if not events and self.died() is not None:
                raise KernelDied(f"the Jupyter kernel exited with status {self.died()}")
            for sock, _ in events:
                msg = self.recv(sock)
                if msg and msg["type"] == "execute_reply" and msg["parent"].get("msg_id") == msg_id:
                    if msg["content"].get("status") != "ok":
                        raise RuntimeError(
                            f"the kernel could not set the cell's environment: {msg['content']}"
                        )
                    return
        raise RuntimeError(f"the kernel did not set the cell's environment within {timeout:.0f}s")

    def execute(self, code: str, cell: Cell) -> int:
        zmq = self.zmq
        msg_id = self.execute_request(code, silent=False)
        idle = replied = False
        poller = zmq.Poller()
        poller.register(self.shell, zmq.POLLIN)
        poller.register(self.iopub, zmq.POLLIN)
        while not (idle and replied):
            events = poller.poll(200)
            if not events and self.died() is not None:
                raise KernelDied(f"the Jupyter kernel exited with status {self.died()} during this cell")
            for sock, _ in events:
                msg = self.recv(sock)
                if msg is None or msg["parent"].get("msg_id") != msg_id:
                    continue
                content, kind = msg["content"], msg["type"]
                if sock is self.shell and kind == "execute_reply":
                    replied = True
                    self.count = int(content.get("execution_count") or self.count + 1)
                    if content.get("status") == "aborted":
                        cell.error("Aborted", "the kernel did not run this cell (an earlier one failed)", "")
                elif kind == "stream":
                    OUT.stream(content.get("name", "stdout"), content.get("text", ""))
                elif kind in ("execute_result", "display_data"):
                    cell.result(content.get("data") or {}, kind == "execute_result")
                elif kind == "error":
                    tb = "\n".join(ANSI.sub("", line) for line in content.get("traceback") or [])
                    cell.error(content.get("ename", "Error"), content.get("evalue", ""), tb)
                elif kind == "status" and content.get("execution_state") == "idle":
                    idle = True
        return self.count

    def interrupt(self) -> None:
        if self.interrupt_mode == "message":
            self.send(self.control, "interrupt_request", {})
        else:
            os.killpg(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        if self.died() is None:
            try:
                self.send(self.control, "shutdown_request", {"restart": False})
                self.proc.wait(timeout=3)
            except Exception:
                pass
        if self.died() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# ---- sandlot's kernels of other languages ----------------------------------------
#
# A language's own process keeps the context's state (bash's variables, functions and
# working directory; Node's globals), and this process relays to it: each cell goes to
# it through a pipe, it writes the cell's output to fd 1 and 2 as any child of a cell
# does (FdCapture passes it on), and it answers on a pipe of its own once the cell has
# run, with a token only this cell's answer carries (a cell's processes may hold the
# pipe too). Images need no Jupyter kernel for these: bash, or node.

# Node's own REPL evaluates each cell (its top-level await keeps a cell's declarations,
# its last expression's value is the result); a static import, which the REPL refuses,
# becomes a dynamic one first, and TypeScript loses its types (Node 22.13+'s own
# stripping, else the image's typescript package).
NODE_DRIVER = r"""'use strict';
const fs = require('fs');
const path = require('path');
const repl = require('repl');
const util = require('util');
const vm = require('vm');
const { PassThrough } = require('stream');
const [cmdFd, replyFd] = process.argv.slice(2).map(Number);
const sink = new PassThrough();
sink.resume();
const server = repl.start({ input: new PassThrough(), output: sink, terminal: false, useGlobal: true,
                            breakEvalOnSigint: true, prompt: '', ignoreUndefined: true });
let pending = null;
function settle(err, value) { const p = pending; pending = null; if (p) p(err, value); }
server._domain.on('error', (e) => settle(e));  // the REPL reports a cell's error here, not to its callback
// SIGINT: while a cell's synchronous code runs, the REPL's watchdog takes it and stops the
// code; while a cell waits on a promise, or between cells, this listener ends the wait. The
// listener is off while the REPL runs a cell's code: the REPL takes every SIGINT listener
// off around the code, and the last one's going puts SIGINT back to its default, over the
// watchdog (measured: the process ended). A SIGINT in the moment between the listener's
// going and the watchdog's start (the cell's compile) still ends the kernel, whose next
// cell starts a new one; interrupts are not sent again to Node for that reason.
const INTERRUPTED = 'ERR_SCRIPT_EXECUTION_INTERRUPTED';
function interrupted() { settle(Object.assign(new Error('interrupted'), { code: INTERRUPTED })); }
process.on('SIGINT', interrupted);

const IMPORT = new RegExp(String.raw`(^|;)([ \t]*)import\s+(?:([\w$]+)\s*,?\s*)?` +
                          String.raw`(?:\*\s*as\s+([\w$]+)|\{([^}]*)\})?\s*from\s*(['"][^'"\n]+['"])`, 'gm');
const BARE_IMPORT = /(^|;)([ \t]*)import\s*(['"][^'"\n]+['"])/gm;
function dynamicImports(code) {
  return code.replace(IMPORT, (all, before, indent, def, ns, named, spec) => {
    if (ns) {
      const named = def ? ` var ${def} = ${ns}.default;` : '';
      return `${before}${indent}var ${ns} = await import(${spec});${named}`;
    }
    const names = def ? [`default: ${def}`] : [];
    for (const item of (named || '').split(',').map((s) => s.trim()).filter(Boolean)) {
      if (/^type\s/.test(item)) continue;
      const m = /^(\S+)\s+as\s+(\S+)$/.exec(item);
      names.push(m ? `${m[1]}: ${m[2]}` : item);
    }
    return `${before}${indent}var { ${names.join(', ')} } = await import(${spec});`;
  }).replace(BARE_IMPORT, (all, before, indent, spec) => `${before}${indent}await import(${spec});`);
}

function typescript() {
  const places = [path.join(process.cwd(), 'node_modules'), '/usr/local/lib/node_modules',
                  '/usr/lib/node_modules', '/usr/share/nodejs',
                  path.join(process.env.HOME || '/root', '.npm-global', 'lib', 'node_modules')];
  for (const where of [null, ...places]) {
    try {
      return where ? require(path.join(where, 'typescript')) : require('typescript');
    } catch (e) { /* the next place */ }
  }
  throw new Error('TypeScript cells need Node 22.13 or later, or the typescript package in the image ' +
                  '(npm install -g typescript, or Debian\'s node-typescript)');
}
function stripTypes(code) {
  const mod = require('module');
  if (typeof mod.stripTypeScriptTypes === 'function') {
    return mod.stripTypeScriptTypes(code, { mode: 'transform' });
  }
  const ts = typescript();
  return ts.transpileModule(code, { reportDiagnostics: false, compilerOptions: {
    target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, sourceMap: false } }).outputText;
}

function shown(value) {
  const display = value !== null && (typeof value === 'object' || typeof value === 'function')
    ? value[Symbol.for('Jupyter.display')] : undefined;
  if (typeof display === 'function') {
    const bundle = display.call(value);
    if (bundle && typeof bundle === 'object') return bundle;
  }
  return { 'text/plain': typeof value === 'string' ? value : util.inspect(value) };
}

// a traceback's frames in the cell, not the REPL's and this driver's under them
const OURS = /^\s+at .*(\(node:|\(?\/.*\/kernel\.js:|sigintHandlersWrap|<anonymous>\)|new Promise)/;
function traceback(err) {
  const lines = String(err.stack || err).split('\n');
  const cut = lines.findIndex((line) => OURS.test(line));
  return (cut < 0 ? lines : lines.slice(0, cut)).join('\n');
}
function failure(err) {
  if (err instanceof repl.Recoverable) err = err.err;  // a cell cut short: its SyntaxError
  if (err && err.code === INTERRUPTED) return { name: 'KeyboardInterrupt', value: '', traceback: '' };
  if (err instanceof Error) {
    return { name: err.name || 'Error', value: err.message || '', traceback: traceback(err) };
  }
  return { name: 'Error', value: util.inspect(err), traceback: 'Uncaught ' + util.inspect(err) };
}

async function run(msg) {
  if (msg.env) vm.runInThisContext(msg.env[0]);  // a cell's own variables (env_code's)
  let err = null, value;
  try {
    let code = msg.typescript ? stripTypes(msg.code) : msg.code;
    code = dynamicImports(code);
    [err, value] = await new Promise((resolve) => {
      pending = (e, v) => resolve([e, v]);
      process.removeListener('SIGINT', interrupted);
      try {
        server.eval(code, server.context, 'cell', (e, v) => settle(e, v));
      } catch (e) {
        settle(e);
      } finally {
        process.on('SIGINT', interrupted);
      }
    });
  } catch (e) {
    err = e;
  }
  if (msg.env) vm.runInThisContext(msg.env[1]);
  let reply = { token: msg.token };
  try {  // (a display method or an inspection that throws is the cell's error, never the kernel's end)
    if (err) reply.error = failure(err);
    else if (value !== undefined) reply.result = shown(value);
    reply = JSON.stringify(reply);
  } catch (e) {
    reply = JSON.stringify({ token: msg.token, error: failure(e) });
  }
  fs.writeSync(replyFd, reply + '\n');
}

const queue = [];
let running = false, buffered = '';
async function next() {
  if (running) return;
  running = true;
  while (queue.length) await run(queue.shift());
  running = false;
}
const commands = fs.createReadStream(null, { fd: cmdFd, encoding: 'utf8' });
commands.on('data', (data) => {
  buffered += data;
  let at;
  while ((at = buffered.indexOf('\n')) >= 0) {
    queue.push(JSON.parse(buffered.slice(0, at)));
    buffered = buffered.slice(at + 1);
  }
  next();
});
commands.on('end', () => process.exit(0));
fs.writeSync(replyFd, JSON.stringify({ token: process.env.SANDLOT_KERNEL_READY }) + '\n');
"""


class ProcessKernel(abc.ABC):
    """A kernel that is a process of the language's own (see above): a kind says how to
    start it (``argv``, ``stdin``, ``first_words``), what to send it for a cell
    (``cell_words``) and what its answer means (``report``)."""

    language = ""
    name = ""  # of its program, for errors
    interrupts_again = False  # (Server.interrupt_again)

    def __init__(self, directory: str) -> None:
        import subprocess

        self.count = 0
        self.directory = directory
        self.cell_env: dict[str, str] = {}
        self.buffered = b""
        cmd_r, self.cmd_w = os.pipe()
        self.reply_r, reply_w = os.pipe()
        self.reply_fd = reply_w  # (the same number in the child: pass_fds keeps it)
        ready = os.urandom(8).hex()
        env = dict(os.environ, SANDLOT_KERNEL_READY=ready)
        # SIGINT is how a cell is interrupted: a process that inherits it ignored (one
        # started in the background by a shell without job control does) could not be, and
        # bash cannot even trap it. A handler here is put back to the default in the child
        # by its exec; here, a SIGINT is nothing (this process's cells run in the child).
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        self.proc = subprocess.Popen(self.argv(cmd_r, reply_w), stdin=self.stdin(cmd_r), env=env,
                                     pass_fds=(cmd_r, reply_w), start_new_session=True)  # fmt: skip
        os.close(cmd_r)
        os.close(reply_w)
        self.send(self.first_words(ready))
        self.reply(ready, 60.0)

    @abc.abstractmethod
    def argv(self, cmd_r: int, reply_w: int) -> list[str]:
        """The program and its arguments (``cmd_r``, ``reply_w``: the two pipes' ends it gets)."""

    def stdin(self, cmd_r: int) -> Any:
        import subprocess

        return subprocess.DEVNULL

    def first_words(self, ready: str) -> bytes:
        return b""

    @abc.abstractmethod
    def cell_words(self, code: str, token: str) -> bytes:
        """What goes down the commands' pipe to run ``code`` (with ``cell_env``), answered
        with ``token``."""

    def send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # it has ended: the wait for its answer says so
            while data:  # (a cell larger than the pipe goes as the process reads it)
                data = data[os.write(self.cmd_w, data) :]

    def reply(self, token: str, timeout: float | None = None) -> dict[str, Any]:
        """The answer carrying ``token``; KernelDied if the process ends first."""
        import select

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while b"\n" in self.buffered:
                line, self.buffered = self.buffered.split(b"\n", 1)
                answer = self.parse(line)
                if answer is not None and answer.get("token") == token:
                    return answer
            readable, _, _ = select.select([self.reply_r], [], [], 0.2)
            data = os.read(self.reply_r, 65536) if readable else b""
            if data:
                self.buffered = (self.buffered + data)[-(1 << 20) :]
                continue
            if self.died() is not None:
                raise KernelDied(f"{self.name} exited with status {self.died()}")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {timeout:.0f}s")

    def parse(self, line: bytes) -> dict[str, Any] | None:
        with contextlib.suppress(ValueError):
            answer = json.loads(line)
            return answer if isinstance(answer, dict) else None
        return None

    def died(self) -> int | None:
        return self.proc.poll()

    @contextlib.contextmanager
    def environment(self, env: dict[str, str]) -> Any:
        """``env`` for the cell that runs inside: the language's process sets it, and puts
        back afterwards what the cell did not change itself."""
        self.cell_env = env
        try:
            yield
        finally:
            self.cell_env = {}

    def execute(self, code: str, cell: Cell) -> int:
        self.count += 1
        token = os.urandom(8).hex()
        self.send(self.cell_words(code, token))
        try:
            answer = self.reply(token)
        except KernelDied as e:
            OUT.settle()
            raise KernelDied(f"{e} during this cell") from None
        OUT.settle()
        self.report(answer, cell)
        return self.count

    @abc.abstractmethod
    def report(self, answer: dict[str, Any], cell: Cell) -> None:
        """The cell's error or result, from its answer."""

    def interrupt(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.cmd_w)  # the end of its commands: it exits
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=2)
        if self.died() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class ShellKernel(ProcessKernel):
    """bash, reading its commands from a pipe: each cell is written to a file of the
    context's directory and sourced, with no stdin (``</dev/null``) and without the
    answer's pipe. An interrupt is SIGINT to bash and what it runs: the cell's command
    ends, and bash's trap returns from the sourced cell, so the rest of it does not run
    and the shell's state stays. A cell whose last command fails is an error, as
    Jupyter's bash kernel reports it."""

    language = name = "bash"
    # a SIGINT that comes before bash has begun the cell's source runs the trap outside
    # it, and is lost: it is sent again while the cell runs (Server.interrupt_again)
    interrupts_again = True
    interrupts_taken = 0  # (bash does not say: the cell's end is the sign)

    def __init__(self, directory: str) -> None:
        import shutil

        self.shell = shutil.which("bash")
        if self.shell is None:
            raise LookupError("this image has no bash, which sandlot's bash kernel runs")
        self.cell_file = os.path.join(directory, "cell")
        super().__init__(directory)

    def argv(self, cmd_r: int, reply_w: int) -> list[str]:
        return [self.shell or "bash", "--noprofile", "--norc", "-s"]

    def stdin(self, cmd_r: int) -> Any:
        return cmd_r

    def first_words(self, ready: str) -> bytes:
        return (f"trap 'return 130 2>/dev/null' INT\n"
                f"printf '%s\\n' '{{\"token\": \"{ready}\"}}' >&{self.reply_fd}\n").encode()  # fmt: skip

    def cell_words(self, code: str, token: str) -> bytes:
        fd = os.open(self.cell_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(code)
        before, after = env_code("bash", self.cell_env) or ("", "")
        cell = f". {shell_quote(self.cell_file)} </dev/null {self.reply_fd}>&-"
        answer = f'printf \'{{"token": "%s", "status": %d}}\\n\' {token} "$__sandlot_status"'
        return f"{before}{cell}; __sandlot_status=$?; {after}{answer} >&{self.reply_fd}\n".encode()

    def report(self, answer: dict[str, Any], cell: Cell) -> None:
        status = answer.get("status")
        if status == 130:
            cell.error("KeyboardInterrupt", "", "")
        elif isinstance(status, int) and status:
            cell.error("ExitCode", str(status), f"the cell's last command exited with status {status}\n")


class NodeKernel(ProcessKernel):
    """Node.js running ``NODE_DRIVER``, for JavaScript, and TypeScript once its types are
    stripped. An interrupt is SIGINT: it stops a cell's synchronous code (the REPL's
    ``breakEvalOnSigint``) or ends its wait on a promise."""

    def __init__(self, directory: str, language: str) -> None:
        import shutil

        self.language, self.name = language, "node"
        self.node = shutil.which("node") or shutil.which("nodejs")
        if self.node is None:
            raise LookupError(f"this image has no node (Node.js), which sandlot's {language} kernel runs")
        self.driver = os.path.join(directory, "kernel.js")
        with open(self.driver, "w") as f:
            f.write(NODE_DRIVER)
        super().__init__(directory)

    def argv(self, cmd_r: int, reply_w: int) -> list[str]:
        return [self.node or "node", self.driver, str(cmd_r), str(reply_w)]

    def cell_words(self, code: str, token: str) -> bytes:
        env = env_code("javascript", self.cell_env) if self.cell_env else None
        msg = {"token": token, "code": code, "typescript": self.language == "typescript", "env": env}
        return (json.dumps(msg) + "\n").encode()

    def report(self, answer: dict[str, Any], cell: Cell) -> None:
        error = answer.get("error")
        if isinstance(error, dict):
            cell.error(str(error.get("name") or "Error"), str(error.get("value") or ""),
                       str(error.get("traceback") or ""))  # fmt: skip
        elif isinstance(answer.get("result"), dict):
            cell.result(answer["result"], True)


BUILTIN_LANGUAGES = ("python", "bash", "javascript", "typescript")


def builtin_kernel(language: str, directory: str) -> Any:
    """sandlot's own kernel for ``language`` (LookupError where it has none, or the image
    lacks what it runs on)."""
    if language == "python":
        return BuiltinKernel()
    if language == "bash":
        return ShellKernel(directory)
    if language in ("javascript", "typescript"):
        return NodeKernel(directory, language)
    have = ", ".join(BUILTIN_LANGUAGES)
    raise LookupError(f"sandlot has no kernel of its own for {language} (it has {have})")


class KernelDied(Exception):
    pass


class CellNotRun(Exception):
    """The cell could not be run as asked (its environment could not be set): its error,
    and the context goes on."""


# ---- serving -----------------------------------------------------------------


class Server:
    def __init__(self, kernel: Any, directory: str, info: dict[str, Any]) -> None:
        self.kernel = kernel
        self.directory = directory
        self.info = info
        self.cells: queue.Queue[Any] = queue.Queue()
        self.busy = False
        self.busy_lock = threading.Lock()
        self.running: str | None = None  # the id of the cell that runs now
        self.waiting: dict[str, Client] = {}  # the cells queued behind it, by id
        self.skipped: set[str] = set()  # queued cells interrupted before their turn

    def serve(self, listener: socket.socket) -> None:
        thread(self.accept, listener)
        thread(self.flusher)
        while True:
            try:
                item = self.cells.get()
            except KeyboardInterrupt:
                continue  # an interrupt that came after its cell had finished
            if item is None:
                break
            client, rid, code, env = item
            cell = Cell(client, rid)
            try:
                with self.busy_lock:
                    if rid in self.skipped:  # interrupted while it waited, and answered then
                        self.skipped.discard(rid)
                        continue
                    self.waiting.pop(rid, None)
                    self.busy, self.running = True, rid
                    OUT.cell = cell
                with self.kernel.environment(env):
                    count = self.kernel.execute(code, cell)
            except KeyboardInterrupt:
                count = self.kernel.count  # an interrupt outside the cell's own code
            except CellNotRun as e:
                cell.error("CellNotRun", str(e), "")
                count = self.kernel.count
            except KernelDied as e:
                cell.error("KernelDied", str(e), "")
                cell.done(self.kernel.count)
                self.shutdown(1)
            finally:
                with self.busy_lock:
                    self.busy, self.running = False, None
                    OUT.cell = None
            cell.done(count)
        self.shutdown(0)

    def flusher(self) -> None:
        while True:
            time.sleep(FLUSH_SECONDS)
            cell = OUT.cell
            if cell is not None:
                cell.flush()

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as e:
                if e.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                raise
            thread(self.read, Client(sock))

    def read(self, client: Client) -> None:
        buf = b""
        while True:
            try:
                data = client.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                client.open = False
                client.sock.close()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                    op = msg["op"]
                except (ValueError, KeyError, TypeError):
                    client.send({"ev": "invalid", "message": "not a JSON request with an op"})
                    continue
                self.handle(client, op, msg)

    def handle(self, client: Client, op: str, msg: dict[str, Any]) -> None:
        if op == "run":
            rid = str(msg.get("id", ""))
            with self.busy_lock:
                self.waiting[rid] = client
            self.cells.put((client, rid, str(msg.get("code", "")), cell_env(msg.get("env"))))
        elif op == "interrupt":
            named = msg.get("id")
            self.interrupt(named if isinstance(named, str) else None)
        elif op == "info":
            info = dict(self.info, count=self.kernel.count, busy=self.busy, queued=self.cells.qsize())
            client.send(dict(info, ev="info"))
        elif op == "shutdown":
            self.cells.put(None)
        elif op == "kill":  # the context stays: its next cell starts a new interpreter
            if isinstance(self.kernel, (JupyterKernel, ProcessKernel)):
                self.kernel.close()
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            client.send({"ev": "invalid", "message": f"unknown op {op!r}"})

    def interrupt(self, rid: str | None) -> None:
        """Interrupt the cell that runs, or the one ``rid`` names: a cell still queued
        behind another (a host's timeout fires whether or not its cell has started) ends
        at once as interrupted and never runs, and the one running goes on. A cell that
        has ended already is left alone."""
        with self.busy_lock:
            if self.busy and rid in (None, self.running):
                if self.kernel.interrupts_again:  # (a Jupyter kernel takes its own)
                    thread(self.interrupt_again, self.running, self.kernel.interrupts_taken)
                self.kernel.interrupt()
                return
            client = self.waiting.pop(rid, None) if rid is not None else None
            if rid is None or client is None:
                return
            self.skipped.add(rid)
        cell = Cell(client, rid)
        cell.error("KeyboardInterrupt", "", "interrupted before it started\n")
        cell.done(self.kernel.count)

    def interrupt_again(self, rid: str, taken: int) -> None:
        """Send the running cell's interrupt again until it is taken: a SIGINT that lands
        between the interpreter's last look for signals and a blocking call (a sleep, a
        read) is taken only when that call returns, a minute later perhaps. A cell that
        ignores SIGINT never takes it; the host ends its interpreter after its grace."""
        for _ in range(INTERRUPT_AGAIN):
            time.sleep(INTERRUPT_AGAIN_EVERY)
            with self.busy_lock:
                if not (self.busy and self.running == rid) or self.kernel.interrupts_taken > taken:
                    return
                self.kernel.interrupt()

    def remove_files(self) -> None:
        remove_dir(self.directory)

    def shutdown(self, status: int) -> None:
        self.remove_files()
        try:
            self.kernel.close()
        finally:
            os._exit(status)


def start(args: Args) -> int:
    """Start the context in a new session, detached from the command that started
    it, and report once it listens (or why it could not)."""
    directory = os.path.join(args.root, args.id)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        if answers(os.path.join(directory, "sock")):
            sys.stderr.write(f"code context {args.id} is already running\n")
            return 17
        for name in os.listdir(directory):  # what a context that died left behind
            os.unlink(os.path.join(directory, name))
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.setsid()
        if os.fork():
            os._exit(0)
        try:
            serve_context(args, directory, ready_w)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.write(ready_w, json.dumps({"error": f"{type(e).__name__}: {e}\n"}).encode())
            os._exit(1)
        os._exit(0)
    os.close(ready_w)
    os.waitpid(pid, 0)
    with os.fdopen(ready_r, "rb") as f:
        said = f.read()
    try:
        report = json.loads(said or b"{}")
    except ValueError:
        report = {"error": said.decode(errors="replace")}
    if "error" in report or not report:
        remove_dir(directory)  # with what it made before it failed (its socket...)
        sys.stderr.write(report.get("error") or "the context exited before it answered\n")
        return 1
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


def remove_dir(directory: str) -> None:
    """A context's directory, and the files in it."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def serve_context(args: Args, directory: str, ready_w: int) -> None:
    # the command that started us ends when nothing holds its output: not this
    # process, nor a Jupyter kernel it starts
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.environ.setdefault("MPLBACKEND", "Agg")  # figures render to PNG results, never to a display
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    kernel = jupyter = None
    no_jupyter = ""
    if args.kernel.startswith("jupyter:"):
        kernel = jupyter = JupyterKernel(args.kernel.partition(":")[2], args.language, directory)
    elif args.kernel == "auto":  # the image's Jupyter kernel for the language, else sandlot's own
        try:
            kernel = jupyter = JupyterKernel("", args.language, directory)
        except LookupError as e:
            if args.language not in BUILTIN_LANGUAGES:
                raise
            no_jupyter = str(e)
    elif args.kernel != "builtin":
        raise LookupError(f"unknown kernel {args.kernel!r}")
    path = os.path.join(directory, "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # from here fd 1 and 2 belong to the cells (sandlot's kernels of other languages write
    # there, so they start after this); the report goes through the pipe
    OUT.fd_readers = [FdCapture(1, "stdout"), FdCapture(2, "stderr")]
    os.close(devnull)
    sys.stdout = TextStream("stdout")
    sys.stderr = TextStream("stderr")
    if kernel is None:
        try:
            kernel = builtin_kernel(args.language, directory)
        except LookupError as e:
            raise LookupError(f"{no_jupyter}; and {e}" if no_jupyter else str(e)) from None
    info = {
        "id": args.id,
        "language": args.language,
        "kernel": "jupyter:" + jupyter.name if jupyter is not None else "builtin",
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "created": time.time(),
        "options": json.loads(args.options),
        # what this interpreter's host may ask of it beyond the first protocol: "cell-env", a
        # cell's own variables in this kernel's language (every kernel of sandlot's own)
        "features": ["env", *(["cell-env"] if jupyter is None or env_code(jupyter.language, {}) else [])],
    }
    with open(os.path.join(directory, "info.json.tmp"), "w") as f:
        json.dump(info, f)
    os.rename(os.path.join(directory, "info.json.tmp"), os.path.join(directory, "info.json"))
    server = Server(kernel, directory, info)
    os.write(ready_w, json.dumps(info).encode())
    os.close(ready_w)
    server.serve(listener)


class Args:
    """``start --root DIR --id ID [--language L] [--kernel K] [--options JSON]`` (by hand:
    argparse alone costs a fifth of a second to import under emulation)."""

    def __init__(self, argv: list[str]) -> None:
        if not argv or argv[0] != "start" or len(argv) % 2 != 1:
            raise SystemExit("usage: interpreter.py start --root DIR --id ID [--language L] [--kernel K]")
        given = {argv[i]: argv[i + 1] for i in range(1, len(argv), 2)}  # zip(strict=) is 3.10+
        unknown = set(given) - {"--root", "--id", "--language", "--kernel", "--options"}
        if unknown or "--root" not in given or "--id" not in given:
            raise SystemExit(f"interpreter.py start: bad options {sorted(unknown) or 'missing --root/--id'}")
        self.root = given["--root"]
        self.id = given["--id"]
        self.language = given.get("--language", "python")
        self.kernel = given.get("--kernel", "builtin")
        self.options = given.get("--options", "{}")


def main(argv: list[str] | None = None) -> int:
    return start(Args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
