"""The box controller: create, start, stop, kill, pause, remove, network, and the
one guarded transition every state change goes through.

``transition`` is the only place a box's state is written outside recovery. It
checks the operation against the declared table (``core.state``), records the
in-progress state with this process as its owner (so recovery can tell a live
operation from a dead one), and writes the end state, or the table's failure
state with the reason, when the operation's block ends. Its precondition, the
box's lock, is checked.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import secrets as random_ids
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import pids
from ..config import free_bytes
from ..crashpoints import crash_point
from ..engine.auto import AUTO
from ..engine.auto import DEFAULT as DEFAULT_ENGINE
from ..engine.base import VM
from ..errors import (
    BoxCrashed,
    BoxNotFound,
    ConnectionLost,
    GuestError,
    GuestOSError,
    InvalidArgument,
    InvalidState,
    SandlotError,
    SnapshotNotFound,
    no_space,
)
from ..net.policy import PROXIED, Policy, write_policy
from ..net.secrets import build_vault, read_vault_json, write_vault
from ..protocol.connection import AgentConnection
from ..protocol.exec import ExecRequest, RemoteProcess
from ..protocol.wire import ControlOp, Fields, Tag, tlv
from . import admission, awake, events, idle, layers, room, snapshots, tracing, volumes
from .boxrecord import listed
from .entry import BoxEntry
from .launch import Launcher, read_file
from .recovery import Recovery
from .requests import BoxRequest
from .runtime import Runtime
from .sessions import Session
from .state import LIVE, SERVING, TRANSITIONS, BoxState, Op, check, end_state, failure_state
from .store import AsyncStore, BoxRecord, SnapshotRecord, holder_columns
from .validate import positive

if TYPE_CHECKING:
    from ..images.store import Image
    from .spec import BoxSpec

GiB = 1 << 30
SAVES = frozenset({Op.SNAPSHOT, Op.SUSPEND})  # operations that write a saved state: room first


def require_room(home: Path, what: str, *, box: str | None = None) -> None:
    """NoSpace unless the home has ``SANDLOT_MIN_FREE_MIB`` (64) free: an operation that
    writes saved state or a disk does not begin on a nearly full home, so that the rows
    saying how it ended find room (the store keeps a reserve of its own for those,
    ``store.ROOM_FILE``, which a payload must not eat up first)."""
    need = room.min_free_bytes()
    where = home
    while not where.exists() and where != where.parent:  # a new home: where it will be made
        where = where.parent
    if free_bytes(where) < need:
        floor = f"sandlot keeps {need / (1 << 20):g} MiB free for it (SANDLOT_MIN_FREE_MIB)"
        raise no_space(home, f"{what}: {floor}", box=box)


CLOCKSOURCES = "/sys/devices/system/clocksource/clocksource0/available_clocksource"
BOOT_WORK_LIMIT = 3.0  # seconds; the TSC's calibration ends about 1.2 s after boot
# A box with VMs of its own has its commands frozen while its VM stands still for a save
# or a pause (``BoxController.still``); should no host thaw them (a VM restored from the
# state saved then, and not attached to), they run again after this much of the guest's
# time. It must outlast the moment between the freeze and the VM's stop on a loaded host
# (a new disk layer is made in between): a lease run out before the stop would let a
# nested guest run into the save, and the state would not load.
FREEZE_LEASE = 10.0
DETACH_RETRIES = (0.05, 0.1, 0.2, 0.4)  # seconds the commands run between tries to unmount the shares


@dataclass
class Step:
    """An operation under way: what it writes when it ends, and how a failure reads."""

    op: Op
    source: BoxState
    changes: dict[str, Any] = field(default_factory=dict)  # written with the end state
    on_failure: dict[str, Any] = field(default_factory=dict)  # written with the failure state
    failure_reason: str | None = None  # a failure records "<this>: <the error's first line>"
    gone: bool = False  # the box was deleted: nothing to write
    detail: dict[str, Any] = field(default_factory=dict)  # the end's event's detail (``core.events``)
    called_off: bool = False  # nothing to do after all: back where it began, and no event


FLUSH_LIMIT = 10.0  # seconds a box that writes volumes back has to flush them before a forced removal


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def end_events(op: Op, step: Step) -> list[events.Draft]:
    """What an operation's successful end tells of."""
    kind = events.OP_KINDS[op]
    if kind is None:
        return []
    detail = dict(step.detail)
    if op == Op.KILL:
        detail["killed"] = True
    elif op in (Op.DISCARD, Op.LOSE):
        detail["saved_state_discarded"] = True
    reason = step.changes.get("reason") if op == Op.LOSE else None  # why its state is gone
    done = [events.draft(kind, reason, **detail)]
    if op == Op.CLAIM:  # the box is new to its users: made from a warm pool's VM, and running
        done.insert(0, events.draft("created", **detail))
    return done


def failure_event(op: Op, fail: BoxState, exc: BaseException, reason: str | None) -> events.Draft:
    """What an operation's failure tells of: a crash (with the guest console's tail where
    the error has it), or an operation that failed and left the box as it was."""
    detail: dict[str, Any] = {"op": op.value, "error": type(exc).__name__}
    tail = getattr(exc, "console_tail", None)
    if tail:
        detail["console"] = str(tail)[-events.CONSOLE_TAIL :]
    kind = "crashed" if fail == BoxState.CRASHED else "failed"
    return events.draft(kind, reason or first_line(exc), **detail)


class SavedStates(Protocol):
    """What the controller asks of live state (``core.livestate``), which builds on
    the controller: a suspended box resumes, an image's first boot is saved as its
    automatic template and later boxes of the image start from it."""

    async def resume(self, entry: BoxEntry) -> None: ...

    async def drop_saved_state(self, snap_id: str) -> None: ...

    async def auto_template(self, entry: BoxEntry, image_digest: str) -> SnapshotRecord | None: ...

    async def save_auto_template(self, entry: BoxEntry) -> None: ...

    async def suspend(self, entry: BoxEntry, *, if_idle_for: float | None = None) -> None: ...


class BoxController:
    """The boxes of one event loop: their entries, and every operation but live state's."""

    saved: SavedStates  # set by the core once live state exists

    def __init__(self, runtime: Runtime, recovery: Recovery, launcher: Launcher) -> None:
        self.rt = runtime
        self.recovery = recovery
        self.launcher = launcher
        self.entries: dict[str, BoxEntry] = {}

    @property
    def db(self) -> AsyncStore:
        return self.rt.db

    # -- finding boxes ------------------------------------------------------------------------

    def entry(self, rec: BoxRecord) -> BoxEntry:
        """The entry of the box ``rec`` describes (made on first sight), brought up to date."""
        entry = self.entries.get(rec.id)
        if entry is None:
            entry = self.entries[rec.id] = BoxEntry(
                rec, self.rt.box_dir(rec.id), self.agent_lost, self.rt.takes_over_sessions
            )
        else:
            entry.update(rec)
        return entry

    def forget(self, entry: BoxEntry) -> None:
        entry.removed = True
        entry.session.drop()
        self.entries.pop(entry.id, None)

    async def recover(self, rec: BoxRecord) -> BoxRecord | None:
        """``rec`` made to agree with its processes (None: the box is gone)."""
        if not self.recovery.needed(rec):
            return rec
        return await asyncio.to_thread(self.recovery.apply, rec)

    async def find(self, key: str) -> BoxEntry:
        """The box with this id, name or id prefix (``BoxNotFound`` if none)."""
        rec = await self.recover(await self.db.get(key))
        if rec is None or rec.options.get("pool"):  # a warm pool's VM is no box (yet)
            raise BoxNotFound(f"no box {key!r}", box=key)
        return self.entry(rec)

    async def list(
        self,
        *,
        all: bool = True,
        state: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> builtins.list[BoxEntry]:
        out = []
        for rec in await self.db.list():
            found = await self.recover(rec)
            if found is not None and listed(found, include_stopped=all, state=state, labels=labels):
                out.append(self.entry(found))
        return out

    async def refresh(self, entry: BoxEntry) -> BoxRecord:
        """The box's row as it is now, recovered (``BoxNotFound`` once removed)."""
        stamp = self.db.stamp()
        # Not known while it is read: a command of this loop that came meanwhile would take
        # the entry's old state as current (``connection``'s quick path), a box another
        # process suspended as running, and send its request to a VM that is gone.
        entry.seen = None
        rec = await self.db.find(entry.id)
        rec = await self.recover(rec) if rec is not None else None
        if rec is None:
            self.forget(entry)
            raise BoxNotFound(f"box {entry.name} was removed", box=entry.name, state="removed")
        # a write (or read) of this loop's came in between: which row is newer is not known
        # here, so the next command reads it again
        entry.seen = stamp if entry.seen is None else None
        return entry.update(rec)

    # -- the one guarded transition ---------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transition(
        self,
        entry: BoxEntry,
        op: Op,
        *,
        op_data: dict[str, Any] | None = None,
        with_start: dict[str, Any] | None = None,
        durable: bool = True,
    ) -> AsyncIterator[Step]:
        """Run ``op`` on the box: check it against the table, record its in-progress
        state (and ``op_data``, what recovery needs to finish or undo it), then its end
        state, or its failure state if the block raises. Needs the box's lock.
        ``with_start``: columns written in the same compare-and-swap as the in-progress
        state (a pool claim's new identity: no two claimers can both write theirs).
        ``durable=False``: its writes are not fsynced (they survive any process's crash,
        not a power loss: for an operation whose VM a power loss ends anyway)."""
        entry.lock.require()
        with tracing.span(op.value, box=entry.id, name=entry.name):
            async with self._transition(entry, op, op_data, with_start, durable) as step:
                yield step

    @contextlib.asynccontextmanager
    async def _transition(
        self,
        entry: BoxEntry,
        op: Op,
        op_data: dict[str, Any] | None,
        with_start: dict[str, Any] | None,
        durable: bool,
    ) -> AsyncIterator[Step]:
        t = TRANSITIONS[op]
        source = entry.state
        if source not in t.sources:
            raise InvalidState.refused(op.value, source.value, [s.value for s in t.sources], box=entry.name)
        step = Step(op, source)
        writing = source
        if op in SAVES:
            require_room(self.rt.home, f"{op.value} of box {entry.name} was not begun", box=entry.name)
        if t.via is not None:
            owner, start = pids.me()
            rec = await self._write(
                entry,
                expect=(source,),
                state=t.via,
                owner_pid=owner,
                owner_start=start,
                op=op_data,
                reason=None,
                durable=durable,
                **(with_start or {}),
            )
            if rec is None:
                now = await self.refresh(entry)
                raise InvalidState.refused(op.value, now.state, [s.value for s in t.sources], box=entry.name)
            writing = t.via
        try:
            yield step
        except BaseException as exc:
            if not step.gone:
                fail = failure_state(op, source)
                changes = dict(step.on_failure)
                if step.failure_reason:
                    changes["reason"] = f"{step.failure_reason}: {first_line(exc)}"
                event = failure_event(op, fail, exc, changes.get("reason"))
                await self._write(entry, expect=(writing,), state=fail, op=None, event=event, **changes)
            raise
        if step.gone:
            return
        end = source if step.called_off else end_state(op, source)
        await self._write(
            entry,
            expect=(writing,),
            state=end,
            op=None,
            durable=durable,
            event=None if step.called_off else end_events(op, step),
            **({} if step.called_off else step.changes),
        )

    async def _write(self, entry: BoxEntry, **changes: Any) -> BoxRecord | None:
        """Update the box's row (``BoxStore.update``) and its entry: the row the update
        returns is current until the next commit, so the next command need not read it
        again (``connection``). None, and the entry as it was, if ``expect`` failed."""
        rec, stamp = await self.db.update_as_seen(entry.id, **changes)
        if rec is not None:
            entry.update(rec)
            entry.seen = stamp
        return rec

    # -- creation ---------------------------------------------------------------------------

    def _auto_engine_for(self, spec: BoxSpec) -> str:
        """``engine="auto"`` for this box: the host's choice (``Runtime.auto_engine``),
        unless that engine cannot run what the box asks for (volumes or a kernel of
        its own on gVisor): then QEMU, which runs every request. Blocking."""
        choice = self.rt.auto_engine().name
        if choice != DEFAULT_ENGINE:
            try:
                self.launcher.refuse(replace(spec, engine=choice))
            except InvalidArgument:
                return DEFAULT_ENGINE
        return choice

    async def create(self, req: BoxRequest, *, ephemeral: bool = False) -> BoxEntry:
        """Create the box ``req`` describes: image pulled, disk ready, state created."""
        with tracing.span("create", box=req.id, name=req.name):
            return await self._create(req, ephemeral)

    async def _create(self, req: BoxRequest, ephemeral: bool) -> BoxEntry:
        rt = self.rt
        snap = await self._saved_state(req)
        spec = req.spec_for(snap)
        if snap is None and spec.mounts:  # a shared volume's directory becomes one of its shares
            await asyncio.to_thread(volumes.resolve, rt.store, spec)
        if spec.engine == AUTO:  # the row records the engine the box got, never "auto"
            spec.engine = await asyncio.to_thread(self._auto_engine_for, spec)
        self.launcher.refuse(spec)  # before the row: a request the engine refuses leaves no box
        pid, start = pids.me()
        now = time.time()
        rec = BoxRecord(
            id=req.id, name=req.name, state=BoxState.CREATING, options=spec.to_options(), created_at=now,
            updated_at=now, image_ref=spec.image, rootfs=spec.rootfs, labels=dict(spec.labels),
            engine=spec.engine, owner_pid=pid, owner_start=start, ephemeral=ephemeral,
            **holder_columns(ephemeral),
            machine_id=random_ids.token_hex(16),
        )  # fmt: skip
        require_room(rt.home, f"box {req.name} could not be created")
        await self.db.insert(rec)  # reserves the name; a crash from here on is undone by recovery
        crash_point("create.after-row")
        entry = self.entry(rec)
        try:
            image: Image | None = None
            # an engine that saves no running state makes no automatic template
            live = rt.engine(spec.engine).live_state and auto_templates()
            plain = not spec.volumes and not spec.mounts  # an automatic template has no volumes
            if snap is None and req.template is None and plain and live:
                if spec.image:
                    image = await self._resolve_image(req, spec.image)
                else:  # a directory or tarball: its boots are as costly as an image's
                    from ..images.rootfs import rootfs_key  # imported where a box is made, as below

                    assert spec.rootfs is not None
                    spec.rootfs_digest = await asyncio.to_thread(rootfs_key, spec.rootfs)
                source = template_source(image.digest if image else None, spec.rootfs_digest)
                assert source is not None
                snap = await self.saved.auto_template(entry, source)
                if snap is None:
                    spec.auto_template = not spec.secrets  # its first boot becomes the template
                else:
                    spec = req.spec_for(snap)
            if snap is not None:
                done = await self._create_from(entry, req, spec, snap)
            else:
                done = await self._create_fresh(entry, req, spec, image)
        except BaseException as exc:
            rec = await self.db.find(req.id) or rec
            gone = events.draft(
                "removed", f"its creation failed: {first_line(exc)}", error=type(exc).__name__
            )
            await asyncio.to_thread(rt.discard_box, rec, gone)
            self.forget(entry)
            raise
        if done is None:
            self.forget(entry)
            raise BoxNotFound(f"box {req.name} was removed while it was being created", box=req.name)
        entry.update(done)
        return entry

    async def _saved_state(self, req: BoxRequest) -> SnapshotRecord | None:
        t = req.template
        if t is None or t is False or t is True:
            return None
        if isinstance(t, SnapshotRecord):
            found = await self.db.find_snapshot(t.id)
            if found is None:
                raise SnapshotNotFound(f"snapshot {t.id} was removed")
            return found
        found = await self.db.get_snapshot(t)
        if found.kind not in ("template", "snapshot"):
            raise InvalidArgument(f"{t!r} is a {found.kind}, not a template or snapshot")
        return found

    async def _resolve_image(self, req: BoxRequest, ref: str) -> Image:
        if req.image is not None:
            return req.image
        images = self.rt.images
        found = None if req.pull == "always" else await asyncio.to_thread(images.get, ref)
        if found is None:
            if req.pull == "never":
                raise InvalidArgument(f"image {ref!r} is not here and pull='never'")
            found = await images.pull(ref, **req.pull_options)
        req.image = found
        return found

    async def _create_fresh(
        self, entry: BoxEntry, req: BoxRequest, spec: Any, image: Image | None
    ) -> BoxRecord | None:
        # not at the top: commands on an existing box never make a disk, nor import what does
        from ..images.rootfs import base_for, create_overlay, rootfs_dir_for

        rt = self.rt
        digest = None
        as_dir = rt.engine(spec.engine).disk_format == "dir"  # an overlay's layer directory, not qcow2
        if spec.image is not None:
            image = image or await self._resolve_image(req, spec.image)
            digest = image.digest
            c = image.config
            spec.image_config = {"env": list(c.env), "workdir": c.workdir, "user": c.user,
                                 "entrypoint": list(c.entrypoint), "cmd": list(c.cmd)}  # fmt: skip
            ensure = rt.images.ensure_rootfs if as_dir else rt.images.ensure_base
            base = await asyncio.to_thread(ensure, image)
        else:
            assert spec.rootfs is not None
            make_base = rootfs_dir_for if as_dir else base_for
            # the tree as keyed at creation, so its template and base are of one tree
            base = await asyncio.to_thread(make_base, rt.bases_dir, spec.rootfs, spec.rootfs_digest)
        await asyncio.to_thread(self._box_dir, entry)
        await self._write_vault(entry, spec, req, None)
        if spec.mounts:  # made before they are named: the row's claim on a volume names whole files
            await self._record_drives(entry, volumes.tops_for, rt.home, rt.store, spec.mounts)
        disk = layers.new_path(rt.home, layers.DIR_SUFFIX if as_dir else ".qcow2")
        await self.db.update(entry.id, disk=str(disk))  # before the file: a crash leaves nothing unnamed
        crash_point("create.before-disk")
        if as_dir:
            await asyncio.to_thread(layers.make_dir_layer, disk, base)
        else:
            await asyncio.to_thread(create_overlay, base, disk, spec.disk_size_gb * GiB)
        result: BoxRecord | None = await self.db.update(
            entry.id, expect=(BoxState.CREATING,), state=BoxState.CREATED, image_digest=digest,
            options=spec.to_options(), event=events.draft("created", image=spec.image),
        )  # fmt: skip
        return result

    async def _create_from(
        self, entry: BoxEntry, req: BoxRequest, spec: Any, snap: SnapshotRecord
    ) -> BoxRecord | None:
        """The disk of a box started from a saved state: a new layer on the snapshot's."""
        rt = self.rt
        await asyncio.to_thread(self._box_dir, entry)
        if spec.secrets:
            source = await self.db.find(snap.box_id) if snap.box_id else None
            vault = await asyncio.to_thread(read_vault_json, rt.box_dir(source.id)) if source else None
            await self._write_vault(entry, spec, req, vault)
        if snap.options.get("drives"):
            await self._record_drives(entry, volumes.tops_from, rt.home, snap)
        disk = await asyncio.to_thread(layers.new_layer, rt.home, Path(snap.layer))
        made = events.draft("created", image=snap.options.get("image_ref"), snapshot=snap.id,
                            snapshot_name=snap.name, from_box=snap.box_name)  # fmt: skip
        result: BoxRecord | None = await self.db.update(
            entry.id, expect=(BoxState.CREATING,), state=BoxState.CREATED, disk=str(disk), origin=snap.id,
            image_digest=snap.options.get("image_digest"), options=spec.to_options(), event=made,
        )  # fmt: skip
        return result

    async def _record_drives(
        self, entry: BoxEntry, make: Callable[..., builtins.list[dict[str, Any]]], *args: Any
    ) -> None:
        """Make the tops of a new box's volumes (``make(*args)``), then name them in its row,
        which claims the volumes it writes back; refused (another box writes one), or not
        recorded, they go: no row names them."""
        drives = await asyncio.to_thread(make, *args)
        try:
            await self.db.update(entry.id, drives=drives)
        except BaseException:
            for d in drives:
                Path(d["top"]).unlink(missing_ok=True)
            raise

    def _box_dir(self, entry: BoxEntry) -> None:
        entry.dir.mkdir(parents=True, exist_ok=True)
        (entry.dir / "ports").mkdir(exist_ok=True)

    async def _write_vault(
        self, entry: BoxEntry, spec: Any, req: BoxRequest, source: dict[str, Any] | None
    ) -> None:
        """The box's secrets file, if it has secrets (``source``: that of the box its
        saved state was taken of). A CA is made (EC keys) and the file fsynced."""
        if spec.secrets:
            vault = await asyncio.to_thread(build_vault, entry.name, spec.secrets, req.secrets, source)
            await asyncio.to_thread(write_vault, entry.dir, vault)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, entry: BoxEntry) -> None:
        """Boot the box (or restore it, if it was made from a saved state) and wait for
        its agent. A running box is left as it is; the disk is kept across stop/start."""
        async with entry.lock():
            rec = await self.refresh(entry)
            if rec.state == BoxState.SUSPENDED:
                await self.saved.resume(entry)
                return
            if not check(Op.START, rec.state, box=entry.name):
                return
            origin = (
                await self.db.find_snapshot(rec.origin)
                if rec.state == BoxState.CREATED and rec.origin
                else None
            )
            async with (
                awake.room_for(self, self.saved, entry),  # its namespace's quota of awake boxes
                self.transition(entry, Op.START) as step,
            ):
                step.on_failure = {"vm_pid": None}
                step.changes = {"started_at": time.time()}
                if origin is not None:
                    step.failure_reason = "start failed"
                    await self.launcher.restore(entry, rec, origin, attach=True, trust=True)
                else:
                    step.failure_reason = "boot failed"
                    await self.launcher.boot(entry, rec)
            if origin is None and entry.spec.auto_template:
                await self.saved.save_auto_template(entry)
        self.watch_idle(entry)

    async def stop(self, entry: BoxEntry, timeout: float = 10.0) -> None:
        """Stop gracefully: every process gets SIGTERM, then SIGKILL after half of
        ``timeout``; the disk is synced and unmounted; the VM powers off. Forced once
        ``timeout`` has passed. The disk is kept."""
        positive("timeout", timeout)
        async with entry.lock():
            rec = await self.refresh(entry)
            if rec.state == BoxState.SUSPENDED:  # its saved processes end; the disk stays
                async with self.transition(entry, Op.DISCARD) as step:
                    step.changes = {"suspended": None, "stopped_at": time.time()}
                if rec.suspended:
                    await self.saved.drop_saved_state(rec.suspended)
                return
            if not check(Op.STOP, rec.state, box=entry.name):
                return
            async with self.transition(entry, Op.STOP) as step:
                step.changes = step.on_failure = {"stopped_at": time.time(), "vm_pid": None}
                vm = self.launcher.vm_of(entry, rec)
                try:
                    crash_point("stop.before-shutdown")
                    if step.source == BoxState.PAUSED:
                        with contextlib.suppress(Exception):
                            await vm.resume()
                    with contextlib.suppress(Exception):
                        grace_ms = int(max(0.5, timeout * 0.5) * 1000)
                        await asyncio.wait_for(self._shutdown_via_agent(entry, vm, grace_ms), timeout=timeout)
                    if not await vm.wait_exit(max(1.0, timeout * 0.3)):
                        await vm.kill(grace=2.0)
                finally:
                    if vm.running:
                        await vm.kill(grace=1.0)
                    entry.session.drop()
                    vm.cleanup()
        if entry.spec.auto_remove:
            await self.remove(entry)

    async def _shutdown_via_agent(self, entry: BoxEntry, vm: VM, grace_ms: int) -> None:
        conn = await entry.session.connection(vm, replace(self.launcher.hello(entry), request_timeout=5.0))
        # the agent's EOF that follows is this stop, not a crash: the box's open channels
        # (a watch, a stream) end as closed on purpose, whichever comes first, the EOF or
        # the drop of the session below
        conn.closing()
        await conn.control(ControlOp.SHUTDOWN, tlv(Tag.TIMEOUT_MS, grace_ms), timeout=grace_ms / 1000 + 10)
        await vm.wait_exit(5.0)

    async def restart(self, entry: BoxEntry, timeout: float = 10.0) -> None:
        await self.stop(entry, timeout)
        await self.start(entry)

    async def kill(self, entry: BoxEntry) -> None:
        """Stop at once, like pulling the plug (the disk's journal recovers on next boot)."""
        async with entry.lock():
            rec = await self.refresh(entry)
            if not check(Op.KILL, rec.state, box=entry.name):
                return
            async with self.transition(entry, Op.KILL) as step:
                step.changes = {"stopped_at": time.time(), "vm_pid": None, "reason": "killed"}
                vm = self.launcher.vm_of(entry, rec)
                await vm.kill(grace=1.0)  # an orderly exit of the VM process: no guest involvement
                entry.session.drop()
                vm.cleanup()
        if entry.spec.auto_remove:
            await self.remove(entry)

    async def pause(self, entry: BoxEntry) -> None:
        """Freeze the vCPUs; RAM and processes stay. Commands wait until unpause()."""
        async with entry.lock():
            rec = await self.refresh(entry)
            if not check(Op.PAUSE, rec.state, box=entry.name):
                return
            # a paused box may be saved (snapshot, suspend): one with VMs of its own
            # stands still with no vCPU inside them, one with shares has them down
            async with self.still(entry, for_save=False), self.transition(entry, Op.PAUSE):
                await self.launcher.vm_of(entry, rec).pause()

    async def unpause(self, entry: BoxEntry) -> None:
        async with entry.lock():
            rec = await self.refresh(entry)
            if not check(Op.UNPAUSE, rec.state, box=entry.name):
                return
            async with self.transition(entry, Op.UNPAUSE):
                await self.launcher.vm_of(entry, rec).resume()
        # the guest clock stood still while paused: set it to now
        with contextlib.suppress(Exception):
            conn = await self.connection(entry)
            await conn.set_clock()
            if self.launcher.frozen_for_saves(entry):
                await conn.thaw()

    @contextlib.asynccontextmanager
    async def still(self, entry: BoxEntry, *, for_save: bool = True) -> AsyncIterator[None]:
        """Around a step that stops a running box's VM (a save, a pause): a box with VMs of
        its own has its commands frozen for it, since QEMU cannot load a state saved while
        a vCPU runs a nested guest, and a frozen task has left ``KVM_RUN``. So has a box
        with shares, which the agent then unmounts: QEMU saves no VM with a 9p share
        mounted. They are thawed after it if the box runs on, and the agent mounts the
        shares first (a VM restored from the state saved then is thawed by
        ``Launcher.restore``, or by the freeze's lease). Any other box needs nothing.
        A share that cannot come down (files open under it) refuses a save, naming the
        processes; a pause (not ``for_save``) then goes on with it up."""
        conn = None
        # what a pause of a box with shares (and no VMs of its own) does not need: it goes
        # on with them up if they cannot come down, and a save of it then says so
        optional = not for_save and not entry.spec.nested_virt
        if self.launcher.frozen_for_saves(entry) and entry.state == BoxState.RUNNING:
            conn = await self.connection(entry)
            try:
                await conn.freeze(FREEZE_LEASE)
            except GuestOSError:
                if not optional:
                    raise
                conn = None
        if conn is not None and entry.spec.volumes and not self.rt.engine(entry.spec.engine).mounts_shares:
            try:
                await self._detach_shares(conn)
            except GuestOSError as exc:  # a share stays busy: the agent put every one back up
                await conn.thaw()
                conn = None
                if not optional:
                    raise InvalidState(
                        f"box {entry.name} cannot be saved now: {exc.message}. A host directory is "
                        "unmounted for the length of a save; close what is open under it and try again",
                        box=entry.name,
                        state=entry.state,
                    ) from None
        try:
            yield
        finally:
            if conn is not None and entry.state == BoxState.RUNNING:  # not paused, suspended, gone
                with contextlib.suppress(SandlotError, OSError):
                    # asked for again: a save that outlasted the idle release let the session go
                    await (await self.connection(entry)).thaw()

    @staticmethod
    async def _detach_shares(conn: AgentConnection) -> None:
        """Have the agent unmount the shares of a frozen box. A command caught with a file
        open under one (a ``cat`` that was reading it) is let run a moment and the box
        frozen again: a few tries, about a second in all, before the error stands."""
        for wait in DETACH_RETRIES:
            try:
                await conn.control(ControlOp.DETACH)
                return
            except GuestOSError:
                await conn.thaw()
                await asyncio.sleep(wait)
                await conn.freeze(FREEZE_LEASE)
        await conn.control(ControlOp.DETACH)

    async def remove(self, entry: BoxEntry, *, force: bool = False) -> None:
        """Delete the box: its disk, logs and record. A running box needs ``force``
        (it is killed first). Removing a removed box does nothing."""
        try:
            async with entry.lock():
                try:
                    rec = await self.refresh(entry)
                except BoxNotFound:
                    return
                state = BoxState(rec.state)
                if state in LIVE and not force:
                    raise InvalidState(
                        f"box {entry.name} is {state}: stop it first, or remove(force=True)",
                        box=entry.name, state=state, allowed=["created", "stopped", "crashed", "suspended"],
                    )  # fmt: skip
                async with self.transition(entry, Op.REMOVE) as step:
                    engine = self.rt.engine(rec.engine)
                    if engine.alive(rec.vm, rec.id):
                        vm = self.launcher.vm_of(entry, rec)
                        if any(d.get("holds") for d in rec.drives) and state in LIVE:
                            await self._flush_volumes(entry, vm, paused=state == BoxState.PAUSED)
                        await vm.kill(grace=1.0)
                    entry.session.drop()
                    current = await self.db.find(entry.id) or rec
                    removed = events.draft("removed", was=state.value)
                    await asyncio.to_thread(self.rt.discard_box, current, removed)
                    step.gone = True
        except FileNotFoundError:  # the box's directory went while we waited for its lock
            await self.db.delete(entry.id, event=events.draft("removed"))
        self.forget(entry)

    async def _flush_volumes(self, entry: BoxEntry, vm: VM, *, paused: bool) -> None:
        """Before a running box that writes volumes back is killed: the guest writes what
        its page cache holds (``sync``), so the volumes get what was written, as after a
        stop. Best effort, within ``FLUSH_LIMIT``: a guest that cannot answer loses what
        it had not written, as a crash would."""
        with contextlib.suppress(Exception):
            if paused:
                await vm.resume()
            conn = await entry.session.connection(vm, self.launcher.hello(entry))
            await conn.control(ControlOp.SYNC, timeout=FLUSH_LIMIT)

    async def set_network(
        self, entry: BoxEntry, network: str | bool | None = None, *, allow: Sequence[str] | str | None = None
    ) -> None:
        """Change the egress policy: ``network`` (the mode; unchanged if None) and
        ``allow`` (replaces the list; unchanged if None). Between 'public' and
        'allowlist', and for ``allow``, a running box applies it to its next
        connection. Adding or removing the network card, or going to or from
        'open', needs the VM to boot again: stop() the box first."""
        async with entry.lock():
            rec = await self.refresh(entry)
            spec = entry.spec
            mode = spec.network if network is None else network
            if allow is None:  # kept, where the new mode has a use for it
                allow = (list(spec.allow) or None) if mode in PROXIED else None
            new = Policy.build(mode, allow)
            old = spec.policy
            live = BoxState(rec.state) in LIVE or rec.state == BoxState.SUSPENDED
            if live and (new.has_nic != old.has_nic or (new.mode == "open") != (old.mode == "open")):
                raise InvalidState(
                    f"box {entry.name} is {rec.state}: going from network={old.mode!r} to {new.mode!r} "
                    "changes its network card; stop() it first",
                    box=entry.name, state=rec.state, allowed=["created", "stopped", "crashed"],
                )  # fmt: skip
            if spec.ports and not new.has_nic and not spec.wake_on_traffic:
                raise InvalidArgument(f"box {entry.name} publishes ports: it needs a network card")
            if spec.secrets and not new.proxied:
                raise InvalidArgument(
                    f"box {entry.name} has secrets: they need network='allowlist' or 'public'"
                )
            async with self.transition(entry, Op.NETWORK) as step:
                spec.network, spec.allow = new.mode, [str(r) for r in new.allow]
                if new.proxied:
                    await asyncio.to_thread(write_policy, entry.dir / "egress-policy.json", spec.policy)
                step.changes = {"options": spec.to_options()}

    # -- serving commands ------------------------------------------------------------------

    async def connection(self, entry: BoxEntry) -> AgentConnection:
        """This process's session with the box's agent, made on first use; a suspended
        box is resumed first (transparently: an idle box was put to sleep)."""
        if entry.removed:
            raise BoxNotFound(f"box {entry.name} was removed", box=entry.name, state="removed")
        if room.marked(entry.dir):
            await self._held_for_room(entry)
        session = entry.session
        stamp = self.db.stamp()
        if stamp is not None and stamp == entry.seen and session.healthy and entry.state in SERVING:
            # nothing was committed since the row was read or written (and a VM that died
            # would have ended the connection): the running box is as we know it
            assert session.conn is not None
            await session.conn.wait_ready()
            return session.conn
        rec = await self.refresh(entry)  # another process may have paused, stopped or suspended it
        if rec.state in (BoxState.SUSPENDED, BoxState.SUSPENDING, BoxState.RESUMING):
            try:
                with admission.waiting_at_most(admission.wake_wait()):
                    await self.saved.resume(entry)
            except SandlotError as exc:  # the caller asked for the box, not for its wake
                exc.while_waking()
                raise
            rec = entry.record
        if rec.state not in SERVING:
            raise InvalidState.refused("run commands", rec.state, ["running"], box=entry.name)
        conn = session.conn
        if conn is not None and conn.failed is None:
            # a connection reconnecting to the VM that took over (agent_lost: a box another
            # process resumed or rolled back) is let finish, rather than dropped mid-way for
            # a new one, which would end it and its channels as on a crash
            with contextlib.suppress(Exception):
                await conn.wait_ready()
        if conn is not None and conn.failed is not None:
            session.drop()
            raise conn.failed
        vm = self.launcher.vm_of(entry, rec)
        return await session.connection(vm, self.launcher.hello(entry))

    async def _held_for_room(self, entry: BoxEntry) -> None:
        """A box marked as held for room (``core.room``): let it run if the home has room
        again, else refuse the call now rather than wait on a guest that does not run."""
        rec = await self.refresh(entry)
        mark = room.read_mark(entry.dir, rec.vm.pid if rec.vm else None)
        if mark is None or rec.state != BoxState.RUNNING:
            with contextlib.suppress(FileNotFoundError):
                room.mark_of(entry.dir).unlink()  # a VM's since gone: it holds nothing
            return
        free = await asyncio.to_thread(free_bytes, self.rt.home)
        if free < room.room_needed():
            raise room.refusal(self.rt.home, entry.name, mark)
        await room.let_run(self.rt, self.db, rec, free)

    async def first_exec(self, entry: BoxEntry) -> None:
        """Run ``true`` as a box's first command runs (its default user, directory and
        environment). Done before a state that many VMs restore is saved: the state then
        holds what a first command reads (the directories on PATH, the dynamic loader
        and libc, the user database, the agent's command cgroup), so that no restored
        VM reads them from disk through kernel paths it has yet to translate."""
        spec = entry.spec
        first = ExecRequest(argv=["true"], env=spec.default_env() or None, cwd=spec.default_cwd(),
                            user=spec.default_user())  # fmt: skip
        await (await RemoteProcess.start(await self.connection(entry), first)).wait()

    async def boot_work_done(self, entry: BoxEntry, limit: float = BOOT_WORK_LIMIT) -> None:
        """Wait (``limit`` seconds at most) for the guest kernel's last boot-time work:
        the TSC calibration, which a second after boot registers the clocksource the
        kernel keeps and switches to it. A state saved before it makes every VM that
        restores it do that work (measured under TCG: ~1k blocks to translate, 5% of a
        restored VM's start and first command). Kernels that start on their final
        clocksource, and engines without one, answer at the first read."""
        conn = await self.connection(entry)
        deadline = time.monotonic() + limit
        while True:
            try:
                sources = (await read_file(conn, CLOCKSOURCES)).split()
            except (GuestError, OSError):
                return
            if b"tsc-early" not in sources or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)

    async def sync(self, entry: BoxEntry) -> None:
        """Have the guest write what it holds for its disk (``sync``), now."""
        await self.control(entry, ControlOp.SYNC)

    async def control(self, entry: BoxEntry, op: ControlOp, payload: bytes = b"") -> Fields:
        return await (await self.connection(entry)).control(op, payload)

    async def activity(self, entry: BoxEntry, *, as_is: bool = False) -> tuple[int, float]:
        """(operations in progress from any process, seconds since the last request or
        since the box last started or woke, whichever is later): what the idle timeout
        looks at. Asking does not count as activity. ``as_is``: ask the VM the row names
        whatever the box's state (an operation of its own under way)."""
        if as_is:
            conn = await entry.session.connection(
                self.launcher.vm_of(entry, entry.record), self.launcher.hello(entry)
            )
            f = await conn.control(ControlOp.STATUS)
        else:
            f = await self.control(entry, ControlOp.STATUS)
        idle = (f.u64(Tag.IDLE_MS, 0) or 0) / 1000
        # A woken guest's clock went on from its sleep: its last request is as old as the
        # sleep's cause, and the call that woke it may not have reached it yet (a loaded
        # host): a wake is a use.
        started = entry.record.started_at
        if started:
            idle = min(idle, max(0.0, time.time() - started))
        return f.u32(Tag.COUNT, 0) or 0, idle

    async def agent_lost(self, session: Session) -> BaseException | None:
        """A box's agent socket closed: reconnect if its VM lives (or once a suspended
        or rolled-back box runs again, here or in another process); else say why it is gone."""
        await asyncio.sleep(0.05)
        # A save by another process, on an engine whose save ends every connection and
        # the VM process (gvisor: a checkpoint, then a restore for a snapshot): wait for
        # it, then follow the VM it runs on (or wait for the resume below).
        saving = (BoxState.SNAPSHOTTING, BoxState.SUSPENDING)
        for _ in range(6000):  # a save's own limit is minutes: recovery ends one cut short
            found = await self.db.find(session.box_id)
            if found is None or found.state not in saving or found.engine == "qemu":
                break
            if session.conn is None:
                break
            await asyncio.sleep(0.05)
        vm = session.vm
        if vm is not None and vm.running:
            # a VM whose socket closed while its process lives may be one another process
            # has just suspended (it exits a moment later, and a resume may be starting the
            # next one on the same sockets): followed only while the box's row says it runs it
            rec = await self.db.find(session.box_id)
            if (rec is not None and rec.state not in (BoxState.SUSPENDING, BoxState.SUSPENDED)
                    and (rec.vm is None or rec.vm.pid == vm.ref.pid)):  # fmt: skip
                return None
        entry = self.entries.get(session.box_id)
        while (rec := await self.db.find(session.box_id)) is not None and rec.state in (
            BoxState.SUSPENDING, BoxState.SUSPENDED, BoxState.RESUMING, BoxState.RESTORING
        ):  # fmt: skip
            if session.conn is None:
                return ConnectionLost(f"box {session.name} was suspended; this connection ended")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.resumed.wait(), 0.5)
        if (
            rec is not None
            and rec.state == BoxState.RUNNING
            and entry is not None
            and session.conn is not None
        ):
            entry.update(rec)
            new = self.launcher.vm_of(entry, rec)
            if new.running:
                session.vm = new
                return None
        if rec is None:
            return InvalidState(f"box {session.name} was removed", box=session.name, state="removed")
        if rec.state in (BoxState.STOPPING, BoxState.STOPPED, BoxState.REMOVING, BoxState.CREATED):
            return InvalidState(f"box {session.name} was stopped", box=session.name, state=rec.state)
        tail_text = vm.console_tail() if vm is not None else ""
        if vm is not None:
            # only if the row still describes this VM: a restart may have started another
            why = "the VM process exited unexpectedly"
            crashed = events.draft("crashed", why, console=tail_text[-events.CONSOLE_TAIL :])
            crash = TRANSITIONS[Op.CRASH]
            await self.db.update(
                session.box_id, expect=crash.sources, expect_pid=vm.ref.pid,
                state=crash.target, reason=why, vm_pid=None, event=crashed,
            )  # fmt: skip
        return BoxCrashed(f"box {session.name} stopped unexpectedly", tail_text, box=session.name)

    def watch_idle(self, entry: BoxEntry) -> None:
        """Make sure a watchdog suspends this box once idle (``idle_timeout``); it is a
        detached process, so the box sleeps even after every user process has exited."""
        if entry.spec.idle_timeout:
            idle.spawn(self.rt.home, entry.id)

    # -- facts --------------------------------------------------------------------------------

    async def inspect(self, entry: BoxEntry) -> dict[str, Any]:
        """Everything about the box, JSON-ready."""
        rec = await self.refresh(entry)
        d = rec.to_json()
        d["paths"] = {"dir": str(entry.dir), "disk": rec.disk, "console": str(entry.dir / "console.log")}
        d["hostname"] = entry.hostname
        live = rec.state in (BoxState.RUNNING, BoxState.PAUSED)  # host ports are bound while the VM runs
        held = live or entry.spec.wake_on_traffic  # or, where it wakes on traffic, by its port keeper
        bound = {guest: (address, host) for address, host, guest in rec.ports if held}
        ports = []
        for p in entry.spec.ports:
            address, host = bound.get(p.guest, (p.address, p.host))
            ports.append({"address": address, "host": host or None, "guest": p.guest})
        d["network"] = {"mode": entry.spec.network, "allow": list(entry.spec.allow), "ports": ports}
        engine = self.rt.engine(rec.engine)
        d["host_cgroup"] = await asyncio.to_thread(engine.host_limits, rec.vm) if live else None
        d["accel"] = rec.boot.get("accel")
        d["size"], d["logical_size"] = await asyncio.to_thread(snapshots.box_sizes, rec, self.rt.store)
        return d

    async def stats(self, entry: BoxEntry) -> dict[str, Any]:
        """Host CPU time and memory of the VM, and the disk it uses."""
        rec = await self.refresh(entry)
        engine = self.rt.engine(rec.engine)
        live = rec.state in (BoxState.RUNNING, BoxState.PAUSED)

        def measure() -> dict[str, Any]:
            usage = engine.usage(rec.vm) if live else {"cpu_seconds": None, "rss_bytes": None}
            try:
                disk = Path(rec.disk).stat().st_blocks * 512 if rec.disk else 0
            except FileNotFoundError:
                disk = 0
            return {"name": rec.name, "state": rec.state, **usage, "disk_bytes": disk}

        return await asyncio.to_thread(measure)


def template_source(image_digest: str | None, rootfs_digest: str | None) -> str | None:
    """What a box's automatic template is of: its image (by digest), or its root
    filesystem (by content key); None for a box that has neither."""
    return image_digest or (f"rootfs:{rootfs_digest}" if rootfs_digest else None)


def auto_templates() -> bool:
    return os.environ.get("SANDLOT_AUTO_TEMPLATE", "1") != "0"
