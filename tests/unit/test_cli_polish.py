"""What a newcomer meets first on the command line: usage lines that name their
arguments, ``-h``, help without type tags, the commands in groups, ``--engine``,
``--quiet``, shell completion, and docs/cli.md's examples. No VM: commands that
would make one get a stand-in for the API."""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer.main
from typer._click import Command, Context
from typer._click.exceptions import UsageError
from typer.core import TyperArgument, TyperGroup, TyperOption
from typer.testing import CliRunner, Result

from sandlot.cli import COMMANDS, GROUPS, MODULES, boxes, images, livestate
from sandlot.cli.common import app
from sandlot.errors import SandlotError

from tests.support.docs import REPO, blocks, command_lines
from tests.support.docs import parse_cli as parse

for _module in MODULES:  # every command registered, as `sandlot --help` has them
    importlib.import_module(f"sandlot.cli.{_module}")

DOCS = REPO / "docs" / "cli.md"


def commands() -> Iterator[tuple[list[str], Command, Context]]:
    """Every command and group under ``sandlot``, with its path and a context."""

    def walk(
        path: list[str], command: Command, parent: Context | None
    ) -> Iterator[tuple[list[str], Command, Context]]:
        ctx = Context(command, info_name=path[-1] if path else "sandlot", parent=parent)
        yield path, command, ctx
        if isinstance(command, TyperGroup):
            for name in command.list_commands(ctx):
                yield from walk([*path, name], command.commands[name], ctx)

    yield from walk([], ROOT, None)


ROOT = typer.main.get_command(app)
PATHS = [path for path, _, _ in commands()]


def sandlot(*args: str, **env: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **env})


def flat(text: str) -> str:
    """Help or error text without rich's boxes and line breaks."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


# -- 1. usage lines ---------------------------------------------------------------------------


def test_run_and_exec_show_their_arguments_in_usage() -> None:
    for argv, usage in ((["run", "--help"], "Usage: sandlot run [OPTIONS] IMAGE [CMD]..."),
                        (["exec", "--help"], "Usage: sandlot exec [OPTIONS] BOX CMD [ARGS]...")):  # fmt: skip
        # as a shell runs it: the lazy loader, then typer
        r = subprocess.run([sys.executable, "-m", "sandlot.cli", *argv], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert usage in r.stdout


def test_every_usage_line_names_its_arguments() -> None:
    for path, command, ctx in commands():
        usage = command.get_usage(ctx)
        assert usage.startswith(f"Usage: {' '.join(['sandlot', *path])} [OPTIONS]"), usage
        assert "{" not in usage, usage  # typer's own spelling, {box}
        for param in command.params:
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                assert name in usage, (path, usage)
    usages = {" ".join(path): command.get_usage(ctx) for path, command, ctx in commands()}
    assert usages["cp"].endswith("cp [OPTIONS] SRC DST")
    assert usages["port"].endswith("port [OPTIONS] BOX [GUEST]")
    assert usages["stop"].endswith("stop [OPTIONS] BOX...")
    assert usages["images"].endswith("images [OPTIONS] [prune]")


@pytest.mark.parametrize(
    ("args", "words"),
    [(["exec", "box", "sh", "-c", "echo -x"], ("box", ["sh", "-c", "echo -x"])),
     (["exec", "box", "--", "ls", "-l"], ("box", ["ls", "-l"])),
     (["exec", "-e", "A=1", "--", "box", "env"], ("box", ["env"])),
     (["exec", "box", "ls", "-h"], ("box", ["ls", "-h"]))],  # -h after BOX is the command's
)  # fmt: skip
def test_exec_hands_on_the_command_after_box(monkeypatch: pytest.MonkeyPatch, args: list[str],
                                             words: tuple[str, list[str]]) -> None:  # fmt: skip
    seen: list[tuple[str, list[str]]] = []

    async def exec_in(key: str, argv: list[str], **options: object) -> int:
        seen.append((key, argv))
        return 3

    monkeypatch.setattr(boxes, "exec_in", exec_in)
    r = sandlot(*args)
    assert r.exit_code == 3, r.output
    assert seen == [words]


def test_exec_without_a_command_is_a_usage_error() -> None:
    for args in (["exec", "box"], ["exec", "box", "--"], ["exec"]):
        r = sandlot(*args)
        assert r.exit_code == 2, r.output


# -- 2. -h ------------------------------------------------------------------------------------


def test_no_command_takes_h_for_anything_else() -> None:
    for path, command, ctx in commands():
        help_option = command.get_help_option(ctx)
        for param in command.params:
            if param is not help_option:
                assert "-h" not in [*param.opts, *param.secondary_opts], path


def test_h_reaches_typer_past_the_fast_ls_and_exec() -> None:
    for argv in (["ls", "-h"], ["exec", "-h"]):
        r = subprocess.run([sys.executable, "-m", "sandlot.cli", *argv], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 0 and f"Usage: sandlot {argv[0]}" in r.stdout, r.stderr


# -- 3. no type tags (with -h above) -----------------------------------------------------------

TYPE_TAG = re.compile(r"<(list\[\w+\]|[a-z]+)>")  # <bool>, <str>, <list[str]>, <path>


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "sandlot")
def test_h_is_help_everywhere_and_help_has_no_type_tags(path: list[str]) -> None:
    short, long = sandlot(*path, "-h"), sandlot(*path, "--help")
    assert short.exit_code == 0, short.output
    assert f"Usage: {' '.join(['sandlot', *path])} " in short.output
    assert short.output == long.output
    assert TYPE_TAG.search(short.output) is None, short.output
    assert re.search(r"--help +-h +Show this message", short.output)


def test_options_keep_their_names_defaults_and_metavars() -> None:
    out = flat(sandlot("run", "--help").output)
    assert "--memory -m Guest memory in MiB. [default: 512]" in out
    assert "--rm Remove the box" in out  # a flag, nothing between its name and its help
    assert "BOX [NAME] | ACTION ARGS..." in flat(sandlot("snapshot", "--help").output)


# -- 4. the groups of the root help -----------------------------------------------------------


def panels(text: str) -> dict[str, list[str]]:
    """The commands of each panel of a help screen, in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        title = re.match(r"╭─ (.+?) ─", line)
        if title:
            current = out.setdefault(title.group(1), [])
        elif current is not None and re.match(r"│ \S", line):
            current.append(line[2:].split()[0])
    return out


def test_root_help_groups_the_commands_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {"Options": ["--version", "--help"], **{g: list(c) for g, c in GROUPS.items()}}
    assert list(GROUPS) == ["Boxes", "Live state", "Images", "Server", "Fleet", "Host"]
    assert panels(sandlot("--help").output) == expected
    # registered in another order (another import order of the modules): the same screen
    monkeypatch.setattr(app, "registered_commands", app.registered_commands[::-1])
    monkeypatch.setattr(app, "registered_groups", app.registered_groups[::-1])
    assert panels(sandlot("--help").output) == expected


def test_the_groups_hold_what_the_brief_asks() -> None:
    assert list(GROUPS["Boxes"])[:2] == ["run", "create"] and "audit" in GROUPS["Server"]
    assert {"pool", "template", "snapshot"} <= set(GROUPS["Live state"])
    assert {"serve", "keys", "previews", "audit", "mcp"} == set(GROUPS["Server"])
    assert list(GROUPS["Host"]) == ["doctor", "setup", "rootfs", "completion"]
    assert next(iter(COMMANDS)) == "run"


# -- 5. --engine ------------------------------------------------------------------------------


class FakeBox:
    """``AsyncBox`` as far as ``run`` and ``create`` go before a VM would boot (or, with
    ``boots``, as if one had)."""

    made: list[dict[str, Any]] = []
    boots = False
    name = "fake"

    def __init__(self, **options: Any) -> None:
        FakeBox.made.append(options)

    @classmethod
    async def create(cls, **options: Any) -> FakeBox:
        return cls(**options)

    async def start(self) -> None:
        if not self.boots:
            raise SandlotError("no VM in unit tests")

    def default_command(self, args: list[str] | None = None) -> list[str]:
        return list(args or ["entrypoint"])

    async def stop(self) -> None:
        pass


@pytest.fixture
def fake_box(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    FakeBox.made = []
    monkeypatch.setattr(FakeBox, "boots", False)
    monkeypatch.setattr(boxes, "AsyncBox", FakeBox)
    return FakeBox.made


@pytest.mark.parametrize(
    ("args", "image", "rootfs", "argv"),
    [(["alpine"], "alpine", None, ["entrypoint"]),
     (["alpine", "sh", "-c", "echo -x"], "alpine", None, ["sh", "-c", "echo -x"]),
     (["alpine", "--", "ls", "-l"], "alpine", None, ["ls", "-l"]),
     (["--", "alpine", "ls"], "alpine", None, ["ls"]),
     (["alpine", "ls", "-h"], "alpine", None, ["ls", "-h"]),  # -h after IMAGE is the command's
     (["--rootfs", "/r", "--", "sh", "-c", "x"], None, Path("/r"), ["sh", "-c", "x"]),
     (["--rootfs", "/r", "true"], None, Path("/r"), ["true"])],
)  # fmt: skip
def test_run_takes_image_and_command(monkeypatch: pytest.MonkeyPatch, fake_box: list[dict[str, Any]],
                                     args: list[str], image: str | None, rootfs: Path | None,
                                     argv: list[str]) -> None:  # fmt: skip
    ran: list[list[str]] = []

    async def exec_attached(box: FakeBox, argv: list[str], **options: object) -> int:
        ran.append(argv)
        return 4

    monkeypatch.setattr(FakeBox, "boots", True)
    monkeypatch.setattr(boxes, "exec_attached", exec_attached)
    r = sandlot("run", *args)
    assert r.exit_code == 4, r.output
    assert [(m["image"], m["rootfs"]) for m in fake_box] == [(image, rootfs)] and ran == [argv]


def test_run_without_image_or_command_is_a_usage_error(fake_box: list[dict[str, Any]]) -> None:
    assert sandlot("run").exit_code == 2
    assert sandlot("run", "--rootfs", "/r").exit_code == 2
    assert fake_box == []


def test_engine_goes_to_the_box(fake_box: list[dict[str, Any]]) -> None:
    assert sandlot("create", "--engine", "gvisor", "alpine").exit_code == 0
    r = sandlot("run", "--engine", "auto", "alpine", "true")
    assert r.exit_code == 125 and "no VM in unit tests" in r.output
    assert sandlot("create", "alpine").exit_code == 0
    assert [m["engine"] for m in fake_box] == ["gvisor", "auto", None]  # None: $SANDLOT_ENGINE, else qemu


@pytest.mark.parametrize("command", ["run", "create"])
def test_repeated_flags_reach_the_box_as_their_options_values(monkeypatch: pytest.MonkeyPatch,
                                                              fake_box: list[dict[str, Any]],
                                                              command: str) -> None:  # fmt: skip
    monkeypatch.setenv("PASSED", "from-here")
    monkeypatch.setenv("TOKEN", "s3cret-token")
    r = sandlot(command, "-e", "FOO=bar", "-e", "PASSED", "-l", "team=cli", "-l", "tier=2",
                "-v", "/tmp:/mnt/s:ro", "-p", "8080:80", "--allow", "pypi.org", "--secret",
                "TOKEN@api.example.com", "alpine", *(["true"] if command == "run" else []))  # fmt: skip
    assert r.exit_code in (0, 125), r.output  # run: the fake box does not boot
    (made,) = fake_box
    # a mapping flag is the mapping, not its keys (typer converts a callback's answer
    # to the flag's list type)
    assert made["env"] == {"FOO": "bar", "PASSED": "from-here"}
    assert made["labels"] == {"team": "cli", "tier": "2"}
    assert made["volumes"] == ["/tmp:/mnt/s:ro"] and made["ports"] == ["8080:80"]
    assert made["allow"] == ["pypi.org"]
    assert [(s.name, s.value, list(s.hosts)) for s in made["secrets"]] == [
        ("TOKEN", "s3cret-token", ["api.example.com"])
    ]


def test_a_bad_repeated_flag_is_a_usage_error(fake_box: list[dict[str, Any]]) -> None:
    r = sandlot("create", "-l", "nolabel", "alpine")
    assert r.exit_code == 2 and "--label needs KEY=VALUE" in flat(r.output)
    assert fake_box == []


@pytest.mark.parametrize("command", ["run", "create"])
def test_an_unknown_engine_is_a_usage_error(fake_box: list[dict[str, Any]], command: str) -> None:
    r = sandlot(command, "--engine", "firecracker", "alpine")
    assert r.exit_code == 2
    # (the fake engine of other unit tests may be registered too: it is then a choice as well)
    assert re.search(r"engine must be one of qemu, gvisor, (fake, )?auto, not 'firecracker'", flat(r.output))
    assert fake_box == []  # refused before anything was made


# -- 6. --quiet -------------------------------------------------------------------------------


@pytest.fixture
def spinners(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``quiet`` each progress display was asked with."""
    seen: list[bool] = []

    @contextlib.contextmanager
    def busy(message: str, *, quiet: bool = False) -> Iterator[None]:
        seen.append(quiet)
        yield

    for module in (boxes, livestate, images):
        monkeypatch.setattr(module, "busy", busy)
    return seen


def stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The API calls of template, snapshot export and import, load and import."""
    exported = tmp_path / "snap.sandlot"
    exported.write_bytes(b"x")

    async def template_async(image: str, **options: Any) -> Any:
        return SimpleNamespace(id="t1", name=options["name"])

    async def export(path: str) -> Path:
        return exported

    class Snapshot:
        @staticmethod
        async def get(key: str) -> Any:
            return SimpleNamespace(export=export)

    async def import_snapshot_async(path: str, name: str | None = None) -> Any:
        return SimpleNamespace(name=name or "imported")

    image = SimpleNamespace(name="img:1", names=("img:1",), digest="sha256:0")
    monkeypatch.setattr(livestate, "template_async", template_async)
    monkeypatch.setattr(livestate, "AsyncSnapshot", Snapshot)
    monkeypatch.setattr(livestate, "import_snapshot_async", import_snapshot_async)
    monkeypatch.setattr("sandlot.api.images.load_image", lambda path, name: [image])
    monkeypatch.setattr("sandlot.api.images.import_image", lambda directory, name, cmd: image)


QUIET_FORMS = [["run", "alpine", "true"], ["create", "alpine"], ["template", "alpine", "--name", "t"],
               ["snapshot", "export", "s1", "out.sandlot"], ["snapshot", "import", "in.sandlot"],
               ["load", "app.tar"], ["import", ".", "img:1"]]  # fmt: skip


@pytest.mark.parametrize("args", QUIET_FORMS, ids=" ".join)
def test_quiet_hides_the_progress_of_every_command_that_draws_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_box: list[dict[str, Any]], spinners: list[bool],
    args: list[str],
) -> None:  # fmt: skip
    stand_ins(monkeypatch, tmp_path)
    for flag, quiet in (([], False), (["-q"], True), (["--quiet"], True)):
        where = 1 if args[0] != "snapshot" else len(args)  # after the command, before IMAGE (run's)
        sandlot(*args[:where], *flag, *args[where:])
        assert spinners[-1] is quiet, (args, flag)
    assert len(spinners) == 3


def test_pull_draws_its_progress_unless_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    pulled: list[object] = []

    def pull(ref: str, *, insecure: bool, ca_cert: Path | None, progress: object = None) -> Any:
        pulled.append(progress)
        return SimpleNamespace(name=ref, digest="sha256:0")

    monkeypatch.setattr("sandlot.api.sync.pull", pull)
    monkeypatch.setattr(images, "on_terminal", lambda quiet=False: not quiet)  # as on a terminal
    assert sandlot("pull", "alpine").exit_code == 0
    assert sandlot("pull", "-q", "alpine").exit_code == 0
    assert callable(pulled[0]) and pulled[1] is None


def test_every_command_with_a_progress_display_takes_quiet() -> None:
    quiet = {" ".join(path) for path, command, _ in commands()
             if any("--quiet" in p.opts and "-q" in p.opts for p in command.params)}  # fmt: skip
    assert {"run", "create", "template", "snapshot", "pull", "load", "import"} <= quiet


# -- 7. completion ----------------------------------------------------------------------------


def cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``sandlot ARGV`` as a shell runs it (the lazy loader included)."""
    return subprocess.run([sys.executable, "-m", "sandlot.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)  # fmt: skip


SCRIPTS = [("bash", "complete -o default -F _sandlot_completion sandlot"), ("zsh", "#compdef sandlot"),
           ("fish", "complete --command sandlot")]  # fmt: skip


@pytest.mark.parametrize(("shell", "mark"), SCRIPTS)
def test_completion_prints_each_shells_script(shell: str, mark: str) -> None:
    r = sandlot("completion", shell)
    assert r.exit_code == 0 and mark in r.output and f"_SANDLOT_COMPLETE=complete_{shell}" in r.output
    assert sandlot("completion", SHELL=f"/usr/bin/{shell}").output == r.output  # that of $SHELL


def test_completion_names_the_shells_it_knows() -> None:
    for args, env in ((["completion", "tcsh"], {}), (["completion"], {"SHELL": "/bin/tcsh"})):
        r = sandlot(*args, **env)
        assert r.exit_code == 2 and "bash|zsh|fish" in r.output


def test_completion_says_how_to_install_it() -> None:
    out = sandlot("completion", "--help").output
    assert "sandlot completion bash > ~/.local/share/bash-completion/completions/sandlot" in out


@functools.cache
def bash_instruction() -> str:
    """What the script of ``sandlot completion bash`` sets ``$_SANDLOT_COMPLETE`` to."""
    script = cli("completion", "bash").stdout
    instruction = re.search(r"_SANDLOT_COMPLETE=(\S+)", script)
    assert instruction is not None, script
    return instruction.group(1)


def bash_completes(words: str, *argv: str) -> list[str]:
    """What that script gets back for ``words`` typed so far."""
    r = cli(*argv, _SANDLOT_COMPLETE=bash_instruction(), COMP_WORDS=words,
            COMP_CWORD=str(len(words.split(" ")) - 1))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_bash_completes_commands_subcommands_options_and_engines() -> None:
    assert bash_completes("sandlot ru") == ["run"]
    assert bash_completes("sandlot snap") == ["snapshot", "snapshots"]
    assert bash_completes("sandlot keys ") == ["create", "ls", "revoke"]
    assert "--engine" in bash_completes("sandlot run --e")
    assert bash_completes("sandlot run --engine ") == ["qemu", "gvisor", "auto"]
    # a completion request loads every command, whatever words came with it (never `ls`'s fast path)
    assert bash_completes("sandlot fleet mi", "ls") == ["migrate"]


def test_zsh_and_fish_complete_too() -> None:
    zsh = cli(_SANDLOT_COMPLETE="complete_zsh", _TYPER_COMPLETE_ARGS="sandlot fle")
    assert zsh.returncode == 0 and '"fleet"' in zsh.stdout, zsh.stderr
    fish = cli(_SANDLOT_COMPLETE="complete_fish", _TYPER_COMPLETE_FISH_ACTION="get-args",
               _TYPER_COMPLETE_ARGS="sandlot pool ")  # fmt: skip
    assert fish.returncode == 0 and [line.split("\t")[0] for line in fish.stdout.split("\n") if line] == [
        "set", "ls"], fish.stdout  # fmt: skip


# -- 8. docs/cli.md ---------------------------------------------------------------------------


def examples() -> list[list[str]]:
    """The arguments of each ``sandlot ...`` command of docs/cli.md's blocks, as the
    docs tests read them (run or not), up to a redirection."""
    found = [args for block in blocks(DOCS) for cmd, _ in block.commands() for args in command_lines(cmd)]
    return [list(itertools.takewhile(lambda word: word not in (">", ">>", "<"), args)) for args in found]


def test_the_docs_examples_are_commands_sandlot_takes() -> None:
    found = examples()
    assert {args[0] for args in found} == set(COMMANDS)
    for args in found:
        if "bogus" in args:  # the page's example of a usage error
            with pytest.raises(UsageError, match="engine must be one of"):
                parse(args)
        else:
            parse(args)


def test_the_docs_name_every_command_and_the_essentials() -> None:
    text = DOCS.read_text()
    for group in GROUPS:
        assert f"## {group}" in text
    for command in COMMANDS:
        assert f"sandlot {command}" in text, command
    for must in ("125", "127", "--quiet", "--engine qemu|gvisor|auto", "./scripts/setup",
                 ". .venv/bin/activate",
                 "sandlot completion bash > ~/.local/share/bash-completion/completions/sandlot"):  # fmt: skip
        assert must in text, must


def test_options_in_the_docs_exist() -> None:
    """Every ``--option`` docs/cli.md names is an option of some command."""
    known = {opt for _, command, ctx in commands() for p in command.get_params(ctx)
             if isinstance(p, TyperOption) for opt in [*p.opts, *p.secondary_opts]}  # fmt: skip
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", DOCS.read_text()))
    assert named - known <= {"--no-demo"}  # that one is ./scripts/setup's
