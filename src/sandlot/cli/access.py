"""API keys and the audit trail of ``sandlot serve``.

sandlot keys create --name N [--namespace NS] [--admin] [--e2b] [--max-boxes N]
                    [--max-memory-mib N] [--max-disk-gb N] [--max-volumes N]
                    [--max-volume-gb N] [--max-awake N] [--lease S]   the key, once
sandlot keys ls [--json]                                       revoked ones too
sandlot keys revoke NAME                 at once, for good, with the preview URLs it made
sandlot previews ls [--box B] [--key K] [--namespace NS] [--all] [--json]
sandlot previews revoke [ID] [--box B] [--key K] [--namespace NS]
sandlot audit [--box B] [--key K] [--since 1h|30m|2d|ISO-8601] [--limit N] [--json]
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeVar

import typer

from ..errors import SandlotError
from .common import Sandlot, age, app, err, fail

if TYPE_CHECKING:
    from rich.console import Console

    from ..api.access import ApiKey, AuditEntry, Preview

keys_app = Sandlot(help="API keys of `sandlot serve`: create, ls, revoke.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
previews_app = Sandlot(help="Preview URLs that `sandlot serve` signed: ls, revoke.", no_args_is_help=True)
app.add_typer(previews_app, name="previews")

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``90s``, ``30m``, ``1h``, ``2d``, ``1w`` ago, or an ISO-8601 time (local
    unless it names its zone), as seconds since the epoch."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if m:
        return (time.time() if now is None else now) - float(m[1]) * UNITS[m[2]]
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since takes 1h, 30m, 2d (ago) or an ISO-8601 time, not {text!r}") from None
    return when.timestamp()  # a naive time is local


def table_console() -> Console:
    """Where tables go: the terminal's width, or lines unbroken into a pipe or file."""
    from rich.console import Console

    return Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 1000)


class _Record(Protocol):
    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=_Record)


def print_records(records: Sequence[R], as_json: bool, columns: tuple[str, ...],
                  row: Callable[[R], Sequence[str]]) -> None:  # fmt: skip
    """What a listing command prints: the records as JSON (``--json``), or a table of
    ``columns`` with ``row(record)`` for each."""
    if as_json:
        print(json.dumps([r.to_json() for r in records], indent=1))
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in columns:
        table.add_column(col)
    for r in records:
        table.add_row(*row(r))
    table_console().print(table)


def quotas_text(key: ApiKey) -> str:
    q = key.quotas
    parts = [f"boxes={q.boxes}" if q.boxes else "", f"memory={q.memory_mib}MiB" if q.memory_mib else "",
             f"disk={q.disk_gb}GB" if q.disk_gb else "", f"volumes={q.volumes}" if q.volumes else "",
             f"volume_disk={q.volume_gb}GB" if q.volume_gb else "",
             f"awake={q.awake}" if q.awake else ""]  # fmt: skip
    return ",".join(p for p in parts if p) or "-"


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option("--name", help="The key's name (unique; letters, digits, _ . -).")],
    namespace: Annotated[
        str | None, typer.Option("--namespace", help="Only the boxes of this namespace.")
    ] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="Host paths, open network, the audit trail.")
    ] = False,
    max_boxes: Annotated[int | None, typer.Option("--max-boxes", min=1, help="Boxes at once.")] = None,
    max_memory_mib: Annotated[
        int | None, typer.Option("--max-memory-mib", min=1, help="MiB of memory in all.")
    ] = None,
    max_disk_gb: Annotated[
        int | None, typer.Option("--max-disk-gb", min=1, help="GB of disk in all.")
    ] = None,
    lease: Annotated[
        float | None,
        typer.Option("--lease", help="Seconds a box of its remote `with` block outlives the client (10+)."),
    ] = None,
    max_volumes: Annotated[
        int | None, typer.Option("--max-volumes", min=1, help="Named volumes in all.")
    ] = None,
    max_volume_gb: Annotated[
        int | None, typer.Option("--max-volume-gb", min=1, help="GB of disk volumes in all (no shared ones).")
    ] = None,
    e2b: Annotated[
        bool, typer.Option("--e2b", help="In E2B's form (e2b_...), for E2B's SDKs: see docs/e2b.md.")
    ] = False,
    max_awake: Annotated[
        int | None,
        typer.Option("--max-awake", min=1, help="Boxes awake at once (the idle ones that sleep go first)."),
    ] = None,
) -> None:
    """Make an API key and print it (shown only this once; the store keeps a hash)."""
    from ..api.access import create_key

    try:
        key, secret = create_key(name, namespace=namespace, admin=admin, max_boxes=max_boxes,
                                 max_memory_mib=max_memory_mib, max_disk_gb=max_disk_gb, lease=lease,
                                 max_volumes=max_volumes, max_volume_gb=max_volume_gb, e2b=e2b,
                                 max_awake=max_awake)  # fmt: skip
    except SandlotError as exc:
        raise fail(exc, 125) from exc
    print(secret, flush=True)
    scope = f"namespace {key.namespace}" if key.namespace else "every box"
    err.print(f"key {key.name} (id {key.id}, {scope}{', admin' if key.admin else ''}): shown only this "
              f"once, keep it now; `sandlot keys revoke {key.name}` ends it", highlight=False,
              markup=False)  # fmt: skip


@keys_app.command("ls")
def keys_ls(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List API keys: name, id, namespace, admin, quotas, when made, last used, revoked."""
    from ..api.access import list_keys

    try:
        keys = list_keys()
    except SandlotError as exc:
        raise fail(exc, 125) from exc
    columns = ("NAME", "ID", "NAMESPACE", "ADMIN", "QUOTAS", "CREATED", "LAST USED", "REVOKED")
    print_records(keys, as_json, columns,
                  lambda k: (k.name, k.id, k.namespace or "-", "yes" if k.admin else "no", quotas_text(k),
                             age(k.created_at), age(k.last_used_at) if k.last_used_at else "never",
                             age(k.revoked_at)))  # fmt: skip


@keys_app.command("revoke")
def keys_revoke(name: Annotated[str, typer.Argument(help="The key's name (or id).")]) -> None:
    """End an API key at once and for good, and every preview URL it made, on every
    server of the home. Prints the key's name; says on stderr how many previews ended."""
    from ..api.access import previews_ended_with, revoke_key

    try:
        key = revoke_key(name)
        ended = previews_ended_with(key)
    except SandlotError as exc:
        raise fail(exc, 125) from exc
    print(key.name)
    err.print(f"{ended} preview URL{'' if ended == 1 else 's'} ended with it")


PreviewFilter = Annotated[str | None, typer.Option(help="Only those of this box (id).")]
KeyFilter = Annotated[str | None, typer.Option("--key", help="Only those this key made (name or id).")]
NamespaceFilter = Annotated[str | None, typer.Option("--namespace", help="Only those of this namespace.")]


@previews_app.command("ls")
def previews_ls(
    box: PreviewFilter = None,
    key: KeyFilter = None,
    namespace: NamespaceFilter = None,
    everything: Annotated[
        bool, typer.Option("--all", "-a", help="Also those that ended or expired in the last week.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List preview URLs: id, box, port, the key that made it, when it expires or ended, and why."""
    from ..api.access import list_previews

    try:
        found = list_previews(box=box, key=key, namespace=namespace, live=not everything)
    except SandlotError as exc:
        raise fail(exc, 125) from exc

    def row(p: Preview) -> tuple[str, ...]:
        expires = datetime.datetime.fromtimestamp(p.expires_at).strftime("%Y-%m-%d %H:%M")
        ended = f"{age(p.ended_at)} ({p.ended_why})" if p.ended_at else "-"
        return (p.id, p.box_id, str(p.port), p.key_name or p.key_id or "-", p.namespace or "-",
                age(p.created_at), expires, ended)  # fmt: skip

    print_records(
        found, as_json, ("ID", "BOX", "PORT", "KEY", "NAMESPACE", "CREATED", "EXPIRES", "ENDED"), row
    )


@previews_app.command("revoke")
def previews_revoke(
    preview: Annotated[str | None, typer.Argument(help="The preview's id (pv-...).")] = None,
    box: PreviewFilter = None,
    key: KeyFilter = None,
    namespace: NamespaceFilter = None,
) -> None:
    """End preview URLs at once, on every server of the home: one by its id, or all of a
    box, a key or a namespace. Prints how many ended."""
    from ..api.access import end_previews

    try:
        ended = end_previews(preview=preview, box=box, key=key, namespace=namespace)
    except SandlotError as exc:
        raise fail(exc, 125) from exc
    print(ended)


def detail_text(entry: AuditEntry) -> str:
    d = entry.detail
    if isinstance(d.get("argv"), list):
        text = shlex.join(str(a) for a in d["argv"])
        rest = {k: v for k, v in d.items() if k not in ("argv", "exit_code")}
        if d.get("exit_code") is not None:
            text += f" -> {d['exit_code']}"
        return text + (f" {json.dumps(rest)}" if rest else "")
    return json.dumps(d) if d else ""


@app.command()
def audit(
    box: Annotated[str | None, typer.Option("--box", help="Only entries of this box (its id).")] = None,
    key: Annotated[str | None, typer.Option("--key", help="Only entries of this key (name or id).")] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Only since: 1h, 30m, 2d ago, or an ISO-8601 time.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many (the newest).")] = 1000,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Read the audit trail of `sandlot serve`: who did what to which box, and how it ended."""
    from ..api.access import audit_log

    try:
        start = parse_since(since) if since is not None else None
    except ValueError as exc:
        raise fail(exc, 2) from exc
    try:
        entries = audit_log(box=box, key=key, since=start, limit=limit)
    except SandlotError as exc:
        raise fail(exc, 125) from exc

    def row(e: AuditEntry) -> tuple[str, ...]:
        when = datetime.datetime.fromtimestamp(e.at).strftime("%Y-%m-%d %H:%M:%S")
        status = f"{e.status} {e.error}" if e.error else str(e.status)
        took = f"{e.duration * 1000:.0f} ms" if e.duration < 10 else f"{e.duration:.1f} s"
        return when, e.key_name or e.key_id or "-", e.action, e.box or "-", status, took, detail_text(e)

    print_records(entries, as_json, ("TIME", "KEY", "ACTION", "BOX", "STATUS", "DURATION", "DETAIL"), row)
