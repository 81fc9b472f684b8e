"""Warm pools: VMs restored from a template ahead of time, paused until a box claims one.

``Box(template=T)`` restores T's saved state into a new QEMU process, whose guest
then runs its first HELLO and first exec through kernel paths that process has
never translated (under TCG, ~250 ms of CPU). A pool keeps ``size`` VMs that
have done all of that already, paused. A claim is then a compare-and-swap on
the row, a QMP ``cont`` and a HELLO that re-identifies the guest (RNG reseed,
wall clock, hostname, machine-id), and the box answers.

Pool VMs are rows in the store like boxes, marked with ``options["pool"]`` (the
template's id), hidden from listings:

* filling: ``create`` and ``start`` of an ordinary box from the template, a first
  exec, then ``Op.POOL`` (the VM paused): state ``pooled``;
* a claim: ``Op.CLAIM``, whose start is one compare-and-swap from ``pooled`` that
  also writes the box's name, labels, spec and a new machine-id, so two claimers
  (threads, loops, processes) never take the same VM; the guest then resumes and
  says HELLO; the row ends ``running`` without the mark;
* recovery (``core.recovery``): a marked row whose filler or claimer died before
  it was done is discarded (its VM killed), and so is a ready one whose VM exited;
* a removed home: its watcher (``core.homewatch``) ends its VMs, pool VMs and all.

The size of a template's pool is in its row (``options["pool"]``); whoever
claims starts a detached refiller (``python -m sandlot.core.refill HOME TEMPLATE``,
one per template at a time, a ``flock``), so neither the claimer waits nor a
claimer's exit leaves a VM half made; ``sandlot serve`` tops pools up itself.
The nominal memory of all pool VMs (guest RAM times VMs) is capped by
``SANDLOT_POOL_MEMORY_MIB`` (default: a quarter of the host's RAM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets as random_ids
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import flock_within, meminfo, spawn_unless_locked, try_flock
from ..crashpoints import crash_point
from ..errors import BoxBusy, BoxNotFound, InvalidArgument, InvalidState, SnapshotNotFound
from .controller import BoxController
from .entry import BoxEntry
from .launch import Launcher
from .requests import BoxRequest
from .runtime import Runtime
from .spec import BoxSpec
from .state import BoxState, Op
from .store import AsyncStore, BoxRecord, SnapshotRecord, holder_columns

log = logging.getLogger("sandlot")

# How long a filled pool VM runs after its filler's connection closes, before it pauses
DISCONNECT_SETTLE = 0.05

# What a claim may set anew on a pool VM: what the host applies per command, or the
# HELLO applies to the guest. Anything else (shape, network, ports, secrets) was fixed
# when the VM was restored, so a box that asks for another falls back to a plain restore.
CLAIMABLE = frozenset({
    "name", "env", "workdir", "user", "labels", "hostname", "request_timeout", "auto_remove",
    "idle_timeout", "boot_timeout", "pool", "auto_template", "rootfs_digest", "wake_on_traffic",
})  # fmt: skip
FILL_TIMEOUT = 300.0  # one filler at a time per template; a claimer never waits for it
MAX_POOL = 64
# ready VMs a claim reads at a time: claimers of other processes may take some first, and a
# claim that lost all of them reads the next ones
CLAIM_CANDIDATES = 4


def pool_size(snap: SnapshotRecord) -> int:
    size = snap.options.get("pool", 0)
    return size if isinstance(size, int) else 0


def memory_cap_mib() -> int:
    """The host-wide bound on pool VMs' memory (guest RAM, summed over every pool)."""
    env = os.environ.get("SANDLOT_POOL_MEMORY_MIB")
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise InvalidArgument(f"SANDLOT_POOL_MEMORY_MIB must be a number of MiB, not {env!r}") from None
    try:
        total = meminfo().get("MemTotal")
    except (OSError, ValueError):
        total = None
    return total // (1 << 20) // 4 if total else 1024


def fits(pool_vm: BoxSpec, wanted: BoxSpec) -> bool:
    """Whether a box of spec ``wanted`` may be a claimed pool VM of spec ``pool_vm``."""
    if wanted.secrets or wanted.volumes or wanted.mounts:
        return False
    a = {k: v for k, v in pool_vm.to_options().items() if k not in CLAIMABLE}
    b = {k: v for k, v in wanted.to_options().items() if k not in CLAIMABLE}
    return a == b


def pss_bytes(pid: int | None) -> int:
    """A process's proportional share of memory (pool VMs share their template's pages)."""
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def pool_lock(home: Path, template_id: str) -> Path:
    d = home / "pools"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{template_id}.lock"


def spawn_refill(home: Path, template_id: str) -> bool:
    """Start the template's refiller, a detached process, unless one runs (it holds the
    pool's lock). True if one was started. ``SANDLOT_POOL_REFILL=0`` starts none (pools
    are then topped up only by ``set_pool(wait=True)`` and ``sandlot serve``)."""
    if os.environ.get("SANDLOT_POOL_REFILL", "1") == "0":
        return False
    return spawn_unless_locked(pool_lock(home, template_id), "sandlot.core.refill", str(home), template_id)


def refill_quietly(home: Path, template_id: str) -> None:
    """``spawn_refill``, where a failure to start one only delays the refill to the next claim."""
    try:
        spawn_refill(home, template_id)
    except OSError as exc:
        log.warning("could not start the refiller of pool %s: %s", template_id, exc)


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """One template's pool as it is now."""

    template_id: str
    template: str  # its name (or id)
    size: int  # the VMs it keeps
    ready: int  # paused, waiting for a claim
    filling: int  # being made now
    memory_mib: int  # guest RAM of each VM
    pss_bytes: int  # what its ready VMs take of the host's memory now
    cap_mib: int  # the host-wide cap on all pools' guest RAM

    def to_json(self) -> dict[str, Any]:
        return {
            "template_id": self.template_id, "template": self.template, "size": self.size,
            "ready": self.ready, "filling": self.filling, "memory_mib": self.memory_mib,
            "nominal_mib": self.memory_mib * (self.ready + self.filling),
            "pss_mib": round(self.pss_bytes / (1 << 20), 1), "cap_mib": self.cap_mib,
        }  # fmt: skip


class Pools:
    """The warm pools of a home, for one event loop: claims, fills and drains."""

    def __init__(self, runtime: Runtime, controller: BoxController, launcher: Launcher) -> None:
        self.rt = runtime
        self.controller = controller
        self.launcher = launcher
        self._claiming: set[str] = set()  # pool VMs a task of this loop is claiming

    @property
    def db(self) -> AsyncStore:
        return self.rt.db

    # -- claiming --------------------------------------------------------------------------

    async def template_of(self, req: BoxRequest) -> tuple[SnapshotRecord, list[BoxRecord]] | None:
        """The template ``req`` starts from and its pool's ready VMs (oldest first), if it
        has a pool: read together, one store round trip of the claim's."""
        t = req.template
        if not isinstance(t, SnapshotRecord | str):
            return None
        try:
            snap, ready = await self.db.template_pool(
                t.id if isinstance(t, SnapshotRecord) else t,
                by_id=isinstance(t, SnapshotRecord),
                skip=sorted(self._claiming),
                limit=CLAIM_CANDIDATES,
            )
        except (SnapshotNotFound, InvalidArgument):
            return None  # the plain path reports it
        if snap is None or snap.kind != "template" or pool_size(snap) == 0:
            return None
        return snap, ready

    async def claim(self, req: BoxRequest, *, ephemeral: bool = False) -> BoxEntry | None:
        """A running box made of a ready VM of the pool of ``req``'s template, with
        ``req``'s identity; None if the template has no pool, the pool is empty, or the
        box asks for what a pool VM cannot become (then a plain restore makes it)."""
        found = await self.template_of(req)
        if found is None:
            return None
        snap, ready = found
        spec = req.spec_for(snap)  # checks the request against the template, as a restore would
        try:
            return await self._claim_one(snap, ready, req, spec, ephemeral)
        finally:
            # the pool lost a VM, or had none: a detached process makes up for it, started
            # from a worker thread so the claimer's first command does not wait for the fork
            # (measured here: 4 ms median, 80 ms at worst); a loop's end waits for that thread
            asyncio.get_running_loop().run_in_executor(None, refill_quietly, self.rt.home, snap.id)

    async def _claim_one(
        self, snap: SnapshotRecord, ready: list[BoxRecord], req: BoxRequest, spec: BoxSpec, ephemeral: bool
    ) -> BoxEntry | None:
        tried: set[str] = set()
        while ready:
            for rec in ready:
                tried.add(rec.id)
                if rec.id in self._claiming:
                    continue
                if not fits(BoxSpec.from_options(rec.options), spec):
                    return None  # every VM of a pool has the template's spec
                self._claiming.add(rec.id)
                try:
                    entry = await self._take(rec, snap, req, spec, ephemeral)
                finally:
                    self._claiming.discard(rec.id)
                if entry is not None:
                    return entry
            if len(ready) < CLAIM_CANDIDATES:
                return None  # that was the whole pool
            ready = await self.db.pooled(snap.id, skip=sorted(tried | self._claiming), limit=CLAIM_CANDIDATES)
        return None

    async def _take(
        self, rec: BoxRecord, snap: SnapshotRecord, req: BoxRequest, spec: BoxSpec, ephemeral: bool
    ) -> BoxEntry | None:
        """Claim one pool VM; None if another claimer took it first, or it failed (then it is removed)."""
        t0 = time.monotonic()
        claimed = spec.to_options()
        options = {**claimed, "pool": snap.id}  # marked until the claim is done
        identity: dict[str, Any] = {
            "name": req.name, "labels": dict(spec.labels), "options": options,
            "machine_id": random_ids.token_hex(16), "ephemeral": ephemeral,
            **holder_columns(ephemeral),
        }  # fmt: skip
        ctl = self.controller
        ctl.entries.pop(rec.id, None)
        entry = ctl.entry(replace(rec, **identity))  # the box it becomes: its name, hostname, spec
        won = False  # the compare-and-swap was ours: from then on the VM is this claimer's alone
        try:
            async with (
                entry.lock(timeout=0.05),
                # not fsynced: after a power loss the VM is gone whatever the row says, and
                # recovery removes a pool VM's row whose VM is gone, claimed or not
                ctl.transition(
                    entry, Op.CLAIM, op_data={"kind": "claim", "template": snap.id}, with_start=identity,
                    durable=False,
                ) as step,
            ):  # fmt: skip
                won = True
                step.failure_reason = "claiming a pool VM failed"
                crash_point("pool.claim-after-row")
                vm = self.launcher.vm_of(entry, entry.record)
                # its HELLO reseeds the guest's RNG and sets its clock, hostname and machine-id;
                # sent while QEMU's cont is under way, it waits in the socket for the guest
                hello = asyncio.ensure_future(entry.session.connection(vm, self.launcher.hello(entry)))
                try:
                    await vm.resume()
                    crash_point("pool.claim-after-resume")
                    await hello
                except BaseException:
                    hello.cancel()
                    with contextlib.suppress(BaseException):
                        await hello
                    raise
                step.changes = {"options": claimed, "started_at": time.time()}
        except Exception as exc:
            if not won:  # another claimer (or a drain) had it, or the name is taken: nothing changed
                ctl.forget(entry)
                if isinstance(exc, InvalidState | BoxBusy):
                    return None
                raise
            log.warning("a pool VM of %s could not be claimed (%s); restoring afresh", snap.name, exc)
            await self._discard(entry)
            return None
        except BaseException:  # cancelled mid-claim: the half-claimed VM goes, nobody has it
            if won:
                await asyncio.shield(self._discard(entry))
            else:
                ctl.forget(entry)
            raise
        entry.boot_seconds = time.monotonic() - t0
        ctl.watch_idle(entry)
        return entry

    async def _drain(self, rec: BoxRecord) -> None:
        """Remove a ready pool VM, unless a claimer took it meanwhile (then it is a box)."""
        ctl = self.controller
        known = ctl.entries.get(rec.id)
        if known is not None and not known.spec.pool:
            return  # claimed by a task of this loop: its entry is the box's
        entry = ctl.entry(rec)
        with contextlib.suppress(BoxBusy, BoxNotFound):
            async with entry.lock(timeout=30.0):
                now = await ctl.refresh(entry)
                if now.state == BoxState.POOLED and now.options.get("pool"):
                    await ctl.remove(entry, force=True)  # its own compare-and-swap expects pooled
                    return
        if ctl.entries.get(rec.id) is entry and known is None:
            ctl.entries.pop(rec.id, None)

    async def _discard(self, entry: BoxEntry) -> None:
        with contextlib.suppress(Exception):
            await self.controller.remove(entry, force=True)

    # -- filling and draining ------------------------------------------------------------

    async def fill_one(self, snap: SnapshotRecord) -> BoxRecord:
        """Restore one VM for ``snap``'s pool, run its first exec, pause it: ready."""
        req = BoxRequest.build(None, {"name": f"pool-{random_ids.token_hex(5)}"}, template=snap, keep=True)
        req.pool = snap.id
        ctl = self.controller
        entry = await ctl.create(req)
        try:
            await ctl.start(entry)
            crash_point("pool.fill-after-start")
            await ctl.first_exec(entry)
            async with entry.lock():
                rec = await ctl.refresh(entry)
                async with ctl.transition(entry, Op.POOL):
                    # a claimer connects afresh: its HELLO is the one that names the box.
                    # The guest sees this connection go before the VM pauses, not after its
                    # claim's cont: the port's event and the agent's end of the session
                    # were half of what a claim waited for (traced: 14.5 ms of guest time
                    # under TCG from cont to the HELLO's answer, 7 of it this)
                    await entry.session.close()
                    await asyncio.sleep(DISCONNECT_SETTLE)
                    await self.launcher.vm_of(entry, rec).pause()
        except BaseException:
            await asyncio.shield(self._discard(entry))
            raise
        ctl.forget(entry)  # this loop keeps no entry of a pool VM: a claim makes the box's own
        return entry.record

    async def rows(self, template_id: str | None = None) -> list[BoxRecord]:
        """The pool VMs (of one template), each made to agree with its processes first:
        half-made ones whose maker died, and ready ones whose VM exited, are removed."""
        out = []
        for rec in await self.db.list():
            pool = rec.options.get("pool")
            if not pool or (template_id is not None and pool != template_id):
                continue
            found = await self.controller.recover(rec)
            if found is not None:
                out.append(found)
        return out

    async def top_up(self, template_id: str) -> None:
        """Bring the template's pool to its size: fill what is missing, one VM at a time,
        within the memory cap; remove ready VMs beyond it. The caller holds its lock."""
        while True:
            snap = await self.db.find_snapshot(template_id)
            size = pool_size(snap) if snap is not None else 0
            mine = await self.rows(template_id)
            ready = [r for r in mine if r.state == BoxState.POOLED]
            coming = [r for r in mine if r.state not in (BoxState.POOLED, BoxState.CLAIMING)]
            extra = len(ready) + len(coming) - size
            if extra > 0:
                for rec in ready[:extra]:
                    await self._drain(rec)
                return
            if snap is None or extra == 0:
                return
            memory = int(snap.facts["memory_mib"])
            used = await self.nominal_mib()
            cap = memory_cap_mib()
            if used + memory > cap:
                log.warning(
                    "pool of %s stays at %d of %d VMs: the pools' memory cap is %d MiB "
                    "(SANDLOT_POOL_MEMORY_MIB), %d MiB in use",
                    snap.name or snap.id, len(ready), size, cap, used,
                )  # fmt: skip
                return
            await self.fill_one(snap)

    async def nominal_mib(self) -> int:
        """Guest RAM of every pool VM of the home (ready or being made)."""
        total = 0
        for rec in await self.rows():
            if rec.state != BoxState.CLAIMING:
                total += int(BoxSpec.from_options(rec.options).memory_mib)
        return total

    async def maintain(self, template_id: str, *, wait: float = FILL_TIMEOUT) -> None:
        """``top_up`` under the pool's lock (waiting up to ``wait`` for a refiller to finish)."""
        fd = await flock_within(pool_lock(self.rt.home, template_id), wait, "this pool")
        try:
            await self.top_up(template_id)
        finally:
            os.close(fd)

    async def set_size(self, snap: SnapshotRecord, size: int, *, wait: bool = False) -> PoolInfo:
        """Keep ``size`` VMs ready for the template ``snap`` (0: none, and its VMs go).
        Refused past the memory cap. ``wait``: fill or drain now, else in the background."""
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_POOL:
            raise InvalidArgument(f"a pool's size is a whole number from 0 to {MAX_POOL}, not {size!r}")
        if snap.kind != "template":
            raise InvalidArgument(f"{snap.name or snap.id} is a {snap.kind}: only templates have pools")
        found = await self.db.find_snapshot(snap.id)
        if found is None:
            raise SnapshotNotFound(f"template {snap.name or snap.id} was removed")
        memory = int(found.facts["memory_mib"])
        cap = memory_cap_mib()
        others = 0
        for t in await self.db.snapshots(kind="template"):
            if t.id != found.id:
                others += pool_size(t) * int(t.facts["memory_mib"])
        if others + size * memory > cap:
            raise InvalidArgument(
                f"a pool of {size} VMs of {memory} MiB for template {found.name or found.id} would take "
                f"the pools' memory to {others + size * memory} MiB, over the cap of {cap} MiB "
                f"(SANDLOT_POOL_MEMORY_MIB; other pools take {others} MiB): ask for at most "
                f"{max(0, (cap - others) // memory)}"
            )
        await self.db.update_snapshot(found.id, options={**found.options, "pool": size})
        if wait:
            await self.maintain(found.id)
        else:
            spawn_refill(self.rt.home, found.id)
        return await self.info(found.id)

    async def keep_filled(self, interval: float = 5.0) -> None:
        """Top every pool up now and every ``interval`` seconds, where no refiller is at
        work (``sandlot serve`` runs this for as long as it runs; cancelled mid-fill, the
        half-made VM is removed)."""
        while True:
            for snap in await self.db.snapshots(kind="template"):
                if not pool_size(snap):
                    continue
                fd = try_flock(pool_lock(self.rt.home, snap.id))
                if fd is None:
                    continue
                try:
                    await self.top_up(snap.id)
                except Exception as exc:  # one pool's trouble must not stop the others'
                    log.warning("refilling the pool of %s: %s", snap.name or snap.id, exc)
                finally:
                    os.close(fd)
            await asyncio.sleep(interval)

    async def drop(self, snap: SnapshotRecord) -> None:
        """Remove a template's pool (before the template goes)."""
        if pool_size(snap) or await self.rows(snap.id):
            await self.db.update_snapshot(snap.id, options={**snap.options, "pool": 0})
            await self.maintain(snap.id)

    async def info(self, template_id: str) -> PoolInfo:
        snap = await self.db.find_snapshot(template_id)
        if snap is None:
            raise SnapshotNotFound(f"template {template_id} was removed")
        mine = await self.rows(template_id)
        ready = [r for r in mine if r.state == BoxState.POOLED]
        pss = await asyncio.to_thread(lambda: sum(pss_bytes(r.vm_pid) for r in ready))
        return PoolInfo(
            template_id=snap.id, template=snap.name or snap.id, size=pool_size(snap), ready=len(ready),
            filling=sum(1 for r in mine if r.state not in (BoxState.POOLED, BoxState.CLAIMING)),
            memory_mib=int(snap.facts["memory_mib"]), pss_bytes=pss, cap_mib=memory_cap_mib(),
        )  # fmt: skip

    async def list(self) -> list[PoolInfo]:
        """Every template's pool that has a size or VMs."""
        out = []
        marked = {r.options.get("pool") for r in await self.rows()}
        for snap in await self.db.snapshots(kind="template"):
            if pool_size(snap) or snap.id in marked:
                out.append(await self.info(snap.id))
        return out
