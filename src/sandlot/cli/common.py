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
from typer._click import Command as ClickCommand
from typer._click import Context as ClickContext
from typer._click import Parameter
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption
from typer.models import CommandFunctionType

from ..errors import SandlotError
from ..version import __version__
from .table import COMMANDS, GROUPS
from .text import age, human

if TYPE_CHECKING:
    from ..api.box import AsyncBox

# -- how commands show in help -----------------------------------------------------------------
# typer builds every parameter with its own classes and has no setting for these;
# sandlot's command classes (below) give their parameters these subclasses instead.


class Argument(TyperArgument):
    """An argument as click writes it, ``BOX``, ``[GUEST]``, ``NAMES...`` (or its metavar
    as given), where typer writes ``{box}`` and a type tag such as ``<str>``."""

    @property
    def display_name_raw(self) -> str:
        return self.metavar or (self.name or "").upper()

    def display_type_rich(self, ctx: ClickContext) -> str | None:
        return None

    def get_usage_pieces(self, ctx: ClickContext) -> list[str]:
        if self.metavar is not None:
            return [self.metavar]
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return [name + ("..." if self.nargs != 1 else "")]


class Option(TyperOption):
    """An option without typer's type tag (``--name <str>``, ``--rm <bool>``): its help
    says what it takes; a metavar given is shown."""

    def display_type_rich(self, ctx: ClickContext) -> str | None:
        return self.metavar or ""  # not None: typer's plain help (no rich) would print "None"


def plain(param: Parameter | None) -> None:
    """Make ``param`` show as sandlot shows parameters in help (the same object, with
    all it holds: only its class changes)."""
    if isinstance(param, TyperArgument):
        param.__class__ = Argument
    elif isinstance(param, TyperOption):
        param.__class__ = Option


class Plain(ClickCommand):
    """What sandlot's commands and groups share: their parameters are ``plain``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            plain(param)

    def get_help_option(self, ctx: ClickContext) -> TyperOption | None:
        option = super().get_help_option(ctx)  # made when first asked for, with the names of ctx
        plain(option)
        return option


class Command(Plain, TyperCommand):
    pass


class Group(Plain, TyperGroup):
    pass


class Root(Group):
    """``sandlot``: its commands in the groups and the order of ``sandlot.cli.GROUPS``,
    whichever module registered them first."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        panels = {command: panel for panel, commands in GROUPS.items() for command in commands}
        for name, command in self.commands.items():
            if isinstance(command, TyperCommand | TyperGroup):
                command.rich_help_panel = panels.get(name)

    def list_commands(self, ctx: ClickContext) -> list[str]:
        order = {command: i for i, command in enumerate(COMMANDS)}  # the groups' order, theirs in turn
        return sorted(self.commands, key=lambda name: order.get(name, len(order)))


class Sandlot(typer.Typer):
    """A typer app whose commands and groups are of the classes above."""

    def __init__(self, *, cls: type[TyperGroup] = Group, **options: Any) -> None:
        super().__init__(cls=cls, **options)

    def command(
        self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **options: Any
    ) -> Callable[[CommandFunctionType], CommandFunctionType]:
        return super().command(name, cls=cls or Command, **options)


app = Sandlot(
    cls=Root,
    name="sandlot",
    help="Embeddable microVM sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=False,  # `sandlot completion SHELL` prints the script (cli/completion.py)
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["--help", "-h"]},  # the subcommands' contexts inherit them
)
err = Console(stderr=True)
__all__ = ["QuietOpt", "Sandlot", "age", "app", "busy", "err", "fail", "for_each_box", "human", "on_terminal",
           "only", "run_coro"]  # fmt: skip

QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress display (there is none off a terminal either).")
]


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
    """Run a command's coroutine in the main thread (signals and terminal belong to it),
    then let the flight recorder take the checkpoints of the steps it made."""
    from .quick import then_settled

    try:
        return asyncio.run(then_settled(coro))
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
