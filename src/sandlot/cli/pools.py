"""Warm pools of templates: VMs restored ahead of time, paused until a box claims one.

sandlot pool set TEMPLATE N [--wait]   keep N ready (0: none, and its VMs go)
sandlot pool ls [--json]               each pool: size, ready, filling, memory, the cap
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from .common import Sandlot, app, fail, run_coro

pool_app = Sandlot(help="Warm pools of templates: set, ls.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")


@pool_app.command("set")
def pool_set(
    template: Annotated[str, typer.Argument(help="The template's name or id.")],
    size: Annotated[int, typer.Argument(help="VMs to keep ready (0: none).")],
    wait: Annotated[bool, typer.Option("--wait", help="Fill (or drain) before returning.")] = False,
) -> None:
    """Keep SIZE VMs of TEMPLATE restored, first exec done, paused until Box(template=...) claims one."""
    from ..api.templates import set_pool_async

    async def main() -> None:
        info = await set_pool_async(template, size, wait=wait)
        print(f"{info.template}\tsize {info.size}\tready {info.ready}\tfilling {info.filling}")

    if size < 0:
        raise fail("a pool's size is 0 or more", 2)
    run_coro(main())


@pool_app.command("ls")
def pool_ls(as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False) -> None:
    """Each template's pool: its size, VMs ready and being made, their memory, and the cap."""
    from rich.console import Console
    from rich.table import Table

    from ..api.templates import pools_async

    async def main() -> None:
        found = [p.to_json() for p in await pools_async()]
        if as_json:
            print(json.dumps(found, indent=2))
            return
        table = Table(box=None, pad_edge=False)
        for col in ("TEMPLATE", "SIZE", "READY", "FILLING", "GUEST MEMORY", "HOST PSS", "CAP"):
            table.add_column(col)
        for p in found:
            memory = (f"{p['nominal_mib']} MiB", f"{p['pss_mib']} MiB", f"{p['cap_mib']} MiB")
            table.add_row(p["template"], str(p["size"]), str(p["ready"]), str(p["filling"]), *memory)
        Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 1000).print(table)

    run_coro(main())
