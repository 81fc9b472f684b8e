"""The gVisor engine's drive servers, what needs no root: the state files a box's
drives are found again by, and what a host without the tools is told. Serving them
(qemu-storage-daemon, a loop device, fuse2fs) is tested on real boxes:
tests/vm/test_volumes.py, parametrized by engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandlot.engine.base import Drive
from sandlot.engine.gvisor import drives
from sandlot.errors import HostSetupError


def test_a_process_that_finds_the_box_finds_its_drives_in_their_order(tmp_path: Path) -> None:
    where = drives.drives_dir(tmp_path)
    where.mkdir()
    for i in (10, 2, 0):
        serial = f"sandlot-vol{i}"
        state = {"top": f"/layers/{i}.qcow2", "serial": serial, "guest": f"/v{i}", "readonly": i == 2}
        (where / f"{serial}.json").write_text(json.dumps(state))
    (where / "sandlot-vol5.json").write_text("{not json")  # half a crash's: left to stop_all
    assert drives.recorded(tmp_path) == (
        Drive(Path("/layers/0.qcow2"), "sandlot-vol0", guest="/v0"),
        Drive(Path("/layers/2.qcow2"), "sandlot-vol2", guest="/v2", guest_readonly=True),
        Drive(Path("/layers/10.qcow2"), "sandlot-vol10", guest="/v10"),
    )
    assert drives.any_left(tmp_path)


def test_stopping_what_was_never_served_is_a_no_op(tmp_path: Path) -> None:
    drives.stop_all(tmp_path)
    assert drives.recorded(tmp_path) == () and not drives.any_left(tmp_path)
    where = drives.drives_dir(tmp_path)
    where.mkdir()
    (where / "sandlot-vol0.json").write_text("{}")  # a crash before anything was started
    drives.stop_all(tmp_path)
    assert not drives.any_left(tmp_path)


def test_a_host_without_the_tools_is_told_which_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drives, "which", lambda tool: None if tool == "fuse2fs" else f"/usr/bin/{tool}")
    assert "fuse2fs" in drives.missing_tools()
    monkeypatch.setattr(drives, "which", lambda tool: None)
    with pytest.raises(HostSetupError, match="apt install qemu-system-common"):
        drives.serve(tmp_path, (Drive(tmp_path / "top.qcow2", "sandlot-vol0", guest="/data"),))
    assert not drives.any_left(tmp_path)  # nothing of it is left to stop
