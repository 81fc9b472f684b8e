"""The command line imports only what a command needs: its start is most of what
``sandlot ls`` costs (``benchmarks/cli.py`` measures it). These check what is
imported, never how long it takes."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot import pids
from sandlot.cli import COMMANDS, MODULES, quick
from sandlot.cli.common import app
from sandlot.core.boxrecord import PID_ENGINES, SCHEMA_VERSION, BoxRecord, settled_boxes, store_path
from sandlot.core.store import MIGRATIONS
from sandlot.engine.base import Engine
from sandlot.engine.gvisor.engine import GvisorEngine
from sandlot.engine.qemu.engine import QemuEngine

from tests.support.fake_engine import pid_of_dead_process
from tests.support.rows import plant
from tests.support.waiting import wait_for

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


# what a listing of boxes that need no recovery does not import: the event loop's
# machinery, the box API, the store's class (api/listing.py)
LISTING_SKIPS = ("asyncio", "sandlot.api.box", "sandlot.api.local", "sandlot.core.store", "sandlot.protocol")


def test_ls_imports_no_other_face_and_no_heavy_library(tmp_path: Path) -> None:
    names, r = imported_by(tmp_path, "ls")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sandlot.cli.quick" in names and "sandlot.api.listing" in names  # the probe sees imports
    assert heavy(names, also=(*BOOT_ONLY, *LISTING_SKIPS)) == []
    assert "typer" not in names and "rich" not in names  # the plain form skips them (cli/quick.py)


@pytest.fixture
def live_vm() -> Iterator[Callable[[str], tuple[int, str]]]:
    """A process standing in for a box's VM: alive, its command line naming the box (what
    ``Engine.alive`` asks of a VM process)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(box_id: str) -> tuple[int, str]:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", box_id])
        procs.append(p)
        start = wait_for("the stand-in VM to start", lambda: pids.start_time(p.pid), timeout=10)
        return p.pid, start

    yield start
    for p in procs:
        p.kill()
        p.wait()


def put_box(home: Path, name: str, state: str, *, vm: tuple[int, str] | None = None, **extra: Any) -> None:
    now = time.time()
    pid, start = vm or (None, None)
    rec = BoxRecord(id=f"id-{name}", name=name, state=state, options=extra.pop("options", {}), created_at=now,
                    updated_at=now, vm_pid=pid, vm_start=start, **extra)  # fmt: skip
    plant(store_path(home), rec)  # in any state: as a listing may find it


def listed_by_cli(tmp_path: Path, *argv: str) -> tuple[list[dict[str, Any]], set[str]]:
    names, r = imported_by(tmp_path, "ls", "--json", *argv)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout), names


def test_ls_shows_settled_boxes_as_the_box_api_lists_them_without_it(
    tmp_path: Path, live_vm: Callable[[str], tuple[int, str]]
) -> None:
    home = tmp_path / "home"
    put_box(home, "kept", "stopped", labels={"team": "a"})
    put_box(home, "live", "running", vm=live_vm("id-live"), labels={"team": "b"})
    put_box(home, "pooled", "pooled", vm=live_vm("id-pooled"), options={"pool": "tmpl"})  # no box (yet)
    put_box(home, "asleep", "suspended", suspended="state-1")
    # each form of the command, the same listing asked of the box API, and what both show
    forms = [
        ((), {"all": False}, ["live"]),
        (("-a",), {"all": True}, ["kept", "live", "asleep"]),
        (("-f", "state=stopped"), {"all": True, "state": "stopped"}, ["kept"]),
        (("-a", "-f", "label=team=b"), {"all": True, "labels": {"team": "b"}}, ["live"]),
    ]
    for argv, asked, shown in forms:
        records, names = listed_by_cli(tmp_path, *argv)
        assert [r["name"] for r in records] == shown, argv
        assert heavy(names, also=LISTING_SKIPS) == [], argv
        through_api = asyncio.run(sandlot.AsyncBox.list(home=home, **asked))  # type: ignore[arg-type]
        assert [b.name for b in through_api] == shown, argv
    assert records[0]["state"] == "running" and records[0]["labels"] == {"team": "b"}


def test_ls_of_a_box_whose_vm_died_recovers_it_through_the_box_api(
    tmp_path: Path, live_vm: Callable[[str], tuple[int, str]]
) -> None:
    home = tmp_path / "home"
    put_box(home, "live", "running", vm=live_vm("id-live"))
    put_box(home, "dead", "running", vm=pid_of_dead_process())
    records, names = listed_by_cli(tmp_path, "-a")
    assert {r["name"]: r["state"] for r in records} == {"live": "running", "dead": "crashed"}
    assert "sandlot.api.box" in names  # the listing went through recovery
    records, names = listed_by_cli(tmp_path, "-a")  # recovered: settled again
    assert "sandlot.api.box" not in names and len(records) == 2


def test_ls_after_an_export_cut_short_opens_the_store_which_deletes_what_it_left(tmp_path: Path) -> None:
    home = tmp_path / "home"
    put_box(home, "kept", "stopped")
    parts, archive = tmp_path / ".out.sandlot.parts-1", tmp_path / ".out.sandlot.tmp-1"
    parts.mkdir()
    archive.write_bytes(b"half")
    dead_pid, dead_start = pid_of_dead_process()
    (home / "exports").mkdir()
    (home / "exports" / "x.json").write_text(
        json.dumps({"pid": dead_pid, "start": dead_start, "paths": [str(parts), str(archive)]})
    )
    records, names = listed_by_cli(tmp_path, "-a")
    assert [r["name"] for r in records] == ["kept"]
    assert "sandlot.api.box" in names  # through the store, whose opening sweeps
    assert not parts.exists() and not archive.exists()
    records, names = listed_by_cli(tmp_path, "-a")  # nothing left: the quick path again
    assert "sandlot.api.box" not in names


def test_a_store_of_another_schema_is_listed_by_the_store(tmp_path: Path) -> None:
    home = tmp_path / "home"
    put_box(home, "kept", "stopped")
    db = sqlite3.connect(store_path(home))
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION - 1}")  # as an older sandlot left it
    db.close()
    assert settled_boxes(home) is None


def test_the_quick_listing_asks_what_the_store_and_the_engines_do() -> None:
    assert len(MIGRATIONS) == SCHEMA_VERSION
    for engine in (QemuEngine, GvisorEngine):  # PID_ENGINES: their VMs' liveness is a process's
        assert engine.alive is Engine.alive
    assert {e.name for e in (QemuEngine, GvisorEngine)} == PID_ENGINES


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
