"""``sandlot ls`` and ``sandlot exec``, the commands scripts run most, without typer.

typer converts a command's parameters through pydantic validators it builds at
every start, which costs more than the rest of ``sandlot ls`` together. The plain
forms of these two commands are parsed here instead, by click's rules; anything
else (``--help``, a flag this parser does not know, a usage error) returns None
and goes to typer, which runs the same code below (``boxes.ls``, ``boxes.exec_cmd``)
or says what is wrong. ``tests/unit/test_cli_lean.py`` holds what this parser makes
of each form to what typer makes of it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..api.listing import settled_listing
from ..core.validate import env_pairs
from ..errors import SandlotError
from .text import age

T = TypeVar("T")

if TYPE_CHECKING:
    from ..api.box import AsyncBox

# The box API, the event loop and the terminal are imported by the functions that use
# them: a listing whose boxes need no recovery reads the store without any of them
# (``api.listing``), and its start is most of what ``sandlot ls`` costs.

# -- what both paths run ----------------------------------------------------------------------


async def exec_attached(
    box: AsyncBox, argv: list[str], *, interactive: bool, tty_mode: bool, env: dict[str, str] | None = None,
    workdir: str | None = None, user: str | None = None, timeout: float | None = None,
) -> int:  # fmt: skip
    """As Docker does: stdin is forwarded only with -i; -t gives a terminal (raw mode here)."""
    from .terminal import attach, raw_terminal, terminal_size

    rows, cols = terminal_size()
    proc = await box.spawn(
        *argv, env=env, cwd=workdir, user=user, tty=tty_mode, rows=rows, cols=cols, stdin=True
    )
    if tty_mode and interactive and sys.stdin.isatty():
        with raw_terminal(sys.stdin.fileno()):
            return await attach(proc, stdin=True, tty_mode=True, timeout=timeout)
    return await attach(proc, stdin=interactive, tty_mode=tty_mode, timeout=timeout)


async def exec_in(key: str, argv: list[str], **options: Any) -> int:
    """``sandlot exec``: the command's exit status."""
    from ..api.box import AsyncBox

    return await exec_attached(await AsyncBox.get(key), argv, **options)


def filters(items: list[str] | None) -> tuple[dict[str, str], str | None]:
    """``--filter label=K=V`` and ``--filter state=S``: (labels, state); ValueError otherwise."""
    labels: dict[str, str] = {}
    state = None
    for f in items or []:
        key, _, value = f.partition("=")
        if key == "label":
            k, _, v = value.partition("=")
            labels[k] = v
        elif key == "state":
            state = value
        else:
            raise ValueError(f"unknown filter {f!r} (label=K=V or state=S)")
    return labels, state


def listing(all_: bool, labels: dict[str, str], state: str | None) -> list[dict[str, Any]]:
    """The records ``sandlot ls`` shows: read as they are where none needs recovery,
    else through the box API, which recovers them first."""
    include_stopped = all_ or state is not None
    records = settled_listing(include_stopped=include_stopped, state=state, labels=labels or None)
    if records is not None:
        return records
    import asyncio

    from ..api.box import AsyncBox
    from ..api.local import local

    async def recovered() -> list[dict[str, Any]]:
        boxes = await AsyncBox.list(all=include_stopped, state=state, labels=labels or None)
        return [local(b.ref).record.to_json() for b in boxes]  # the store's records, as just listed

    return asyncio.run(recovered())


def show_listing(records: list[dict[str, Any]], *, quiet: bool, as_json: bool) -> None:
    if quiet:
        for rec in records:
            print(rec["name"])
        return
    if as_json:
        print(json.dumps(records, indent=1))
        return
    rows = [["NAME", "ID", "IMAGE", "STATE", "CREATED", "STATUS"]]
    for r in records:
        source = (r["image_ref"] or "").removeprefix("docker.io/").removeprefix("library/")
        state = r["state"]
        status = (
            r["reason"]
            if state == "crashed" and r["reason"]
            else age(r["started_at"] if state == "running" else r["stopped_at"])
        )
        rows.append([r["name"], r["id"], source or f"rootfs:{r['rootfs']}", state, age(r["created_at"]),
                     status or "-"])  # fmt: skip
    print(columns(rows), end="")


def columns(rows: list[list[str]]) -> str:
    """Rows as left-aligned columns two spaces apart, as ``docker ps`` prints them: never
    wrapped or cut to a terminal's width, so that scripts can split them."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows
    )


# -- the fast path ----------------------------------------------------------------------------


def say_error(message: str) -> None:
    """``error: ...`` on stderr, as ``common.fail`` prints it (in color on a terminal)."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    else:
        print(f"error: {message}", file=sys.stderr)


async def then_settled(coro: Awaitable[T]) -> T:
    """A command's coroutine, then the flight recorder's checkpoints of the steps it made
    (``asyncio.run`` would cancel their tasks): a command's last step is kept."""
    try:
        return await coro
    finally:
        # loaded only by a command that reached a local box: ``sandlot ls`` stays lean
        local = sys.modules.get("sandlot.api.local")
        if local is not None:
            await local.settle_recorders()


def finish(coro: Awaitable[int]) -> int:
    """Run a command's coroutine; sandlot's own failures exit 125, a missing command 127
    (as ``common.run_coro``)."""
    import asyncio

    try:
        return asyncio.run(then_settled(coro))
    except FileNotFoundError as exc:
        say_error(str(exc))
        return 127
    except SandlotError as exc:
        say_error(str(exc))
        return 125


def options(
    args: list[str], flags: dict[str, str], valued: dict[str, str]
) -> tuple[dict[str, Any], int] | None:
    """Options before the first positional argument, by click's rules for the forms it
    takes here: ``-a``, ``--all``, ``-it`` (short flags together), ``-f V``, ``--filter V``,
    ``--filter=V``. Returns (values, index of the first positional) or None for anything
    else. ``flags``/``valued``: option spelling -> parameter name."""
    got: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-" or not arg.startswith("-"):
            break
        if arg in flags:
            got[flags[arg]] = True
        elif arg in valued:
            if i + 1 >= len(args):
                return None
            got.setdefault(valued[arg], []).append(args[i + 1])
            i += 1
        elif arg.startswith("--") and "=" in arg and arg.split("=", 1)[0] in valued:
            name, value = arg.split("=", 1)
            got.setdefault(valued[name], []).append(value)
        elif not arg.startswith("--") and len(arg) > 2 and all(f"-{c}" in flags for c in arg[1:]):
            got.update({flags[f"-{c}"]: True for c in arg[1:]})
        else:
            return None
        i += 1
    return got, i


def parse_ls(args: list[str]) -> dict[str, Any] | None:
    flags = {"-a": "all_", "--all": "all_", "-q": "quiet", "--quiet": "quiet", "--json": "as_json"}
    parsed = options(args, flags, {"-f": "filter_", "--filter": "filter_"})
    if parsed is None or parsed[1] != len(args):
        return None
    got = parsed[0]
    try:
        filters(got.get("filter_"))
    except ValueError:
        return None
    return {"all_": False, "filter_": None, "quiet": False, "as_json": False, **got}


def parse_exec(args: list[str]) -> dict[str, Any] | None:
    flags = {"-i": "interactive", "--interactive": "interactive", "-t": "tty_mode", "--tty": "tty_mode"}
    valued = {"-e": "env", "--env": "env", "-w": "workdir", "--workdir": "workdir", "-u": "user",
              "--user": "user", "--timeout": "timeout"}  # fmt: skip
    parsed = options(args, flags, valued)
    if parsed is None:
        return None
    got, first = parsed
    rest = args[first:]
    if rest and rest[0] == "--":
        return None  # click ends its options there; leave the rare form to it
    if len(rest) < 2:
        return None  # typer prints the usage
    for name in ("workdir", "user", "timeout"):  # given once (click keeps the last; so would we)
        if name in got:
            got[name] = got[name][-1]
    if "timeout" in got:
        try:
            got["timeout"] = float(got["timeout"])
        except ValueError:
            return None
        if not math.isfinite(got["timeout"]):
            return None
    argv = rest[1:]
    if argv[0] == "--":
        argv = argv[1:]
    return {"interactive": False, "tty_mode": False, "env": None, "workdir": None, "user": None,
            "timeout": None, **got, "key": rest[0], "argv": argv}  # fmt: skip


def run_ls(all_: bool, filter_: list[str] | None, quiet: bool, as_json: bool) -> int:
    labels, state = filters(filter_)
    try:
        records = listing(all_, labels, state)
    except SandlotError as exc:
        say_error(str(exc))
        return 1
    show_listing(records, quiet=quiet, as_json=as_json)
    return 0


def run_exec(key: str, argv: list[str], *, env: list[str] | None, **options: Any) -> int:
    return finish(exec_in(key, argv, env=env_pairs(env) or None, **options))


FAST: dict[str, tuple[Callable[[list[str]], dict[str, Any] | None], Callable[..., int]]] = {
    "ls": (parse_ls, run_ls),
    "exec": (parse_exec, run_exec),
}


def run(argv: list[str]) -> int | None:
    """Run ``sandlot ARGV`` here if it is a plain ``ls`` or ``exec``: its exit status;
    None: typer's to parse."""
    if not argv or argv[0] not in FAST:
        return None
    parse, command = FAST[argv[0]]
    parsed = parse(argv[1:])
    return None if parsed is None else command(**parsed)
