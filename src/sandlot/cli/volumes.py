"""Named volumes: filesystems that outlive boxes, mounted by name (``sandlot run -v data:/data``).

sandlot volume create NAME [--size-gb N] [--label K=V]   an empty volume
sandlot volume ls [--json]                               every volume
sandlot volume inspect NAME                              as JSON: size, labels, boxes, holder
sandlot volume rm NAME...                                refused while a box mounts it
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer

from ..core.validate import label_pairs
from ..errors import InvalidArgument
from .common import Sandlot, app, fail, run_coro

volume_app = Sandlot(help="Named volumes: create, ls, inspect, rm.", no_args_is_help=True)
app.add_typer(volume_app, name="volume")


@volume_app.command("create")
def volume_create(
    name: Annotated[str, typer.Argument(help="Its name: letters, digits, '_', '.', '-'.")],
    size_gb: Annotated[
        float | None, typer.Option("--size-gb", help="Its filesystem's size, in GiB (default 10).")
    ] = None,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="KEY=VALUE (repeatable).")] = None,
    shared: Annotated[
        bool, typer.Option("--shared", help="A directory that the boxes mounting it share live (no size).")
    ] = False,
) -> None:
    """Create an empty volume; mount it with `sandlot run -v NAME:/path IMAGE`."""
    from ..api.volumes import AsyncVolumes

    try:
        labels = label_pairs(label)
    except InvalidArgument as exc:
        raise fail(exc, 2) from exc

    async def main() -> None:
        made = await AsyncVolumes().create(name, size_gb=size_gb, labels=labels, shared=shared)
        print(made.name)

    run_coro(main())


@volume_app.command("ls")
def volume_ls(as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False) -> None:
    """Every volume: its size, what its layers take on the host, the boxes that mount it."""
    from rich.console import Console
    from rich.table import Table

    from ..api.volumes import AsyncVolumes

    async def main() -> None:
        found = await AsyncVolumes().list()
        if as_json:
            print(json.dumps([await AsyncVolumes().inspect(v.id) for v in found], indent=2))
            return
        table = Table(box=None, pad_edge=False)
        for col in ("NAME", "SIZE", "ON HOST", "BOXES", "HOLDER", "CREATED"):
            table.add_column(col)
        now = time.time()
        for v in found:
            boxes = ", ".join(f"{b['name']} ({b['mode']})" for b in v.boxes) or "-"
            size = "shared" if v.kind == "shared" else f"{v.size_gb:g} GiB"
            table.add_row(v.name, size, f"{v.host_bytes / (1 << 20):.1f} MiB", boxes,
                          v.holder or "-", f"{int(now - v.created_at)}s ago")  # fmt: skip
        Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 1000).print(table)

    run_coro(main())


@volume_app.command("inspect")
def volume_inspect(name: Annotated[str, typer.Argument(help="The volume's name or id.")]) -> None:
    """The volume as JSON: size, labels, the boxes that mount it, the one that writes it back."""
    from ..api.volumes import AsyncVolumes

    async def main() -> None:
        print(json.dumps(await AsyncVolumes().inspect(name), indent=2))

    run_coro(main())


@volume_app.command("rm")
def volume_rm(names: Annotated[list[str], typer.Argument(help="Volumes' names or ids.")]) -> None:
    """Remove volumes (refused while a box mounts one); snapshots keep their copies."""
    from ..api.volumes import AsyncVolumes

    async def main() -> None:
        for name in names:
            await AsyncVolumes().remove(name)
            print(name)

    run_coro(main())
