"""A recorded box's steps as every transport describes them (``box.timeline()``).

>>> box.record()                                              # doctest: +SKIP
>>> box.sh("echo one > /root/a.txt")                          # doctest: +SKIP
>>> box.sh("rm /root/a.txt")                                  # doctest: +SKIP
>>> for step in box.timeline():                               # doctest: +SKIP
...     print(step)
   1  record   {'policy': {'every': 0.0, 'keep_last': None, 'keep_for': None}}  0.000s  checkpoint
   2  exec     sh -c 'echo one > /root/a.txt'  exit 0  0.180s  checkpoint
   3  exec     sh -c 'rm /root/a.txt'  exit 0  0.150s  checkpoint
>>> box.rewind(2)                                             # doctest: +SKIP
>>> box.sh("cat /root/a.txt").stdout                          # doctest: +SKIP
'one\\n'
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from .diffs import Diff


@dataclass(frozen=True)
class Step:
    """One step of a box's timeline: what ran (``what``: an exec's ``argv``, a cell's
    ``code``, a tool's name and arguments, a file operation's ``op`` and ``path``; an
    environment by its names only), how it ended (``result``: ``exit_code``, ``error``,
    ``no_checkpoint`` where its state was not kept), when, its checkpoint's id while
    kept (``rewind``, ``fork_at``), its name, and ``files``: the summary of what it
    changed once computed (``box.step(n, diff=True)`` computes it and gives ``diff``).
    ``egress``: the box's egress decisions during the step, counted by decision
    (``{"allowed": 3, "refused": 1}``); ``box.step(n)`` lists them in ``egress_log``.
    ``processes``: the guest's processes after the step (see the property)."""

    seq: int
    kind: str
    what: dict[str, Any]
    result: dict[str, Any]
    started_at: float
    ended_at: float
    duration: float
    checkpoint: str | None
    name: str | None = None
    files: dict[str, Any] | None = None
    diff: Diff | None = None
    egress: dict[str, int] | None = None
    egress_log: list[dict[str, Any]] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Step:
        diff = Diff.from_json(d["diff"]) if d.get("diff") else None
        return cls(
            seq=int(d["seq"]), kind=str(d["kind"]), what=dict(d.get("what") or {}),
            result=dict(d.get("result") or {}), started_at=float(d["started_at"]),
            ended_at=float(d["ended_at"]), duration=float(d.get("duration") or 0.0),
            checkpoint=d.get("checkpoint"), name=d.get("name"), files=d.get("files"), diff=diff,
            egress=d.get("egress"), egress_log=d.get("egress_log"),
        )  # fmt: skip

    @property
    def processes(self) -> dict[str, Any] | None:
        """The guest's processes as the step left them (None where none could be listed:
        a guest without ``/bin/sh``): ``running``, each ``{"pid", "since", "name", "argv"}``
        (``since``: its start, in clock ticks from the guest's boot), and where the step
        before was listed too, ``started`` and ``ended``: those the step started that
        still ran at its end, and those that ran before it and ended during it (each list
        at most 100: ``count`` says how many run, ``more`` how many more started or
        ended). ``kernel``: the guest's kernel threads' pids, which are no processes of
        its work (the next listing skips them)."""
        found = self.result.get("processes")
        return dict(found) if isinstance(found, dict) else None

    @property
    def kept(self) -> bool:
        """Whether its state is kept: the box can rewind to it, and boxes start from it."""
        return self.checkpoint is not None

    def describe(self) -> str:
        """What ran, in a line."""
        w = self.what
        if "argv" in w:
            return shlex.join(w["argv"])
        if "code" in w:
            first = str(w["code"]).strip().splitlines()
            return f"{w.get('language') or 'python'}: {first[0] if first else ''}"
        if "tool" in w:
            return f"{w['tool']}({', '.join(f'{k}={v!r}' for k, v in (w.get('arguments') or {}).items())})"
        if "op" in w:
            return " ".join(str(w[k]) for k in ("op", "path", "to") if w.get(k) is not None)
        if "to" in w:
            return f"to step {w['to']}"
        return str(w) if w else ""

    def outcome(self) -> str:
        r = self.result
        if r.get("error"):
            return f"error {r['error']}"
        if r.get("signal"):
            return f"signal {r['signal']}"
        if "exit_code" in r:
            return f"exit {r['exit_code']}"
        return "ok"

    def __str__(self) -> str:
        kept = "checkpoint" if self.kept else f"no checkpoint ({self.result.get('no_checkpoint', 'let go')})"
        name = f" [{self.name}]" if self.name else ""
        if self.egress:
            name += "  egress " + ", ".join(f"{k} {v}" for k, v in sorted(self.egress.items()))
        procs = self.processes or {}
        if procs.get("started") or procs.get("ended"):
            name += f"  processes +{len(procs['started'])} -{len(procs['ended'])}"
        line = f"{self.seq:4d}  {self.kind:<8} {self.describe()[:80]}  {self.outcome()}"
        return f"{line}  {self.duration:.3f}s  {kept}{name}"


@dataclass(frozen=True)
class Bisection:
    """What ``box.bisect(test)`` found: ``first_bad``, the first step after which the test
    fails (None if it passes after the last), ``last_good`` the kept step before it
    (None if it fails already after the first), the failing test's ``exit_code`` and
    output, the ``diff`` of the first bad step (from the last good one), each step tested
    with its exit code, the rounds of tests run at once, and the wall time."""

    first_bad: Step | None
    last_good: Step | None
    exit_code: int | None
    stdout: str
    stderr: str
    diff: Diff | None
    tested: dict[int, int]
    rounds: int
    seconds: float

    def __str__(self) -> str:
        if self.first_bad is None:
            return f"the test passes after every step ({len(self.tested)} tested, {self.rounds} rounds)"
        where = f"after step {self.last_good.seq}" if self.last_good else "after no step"
        head = (
            f"first bad step: {self.first_bad}\n"
            f"the test passed {where}, and failed with exit {self.exit_code} after step {self.first_bad.seq} "
            f"({len(self.tested)} steps tested in {self.rounds} rounds, {self.seconds:.1f}s)"
        )
        out = "\n".join(t for t in (self.stdout.strip(), self.stderr.strip()) if t)
        tail = f"\n--- the test's output ---\n{out[-4000:]}" if out else ""
        changed = f"\n--- what the step changed ---\n{self.diff.summary()}" if self.diff is not None else ""
        return head + changed + tail


def probes(lo: int, hi: int, at_once: int) -> list[int]:
    """Up to ``at_once`` indexes strictly between ``lo`` and ``hi``, evenly spread: one
    round of a search over ``at_once`` + 1 parts."""
    inside = hi - lo - 1
    if inside <= 0:
        return []
    n = min(at_once, inside)
    return sorted({lo + max(1, round((i + 1) * (hi - lo) / (n + 1))) for i in range(n)} - {hi})
