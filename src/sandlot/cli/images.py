"""Image commands: pull, images, images prune, rmi, load, import, inspect-image."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..errors import SandlotError
from .common import QuietOpt, Sandlot, app, busy, fail, human, on_terminal


def progress_display() -> tuple[Any, Callable[[Any], None]]:
    """A rich progress display and the callback that feeds it."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=Console(stderr=True), transient=False,
    )  # fmt: skip
    tasks: dict[str, Any] = {}

    def on_event(ev: Any) -> None:
        label = ev.digest.split(":")[1][:12]
        if ev.digest not in tasks:
            tasks[ev.digest] = progress.add_task(label, total=ev.total)
        status = {"cached": "cached", "done": "done"}.get(ev.status, "")
        progress.update(tasks[ev.digest], completed=ev.done, description=f"{label} {status}".strip())

    return progress, on_event


@app.command("pull")
def pull_cmd(
    ref: Annotated[
        str, typer.Argument(help="Image reference, e.g. python:3.12-slim or host:5000/team/app:v1")
    ],
    insecure: Annotated[bool, typer.Option(help="Allow plain HTTP to this registry.")] = False,
    ca_cert: Annotated[Path | None, typer.Option(help="Trust this CA certificate for the registry.")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Pull an image (its x86_64 variant) and prepare its disk."""
    from ..api.sync import pull

    progress, on_event = progress_display()
    try:
        if not on_terminal(quiet):
            img = pull(ref, insecure=insecure, ca_cert=ca_cert)
        else:
            with progress:
                img = pull(ref, insecure=insecure, ca_cert=ca_cert, progress=on_event)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(f"{img.name} {img.digest}")


images_app = Sandlot(help="List images (default) or prune unused ones.", no_args_is_help=False,
                     subcommand_metavar="[prune]")  # fmt: skip
app.add_typer(images_app, name="images")


@images_app.callback(invoke_without_command=True)
def images_list(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List images."""
    if ctx.invoked_subcommand is not None:
        return
    from ..api.images import list_images

    imgs = list_images()
    if as_json:
        print(
            json.dumps(
                [{"id": i.id, "digest": i.digest, "names": list(i.names), "size": i.size} for i in imgs]
            )
        )
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("NAME", "ID", "SIZE", "PULLED"):
        table.add_column(col)
    for i in imgs:
        when = datetime.datetime.fromtimestamp(i.pulled_at).strftime("%Y-%m-%d %H:%M")
        for name in i.names or ("<none>",):
            short = name.removeprefix("docker.io/").removeprefix("library/")
            table.add_row(short, i.id, human(i.size), when)
    Console(soft_wrap=True).print(table)


@images_app.command("prune")
def images_prune(
    unused_for: Annotated[
        float,
        typer.Option(
            help="Keep base disks of root filesystems that a box used this many seconds ago or less."
        ),
    ] = 0.0,
) -> None:
    """Remove blobs and base disks that no image and no box uses."""
    from ..api.images import prune_images

    try:
        report = prune_images(unused_for=unused_for)
    except SandlotError as exc:
        raise fail(exc) from exc
    freed = human(report.bytes_freed)
    print(f"removed {report.blobs_removed} blobs and {report.bases_removed} base disks, {freed}")


@app.command()
def rmi(names: Annotated[list[str], typer.Argument(help="Image names, digests or ids.")]) -> None:
    """Remove images (a name: untag it; the image goes with its last name)."""
    from ..api.images import remove_image

    for name in names:
        try:
            for removed in remove_image(name):
                print(f"removed {removed}")
        except SandlotError as exc:
            raise fail(exc) from exc


@app.command()
def load(
    path: Annotated[
        Path, typer.Argument(help="docker save / OCI archive (.tar, .tar.gz) or OCI layout directory")
    ],
    name: Annotated[str | None, typer.Option("--name", "-n", help="Name the loaded image.")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Load images from an archive or an OCI layout directory."""
    from ..api.images import load_image
    from ..images.reference import Reference

    try:
        wanted = str(Reference.parse(name)) if name else None
        with busy(f"loading {path}", quiet=quiet):
            loaded = load_image(path, name)
        for img in loaded:
            # the name this load gave (an image known already keeps its older names too)
            shown = wanted if wanted in img.names else img.name
            print(f"{shown} {img.digest}")
    except SandlotError as exc:
        raise fail(exc) from exc


@app.command("import")
def import_cmd(
    directory: Annotated[Path, typer.Argument(help="Root filesystem directory.")],
    name: Annotated[str, typer.Argument(help="NAME:TAG for the new image.")],
    cmd: Annotated[str | None, typer.Option(help="Default command (a shell line).")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Make an image from a directory."""
    from ..api.images import import_image

    try:
        with busy(f"making {name} from {directory}", quiet=quiet):
            img = import_image(directory, name, cmd=["/bin/sh", "-c", cmd] if cmd else None)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(f"{img.name} {img.digest}")


@app.command("inspect-image")
def inspect_image(name: Annotated[str, typer.Argument(help="Image name, digest or id.")]) -> None:
    """Show an image's record as JSON (config, labels, layers)."""
    from ..api.images import get_image

    img = get_image(name)
    if img is None:
        raise fail(ValueError(f"no image {name!r}"))
    print(json.dumps(img.to_json(), indent=2))
