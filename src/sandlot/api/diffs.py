"""What ``box.diff()`` answers: the changes between two states of a box's files
(``core/diffs.py`` says how they are found), as objects, a ``git diff --stat``-like
summary and a patch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from .backend import BoxRef, SnapshotRef


def side_arg(side: Any) -> str | None:
    """A side of a diff as the wire names it: a box object (its files now), a snapshot
    object, ``"image"``, ``"now"``, ``"box:KEY"``, ``"snapshot:KEY"``, or a snapshot's id
    or name."""
    if side is None or isinstance(side, str):
        return side
    ref = getattr(side, "ref", None)
    if isinstance(ref, BoxRef):
        return f"box:{ref.id}"
    if isinstance(ref, SnapshotRef):
        return f"snapshot:{ref.id}"
    raise InvalidArgument(f"a side of a diff is a box, a snapshot, or a name, not {type(side).__name__}")


@dataclass(frozen=True, slots=True)
class FileState:
    """One side's file: ``type`` is file, dir, symlink, fifo, socket, char or block;
    ``sha256`` is there for a regular file that was read (its content changed)."""

    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    target: str | None = None  # a symlink's
    rdev: tuple[int, int] | None = None  # a device's (major, minor)
    sha256: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> FileState | None:
        if d is None:
            return None
        rdev = d.get("rdev")
        return cls(
            d["type"], d["size"], d["mode"], d["uid"], d["gid"], d["mtime"],
            d.get("target"), (rdev[0], rdev[1]) if rdev else None, d.get("sha256"),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Change:
    """One path that differs. ``status``: added, deleted, modified or renamed (then
    ``renamed_from`` is the old path). ``fields`` says what a modification changed:
    content, type, mode, owner, target, rdev. ``diff``: a unified diff, for text."""

    path: str
    status: str
    old: FileState | None
    new: FileState | None
    fields: tuple[str, ...] = ()
    renamed_from: str | None = None
    diff: str | None = None
    diff_omitted: bool = False  # a text diff past the 64 MiB of diffs one answer holds

    @property
    def type(self) -> str:
        state = self.new or self.old
        return state.type if state else "unknown"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Change:
        return cls(
            d["path"], d["status"], FileState.from_json(d.get("old")), FileState.from_json(d.get("new")),
            tuple(d.get("fields") or ()), d.get("renamed_from"), d.get("diff"), bool(d.get("diff_omitted")),
        )  # fmt: skip

    def line(self) -> str:
        """One line of ``Diff.summary()``."""
        mark = {"added": "A", "deleted": "D", "modified": "M", "renamed": "R"}.get(self.status, "?")
        name = f"{self.renamed_from} -> {self.path}" if self.renamed_from else self.path
        if self.type == "dir":
            name += "/"
        state = self.new or self.old
        if state is not None and state.target is not None:
            name += f" -> {state.target}"
        extra = ""
        if self.diff is not None:
            body = self.diff.splitlines()[2:]  # past the "--- a/..." and "+++ b/..." of the one file
            plus, minus = sum(x.startswith("+") for x in body), sum(x.startswith("-") for x in body)
            extra = f"+{plus} -{minus}"
        elif self.old is not None and self.new is not None and "content" in self.fields:
            extra = f"{self.old.size} -> {self.new.size} bytes"
        if self.diff_omitted:
            extra = "(text diff left out: the answer's diffs are full; narrow it with paths)"
        others = [f for f in self.fields if f != "content"]
        if others:
            extra = (extra + " " if extra else "") + "(" + ", ".join(others) + ")"
        return f"{mark} {name}" + (f"  {extra}" if extra else "")


@dataclass(frozen=True)
class Diff:
    """The changes from side ``a`` to side ``b``, sorted by path.

    >>> d = box.diff(snap)                                   # doctest: +SKIP
    >>> [(c.status, c.path) for c in d]                      # doctest: +SKIP
    [('modified', '/app/main.py'), ('added', '/app/notes.txt')]
    >>> print(d.patch())                                     # doctest: +SKIP
    """

    a: str
    b: str
    paths: tuple[str, ...]
    changes: tuple[Change, ...]
    stat: dict[str, int]
    seconds: float
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Diff:
        return cls(
            d["a"], d["b"], tuple(d.get("paths") or ("/",)),
            tuple(Change.from_json(c) for c in d.get("changes") or ()),
            dict(d.get("stat") or {}), float(d.get("seconds") or 0.0), d,
        )  # fmt: skip

    def __iter__(self) -> Any:
        return iter(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def to_json(self) -> dict[str, Any]:
        return self.raw

    def summary(self) -> str:
        """A line a change, then the counts, as ``git diff --stat`` gives them."""
        s = self.stat
        kinds = ("added", "modified", "deleted", "renamed")
        counts = ", ".join(f"{s[k]} {k}" for k in kinds if s.get(k))
        lines = [c.line() for c in self.changes]
        lines.append(
            f"{len(self.changes)} change{'' if len(self.changes) == 1 else 's'} ({counts or 'none'}), "
            f"+{s.get('lines_added', 0)} -{s.get('lines_removed', 0)} lines, from {self.a} to {self.b}"
        )
        return "\n".join(lines)

    def patch(self) -> str:
        """The unified diffs of the text files, and a line for each other change."""
        out = []
        for c in self.changes:
            if c.diff:
                out.append(c.diff)
            elif c.status == "renamed":
                out.append(f"rename from {c.renamed_from}\nrename to {c.path}\n")
            elif c.old is not None and c.new is not None and "content" in c.fields:
                out.append(
                    f"Binary files a{c.path} and b{c.path} differ (sha256 {c.old.sha256} -> {c.new.sha256})\n"
                )
            else:
                out.append(c.line() + "\n")
        return "".join(out)

    def __str__(self) -> str:
        return self.summary()
