"""The Docker-style box commands, run as a user would, and an interactive
terminal session driven through tmux."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.names import unique
from tests.support.waiting import deadline_in, wait_for

pytestmark = pytest.mark.vm
CLI_BOX = unique("cli-box")
CLI_RM = unique("cli-rm")
CLI_KEPT = unique("cli-kept")
CLI_CREATED = unique("cli-created")
CLI_DETACHED = unique("cli-detached")
CLI_TTY = unique("cli-tty")
SANDLOT = [sys.executable, "-m", "sandlot.cli"]


def cli(*args: str, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SANDLOT, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def ok(*args: str, **kw: object) -> str:
    r = cli(*args, **kw)  # type: ignore[arg-type]
    assert r.returncode == 0, f"sandlot {' '.join(args)}: {r.returncode}\n{r.stderr}"
    return r.stdout


def test_box_lifecycle_commands(busybox_root: Path, tmp_path: Path) -> None:
    root = str(busybox_root)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("from host")
    name = CLI_BOX
    try:
        assert ok("run", "-d", "--name", name, "-l", "team=cli", "-e", "FOO=bar", "-v", f"{shared}:/mnt/s",
                  "--tz", "UTC-3", "--rootfs", root).strip() == name  # fmt: skip
        listing = ok("ls")
        assert name in listing and "running" in listing
        assert ok("ls", "-q", "--filter", "label=team=cli").split() == [name]
        assert ok("exec", name, "sh", "-c", "echo $FOO; cat /mnt/s/in.txt") == "bar\nfrom host"
        assert ok("exec", name, "date", "+%z") == "+0300\n"  # --tz: the commands' $TZ
        assert cli("exec", name, "sh", "-c", "exit 7").returncode == 7
        assert ok("exec", "-i", name, "tr", "a-z", "A-Z", stdin="piped\n") == "PIPED\n"
        # cp both ways
        local = tmp_path / "local.txt"
        local.write_text("uploaded")
        ok("cp", str(local), f"{name}:/root/")
        assert ok("exec", name, "cat", "/root/local.txt") == "uploaded"
        ok("cp", f"{name}:/etc/passwd", str(tmp_path / "passwd"))
        assert "agent:x:1000" in (tmp_path / "passwd").read_text()
        # trees as docker cp copies them: links are links both ways, -L follows inside the tree only
        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "f").write_text("f")
        (tree / "ln").symlink_to("/etc/passwd")
        (tree / "in").symlink_to("sub/f")
        ok("cp", str(tree), f"{name}:/root/")
        assert ok("exec", name, "readlink", "/root/tree/ln") == "/etc/passwd\n"
        ok("cp", f"{name}:/root/tree", str(tmp_path / "back"))
        assert (
            os.readlink(tmp_path / "back" / "ln") == "/etc/passwd"
            and os.readlink(tmp_path / "back" / "in") == "sub/f"
        )
        r = cli("cp", "-L", str(tree), f"{name}:/root/followed")
        assert r.returncode == 125 and "'ln'" in r.stderr and "leads out" in r.stderr
        (tree / "ln").unlink()
        ok("cp", "-L", f"{tree}/.", f"{name}:/root/followed")
        assert ok("exec", name, "cat", "/root/followed/in") == "f"
        # facts
        info = json.loads(ok("inspect", name))
        assert info["name"] == name and info["labels"] == {"team": "cli"} and info["state"] == "running"
        assert "sandlot-agent: ready" in ok("logs", name)
        assert name in ok("stats")
        # stop, start, rm
        r = cli("rm", name)
        assert r.returncode == 1 and "stop it first" in r.stderr
        ok("stop", name)
        assert name not in ok("ls") and name in ok("ls", "-a")
        ok("start", name)
        assert ok("exec", name, "cat", "/root/local.txt") == "uploaded"  # the disk was kept
        ok("pause", name)
        assert "paused" in ok("ls")
        ok("unpause", name)
        ok("restart", name)
        ok("rm", "-f", name)
        assert name not in ok("ls", "-a")
        r = cli("exec", name, "true")
        assert r.returncode == 125 and "no box" in r.stderr
    finally:
        cli("rm", "-f", name)


def test_run_rm_and_create(busybox_root: Path) -> None:
    root = str(busybox_root)
    r = cli("run", "--rm", "--name", CLI_RM, "--rootfs", root, "--", "sh", "-c", "echo once; exit 3")
    assert r.returncode == 3 and r.stdout == "once\n"
    assert CLI_RM not in ok("ls", "-a")
    r = cli("run", "--name", CLI_KEPT, "--rootfs", root, "--", "true")  # no --rm: stopped, kept
    try:
        assert r.returncode == 0
        assert "stopped" in ok("ls", "-a", "--filter", "state=stopped")
        assert ok("create", "--name", CLI_CREATED, "--rootfs", root).strip() == CLI_CREATED
        assert "created" in ok("ls", "-a", "-f", "state=created")
        ok("start", CLI_CREATED)
        assert ok("exec", CLI_CREATED, "echo", "hi") == "hi\n"
        r = cli("create", "--name", CLI_CREATED, "--rootfs", root)
        assert r.returncode == 125 and "already exists" in r.stderr
    finally:
        cli("rm", "-f", CLI_KEPT, CLI_CREATED)


def test_a_detached_command_leaves_the_next_process_free_to_exec(busybox_root: Path) -> None:
    # run -d CMD leaves the command on a channel of its (now gone) connection; the next
    # process that takes the same agent port numbers its channels from 1 again
    name = CLI_DETACHED
    try:
        ok("run", "-d", "--name", name, "--rootfs", str(busybox_root), "--", "sleep", "300")
        assert ok("exec", name, "echo", "next") == "next\n"
        still = ok("exec", name, "sh", "-c", "cat /proc/[0-9]*/comm | grep -qx sleep && echo still-running")
        assert still == "still-running\n"
    finally:
        cli("rm", "-f", name)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_exec_it_in_a_real_terminal(busybox_root: Path, tmp_path: Path) -> None:
    name = CLI_TTY
    ok("run", "-d", "--name", name, "--rootfs", str(busybox_root))
    session = f"sandlot-test-{int(time.time())}"
    sock = str(tmp_path / "tmux.sock")

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-S", sock, *args], capture_output=True, text=True, check=True).stdout

    def screen_has(text: str, timeout: float = 30) -> str:
        deadline = deadline_in(timeout)
        while time.monotonic() < deadline:
            shown = tmux("capture-pane", "-p", "-t", session)
            if text in shown:
                return shown
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared on the terminal:\n{shown}")

    try:
        command = " ".join([*SANDLOT, "exec", "-it", name, "sh"])
        tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30", command)
        screen_has("/ #")  # the guest shell's prompt: type only once it is there, as a person would
        tmux("send-keys", "-t", session, "echo $((6*7)); tty", "Enter")
        screen_has("42")
        screen_has("/dev/pts/")
        tmux("send-keys", "-t", session, "stty size", "Enter")
        screen_has("30 100")
        tmux("resize-window", "-t", session, "-x", "120", "-y", "40")

        def new_size_seen() -> bool:  # asked again until the resize has reached the guest
            tmux("send-keys", "-t", session, "stty size", "Enter")
            return "40 120" in tmux("capture-pane", "-p", "-t", session)

        wait_for("the terminal's new size in the guest", new_size_seen, 30, every=1)
        tmux("send-keys", "-t", session, "exit", "Enter")
        deadline = deadline_in(30)
        while time.monotonic() < deadline:
            if subprocess.run(
                ["tmux", "-S", sock, "has-session", "-t", session], capture_output=True
            ).returncode:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the session did not end after exit")
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)
        cli("rm", "-f", name)


def test_create_then_start_in_other_processes_saves_the_images_template(
    busybox_root: Path, tmp_path: Path
) -> None:
    """The first boot of an image saves its automatic template whichever process
    boots it, so later CLI-started boxes of the image are restores, not boots."""
    image = f"cli/tmpl-{time.monotonic_ns() % 10**6}:1"
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(busybox_root), str(root)], check=True)
    (root / "unique").write_text(image)  # an image no other test made a template of
    ok("import", str(root), image)
    first, second = f"ct1-{time.monotonic_ns() % 10**6}", f"ct2-{time.monotonic_ns() % 10**6}"
    try:
        ok("create", "--name", first, "-m", "256", image)
        ok("start", first)
        assert json.loads(ok("inspect", first))["origin"] is None  # booted
        snaps = json.loads(ok("snapshots", "--json"))
        assert [s for s in snaps if s["kind"] == "template" and s["box_name"] == first]
        ok("run", "-d", "--name", second, "-m", "256", image)
        origin = json.loads(ok("inspect", second))["origin"]
        assert origin and any(s["id"] == origin for s in snaps)  # restored from it
    finally:
        cli("rm", "-f", first, second)
        cli("rmi", image)
