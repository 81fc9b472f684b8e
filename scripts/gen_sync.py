#!/usr/bin/env python3
"""Generate the sync API from the async classes: ``src/sandlot/api/sync.py`` (boxes,
snapshots, files, processes, and the client of boxes elsewhere, ``api/client.py``).

Each sync class is a thin twin of an async one: same methods, same signatures,
same docstrings; a coroutine method runs on sandlot's loop thread, an async
iterator is driven item by item, and async objects in results are wrapped in
their sync twins (``aclose`` becomes ``close``). Members a ``*Base`` class in
the output's base module (``api/sync_base.py``)
defines are written by hand there and skipped here. Module-level functions
named in an output's ``functions`` get a sync twin too (``connect_async`` ->
``connect``), and so do those of other modules named in its ``lazy`` (``pull_async``
-> ``pull``, ``template_async`` -> ``template``...), which import their function when
called: the sync API imports the image store and the pools only when used.

It also writes what ``core/options.py`` declares of each box option: the signature
and docstring of ``AsyncBox.__init__`` (so the sync twin's too), ``BoxSpec``'s
fields, each between its markers, and the listing of ``sandlot.Box(...)`` on the API
page (docs/api.md).

    python scripts/gen_sync.py           # write the files
    python scripts/gen_sync.py --check   # fail if one is not what would be written (CI)
"""

from __future__ import annotations

import ast
import copy
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "src" / "sandlot" / "api"


@dataclass(frozen=True)
class Output:
    """One generated module: its twins (async class -> (sync class, its module, its
    hand-written base)), the module of those bases, and its docstring."""

    path: Path
    twins: dict[str, tuple[str, str, str]]
    bases: str
    doc: list[str]
    functions: dict[str, str] = field(default_factory=dict)  # module-level function -> its sync twin
    # module-level functions of other modules of the API -> (sync twin, module): each twin
    # imports its function when called, so that the sync API's import stays what it was
    lazy: dict[str, tuple[str, str]] = field(default_factory=dict)


LOCAL = Output(
    API / "sync.py",
    {
        "AsyncBox": ("Box", "box", "BoxBase"),
        "AsyncSnapshot": ("Snapshot", "box", "SnapshotBase"),
        "AsyncFiles": ("Files", "files", "FilesBase"),
        "AsyncWatch": ("Watch", "files", "WatchBase"),
        "AsyncProcess": ("Process", "process", "ProcessBase"),
        "AsyncStream": ("Stream", "process", "StreamBase"),
        "AsyncClient": ("Client", "client", "ClientBase"),
        "AsyncVolumes": ("Volumes", "volumes", "VolumesBase"),
        "AsyncDesktop": ("Desktop", "desktop", "DesktopBase"),
    },
    "sync_base",
    [
        '"""The sync API: ``Box``, ``Snapshot``, ``Files``, ``Watch``, ``Process``, ``Stream`` and',
        "``Client``, each a thin twin of its async class (same methods, same signatures) that runs",
        "the same coroutines on sandlot's loop thread (``api/loop.py``); and the module-level",
        'functions of the API (``pull``, ``template``, ``set_pool``...), twins of their async ones."""',
    ],
    {"connect_async": "connect"},
    {
        "pull_async": ("pull", "images"),
        "template_async": ("template", "templates"),
        "import_snapshot_async": ("import_snapshot", "templates"),
        "prune_snapshots_async": ("prune_snapshots", "templates"),
        "set_pool_async": ("set_pool", "templates"),
        "pools_async": ("pools", "templates"),
    },
)
OUTPUTS = (LOCAL,)
OUT = LOCAL.path

# every twin, whichever module it is generated into: results are wrapped across modules
TWINS = {a: t for o in OUTPUTS for a, t in o.twins.items()}
DUNDERS = {"__aenter__": "__enter__", "__aexit__": "__exit__", "__aiter__": "__iter__", "aclose": "close"}
NAMES = {a: s for a, (s, _, _) in TWINS.items()} | {"AsyncIterator": "Iterator"}
NAMES |= {f: s for o in OUTPUTS for f, s in o.functions.items()}
NAMES |= {f: s for o in OUTPUTS for f, (s, _) in o.lazy.items()}


def sync_text(annotation: str) -> str:
    """An annotation as the sync class spells it."""
    out = re.sub(r"\b(" + "|".join(NAMES) + r")\b", lambda m: NAMES[m.group(1)], annotation)
    parts, depth, cur = [], 0, ""
    for ch in out:  # a union whose members became the same after renaming
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "|" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return " | ".join(dict.fromkeys(parts))


def wrapped(expr: str, annotation: str | None) -> str:
    """``expr`` (an async result of ``annotation``) as the sync twin returns it."""
    if not annotation:
        return expr
    if annotation in TWINS:
        return f"{TWINS[annotation][0]}.wrap({expr})"
    union = [p.strip() for p in annotation.split("|")]
    if len(union) == 2 and all(p in TWINS for p in union):  # one of two twins, told apart at run time
        first, second = (TWINS[p][0] for p in union)
        return f"{first}.wrap(r) if isinstance(r := {expr}, {union[0]}) else {second}.wrap(r)"
    m = re.fullmatch(r"(?:builtins\.)?list\[(\w+)\]", annotation)
    if m and m.group(1) in TWINS:
        return f"[{TWINS[m.group(1)][0]}.wrap(x) for x in {expr}]"
    if annotation == "AsyncIterator[Event]":  # independent records: prefetched (api/loop.py)
        return f"loop.iterate({expr}, prefetch=loop.RECORDS_AHEAD)"
    if annotation.startswith("AsyncIterator["):
        return f"loop.iterate({expr})"
    return expr


@dataclass
class Member:
    node: ast.FunctionDef | ast.AsyncFunctionDef
    kind: str  # method, classmethod, property

    @property
    def returns(self) -> str | None:
        return ast.unparse(self.node.returns) if self.node.returns else None


def call_args(args: ast.arguments, skip_first: bool) -> str:
    out = []
    positional = [*args.posonlyargs, *args.args][1 if skip_first else 0 :]
    out += [a.arg for a in positional]
    if args.vararg:
        out.append(f"*{args.vararg.arg}")
    out += [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
    if args.kwarg:
        out.append(f"**{args.kwarg.arg}")
    return ", ".join(out)


def signature(args: ast.arguments) -> str:
    """The parameters as the sync twin spells them: each annotation on its own (a union's
    members that became the same are one), so two parameters' unions never mix."""
    args = copy.deepcopy(args)
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    for a in every:
        if a is not None and a.annotation is not None:
            a.annotation = ast.parse(sync_text(ast.unparse(a.annotation)), mode="eval").body
    return ast.unparse(args)


def members(cls: ast.ClassDef) -> list[Member]:
    out = []
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        decos = {ast.unparse(d) for d in node.decorator_list}
        if node.name.startswith("_") and node.name not in DUNDERS and node.name != "__init__":
            continue
        kind = "property" if "property" in decos else "classmethod" if "classmethod" in decos else "method"
        out.append(Member(node, kind))
    return out


def doc(node: ast.AST, indent: str) -> list[str]:
    text = ast.get_docstring(node, clean=False)  # type: ignore[arg-type]
    if not text:
        return []
    text = text.replace("(async API)", "(sync API)").replace("async with ", "with ").replace("await ", "")
    text = text.replace("async for ", "for ")
    text = re.sub(r"\b(" + "|".join(NAMES) + r")\b", lambda m: NAMES[m.group(1)], text)
    body = text.replace('"""', r"\"\"\"")
    return [f'{indent}"""{body}"""']


def generate_function(
    node: ast.FunctionDef | ast.AsyncFunctionDef, sync_name: str, lazy_from: str | None = None
) -> list[str]:
    """The sync twin of a module-level function of the async API (``lazy_from``: the module
    it imports the function from when called)."""
    ret = ast.unparse(node.returns) if node.returns else None
    call = f"{node.name}({call_args(node.args, False)})"
    if isinstance(node, ast.AsyncFunctionDef):
        call = f"loop.run({call})"
    lines = [f"def {sync_name}({signature(node.args)}) -> {sync_text(ret or 'None')}:"]
    lines += doc(node, "    ")
    if lazy_from is not None:
        lines.append(f"    from .{lazy_from} import {node.name}")
        lines.append("")
    lines.append(f"    {'return ' if ret not in (None, 'None') else ''}{wrapped(call, ret)}")
    return lines


def shadowed(cls: ast.ClassDef) -> set[str]:
    """Twin names a class's own methods take (``Client.Box``): within the class, an
    annotation by that name would mean the method, so it names the ``...Type`` alias."""
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return own & {s for s, _, _ in TWINS.values()}


def unshadow(text: str, names: set[str]) -> str:
    for name in names:
        text = re.sub(rf"(?<![\w.]){name}\b(?!\()", f"{name}Type", text)
    return text


def generate_class(async_name: str, cls: ast.ClassDef, base_members: set[str]) -> list[str]:
    sync_name, _module, base = TWINS[async_name]
    hidden = shadowed(cls)
    lines = [f"class {sync_name}({base}):"]
    lines += doc(cls, "    ") or [f'    """The sync twin of ``{async_name}``."""']
    for m in members(cls):
        node = m.node
        name = DUNDERS.get(node.name, node.name)
        if name in base_members:
            continue
        is_async = isinstance(node, ast.AsyncFunctionDef)
        ret = m.returns
        lines.append("")
        if name == "__init__":
            lines.append(f"    def __init__({signature(node.args)}) -> None:")
            lines += doc(node, "        ")
            lines.append(f"        self._a = {async_name}({call_args(node.args, True)})")
            continue
        if m.kind == "property":
            lines.append("    @property")
            lines.append(f"    def {name}(self) -> {sync_text(ret or 'Any')}:")
            lines += doc(node, "        ")
            lines.append(f"        return {wrapped(f'self._a.{node.name}', ret)}")
            continue
        owner = async_name if m.kind == "classmethod" else "self._a"
        call = f"{owner}.{node.name}({call_args(node.args, True)})"
        iterates = bool(ret and ret.startswith("AsyncIterator["))
        if is_async and not iterates:
            call = f"loop.run({call})"
        if name == "__enter__":
            result_type, body = sync_name, [f"        {call}", "        return self"]
        elif name == "__exit__":
            result_type, body = "None", [f"        {call}"]
        else:
            result_type = sync_text(ret or "None")
            expr = wrapped(call, ret)
            body = [f"        {'return ' if ret not in (None, 'None') else ''}{expr}"]
        if m.kind == "classmethod":
            lines.append("    @classmethod")
        lines.append(
            f"    def {name}({unshadow(signature(node.args), hidden)}) -> {unshadow(result_type, hidden)}:"
        )
        lines += doc(node, "        ")
        lines += body
    return lines


def bindings(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Every name the async modules bind at top level, and the import that binds it here."""
    out: dict[str, str] = {}
    for module, tree in trees.items():
        nodes: list[ast.stmt] = []
        for node in tree.body:
            nodes += node.body if isinstance(node, ast.If) else [node]  # TYPE_CHECKING blocks too
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    out.setdefault(
                        a.asname or a.name, f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
                    )
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                source = "." * node.level + (node.module or "")
                for a in node.names:
                    alias = f" as {a.asname}" if a.asname else ""
                    out.setdefault(a.asname or a.name, f"from {source} import {a.name}{alias}")
            elif isinstance(node, ast.Assign | ast.ClassDef | ast.FunctionDef):
                names = (
                    [t.id for t in node.targets if isinstance(t, ast.Name)]
                    if isinstance(node, ast.Assign)
                    else [node.name]
                )
                for name in names:
                    out.setdefault(name, f"from .{module} import {name}")
    return out


def run_time_names(body: list[str]) -> set[str]:
    """The names the generated code uses when it runs: in function bodies, default values,
    decorators and base classes, not in annotations (which stay strings: ``from __future__
    import annotations``)."""
    tree = ast.parse("\n".join(body))
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for part in (*node.decorator_list, *node.args.defaults, *node.args.kw_defaults, *node.body):
                if part is not None:
                    visit(part)
            return
        if isinstance(node, ast.ClassDef):
            for part in (*node.bases, *node.decorator_list, *node.body):
                visit(part)
            return
        if isinstance(node, ast.AnnAssign):
            if node.value is not None:
                visit(node.value)
            return
        if isinstance(node, ast.Name):
            out.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def module_header(output: Output, body: list[str], trees: dict[str, ast.Module]) -> list[str]:
    known = bindings(trees)
    used = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", "\n".join(body)))
    mine = {s for s, _, _ in output.twins.values()} | set(output.functions.values())
    mine |= {s for s, _ in output.lazy.values()} | set(output.lazy)  # each lazy twin imports its own
    names = {n for n in used if n in known and n not in mine}
    running = run_time_names(body)
    # what only annotations name is imported for type checkers alone: ``import sandlot``
    # then loads neither the remote client's libraries nor what only some methods need
    now = {known[n] for n in names if n in running}
    later = {known[n] for n in names if n not in running} - now
    for other in OUTPUTS:  # sync twins another output generates
        if other is not output:
            now |= {f"from .{other.path.stem} import {s}" for s, _, _ in other.twins.values() if s in used}
    return [
        "# Generated by scripts/gen_sync.py from the async classes: do not edit; run it instead.",
        *output.doc,
        "",
        "from __future__ import annotations",
        "",
        "from collections.abc import Iterator",
        "from typing import TYPE_CHECKING, TypeAlias",
        *sorted(now),
        "from . import loop",
        *[f"from .{output.bases} import {base}" for _a, (_s, _m, base) in output.twins.items()],
        *(["", "if TYPE_CHECKING:", *[f"    {line}" for line in sorted(later)]] if later else []),
    ]


def generate(output: Output = LOCAL) -> str:
    modules = {v[1] for v in output.twins.values()}
    trees = {m: ast.parse((API / f"{m}.py").read_text()) for m in modules}
    base_tree = ast.parse((API / f"{output.bases}.py").read_text())
    base_members: dict[str, set[str]] = {}
    for node in base_tree.body:
        if isinstance(node, ast.ClassDef):
            own = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            base_members[node.name] = own | {"wrap", "aio", "__repr__"}
    body: list[str] = []
    for async_name, (_s, module, base) in output.twins.items():
        cls = next(n for n in trees[module].body if isinstance(n, ast.ClassDef) and n.name == async_name)
        body += ["", "", *generate_class(async_name, cls, base_members[base])]
    for name, sync_name in output.functions.items():
        node = next(
            n
            for tree in trees.values()
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        )
        body += ["", "", *generate_function(node, sync_name)]
    extra = {m: ast.parse((API / f"{m}.py").read_text()) for _s, m in output.lazy.values() if m not in trees}
    for name, (sync_name, module) in output.lazy.items():
        node = next(
            n
            for n in extra.get(module, trees.get(module, ast.Module([], []))).body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        )
        body += ["", "", *generate_function(node, sync_name, lazy_from=module)]
    out = module_header(output, body, {**trees, **extra}) + body
    aliases = sorted(
        {
            n
            for o in output.twins
            for n in shadowed(
                next(c for t in trees.values() for c in t.body if isinstance(c, ast.ClassDef) and c.name == o)
            )
        }
    )
    if aliases:
        out += [
            "",
            "",
            *[f"{n}Type: TypeAlias = {n}  # for annotations where a method has the name" for n in aliases],
        ]
    out.append("")
    names = [s for s, _, _ in output.twins.values()] + list(output.functions.values())
    names += [s for s, _ in output.lazy.values()]
    out.append(f"__all__ = {sorted(names)!r}")
    source = "\n".join(out) + "\n"
    ruff = [sys.executable, "-m", "ruff"]
    name = str(output.path)
    fixed = subprocess.run([*ruff, "check", "--fix-only", "--quiet", "--stdin-filename", name, "-"],
                           input=source, capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    if fixed.returncode == 0 and fixed.stdout:
        source = fixed.stdout
    formatted = subprocess.run([*ruff, "format", "--stdin-filename", name, "-"],
                               input=source, capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    if formatted.returncode != 0:
        raise SystemExit(f"ruff format failed on the generated code:\n{formatted.stderr}")
    return formatted.stdout


# -- what core/options.py declares: AsyncBox.__init__ and BoxSpec's fields -----------------

INIT_START = "    # -- AsyncBox.__init__, from core/options.py: written by scripts/gen_sync.py, edit there --"
INIT_END = "    # -- end of AsyncBox.__init__ --"
FIELDS_START = "    # -- the options (core/options.py), written by scripts/gen_sync.py: edit there --"
FIELDS_END = "    # -- end of the options --"


def declared() -> tuple[Any, ...]:
    sys.path.insert(0, str(ROOT / "src"))
    from sandlot.core.options import OPTIONS

    return OPTIONS


def literal(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def box_init(options: tuple[Any, ...]) -> list[str]:
    """``AsyncBox.__init__``: every option a keyword with its type and default, and its help."""
    lines = [INIT_START, "    def __init__(", "        self,", "        image: str | Image | None = None,"]
    lines += ["        *,"]
    lines += [f"        {o.name}: {o.type} = {literal(o.default)}," for o in options]
    lines += ["    ) -> None:"]
    lines += [
        '        """Describe a box; ``start()`` makes it and boots it (``async with`` too, and removes it',
        "        at the block's end unless ``keep``). ``image``: an image reference (``python:3.12-slim``),",
        "        or an ``Image``; else ``rootfs``. The options (``core/options.py`` declares each):",
        "",
    ]
    for o in options:
        wrapped = textwrap.wrap(f"- ``{o.name}``: {o.help}", width=100, subsequent_indent="  ")
        lines += [f"        {w}" for w in wrapped]
        shown = o.default is not None and o.default is not False and o.kind != "handle"
        default = f" Default: ``{literal(o.default)}``." if shown else ""
        if default and len(lines[-1]) + len(default) <= 108:
            lines[-1] += default
        elif default:
            lines.append(f"         {default}")
    lines += ['        """', "        self._describe(image, locals())", "", INIT_END]
    return lines


def spec_fields(options: tuple[Any, ...]) -> list[str]:
    """``BoxSpec``'s field of each option of the box: the form it keeps."""
    lines = [FIELDS_START]
    for o in options:
        if o.kind == "box":
            kind, default = o.keeps or (o.type, literal(o.default))
            lines.append(f"    {o.name}: {kind} = {default}")
    return [*lines, FIELDS_END]


LISTING_START = "sandlot.Box("  # docs/api.md's listing of the options, to its closing ")"


def api_listing(options: tuple[Any, ...]) -> list[str]:
    """docs/api.md's ``sandlot.Box(...)``: each option with its type and default, and its
    one-line comment aligned at the first of two columns it fits before."""
    lines = [LISTING_START, '    image: str | Image | None = None,  # "python:3.12-slim", '
             '"ghcr.io/o/t@sha256:...", an Image', "    *,"]  # fmt: skip
    for o in options:
        shown = o.shown or o.type.replace("os.PathLike[str]", "PathLike")
        line = f"    {o.name}: {shown} = {literal(o.default)},"
        if o.brief:
            column = next((c for c in (37, 44) if len(line) < c), len(line) + 2)
            line = f"{line.ljust(column)}# {o.brief}"
        lines.append(line)
    return [*lines, ")"]


def with_listing(path: Path, listing: list[str]) -> str:
    """``path``'s text with the lines from ``LISTING_START`` to the first ``)`` after it
    made ``listing``."""
    lines = path.read_text().split("\n")
    try:
        first = lines.index(LISTING_START)
        last = lines.index(")", first)
    except ValueError:
        raise SystemExit(f"{path.relative_to(ROOT)} has lost its listing: {LISTING_START!r}") from None
    return "\n".join([*lines[:first], *listing, *lines[last + 1 :]])


def with_block(path: Path, start: str, end: str, block: list[str]) -> str:
    """``path``'s text with the lines from ``start`` to ``end`` (both kept) made ``block``."""
    lines = path.read_text().split("\n")
    try:
        first, last = lines.index(start), lines.index(end)
    except ValueError:
        raise SystemExit(f"{path.relative_to(ROOT)} has lost its markers: {start.strip()!r}") from None
    return "\n".join([*lines[:first], *block, *lines[last + 1 :]])


def declared_files() -> dict[Path, str]:
    options = declared()
    return {
        API / "box.py": with_block(API / "box.py", INIT_START, INIT_END, box_init(options)),
        ROOT / "src" / "sandlot" / "core" / "spec.py": with_block(
            ROOT / "src" / "sandlot" / "core" / "spec.py", FIELDS_START, FIELDS_END, spec_fields(options)
        ),
        ROOT / "docs" / "api.md": with_listing(ROOT / "docs" / "api.md", api_listing(options)),
    }


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for path, text in declared_files().items():
        if path.read_text() == text:
            continue
        if check:
            stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for output in OUTPUTS:
        source = generate(output)
        if check:
            if not output.path.is_file() or output.path.read_text() != source:
                stale.append(output.path)
            continue
        if not output.path.is_file() or output.path.read_text() != source:
            output.path.write_text(source)
            print(f"wrote {output.path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)} is out of date: run scripts/gen_sync.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
