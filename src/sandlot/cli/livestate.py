"""Live-state commands: snapshot, snapshots, rollback, fork, suspend, resume, template.

sandlot snapshot BOX [NAME]             save a running box (it goes on)
sandlot snapshot rm SNAPSHOT...         refused while boxes started from it exist
sandlot snapshot prune [--templates]    those of removed boxes no box was started from
sandlot snapshot export SNAPSHOT FILE   one file for another machine
sandlot snapshot import FILE [--name N] start the box it holds here
sandlot snapshots [BOX]                 list (templates too)
sandlot rollback BOX SNAPSHOT
sandlot diff BOX [SNAP] [SNAP2]         what changed in its files (--stat, --json)
sandlot fork BOX [-n N]
sandlot suspend BOX... / resume BOX...
sandlot template IMAGE --name N [--setup CMD]...
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..api.box import AsyncBox, AsyncSnapshot
from ..api.templates import import_snapshot_async, prune_snapshots_async, template_async
from .boxes import AllowOpt, BoxesArg, NetOpt
from .common import QuietOpt, age, app, busy, fail, for_each_box, human, run_coro


@app.command()
def snapshot(
    args: Annotated[
        list[str],
        typer.Argument(
            metavar="BOX [NAME] | ACTION ARGS...",
            help="A box to save (and the snapshot's name), or rm, prune, export or import and theirs.",
        ),
    ],
    name: Annotated[str | None, typer.Option("--name", help="import: the new box's name.")] = None,
    templates: Annotated[bool, typer.Option("--templates", help="prune: named templates too.")] = False,
    since: Annotated[
        str | None, typer.Option("--since", help="export: only what changed after this snapshot of the box.")
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Save a running box's memory, processes and disk (it goes on running).

    sandlot snapshot BOX [NAME]              save a running box (it goes on running)
    sandlot snapshot rm SNAP...              refused while boxes started from one exist
    sandlot snapshot prune [--templates]     those of removed boxes no box was started from
    sandlot snapshot export SNAP FILE [--since BASE]  one file for another machine
    sandlot snapshot import FILE [--name N]  start the box it holds here
    """
    if args[0] == "prune":
        if len(args) != 1:
            raise fail("snapshot prune takes no arguments", 2)

        async def prune() -> None:
            for snap in await prune_snapshots_async(templates=templates):
                print(f"{snap.id}\t{snap.name or ''}\t{human(snap.size)}")

        run_coro(prune())
        return
    if args[0] == "rm":
        if len(args) < 2:
            raise fail("snapshot rm needs snapshot ids or names", 2)

        async def remove() -> None:
            for key in args[1:]:
                snap = await AsyncSnapshot.get(key)
                await snap.remove()
                print(snap.id)

        run_coro(remove())
        return
    if args[0] == "export":
        if len(args) != 3:
            raise fail("snapshot export needs SNAPSHOT FILE", 2)

        async def export() -> None:
            t = time.monotonic()
            with busy(f"exporting {args[1]} to {args[2]}", quiet=quiet):
                path = await (await AsyncSnapshot.get(args[1])).export(args[2], since=since)
            print(f"{path} ({human(path.stat().st_size)}, {time.monotonic() - t:.1f}s)")

        run_coro(export())
        return
    if args[0] == "import":
        if len(args) != 2:
            raise fail("snapshot import needs FILE", 2)

        async def import_() -> None:
            with busy(f"importing {args[1]}", quiet=quiet):
                box = await import_snapshot_async(args[1], name=name)
            print(box.name)

        run_coro(import_())
        return
    if len(args) > 2:
        raise fail("snapshot takes BOX [NAME]", 2)

    async def take() -> None:
        box = await AsyncBox.get(args[0])
        snap = await box.snapshot(args[1] if len(args) > 1 else None)
        pause = f"{box.last_pause * 1000:.0f} ms" if box.last_pause is not None else "?"
        print(f"{snap.id}\t{snap.name or ''}\tpaused {pause}, {human(snap.size)}")

    run_coro(take())


@app.command()
def snapshots(
    box: Annotated[str | None, typer.Argument(help="Only this box's snapshots.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List snapshots and templates."""

    async def listing() -> list[dict[str, Any]]:
        return [await s.inspect() for s in await AsyncSnapshot.list(box=box)]

    try:
        snaps = asyncio.run(listing())
    except Exception as exc:
        raise fail(exc, 125) from exc
    if as_json:
        print(json.dumps(snaps, indent=2))
        return
    table = Table(box=None, pad_edge=False)
    for col in ("ID", "NAME", "KIND", "BOX", "CREATED", "SIZE", "CHILDREN"):
        table.add_column(col)
    for s in snaps:
        table.add_row(s["id"], s["name"] or "", s["kind"], s["box_name"] or "", age(s["created_at"]),
                      human(s["size"]), str(len(s["children"])))  # fmt: skip
    Console(width=200).print(table)


@app.command()
def rollback(
    box: Annotated[str, typer.Argument(help="The box.")],
    snap: Annotated[str, typer.Argument(help="One of its snapshots (id or name).")],
) -> None:
    """Take a box back to one of its snapshots: memory, processes and disk."""

    async def main() -> None:
        b = await AsyncBox.get(box)
        await b.rollback(snap)
        print(b.name)

    run_coro(main())


@app.command()
def diff(
    box: Annotated[str, typer.Argument(help="The box.")],
    sides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[SNAP] [SNAP2]",
            help="None: the box's image to the box now; one: that snapshot to now; two: the "
            "first to the second. Each may also be 'image', 'now' or box:NAME (its files now).",
        ),
    ] = None,
    stat: Annotated[bool, typer.Option("--stat", help="A line a changed path, and the counts.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="The whole answer as JSON.")] = False,
    paths: Annotated[
        list[str] | None, typer.Option("--path", "-p", help="Only this subtree (repeatable).")
    ] = None,
    text_limit: Annotated[
        int | None, typer.Option("--text-limit", help="Largest text file given a unified diff, in bytes.")
    ] = None,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="Exit 1 if anything changed.")] = False,
) -> None:
    """What changed in a box's files between two states: added, deleted, modified and
    renamed paths, with unified diffs of text files.

    sandlot diff BOX                 its image to the box now
    sandlot diff BOX SNAP            that snapshot to the box now
    sandlot diff BOX SNAP SNAP2      one snapshot to another (forks' too)
    sandlot diff BOX box:OTHER       another box now to this one now (two forks)
    """
    given = list(sides or [])
    if len(given) > 2:
        raise fail("diff takes at most two snapshots: SNAP [SNAP2]", 2)
    a = given[0] if given else None
    b = given[1] if len(given) > 1 else None

    async def main() -> bool:
        found = await (await AsyncBox.get(box)).diff(a, b, paths=paths, text_limit=text_limit)
        if as_json:
            print(json.dumps(found.to_json(), indent=2))
        elif stat:
            print(found.summary())
        else:
            print(found.patch(), end="")
        return bool(found)

    changed = run_coro(main())
    if exit_code and changed:
        raise typer.Exit(1)


@app.command()
def fork(
    box: Annotated[str, typer.Argument(help="The box.")],
    n: Annotated[int, typer.Option("-n", help="How many children.")] = 1,
    name: Annotated[str | None, typer.Option("--name", help="Prefix of the children's names.")] = None,
) -> None:
    """Start N running copies of a box (from a snapshot taken now)."""

    async def main() -> None:
        kids = await (await AsyncBox.get(box)).fork(n, name=name)
        for k in kids:
            print(k.name)

    run_coro(main())


@app.command()
def suspend(boxes: BoxesArg) -> None:
    """Write boxes' running state to disk and end their VMs (no CPU, no RAM)."""
    for_each_box(boxes, lambda b: b.suspend(), "suspend")


@app.command()
def resume(boxes: BoxesArg) -> None:
    """Bring suspended boxes back, processes running."""
    for_each_box(boxes, lambda b: b.resume(), "resume")


@app.command()
def template(
    image: Annotated[str, typer.Argument(help="The image.")],
    name: Annotated[str, typer.Option("--name", help="The template's name.")],
    setup: Annotated[
        list[str] | None, typer.Option("--setup", help="A shell command to run first (repeat).")
    ] = None,
    code: Annotated[
        list[str] | None,
        typer.Option("--code", help="A Python cell to run in the interpreter, kept started (repeat)."),
    ] = None,
    memory: Annotated[int, typer.Option("--memory", "-m", help="MiB of RAM.")] = 512,
    pool: Annotated[
        int, typer.Option("--pool", min=0, help="VMs of it to keep ready (filled in the background).")
    ] = 0,
    network: NetOpt = None,
    allow: AllowOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Boot an image, run setup commands, and save it as a template (Box(template=NAME)).
    Boxes from it have its network card or none (--network); each may change its mode."""
    net: dict[str, Any] = {"network": network} if network else {}
    if allow:
        net["allow"] = allow

    async def main() -> None:
        with busy(f"building the template {name} from {image}", quiet=quiet):
            snap = await template_async(
                image, setup=setup or [], code=code or [], name=name, memory_mib=memory, pool=pool, **net
            )
        print(f"{snap.id}\t{snap.name}")

    run_coro(main())
