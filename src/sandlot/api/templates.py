"""Templates (a booted, set-up box saved to start others from) and snapshot import.

>>> import sandlot
>>> t = sandlot.template("python:3.12-slim", name="py",               # doctest: +SKIP
...                      setup=["pip install numpy", "python3 -c 'import numpy'"])
>>> with sandlot.Box(template="py") as box:    # a restore, not a boot    # doctest: +SKIP
...     box.exec("python3", "-c", "import numpy; print(numpy.__version__)")
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import snapshots
from ..errors import InvalidArgument
from ..images.store import Image
from ..runtime import Runtime
from ..store import validate_name
from . import _sync
from .box import AsyncBox, Box
from .snapshot import AsyncSnapshot, Snapshot


async def template_async(
    image: str | Image | None = None,
    *,
    setup: Sequence[str | Sequence[str]] = (),
    name: str | None = None,
    home: str | os.PathLike[str] | None = None,
    **box_options: Any,
) -> AsyncSnapshot:
    """Boot ``image``, run each ``setup`` command (a shell line, or an argv list; any
    failure raises CommandFailed), and save the running box as a template. Boxes
    started with ``Box(template=name)`` begin in that state, processes included."""
    if name is not None:
        validate_name(name)
    if isinstance(setup, str):
        raise InvalidArgument("setup is a list of commands, not one string")
    rt = Runtime.for_home(home)
    if name is not None and any(s.name == name for s in rt.store.snapshots(kind="template")):
        raise InvalidArgument(f"a template named {name!r} already exists")
    box = AsyncBox(image, template=False, home=rt.home, **box_options)
    async with box:
        for cmd in setup:
            if isinstance(cmd, str):
                await box.sh(cmd, check=True)
            else:
                await box.exec(*cmd, check=True)
        async with box._lock, box._box_lock():
            snap = await box._capture("template", name=name)
    await snapshots.materialize(rt, snap.record)
    found = rt.store.find_snapshot(snap.id)
    assert found is not None
    return AsyncSnapshot(rt, found)


def template(
    image: str | Image | None = None,
    *,
    setup: Sequence[str | Sequence[str]] = (),
    name: str | None = None,
    home: str | os.PathLike[str] | None = None,
    **box_options: Any,
) -> Snapshot:
    """Sync ``template_async``."""
    return Snapshot(_sync.run(template_async(image, setup=setup, name=name, home=home, **box_options)))


async def import_snapshot_async(
    path: str | os.PathLike[str], *, name: str | None = None, home: str | os.PathLike[str] | None = None,
    start: bool = True, **box_options: Any,
) -> AsyncBox | AsyncSnapshot:  # fmt: skip
    """Verify an exported snapshot (integrity, compatibility with this host) and add
    it to this home; with ``start`` (the default) start a box from it and return the box."""
    from .. import archive

    rt = Runtime.for_home(home)
    rec = await asyncio.to_thread(archive.import_snapshot, rt, Path(path))
    snap = AsyncSnapshot(rt, rec)
    if not start:
        return snap
    boxes = await snap.start(1, name=name, **box_options)
    return boxes[0]


def import_snapshot(
    path: str | os.PathLike[str], *, name: str | None = None, home: str | os.PathLike[str] | None = None,
    start: bool = True, **box_options: Any,
) -> Box | Snapshot:  # fmt: skip
    """Sync ``import_snapshot_async``: the running box (or the snapshot, ``start=False``)."""
    out = _sync.run(import_snapshot_async(path, name=name, home=home, start=start, **box_options))
    return Box._wrap(out) if isinstance(out, AsyncBox) else Snapshot(out)
