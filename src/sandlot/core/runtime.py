"""The runtime: one ``$SANDLOT_HOME`` and what every box there shares.

It owns the layout of the home, the state store, the image manager and the
engines, and the few blocking helpers recovery needs (removing a box's files,
sweeping a crash's leftovers). Nothing here is per box, and nothing here runs
on an event loop: async code reaches the store through ``Runtime.db``.

>>> import sandlot
>>> rt = sandlot.Runtime()            # $SANDLOT_HOME or ~/.local/share/sandlot
>>> rt.home.name
'sandlot'
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import clusterauth, hostsetup, ksm
from ..config import home_path, runtime_dir
from ..engine import engine_for, names
from ..engine.auto import EngineChoice
from ..engine.auto import choose as choose_engine
from ..engine.auto import requested as requested_engine
from ..engine.base import Boot, BootRequest, Engine, Placement
from ..errors import HostSetupError, InvalidArgument
from . import exports, layers, snapshots
from .boxrecord import store_path
from .events import Draft
from .store import AsyncStore, BoxRecord, BoxStore

if TYPE_CHECKING:
    from ..images.manager import ImageManager

AGENT_PORTS = 8  # agent connections a box takes at once (one per process; see core.sessions)
BOXES = "boxes"


class Runtime:
    """Shared state of one sandlot home. Cheap to create; work happens on first use."""

    _instances: dict[Path, Runtime] = {}
    _instances_lock = threading.Lock()

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = home_path(home)
        self._lock = threading.Lock()
        self._store: BoxStore | None = None
        self._db: AsyncStore | None = None
        self._images: ImageManager | None = None
        self._images_lock = threading.Lock()
        self._engines: dict[str, Engine] = {}
        self._auto: EngineChoice | None = None
        self._auto_lock = threading.Lock()  # a probe may take seconds: one at a time, not under _lock
        # this process is the heir of agent sessions its predecessors left (core.sessions)
        self.takes_over_sessions: str | None = None  # the heir's name (None: no heir)

    @property
    def images(self) -> ImageManager:
        """The home's images, loaded on first use: a command on existing boxes needs
        none of the image code (archives, layers, registries)."""
        with self._images_lock:
            if self._images is None:
                from ..images.manager import ImageManager

                self._images = ImageManager(self.home)
            return self._images

    @classmethod
    def for_home(cls, home: str | os.PathLike[str] | None = None) -> Runtime:
        """The shared runtime of a home (one per process)."""
        key = home_path(home)
        with cls._instances_lock:
            rt = cls._instances.get(key)
            if rt is None:
                rt = cls._instances[key] = cls(key)
            return rt

    # -- layout -----------------------------------------------------------------------------

    @property
    def boxes_dir(self) -> Path:
        return self.home / BOXES

    @staticmethod
    def box_of(box_dir: Path) -> tuple[Path, str] | None:
        """The home and the box id whose directory ``box_dir`` is (``box_dir``, read
        backwards); None where it is no box's."""
        if box_dir.parent.name != BOXES or not box_dir.name:
            return None
        return box_dir.parent.parent, box_dir.name

    @property
    def bases_dir(self) -> Path:
        return self.home / "bases"

    def box_dir(self, box_id: str) -> Path:
        return self.boxes_dir / box_id

    def run_dir(self, box_id: str) -> Path:
        return runtime_dir() / box_id

    def placement(self, rec: BoxRecord, hostname: str, agent_ports: int = AGENT_PORTS) -> Placement:
        return Placement(rec.id, hostname, self.box_dir(rec.id), self.run_dir(rec.id), agent_ports)

    # -- the store and the engines ----------------------------------------------------------

    @property
    def store(self) -> BoxStore:
        """The box registry (``sandlot.db``), opened on first use (sweeping a crash's leftovers)."""
        with self._lock:
            if self._store is not None:
                return self._store
            store = BoxStore(store_path(self.home))
            self._sweep_orphan_dirs(store)
            with contextlib.suppress(OSError):
                snapshots.sweep(self.home, store)
            exports.sweep(self.home)
            self._store = store
            return store

    @property
    def db(self) -> AsyncStore:
        """The store for async code (each call on the store's own thread, where it is opened)."""
        with self._lock:
            if self._db is None:
                self._db = AsyncStore(lambda: self.store, self.home)
            return self._db

    def engine(self, name: str = "qemu") -> Engine:
        with self._lock:
            engine = self._engines.get(name)
            if engine is None:
                engine = self._engines[name] = engine_for(name, self.home)
            return engine

    def auto_engine(self) -> EngineChoice:
        """What ``engine="auto"`` gives a box here, and why (probed once per process;
        the probes themselves are cached per host boot)."""
        with self._auto_lock:
            if self._auto is None:
                self._auto = choose_engine(self.home)
            return self._auto

    def prepare(self, request: BootRequest | None = None, *, engine: str = "qemu") -> Boot:
        """Resolve what a boot needs (kernel, agent, initramfs, accelerator), fetching
        or building it on first use. Blocking; worth calling once before timing boots."""
        return self.engine(engine).prepare(request or BootRequest())

    # -- what recovery and removal share ------------------------------------------------

    def discard_box(self, rec: BoxRecord, event: Draft | None = None) -> None:
        """Delete a box's files, then its row (a crash in between is swept; ``event`` says
        who removed it, and why), then the disk layers and saved states only it used.
        Its VM must be gone."""
        store = self.store
        # what a VM that died (a crashed box) left on the host: a gVisor sandbox's state and
        # its root mount, which would otherwise outlive the box (found leaked by the tests)
        with contextlib.suppress(Exception):
            self.engine(rec.engine).forget(self.placement(rec, rec.name))
        shutil.rmtree(self.box_dir(rec.id), ignore_errors=True)
        with contextlib.suppress(HostSetupError):
            shutil.rmtree(self.run_dir(rec.id), ignore_errors=True)
        # on a full disk too: what frees room must work there (the row and its event are
        # written in the room the store keeps, should the filesystem have none)
        store.in_room(BoxStore.delete, rec.id, event=event)
        if rec.suspended:
            snapshots.drop(self.home, store, rec.suspended)
        # its recorded steps' checkpoints go with it, but for those boxes were started from
        for step in store.snapshots(box_id=rec.id, kind="step"):
            if not store.children(step.id):
                snapshots.drop(self.home, store, step.id)
        if rec.origin:  # a fork's own snapshot goes with the last of its children, as does
            origin = store.find_snapshot(rec.origin)  # a step's whose box is gone
            ownerless = (
                origin is not None
                and origin.kind == "step"
                and (origin.box_id is None or store.find(origin.box_id) is None)
            )
            goes = origin is not None and (origin.options.get("auto") or ownerless)
            if origin is not None and goes and not store.children(origin.id):
                snapshots.drop(self.home, store, origin.id)
        # its whole chain: the layers under its top that only it used go too (one a failed
        # snapshot froze under it, say), while those another box or a snapshot reaches stay
        # (a volume's head it handed on is kept: the volume names it)
        layers.gc(self.home, store, also=layers.chains(layers.box_tops(rec)))

    def _sweep_orphan_dirs(self, store: BoxStore) -> None:
        """Box directories without a row are leftovers (rows are written first and
        deleted last), once they are a minute old."""
        if not self.boxes_dir.is_dir():
            return
        known = {rec.id for rec in store.list()}
        now = time.time()
        for d in self.boxes_dir.iterdir():
            with contextlib.suppress(OSError):
                if d.is_dir() and d.name not in known and now - d.stat().st_mtime > 60:
                    shutil.rmtree(d, ignore_errors=True)
                    shutil.rmtree(runtime_dir() / d.name, ignore_errors=True)

    # -- facts ------------------------------------------------------------------------------

    def doctor(self) -> dict[str, Any]:
        """Facts about this host for ``sandlot doctor``; never raises for a missing part."""
        report: dict[str, Any] = {"home": str(self.home)}
        report.update(self.engine("qemu").doctor())
        report["engines"] = list(names())
        try:
            auto = self.auto_engine()
            report["auto"] = {"engine": auto.name, "why": auto.reason}
        except Exception as exc:  # a probe that cannot even run: say so, never raise
            report["auto"] = {"engine": None, "why": f"{type(exc).__name__}: {exc}"}
        try:  # what a box that names no engine gets: $SANDLOT_ENGINE, else qemu
            report["default_engine"] = requested_engine(None)
        except InvalidArgument as exc:
            report["default_engine"] = None
            report["error"] = str(exc)
        for other in names():
            if other != "qemu":
                try:
                    report[other] = self.engine(other).doctor()
                except Exception as exc:  # a registered engine that cannot even say: report it
                    report[other] = {"engine": other, "usable": False, "why": f"{type(exc).__name__}: {exc}"}
        absent = hostsetup.missing(optional=True)  # what `sandlot setup` would install
        report["ksm"] = ksm.status()
        report["host_packages"] = {
            "missing": [p.name for p in absent if p.required],
            "optional_missing": [p.name for p in absent if not p.required],
        }
        self.home.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.home)
        report["disk_free_gib"] = round(usage.free / (1 << 30), 1)
        report["runtime_dir"] = str(runtime_dir())
        report["storage"] = self.storage_doctor()
        # a fleet node's: whether its cluster authenticates, and this user's token (no Ray imported)
        report["fleet"] = clusterauth.report(self.home)
        return report

    def storage_doctor(self) -> dict[str, Any]:
        """Where saved state goes: the chunk store, and the storage tier (and whether it
        answers) where one is configured."""
        from . import chunks, lazymem, tier

        why_not = lazymem.unavailable()
        out: dict[str, Any] = {
            "chunks": str(self.home / "chunks"),
            "format": "chunks" if chunks.enabled() else "files",
            # a state whose memory is in the tier resumes as its memory is read (or whole)
            "lazy_restore": {"available": why_not is None, "why_not": why_not},
        }
        try:
            config = tier.configured(self.home)
        except InvalidArgument as exc:
            out["tier"] = {"url": None, "reachable": False, "why": str(exc)}
            return out
        out["tier"] = tier.Tier(config).check() if config is not None else None
        return out
