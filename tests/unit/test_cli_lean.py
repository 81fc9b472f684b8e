"""The command line imports only what a command needs: its start is most of what
``sandlot ls`` costs (``benchmarks/cli.py`` measures it). These check what is
imported, never how long it takes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot.cli import COMMANDS, MODULES, quick
from sandlot.cli.common import app

# What no box command needs: the other faces, their libraries, and the parts of
# the core that only some operations use.
HEAVY = (
    "httpx", "pydantic", "fastapi", "starlette", "uvicorn", "websockets", "mcp", "ray", "cryptography",
    "zstandard", "sandlot.server", "sandlot.mcp", "sandlot.fleet", "sandlot.tools",
    "sandlot.api.remote", "sandlot.api.code", "sandlot.core.livestate", "sandlot.core.archive",
    "sandlot.images.registry", "sandlot.cli.server", "sandlot.cli.mcp", "sandlot.cli.fleet",
    "sandlot.cli.access", "sandlot.cli.images", "sandlot.cli.livestate",
)  # fmt: skip
# what only making a box (or booting one) needs: a command on an existing box loads none of it
BOOT_ONLY = ("qemu", "sandlot.engine.qemu.assets", "sandlot.guest", "sandlot.images.store",
             "sandlot.images.oci")  # fmt: skip


# ``sandlot ARGV`` as ``python -m sandlot.cli`` runs it, writing the modules it
# imported at exit (after the command's own exit)
PROBE = """
import atexit, json, runpy, sys
out, sys.argv = sys.argv[1], ["sandlot", *sys.argv[2:]]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("sandlot.cli", run_name="__main__", alter_sys=True)
"""


def imported_by(tmp_path: Path, *argv: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules a run of ``sandlot ARGV`` imported."""
    env = {**os.environ, "SANDLOT_HOME": str(tmp_path / "home")}
    out = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", PROBE, str(out), *argv], capture_output=True, text=True,
                       env=env, timeout=60)  # fmt: skip
    return set(json.loads(out.read_text())), r


def heavy(names: set[str], also: tuple[str, ...] = BOOT_ONLY) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in (*HEAVY, *also)))


def test_ls_imports_no_other_face_and_no_heavy_library(tmp_path: Path) -> None:
    names, r = imported_by(tmp_path, "ls")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sandlot.cli.quick" in names and "sandlot.core.store" in names  # the probe sees imports
    assert heavy(names) == []
    assert "typer" not in names and "rich" not in names  # the plain form skips them (cli/quick.py)


def test_exec_imports_no_other_face_and_no_heavy_library(tmp_path: Path) -> None:
    names, r = imported_by(tmp_path, "exec", "no-such-box", "true")
    assert r.returncode == 125 and "no-such-box" in r.stderr, r.stderr[-2000:]
    assert heavy(names) == []
    assert "typer" not in names and "rich" not in names


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["ls", "--help"], ["snapshots", "--json"]])
def test_every_path_still_answers(tmp_path: Path, argv: list[str]) -> None:
    names, r = imported_by(tmp_path, *argv)
    assert r.returncode == 0, r.stderr[-2000:]
    if argv == ["--version"]:
        assert "typer" not in names and "sandlot.api.box" not in names
    if argv == ["--help"]:  # the full help lists every command, so it loads them all
        assert {f"sandlot.cli.{m}" for m in MODULES} <= names
        assert "serve" in r.stdout and "fleet" in r.stdout


def test_the_table_of_commands_is_what_the_modules_register() -> None:
    for module in MODULES:  # registered by importing them all (the slow path does the same)
        importlib.import_module(f"sandlot.cli.{module}")
    registered = {(c.name or c.callback.__name__).lower().replace("_", "-") for c in app.registered_commands
                  if c.callback is not None}  # fmt: skip
    registered |= {g.name for g in app.registered_groups if g.name}
    assert registered == set(COMMANDS)
    for command, module in COMMANDS.items():
        owner = [c.callback.__module__ for c in app.registered_commands
                 if c.callback and (c.name or c.callback.__name__).replace("_", "-") == command]  # fmt: skip
        owner += [c.callback.__module__ for g in app.registered_groups if g.name == command
                  for c in g.typer_instance.registered_commands if c.callback]  # fmt: skip
        assert owner and owner[0] == f"sandlot.cli.{module}", command


LS_FORMS = [[], ["-a"], ["--all"], ["-q"], ["--json"], ["-a", "-q", "--json"], ["-aq"], ["-f", "label=a=b"],
            ["--filter", "state=running"], ["--filter=label=x=y", "-f", "state=stopped", "-a"]]  # fmt: skip
EXEC_FORMS = [["box", "true"], ["-i", "box", "cat"], ["-it", "box", "sh"], ["-ti", "box", "sh"],
              ["-e", "A=1", "-e", "HOME", "box", "env"], ["--env=A=1", "box", "env"],
              ["-w", "/tmp", "-u", "root", "box", "pwd"], ["--workdir=/x", "--user", "1:1", "box", "ls"],
              ["--timeout", "2.5", "box", "sleep", "1"], ["box", "sh", "-c", "echo -x"],
              ["box", "--", "ls", "-l"], ["--interactive", "--tty", "box", "-", "x"]]  # fmt: skip
TO_TYPER = {"ls": [["--help"], ["-x"], ["-f"], ["-f", "bogus=1"], ["extra"], ["-ax"]],
            "exec": [[], ["box"], ["--help"], ["--bogus", "box", "true"], ["--timeout", "abc", "box", "true"],
                     ["--timeout", "nan", "box", "true"], ["--", "box", "true"], ["-e"],
                     ["-ix", "box", "true"]]}  # fmt: skip


def through_typer(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, object]:
    """What typer hands the shared code for ``sandlot ARGV``."""
    from typer.testing import CliRunner

    from sandlot.cli import boxes

    seen: dict[str, object] = {}

    def run_ls(all_: bool, filter_: list[str] | None, quiet: bool, as_json: bool) -> int:
        seen.update(all_=all_, filter_=filter_ or None, quiet=quiet, as_json=as_json)
        return 0

    async def exec_in(key: str, argv: list[str], **options: object) -> int:
        seen.update(key=key, argv=argv, **options)
        return 0

    monkeypatch.setattr(boxes, "run_ls", run_ls)
    monkeypatch.setattr(boxes, "exec_in", exec_in)
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    return seen


@pytest.mark.parametrize("args", LS_FORMS, ids=" ".join)
def test_the_fast_ls_parses_as_typer_does(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    mine = quick.parse_ls(args)
    assert mine is not None
    assert {**mine, "filter_": mine["filter_"] or None} == through_typer(monkeypatch, ["ls", *args])


@pytest.mark.parametrize("args", EXEC_FORMS, ids=" ".join)
def test_the_fast_exec_parses_as_typer_does(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    mine = quick.parse_exec(args)
    assert mine is not None
    mine["env"] = quick.env_pairs(mine["env"]) or None  # as both paths hand it on
    assert mine == through_typer(monkeypatch, ["exec", *args])


@pytest.mark.parametrize(("command", "args"), [(c, a) for c, forms in TO_TYPER.items() for a in forms])
def test_other_forms_go_to_typer(command: str, args: list[str]) -> None:
    assert quick.run([command, *args]) is None


def test_progress_shows_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from sandlot.cli import common

    recorded = Console(record=True, force_terminal=True, width=100)
    monkeypatch.setattr(common, "err", recorded)
    with common.busy("pulling x"):  # pytest's stdout is no terminal: a script's view
        pass
    assert recorded.export_text() == ""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert common.on_terminal() and not common.on_terminal(quiet=True)
    with common.busy("pulling x", quiet=True):
        pass
    assert recorded.export_text() == ""
    with common.busy("pulling x"):
        pass
    assert "pulling x" in recorded.export_text()


def test_ls_columns_are_never_cut() -> None:
    rows = [["NAME", "ID"], ["a-very-long-box-name-" * 5, "abc"], ["b", "d"]]
    lines = quick.columns(rows).splitlines()
    assert lines[0] == "NAME" + " " * (len(rows[1][0]) - 4) + "  ID"
    assert [line.split() for line in lines] == rows
