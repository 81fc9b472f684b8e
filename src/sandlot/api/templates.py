"""Templates (a booted, set-up box saved to start others from), their warm pools,
and snapshot import.

>>> import sandlot
>>> t = sandlot.template("python:3.12-slim", name="py",               # doctest: +SKIP
...                      setup=["pip install numpy", "python3 -c 'import numpy'"], pool=2)
>>> with sandlot.Box(template="py") as box:    # a pool VM claimed, or a restore  # doctest: +SKIP
...     box.exec("python3", "-c", "import numpy; print(numpy.__version__)")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..core.pools import PoolInfo
from ..core.runtime import Runtime
from ..core.service import core_for
from ..core.store import SnapshotRecord, validate_name
from ..errors import InterpreterError, InvalidArgument
from ..images.store import Image
from .backend import SnapshotRef
from .box import AsyncBox, AsyncSnapshot
from .local import LocalBackend, LocalSnapshotRef


async def template_async(
    image: str | Image | None = None,
    *,
    setup: Sequence[str | Sequence[str]] = (),
    code: Sequence[str] = (),
    name: str | None = None,
    pool: int = 0,
    home: str | os.PathLike[str] | None = None,
    **box_options: Any,
) -> AsyncSnapshot:
    """Start ``image`` (from its automatic template, where the home has one: a restore
    rather than a boot, as for any box of it; ``template=False`` boots it), run each
    ``setup`` command (a shell line, or an argv list; any failure raises CommandFailed),
    run each ``code`` cell in the box's default Python interpreter (an error raises
    InterpreterError), and save the running box as a template. Boxes started with
    ``Box(template=name)`` begin in that state, processes included: with ``code``, their
    first ``run_code`` finds the interpreter started and what its cells imported and
    defined. ``pool``: keep that many VMs of it ready (``set_pool``), filled in the
    background.

    >>> sandlot.template("python:3.12-slim", code=["import json, csv"], name="py")  # doctest: +SKIP
    """
    if name is not None:
        validate_name(name, "template")
    if isinstance(setup, str) or isinstance(code, str):
        raise InvalidArgument("setup and code are lists (of commands, of cells), not one string")
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 0:
        raise InvalidArgument(f"pool is a number of VMs (0 or more), not {pool!r}")
    rt = Runtime.for_home(home)
    core = core_for(rt)
    backend = LocalBackend.for_home(rt.home)
    if name is not None and any(s.name == name for s in await core.live.list_snapshots(kind="template")):
        raise InvalidArgument(f"a template named {name!r} already exists")
    box = AsyncBox(image, home=rt.home, **box_options)
    async with box:
        for cmd in setup:
            if isinstance(cmd, str):
                await box.sh(cmd, check=True)
            else:
                await box.exec(*cmd, check=True)
        for cell in code:
            ran = await box.run_code(cell)
            if ran.error is not None:
                raise InterpreterError(
                    f"template code cell failed: {ran.error.name}: {ran.error.value}\n{ran.error.traceback}"
                )
        entry = await core.controller.find(box.id)
        snap = await core.live.make_template(entry, name)
    if pool:
        await core.pools.set_size(snap, pool)
    return AsyncSnapshot(LocalSnapshotRef(backend, snap))


async def import_snapshot_async(
    path: str | os.PathLike[str], *, name: str | None = None, home: str | os.PathLike[str] | None = None,
    start: bool = True, **box_options: Any,
) -> AsyncBox | AsyncSnapshot:  # fmt: skip
    """Verify an exported snapshot (integrity, compatibility with this host) and add
    it to this home; with ``start`` (the default) start a box from it and return the box."""
    made = await LocalBackend.for_home(home).import_snapshot(Path(path), name=name, start=start,
                                                              options=box_options)  # fmt: skip
    return AsyncSnapshot(made) if isinstance(made, SnapshotRef) else AsyncBox.bound(made)


async def restore_moved_box_async(
    snapshot: AsyncSnapshot | str, *, box_id: str, name: str, labels: dict[str, str] | None = None,
    home: str | os.PathLike[str] | None = None,
) -> AsyncBox:  # fmt: skip
    """Start the box a snapshot was moved here for, under the id and name it had in its
    old home (a box migrated or recovered from another host is the same box): one box,
    processes running. The id must be free in this home."""
    rt = Runtime.for_home(home)
    core = core_for(rt)
    ref = snapshot.ref if isinstance(snapshot, AsyncSnapshot) else None
    rec = ref.record if isinstance(ref, LocalSnapshotRef) else await core.live.find_snapshot(str(snapshot))
    entries = await core.live.start_boxes(rec, 1, name=name, box_id=box_id, labels=dict(labels or {}))
    return AsyncBox.of(core, entries[0])


async def prune_snapshots_async(
    *, templates: bool = False, home: str | os.PathLike[str] | None = None
) -> list[AsyncSnapshot]:
    """Remove the snapshots no box needs: those of removed boxes (and imported ones)
    from which no box was started; ``templates``: named templates no box was started
    from too. Returns what was removed. (Removing a box keeps its snapshots.)"""
    backend = LocalBackend.for_home(home)
    pruned = await backend.core().live.prune_snapshots(templates=templates)
    return [AsyncSnapshot(LocalSnapshotRef(backend, r)) for r in pruned]


class OfSnapshot(Protocol):
    """A snapshot of either API (``AsyncSnapshot``, the sync ``Snapshot``), as ``set_pool``
    takes one: what it reads of it."""

    @property
    def ref(self) -> SnapshotRef: ...


async def set_pool_async(
    template: OfSnapshot | str, size: int, *, wait: bool = False,
    home: str | os.PathLike[str] | None = None,
) -> PoolInfo:  # fmt: skip
    """Keep ``size`` VMs of ``template`` restored, their first exec done, paused until
    ``Box(template=...)`` claims one (0: none, and its VMs go). Refused (InvalidArgument)
    past the pools' memory cap, ``$SANDLOT_POOL_MEMORY_MIB``. ``wait``: fill or drain
    before returning, else a process of its own does it in the background."""
    rt = Runtime.for_home(home)
    core = core_for(rt)
    ref = getattr(template, "ref", None)
    rec = await core.db.get_snapshot(template) if isinstance(template, str) else getattr(ref, "record", None)
    if not isinstance(rec, SnapshotRecord):
        raise InvalidArgument(f"set_pool takes a template or its name, not {template!r}")
    return await core.pools.set_size(rec, size, wait=wait)


async def pools_async(*, home: str | os.PathLike[str] | None = None) -> list[PoolInfo]:
    """Every template's warm pool: its size, the VMs ready and being made, their memory
    (guest RAM, and host PSS now) and the cap on all pools' memory."""
    return await core_for(Runtime.for_home(home)).pools.list()


async def keep_pools_filled_async(
    *, home: str | os.PathLike[str] | None = None, interval: float = 5.0
) -> None:
    """Top every warm pool of the home up, now and every ``interval`` seconds, until
    cancelled (what ``sandlot serve`` runs beside its routes)."""
    await core_for(Runtime.for_home(home)).pools.keep_filled(interval)
