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
from pathlib import Path
from typing import Annotated

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
    rootfs: Annotated[Path, typer.Option("--rootfs", help="Root filesystem: a directory or a tarball.")],
    memory: Annotated[int, typer.Option("--memory", "-m", help="Guest memory in MiB.")] = 512,
    cpus: Annotated[int, typer.Option("--cpus", help="Virtual CPUs.")] = 1,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE for the command.")] = None,
    workdir: Annotated[
        str | None, typer.Option("--workdir", "-w", help="Working directory in the guest.")
    ] = None,
    user: Annotated[
        str | None, typer.Option("--user", "-u", help="name, uid, name:group or uid:gid.")
    ] = None,
    timeout: Annotated[float | None, typer.Option(help="Kill the command after this many seconds.")] = None,
    accel: Annotated[str, typer.Option(help="auto, kvm or tcg.")] = "auto",
) -> None:
    """Boot a box from ROOTFS, run the command given after '--', and exit with its status.

    Output streams live; stdin is forwarded when it is not a terminal.
    """
    argv = list(ctx.args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
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
        async with AsyncBox(rootfs=rootfs, memory_mib=memory, cpus=cpus, accel=accel) as box:
            proc = await box.spawn(*argv, env=environment or None, cwd=workdir, user=user, stdin=True)

            async def pump(stream: object, fd: int) -> None:
                async for chunk in stream:  # type: ignore[attr-defined]
                    os.write(fd, chunk)

            import asyncio

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
