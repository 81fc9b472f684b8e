"""The gVisor engine's host-side facts, without a sandbox: the platform a runsc
release gets, doctor's report, layer directories, and refusals of saved states
from the other engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandlot.core import layers
from sandlot.core.store import BoxStore
from sandlot.engine import engine_for, names
from sandlot.engine.base import Boot
from sandlot.engine.gvisor import runsc
from sandlot.engine.gvisor.vm import lower_dirs
from sandlot.errors import IncompatibleSnapshot


def test_platform_by_release() -> None:
    assert runsc.platform_for("0.0~20221219.0") == "ptrace"  # Debian bookworm's package
    assert runsc.platform_for("release-20240212.0") == "systrap"
    assert runsc.platform_for("unknown") == "ptrace"


def test_registered_and_doctor(tmp_path: Path) -> None:
    assert "gvisor" in names()
    report = engine_for("gvisor", tmp_path).doctor()
    assert report["engine"] == "gvisor"
    assert report["runsc"]["version"].startswith("0.0~2022") or report["runsc"]["version"]
    assert report["runsc"]["platform"] in ("ptrace", "systrap")
    assert isinstance(report["usable"], bool) and report["why"]


def test_saved_state_of_the_other_engine_is_refused(tmp_path: Path) -> None:
    engine = engine_for("gvisor", tmp_path)
    boot = Boot("gvisor", "ptrace", "", {"runsc_version": "0.0~20221219.0"}, ())
    with pytest.raises(IncompatibleSnapshot, match="'qemu' engine"):
        engine.check_compatible({"engine": "qemu", "engine_facts": {}}, boot)
    with pytest.raises(IncompatibleSnapshot, match="saved by runsc 1"):
        engine.check_compatible({"engine": "gvisor", "engine_facts": {"runsc_version": "1"}}, boot)
    saved = {"engine": "gvisor", "engine_facts": {"runsc_version": "0.0~20221219.0", "platform": "ptrace"}}
    ptrace = Boot("gvisor", "ptrace", "", {"runsc_version": "0.0~20221219.0", "platform": "ptrace"}, ())
    systrap = Boot("gvisor", "systrap", "", {"runsc_version": "0.0~20221219.0", "platform": "systrap"}, ())
    with pytest.raises(IncompatibleSnapshot, match="ptrace platform; this host runs systrap"):
        engine.check_compatible(saved, systrap)
    # the restored init maps its executable again: only the very agent build it ran will do
    with pytest.raises(IncompatibleSnapshot, match="agent build"):
        engine.check_compatible(saved, ptrace)

    def built(name: str) -> dict[str, object]:
        return {**saved, "engine_facts": {**saved["engine_facts"], "agent_build": name}}

    with pytest.raises(IncompatibleSnapshot, match="agent build"):
        engine.check_compatible(built("../x"), ptrace)
    build = tmp_path / "agent" / "guest-0123"
    build.mkdir(parents=True)
    (build / "sandlot-agent").write_bytes(b"")
    engine.check_compatible(built(build.name), ptrace)
    qemu = engine_for("qemu", tmp_path)
    qboot = Boot("qemu", "tcg", "", {}, ())
    with pytest.raises(IncompatibleSnapshot, match="'gvisor' engine"):
        qemu.check_compatible({"engine": "gvisor", "engine_facts": {}}, qboot)


def test_layer_directories(tmp_path: Path) -> None:
    base = tmp_path / "root"
    base.mkdir()
    path = layers.new_path(tmp_path, layers.DIR_SUFFIX)
    layers.make_dir_layer(path, base)
    assert (path / "upper").is_dir() and (path / "work").is_dir()
    assert (path / "base").read_text() == str(base)
    assert layers.chain(path) == [path]  # the image's root is the image store's to keep
    # a snapshot freezes the layer: the box goes on over a new one, whose overlay has the
    # frozen layer's upper as its top lower layer
    top = layers.new_layer(tmp_path, path)
    assert top.suffix == layers.DIR_SUFFIX and layers.dir_parent(top) == path
    assert layers.dir_base(top) == base and layers.chain(top) == [top, path]
    assert lower_dirs(top, base) == [path / "upper", base]
    store = BoxStore(tmp_path / "sandlot.db")
    layers.gc(tmp_path, store, also=[top])
    assert not top.exists() and path.exists()
    layers.gc(tmp_path, store, also=[path])
    assert not path.exists() and base.is_dir()


def test_non_root_is_refused_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlot.engine.base import BootRequest
    from sandlot.errors import HostSetupError

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(HostSetupError, match=r"needs root.*--rootless"):
        engine_for("gvisor", tmp_path).prepare(BootRequest())
    report = engine_for("gvisor", tmp_path).doctor()
    assert not report["usable"] and "not root" in report["why"]
