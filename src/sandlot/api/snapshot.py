"""``Snapshot``: a box's running state, saved; start boxes from it, export it, remove it.

>>> snap = box.snapshot("before-migration")                      # doctest: +SKIP
>>> kids = snap.start(4)                 # four running copies, processes included
>>> box.rollback(snap)                   # the box itself, back in time
>>> snap.export("before-migration.sandlot")   # one file, for another machine
"""

from __future__ import annotations

import asyncio
import builtins
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import snapshots
from ..errors import InvalidArgument, SnapshotInUse
from ..runtime import Runtime
from ..store import SnapshotRecord
from . import _sync

if TYPE_CHECKING:
    from .box import AsyncBox, Box
    from .options import BoxSpec


def resolve_snapshot(
    rt: Runtime, snap: Any, *, box_id: str | None = None, kinds: tuple[str, ...] = ("snapshot", "template")
) -> SnapshotRecord:
    """A snapshot row from a Snapshot, an AsyncSnapshot, an id or a name."""
    if isinstance(snap, Snapshot):
        snap = snap.aio
    if isinstance(snap, AsyncSnapshot):
        found = rt.store.find_snapshot(snap.id)
        if found is None:
            from ..errors import SnapshotNotFound

            raise SnapshotNotFound(f"snapshot {snap.id} was removed")
        return found
    if not isinstance(snap, str):
        raise InvalidArgument(f"a snapshot, or its id or name, is needed, not {type(snap).__name__}")
    rec = rt.store.get_snapshot(snap, box_id=box_id)
    if rec.kind not in kinds:
        raise InvalidArgument(f"{snap!r} is a {rec.kind}, not a {' or '.join(kinds)}")
    return rec


def check_template_fits(snap: SnapshotRecord, spec: BoxSpec) -> None:
    """A box started from a saved state has the shape of that state."""
    facts = snap.options["vm"]
    if spec.memory_mib != facts["memory_mib"] or spec.cpus != facts["cpus"]:
        raise InvalidArgument(
            f"snapshot {snap.name or snap.id} is of a box with {facts['memory_mib']} MiB and "
            f"{facts['cpus']} CPU(s); a box started from it cannot have {spec.memory_mib} MiB and {spec.cpus}"
        )
    if spec.volumes:
        raise InvalidArgument("a box started from a snapshot cannot have volumes (their state is not saved)")
    saved_nic = bool(facts.get("network"))
    if spec.policy.has_nic != saved_nic:
        had = "a network card" if saved_nic else "no network card"
        hint = " (any other mode; 'allowlist' with no entries lets nothing out)" if saved_nic else ""
        raise InvalidArgument(
            f"snapshot {snap.name or snap.id} is of a box with {had}; a box started from it cannot have "
            f"network={spec.network!r}{hint}"
        )


class AsyncSnapshot:
    """A saved running state (async API): memory, devices and a frozen disk layer."""

    def __init__(self, runtime: Runtime, rec: SnapshotRecord) -> None:
        self.runtime = runtime
        self._rec = rec

    @classmethod
    def get(cls, key: str, *, home: str | os.PathLike[str] | None = None) -> AsyncSnapshot:
        """By id, id prefix or name (SnapshotNotFound if none)."""
        rt = Runtime.for_home(home)
        return cls(rt, rt.store.get_snapshot(key))

    @classmethod
    def list(
        cls, *, box: str | None = None, kind: str | None = None, home: str | os.PathLike[str] | None = None
    ) -> builtins.list[AsyncSnapshot]:
        """Snapshots and templates of this home, oldest first (``box``: of that box)."""
        rt = Runtime.for_home(home)
        box_id = rt.store.get(box).id if box else None
        recs = rt.store.snapshots(box_id=box_id, kind=kind)
        return [cls(rt, r) for r in recs if r.kind != "suspend"]

    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def name(self) -> str | None:
        return self._rec.name

    @property
    def kind(self) -> str:
        """ "snapshot" or "template"."""
        return self._rec.kind

    @property
    def box_name(self) -> str | None:
        return self._rec.box_name

    @property
    def created_at(self) -> float:
        return self._rec.created_at

    @property
    def size(self) -> int:
        """Bytes of saved state on disk (the frozen disk layer aside)."""
        return self._rec.size

    @property
    def record(self) -> SnapshotRecord:
        return self._rec

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Snapshot {self.id}{label} of {self.box_name}>"

    def inspect(self) -> dict[str, Any]:
        d = self._rec.to_json()
        d["children"] = [b.name for b in self.runtime.store.children(self.id)]
        d["path"] = str(snapshots.snapshot_dir(self.runtime.home, self.id))
        return d

    async def start(
        self, n: int = 1, *, name: str | None = None, _as_prefix: bool = False, **options: Any
    ) -> builtins.list[AsyncBox]:
        """Start ``n`` boxes from this state, processes running. They share unchanged
        memory copy-on-write and each has its own disk layer, hostname, machine-id,
        RNG state and wall clock. ``name``: the box's name if ``n`` is 1, else the
        prefix of their names; ``options``: env, labels, workdir, user,
        idle_timeout and the like for each."""
        from .box import AsyncBox

        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise InvalidArgument(f"n must be a whole number in 1..256, not {n!r}")
        rec = self.runtime.store.find_snapshot(self.id)
        if rec is None:
            from ..errors import SnapshotNotFound

            raise SnapshotNotFound(f"snapshot {self.id} was removed")
        if n > 1:  # one load of the whole stream, then copy-on-write for everyone
            await snapshots.materialize(self.runtime, rec)
        prefix = name or rec.box_name or "box"
        exact = name is not None and n == 1 and not _as_prefix
        kids = [
            AsyncBox(template=self, name=name if exact else f"{prefix}-{os.urandom(3).hex()}",
                     home=self.runtime.home, keep=True, **options)
            for _ in range(n)
        ]  # fmt: skip

        async def start(kid: AsyncBox) -> None:
            await kid._create(ephemeral=True)  # until all are up: a crash takes every one away
            await kid.start()

        results = await asyncio.gather(*(start(k) for k in kids), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # all or none
            await asyncio.gather(*(k.remove(force=True) for k in kids), return_exceptions=True)
            raise failed[0]
        for k in kids:
            self.runtime.store.update(k.id, ephemeral=False)
        return kids

    async def export(self, path: str | os.PathLike[str]) -> Path:
        """Write this snapshot to one file (zstd tar) that ``sandlot.import_snapshot``
        starts elsewhere. Written under a temporary name and renamed when complete."""
        from .. import archive

        rec = self.runtime.store.find_snapshot(self.id)
        if rec is None:
            from ..errors import SnapshotNotFound

            raise SnapshotNotFound(f"snapshot {self.id} was removed")
        await snapshots.materialize(self.runtime, rec)
        rec = self.runtime.store.find_snapshot(self.id) or rec
        return await asyncio.to_thread(archive.export_snapshot, self.runtime, rec, Path(path))

    async def remove(self) -> None:
        """Delete the snapshot; refused (SnapshotInUse) while boxes started from it exist."""
        rt = self.runtime
        kids = rt.store.children(self.id)
        if kids:
            names = ", ".join(b.name for b in kids[:5]) + (" ..." if len(kids) > 5 else "")
            raise SnapshotInUse(
                f"snapshot {self.name or self.id} has {len(kids)} box(es) started from it: {names}"
            )
        rt.store.delete_snapshot(self.id)
        snapshots.remove_files(rt.home, self.id)
        await asyncio.to_thread(snapshots.gc_layers, rt, min_age=snapshots.ORPHAN_AGE)


class Snapshot:
    """A saved running state (sync API); see :class:`AsyncSnapshot`."""

    def __init__(self, a: AsyncSnapshot) -> None:
        self._a = a

    @classmethod
    def get(cls, key: str, *, home: str | os.PathLike[str] | None = None) -> Snapshot:
        return cls(AsyncSnapshot.get(key, home=home))

    @classmethod
    def list(
        cls, *, box: str | None = None, kind: str | None = None, home: str | os.PathLike[str] | None = None
    ) -> builtins.list[Snapshot]:
        return [cls(a) for a in AsyncSnapshot.list(box=box, kind=kind, home=home)]

    @property
    def aio(self) -> AsyncSnapshot:
        return self._a

    @property
    def id(self) -> str:
        return self._a.id

    @property
    def name(self) -> str | None:
        return self._a.name

    @property
    def kind(self) -> str:
        return self._a.kind

    @property
    def box_name(self) -> str | None:
        return self._a.box_name

    @property
    def created_at(self) -> float:
        return self._a.created_at

    @property
    def size(self) -> int:
        return self._a.size

    def __repr__(self) -> str:
        return repr(self._a)

    def inspect(self) -> dict[str, Any]:
        return self._a.inspect()

    def start(self, n: int = 1, *, name: str | None = None, **options: Any) -> builtins.list[Box]:
        from .box import Box

        return [Box._wrap(a) for a in _sync.run(self._a.start(n, name=name, **options))]

    def export(self, path: str | os.PathLike[str]) -> Path:
        return _sync.run(self._a.export(path))

    def remove(self) -> None:
        _sync.run(self._a.remove())
