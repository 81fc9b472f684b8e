"""What every command module shares: the typer app, error reporting, helpers."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import SandlotError
from ..version import __version__
from .text import age, human

if TYPE_CHECKING:
    from ..api.box import AsyncBox

app = typer.Typer(
    name="sandlot",
    help="Embeddable microVM sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
__all__ = ["age", "app", "busy", "err", "fail", "for_each_box", "human", "on_terminal", "only", "run_coro"]


def only(typer_app: typer.Typer, command: str) -> None:
    """Keep only ``command`` on ``typer_app``: typer converts every command it holds (and
    builds a validator for each of its parameters) before it runs one."""
    typer_app.registered_commands = [
        c for c in typer_app.registered_commands
        if str(c.name or getattr(c.callback, "__name__", "")).lower().replace("_", "-") == command
    ]  # fmt: skip
    typer_app.registered_groups = [g for g in typer_app.registered_groups if g.name == command]


def fail(exc: BaseException | str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def on_terminal(quiet: bool = False) -> bool:
    """Whether progress belongs on screen: stdout and stderr are a terminal, and no
    ``--quiet`` or ``--json`` asked for output that a script reads."""
    return not quiet and sys.stdout.isatty() and sys.stderr.isatty()


@contextlib.contextmanager
def busy(message: str, *, quiet: bool = False) -> Iterator[None]:
    """A spinner, ``message`` and the time so far on stderr while a long operation runs
    (only ``on_terminal``); it goes when the operation ends."""
    if not on_terminal(quiet):
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        progress.add_task(message, total=None)
        yield


def run_coro(coro: Awaitable[int | None]) -> int | None:
    """Run a command's coroutine in the main thread (signals and terminal belong to it)."""
    try:
        return asyncio.run(coro)  # type: ignore[arg-type]
    except FileNotFoundError as exc:
        raise fail(exc, 127) from exc
    except SandlotError as exc:
        raise fail(exc, 125) from exc


def for_each_box(boxes: list[str], action: Callable[[AsyncBox], Awaitable[Any]], verb: str) -> None:
    """Apply an action to several boxes; report each, fail if any failed."""
    from ..api.box import AsyncBox

    failed = False

    async def main() -> None:
        nonlocal failed
        for key in boxes:
            try:
                box = await AsyncBox.get(key)
                await action(box)
                print(box.name)
            except SandlotError as exc:
                failed = True
                fail(f"{verb} {key}: {exc}")

    asyncio.run(main())
    if failed:
        raise typer.Exit(1)


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", is_eager=True)
    ] = False,
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(2)
