"""Live state: snapshot, rollback, fork, suspend, resume, templates, export.

A snapshot pauses the VM, freezes the disk's top layer (the box goes on over a
new one) and has the engine save memory and devices; the pause lasts as long
as the save. Everything is recorded before the step that depends on it, and
each operation runs under the box's lock as one transition (``core.state``),
so a crash anywhere is finished or undone by recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from .. import pids
from ..crashpoints import crash_point
from ..engine.base import Boot, BootRequest, Engine, SavedState
from ..errors import InvalidArgument, InvalidState, SandlotError, SnapshotInUse, SnapshotNotFound
from . import archive, awake, chunks, events, layers, pusher, remote, snapshots, tier, tracing, volumes
from .controller import BoxController, template_source
from .entry import BoxEntry
from .launch import Launcher, drives_of, shares_of
from .requests import BoxRequest
from .runtime import Runtime
from .spec import BoxSpec
from .state import BoxState, Op, check
from .store import AsyncStore, BoxRecord, SnapshotRecord
from .validate import count

BOX_ID_RE = re.compile(r"[0-9a-f]{12}")
WARM_UP_TIMEOUT = 30.0  # seconds for the first command run before a template or fork is saved

log = logging.getLogger("sandlot")


def saved_drives(rec: BoxRecord) -> dict[str, Any]:
    """A saved state's options for the box's named volumes: the layer of each (frozen
    by the save), and the volume it is a copy of."""
    if not rec.drives:
        return {}
    return {"drives": [d["top"] for d in rec.drives], "drive_volumes": [d["volume"] for d in rec.drives]}


def stale_rootfs_template(snap: SnapshotRecord, rootfs: str, current: str | None) -> bool:
    """Whether ``snap`` is an automatic template of the tree ``rootfs`` as it no longer is
    (``current``: the tree's content key now; None: the tree is gone)."""
    saved_of = snap.options.get("box", {}).get("rootfs_digest")
    return (snap.template_key is not None and snap.name is None and saved_of is not None
            and snap.options.get("rootfs") == rootfs and saved_of != current)  # fmt: skip


class LiveState:
    """Snapshots and everything made of them, on the controller and the launcher."""

    def __init__(self, runtime: Runtime, controller: BoxController, launcher: Launcher) -> None:
        self.rt = runtime
        self.controller = controller
        self.launcher = launcher

    @property
    def db(self) -> AsyncStore:
        return self.rt.db

    # -- saving ----------------------------------------------------------------------------

    async def snapshot(self, entry: BoxEntry, name: str | None = None) -> SnapshotRecord:
        """Save memory, processes and disk while the box runs (it pauses only for the save)."""
        async with entry.lock():
            await self.controller.refresh(entry)
            return await self.capture(entry, "snapshot", name=name)

    async def capture(
        self,
        entry: BoxEntry,
        kind: str,
        *,
        name: str | None = None,
        template_key: str | None = None,
        auto: bool = False,
        fixed: asyncio.Event | None = None,
    ) -> SnapshotRecord:
        """Save the running state as a snapshot of ``kind`` (the box's lock held); the box goes on.
        ``fixed``: set once the state saved can no longer change (``VM.save``), at the latest
        when the save has returned and the box's row names the VM it left running (an
        engine whose save runs the box in another VM: a call that looked the box up before
        would reach the one the save ended)."""
        check(Op.SNAPSHOT, entry.state, box=entry.name)
        self.require_live_state(entry)
        home = self.rt.home
        snap_id = snapshots.new_id()
        rec = entry.record
        op_data = {"kind": "snapshot", "source": str(entry.state), "snapshot": snap_id}
        async with (
            self.controller.still(entry),
            self.controller.transition(entry, Op.SNAPSHOT, op_data=op_data) as step,
        ):
            step.detail = {"snapshot": snap_id, "name": name, "snapshot_kind": kind}
            assert rec.disk is not None
            frozen = Path(rec.disk)
            top, drives = await asyncio.to_thread(self._new_tops, rec)
            # recorded before the VM switches: the new tops start empty over the old ones,
            # so the row names complete disks whether or not the switch happens
            try:
                await self.db.update(entry.id, disk=str(top), drives=drives)
            except BaseException:  # not recorded (a full disk): no row names them, so they go
                for made in (top, *(Path(d["top"]) for d in drives)):
                    made.unlink(missing_ok=True)
                raise
            crash_point("snapshot.before-save")
            vm = self.launcher.vm_of(entry, rec)
            # a template's state, and a fork's own, are restored by many VMs at once
            async with self._saving(rec, snap_id, shared=kind == "template" or auto) as saving:
                with snapshots.writing(home, snap_id) as tmp:
                    new_drives = {d["serial"]: Path(d["top"]) for d in drives}
                    pause = await vm.save(
                        tmp, new_disk=top, keep_running=True, new_drives=new_drives, sink=saving.sink,
                        fixed=fixed,
                    )  # fmt: skip
                    if vm.ref == rec.vm and fixed is not None:
                        fixed.set()  # (the VM that ran the box runs it still)
                    manifest, stored = await saving.finish()
                if vm.ref != rec.vm:  # an engine whose save ends the VM process runs it anew (gvisor)
                    moved = await self.db.update(entry.id, vm_pid=vm.ref.pid, vm_start=vm.ref.start)
                    if moved is not None:
                        entry.update(moved)
                    if fixed is not None:
                        fixed.set()
                crash_point("snapshot.after-save")
                sizes = snapshots.sizes(home, snap_id, saving.manifest, frozen)
                options: dict[str, Any] = {"box": rec.options, "image_ref": rec.image_ref,
                                           "image_digest": rec.image_digest, "rootfs": rec.rootfs,
                                           "vm": vm.saved_facts(), **saved_drives(rec), **sizes}  # fmt: skip
                if auto:  # a fork's own: it goes with its last child, or with its owner if no child came
                    options.update(auto=True, owner=list(pids.me()))
                snap = SnapshotRecord(
                    id=snap_id, kind=kind, layer=str(frozen), name=name, box_id=rec.id, box_name=rec.name,
                    template_key=template_key, created_at=time.time(),
                    size=options["stored_bytes"], options=options,
                )  # fmt: skip
                try:
                    await self.db.insert_snapshot(snap, manifest=manifest, stored=stored)
                except BaseException:
                    snapshots.remove_files(home, snap_id)
                    raise
        self._pushed_later()
        entry.last_pause = pause
        return snap

    async def suspend(self, entry: BoxEntry, *, if_idle_for: float | None = None) -> None:
        """Write the running state to disk and end the VM: no CPU, no RAM. ``if_idle_for``
        (the idle watchdog's): only if, once the box is marked suspending, nothing is in
        flight and no request came for that many seconds; else it is called off."""
        async with entry.lock():
            rec = await self.controller.refresh(entry)
            if not check(Op.SUSPEND, rec.state, box=entry.name):
                return
            self.require_live_state(entry)
            home = self.rt.home
            snap_id = snapshots.new_id()
            session = entry.session
            session.resumed.clear()
            op_data = {"kind": "suspend", "source": rec.state, "snapshot": snap_id}
            async with (
                self.controller.still(entry),
                self.controller.transition(entry, Op.SUSPEND, op_data=op_data) as step,
            ):
                if if_idle_for is not None:
                    # asked again now that other processes see the box suspending and wait
                    # for it: a request that came after the watchdog looked keeps it running
                    busy, idle = await self.controller.activity(entry, as_is=True)
                    if busy or idle < if_idle_for:
                        step.called_off = True
                        session.resumed.set()
                        return
                vm = self.launcher.vm_of(entry, rec)
                crash_point("suspend.before-save")
                try:
                    async with self._saving(rec, snap_id) as saving:
                        with snapshots.writing(home, snap_id) as tmp:
                            pause = await vm.save(tmp, new_disk=None, keep_running=False, sink=saving.sink)
                            manifest, stored = await saving.finish()
                        sizes = snapshots.sizes(home, snap_id, saving.manifest, None)
                        snap = SnapshotRecord(
                            id=snap_id, kind="suspend", layer=str(rec.disk), box_id=rec.id, box_name=rec.name,
                            created_at=time.time(), size=sizes["stored_bytes"],
                            options={"box": rec.options, "image_ref": rec.image_ref,
                                     "image_digest": rec.image_digest, "rootfs": rec.rootfs,
                                     "vm": vm.saved_facts(), **saved_drives(rec), **sizes},
                        )  # fmt: skip
                        await self.db.insert_snapshot(snap, manifest=manifest, stored=stored)
                    await self.db.update(entry.id, suspended=snap_id)  # from here on, recovery finishes it
                except BaseException:
                    if step.source == BoxState.RUNNING:
                        with contextlib.suppress(Exception):
                            await vm.resume()
                    raise
                crash_point("suspend.after-save")
                self._pushed_later()
                step.changes = {"vm_pid": None, "stopped_at": time.time()}
                if session.conn is not None and session.conn.open_channels == 0:
                    session.drop()  # nothing to carry over; operations in flight reconnect on resume
                await vm.kill(grace=1.0)
                vm.cleanup()
        entry.last_pause = pause

    async def resume(self, entry: BoxEntry) -> None:
        """Bring a suspended box back with its processes; this process's open commands
        and streams carry on where they were."""
        session = entry.session
        async with entry.lock():
            rec = await self.controller.refresh(entry)
            if not check(Op.RESUME, rec.state, box=entry.name):
                return
            snap = await self.db.find_snapshot(rec.suspended or "")
            if snap is None:
                async with self.controller.transition(entry, Op.LOSE) as step:
                    step.changes = {"reason": "its suspended state is missing", "suspended": None}
                raise InvalidState(
                    f"box {entry.name}: its suspended state is missing; start() boots it afresh",
                    box=entry.name, state="crashed",
                )  # fmt: skip
            if snap.id in await self.db.call(remote.pushed_states):
                # it went to the storage tier: another home may have taken it (by force,
                # its holder thought gone); this home runs it only while it holds it
                await asyncio.to_thread(self._hold_lease, rec)
            keep_conn = session.healthy  # its operations reconnect to the resumed VM
            installs = session.conn.installs if keep_conn and session.conn is not None else 0
            async with (
                awake.room_for(self.controller, self, entry),  # its namespace's quota of awake boxes
                self.controller.transition(entry, Op.RESUME) as step,
            ):
                step.on_failure = {"vm_pid": None}
                await self.launcher.restore(entry, rec, snap, attach=not keep_conn)
                step.changes = {"suspended": None, "started_at": time.time()}
            await self.drop_saved_state(snap.id)
            session.resumed.set()
            if keep_conn and session.conn is not None:
                # before the lock lets this process's next callers use it (a box another
                # process suspended: its socket closed, maybe not yet read)
                try:
                    await session.conn.follow(installs, entry.spec.request_timeout)
                except Exception:
                    session.drop()  # the next call connects anew; what ran on it is lost, as on a crash
                    keep_conn = False
        self.controller.watch_idle(entry)
        if keep_conn and session.conn is not None:
            await session.conn.wait_ready()
            if self.launcher.frozen_for_saves(entry):  # saved so (BoxController.still): its shares go up too
                await session.conn.thaw()

    def _saving(self, rec: BoxRecord, snap_id: str, *, shared: bool = False) -> chunks.Saving:
        """A save of ``rec``'s VM as chunks, where its engine writes them (``shared``: many
        VMs restore it right after, ``StateSink.shared``)."""
        engine = self.rt.engine(rec.engine)
        enabled = engine.chunked_state and chunks.enabled()
        return chunks.Saving(
            self.rt.home, self.rt.store, engine.name, snap_id, enabled=enabled, shared=shared
        )

    def _pushed_later(self) -> None:
        """Where the home has a storage tier, its pusher sends what this save made (a
        detached process: the save waits on no network)."""
        if tier.configured_quickly(self.rt.home):
            asyncio.get_running_loop().run_in_executor(None, pusher.spawn, self.rt.home)

    def _hold_lease(self, rec: BoxRecord) -> None:
        remote = chunks.ChunkStore(self.rt.home).tier()
        if remote is not None:
            remote.take(rec.id, tier.home_id(self.rt.home))

    def require_live_state(self, entry: BoxEntry) -> None:
        """Refuse, saying why, on an engine that cannot save a running state."""
        engine = self.rt.engine(entry.record.engine)
        if not engine.live_state:
            raise InvalidState(
                f"box {entry.name} runs on engine {engine.name!r}, which cannot save its running state yet: "
                "snapshot, suspend, fork, templates and export need engine='qemu'",
                box=entry.name, state=entry.state,
            )  # fmt: skip

    async def drop_saved_state(self, snap_id: str) -> None:
        await asyncio.to_thread(snapshots.drop, self.rt.home, self.rt.store, snap_id)

    async def rollback(self, entry: BoxEntry, snap: SnapshotRecord) -> None:
        """Take the box back to one of its snapshots: memory, processes and disk. Same
        id and name; commands running now end (with ConnectionLost)."""
        if snap.box_id != entry.id:
            raise InvalidArgument(
                f"snapshot {snap.name or snap.id} is of box {snap.box_name}; a box rolls back to its own "
                "snapshots (snapshot.start() makes a new box from any)"
            )
        rt = self.rt
        async with entry.lock():
            rec = await self.controller.refresh(entry)
            check(Op.ROLLBACK, rec.state, box=entry.name)
            top = await asyncio.to_thread(layers.new_layer, rt.home, Path(snap.layer))
            made, drives = [top], []
            try:
                for d, layer in zip(rec.drives, snap.options.get("drives") or [], strict=True):
                    made.append(await asyncio.to_thread(layers.new_layer, rt.home, Path(layer)))
                    drives.append({**d, "top": str(made[-1])})
                op_data = {"kind": "rollback", "disk": str(top), "drives": [d["top"] for d in drives]}
                async with self.controller.transition(entry, Op.ROLLBACK, op_data=op_data) as step:
                    step.failure_reason = "rollback failed, the disk is as it was before"
                    step.detail = {"snapshot": snap.id, "name": snap.name}
                    step.on_failure = {"vm_pid": None}
                    entry.session.drop()  # first: its end must not look like a crash to reconnect from
                    if rt.engine(rec.engine).alive(rec.vm, rec.id):
                        old = self.launcher.vm_of(entry, rec)
                        await old.kill(grace=0.5)
                        old.cleanup()
                    await self.launcher.restore(entry, rec, snap, attach=True, disk=top, drives=drives)
                    step.changes = {"disk": str(top), "drives": drives, "started_at": time.time(),
                                    "suspended": None}  # fmt: skip
            except BaseException:
                await asyncio.to_thread(self._gc, made)
                raise
            if rec.suspended:
                await self.drop_saved_state(rec.suspended)
            # the old tops and what only they reached (layers a snapshot or fork froze under
            # them since): gc keeps whatever a snapshot, a box or a volume still reaches
            await asyncio.to_thread(self._gc, layers.chains(layers.box_tops(rec)))
        self.controller.watch_idle(entry)

    def _new_tops(self, rec: BoxRecord) -> tuple[Path, list[dict[str, Any]]]:
        """A new top over the box's disk and over each of its drives (a snapshot's)."""
        home = self.rt.home
        assert rec.disk is not None
        made: list[Path] = []
        try:
            made.append(layers.new_layer(home, Path(rec.disk)))
            drives = []
            for d in rec.drives:
                made.append(layers.new_layer(home, Path(d["top"])))
                drives.append({**d, "top": str(made[-1])})
        except BaseException:
            for p in made:
                p.unlink(missing_ok=True)
            raise
        return made[0], drives

    def _gc(self, also: list[Path]) -> None:
        store = self.rt.store
        layers.gc(self.rt.home, store, also=also)

    # -- starting boxes from saved states ---------------------------------------------------

    async def fork(self, entry: BoxEntry, n: int = 1, *, name: str | None = None) -> list[BoxEntry]:
        """``n`` running copies of the box, from a snapshot taken now (removed with its last
        child); they carry its labels (a namespace, an owner)."""
        count(n)
        with tracing.span("fork", box=entry.id, name=entry.name, n=n):
            await self.warm_up(entry)
            async with entry.lock():
                await self.controller.refresh(entry)
                snap = await self.capture(entry, "snapshot", auto=True)
            labels = dict(entry.spec.labels)
            children = await self.start_boxes(snap, n, name=name, as_prefix=True, labels=labels)
        forked = events.draft(
            "forked", snapshot=snap.id, children=[{"id": c.id, "name": c.name} for c in children]
        )
        await self.db.add_event(forked, entry.id)
        return children

    async def start_boxes(
        self, snap: SnapshotRecord, n: int = 1, *, name: str | None = None, as_prefix: bool = False,
        box_id: str | None = None, held_by_me: bool = False, **options: Any,
    ) -> list[BoxEntry]:  # fmt: skip
        """Start ``n`` boxes from a saved state, all or none. They share unchanged memory
        copy-on-write and each has its own disk layer, hostname, machine-id, RNG state
        and wall clock. ``name``: the box's name if ``n`` is 1, else the prefix of their names.
        ``box_id``: the id of the one box (a box moved from another home keeps its id).
        ``held_by_me``: the boxes are this process's, removed by recovery once it dies
        (a ``with`` block's, a diff's)."""
        count(n)
        if box_id is not None:
            if n != 1:
                raise InvalidArgument("box_id names one box; start one box with it (n=1)")
            if not BOX_ID_RE.fullmatch(box_id):
                raise InvalidArgument(f"box_id must be 12 lowercase hex digits, not {box_id!r}")
        found = await self.db.find_snapshot(snap.id)
        if found is None:
            raise SnapshotNotFound(f"snapshot {snap.id} was removed")
        if n > 1:  # one load of the whole stream, then copy-on-write for everyone
            await self.share(found)
        # the box's own name, cut to leave room for "-" and 6 hex digits within 63 characters
        prefix = name or (found.box_name or "box")[:56]
        exact = name is not None and n == 1 and not as_prefix
        requests = [
            BoxRequest.build(None, {**options, "name": name if exact else f"{prefix}-{os.urandom(3).hex()}"},
                             template=found, keep=True)
            for _ in range(n)
        ]  # fmt: skip
        if box_id is not None:
            requests[0].id = box_id
        made: list[BoxEntry] = []

        async def one(req: BoxRequest) -> None:
            crash_point("fork.child-start")
            child = await self.controller.create(req, ephemeral=True)  # until all are up
            made.append(child)
            await self.controller.start(child)

        results = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(
                *(self.controller.remove(c, force=True) for c in made), return_exceptions=True
            )
            raise failed[0]
        for child in [] if held_by_me else made:
            rec = await self.db.update(child.id, ephemeral=False)
            if rec is not None:
                child.update(rec)
        by_name = {r.id: i for i, r in enumerate(requests)}
        return sorted(made, key=lambda c: by_name[c.id])

    async def share(self, snap: SnapshotRecord) -> None:
        """Give a saved state the copy-on-write form forks, templates and exports use."""
        rt = self.rt
        directory = snapshots.snapshot_dir(rt.home, snap.id)
        engine = rt.engine(snap.facts.get("engine", "qemu"))
        if engine.memory_shared(directory):
            return
        drives = [
            {"top": layer, "serial": volumes.serial(i)}
            for i, layer in enumerate(snap.options.get("drives") or [])
        ]
        saved = BoxSpec.from_options(snap.options.get("box", {}))
        async with chunks.reading(rt.home, rt.store, snap.id) as source:
            state = SavedState(directory, snap.facts, source)
            await engine.share_memory(state, Path(snap.layer), drives_of(drives), shares_of(saved))
        # the form forks map is the snapshot's too: its files count in what it takes
        shared = snapshots.dir_size(directory)
        options = {**snap.options, "shared_bytes": shared}
        await self.db.update_snapshot(snap.id, size=int(snap.options.get("stored_bytes", 0)) + shared,
                                      options=options)  # fmt: skip

    # -- templates -------------------------------------------------------------------------

    async def warm_up(self, entry: BoxEntry) -> None:
        """Before a state many VMs restore (a template, a fork) is saved: a first command,
        so that each of them finds what one reads in its page cache (measured under TCG:
        a fifth fewer blocks to translate for a restored VM's first command), then a
        sync, so that what the box wrote goes to the disk layer they share once, not
        to each of theirs by each of them (a journal commit and a writeback, ~5k blocks
        to translate, in every restored VM). Between them, the guest kernel's boot-time
        work is waited out (``BoxController.boot_work_done``). A box whose image cannot
        run ``true`` is saved as it is; one that is not running (paused, suspended) is
        left as it is, for the save to judge."""
        if (await self.controller.refresh(entry)).state != BoxState.RUNNING:
            return
        try:
            await asyncio.wait_for(self.controller.first_exec(entry), WARM_UP_TIMEOUT)
            await asyncio.wait_for(self.controller.boot_work_done(entry), WARM_UP_TIMEOUT)
            await asyncio.wait_for(self.controller.sync(entry), WARM_UP_TIMEOUT)
        except (SandlotError, OSError, TimeoutError) as exc:
            log.debug("no first command or sync in %s before its state was saved: %s", entry.name, exc)

    async def template_key(self, entry: BoxEntry, image_digest: str) -> str:
        """What an automatic template must share with a box to stand in for its boot."""
        spec = entry.spec
        request = BootRequest(accel=spec.accel, kernel=spec.kernel, nested_virt=spec.nested_virt,
                              containers=spec.containers)  # fmt: skip
        boot = await asyncio.to_thread(self.rt.engine(spec.engine).prepare, request)
        key: list[Any] = [image_digest, spec.memory_mib, spec.cpus, spec.disk_size_gb, *boot.identity]
        if spec.engine != "qemu":
            key.append(spec.engine)
        if spec.policy.has_nic:  # a network card is part of the saved device state
            key.append("nic")
        if spec.nested_virt:  # its kernel loaded KVM at boot
            key.append("nested-virt")
        if spec.containers:  # and a container engine's modules, and started its daemon
            key.append("containers")
        if spec.policy.proxied:  # so is the guest's resolver, chosen at boot (the relay)
            key.append("dns-relay")
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]

    async def auto_template(self, entry: BoxEntry, image_digest: str) -> SnapshotRecord | None:
        """The image's automatic template for a box like this one, if one was saved, in
        the form boxes map copy-on-write, as an explicit template's. That form is made
        when a second box of the image starts (one box per image never pays for its
        memory file): a box restored from the stream holds every page of the saved
        memory as its own, one that maps the file holds only what it wrote (measured
        under TCG, busybox, 256 MiB: 74 MiB of PSS against 36, and 0.48 s to start
        against 0.14). A template that cannot be given it (a full disk) is restored
        from its chunks, as before."""
        snap = await self._saved_boot(entry, image_digest)
        if snap is None:
            return None
        try:
            await self.share(snap)  # it changes only the row's sizes, which a box's start never reads
        except (SandlotError, OSError) as exc:
            log.warning("the automatic template %s is restored from its chunks: %s", snap.id, exc)
        return snap

    async def _saved_boot(self, entry: BoxEntry, image_digest: str) -> SnapshotRecord | None:
        key = await self.template_key(entry, image_digest)
        for snap in await self.db.snapshots(kind="template"):
            if snap.template_key == key and snap.name is None:
                found: SnapshotRecord = snap
                return found
        return None

    async def save_auto_template(self, entry: BoxEntry) -> None:
        """Right after the first boot of an image or root filesystem (the box's lock
        held): later boxes like it restore this state instead of booting. A box that
        booted is never failed for its template."""
        rec, spec = entry.record, entry.spec
        source = template_source(rec.image_digest, spec.rootfs_digest)
        try:
            if source and await self._saved_boot(entry, source) is None:
                key = await self.template_key(entry, source)
                await self.warm_up(entry)
                await self.capture(entry, "template", template_key=key)
                if spec.rootfs_digest and rec.rootfs:
                    await self._drop_older_rootfs_templates(rec.rootfs, spec.rootfs_digest)
        except Exception as exc:
            log.warning("could not make a template of %s: %s", spec.image or spec.rootfs, exc)
        entry.spec.auto_template = False
        done = await self.db.update(entry.id, options=entry.spec.to_options())
        if done is not None:
            entry.update(done)

    async def _drop_older_rootfs_templates(self, rootfs: str, digest: str) -> None:
        """A directory that changed made a new automatic template: those of its older
        trees that no box was started from go (an image's go with the image instead),
        so a root filesystem edited between runs does not keep a saved boot per edit.
        Only when ``digest`` is the tree as it is now: a box made before the tree
        changed and started after saved an older tree's boot, not the newest."""
        from ..images.rootfs import rootfs_key  # only where a tree's box saved its first boot

        try:
            current = await asyncio.to_thread(rootfs_key, rootfs)
        except (OSError, InvalidArgument):
            return
        if current == digest:
            for snap in await self.db.snapshots(kind="template"):
                if stale_rootfs_template(snap, rootfs, current):
                    with contextlib.suppress(SnapshotInUse, SnapshotNotFound):
                        await self.remove_snapshot(snap)

    async def make_template(self, entry: BoxEntry, name: str | None) -> SnapshotRecord:
        """Save a set-up box as a template, in the form many boxes start from."""
        await self.warm_up(entry)
        async with entry.lock():
            await self.controller.refresh(entry)
            snap = await self.capture(entry, "template", name=name)
        try:
            await self.share(snap)
        except Exception:
            # the caller is told there is no template: none stays under the name asked for
            with contextlib.suppress(SandlotError, OSError):
                await self.remove_snapshot(snap)
            raise
        return await self.db.find_snapshot(snap.id) or snap

    # -- snapshots as things ----------------------------------------------------------------

    async def find_snapshot(
        self, key: str, *, box_id: str | None = None, kinds: tuple[str, ...] = ("snapshot", "template")
    ) -> SnapshotRecord:
        rec = await self.db.get_snapshot(key, box_id=box_id)
        if rec.kind not in kinds:
            raise InvalidArgument(f"{key!r} is a {rec.kind}, not a {' or '.join(kinds)}")
        found: SnapshotRecord = rec
        return found

    async def list_snapshots(
        self, *, box: str | None = None, kind: str | None = None
    ) -> list[SnapshotRecord]:
        """Snapshots and templates, oldest first (``box``: of that box; an automatic
        template saved of its first boot is sandlot's, not one of the box's own steps)."""
        await asyncio.to_thread(snapshots.reclaim_abandoned, self.rt.home, self.rt.store)
        box_id = (await self.db.get(box)).id if box else None
        recs = await self.db.snapshots(box_id=box_id, kind=kind)
        # a recorded step's checkpoint is the timeline's (``box.timeline()``), listed when asked for
        mine = [r for r in recs if r.kind != "suspend" and (r.kind != "step" or kind == "step")]
        return [r for r in mine if not (box_id and r.template_key)]

    async def children(self, snap: SnapshotRecord) -> list[str]:
        return [b.name for b in await self.db.children(snap.id)]

    async def remove_snapshot(self, snap: SnapshotRecord) -> None:
        """Delete a snapshot; refused (SnapshotInUse) while boxes started from it exist."""
        kids = await self.db.children(snap.id)
        if kids:
            names = ", ".join(b.name for b in kids[:5]) + (" ..." if len(kids) > 5 else "")
            raise SnapshotInUse(
                f"snapshot {snap.name or snap.id} has {len(kids)} box(es) started from it: {names}"
            )
        await asyncio.to_thread(snapshots.drop, self.rt.home, self.rt.store, snap.id)
        # its layers and what only they reached go now (what a box or a volume reaches stays)
        await asyncio.to_thread(self._gc, layers.chains(layers.snapshot_layers(snap)))

    async def prune_snapshots(self, *, templates: bool = False) -> list[SnapshotRecord]:
        """Remove the snapshots no box needs: those of boxes that are gone (imported ones
        too) and the automatic templates of root filesystem trees that changed or went,
        from which no box was started; with ``templates``, every template no box was
        started from as well. Removing a box keeps its snapshots; this is how they go."""
        rt = self.rt

        from ..images.rootfs import rootfs_key  # only where a tree's template may be stale

        trees: dict[str, str | None] = {}

        def tree_now(path: str) -> str | None:
            if path not in trees:
                try:
                    trees[path] = rootfs_key(path)
                except (OSError, InvalidArgument):  # gone (or unreadable): no box boots it again
                    trees[path] = None
            return trees[path]

        def stale(s: SnapshotRecord) -> bool:
            path = s.options.get("rootfs")
            if s.template_key is None or not isinstance(path, str):
                return False
            return stale_rootfs_template(s, path, tree_now(path))

        def prune() -> list[SnapshotRecord]:
            store = rt.store
            boxes = {b.id for b in store.list()}
            gone = []
            for s in store.snapshots():
                keep = (
                    s.kind == "suspend"
                    or (s.kind == "template" and not templates and not stale(s))
                    or (s.kind in ("snapshot", "step") and s.box_id in boxes)
                    or store.children(s.id)
                )
                if not keep:
                    snapshots.drop(rt.home, store, s.id, collect=False)
                    gone.append(s)
            layers.gc(rt.home, store)
            chunks.ChunkStore(rt.home).collect(store)
            return gone

        return await asyncio.to_thread(prune)

    async def export(self, snap: SnapshotRecord, path: Path, since: SnapshotRecord | None = None) -> Path:
        """Write a snapshot to one file another host imports; readers never see a partial
        file. ``since``: only what changed after that snapshot (the archive of a state
        saved as chunks carries the chunks and disk layers the base has not)."""
        found = await self.db.find_snapshot(snap.id)
        if found is None:
            raise SnapshotNotFound(f"snapshot {snap.id} was removed")
        engine = self.rt.engine(found.facts.get("engine", "qemu"))
        # a layer directory (gVisor's disk) is carried as the tree it holds, whole
        if engine.disk_format != "dir" and await self.db.state_manifest(found.id) is not None:
            return await asyncio.to_thread(
                archive.export_chunked, self.rt.home, self.rt.store, found, path, since
            )
        if since is not None:
            raise InvalidArgument(
                f"snapshot {found.name or found.id} was saved before chunks (or by gVisor): it exports whole"
            )
        await self.share(found)
        found = await self.db.find_snapshot(snap.id) or found
        return await asyncio.to_thread(archive.export_snapshot, self.rt.home, engine, found, path)

    async def import_snapshot(self, path: Path, namespace: str | None = None) -> SnapshotRecord:
        """Verify an exported snapshot (integrity, compatibility with this host) and add it;
        ``namespace``: whose it is here (the importer's)."""
        rt = self.rt

        def engine_for(name: str) -> tuple[Engine, Boot]:
            engine = rt.engine(name)
            return engine, engine.prepare(BootRequest())

        def verify_and_add() -> SnapshotRecord:
            return archive.import_snapshot(rt.home, rt.store, engine_for, path, namespace)

        return await asyncio.to_thread(verify_and_add)
