"""The public surface: the sync classes are generated from the async ones and
nothing drifts between them, and every error carries its structured fields."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import sandlot
from sandlot import errors

ROOT = Path(__file__).resolve().parents[2]
TWINS = [
    (sandlot.AsyncBox, sandlot.Box),
    (sandlot.AsyncSnapshot, sandlot.Snapshot),
    (sandlot.AsyncFiles, sandlot.Files),
    (sandlot.AsyncWatch, sandlot.Watch),
    (sandlot.AsyncProcess, sandlot.Process),
    (sandlot.AsyncStream, sandlot.Stream),
]
SYNC_NAMES = {"__aenter__": "__enter__", "__aexit__": "__exit__", "__aiter__": "__iter__", "aclose": "close"}


def test_the_generated_sync_api_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_sync.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def public(cls: type) -> dict[str, object]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_") or n in SYNC_NAMES}


@pytest.mark.parametrize(("async_cls", "sync_cls"), TWINS, ids=[s.__name__ for _, s in TWINS])
def test_sync_twins_have_the_same_methods_and_signatures(async_cls: type, sync_cls: type) -> None:
    for name, member in public(async_cls).items():
        twin = SYNC_NAMES.get(name, name)
        assert hasattr(sync_cls, twin), f"{sync_cls.__name__} has no {twin}"
        if callable(member) and not isinstance(member, property) and name != "__init__":
            fn = member.__func__ if isinstance(member, classmethod) else member  # type: ignore[attr-defined]
            mine = getattr(sync_cls, twin)
            a = inspect.signature(fn).parameters
            b = inspect.signature(mine).parameters
            assert list(a) == list(b), f"{sync_cls.__name__}.{twin}: {list(b)} != {list(a)}"
            for p in a:
                assert a[p].default == b[p].default and a[p].kind == b[p].kind, f"{twin}({p})"


def test_every_error_has_a_stable_code_and_an_http_status() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.SandlotError)]
    codes = {c.code for c in classes if "code" in vars(c)}
    assert len(codes) == len([c for c in classes if "code" in vars(c)])  # one code, one class
    for c in classes:
        assert 400 <= c.status < 600, c
    err = errors.InvalidState.refused("exec", "paused", ["running"], box="dev")
    assert err.to_dict() == {"code": "invalid_state", "message": str(err), "box": "dev", "state": "paused",
                             "allowed": ["running"]}  # fmt: skip
    crash = errors.BoxCrashed("box dev stopped unexpectedly", "kernel: oops", box="dev")
    assert crash.to_dict()["console_tail"] == "kernel: oops" and crash.state == "crashed"
    assert isinstance(crash, errors.InvalidState) and crash.code == "box_crashed"
    guest = errors.guest_os_error(2, "no such file")
    assert (
        isinstance(guest, FileNotFoundError) and guest.to_dict()["errno"] == "ENOENT" and guest.status == 404
    )
    assert issubclass(errors.BootTimeout, TimeoutError) and issubclass(errors.InvalidArgument, ValueError)


def test_the_boxs_options_are_spelled_once() -> None:
    """Each option declared in core/options.py is, by its declaration alone: a keyword of
    AsyncBox with its default and its help, a field of BoxSpec, a flag of ``sandlot run``
    and ``create``, and a field of the wire model, or refused over a remote transport."""
    import dataclasses

    from typer.main import get_command

    from sandlot.api.contract import BoxCreate, box_create
    from sandlot.cli import boxes  # registers run and create
    from sandlot.cli.common import app
    from sandlot.core.options import LOCAL, OPTIONS
    from sandlot.core.spec import BoxSpec

    params = inspect.signature(sandlot.AsyncBox.__init__).parameters
    assert list(params)[2:] == [o.name for o in OPTIONS]  # self, image, then the table's order
    doc = sandlot.AsyncBox.__init__.__doc__ or ""
    fields = {f.name for f in dataclasses.fields(BoxSpec)}
    assert boxes.run and boxes.create
    click = get_command(app)
    flags = {name: {opt for p in click.commands[name].params for opt in p.opts}  # type: ignore[attr-defined]
             for name in ("run", "create")}  # fmt: skip
    for o in OPTIONS:
        assert params[o.name].default == o.default, o.name
        assert f"``{o.name}``: {o.help.split()[0]}" in doc, o.name
        assert (o.name in fields) == (o.kind == "box"), o.name
        for names in flags.values():
            assert o.flag is None or o.flag.names[0].split("/")[0] in names, o.name
        if o.kind == "handle":
            continue
        assert (o.name in BoxCreate.model_fields) == (o.wire is not LOCAL), o.name
        if o.wire is LOCAL and o.default is None:
            with pytest.raises(errors.Unsupported, match=f"{o.name}= is not offered over the http"):
                box_create("alpine", {o.name: "something"}, "http")


def test_the_command_line_says_its_version() -> None:
    r = subprocess.run([sys.executable, "-m", "sandlot.cli", "--version"], capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip()) == (0, sandlot.__version__), r.stderr
    r = subprocess.run([sys.executable, "-m", "sandlot.cli"], capture_output=True, text=True)
    assert r.returncode in (0, 2) and "Usage" in r.stdout + r.stderr  # no command: the help


def test_a_timezone_is_the_commands_tz_and_a_bad_one_is_refused() -> None:
    """``timezone`` (added by its declaration alone, with its use in ``BoxSpec.default_env``):
    the commands' $TZ over the image's, under their own env; over the wire as a field."""
    from sandlot.api.contract import box_create
    from sandlot.core.spec import BoxSpec

    spec = BoxSpec.build("alpine", timezone="Europe/Paris", env={"A": "1"})
    spec.image_config = {"env": ["TZ=Asia/Tokyo", "PATH=/bin"]}
    assert spec.default_env() == {"TZ": "Europe/Paris", "PATH": "/bin", "A": "1"}
    assert BoxSpec.build("alpine", timezone="UTC-3", env={"TZ": "UTC"}).default_env()["TZ"] == "UTC"
    assert "TZ" not in BoxSpec.build("alpine").default_env()
    assert BoxSpec.from_options(spec.to_options()).timezone == "Europe/Paris"  # kept with the box
    assert box_create("alpine", {"timezone": "Etc/GMT+5"}, "http")["timezone"] == "Etc/GMT+5"
    for bad in ("/etc/passwd", "../../etc/shadow", "Europe/../../x", "a b", "", 5):
        with pytest.raises(errors.InvalidArgument, match="timezone must be"):
            BoxSpec.build("alpine", timezone=bad)
