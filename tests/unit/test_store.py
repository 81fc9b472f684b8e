"""The state store's schema: upgrades from every earlier version keep every box,
snapshot and fact; a newer store is refused rather than misread."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from sandlot.core.store import MIGRATIONS, SCHEMA_VERSION, BoxStore, StoreError


def v2_store(path: Path) -> None:
    """A store as sandlot wrote it at schema version 2 (QEMU columns, private option keys)."""
    db = sqlite3.connect(path)
    for step in MIGRATIONS[:2]:
        assert isinstance(step, str)
        db.executescript(step)
    db.execute("PRAGMA user_version=2")
    options = {"image": None, "memory_mib": 256, "cpus": 1, "network": "none", "_machine_id": "m" * 32,
               "_kernel": "/k/vmlinux", "_initrd": "/k/initrd", "_accel": "tcg",
               "_ports": [["127.0.0.1", 8080, 80]], "_suspend": "s1",
               "_op": {"disk": "/layers/new.qcow2"}}  # fmt: skip
    db.execute(
        "INSERT INTO boxes (id, name, state, options, labels, qemu_pid, qemu_start, created_at, updated_at,"
        " disk) VALUES ('b1', 'dev', 'suspended', ?, '{}', 123, '456', 1, 1, '/layers/top.qcow2')",
        (json.dumps(options),),
    )
    facts = {"machine": "microvm", "qemu_version": "7.2.19", "accel": "tcg", "cpu_model": "max",
             "memory_mib": 256, "cpus": 1, "ports": 8, "kernel": "/k/vmlinux", "initrd": "/k/initrd",
             "network": False}  # fmt: skip
    db.execute(
        "INSERT INTO snapshots (id, kind, box_id, box_name, layer, options, created_at)"
        " VALUES ('s1', 'suspend', 'b1', 'dev', '/layers/top.qcow2', ?, 1)",
        (json.dumps({"box": options, "vm": facts}),),
    )
    db.commit()
    db.close()


def test_a_version_2_store_is_upgraded_with_every_fact_in_its_new_place(tmp_path: Path) -> None:
    v2_store(tmp_path / "sandlot.db")
    store = BoxStore(tmp_path / "sandlot.db")
    rec = store.get("dev")
    assert (rec.vm_pid, rec.vm_start, rec.engine) == (123, "456", "qemu")
    assert rec.machine_id == "m" * 32 and rec.suspended == "s1"
    assert rec.boot == {"kernel": "/k/vmlinux", "initrd": "/k/initrd", "accel": "tcg"}
    assert rec.ports == [["127.0.0.1", 8080, 80]]
    assert rec.op == {"kind": "rollback", "disk": "/layers/new.qcow2"}
    assert not [k for k in rec.options if k.startswith("_")] and rec.options["memory_mib"] == 256
    snap = store.find_snapshot("s1")
    assert snap is not None
    assert snap.facts == {"engine": "qemu", "memory_mib": 256, "cpus": 1, "agent_ports": 8, "network": False,
                          "accel": "tcg", "engine_facts": {"machine": "microvm", "qemu_version": "7.2.19",
                          "cpu_model": "max", "kernel": "/k/vmlinux", "initrd": "/k/initrd"}}  # fmt: skip
    assert not [k for k in snap.options["box"] if k.startswith("_")]
    store.close()
    again = BoxStore(tmp_path / "sandlot.db")  # opening it again changes nothing
    assert again.get("dev") == rec


def test_a_version_4_stores_with_blocks_keep_their_holders(tmp_path: Path) -> None:
    """Before version 5 a ``with`` block's box was held by its owner (the process of its
    last operation): the upgrade makes that process the holder of each ephemeral box."""
    db = sqlite3.connect(tmp_path / "sandlot.db")
    for step in MIGRATIONS[:4]:
        db.executescript(step) if isinstance(step, str) else step(db)
    db.execute("PRAGMA user_version=4")
    for name, ephemeral in (("held", 1), ("kept", 0)):
        db.execute(
            "INSERT INTO boxes (id, name, state, options, owner_pid, owner_start, ephemeral, created_at,"
            " updated_at) VALUES (?, ?, 'running', '{}', 77, '88', ?, 1, 1)",
            (name, name, ephemeral),
        )
    db.commit()
    db.close()
    store = BoxStore(tmp_path / "sandlot.db")
    held, kept = store.get("held"), store.get("kept")
    assert held.ephemeral and (held.holder_pid, held.holder_start) == (77, "88")
    assert not kept.ephemeral and (kept.holder_pid, kept.holder_start) == (None, None)
    assert (held.owner_pid, held.owner_start) == (77, "88")


def test_a_store_from_a_newer_sandlot_is_refused(tmp_path: Path) -> None:
    BoxStore(tmp_path / "sandlot.db").close()
    db = sqlite3.connect(tmp_path / "sandlot.db")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="upgrade sandlot") as err:
        BoxStore(tmp_path / "sandlot.db")
    assert err.value.code == "store_unusable"


def test_a_damaged_store_is_refused_with_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "sandlot.db").write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match="cannot be used"):
        BoxStore(tmp_path / "sandlot.db")


def test_a_stamp_moves_with_any_commit_and_a_write_knows_the_one_it_made(tmp_path: Path) -> None:
    """``stamp()`` changes with every commit, this connection's and any other's; a
    transaction's own stamp (``written()``) says what its rows reflect, so that a row
    written is known current until the next commit anywhere."""
    v2_store(tmp_path / "sandlot.db")
    store = BoxStore(tmp_path / "sandlot.db")
    before = store.stamp()
    assert before is not None and store.stamp() == before  # looking commits nothing
    assert store.update("b1", labels={"a": "1"}) is not None
    mine = store.written()
    assert mine is not None and mine != before and store.stamp() == mine
    assert store.find("b1") is not None and store.stamp() == mine  # neither does a read
    other = BoxStore(tmp_path / "sandlot.db")  # another process's connection
    other.update("b1", labels={"b": "2"})
    assert store.stamp() != mine
    seen = store.stamp()
    store.update("b1", labels={})
    assert store.stamp() != seen and store.stamp() == store.written()
    other.close()
    store.close()
