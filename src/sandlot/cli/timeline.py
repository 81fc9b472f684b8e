"""The flight recorder's commands: record, timeline, rewind, fork-at, promote, bisect.

sandlot record BOX [--every S] [--keep-last N] [--keep-for S] | --off
sandlot timeline BOX [--after N] [--limit N] [--json]
sandlot timeline BOX STEP [--diff] [--json]   one step (and what it changed)
sandlot rewind BOX STEP
sandlot fork-at BOX STEP [-n N] [--name P]
sandlot promote BOX CHILD                 a fork takes the box's place
sandlot bisect BOX --test CMD [--parallel N] [--good STEP]
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer

from ..api.box import AsyncBox
from ..api.timeline import Step
from .common import app, fail, run_coro

StepArg = Annotated[str, typer.Argument(help="A step: its number in the timeline, or its name.")]


def step_json(step: Step) -> dict[str, object]:
    out = {k: v for k, v in asdict(step).items() if k != "diff"}
    if step.diff is not None:
        out["diff"] = step.diff.to_json()
    return out


@app.command()
def record(
    box: Annotated[str, typer.Argument(help="The box.")],
    off: Annotated[bool, typer.Option("--off", help="Stop recording (the timeline stays).")] = False,
    every: Annotated[
        float, typer.Option("--every", help="At most one checkpoint per this many seconds (0: every step).")
    ] = 0.0,
    keep_last: Annotated[int | None, typer.Option("--keep-last", help="Checkpoints kept, newest first.")] = (
        None
    ),
    keep_for: Annotated[float | None, typer.Option("--keep-for", help="Seconds a checkpoint is kept.")] = (
        None
    ),
) -> None:
    """Record every step taken in a box (commands, code cells, file writes, tool calls)
    with a checkpoint of the state it left, to rewind to or fork from later."""

    async def main() -> None:
        b = await AsyncBox.get(box)
        policy = await b.record(not off, every=every, keep_last=keep_last, keep_for=keep_for)
        print(f"{b.name}: " + ("not recording" if policy is None else f"recording {json.dumps(policy)}"))

    run_coro(main())


@app.command()
def timeline(
    box: Annotated[str, typer.Argument(help="The box.")],
    step: Annotated[str | None, typer.Argument(help="One step (number or name): all of it.")] = None,
    after: Annotated[int, typer.Option("--after", help="Only the steps after this one.")] = 0,
    limit: Annotated[int | None, typer.Option("--limit", help="At most this many steps.")] = None,
    diff: Annotated[bool, typer.Option("--diff", help="With STEP: what it changed in the files.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="As JSON.")] = False,
) -> None:
    """The steps recorded in a box, oldest first: what ran, how it ended, how long it
    took, and whether its state is kept (a checkpoint)."""
    if diff and step is None:
        raise fail("--diff needs a STEP", 2)

    async def main() -> None:
        b = await AsyncBox.get(box)
        if step is not None:
            one = await b.step(step, diff=diff)
            if as_json:
                print(json.dumps(step_json(one), indent=2, default=str))
                return
            print(one)
            print(json.dumps({"what": one.what, "result": one.result}, indent=2, default=str))
            if one.diff is not None:
                print(one.diff.summary())
                print(one.diff.patch(), end="")
            return
        steps = await b.timeline(after=after, limit=limit)
        if as_json:
            print(json.dumps([step_json(s) for s in steps], indent=2, default=str))
        else:
            for s in steps:
                print(s)

    run_coro(main())


@app.command()
def rewind(box: Annotated[str, typer.Argument(help="The box.")], step: StepArg) -> None:
    """Take a recording box back, in place, to the state just after one of its steps."""

    async def main() -> None:
        b = await AsyncBox.get(box)
        await b.rewind(step)
        print(b.name)

    run_coro(main())


@app.command("fork-at")
def fork_at(
    box: Annotated[str, typer.Argument(help="The box.")],
    step: StepArg,
    n: Annotated[int, typer.Option("-n", help="How many boxes.")] = 1,
    name: Annotated[str | None, typer.Option("--name", help="Prefix of their names.")] = None,
) -> None:
    """Start N running boxes in the state just after one of a box's recorded steps."""

    async def main() -> None:
        for k in await (await AsyncBox.get(box)).fork_at(step, n, name=name):
            print(k.name)

    run_coro(main())


@app.command()
def promote(
    box: Annotated[str, typer.Argument(help="The box.")],
    child: Annotated[str, typer.Argument(help="A box started from a state of it (a fork).")],
) -> None:
    """A fork takes a box's place: its memory, processes and disk under the box's id,
    name, ports, previews, volumes and lease; the fork goes. Prints the snapshot that
    keeps what the box was."""

    async def main() -> None:
        kept = await (await AsyncBox.get(box)).promote(child)
        print(kept.id)

    run_coro(main())


@app.command()
def bisect(
    box: Annotated[str, typer.Argument(help="The box.")],
    test: Annotated[str, typer.Option("--test", help="A shell line that exits 0 where things are right.")],
    parallel: Annotated[int, typer.Option("--parallel", "-j", help="Forks tested at once.")] = 4,
    good: Annotated[
        str | None, typer.Option("--good", help="A step after which TEST passes: the search starts there.")
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each test may run.")] = 600.0,
    as_json: Annotated[bool, typer.Option("--json", help="As JSON.")] = False,
) -> None:
    """Find the first recorded step after which TEST fails, testing forks of the box at
    the steps tried (the box is not touched). Exits 1 if a step breaks it, 0 if none does."""

    async def main() -> int:
        found = await (await AsyncBox.get(box)).bisect(test, parallel=parallel, timeout=timeout, good=good)
        if as_json:
            out = {
                "first_bad": step_json(found.first_bad) if found.first_bad else None,
                "last_good": step_json(found.last_good) if found.last_good else None,
                "exit_code": found.exit_code, "stdout": found.stdout, "stderr": found.stderr,
                "diff": found.diff.to_json() if found.diff is not None else None,
                "tested": found.tested, "rounds": found.rounds, "seconds": round(found.seconds, 3),
            }  # fmt: skip
            print(json.dumps(out, indent=2, default=str))
        else:
            print(found)
        return 1 if found.first_bad is not None else 0

    if run_coro(main()):
        raise typer.Exit(1)
