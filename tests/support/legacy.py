"""Stores as earlier sandlot versions wrote them, to test upgrades for real.

``downgrade_to_v2`` rewrites a store in the format of schema version 2 (the
tables of ``MIGRATIONS[:2]``; the VM in ``qemu_pid``/``qemu_start``; the machine
id, boot paths, accelerator, bound ports, suspended state and pending operation
in private option keys; snapshot facts flat, QEMU's), keeping every box, snapshot
and file as they are."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from sandlot.core.store import MIGRATIONS

V2_BOX = ("id", "name", "state", "image_ref", "image_digest", "rootfs", "options", "labels", "owner_pid",
          "owner_start", "ephemeral", "reason", "created_at", "started_at", "stopped_at", "updated_at",
          "disk", "origin")  # fmt: skip


def insert(db: sqlite3.Connection, table: str, row: dict[str, object]) -> None:
    db.execute(
        f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values())
    )


def downgrade_to_v2(db: Path) -> None:
    src = sqlite3.connect(db)
    src.row_factory = sqlite3.Row
    boxes = [dict(r) for r in src.execute("SELECT * FROM boxes")]
    snaps = [dict(r) for r in src.execute("SELECT * FROM snapshots")]
    src.close()
    for suffix in ("", "-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)
    dst = sqlite3.connect(db)
    for step in MIGRATIONS[:2]:
        assert isinstance(step, str)
        dst.executescript(step)
    dst.execute("PRAGMA user_version=2")
    for b in boxes:
        opts = json.loads(b["options"])
        opts.pop("engine", None)
        opts.pop("auto_template", None)
        opts.pop("rootfs_digest", None)
        boot = json.loads(b["boot"])
        opts.update({"_machine_id": b["machine_id"], "_kernel": boot.get("kernel"),
                     "_initrd": boot.get("initrd"), "_accel": boot.get("accel"),
                     "_ports": json.loads(b["ports"])})  # fmt: skip
        if b["suspended"]:
            opts["_suspend"] = b["suspended"]
        if b["op"]:
            op = json.loads(b["op"])
            op.pop("kind", None)
            opts["_op"] = op
        row = {k: b[k] for k in V2_BOX} | {"options": json.dumps(opts), "qemu_pid": b["vm_pid"],
                                           "qemu_start": b["vm_start"]}  # fmt: skip
        dst.execute(
            f"INSERT INTO boxes ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values())
        )
    for s in snaps:
        o = json.loads(s["options"])
        vm, ef = o["vm"], o["vm"]["engine_facts"]
        o["vm"] = {**ef, "accel": vm["accel"], "memory_mib": vm["memory_mib"], "cpus": vm["cpus"],
                   "ports": vm["agent_ports"], "network": vm["network"]}  # fmt: skip
        row = s | {"options": json.dumps(o)}
        insert(dst, "snapshots", row)
    dst.commit()
    dst.close()
