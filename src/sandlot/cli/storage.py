"""The home's saved state: what its chunk store holds and costs, and collecting what no
state needs (docs/storage.md).

sandlot storage [--json]       stored against logical bytes, sharing and compression
sandlot storage gc [--wait S]  delete the chunks no saved state lists
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..errors import SandlotError
from .common import Sandlot, app, fail, human

storage_app = Sandlot(help="The home's saved state: its figures (default), gc.", no_args_is_help=False,
                      subcommand_metavar="[gc]")  # fmt: skip
app.add_typer(storage_app, name="storage")


@storage_app.callback(invoke_without_command=True)
def storage_show(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False,
) -> None:
    """What the saved states of this home hold, and what they take."""
    if ctx.invoked_subcommand is not None:
        return
    from ..api import storage

    try:
        r = storage.info()
    except SandlotError as exc:
        raise fail(exc) from exc
    if as_json:
        print(json.dumps(r.to_json()))
        return
    print(f"saved states  {r.states}")
    print(f"chunks        {r.chunks} · {human(r.stored_bytes)} stored")
    print(f"logical       {human(r.logical_bytes)} of memory and device state"
          f" · {r.compression_ratio}x compressed · {r.dedup_ratio}x shared")  # fmt: skip
    print(f"unshared      {human(r.unshared_bytes)} if each state kept its own chunks")
    if r.garbage_chunks:
        print(f"garbage       {r.garbage_chunks} chunks · {human(r.garbage_bytes)} (sandlot storage gc)")


@storage_app.command("gc")
def storage_gc(
    wait: Annotated[float, typer.Option(help="Seconds to wait for saves and loads in progress.")] = 120.0,
) -> None:
    """Delete the chunks no saved state lists, and what cut-short saves left."""
    from ..api import storage

    try:
        report = storage.gc(wait=wait)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(f"removed {report.chunks} chunks, {human(report.bytes_freed)}")
