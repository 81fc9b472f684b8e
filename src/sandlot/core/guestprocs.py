"""The processes running in a guest, as the flight recorder lists them after each step
(``core.recorder``): which a step started and which it ended.

One command per listing, run by the agent after the step's answer went back: a shell
that reads each process's ``/proc/PID/stat`` with builtins alone, so that listing
twenty processes starts no twenty more, and reads the command line (``cmdline``, one
``tr`` each) only of processes the last listing did not have (``KNOWN``). A process is
known by its pid and its start time (``since``: clock ticks from boot), so that a pid used
again is a new process. Kernel threads (children of ``kthreadd``) are left out, and so
are sandlot's own agent's processes (its relays: what runs them is sandlot, not the
box's work) and the listing's own shell.

A guest without ``/bin/sh`` (a distroless image) gives no listing: its steps have none,
and nothing fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import SandlotError

if TYPE_CHECKING:
    from ..protocol.connection import AgentConnection

LISTED = 100  # processes a step names as started, ended or running (each list; the rest are counted)
TIMEOUT = 5.0  # seconds a listing may take before the step goes without one

AGENT = "sandlot-agent"  # the agent's processes' name (``native``'s build of guest/agent)
FIELD, ARG = "\x01", "\x02"  # between a line's fields, and between a command line's arguments
LIST_SCRIPT = r"""
cd /proc 2>/dev/null || exit 0
for p in [0-9]*; do
  [ "$p" = "$$" ] && continue
  IFS= read -r s < "$p/stat" 2>/dev/null || continue
  name=${s#*\(}; name=${name%\)*}
  set -f; set -- ${s##*\) }; set +f
  { [ "$p" = 2 ] || [ "$2" = 2 ]; } && continue
  key="$p:${20}"
  argv=
  case " $KNOWN " in *" $key "*) ;; *) argv=$(tr '\000\n' '\002 ' < "$p/cmdline" 2>/dev/null) ;; esac
  printf '%s\001%s\001%s\n' "$key" "$name" "$argv"
done
"""

Listing = dict[str, dict[str, Any]]  # "pid:since" -> {"pid", "since", "name", "argv"}


def key(process: Mapping[str, Any]) -> str:
    return f"{process['pid']}:{process['since']}"


def parse(out: str, before: Mapping[str, Mapping[str, Any]]) -> Listing:
    """The script's lines as a listing; a known process's command line is the one the
    listing before had (``before``)."""
    found: Listing = {}
    for line in out.splitlines():
        parts = line.split(FIELD)
        if len(parts) != 3 or ":" not in parts[0]:
            continue
        at, name, argv = parts
        pid, since = at.split(":", 1)
        if not pid.isdigit() or not since.isdigit() or name == AGENT:
            continue
        known = before.get(at)
        args = [a for a in argv.split(ARG) if a] if argv else (list(known["argv"]) if known else [])
        found[at] = {"pid": int(pid), "since": int(since), "name": name, "argv": args}
    return found


async def listing(conn: AgentConnection, before: Mapping[str, Mapping[str, Any]]) -> Listing | None:
    """The guest's processes now (None: none could be listed, within ``TIMEOUT``)."""
    from ..protocol.exec import ExecRequest, RemoteProcess

    req = ExecRequest(argv=["/bin/sh", "-c", LIST_SCRIPT], env={"KNOWN": " ".join(before)})
    try:
        async with asyncio.timeout(TIMEOUT):
            proc = await RemoteProcess.start(conn, req)
            proc.stderr.drain()
            out = await proc.stdout.read_all()
            status = await proc.wait()
    except (SandlotError, OSError, TimeoutError):
        return None
    if status.exit_code != 0:
        return None
    return parse(out.decode(errors="replace"), before)


def shown(listing: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A listing's processes, by pid, at most ``LISTED``."""
    return sorted((dict(p) for p in listing.values()), key=lambda p: p["pid"])[:LISTED]


def changes(before: Mapping[str, Mapping[str, Any]] | None, now: Listing) -> dict[str, Any]:
    """What a step's result keeps: the processes running after it, and, where the
    listing after the step before is known, those it started and those it ended."""
    out: dict[str, Any] = {"running": shown(now), "count": len(now)}
    if before is not None:
        started = {k: v for k, v in now.items() if k not in before}
        ended = {k: v for k, v in before.items() if k not in now}
        out |= {"started": shown(started), "ended": shown(ended)}
        if len(started) > LISTED or len(ended) > LISTED:
            out["more"] = {"started": max(0, len(started) - LISTED), "ended": max(0, len(ended) - LISTED)}
    return out


def from_kept(kept: Mapping[str, Any] | None) -> Listing | None:
    """The listing a step's result kept (``changes``): the baseline of the next step.
    None where it kept none, or not all (a listing of more than ``LISTED``)."""
    if not kept or "running" not in kept or kept.get("count", 0) > len(kept["running"]):
        return None
    try:
        return {key(p): dict(p) for p in kept["running"]}
    except (KeyError, TypeError):
        return None
