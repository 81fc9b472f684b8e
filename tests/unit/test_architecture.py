"""The layering of ``docs/architecture.md``, checked on the source: the import graph
of ``sandlot`` has no cycle and no import from a lower layer into a higher one,
and no private member crosses a module. Imports inside functions count (they
are real dependencies), and so do imports only for type checking: two modules
that need each other's types are tangled as much as two that call each other."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "sandlot"

# Lower numbers are lower layers. A module may import its own package (a folder
# of one layer) and anything in a lower layer; never a peer package of its layer.
LAYERS: dict[str, int] = {
    "sandlot.errors": 0, "sandlot.home": 0,
    "sandlot.config": 1, "sandlot.pids": 1, "sandlot.version": 1, "sandlot.crashpoints": 1,
    "sandlot.native": 1, "sandlot.hostsetup": 1, "sandlot.ksm": 1, "sandlot.records": 1,
    "sandlot.clusterauth": 1,
    "sandlot.protocol": 2, "sandlot.images": 2, "sandlot.net": 2, "sandlot.guest": 2,
    "sandlot.engine": 3,
    "sandlot.core": 4,
    "sandlot.api": 5,
    "sandlot.fleet": 6,  # the fleet on Ray, on the API (next to the tools; neither imports the other)
    "sandlot.tools": 6,  # the tools for language models, on the API
    "sandlot.integrations": 6,  # sandboxes of other frameworks (the OpenAI Agents SDK), on the API
    "sandlot.mcp": 7,  # the tools as an MCP server
    "sandlot.server": 8,  # it mounts the MCP server at /mcp
    "sandlot.cli": 9,  # the command: it runs the other faces (``sandlot serve``, ``sandlot mcp``)
    "sandlot": 10,  # the package: it re-exports the API (by name, imported on first use)
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    for n in (2, 1):
        candidate = ".".join(parts[:n])
        if candidate in LAYERS:
            return candidate
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def resolve(module: str, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".")
        is_pkg = MODULES[module].name == "__init__.py"
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def imports(module: str) -> list[str]:
    """The sandlot modules ``module`` imports, wherever the import stands."""
    tree = ast.parse(MODULES[module].read_text())
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            targets = resolve(module, node)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            if t == "sandlot" or t.startswith("sandlot."):
                while t not in MODULES and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != module:
                    out.append(t)
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_is_in_a_layer() -> None:
    for m in MODULES:
        unit_of(m)


def test_nothing_imports_upward_or_across() -> None:
    wrong = []
    for m, deps in GRAPH.items():
        mine = unit_of(m)
        for dep in deps:
            theirs = unit_of(dep)
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{m} -> {dep} ({mine} is layer {LAYERS[mine]}, {theirs} is {LAYERS[theirs]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_import_graph_has_no_cycle() -> None:
    edges = defaultdict(set)
    for m, deps in GRAPH.items():
        edges[m].update(deps)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(edges[m]):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


# documented public names of the standard library that look private
STDLIB_PUBLIC = {"_exit"}  # os._exit: end a forked child without running the parent's cleanup


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in STDLIB_PUBLIC


def private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines itself (functions, classes, attributes it assigns)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_no_private_member_crosses_a_module() -> None:
    wrong = []
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        own = private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                wrong += [f"{m}: imports {a.name}" for a in node.names if private(a.name)]
            elif isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own:
                wrong.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "private members used outside their module:\n" + "\n".join(wrong)
