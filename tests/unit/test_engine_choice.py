"""Which engine a box gets: its own ``engine=``, else ``$SANDLOT_ENGINE``, else qemu;
``auto`` resolved by the host's probes (KVM, then gVisor, then TCG) and recorded as the
engine the box got. The probes themselves run for real in ``tests/vm/test_gvisor_limits.py``
(gVisor) and ``tests/vm/test_engine.py`` (the accelerator)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import sandlot
from sandlot.core.runtime import Runtime
from sandlot.engine import auto
from sandlot.engine.auto import EngineChoice
from sandlot.engine.gvisor import drives as gvisor_drives

from tests.support.fake_engine import fake_rootfs, register

register()


def test_requested_engine_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auto.ENV, raising=False)
    assert auto.requested(None) == "qemu"  # the default stays qemu: auto is opt-in
    monkeypatch.setenv(auto.ENV, "gvisor")
    assert auto.requested(None) == "gvisor"
    assert auto.requested("qemu") == "qemu"  # the box's own option wins
    monkeypatch.setenv(auto.ENV, "auto")
    assert auto.requested(None) == "auto"
    monkeypatch.setenv(auto.ENV, "xen")
    with pytest.raises(sandlot.InvalidArgument, match=r"not 'xen' \(from \$SANDLOT_ENGINE\)"):
        auto.requested(None)


def test_an_unknown_engine_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(sandlot.InvalidArgument, match=r"one of qemu, gvisor.*auto, not 'firec"):
        sandlot.Box(rootfs=fake_rootfs(tmp_path), engine="firecracker", home=tmp_path / "home")
    with pytest.raises(sandlot.InvalidArgument, match="engine must be a string"):
        sandlot.Box(rootfs=fake_rootfs(tmp_path), engine=3, home=tmp_path / "home")  # type: ignore[arg-type]


def yes(why: str) -> auto.Probe:
    return lambda home: (True, why)


def no(why: str) -> auto.Probe:
    return lambda home: (False, why)


def test_auto_prefers_kvm_then_gvisor_then_tcg(tmp_path: Path) -> None:
    kvm = auto.choose(tmp_path, kvm=yes("probe boot answered"), gvisor=yes("ran"))
    assert kvm.name == "qemu" and "KVM" in kvm.reason and "probe boot answered" in kvm.reason
    gv = auto.choose(tmp_path, kvm=no("nested PVM"), gvisor=yes("ran"))
    assert gv.name == "gvisor" and "not hardware isolation" in gv.reason and "nested PVM" in gv.reason
    tcg = auto.choose(tmp_path, kvm=no("no /dev/kvm"), gvisor=no("not root"))
    assert tcg.name == "qemu" and "TCG" in tcg.reason
    assert "no /dev/kvm" in tcg.reason and "not root" in tcg.reason


def test_auto_is_resolved_and_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store records the engine the box got, never "auto"; inspect() shows it."""
    home = tmp_path / "home"
    rt = Runtime.for_home(home)
    monkeypatch.setattr(rt, "auto_engine", lambda: EngineChoice("fake", "the test's choice"))

    async def main() -> None:
        box = sandlot.AsyncBox(rootfs=fake_rootfs(tmp_path), engine="auto", home=home, template=False,
                               memory_mib=256, keep=True)  # fmt: skip
        await box.start()
        info = await box.inspect()
        assert info["engine"] == "fake" and info["options"]["engine"] == "fake"
        assert rt.store.get(box.id).engine == "fake"
        await box.stop()
        await box.start()  # started again: the same engine, no new choice
        assert (await box.inspect())["engine"] == "fake"
        await box.remove(force=True)

    asyncio.run(main())


def test_auto_gives_qemu_to_a_box_its_choice_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where auto picks gVisor, a box asking for what gVisor cannot run here (disk
    volumes on a host without their user-space ext4, a kernel of its own) gets QEMU
    instead of an error; any other box gets gVisor, host directories, shared volumes
    and (where the host has the tools) disk volumes included."""
    home = tmp_path / "home"
    rt = Runtime.for_home(home)
    monkeypatch.setattr(rt, "auto_engine", lambda: EngineChoice("gvisor", "the test's choice"))
    shared = tmp_path / "shared"
    shared.mkdir()
    rootfs = fake_rootfs(tmp_path)
    sandlot.Volumes(home).create("data", size_gb=0.1)
    sandlot.Volumes(home).create("more", size_gb=0.1)
    monkeypatch.setattr(gvisor_drives, "missing_tools", lambda: [])
    served = sandlot.create(rootfs=rootfs, engine="auto", home=home, volumes=["more:/more"])
    monkeypatch.setattr(gvisor_drives, "missing_tools", lambda: ["fuse2fs"])
    with_volume = sandlot.create(rootfs=rootfs, engine="auto", home=home, volumes=["data:/data"])
    with_share = sandlot.create(rootfs=rootfs, engine="auto", home=home, volumes=[(shared, "/mnt")])
    plain = sandlot.create(rootfs=rootfs, engine="auto", home=home)
    try:
        assert served.inspect()["engine"] == "gvisor"
        assert with_volume.inspect()["engine"] == "qemu"
        assert with_share.inspect()["engine"] == "gvisor" and plain.inspect()["engine"] == "gvisor"
    finally:
        for box in (served, with_volume, with_share, plain):
            box.remove(force=True)
    with pytest.raises(sandlot.InvalidArgument, match=r"named volumes.*fuse2fs"):  # asked for by name
        sandlot.create(rootfs=rootfs, engine="gvisor", home=home, volumes=["data:/data"])


def test_sandlot_engine_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auto.ENV, "fake")
    home = tmp_path / "home"

    async def main() -> None:
        box = sandlot.AsyncBox(rootfs=fake_rootfs(tmp_path), home=home, template=False, memory_mib=256)
        async with box:
            assert (await box.inspect())["engine"] == "fake"

    asyncio.run(main())


def test_doctor_says_what_auto_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = Runtime(tmp_path / "home")
    monkeypatch.setattr(rt, "auto_engine", lambda: EngineChoice("gvisor", "because"))
    for name in ("qemu", "gvisor", "fake"):  # each engine's own report is tested beside it
        monkeypatch.setattr(rt.engine(name), "doctor", lambda: {})
    report = rt.doctor()
    assert report["auto"] == {"engine": "gvisor", "why": "because"}
    assert report["default_engine"] in ("qemu", "gvisor", "auto")
