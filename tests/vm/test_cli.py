"""The sandlot command line, run as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sandlot as sl

from tests.unit.test_cli_lean import PROBE, heavy

SANDLOT = [sys.executable, "-m", "sandlot.cli"]


def sandlot(
    *args: str, stdin: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*SANDLOT, *args], input=stdin, capture_output=True, timeout=timeout)


def test_doctor_reports_accelerator_and_reason() -> None:
    r = sandlot("doctor", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["accel"]["name"] in ("kvm", "tcg")
    assert report["accel"]["reason"]
    assert report["qemu"]["version"]
    assert "virtio_blk" in report["kernel"]["modules"]
    assert report["kernel"]["lockdown"] is True  # the distro's modules are signed
    assert report["host_cgroup"].get("where") or report["host_cgroup"]["reason"]
    text = sandlot("doctor").stdout.decode()
    if report["accel"]["name"] == "tcg":  # QEMU's emulated SVM
        assert report["nested_virt"] == {"available": True, "why": report["nested_virt"]["why"]}
        assert "emulated CPU offers SVM" in report["nested_virt"]["why"]
        # what a box gains under emulation without address-space randomization
        assert "aslr=False" in report["accel"]["advice"] and "--no-aslr" in text
    assert "nested virt" in text
    assert report["containers"]["modules"] == report["containers"]["of"] > 20  # the distro kernel: all
    assert "boxes may run Docker or Podman (containers=True)" in text
    assert "accelerator" in text and report["accel"]["name"] in text
    assert "host cgroup" in text
    assert "lockdown (confidentiality): yes" in text


@pytest.mark.vm
def test_run_exit_status_streams_and_stdin(busybox_root: Path) -> None:
    # --rm: without it a stopped box is kept, as Docker keeps a container
    root = str(busybox_root)
    r = sandlot("run", "--rm", "--rootfs", root, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert r.returncode == 3
    assert r.stdout == b"out\n" and r.stderr == b"err\n"
    script = "tr a-z A-Z; echo $GREETING"
    r = sandlot(
        "run",
        "--rm",
        "-i",
        "--rootfs",
        str(busybox_root),
        "-e",
        "GREETING=hi",
        "--",
        "sh",
        "-c",
        script,
        stdin=b"hello\n",
    )
    assert r.returncode == 0 and r.stdout == b"HELLO\nhi\n"
    r = sandlot("run", "--rm", "--rootfs", root, "-u", "agent", "-w", "/tmp", "--", "sh", "-c", "id -u; pwd")
    assert r.stdout == b"1000\n/tmp\n"


@pytest.mark.vm
def test_run_errors(busybox_root: Path, tmp_path: Path) -> None:
    r = sandlot("run", "--rm", "--rootfs", str(busybox_root), "--", "no-such-command")
    assert r.returncode == 127 and b"no-such-command" in r.stderr
    r = sandlot("run", "--rootfs", str(tmp_path / "missing"), "--", "true")
    assert r.returncode == 125 and b"does not exist" in r.stderr
    r = sandlot("run", "--rootfs", str(busybox_root))
    assert r.returncode == 2 and b"no command" in r.stderr


def test_exec_and_ls_on_a_running_box_load_nothing_booting_needs(busybox_root: Path, tmp_path: Path) -> None:
    """``sandlot exec`` and ``ls`` on a box that runs: the engine's boot assets, QMP and
    the image store stay unimported (benchmarks/cli.py: what that is worth)."""
    with sl.Box(rootfs=busybox_root, memory_mib=256) as box:
        for argv in (["exec", box.name, "true"], ["ls"]):
            out = tmp_path / "modules.json"
            r = subprocess.run([sys.executable, "-c", PROBE, str(out), *argv], capture_output=True, text=True,
                               timeout=120)  # fmt: skip
            assert r.returncode == 0, r.stderr[-2000:]
            names = set(json.loads(out.read_text()))
            assert "sandlot.engine.qemu.vm" in names or argv == ["ls"]  # it reached the VM
            assert heavy(names) == []
