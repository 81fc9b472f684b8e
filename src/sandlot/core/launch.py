"""Bringing a box's VM up: a cold boot, or a restore of a saved state, up to an
agent that answers. Shared by the controller (start) and live state (resume,
rollback, fork). The caller holds the box's lock and has recorded the state
the operation runs in; everything here records the VM as soon as it exists, so
a crash of this process leaves nothing recovery cannot find.

Each bring-up waits in the admission line first (``core.admission``); the boot
deadline starts when its turn comes. The launcher knows no other component:
the controller and live state build on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .. import records
from ..config import atomic_write, runtime_dir
from ..crashpoints import crash_point
from ..engine.base import VM, Boot, BootRequest, Drive, Engine, LaunchSpec, NetSpec, SavedState, Volume
from ..errors import AgentTimeout, BootTimeout, ConnectionLost, no_space
from ..net.addresses import box_address
from ..net.boxlink import LinkInfo, link_socket
from ..net.egress import ensure_server, mux_for, relay_for
from ..net.policy import write_policy
from ..net.secrets import GUEST_BUNDLE, GUEST_CA, SYSTEM_BUNDLES, read_vault_json
from ..protocol import files as proto_files
from ..protocol.connection import AgentConnection
from ..protocol.wire import ControlOp, FsFlag, FsOp, MountFlag, Tag, tlv
from . import chunks, containers, homewatch, lazymem, metrics, snapshots
from .admission import Admission, default_slots
from .entry import BoxEntry
from .options import DEFAULT_DISK_GB
from .runtime import Runtime
from .sessions import Hello
from .spec import BoxSpec
from .store import BoxRecord, SnapshotRecord

log = logging.getLogger("sandlot")
BOOT_ATTEMPTS = 2  # boots of a box whose guest hangs before its init (a rare TCG hang) before it fails


DISK_FULL_POLL = 1.0  # seconds between looks at a booting VM's disks (a QMP query each)


async def _until_disk_full(vm: VM) -> None:
    """Return once the VM has stopped on a full host filesystem (``VM.disk_full``): a
    boot would otherwise wait out its deadline, twice, on a guest that never runs again."""
    while True:
        await asyncio.sleep(DISK_FULL_POLL)
        with contextlib.suppress(Exception):  # a VM that cannot say is not known to be full
            if await vm.disk_full():
                return


class HungBoot(BootTimeout):
    """Past the deadline, the guest had not opened its agent's port: it hung before its
    init ran, and ``Launcher.boot`` tries once more (a fresh VM on the same disk)."""


def home_helpers(home: Path) -> None:
    """Make sure the home's watcher and its metrics sampler run."""
    homewatch.ensure(home)
    metrics.ensure(home)


class Launcher:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._admission: dict[int, Admission] = {}

    def admission(self, accel: str) -> Admission:
        """This loop's line for VMs coming up under ``accel`` (its bound depends on it)."""
        slots = default_slots(accel)
        line = self._admission.get(slots)
        if line is None:
            line = self._admission[slots] = Admission(runtime_dir() / "admission", slots)
        return line

    # -- what a VM is launched with --------------------------------------------------------

    def hello(self, entry: BoxEntry) -> Hello:
        spec = entry.spec
        return Hello(hostname=entry.hostname, machine_id=entry.record.machine_id, pids_max=spec.pids_limit,
                     request_timeout=spec.request_timeout, aslr=spec.aslr)  # fmt: skip

    def net_spec(self, entry: BoxEntry, *, nic: bool | None = None) -> NetSpec | None:
        """The network card of the box's VM (None: it has none), its policy written where
        the egress proxy reads it. ``nic``: whether the VM must have one (a restore has
        the devices of its saved state, whatever the policy says now: a card under
        policy 'none' lets nothing in or out). Blocking (it writes a file)."""
        spec = entry.spec
        policy = spec.policy
        if nic is None:
            nic = policy.has_nic
        if not nic:
            return None
        if not policy.has_nic:
            return NetSpec(restrict=True)
        policy_file = entry.dir / "egress-policy.json"
        write_policy(policy_file, policy)
        # the boxes the policy names now get guest addresses of their own; one named
        # later is reached through the proxy (QEMU's forwards are fixed at start)
        addresses = {name: box_address(n) for n, name in enumerate(policy.boxes())}
        sock = link_socket(runtime_dir(), self.rt.home)
        link = LinkInfo(home=str(self.rt.home), box=entry.id, socket=str(sock), python=sys.executable,
                        addresses=addresses)  # fmt: skip
        link_file = entry.dir / "egress-link.json"
        atomic_write(link_file, json.dumps(link.to_json()).encode(), mode=0o600)

        relay = relay_for(self.rt.home, runtime_dir())
        if relay is not None:
            ensure_server(relay)

        # the box's bounds are the starting process's settings (a bad one fails the start)
        limits = records.bounds().helper_spec()

        def helper(module: str, *more: str) -> str:  # started by the engine for each guest connection
            argv = [sys.executable, "-m", module, str(policy_file), str(entry.dir / "egress.log"),
                    "--link", str(link_file), "--limits", limits, *more]  # fmt: skip
            return shlex.join(relay.command(argv) if relay is not None else argv)

        return NetSpec(
            restrict=policy.mode != "open",
            proxy_command=helper("sandlot.net.proxy") if policy.proxied else None,
            # open mode too: a guest restored from a snapshot of a proxied box asks it for names
            dns_command=helper("sandlot.net.dns"),
            # a box that wakes on traffic has its ports held by its port keeper instead
            forwards=() if spec.wake_on_traffic else tuple((p.address, p.host, p.guest) for p in spec.ports),
            transparent_ports=tuple(spec.transparent_ports()),
            guest_forwards=tuple(
                (addresses[r.box], r.port, helper("sandlot.net.proxy", "--box", r.box, str(r.port)))
                for r in policy.allow
                if r.box is not None and r.port is not None  # box entries exist in proxied modes only
            ),
            egress_mux=str(mux) if (mux := mux_for(relay)) is not None else None,
        )

    def vm_of(self, entry: BoxEntry, rec: BoxRecord) -> VM:
        """The VM process of a box started elsewhere (or earlier)."""
        assert rec.vm is not None, f"box {rec.name} has no VM"
        if entry.vm is not None and entry.vm.ref == rec.vm:
            return entry.vm
        engine = self.rt.engine(rec.engine)
        # a row written before launch records held the VM's shape: the box's own is the best guess
        spec = entry.spec
        shaped = {
            "memory_mib": spec.memory_mib,
            "cpus": spec.cpus,
            "network": spec.policy.has_nic,
            **rec.boot,
        }
        entry.vm = engine.attach(rec.vm, self.rt.placement(rec, entry.hostname), shaped)
        return entry.vm

    def frozen_for_saves(self, entry: BoxEntry) -> bool:
        """Whether a save of the box freezes its commands (``BoxController.still``), and
        so whether they come back frozen in a VM restored from one: a box with VMs of its
        own (no vCPU may be inside one), or with shares its agent mounted (unmounted for
        the save: no command may see their mount points bare)."""
        spec = entry.spec
        return spec.nested_virt or (bool(spec.volumes) and not self.rt.engine(spec.engine).mounts_shares)

    async def prepare(self, entry: BoxEntry, *, network: bool) -> Boot:
        request = boot_request(entry.spec, network=network)
        return await asyncio.to_thread(self.rt.engine(entry.spec.engine).prepare, request)

    def refuse(self, spec: BoxSpec) -> None:
        """What the box's engine cannot run at all, refused before the box is made."""
        self.rt.engine(spec.engine).refuse(boot_request(spec, network=spec.policy.has_nic))

    # -- bring-ups ----------------------------------------------------------------------------

    async def boot(self, entry: BoxEntry, rec: BoxRecord) -> VM:
        """Boot the box's disk and wait for its agent (also mounting volumes and
        installing the trust of its secrets' CA)."""
        spec = entry.spec
        engine = self.rt.engine(spec.engine)
        boot = await self.prepare(entry, network=spec.policy.has_nic)
        net = await asyncio.to_thread(self.net_spec, entry)
        assert rec.disk is not None
        where = self.rt.placement(rec, entry.hostname)
        launch = LaunchSpec(
            where=where, disk=Path(rec.disk), memory_mib=spec.memory_mib, cpus=spec.cpus,
            boot=shape(boot, spec.memory_mib, spec.cpus, where.agent_ports, net), network=net,
            volumes=shares_of(spec), drives=drives_of(rec.drives, spec),
        )  # fmt: skip
        timeout = spec.boot_timeout_for(boot.accel)

        async def when_up(vm: VM) -> None:
            conn = await self.attach(entry, vm, timeout, boot)
            for share in () if engine.mounts_shares else launch.volumes:
                flags = MountFlag.READONLY if share.readonly else 0
                await conn.control(ControlOp.MOUNT, mount_request(share.guest, share.tag, flags))
            for m, d in zip(() if engine.mounts_drives else spec.mounts, rec.drives, strict=False):
                flags = MountFlag.BLOCK | (MountFlag.READONLY if m.mode == "ro" else 0)
                await conn.control(ControlOp.MOUNT, mount_request(m.guest, d["serial"], flags))
            await self.install_trust(entry, conn)
            if spec.containers:
                await containers.bring_up(conn, spec.default_env(), box=entry.name)

        for attempt in range(1, BOOT_ATTEMPTS + 1):
            try:
                return await self._bring_up(entry, engine, launch, boot, "start.after-launch", when_up)
            except HungBoot as exc:
                if attempt == BOOT_ATTEMPTS:
                    raise BootTimeout(
                        f"{exc.message}; in {attempt} boots its guest never opened the agent's port",
                        exc.console_tail,
                        box=entry.name,
                    ) from None
                log.warning(
                    "box %s: its guest never opened the agent's port (its last line %s); booting it again",
                    entry.name, exc.console_tail.strip().splitlines()[-1:],
                )  # fmt: skip
        raise AssertionError("unreachable")

    async def restore(
        self,
        entry: BoxEntry,
        rec: BoxRecord,
        snap: SnapshotRecord,
        *,
        attach: bool,
        disk: Path | None = None,
        drives: list[dict[str, Any]] | None = None,
        trust: bool = False,
    ) -> VM:
        """Start a VM on ``disk`` and ``drives`` (default: the box's) from ``snap``'s saved
        state and let it run; ``attach``: connect this process's session to its agent."""
        facts = snap.facts
        # the box's engine judges the state: one saved by the other engine is refused clearly
        engine = self.rt.engine(entry.spec.engine)
        boot = await self.prepare(entry, network=bool(facts.get("network")))
        engine.check_compatible(facts, boot)
        net = await asyncio.to_thread(self.net_spec, entry, nic=bool(facts.get("network")))
        top = disk or Path(rec.disk or "")
        where = self.rt.placement(rec, entry.hostname, facts["agent_ports"])
        directory = snapshots.snapshot_dir(self.rt.home, snap.id)
        timeout = entry.spec.boot_timeout_for(boot.accel)

        async def when_up(vm: VM) -> None:
            # loading a large state from a cold page cache may take longer than a boot
            await vm.run_restored(max(timeout, 60.0))
            if attach:
                conn = await self.attach(entry, vm, timeout, boot)
                if trust:
                    await self.install_trust(entry, conn)
                if self.frozen_for_saves(entry):  # saved so (BoxController.still): its shares go up too
                    await conn.thaw()

        async with contextlib.AsyncExitStack() as held:
            # a state forks map (its shared form, if it was given one) is loaded from its
            # files; a state of chunks, from chunks that stay until the VM has read them all
            source, served, memory = None, None, None
            if not engine.memory_shared(directory):
                source = await held.enter_async_context(chunks.reading(self.rt.home, self.rt.store, snap.id))
            if source is not None and (image := engine.lazy_image) is not None:
                # memory not on this host (a deep sleep): the guest runs as it is read
                touched = lazymem.touched_of(where.state_dir)
                served = await asyncio.to_thread(lazymem.lazily, self.rt.home, source, image, touched)
                if served is not None:
                    source, memory = source.leaving_out(image), served.memory
            launch = LaunchSpec(
                where=where, disk=top, memory_mib=facts["memory_mib"], cpus=facts["cpus"], network=net,
                boot=shape(boot, facts["memory_mib"], facts["cpus"], facts["agent_ports"], net),
                saved=SavedState(directory, facts, source, memory),
                volumes=shares_of(entry.spec),
                drives=drives_of(rec.drives if drives is None else drives, entry.spec),
            )  # fmt: skip
            try:
                return await self._bring_up(entry, engine, launch, boot, "restore.after-launch", when_up)
            except BaseException:
                if served is not None:  # a VM that never mapped it leaves it unused
                    await asyncio.to_thread(served.stop)
                raise

    async def _bring_up(
        self,
        entry: BoxEntry,
        engine: Engine,
        launch: LaunchSpec,
        boot: Boot,
        point: str,
        when_up: Callable[[VM], Awaitable[None]],
    ) -> VM:
        """In the admission line's turn: launch, record the VM at once, publish its ports
        and run ``when_up``; a VM that fails on the way is ended."""
        t0 = time.monotonic()
        async with self.admission(boot.accel).turn():
            vm = await engine.launch(launch)
            entry.vm = vm
            await self._record_vm(entry, vm, boot, launch.boot)
            if engine.host_processes:
                # ends the VM should its home be removed (core.homewatch); after the VM
                # exists, which a watcher that is letting go then still sees. From a worker
                # thread, as a pool's refiller: the boot does not wait for a fork. And the
                # home's metrics sampler (core.metrics).
                asyncio.get_running_loop().run_in_executor(None, home_helpers, self.rt.home)
            crash_point(point)
            try:
                await self._record_ports(entry, vm)
                await when_up(vm)
            except BaseException:
                await vm.kill(grace=0.5)
                entry.session.drop()
                raise
        entry.boot_seconds = time.monotonic() - t0
        return vm

    async def _record_vm(self, entry: BoxEntry, vm: VM, boot: Boot, record: dict[str, Any]) -> None:
        """The VM, in the row the moment it exists: its process, and all any process
        needs to find it again and save its state (the engine's boot record and the VM's shape)."""
        rec = await self.rt.db.update(entry.id, vm_pid=vm.ref.pid, vm_start=vm.ref.start, boot=record,
                                        engine=boot.engine)  # fmt: skip
        if rec is not None:
            entry.update(rec)

    async def _record_ports(self, entry: BoxEntry, vm: VM) -> None:
        """Keep in the record the host ports the engine bound for the box's published ports
        (its port keeper's, which it records itself, where it wakes on traffic)."""
        if not entry.spec.ports or entry.spec.wake_on_traffic:
            return
        try:
            bound = await vm.published_ports()
        except Exception as exc:  # QEMU refused a rule (a port in use): it says so on stderr
            raise vm.failure(f"could not publish the ports of box {entry.name}") from exc
        rec = await self.rt.db.update(entry.id, ports=[list(b) for b in bound])
        if rec is not None:
            entry.update(rec)

    async def attach(self, entry: BoxEntry, vm: VM, timeout: float, boot: Boot) -> AgentConnection:
        """Connect the box's session to a VM coming up, racing the VM's exit and the deadline."""
        deadline = time.monotonic() + timeout
        attaching = asyncio.ensure_future(entry.session.attach_booting(vm, self.hello(entry), deadline))
        exited = vm.exited()
        full = asyncio.ensure_future(_until_disk_full(vm))
        waiting: set[asyncio.Future[Any]] = {attaching, exited, full}
        try:
            done, _ = await asyncio.wait(
                waiting, timeout=max(0.0, deadline - time.monotonic()), return_when="FIRST_COMPLETED"
            )
        except BaseException:
            attaching.cancel()
            raise
        finally:
            full.cancel()
        if full in done and attaching not in done:
            attaching.cancel()
            with contextlib.suppress(BaseException):
                await attaching
            await vm.kill(grace=0.5)
            what = f"box {entry.name} could not boot: its disk could not grow"
            raise no_space(self.rt.home / "layers", what, box=entry.name)
        if attaching in done:
            try:
                return attaching.result()
            except (AgentTimeout, ConnectionLost, FileNotFoundError, ConnectionRefusedError):
                await vm.wait_exit(1.0)  # a socket that closed: the VM is probably going
                # reported below as the VM's exit or a boot timeout, with the console
        else:
            attaching.cancel()
            with contextlib.suppress(BaseException):
                await attaching
        if exited in done or not vm.running:
            await asyncio.sleep(0.05)  # let the console file catch up
            raise vm.failure("the VM exited before its agent answered")
        opened = await vm.agent_opened()
        await vm.kill(grace=0.5)
        load = os.getloadavg()[0]
        busy = (
            f"; the host was busy (load {load:.1f} on {os.cpu_count()} cores)"
            if load > (os.cpu_count() or 1)
            else ""
        )
        raise (HungBoot if opened is False else BootTimeout)(
            f"the agent did not answer within {timeout:.0f}s (accel={boot.accel}){busy}; start() tries again",
            vm.console_tail(),
            box=entry.name,
        )

    async def install_trust(self, entry: BoxEntry, conn: AgentConnection) -> None:
        """Make the guest trust the box's CA (for the hosts its secrets go to): the
        CA, a bundle the TLS environment variables name, and the system bundles."""
        if not entry.spec.secrets:
            return
        vault = await asyncio.to_thread(read_vault_json, entry.dir)
        if not vault:
            return
        ca = vault["ca_cert"].encode()
        with contextlib.suppress(FileNotFoundError):
            if await read_file(conn, GUEST_CA) == ca:
                return  # a restore of a state that has it (a fork, a rollback)
        bundle = b""
        for path in SYSTEM_BUNDLES:
            try:
                entries = await proto_files.fs_request(conn, FsOp.STAT, path, flags=FsFlag.NOFOLLOW)
                if not (entries and (entries[0].mode & 0o170000) == 0o100000):
                    continue  # a link to another bundle, which is done on its own
                data = await read_file(conn, path)
            except FileNotFoundError:
                continue
            if ca not in data:
                data = data.rstrip(b"\n") + b"\n" + ca
                await proto_files.write_stream(conn, path, data)
            bundle = bundle or data
        await proto_files.write_stream(conn, GUEST_BUNDLE, bundle or ca, mode=0o644)
        await proto_files.write_stream(conn, GUEST_CA, ca, mode=0o644)  # last: it says the rest is done


def boot_request(spec: BoxSpec, *, network: bool) -> BootRequest:
    """What the engine is asked to boot, from the box's spec."""
    return BootRequest(
        accel=spec.accel, kernel=spec.kernel, volumes=bool(spec.volumes), network=network,
        disk_gb=spec.disk_size_gb, disk_required=spec.disk_size_gb != DEFAULT_DISK_GB,
        nested_virt=spec.nested_virt, containers=spec.containers, drives=len(spec.mounts), aslr=spec.aslr,
    )  # fmt: skip


def shares_of(spec: BoxSpec) -> tuple[Volume, ...]:
    """The engine's shares of a box's host directories, tagged by their order (the
    agent mounts each by its tag; a VM restored from a save has the same devices)."""
    return tuple(Volume(v.host, f"vol{i}", v.readonly, v.guest) for i, v in enumerate(spec.volumes))


def drives_of(drives: list[dict[str, Any]], spec: BoxSpec | None = None) -> tuple[Drive, ...]:
    """The engine's drives of a box's (or a state's) volume tops, in their order, with
    where the box mounts each (``spec``'s mounts, in the same order)."""
    mounts = spec.mounts if spec is not None else []
    out = []
    for i, d in enumerate(drives):
        m = mounts[i] if i < len(mounts) else None
        ro = m is not None and m.mode == "ro"
        out.append(Drive(Path(d["top"]), d["serial"], guest=m.guest if m else "", guest_readonly=ro))
    return tuple(out)


def mount_request(guest: str, source: str, flags: int) -> bytes:
    return tlv(Tag.PATH, guest) + tlv(Tag.PATH2, source) + tlv(Tag.FLAGS, int(flags))


def shape(boot: Boot, memory_mib: int, cpus: int, agent_ports: int, net: NetSpec | None) -> dict[str, Any]:
    """A VM's launch record: how the engine booted it, and its shape, which a state
    saved from it (by any process, later) must record."""
    return {**boot.record, "memory_mib": memory_mib, "cpus": cpus, "agent_ports": agent_ports,
            "network": net is not None}  # fmt: skip


async def read_file(conn: AgentConnection, path: str) -> bytes:
    _size, _mode, chunks = await proto_files.read_stream(conn, path)
    return b"".join([chunk async for chunk in chunks])
