"""What a wheel's user meets first: the host packages ``sandlot setup`` checks and
installs, and the agent and relay it finds prebuilt in a wheel (or builds)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot import hostsetup, native
from sandlot.guest.agent import build_agent

SANDLOT = Path(sys.executable).with_name("sandlot")


def _stub(bindir: Path, name: str, script: str = "exit 0") -> None:
    path = bindir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_setup_names_what_is_missing_and_the_command(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = {**os.environ, "PATH": str(bindir), "SANDLOT_HOME": str(tmp_path / "home")}
    env.pop("SANDLOT_QEMU", None)
    r = subprocess.run([str(SANDLOT), "setup", "--no-install"], capture_output=True, text=True, env=env)
    assert r.returncode == 1, r.stderr
    text = " ".join(r.stderr.split())
    assert "sandlot needs: qemu-system-x86 (running boxes); qemu-utils" in text
    assert "apt-get install -y --no-install-recommends qemu-system-x86 qemu-utils" in text
    assert "runsc" not in text  # optional: named only when asked for


def test_install_runs_apt_and_checks_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "apt.log"
    # a stand-in apt-get that "installs" a package by putting its commands on the PATH
    provides = {p.name: " ".join(p.commands) for p in hostsetup.PACKAGES}
    cases = "\n".join(f'  {name}) for c in {cmds}; do printf "#!/bin/sh\\n" > "{bindir}/$c"; '
                      f'/bin/chmod +x "{bindir}/$c"; done;;' for name, cmds in provides.items())  # fmt: skip
    _stub(bindir, "apt-get", f'echo "$@" >> {log}\nfor p in "$@"; do case "$p" in\n{cases}\nesac; done')
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setattr(hostsetup, "SBIN", ())
    monkeypatch.delenv("SANDLOT_QEMU", raising=False)
    monkeypatch.delenv("SANDLOT_RUNSC", raising=False)
    wanted = [p.name for p in hostsetup.missing()]
    assert wanted == [p.name for p in hostsetup.PACKAGES if p.required]
    if os.geteuid() != 0:
        pytest.skip("installing needs root or a passwordless sudo")
    assert hostsetup.can_install()
    hostsetup.install(wanted)
    assert hostsetup.missing() == []
    assert [p.name for p in hostsetup.missing(optional=True)] == [p.name for p in hostsetup.PACKAGES[5:]]
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1] == "install -y -qq --no-install-recommends " + " ".join(wanted)


def test_a_wheels_prebuilt_agent_is_used_and_a_stale_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "sandlot"
    (package / native.PREBUILT).mkdir(parents=True)
    monkeypatch.setattr(native, "PACKAGE", package)
    for program in native.PROGRAMS:  # the sources as a wheel has them
        (package / program.folder).mkdir(parents=True, exist_ok=True)
        for f in program.sources(Path(native.__file__).parent):
            (package / program.folder / f.name).write_bytes(f.read_bytes())
    cc = native.static_compiler()
    if cc is None:
        pytest.skip("no static C compiler")
    made = native.write_prebuilt(package / native.PREBUILT, package, cc)
    assert [p.name for p in made] == ["sandlot-agent", "sandlot-fdrelay"]
    agent = build_agent(tmp_path / "home")
    assert agent.path == package / native.PREBUILT / "sandlot-agent" and agent.compiler == "prebuilt"
    assert not (tmp_path / "home").exists()  # nothing was compiled
    monkeypatch.setenv(native.FROM_SOURCE, "1")  # the user asks for a build from source
    assert build_agent(tmp_path / "home").compiler != "prebuilt"
    monkeypatch.delenv(native.FROM_SOURCE)
    with open(package / native.AGENT.folder / "main.c", "a") as f:  # sources changed: stale binary
        f.write("\n/* changed */\n")
    assert build_agent(tmp_path / "home").compiler != "prebuilt"


def test_doctor_reports_the_host_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlot.core.runtime import Runtime

    rt = Runtime(tmp_path / "home")
    for name in ("qemu", "gvisor"):  # each engine's own report is tested beside it
        monkeypatch.setattr(rt.engine(name), "doctor", lambda: {})
    monkeypatch.setattr(rt, "auto_engine", lambda: None)
    qemu, runsc = hostsetup.PACKAGES[0], hostsetup.PACKAGES[5]
    monkeypatch.setattr(hostsetup, "missing", lambda optional=False: [qemu, runsc] if optional else [qemu])
    assert rt.doctor()["host_packages"] == {"missing": ["qemu-system-x86"], "optional_missing": ["runsc"]}


def _ksm_dir(tmp_path: Path, run: int, sharing: int = 0) -> Path:
    where = tmp_path / f"ksm-{run}"
    where.mkdir()
    (where / "run").write_text(f"{run}\n")
    (where / "pages_sharing").write_text(f"{sharing}\n")
    return where


def test_ksm_status_says_whether_boxes_memory_is_merged(tmp_path: Path) -> None:
    from sandlot import ksm

    absent = ksm.status(tmp_path / "none")
    assert not absent["available"] and "CONFIG_KSM" in absent["why"]
    off = ksm.status(_ksm_dir(tmp_path, 0))
    assert off["available"] and not off["on"] and "sandlot setup --ksm" in off["why"]
    on = ksm.status(_ksm_dir(tmp_path, 1, sharing=2560))
    assert on["on"] and on["saved_mib"] == 2560 * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    real = ksm.status()  # this host's own, whatever it is: never raises
    assert set(real) >= {"available", "on", "state"}


def test_ksm_is_turned_on_only_by_root_and_says_how_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandlot import ksm
    from sandlot.errors import HostSetupError

    where = _ksm_dir(tmp_path, 0)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))  # no sudo here
    with pytest.raises(HostSetupError, match=r"echo 1 \| sudo tee .*/ksm-0/run"):
        ksm.enable(where)
    assert (where / "run").read_text() == "0\n"  # nothing changed
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert ksm.enable(where)["on"] and (where / "run").read_text() == "1\n"
    with pytest.raises(HostSetupError, match="no KSM"):
        ksm.enable(tmp_path / "none")
