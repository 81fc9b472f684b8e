"""The home's saved state: what its chunk store holds and costs, and collecting what no
state needs (docs/storage.md).

sandlot storage [--json]       stored against logical bytes, sharing and compression
sandlot storage gc [--tier]    delete the chunks no saved state lists (--tier: in the tier too)
sandlot storage configure URL  an S3-compatible tier under it (none: no tier)
sandlot storage push [BOX]     send the tier what it lacks; a suspended box whole
sandlot storage pull BOX       take a box from the tier into this home
sandlot storage evict          keep only the manifest here of cold states
sandlot storage boxes          the boxes in the tier, and who holds each
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..errors import SandlotError
from .common import Sandlot, app, fail, human

storage_app = Sandlot(
    help="The home's saved state: its figures (default), gc, and its storage tier.",
    no_args_is_help=False, subcommand_metavar="[gc|configure|push|pull|evict|boxes]",
)  # fmt: skip
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
    print(f"on this disk  {human(r.local_bytes)}")
    if r.tier:
        print(f"tier          {r.tier} · {r.remote_chunks} chunks ({human(r.remote_bytes)}),"
              f" {r.pushed_states} of {r.states} states")  # fmt: skip


TIER_GC_HELP = "Collect the storage tier too: what no home sharing it holds and no box in it needs."


@storage_app.command("gc")
def storage_gc(
    wait: Annotated[float, typer.Option(help="Seconds to wait for saves and loads in progress.")] = 120.0,
    tier: Annotated[bool, typer.Option("--tier", help=TIER_GC_HELP)] = False,
) -> None:
    """Delete the chunks no saved state lists, and what cut-short saves left."""
    from ..api import storage

    try:
        report = storage.gc(tier=tier, wait=wait)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(f"removed {report.chunks} chunks, {human(report.bytes_freed)}")
    if report.tier is not None:
        t = report.tier
        print(f"tier: removed {t.chunks} chunks ({human(t.bytes_freed)}), {t.states} states, "
              f"{t.files} disk files, {t.boxes} boxes (collection {t.generation})")  # fmt: skip


@storage_app.command("configure")
def storage_configure(
    url: Annotated[str, typer.Argument(help="s3://BUCKET or s3://BUCKET/PREFIX, or none for no tier.")],
    endpoint_url: Annotated[str | None, typer.Option(help="An S3-compatible store other than AWS.")] = None,
    region: Annotated[str | None, typer.Option(help="The bucket's region.")] = None,
    profile: Annotated[str | None, typer.Option(help="A profile of ~/.aws/config.")] = None,
    evict_after: Annotated[
        float | None, typer.Option(help="Seconds after which cold state keeps only its manifest here.")
    ] = None,
) -> None:
    """Give this home a storage tier (for every process of the home)."""
    from ..api import storage

    try:
        storage.configure(None if url == "none" else url, endpoint_url=endpoint_url, region=region,
                          profile=profile, evict_after=evict_after)  # fmt: skip
    except SandlotError as exc:
        raise fail(exc) from exc
    print("no storage tier" if url == "none" else f"storage tier {url}")


@storage_app.command("push")
def storage_push(
    box: Annotated[
        str | None, typer.Argument(help="A suspended box to send whole (default: every state).")
    ] = None,
    release: Annotated[bool, typer.Option("--release", help="The box leaves this home.")] = False,
) -> None:
    """Send the storage tier what it lacks: every saved state, or a suspended box whole."""
    from ..api import storage

    try:
        r = storage.push(box, release=release)
    except SandlotError as exc:
        raise fail(exc) from exc
    files = f", {r.files} disk files" if box else ""
    print(f"sent {r.chunks} chunks ({human(r.bytes)}), {r.states} states{files} in {r.seconds:.1f}s")


@storage_app.command("pull")
def storage_pull(
    box: Annotated[str, typer.Argument(help="The box's name or id in the tier.")],
    force: Annotated[bool, typer.Option("--force", help="Take it from a home known to be gone.")] = False,
) -> None:
    """Take a box from the storage tier into this home, suspended (resume it then)."""
    from ..api import storage

    try:
        pulled = storage.pull(box, force=force)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(f"{pulled.name}\t{pulled.id}\tsuspended")


@storage_app.command("evict")
def storage_evict(
    older_than: Annotated[
        float | None, typer.Option(help="Seconds (default: the tier's --evict-after).")
    ] = None,
) -> None:
    """Keep only the manifest here of cold states, once the tier has their chunks."""
    from ..api import storage

    try:
        r = storage.evict(older_than)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(f"evicted {r.chunks} chunks, {human(r.bytes_freed)}")


@storage_app.command("boxes")
def storage_boxes(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False,
) -> None:
    """The boxes in the storage tier, and which home holds each."""
    from ..api import storage

    try:
        rows = storage.boxes()
    except SandlotError as exc:
        raise fail(exc) from exc
    if as_json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['name']}\t{r['id']}\t{r['holder'] or '(free)'}")
