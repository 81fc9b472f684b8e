"""What an export killed part-way leaves beside its destination (``core/exports.py``):
named in the home before it is written, and deleted by the next process that opens
the home's store, or the next export, once the exporting process is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sandlot import pids
from sandlot.core.exports import EXPORTS
from sandlot.core.exports import sweep as sweep_exports


def note(home: Path, name: str, pid: int, start: str | None, paths: list[Path]) -> Path:
    (home / EXPORTS).mkdir(parents=True, exist_ok=True)
    record = home / EXPORTS / f"{name}.json"
    record.write_text(json.dumps({"pid": pid, "start": start, "paths": [str(p) for p in paths]}))
    return record


def test_the_leftovers_of_a_dead_exporter_go_and_a_live_one_s_stay(tmp_path: Path) -> None:
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_start = pids.start_time(dead.pid)
    dead.wait()
    parts, tmp = out / ".a.sandlot.parts-1", out / ".a.sandlot.tmp-1"
    parts.mkdir()
    (parts / "disk.qcow2").write_bytes(b"x")
    tmp.write_bytes(b"half an archive")
    gone = note(home, "dead", dead.pid, dead_start, [parts, tmp])
    mine_tmp = out / ".b.sandlot.tmp-2"
    mine_tmp.write_bytes(b"in progress")
    me, start = pids.me()
    live = note(home, "live", me, start, [mine_tmp])
    visible = out / "c.sandlot"  # a record never names a file that is not hidden: left alone
    visible.write_bytes(b"a finished archive")
    odd = note(home, "odd", dead.pid, dead_start, [visible])
    (home / EXPORTS / "cut.json").write_text('{"pid": ')  # a record cut short
    assert sweep_exports(home) == 3
    assert not parts.exists() and not tmp.exists() and not gone.exists() and not odd.exists()
    assert mine_tmp.exists() and live.exists() and visible.exists()
    assert sorted(p.name for p in (home / EXPORTS).iterdir()) == ["live.json"]
    assert sweep_exports(tmp_path / "elsewhere") == 0  # a home that never exported
