"""The guest kernel's command line (sandlot's own words, then SANDLOT_KERNEL_ARGS's), and
QEMU's accelerator options."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sandlot.engine.qemu.command import KERNEL_ARGS, VMConfig, build_command, kernel_args_from_env
from sandlot.errors import HostSetupError


def appended(cfg: VMConfig) -> str:
    cmd = build_command(cfg, "qemu-system-x86_64")
    return cmd[cmd.index("-append") + 1]


def config(tmp_path: Path, extra: list[str]) -> VMConfig:
    return VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=tmp_path,
                    state_dir=tmp_path, extra_kernel_args=extra)  # fmt: skip


def test_words_from_the_environment_come_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_KERNEL_ARGS", "  loglevel=7   initcall_debug ")
    words = kernel_args_from_env()
    assert words == ["loglevel=7", "initcall_debug"]
    line = appended(config(tmp_path, words))
    assert line.startswith(KERNEL_ARGS) and line.endswith(" loglevel=7 initcall_debug")
    assert line.index("quiet") < line.index("loglevel=7")  # the later word wins


def test_none_set_adds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDLOT_KERNEL_ARGS", raising=False)
    assert kernel_args_from_env() == []
    assert "initcall_debug" not in appended(config(tmp_path, []))


@pytest.mark.parametrize("bad", ["a\nb", "x=\x07", "é", "a" * 600])
def test_what_the_kernel_could_not_take_is_refused(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_KERNEL_ARGS", bad)
    with pytest.raises(HostSetupError, match="SANDLOT_KERNEL_ARGS"):
        kernel_args_from_env()


def test_only_self_tests_are_left_out_of_the_initcalls() -> None:
    blacklist = next(w for w in KERNEL_ARGS.split() if w.startswith("initcall_blacklist="))
    assert set(blacklist.split("=", 1)[1].split(",")) == {"crypto_kdf108_init", "blake2s_mod_init"}


def test_tcg_code_cache_is_a_shared_mapping_kvm_has_none(tmp_path: Path) -> None:
    """Under TCG the translated code lives in a memfd mapped twice (split-wx), whose page
    tables fork() does not copy: QEMU forks for each guest connection to the egress proxy."""
    cmd = build_command(config(tmp_path, []), "qemu-system-x86_64")
    accel = cmd[cmd.index("-accel") + 1]
    assert accel.startswith("tcg,") and "split-wx=on" in accel.split(",") and "tb-size=128" in accel
    kvm = build_command(replace(config(tmp_path, []), accel="kvm"), "qemu-system-x86_64")
    assert kvm[kvm.index("-accel") + 1] == "kvm"
