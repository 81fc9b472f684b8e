"""``sandlot events``: what happened to the boxes of this home (docs/events.md)."""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import SandlotError
from .common import app, fail

if TYPE_CHECKING:
    from ..api.events import Event

DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str | None) -> float | None:
    """``--since``: a duration ago (``90s``, ``10m``, ``2h``, ``1d``), a Unix time, or an
    ISO 8601 date and time (local time unless it names its zone)."""
    if text is None:
        return None
    if m := DURATION.fullmatch(text.strip()):
        return -float(m.group(1)) * UNIT[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a duration (10m), a Unix time or an ISO date") from None


def line(ev: Event) -> str:
    """One event as a line: time, id, kind, box, state, who, and why."""
    when = datetime.fromtimestamp(ev.at).strftime("%Y-%m-%d %H:%M:%S")
    box = f"{ev.box_name} ({ev.box_id})" if ev.box_name else (ev.box_id or "-")
    out = f"{when}  #{ev.id}  {ev.kind:<15} {box}  {ev.state or '-'}  by {ev.by}"
    return out + (f": {ev.reason}" if ev.reason else "")


@app.command()
def events(
    box: Annotated[str | None, typer.Option("--box", "-b", help="Only this box's (name or id).")] = None,
    since: Annotated[
        str | None, typer.Option(help="From then: 10m, 2h, 1d ago, a Unix time or an ISO date.")
    ] = None,
    after: Annotated[int | None, typer.Option(help="After this event id.", min=0)] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """What happened to the boxes of this home: each state change, crash, OOM kill and
    command timeout, with who did it and why, whichever process did it."""
    from ..api.events import events as read_events

    try:
        for ev in read_events(box=box, since=parse_since(since), after=after, follow=follow):
            print(json.dumps(ev.to_json()) if as_json else line(ev), flush=True)
    except SandlotError as exc:
        raise fail(exc) from exc
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # | head
        sys.stderr.close()


__all__ = ["events", "parse_since"]
