"""The ``sandlot`` command line.

sandlot doctor                      what this host offers, and why (accelerator, kernel, agent)
sandlot setup                       fetch the kernel and build the agent now
sandlot run --rootfs DIR -- CMD...  boot a box, run CMD, exit with its status
sandlot rootfs busybox|debian DIR   build a small root filesystem from Debian packages
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from . import __version__
from .errors import SandlotError

app = typer.Typer(
    name="sandlot",
    help="Embeddable microVM sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


def _fail(exc: BaseException, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


@app.command()
def doctor(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Check QEMU, the accelerator (and why), the guest kernel, the agent and free disk."""
    from .runtime import Runtime

    report = Runtime.for_home().doctor()
    if as_json:
        print(json.dumps(report, indent=2))
        return
    out = Console(soft_wrap=True, highlight=False)
    qemu = report.get("qemu", {})
    accel = report.get("accel", {})
    kernel = report.get("kernel", {})
    agent = report.get("agent", {})
    ok = "[green]ok[/]"
    out.print(f"[bold]sandlot {__version__}[/]  home: {report['home']}")
    if isinstance(qemu, dict) and "version" in qemu:
        out.print(f"qemu         {ok}  {qemu['version']} ({qemu['path']})")
    else:
        out.print(f"qemu         [red]missing[/]  {qemu}")
    if isinstance(accel, dict) and accel:
        color = "green" if accel.get("name") == "kvm" else "yellow"
        out.print(f"accelerator  [{color}]{accel['name']}[/]  {accel['reason']}")
    if isinstance(kernel, dict) and kernel:
        out.print(f"kernel       {ok}  {kernel['version']} from {kernel['source']}")
        out.print(f"             modules: {', '.join(kernel['modules'])}")
    if isinstance(agent, dict) and agent:
        out.print(f"agent        {ok}  {agent['path']} (built with {agent['compiler']})")
    out.print(f"disk free    {report.get('disk_free_gib')} GiB under {report['home']}")
    out.print(f"sockets      {report.get('runtime_dir')}")
    if "error" in report:
        out.print(f"[red]problem[/]      {report['error']}")
        raise typer.Exit(1)


@app.command()
def setup(
    refresh_kernel: Annotated[bool, typer.Option(help="Fetch the newest distro kernel.")] = False,
) -> None:
    """Prepare everything a boot needs (kernel, agent, initramfs) and report it."""
    from .guest.kernel import fetch_distro_kernel
    from .runtime import Runtime

    rt = Runtime.for_home()
    try:
        if refresh_kernel and not os.environ.get("SANDLOT_KERNEL"):
            fetch_distro_kernel(rt.home, refresh=True)
        assets = rt.assets()
    except SandlotError as exc:
        raise _fail(exc) from exc
    print(f"kernel  {assets.kernel.version} ({assets.kernel.vmlinux})")
    print(f"agent   {assets.agent.path}")
    print(f"initrd  {assets.initrd}")
    print(f"accel   {assets.accel.name}: {assets.accel.reason}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    rootfs: Annotated[
        Path | None, typer.Option("--rootfs", help="Boot this directory or tarball, not an image.")
    ] = None,
    memory: Annotated[int, typer.Option("--memory", "-m", help="Guest memory in MiB.")] = 512,
    cpus: Annotated[int, typer.Option("--cpus", help="Virtual CPUs.")] = 1,
    disk: Annotated[int, typer.Option("--disk", help="Disk size in GiB.")] = 8,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE for the command.")] = None,
    workdir: Annotated[
        str | None, typer.Option("--workdir", "-w", help="Working directory in the guest.")
    ] = None,
    user: Annotated[
        str | None, typer.Option("--user", "-u", help="name, uid, name:group or uid:gid.")
    ] = None,
    entrypoint: Annotated[str | None, typer.Option(help="Override the image's entrypoint.")] = None,
    pull: Annotated[str, typer.Option(help="missing, always or never.")] = "missing",
    insecure: Annotated[bool, typer.Option(help="Allow plain HTTP to the registry.")] = False,
    timeout: Annotated[float | None, typer.Option(help="Kill the command after this many seconds.")] = None,
    accel: Annotated[str, typer.Option(help="auto, kvm or tcg.")] = "auto",
) -> None:
    """Boot a box from IMAGE (or --rootfs), run the command, exit with its status.

    sandlot run IMAGE                 runs the image's Entrypoint + Cmd
    sandlot run IMAGE CMD [ARGS...]   runs Entrypoint + CMD
    sandlot run --rootfs DIR -- CMD   boots a root filesystem directory or tarball

    Output streams live; stdin is forwarded when it is not a terminal.
    """
    args = list(ctx.args)
    if args and args[0] == "--":
        args = args[1:]
    image = None
    if rootfs is None:
        if not args:
            raise _fail(ValueError("give an IMAGE, or --rootfs DIR: sandlot run IMAGE [CMD...]"), 2)
        image, args = args[0], args[1:]
        if args and args[0] == "--":
            args = args[1:]
    elif not args:
        raise _fail(ValueError("no command given: sandlot run --rootfs DIR -- CMD [ARGS...]"), 2)
    environment: dict[str, str] = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise _fail(ValueError(f"--env needs KEY=VALUE, got {item!r}"), 2)
        environment[key] = value
    from .api import _sync
    from .api.box import AsyncBox

    async def main() -> int:
        import asyncio

        box = AsyncBox(
            image, rootfs=rootfs, memory_mib=memory, cpus=cpus, disk_size_gb=disk, accel=accel, pull=pull,
            insecure=insecure, env=environment or None, workdir=workdir, user=user,
        )  # fmt: skip
        async with box:
            if box.image is not None and entrypoint is not None:
                argv = [entrypoint, *(args or [])] if entrypoint else list(args)
            else:
                argv = box.default_command(args)
            proc = await box.spawn(*argv, stdin=True)

            async def pump(stream: object, fd: int) -> None:
                async for chunk in stream:  # type: ignore[attr-defined]
                    os.write(fd, chunk)

            async def feed() -> None:
                if sys.stdin.isatty():
                    await proc.close_stdin()
                    return
                while chunk := await asyncio.to_thread(os.read, 0, 65536):
                    await proc.write_stdin(chunk)
                await proc.close_stdin()

            feeder = asyncio.ensure_future(feed())
            await asyncio.gather(pump(proc.stdout, 1), pump(proc.stderr, 2))
            code = await proc.wait(timeout)
            feeder.cancel()
            return code

    try:
        code = _sync.run(main())
    except FileNotFoundError as exc:
        raise _fail(exc, 127) from exc
    except SandlotError as exc:
        raise _fail(exc, 125) from exc
    raise typer.Exit(code)


def _progress_display() -> tuple[Any, Callable[[Any], None]]:
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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Pull an image (its x86_64 variant) and prepare its disk."""
    from .api.images import pull

    progress, on_event = _progress_display()
    try:
        if quiet:
            img = pull(ref, insecure=insecure, ca_cert=ca_cert)
        else:
            with progress:
                img = pull(ref, insecure=insecure, ca_cert=ca_cert, progress=on_event)
    except SandlotError as exc:
        raise _fail(exc) from exc
    print(f"{img.name} {img.digest}")


images_app = typer.Typer(help="List images (default) or prune unused ones.", no_args_is_help=False)
app.add_typer(images_app, name="images")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@images_app.callback(invoke_without_command=True)
def images_list(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List images."""
    if ctx.invoked_subcommand is not None:
        return
    from .api.images import list_images

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
    import datetime

    for i in imgs:
        when = datetime.datetime.fromtimestamp(i.pulled_at).strftime("%Y-%m-%d %H:%M")
        for name in i.names or ("<none>",):
            short = name.removeprefix("docker.io/").removeprefix("library/")
            table.add_row(short, i.id, _human(i.size), when)
    Console(soft_wrap=True).print(table)


@images_app.command("prune")
def images_prune() -> None:
    """Remove blobs and base disks that no image and no box uses."""
    from .api.images import prune_images

    report = prune_images()
    freed = _human(report.bytes_freed)
    print(f"removed {report.blobs_removed} blobs and {report.bases_removed} base disks, {freed}")


@app.command()
def rmi(names: Annotated[list[str], typer.Argument(help="Image names, digests or ids.")]) -> None:
    """Remove images (a name: untag it; the image goes with its last name)."""
    from .api.images import remove_image

    for name in names:
        try:
            for removed in remove_image(name):
                print(f"removed {removed}")
        except SandlotError as exc:
            raise _fail(exc) from exc


@app.command()
def load(
    path: Annotated[
        Path, typer.Argument(help="docker save / OCI archive (.tar, .tar.gz) or OCI layout directory")
    ],
    name: Annotated[str | None, typer.Option("--name", "-n", help="Name the loaded image.")] = None,
) -> None:
    """Load images from an archive or an OCI layout directory."""
    from .api.images import load_image

    try:
        for img in load_image(path, name):
            print(f"{img.name} {img.digest}")
    except SandlotError as exc:
        raise _fail(exc) from exc


@app.command("import")
def import_cmd(
    directory: Annotated[Path, typer.Argument(help="Root filesystem directory.")],
    name: Annotated[str, typer.Argument(help="NAME:TAG for the new image.")],
    cmd: Annotated[str | None, typer.Option(help="Default command (a shell line).")] = None,
) -> None:
    """Make an image from a directory."""
    from .api.images import import_image

    try:
        img = import_image(directory, name, cmd=["/bin/sh", "-c", cmd] if cmd else None)
    except SandlotError as exc:
        raise _fail(exc) from exc
    print(f"{img.name} {img.digest}")


@app.command("inspect-image")
def inspect_image(name: Annotated[str, typer.Argument(help="Image name, digest or id.")]) -> None:
    """Show an image's record as JSON (config, labels, layers)."""
    from .api.images import get_image

    img = get_image(name)
    if img is None:
        raise _fail(ValueError(f"no image {name!r}"))
    print(json.dumps(img.to_json(), indent=2))


@app.command()
def rootfs(
    kind: Annotated[str, typer.Argument(help="busybox or debian")],
    dest: Annotated[Path, typer.Argument(help="Directory to create (replaced if it exists).")],
    packages: Annotated[
        list[str] | None, typer.Option("--package", "-p", help="Extra Debian packages.")
    ] = None,
) -> None:
    """Build a root filesystem directory from Debian packages (no registry needed)."""
    from .images.builders import busybox_rootfs, debian_rootfs

    try:
        if kind == "busybox":
            path = busybox_rootfs(dest)
        elif kind == "debian":
            path = debian_rootfs(dest, packages or [])
        else:
            raise _fail(ValueError("kind must be busybox or debian"), 2)
    except SandlotError as exc:
        raise _fail(exc) from exc
    print(path)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
