"""The fleet's rules without a cluster: moved state in checksummed chunks, the
directory's reconciliation with the nodes (lost boxes, nothing claimed that no
node has, adopted boxes, reservations given back), its persistence, errors from nodes,
and Ray imported only by the fleet. That a fleet box is the same ``Box`` with every
operation is ``tests/unit/test_surface.py``'s; its behaviour, ``tests/vm/test_contract.py``'s."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sandlot
from sandlot.errors import BoxNotFound, CorruptSnapshot, InvalidArgument
from sandlot.fleet import transfer
from sandlot.fleet.backend import opened
from sandlot.fleet.directory import LOST, Directory, new_record, reconcile, released
from sandlot.fleet.node import guarded

SRC = Path(__file__).resolve().parents[2] / "src"


def box(box_id: str, name: str, state: str = "running", **labels: str) -> dict[str, object]:
    return {"id": box_id, "name": name, "labels": labels, "state": state, "cpus": 1, "memory_mib": 256}


# -- moving state --------------------------------------------------------------------------


def test_state_goes_in_checksummed_chunks_and_comes_back_whole(tmp_path: Path) -> None:
    src = tmp_path / "a.sandlot"
    src.write_bytes(os.urandom(100_000) + bytes(50_000))
    parts = list(transfer.pieces(src, chunk=32_768))
    assert [p.index for p, _ in parts] == [0, 1, 2, 3, 4]
    assert parts[-1][0].size == 150_000 - 4 * 32_768
    out = transfer.assemble(parts, tmp_path / "b.sandlot", transfer.digest(src))
    assert out.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.sandlot", "b.sandlot"]


def test_a_damaged_missing_or_extra_chunk_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "a.sandlot"
    src.write_bytes(os.urandom(70_000))
    parts = list(transfer.pieces(src, chunk=32_768))
    total = transfer.digest(src)
    flipped = bytes([parts[1][1][0] ^ 0xFF]) + parts[1][1][1:]  # a changed byte, whatever the data
    damaged = [parts[0], (parts[1][0], flipped), parts[2]]
    with pytest.raises(CorruptSnapshot, match=r"chunk 1 .* sha256"):
        transfer.assemble(damaged, tmp_path / "b.sandlot", total)
    with pytest.raises(CorruptSnapshot, match="chunk 1 of the moved state is missing"):
        transfer.assemble([parts[0], parts[2]], tmp_path / "b.sandlot", total)
    with pytest.raises(CorruptSnapshot, match="missing or extra"):
        transfer.assemble(parts[:2], tmp_path / "b.sandlot", total)
    assert [p.name for p in tmp_path.iterdir()] == ["a.sandlot"]


# -- the directory -------------------------------------------------------------------------


def test_a_box_of_a_dead_node_is_lost_with_its_node_and_time() -> None:
    recs = {"b1": new_record(box("b1", "one"), "nodeA", 1.0, reservation="pg1")}
    out = reconcile(recs, alive=["nodeB"], seen={"nodeB": []}, now=50.0)
    assert out["b1"]["state"] == LOST
    assert out["b1"]["lost"] == {"node": "nodeA", "at": 50.0, "state": "running"}
    again = reconcile(out, alive=["nodeB"], seen={"nodeB": []}, now=90.0)
    assert again["b1"]["lost"]["at"] == 50.0  # the time it was first found lost
    assert released(recs, out) == ["pg1"]  # a lost box's room is given back


def test_nothing_claims_a_box_its_live_node_does_not_have() -> None:
    recs = {
        "b1": new_record(box("b1", "gone"), "nodeA", 1.0, reservation="pg1"),
        "b2": new_record(box("b2", "kept"), "nodeA", 1.0, reservation="pg2"),
    }
    out = reconcile(recs, alive=["nodeA"], seen={"nodeA": [box("b2", "kept", "suspended")]}, now=2.0)
    assert set(out) == {"b2"} and out["b2"]["state"] == "suspended"
    assert released(recs, out) == ["pg1"]


def test_a_live_node_that_does_not_answer_keeps_its_boxes() -> None:
    recs = {"b1": new_record(box("b1", "one"), "nodeA", 1.0)}
    out = reconcile(recs, alive=["nodeA", "nodeB"], seen={"nodeB": []}, now=2.0)
    assert out["b1"]["state"] == "running" and out["b1"]["lost"] is None


def test_boxes_a_node_has_are_adopted_and_a_dead_replica_forgotten() -> None:
    recs = {"b1": new_record(box("b1", "one"), "nodeA", 1.0, replica={"node": "nodeC", "snapshot": "s"})}
    seen = {"nodeA": [box("b1", "one")], "nodeB": [box("b9", "made-elsewhere", team="x")]}
    out = reconcile(recs, alive=["nodeA", "nodeB"], seen=seen, now=3.0)
    assert out["b1"]["replica"] is None
    assert out["b9"]["node"] == "nodeB" and out["b9"]["labels"] == {"team": "x"} and out["b9"]["adopted"]


def test_a_lost_box_is_found_again_where_its_home_comes_back() -> None:
    recs = {"b1": new_record(box("b1", "one"), "nodeA", 1.0)}
    lost = reconcile(recs, alive=["nodeB"], seen={"nodeB": []}, now=2.0)
    back = reconcile(
        lost, alive=["nodeB", "nodeA2"], seen={"nodeB": [], "nodeA2": [box("b1", "one")]}, now=3.0
    )
    assert back["b1"]["node"] == "nodeA2" and back["b1"]["state"] == "running" and back["b1"]["lost"] is None


def test_a_fork_shares_one_reservation_until_its_last_child_goes(tmp_path: Path) -> None:
    d = Directory(str(tmp_path / "directory.json"))
    for i in (1, 2):
        d.put(new_record(box(f"k{i}", f"kid-{i}"), "nodeA", 1.0, reservation="pgfork"))
    assert d.release("k1") == []
    assert d.release("k2") == ["pgfork"]


def test_the_directory_survives_its_actor_and_finds_by_name_or_prefix(tmp_path: Path) -> None:
    path = tmp_path / "fleet" / "directory.json"
    d = Directory(str(path))
    d.put(new_record(box("0123456789ab", "web"), "nodeA", 1.0))
    d.put(new_record(box("0123ffffffff", "db"), "nodeB", 2.0))
    again = Directory(str(path))  # a restarted actor reads what the last one wrote
    assert again.get("web")["node"] == "nodeA"
    assert again.get("0123ff")["name"] == "db"
    with pytest.raises(InvalidArgument, match="more than one box"):
        again.get("0123")
    with pytest.raises(BoxNotFound):
        again.get("nope")
    assert [r["name"] for r in again.all()] == ["web", "db"]


def test_a_node_error_comes_back_as_the_same_class() -> None:
    class Node:
        """A node actor's shape as ``guarded`` sees it: each call waits for it to settle."""

        settles = 0

        async def settled(self) -> None:
            self.settles += 1

        @guarded
        async def fails(self) -> None:
            raise sandlot.IncompatibleSnapshot("the snapshot was saved by QEMU 99.0; this host has QEMU 8.2")

        @guarded
        async def answers(self) -> int:
            return 3

    node = Node()
    with pytest.raises(sandlot.IncompatibleSnapshot, match=r"QEMU 99\.0"):
        opened(asyncio.run(node.fails()))
    assert opened(asyncio.run(node.answers())) == 3
    assert node.settles == 2
    assert opened({"node": "n1"}) == {"node": "n1"}  # the directory's answers pass as they are


def test_only_the_fleet_imports_ray() -> None:
    code = ("import sys, sandlot, sandlot.cli.fleet, sandlot.cli.boxes, sandlot.api.sync; sandlot.Box; "
            "assert 'ray' not in sys.modules, 'ray imported'; "
            "from sandlot import fleet; assert 'ray' in sys.modules")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
