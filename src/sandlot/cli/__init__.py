"""The ``sandlot`` command line, in the Docker idiom.

    sandlot doctor | setup | rootfs busybox|debian DIR          the host
    sandlot pull | images | rmi | load | import | inspect-image  images
    sandlot run | create | start | stop | restart | pause | unpause | rm |
            ls | exec | cp | logs | inspect | stats              boxes
    sandlot snapshot | snapshots | rollback | fork | suspend |
            resume | template                                  live state

Exit codes: a command's own status for ``run`` and ``exec``; 125 when sandlot
itself failed; 127 when the command does not exist; 2 for usage errors.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from .. import __version__

app = typer.Typer(
    name="sandlot",
    help="Embeddable microVM sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


def fail(exc: BaseException | str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


def main() -> None:
    import sys

    from . import boxes, host, images, livestate  # noqa: F401 - they register their commands on `app`

    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
