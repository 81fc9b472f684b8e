"""The document of a box that went through the storage tier (``boxes/<id>.json``): its
row, its suspended state's, and its disk's files as manifests of chunks. Written by
``core.remote`` as a box is pushed, read as it is pulled and as the tier is collected
(``core.tiergc``: a document keeps its state and its disk's files)."""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import CorruptSnapshot

FORMAT = "sandlot-box/1"

# the fields of a box's row that mean the same on any host (its VM's, its ports', its
# disk's paths are this host's: the home that pulls it writes its own)
PORTABLE = {
    "id", "name", "options", "created_at", "image_ref", "image_digest", "rootfs", "labels", "engine",
    "machine_id", "stopped_at", "started_at",
}  # fmt: skip


def read(data: bytes, where: str) -> dict[str, Any]:
    """A box document, checked: ``CorruptSnapshot`` naming ``where`` if it is not one."""
    try:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        box, snap, disk = doc["box"], doc["snapshot"], doc["disk"]
        if not (isinstance(box, dict) and isinstance(snap, dict) and isinstance(disk, list) and disk):
            raise ValueError("its box, state or disk is missing")
        if set(box) - PORTABLE or not re.fullmatch(r"[0-9a-f]{12}", str(box.get("id"))):
            raise ValueError("its box's fields are not those of a box")
        if snap.get("kind") != "suspend" or snap.get("box_id") != box["id"]:
            raise ValueError("its state is not the box's suspended state")
        return dict(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptSnapshot(f"the box {where} in the storage tier is malformed: {exc}") from None
