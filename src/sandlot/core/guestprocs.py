"""The processes running in a guest, as the flight recorder lists them after each step
(``core.recorder``): which a step started and which it ended.

A listing is one shell in the guest that walks ``/proc`` with builtins, so that it
starts no process per process listed: it prints each process's ``stat`` line (parsed
here), and the command line (one ``tr`` each) only of processes the last listing did not
have (``KNOWN``). Kernel threads (children of ``kthreadd``) are told apart there and
left out; the next listing skips their pids without reading them (``SKIP``): a guest
runs tens of them, which under emulation cost a listing more than its own start (a
kernel thread's pid taken by a process once the guest's pids wrap around is taken
for the thread's, until the thread is seen gone). A
process is known by its pid and its start time (``since``: clock ticks from the
guest's boot), so that a pid used again is a new process. sandlot's own agent's
processes (its relays: what runs them is sandlot, not the box's work) and the
listing's own shell are left out too.

A guest without ``/bin/sh`` (a distroless image) gives no listing: its steps have none,
and nothing fails.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import SandlotError
from . import guestshell

if TYPE_CHECKING:
    from ..protocol.connection import AgentConnection

LISTED = 100  # processes a step names as started, ended or running (each list; the rest are counted)
TIMEOUT = 5.0  # seconds a listing may take before the step goes without one
OUTPUT_MAX = 1 << 20  # bytes a listing may print (past them: no listing), whatever the guest runs
ARGV_KEPT = 4096  # characters of a process's command line kept (the guest chooses them: up to MiBs)

AGENT = "sandlot-agent"  # the agent's processes' name (``native``'s build of guest/agent)
FIELD, ARG = "\x01", "\x02"  # after a stat line, and between a command line's arguments
LIST_SCRIPT = r"""
cd /proc 2>/dev/null || exit 0
for p in [0-9]*; do
  case " $SKIP " in *" $p "*) printf '%s\n' "$p"; continue ;; esac
  [ "$p" = "$$" ] && continue
  IFS= read -r s < "$p/stat" 2>/dev/null || continue
  set -f; set -- ${s##*\) }; set +f
  if [ "$p" = 2 ] || [ "$2" = 2 ]; then printf '%s\001\n' "$s"; continue; fi
  case " $KNOWN " in *" $p:${20} "*) printf '%s\001\n' "$s"; continue ;; esac
  printf '%s\001' "$s"; tr '\000\n' '\002 ' < "$p/cmdline" 2>/dev/null; echo
done
"""

Listing = dict[str, dict[str, Any]]  # "pid:since" -> {"pid", "since", "name", "argv"}


@dataclass
class Found:
    """A listing, and the guest's kernel threads' pids (the next listing skips them)."""

    processes: Listing = field(default_factory=dict)
    kernel: set[int] = field(default_factory=set)


def key(process: Mapping[str, Any]) -> str:
    return f"{process['pid']}:{process['since']}"


def parse(out: str, before: Mapping[str, Mapping[str, Any]]) -> Found:
    """The script's lines: each a ``/proc/PID/stat`` line, and after it the command line
    where the script read one (else the one ``before`` had); but kernel threads (their
    pids kept apart) and the agent's processes."""
    found = Found()
    for line in out.splitlines():
        if line.isdigit():  # a kernel thread skipped: it runs still
            found.kernel.add(int(line))
            continue
        stat, _, argv = line.partition(FIELD)
        opened, closed = stat.find(" ("), stat.rfind(")")  # (a name may hold parentheses)
        if opened <= 0 or closed < opened:
            continue
        pid, name, fields = stat[:opened], stat[opened + 2 : closed], stat[closed + 2 :].split()
        if not pid.isdigit() or len(fields) < 20 or not fields[1].isdigit() or not fields[19].isdigit():
            continue
        if pid == "2" or fields[1] == "2":
            found.kernel.add(int(pid))
            continue
        if name == AGENT:
            continue
        at = f"{pid}:{fields[19]}"
        known = before.get(at)
        args = kept_argv(argv) if argv else (list(known["argv"]) if known else [])
        found.processes[at] = {"pid": int(pid), "since": int(fields[19]), "name": name, "argv": args}
    return found


def kept_argv(printed: str) -> list[str]:
    """A command line as the script printed it, as a step keeps it: its first
    ``ARGV_KEPT`` characters, the argument cut there ending in "..." (a row of the home's
    store holds it, for every step)."""
    kept, room = [], ARGV_KEPT
    for a in (a for a in printed.split(ARG) if a):
        if len(a) > room:
            kept.append(a[:room] + "...")
            break
        kept.append(a)
        room -= len(a)
    return kept


Runner = Callable[[str, dict[str, str]], Awaitable[str]]


async def run(conn: AgentConnection, script: str, env: dict[str, str]) -> str:
    """What ``sh -c script`` in the guest printed (SandlotError, OSError where it could
    not run, or failed, or printed more than ``OUTPUT_MAX``: a guest of many processes
    with long command lines)."""
    out, exit_code = await guestshell.shell(conn, script, env, limit=OUTPUT_MAX)
    if exit_code != 0:
        raise OSError(f"the listing exited {exit_code}")
    return out.decode(errors="replace")


async def gathered(runner: Runner, before: Mapping[str, Mapping[str, Any]], kernel: set[int]) -> Found:
    """A listing made by ``runner`` (what runs the script: the agent): known processes
    (``before``) keep their command lines, and ``kernel`` (the last listing's kernel
    threads) is skipped."""
    env = {"KNOWN": " ".join(before), "SKIP": " ".join(map(str, sorted(kernel)))}
    return parse(await runner(LIST_SCRIPT, env), before)


async def listing(
    conn: AgentConnection, before: Mapping[str, Mapping[str, Any]], kernel: set[int]
) -> Found | None:
    """The guest's processes now (None: none could be listed, within ``TIMEOUT``)."""
    try:
        async with asyncio.timeout(TIMEOUT):
            return await gathered(functools.partial(run, conn), before, kernel)
    except (SandlotError, OSError, TimeoutError):
        return None


def shown(listing: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A listing's processes, by pid, at most ``LISTED``."""
    return sorted((dict(p) for p in listing.values()), key=lambda p: p["pid"])[:LISTED]


def changes(before: Mapping[str, Mapping[str, Any]] | None, now: Found) -> dict[str, Any]:
    """What a step's result keeps: the processes running after it, and, where the
    listing after the step before is known, those it started and those it ended; and
    the kernel threads' pids, which the next listing skips."""
    procs = now.processes
    out: dict[str, Any] = {"running": shown(procs), "count": len(procs), "kernel": sorted(now.kernel)}
    if before is not None:
        started = {k: v for k, v in procs.items() if k not in before}
        ended = {k: v for k, v in before.items() if k not in procs}
        out |= {"started": shown(started), "ended": shown(ended)}
        if len(started) > LISTED or len(ended) > LISTED:
            out["more"] = {"started": max(0, len(started) - LISTED), "ended": max(0, len(ended) - LISTED)}
    return out


def from_kept(kept: Mapping[str, Any] | None) -> tuple[Listing | None, set[int]]:
    """What a step's result kept (``changes``) as the next listing's baseline: its
    processes (None where it kept none, or not all: a listing of more than ``LISTED``),
    and the kernel threads to skip."""
    if not kept:
        return None, set()
    try:
        kernel = {int(p) for p in kept.get("kernel") or []}
        if "running" not in kept or kept.get("count", 0) > len(kept["running"]):
            return None, kernel
        return {key(p): dict(p) for p in kept["running"]}, kernel
    except (KeyError, TypeError, ValueError):
        return None, set()
