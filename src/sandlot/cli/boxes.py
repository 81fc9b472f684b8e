"""Box commands, as Docker spells them: run, create, start, stop, restart, pause,
unpause, rm, ls, exec, cp, logs, inspect, stats."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import posixpath
import sys
import time
import typing
import warnings
from collections.abc import Callable
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..api.box import AsyncBox
from ..core.options import BY_NAME, OPTIONS, BoxOption
from ..core.validate import env_pairs
from ..errors import InvalidArgument, SandlotError, TransferWarning
from .common import QuietOpt, app, busy, err, fail, for_each_box, human, run_coro
from .quick import exec_attached, exec_in, filters, run_ls

# Options stop at the first positional argument, as in Docker: what follows the
# image (or the box) is the command, flags included.
COMMAND = {"allow_interspersed_args": False}


def _after_dashes(words: list[str]) -> list[str]:
    """The command after IMAGE or BOX: a ``--`` between them is dropped (``sandlot exec
    BOX -- ls -l``); click takes one only before the first positional argument."""
    return words[1:] if words[:1] == ["--"] else words


def flag_option(option: BoxOption, *, parsed: bool = True) -> Any:
    """The ``typer.Option`` of ``option``'s flag (``core/options.py``); ``parsed``: its
    text checked as the command line is read (a bad one a usage error). The command
    still gets the text: typer converts what a callback returns to the flag's type (a
    mapping made a list would keep only its keys), so ``box_flags`` makes the value."""
    flag = option.flag
    assert flag is not None
    callback = None
    if parsed and flag.parse is not None:
        parse = flag.parse

        def callback(value: Any) -> Any:
            try:
                parse(value)
            except SandlotError as exc:
                raise typer.BadParameter(str(exc)) from None
            return value

    return typer.Option(
        *flag.names, help=flag.help, callback=callback, autocompletion=flag.complete, min=flag.min
    )


def _flag_value(option: BoxOption, text: Any) -> Any:
    parse = option.flag.parse if option.flag is not None else None
    return parse(text) if parse is not None else text


def box_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` the flag of every box option that has one (``core/options.py``),
    after its own parameters; it is called with them as ``box``, ``AsyncBox``'s keyword
    arguments."""
    flagged = [o for o in OPTIONS if o.flag is not None]
    hints = typing.get_type_hints(command, include_extras=True)
    own = [
        p.replace(annotation=hints[p.name]) for p in signature(command).parameters.values() if p.name != "box"
    ]
    added = [
        Parameter(
            o.name,
            Parameter.KEYWORD_ONLY,
            default=o.default,
            annotation=Annotated[o.flag.type, flag_option(o)],
        )
        for o in flagged
        if o.flag is not None
    ]

    @functools.wraps(command)
    def with_box(**given: Any) -> None:
        box = {o.name: _flag_value(o, given.pop(o.name)) for o in flagged}
        command(**given, box={**box, "keep": True})

    params = [*own, *added]
    with_box.__signature__ = Signature(params)  # type: ignore[attr-defined]
    with_box.__annotations__ = {p.name: p.annotation for p in params}
    return with_box


# the flags of box options that other commands take too
EnvOpt = Annotated[list[str] | None, flag_option(BY_NAME["env"], parsed=False)]
WorkdirOpt = Annotated[str | None, flag_option(BY_NAME["workdir"], parsed=False)]
UserOpt = Annotated[str | None, flag_option(BY_NAME["user"], parsed=False)]
NetOpt = Annotated[str | None, flag_option(BY_NAME["network"], parsed=False)]
AllowOpt = Annotated[list[str] | None, flag_option(BY_NAME["allow"], parsed=False)]
ImageArg = Annotated[
    str | None, typer.Argument(metavar="IMAGE", help="Image reference, e.g. python:3.12-slim (or --rootfs).")
]


@app.command(context_settings=COMMAND)
@box_flags
def run(
    image: ImageArg = None,
    cmd: Annotated[
        list[str] | None, typer.Argument(help="The command and its arguments (default: the image's).")
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Leave the box running; print its name.")
    ] = False,
    interactive: Annotated[bool, typer.Option("--interactive", "-i", help="Forward stdin.")] = False,
    tty_mode: Annotated[bool, typer.Option("--tty", "-t", help="Give the command a terminal.")] = False,
    entrypoint: Annotated[str | None, typer.Option(help="Override the image's entrypoint.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Kill the command after this many seconds.")] = None,
    quiet: QuietOpt = False,
    *,
    box: dict[str, Any],
) -> None:
    """Create and start a box from IMAGE (or --rootfs), run a command in it.

    sandlot run IMAGE                  the image's Entrypoint + Cmd; then the box stops
    sandlot run IMAGE CMD [ARGS...]    Entrypoint + CMD
    sandlot run -d --name dev IMAGE    leave it running (the command, if any, in the background)
    sandlot run --rm -it IMAGE sh      an interactive shell in a throwaway box
    sandlot run --rootfs DIR -- CMD    a root filesystem directory or tarball instead of an image
    sandlot run --network public ...   HTTP(S) out through sandlot's proxy (no host, no private ranges)
    sandlot run -d -p 8080:80 ...      the box's port 80 on the host's 127.0.0.1:8080
    sandlot run -d -p 8080:80 --idle-timeout 60 --wake-on-traffic ...
                                       asleep after a quiet minute; the next connection wakes it
    sandlot run --network allowlist --secret API_KEY@api.example.com ...
                                       $API_KEY used by the box, never seen by it

    Exits with the command's status.
    """
    args = _after_dashes(cmd or [])
    rootfs, rm = box["rootfs"], box["auto_remove"]
    if rootfs is not None:  # no image: the first word is the command's
        args = [image, *args] if image is not None else []
        image = None
        if not args and not detach:
            raise fail("no command given: sandlot run --rootfs DIR -- CMD [ARGS...]", 2)
    elif image is None:
        raise fail("give an IMAGE, or --rootfs DIR: sandlot run IMAGE [CMD...]", 2)
    opts = {**box, "image": image}

    async def main() -> int:
        box = AsyncBox(**opts)
        with busy(f"starting a box of {image or rootfs} (an image is pulled if missing; its first boot "
                  "is saved as its template)", quiet=quiet):  # fmt: skip
            await box.start()
        argv = None
        try:
            if entrypoint is not None:
                argv = [entrypoint, *args] if entrypoint else list(args)
            elif args or not detach:
                argv = box.default_command(args)
            else:
                with contextlib.suppress(InvalidArgument):  # a detached box needs no command
                    argv = box.default_command()
            if detach:
                if argv:
                    proc = await box.spawn(*argv, stdin=False)
                    proc.detach()
                print(box.name)
                return 0
            assert argv is not None
            return await exec_attached(box, argv, interactive=interactive, tty_mode=tty_mode, timeout=timeout)
        finally:
            if not detach:
                if rm:
                    await box.remove(force=True)
                else:
                    await box.stop()

    code = run_coro(main())
    raise typer.Exit(code or 0)


@app.command()
@box_flags
def create(image: ImageArg = None, quiet: QuietOpt = False, *, box: dict[str, Any]) -> None:
    """Create a box (image pulled, disk made) without starting it; print its name."""
    opts = {**box, "image": image}
    rootfs = box["rootfs"]

    async def main() -> None:
        with busy(f"creating a box of {image or rootfs} (an image is pulled if missing)", quiet=quiet):
            box = await AsyncBox.create(**opts)
        print(box.name)

    run_coro(main())


BoxesArg = Annotated[list[str], typer.Argument(metavar="BOX...", help="Box names or ids.")]


@app.command()
def start(boxes: BoxesArg) -> None:
    """Start boxes (cold boot; disks kept)."""
    for_each_box(boxes, lambda b: b.start(), "start")


@app.command()
def stop(
    boxes: BoxesArg,
    time_: Annotated[float, typer.Option("--time", "-t", help="Seconds before forcing.")] = 10.0,
) -> None:
    """Stop boxes gracefully (forced after --time seconds)."""
    for_each_box(boxes, lambda b: b.stop(time_), "stop")


@app.command()
def restart(boxes: BoxesArg) -> None:
    """Stop and start boxes."""
    for_each_box(boxes, lambda b: b.restart(), "restart")


@app.command()
def pause(boxes: BoxesArg) -> None:
    """Freeze boxes' CPUs (memory and processes stay)."""
    for_each_box(boxes, lambda b: b.pause(), "pause")


@app.command()
def unpause(boxes: BoxesArg) -> None:
    """Resume paused boxes."""
    for_each_box(boxes, lambda b: b.unpause(), "unpause")


@app.command()
def rm(
    boxes: BoxesArg,
    force: Annotated[bool, typer.Option("--force", "-f", help="Remove running boxes too.")] = False,
) -> None:
    """Remove boxes (their disks and logs)."""
    for_each_box(boxes, lambda b: b.remove(force=force), "rm")


@app.command()
def ls(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Show stopped boxes too.")] = False,
    filter_: Annotated[list[str] | None, typer.Option("--filter", "-f", help="label=K=V or state=S.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Names only.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List boxes (running and paused ones; -a for all)."""
    try:
        filters(filter_)
    except ValueError as exc:
        raise fail(exc, 2) from exc
    raise typer.Exit(run_ls(all_, filter_, quiet, as_json))  # what `sandlot ls` runs without typer


@app.command("exec", context_settings=COMMAND)
def exec_cmd(
    box: Annotated[str, typer.Argument(help="A running box: its name or id.")],
    cmd: Annotated[str, typer.Argument(help="The command (a program in the box's PATH, or a path).")],
    args: Annotated[list[str] | None, typer.Argument(help="Its arguments.")] = None,
    interactive: Annotated[bool, typer.Option("--interactive", "-i", help="Forward stdin.")] = False,
    tty_mode: Annotated[bool, typer.Option("--tty", "-t", help="Give the command a terminal.")] = False,
    env: EnvOpt = None,
    workdir: WorkdirOpt = None,
    user: UserOpt = None,
    timeout: Annotated[float | None, typer.Option(help="Kill the command after this many seconds.")] = None,
) -> None:
    """Run a command in a running box: sandlot exec [-it] BOX CMD [ARGS...]"""
    argv = _after_dashes([cmd, *(args or [])])
    if not argv:
        raise fail("no command given: sandlot exec BOX CMD [ARGS...]", 2)
    coro = exec_in(box, argv, interactive=interactive, tty_mode=tty_mode, env=env_pairs(env) or None,
                   workdir=workdir, user=user, timeout=timeout)  # fmt: skip
    raise typer.Exit(run_coro(coro) or 0)


def _split_box_path(arg: str) -> tuple[str | None, str]:
    """'BOX:/path' -> ('BOX', '/path'); a local path -> (None, path)."""
    head, sep, tail = arg.partition(":")
    if sep and tail.startswith("/") and "/" not in head and head:
        return head, tail
    return None, arg


@app.command()
def cp(
    src: Annotated[str, typer.Argument(help="BOX:/path or a local path.")],
    dst: Annotated[str, typer.Argument(help="BOX:/path or a local path.")],
    follow_link: Annotated[
        bool,
        typer.Option(
            "--follow-link",
            "-L",
            help="Follow SRC if it is a link, and links inside the tree that "
            "stay inside it (one that leads out refuses the copy).",
        ),
    ] = False,
    follow_outside: Annotated[
        list[str] | None,
        typer.Option(
            "--follow-outside",
            help="With -L, a host path links of an uploaded tree may lead into (repeat it).",
        ),
    ] = None,
) -> None:
    """Copy files between a box and the host, as docker cp does: sandlot cp BOX:/etc/hosts . ;
    sandlot cp ./dir BOX:/srv (into /srv/dir when /srv is a directory; ./dir/. for its contents).
    Links are copied as links; a tree lands whole or not at all."""
    sbox, spath = _split_box_path(src)
    dbox, dpath = _split_box_path(dst)
    if (sbox is None) == (dbox is None):
        raise fail("exactly one side must be BOX:/path", 2)
    if follow_outside and not follow_link:
        raise fail("--follow-outside goes with -L", 2)
    contents = spath.endswith("/.")  # SRC/.: what the directory holds, not the directory

    async def main() -> None:
        if sbox is not None:
            box = await AsyncBox.get(sbox)
            target = Path(dpath)
            if target.is_dir() and not contents:
                target = target / posixpath.basename(spath.rstrip("/"))
            await box.files.download(spath, target, follow_symlinks=follow_link)
        else:
            assert dbox is not None
            box = await AsyncBox.get(dbox)
            local = Path(spath)
            remote = dpath
            there = await box.files.exists(dpath) and (await box.files.stat(dpath)).is_dir
            if there and not contents:
                remote = f"{dpath.rstrip('/')}/{local.resolve().name if spath in ('.', './') else local.name}"
            await box.files.upload(
                local, remote, follow_symlinks=follow_link, follow_outside=follow_outside or ()
            )

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", TransferWarning)
        try:
            run_coro(main())
        finally:
            for w in said:
                if issubclass(w.category, TransferWarning):
                    err.print(
                        f"[yellow]warning:[/] {escape(str(w.message))}", highlight=False, soft_wrap=True
                    )


@app.command()
def logs(
    box: Annotated[str, typer.Argument(help="Box name or id.")],
    tail_: Annotated[int | None, typer.Option("--tail", "-n", help="Only the last N lines.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
) -> None:
    """The box's console: kernel and agent messages."""

    async def console() -> tuple[str, Path]:
        b = await AsyncBox.get(box)
        return await b.logs(tail_), Path((await b.inspect())["paths"]["console"])

    try:
        text, console_log = asyncio.run(console())
    except SandlotError as exc:
        raise fail(exc) from exc
    sys.stdout.write(text)
    sys.stdout.flush()
    if follow:
        try:
            with open(console_log, "rb") as f:
                f.seek(0, os.SEEK_END)
                while True:
                    chunk = f.read()
                    if chunk:
                        sys.stdout.buffer.write(chunk)
                        sys.stdout.flush()
                    else:
                        time.sleep(0.2)
        except KeyboardInterrupt:
            pass


@app.command()
def port(
    box: Annotated[str, typer.Argument(help="Box name or id.")],
    guest: Annotated[int | None, typer.Argument(help="A published guest port (default: all).")] = None,
) -> None:
    """Where the box's published ports are on the host: GUEST -> ADDRESS:PORT."""

    async def published() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = (await (await AsyncBox.get(box)).inspect())["network"]["ports"]
        return found

    try:
        ports = asyncio.run(published())
    except SandlotError as exc:
        raise fail(str(exc)) from None
    shown = [p for p in ports if guest is None or p["guest"] == guest]
    if guest is not None and not any(p["host"] for p in shown):
        raise fail(f"box {box} does not publish port {guest} (or is not running)")
    for p in shown:
        print(f"{p['guest']}/tcp -> {p['address']}:{p['host'] or '(not running)'}")


@app.command()
def network(
    box: Annotated[str, typer.Argument(help="Box name or id.")],
    mode: Annotated[str | None, typer.Option("--network", help="public, allowlist, none or open.")] = None,
    allow: AllowOpt = None,
    clear: Annotated[bool, typer.Option("--clear-allow", help="Empty the allow list.")] = False,
) -> None:
    """Show or change a box's egress policy (a running box applies it to its next connection)."""

    async def main() -> None:
        b = await AsyncBox.get(box)
        if mode is not None or allow or clear:
            await b.set_network(mode, allow=[] if clear else allow)
        print(json.dumps((await b.inspect())["network"], indent=2))

    run_coro(main())


@app.command()
def inspect(boxes: BoxesArg) -> None:
    """Everything about boxes, as JSON."""

    async def each() -> list[dict[str, Any]]:
        return [await (await AsyncBox.get(key)).inspect() for key in boxes]

    try:
        out = asyncio.run(each())
    except SandlotError as exc:
        raise fail(exc) from exc
    print(json.dumps(out if len(out) > 1 else out[0], indent=2, default=str))


@app.command()
def stats(
    boxes: Annotated[
        list[str] | None,
        typer.Argument(metavar="[BOX]...", help="Box names or ids (default: running boxes)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Keep showing the sampled figures (Ctrl-C ends).")
    ] = False,
    every: Annotated[float, typer.Option(help="Seconds between two refreshes of --watch.", min=0.5)] = 2.0,
) -> None:
    """Host CPU time, memory and disk of boxes; with --watch, their sampled metrics as they
    come: CPU %, guest memory, PSS, network and disk bytes per second, commands per second."""

    async def measure() -> list[dict[str, Any]]:
        targets = [await AsyncBox.get(k) for k in boxes] if boxes else await AsyncBox.list(all=False)
        if not watch:
            return [await b.stats() for b in targets]
        rows = []
        for b in targets:
            latest = (await b.metrics(since=-120, limit=2))[-1:] or [{}]
            rows.append({"name": b.name, "state": await b.refresh(), **latest[0]})
        return rows

    def table(rows: list[dict[str, Any]]) -> Table:
        t = Table(box=None, pad_edge=False)
        if not watch:
            for col in ("NAME", "STATE", "CPU TIME", "MEMORY", "DISK"):
                t.add_column(col)
            for r in rows:
                cpu = f"{r['cpu_seconds']:.1f}s" if r["cpu_seconds"] is not None else "-"
                mem = human(r["rss_bytes"]) if r["rss_bytes"] is not None else "-"
                t.add_row(r["name"], r["state"], cpu, mem, human(r["disk_bytes"]))
            return t
        for col in ("NAME", "STATE", "CPU %", "GUEST MEM", "PSS", "NET RX/s", "NET TX/s", "DISK W/s",
                    "EXECS/s"):  # fmt: skip
            t.add_column(col)

        def fig(r: dict[str, Any], key: str, fmt: Any = human) -> str:
            return fmt(r[key]) if r.get(key) is not None else "-"

        for r in rows:
            t.add_row(r["name"], r["state"], fig(r, "cpu_percent", lambda v: f"{v:.1f}"),
                      fig(r, "guest_memory_used_bytes"), fig(r, "pss_bytes"), fig(r, "net_rx_Bps"),
                      fig(r, "net_tx_Bps"), fig(r, "disk_written_Bps"),
                      fig(r, "execs_per_s", str))  # fmt: skip
        return t

    try:
        rows = asyncio.run(measure())
    except SandlotError as exc:
        raise fail(exc) from exc
    if as_json and not watch:
        print(json.dumps(rows, indent=1))
        return
    if not watch:
        Console(soft_wrap=True, highlight=False).print(table(rows))
        return
    from rich.live import Live

    try:
        if as_json:  # one JSON document a line, each refresh
            while True:
                print(json.dumps(rows), flush=True)
                time.sleep(every)
                rows = asyncio.run(measure())
        with Live(table(rows), console=Console(highlight=False), auto_refresh=False) as live:
            while True:
                time.sleep(every)
                rows = asyncio.run(measure())
                live.update(table(rows), refresh=True)
    except KeyboardInterrupt:
        pass
    except SandlotError as exc:
        raise fail(exc) from exc
