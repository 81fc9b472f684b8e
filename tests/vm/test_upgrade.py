"""A store written by the previous schema (version 2) opens, and its stopped and
suspended boxes still start and resume, processes included. Its saved states are
whole files, as every sandlot before the chunk store saved them (schema 11)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sandlot
from sandlot.core.store import SCHEMA_VERSION

from tests.support.legacy import downgrade_to_v2
from tests.support.waiting import scaled

pytestmark = pytest.mark.vm


def py(home: Path, code: str, **env_more: str) -> str:
    env = {**os.environ, "SANDLOT_HOME": str(home), **env_more}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_version_2_store_opens_and_its_boxes_start_and_resume(busybox_root: Path, tmp_path: Path) -> None:
    shared = sandlot.Runtime.for_home().home
    sandlot.Runtime.for_home().prepare()
    home = tmp_path / "home"
    home.mkdir()
    for d in ("kernels", "agent", "initramfs"):
        (home / d).symlink_to(shared / d)
    py(
        home,
        f"""
        import sandlot
        root = {str(busybox_root)!r}
        a = sandlot.Box(rootfs=root, name="was-stopped", memory_mib=256, keep=True).start()
        a.files.write("/root/kept", "on the disk")
        a.exec("sync")
        a.stop()
        b = sandlot.Box(rootfs=root, name="was-suspended", memory_mib=256, keep=True).start()
        loop = "i=0; while true; do i=$((i+1)); echo $i >/tmp/m; mv /tmp/m /tmp/n; sleep 0.1; done"
        b.sh("sh -c '" + loop + "' >/dev/null 2>&1 &")
        import time
        deadline = time.monotonic() + {scaled(60)!r}  # (a script of its own: the value, not the call)
        while b.sh("cat /tmp/n").returncode != 0:  # it counts before it is suspended
            assert time.monotonic() < deadline, "the counter never started"
            time.sleep(0.1)
        b.suspend()
    """,
        SANDLOT_STATE_CHUNKS="0",  # a home of then: its states are files
    )
    try:
        check_upgrade(home)
    finally:  # whatever happened, no VM outlives the test
        remove_all = "import sandlot\nfor b in sandlot.list(): b.remove(force=True)"
        env = {**os.environ, "SANDLOT_HOME": str(home)}
        subprocess.run([sys.executable, "-c", remove_all], env=env, capture_output=True, timeout=300)


def check_upgrade(home: Path) -> None:
    downgrade_to_v2(home / "sandlot.db")
    db = sqlite3.connect(home / "sandlot.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    options = json.loads(db.execute("SELECT options FROM boxes WHERE name = 'was-suspended'").fetchone()[0])
    assert options["_suspend"] and options["_accel"]  # as version 2 kept them
    db.close()
    out = py(
        home,
        f"""
        import sandlot
        a = sandlot.get("was-stopped")
        a.start()
        print(a.files.read_text("/root/kept"))
        b = sandlot.get("was-suspended")
        assert b.state == "suspended", b.state
        before = int(b.exec("cat", "/tmp/n").stdout)  # the next command resumes it
        import time
        deadline = time.monotonic() + {scaled(30)!r}
        while (after := int(b.exec("cat", "/tmp/n").stdout)) <= before and time.monotonic() < deadline:
            time.sleep(0.1)  # its counter runs on
        print(before > 0, after > before, b.state)
        for box in sandlot.list():
            box.remove(force=True)
    """,
    )
    assert out.split("\n")[:2] == ["on the disk", "True True running"]
    db = sqlite3.connect(home / "sandlot.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("SELECT count(*) FROM keys").fetchone()[0] == 0  # version 4: keys and audit
    db.close()
