"""The boxes of this host's home as ``sandlot ls`` shows them, read without the box API.

A start of ``sandlot ls`` is mostly imports, and the box API brings the event loop,
the store's class and the agent protocol. Where no box of the home needs recovery
(``core.boxrecord.settled_boxes``), the rows are shown as they are; where one does,
``settled_listing`` answers None and the caller lists through ``AsyncBox.list``, which
recovers them first.

>>> records = settled_listing(include_stopped=True, state=None, labels=None)
>>> records is None or all("state" in r for r in records)
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..core import exports
from ..core.boxrecord import listed, settled_boxes
from ..home import home_path


def settled_listing(
    *,
    include_stopped: bool,
    state: str | None,
    labels: Mapping[str, str] | None,
    home: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]] | None:
    """The records (``BoxRecord.to_json``) of the boxes a listing shows, oldest first, as
    ``AsyncBox.list`` gives them (never a warm pool's VM; running or paused ones only
    unless ``include_stopped``; of ``state`` and carrying ``labels``, if given). None
    where a box needs recovery first, the store must be migrated, or an export left its
    files for the store's opening to delete."""
    where = home_path(home)
    if exports.left_behind(where):  # the store's opening deletes what an export cut short left
        return None
    records = settled_boxes(where)
    if records is None:
        return None
    return [
        r.to_json() for r in records if listed(r, include_stopped=include_stopped, state=state, labels=labels)
    ]
