"""``Box`` and ``AsyncBox``: a durable microVM with its own kernel, disk and processes.

A box is a row in the home's state store plus a directory with its disk and
logs; its QEMU runs detached, so the box outlives the Python process that made
it. ``sandlot.get(name)`` from any process finds it again, and several
processes can run commands in one box at once (each takes its own agent port).

``AsyncBox`` is the implementation; ``Box`` is a thin sync facade that runs the
same coroutines on sandlot's loop thread.

>>> import sandlot
>>> with sandlot.Box("python:3.12-slim") as box:             # doctest: +SKIP
...     print(box.exec("python3", "-c", "print(6*7)").stdout)
42
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import logging
import os
import secrets as random_ids
import shlex
import sys
import time
from collections.abc import AsyncIterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .. import _proc, snapshots
from ..engine import hostcgroup
from ..engine.qemu import NetConfig, QemuVM, VMConfig, qemu_version, tail
from ..errors import (
    AgentTimeout,
    BootTimeout,
    BoxCrashed,
    BoxNotFound,
    ConnectionLost,
    InvalidArgument,
    InvalidState,
)
from ..images.rootfs import base_for, create_overlay
from ..images.store import Image
from ..net.policy import PROXIED, Policy, write_policy
from ..net.secrets import (
    GUEST_BUNDLE,
    GUEST_CA,
    SYSTEM_BUNDLES,
    Secret,
    build_vault,
    read_vault_json,
    write_vault,
)
from ..protocol.connection import AgentConnection
from ..protocol.exec import ExecRequest, RemoteProcess
from ..protocol.wire import ControlOp, Fields, T, Tag, tlv, tlv_u64
from ..runtime import Runtime
from ..store import BoxRecord, SnapshotRecord, validate_name
from . import _sync
from .files import AsyncFiles, Files, guest_path
from .options import (
    DEFAULT_DISK_GB,
    DEFAULT_MEMORY_MIB,
    BoxSpec,
    PortSpec,
    VolumeSpec,
    check_env,
    check_user,
    positive,
)
from .process import AsyncProcess, ExecResult, Process
from .snapshot import AsyncSnapshot, Snapshot, check_template_fits, resolve_snapshot

GiB = 1 << 30
log = logging.getLogger("sandlot")
AGENT_PORTS = 8  # processes that can be attached to one box at the same time
LOCK_TIMEOUT = 300.0

StdinSource = bytes | str | IO[bytes] | AsyncIterable[bytes] | None


def _default_boot_timeout(accel: str) -> float:
    env = os.environ.get("SANDLOT_BOOT_TIMEOUT")
    if env:
        return float(env)
    return 15.0 if accel == "kvm" else 30.0


def _argv(argv: Sequence[Any]) -> tuple[str, ...]:
    if not argv:
        raise InvalidArgument("a command needs at least a program name")
    out = []
    for a in argv:
        if isinstance(a, os.PathLike):
            a = os.fspath(a)
        if not isinstance(a, str):
            raise InvalidArgument(f"command arguments must be strings, not {type(a).__name__}: {a!r}")
        if "\0" in a:
            raise InvalidArgument("command argument contains a NUL byte")
        out.append(a)
    if not out[0]:
        raise InvalidArgument("empty program name")
    return tuple(out)


def _try_flock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _flock_wait(path: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        fd = _try_flock(path)
        if fd is not None:
            return fd
        if time.monotonic() > deadline:
            raise InvalidState(f"another process has been busy with this box for {timeout:.0f}s")
        time.sleep(0.02)


class AsyncBox:
    """A microVM sandbox (async API).

    ``AsyncBox(image)`` describes a box; ``start()`` creates it (pulling the image
    if needed) and boots it. ``async with AsyncBox(image) as box`` does the same
    and removes the box when the block ends; pass ``keep=True`` to leave it
    running instead (find it again later with ``sandlot.get(name)``). A box whose
    ``with`` block never ended because its process died is removed by the next
    sandlot call in any process.
    """

    def __init__(
        self,
        image: str | Image | None = None,
        *,
        rootfs: str | os.PathLike[str] | None = None,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        volumes: Sequence[VolumeSpec] | Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        memory_mib: int = DEFAULT_MEMORY_MIB,
        cpus: int = 1,
        disk_size_gb: int = DEFAULT_DISK_GB,
        auto_remove: bool = False,
        keep: bool = False,
        pull: str = "missing",
        insecure: bool = False,
        ca_cert: str | os.PathLike[str] | None = None,
        credentials: tuple[str, str] | None = None,
        accel: str = "auto",
        kernel: str | os.PathLike[str] | None = None,
        hostname: str | None = None,
        boot_timeout: float | None = None,
        request_timeout: float = 30.0,
        idle_timeout: float | None = None,
        network: str | bool | None = None,
        allow: Sequence[str] | str | None = None,
        ports: Sequence[PortSpec] | None = None,
        pids_limit: int | None = None,
        secrets: Sequence[Secret] | None = None,
        template: Any = None,
        home: str | os.PathLike[str] | None = None,
    ) -> None:
        if pull not in ("missing", "always", "never"):
            raise InvalidArgument(f"pull must be 'missing', 'always' or 'never', not {pull!r}")
        self.runtime = Runtime.for_home(home)
        self._template: SnapshotRecord | None = None
        self._auto_template = template is None and os.environ.get("SANDLOT_AUTO_TEMPLATE", "1") != "0"
        self._auto_key: str | None = None
        if template is not None and template is not False:
            self._template = resolve_snapshot(self.runtime, template, kinds=("template", "snapshot"))
            if image is None and rootfs is None:
                tmpl_opts = self._template.options
                image, rootfs = tmpl_opts.get("image_ref"), tmpl_opts.get("rootfs")
            facts = self._template.options["vm"]
            # the template's shape, unless the caller asked for another (which check_template_fits refuses)
            if memory_mib == DEFAULT_MEMORY_MIB:
                memory_mib = facts["memory_mib"]
            if cpus == 1:
                cpus = facts["cpus"]
            if disk_size_gb == DEFAULT_DISK_GB:
                disk_size_gb = self._template.options["box"].get("disk_size_gb", disk_size_gb)
            if pids_limit is None:
                pids_limit = self._template.options["box"].get("pids_limit")
            saved_box = self._template.options["box"]
            # what its commands ran with, unless given anew: a fork is the same box
            env = saved_box.get("env") if env is None else env
            workdir = saved_box.get("workdir") if workdir is None else workdir
            user = saved_box.get("user") if user is None else user
            if network is None and allow is None:  # its network policy too (its ports stay its own)
                network = self._template.options["box"].get("network", "none")
                allow = self._template.options["box"].get("allow") or None
        self.image: Image | None = image if isinstance(image, Image) else None
        image_ref = image.digest if isinstance(image, Image) else image
        self.spec = BoxSpec.build(
            image_ref, rootfs=rootfs, name=name, env=env, workdir=workdir, user=user, volumes=volumes,
            labels=labels, memory_mib=memory_mib, cpus=cpus, disk_size_gb=disk_size_gb,
            auto_remove=auto_remove, accel=accel, kernel=kernel, hostname=hostname,
            boot_timeout=boot_timeout, request_timeout=request_timeout, idle_timeout=idle_timeout,
            network=network, allow=allow, ports=ports, pids_limit=pids_limit, secrets=secrets,
            saved_secrets=self._template.options["box"].get("secrets", []) if self._template else (),
            saved=self._template is not None,
        )  # fmt: skip
        self._secrets = list(secrets or [])  # the values: kept in the box's secrets file, not its record
        if self._template is not None:
            check_template_fits(self._template, self.spec)
        self.id = random_ids.token_hex(6)
        self.name = self.spec.name or f"box-{self.id[:6]}"
        self.keep = keep
        self._pull = pull
        self._pull_opts: dict[str, Any] = {
            "insecure": insecure,
            "ca_cert": Path(ca_cert) if ca_cert else None,
            "credentials": credentials,
        }
        self._record: BoxRecord | None = None
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self._resumed = asyncio.Event()
        self._vm: QemuVM | None = None
        self._conn: AgentConnection | None = None
        self._port_fd: int | None = None
        self._lock = asyncio.Lock()
        self.files = AsyncFiles(self._connection)
        self.boot_seconds: float | None = None
        self.last_pause: float | None = None  # seconds the last snapshot or suspend paused the VM

    @classmethod
    def _from_record(cls, runtime: Runtime, rec: BoxRecord) -> AsyncBox:
        box = cls.__new__(cls)
        box.runtime = runtime
        box.spec = BoxSpec.from_options(rec.options)
        box.id, box.name = rec.id, rec.name
        box.image = None
        box.keep = True
        box._pull, box._pull_opts = "never", {}
        box._template, box._auto_template, box._auto_key = None, False, None
        box._secrets = []
        box._record = rec
        box._init_runtime_state()
        return box

    # -- finding boxes --------------------------------------------------------------------

    @classmethod
    def get(cls, key: str, *, home: str | os.PathLike[str] | None = None) -> AsyncBox:
        """The box with this id, name or id prefix (BoxNotFound if none)."""
        rt = Runtime.for_home(home)
        rec = rt.reconcile(rt.store.get(key))
        if rec is None:
            raise BoxNotFound(f"no box {key!r}")
        return cls._from_record(rt, rec)

    @classmethod
    def list(
        cls,
        *,
        all: bool = True,
        state: str | None = None,
        labels: Mapping[str, str] | None = None,
        home: str | os.PathLike[str] | None = None,
    ) -> builtins.list[AsyncBox]:
        """Boxes of this home, oldest first. ``all=False``: only running or paused ones;
        ``state``: only that state; ``labels``: only boxes carrying all of them."""
        rt = Runtime.for_home(home)
        out = []
        for rec in rt.store.list():
            rec2 = rt.reconcile(rec)
            if rec2 is None:
                continue
            if not all and rec2.state not in ("running", "paused"):
                continue
            if state is not None and rec2.state != state:
                continue
            if labels and any(rec2.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(cls._from_record(rt, rec2))
        return out

    # -- facts ----------------------------------------------------------------------------

    @property
    def record(self) -> BoxRecord:
        """The box's current row, reconciled with its process (BoxNotFound once removed)."""
        rec = self.runtime.reconcile(self.runtime.store.get(self.id))
        if rec is None:
            raise BoxNotFound(f"box {self.name} was removed")
        self._record = rec
        return rec

    @property
    def state(self) -> str:
        """created, running, paused, stopped or crashed ("removed" once it is gone;
        "new" before it was created)."""
        if self._record is None:
            return "new"
        try:
            return self.record.state
        except BoxNotFound:
            return "removed"

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def hostname(self) -> str:
        return self.spec.hostname or _hostname_for(self.name)

    @property
    def accel(self) -> str | None:
        return (self._record.options.get("_accel") if self._record else None) or None

    @property
    def state_dir(self) -> Path:
        return self.runtime.boxes_dir / self.id

    @property
    def disk_path(self) -> Path:
        """The top layer of the box's disk (it changes with each snapshot)."""
        rec = self._record
        if rec is not None and rec.disk:
            return Path(rec.disk)
        return self.state_dir / "disk.qcow2"  # a box made before disks had layers

    @property
    def console_log(self) -> Path:
        return self.state_dir / "console.log"

    def logs(self, lines: int | None = None) -> str:
        """The guest console (kernel and agent messages) of the last boot."""
        if lines is None:
            try:
                return self.console_log.read_text(errors="replace")
            except FileNotFoundError:
                return ""
        return tail(self.console_log, lines)

    def console_tail(self, lines: int = 40) -> str:
        return tail(self.console_log, lines)

    def inspect(self) -> dict[str, Any]:
        """Everything about the box, JSON-ready."""
        rec = self.record
        d = rec.to_json()
        d["paths"] = {
            "dir": str(self.state_dir),
            "disk": str(self.disk_path),
            "console": str(self.console_log),
        }
        d["hostname"] = self.hostname
        live = rec.state in ("running", "paused")  # host ports are bound while the VM runs
        bound = {guest: (address, host) for address, host, guest in rec.options.get("_ports", []) if live}
        ports = []
        for p in self.spec.ports:
            address, host = bound.get(p.guest, (p.address, p.host))
            ports.append({"address": address, "host": host or None, "guest": p.guest})
        d["network"] = {"mode": self.spec.network, "allow": list(self.spec.allow), "ports": ports}
        placement = hostcgroup.placement_of(rec.qemu_pid) if live and rec.qemu_pid else None
        d["host_cgroup"] = placement.report() if placement else None
        return d

    def port(self, guest_port: int) -> tuple[str, int]:
        """(host address, host port) where the box's published ``guest_port`` is reachable."""
        for p in self.inspect()["network"]["ports"]:
            if p["guest"] == guest_port and p["host"]:
                return p["address"], p["host"]
        raise InvalidArgument(f"box {self.name} does not publish port {guest_port} (or is not running)")

    def stats(self) -> dict[str, Any]:
        """Host CPU time and memory of the VM, and the disk it uses."""
        rec = self.record
        out: dict[str, Any] = {"name": rec.name, "state": rec.state, "cpu_seconds": None, "rss_bytes": None}
        try:
            out["disk_bytes"] = self.disk_path.stat().st_blocks * 512
        except FileNotFoundError:
            out["disk_bytes"] = 0
        if rec.state in ("running", "paused") and _proc.alive(rec.qemu_pid, rec.qemu_start):
            try:
                stat = Path(f"/proc/{rec.qemu_pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                ticks = os.sysconf("SC_CLK_TCK")
                out["cpu_seconds"] = round((int(fields[11]) + int(fields[12])) / ticks, 2)
                for line in Path(f"/proc/{rec.qemu_pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out["rss_bytes"] = int(line.split()[1]) * 1024
            except (OSError, ValueError, IndexError):
                pass
        return out

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    async def create(cls, image: str | Image | None = None, **kwargs: Any) -> AsyncBox:
        """Create a box (disk ready, image pulled) without starting it."""
        box = cls(image, **kwargs)
        await box._create()
        return box

    async def _create(self, *, ephemeral: bool = False) -> None:
        if self._record is not None:
            return
        rt = self.runtime
        pid, start = _proc.me()
        now = time.time()
        rec = BoxRecord(
            id=self.id, name=self.name, state="creating", options=self.spec.to_options(), created_at=now,
            updated_at=now, image_ref=self.spec.image, rootfs=self.spec.rootfs, labels=dict(self.spec.labels),
            owner_pid=pid, owner_start=start, ephemeral=ephemeral,
        )  # fmt: skip
        rt.store.insert(rec)  # reserves the name; a crash from here on is undone by reconcile
        try:
            if self._template is None and self._auto_template and self.spec.image and not self.spec.volumes:
                image = await self._resolve_image()
                self._template = await asyncio.to_thread(self._find_auto_template, image.digest)
            if self._template is not None:
                await self._create_from(self._template)
                return
            digest = None
            if self.spec.image is not None:
                image = await self._resolve_image()
                digest = image.digest
                c = image.config
                self.spec.image_config = {"env": list(c.env), "workdir": c.workdir, "user": c.user,
                                          "entrypoint": list(c.entrypoint), "cmd": list(c.cmd)}  # fmt: skip
                base = await asyncio.to_thread(rt.images.ensure_base, image)
            else:
                assert self.spec.rootfs is not None
                base = await asyncio.to_thread(base_for, rt.bases_dir, self.spec.rootfs)
            self.state_dir.mkdir(parents=True, exist_ok=True)
            (self.state_dir / "ports").mkdir(exist_ok=True)
            await self._write_vault(None)
            disk = snapshots.layers_dir(rt.home) / f"{random_ids.token_hex(8)}.qcow2"
            disk.parent.mkdir(parents=True, exist_ok=True)
            rt.store.update(self.id, disk=str(disk))  # before the file: a crash leaves nothing unnamed
            await asyncio.to_thread(create_overlay, base, disk, self.spec.disk_size_gb * GiB)
            updated = rt.store.update(
                self.id,
                expect=("creating",),
                state="created",
                image_digest=digest,
                options={**self.spec.to_options(), "_machine_id": random_ids.token_hex(16)},
            )
        except BaseException:
            self.runtime.discard_box(self.id)
            raise
        if updated is None:
            raise BoxNotFound(f"box {self.name} was removed while it was being created")
        self._record = updated

    async def _create_from(self, snap: SnapshotRecord) -> None:
        """The disk of a box started from a saved state: a new layer on the snapshot's."""
        rt = self.runtime
        self.spec.image_config = snap.options["box"].get("image_config")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "ports").mkdir(exist_ok=True)
        if self.spec.secrets:
            source = rt.store.find(snap.box_id) if snap.box_id else None
            await self._write_vault(read_vault_json(rt.boxes_dir / source.id) if source else None)
        disk = await asyncio.to_thread(snapshots.child_layer, rt.home, snap)
        updated = rt.store.update(
            self.id, expect=("creating",), state="created", disk=str(disk), origin=snap.id,
            image_digest=snap.options.get("image_digest"),
            options={**self.spec.to_options(), "_machine_id": random_ids.token_hex(16)},
        )  # fmt: skip
        if updated is None:
            raise BoxNotFound(f"box {self.name} was removed while it was being created")
        self._record = updated

    async def _write_vault(self, source: dict[str, Any] | None) -> None:
        """The box's secrets file, if it has secrets (``source``: that of the box its
        saved state was taken of)."""
        if self.spec.secrets:  # a CA is made (EC keys) and the file fsynced: off the event loop
            vault = await asyncio.to_thread(build_vault, self.name, self.spec.secrets, self._secrets, source)
            await asyncio.to_thread(write_vault, self.state_dir, vault)

    async def _install_trust(self) -> None:
        """Make the guest trust the box's CA (for the hosts its secrets go to): the
        CA, a bundle the TLS environment variables name, and the system bundles."""
        vault = read_vault_json(self.state_dir) if self.spec.secrets else None
        if not vault:
            return
        conn = self._conn
        assert conn is not None

        async def booting() -> AgentConnection:  # the box is not "running" yet
            return conn

        files = AsyncFiles(booting)
        ca = vault["ca_cert"].encode()
        with contextlib.suppress(FileNotFoundError):
            if await files.read(GUEST_CA) == ca:
                return  # a restore of a state that has it (a fork, a rollback)
        bundle = b""
        for path in SYSTEM_BUNDLES:
            try:
                if (await files.stat(path, follow_symlinks=False)).type != "file":
                    continue  # a link to another bundle, which is done on its own
                data = await files.read(path)
            except FileNotFoundError:
                continue
            if ca not in data:
                data = data.rstrip(b"\n") + b"\n" + ca
                await files.write(path, data)
            bundle = bundle or data
        await files.write(GUEST_BUNDLE, bundle or ca, mode=0o644)
        await files.write(GUEST_CA, ca, mode=0o644)  # last: it says the rest is done

    def _template_key(self, image_digest: str) -> str:
        """What an automatic template must share with a box to stand in for its boot."""
        import hashlib
        import json

        assets = self.runtime.assets(kernel=self.spec.kernel, accel=self.spec.accel)
        key = [image_digest, self.spec.memory_mib, self.spec.cpus, self.spec.disk_size_gb, assets.accel.name,
               assets.kernel.sha256, assets.agent.digest, str(assets.initrd), qemu_version()]  # fmt: skip
        if self.spec.policy.has_nic:  # a network card is part of the saved device state
            key.append("nic")
        if self.spec.policy.proxied:  # so is the guest's resolver, chosen at boot (the relay)
            key.append("dns-relay")
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]

    def _find_auto_template(self, image_digest: str) -> SnapshotRecord | None:
        key = self._template_key(image_digest)
        self._auto_key = key
        for snap in self.runtime.store.snapshots(kind="template"):
            if snap.template_key == key and snap.name is None:
                found: SnapshotRecord = snap
                return found
        return None

    async def _resolve_image(self) -> Image:
        if self.image is not None:
            return self.image
        assert self.spec.image is not None
        images = self.runtime.images
        found = None if self._pull == "always" else images.get(self.spec.image)
        if found is None:
            if self._pull == "never":
                raise InvalidArgument(f"image {self.spec.image!r} is not here and pull='never'")
            found = await images.pull(self.spec.image, **self._pull_opts)
        self.image = found
        return found

    def default_command(self, command: Sequence[str] | None = None) -> builtins.list[str]:
        """What ``docker run IMAGE [command]`` would run: Entrypoint + (command or Cmd)."""
        cfg = self.spec.image_config
        if cfg is None and self.image is not None:
            cfg = {"entrypoint": list(self.image.config.entrypoint), "cmd": list(self.image.config.cmd)}
        if cfg is None:
            if not command:
                raise InvalidArgument("a root filesystem has no default command; give one")
            return list(command)
        argv = [*cfg.get("entrypoint", []), *(command if command else cfg.get("cmd", []))]
        if not argv:
            raise InvalidArgument(f"image {self.spec.image} has no Entrypoint or Cmd; give a command")
        return argv

    # -- lifecycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _box_lock(self) -> Any:
        """Serialises lifecycle changes of this box across processes."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = await asyncio.to_thread(_flock_wait, self.state_dir / "lock", LOCK_TIMEOUT)
        try:
            yield
        finally:
            os.close(fd)

    async def __aenter__(self) -> AsyncBox:
        await self._create(ephemeral=not self.keep)
        try:
            await self.start()
        except BaseException:
            if not self.keep:  # __aexit__ will not run: do its work
                with contextlib.suppress(Exception):
                    await self.remove(force=True)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.keep:
            self._disconnect()
            if self.state != "removed":
                self.runtime.store.update(self.id, ephemeral=False)
        else:
            await self.remove(force=True)

    def _vm_config(self, rec: BoxRecord, assets: Any) -> VMConfig:
        volumes = [(v.host, f"vol{i}", v.readonly) for i, v in enumerate(self.spec.volumes)]
        return VMConfig(
            kernel=Path(rec.options.get("_kernel") or assets.kernel.vmlinux),
            initrd=Path(rec.options.get("_initrd") or assets.initrd),
            disk=self.disk_path,
            run_dir=self.runtime.run_dir(self.id),
            state_dir=self.state_dir,
            accel=rec.options.get("_accel") or assets.accel.name,
            memory_mib=self.spec.memory_mib,
            cpus=self.spec.cpus,
            hostname=self.hostname,
            ports=AGENT_PORTS,
            volumes=volumes,
            network=self._net_config(),
        )

    def _options_without(self, *keys: str) -> dict[str, Any]:
        """The record's options as they are now, less ``keys``."""
        rec = self.runtime.store.find(self.id) or self.record
        return {k: v for k, v in rec.options.items() if k not in keys}

    async def _record_ports(self, vm: QemuVM) -> None:
        """Keep in the record the host ports QEMU bound for this box's published ports."""
        if not vm.cfg.network or not vm.cfg.network.forwards:
            return
        try:
            bound = await vm.host_forwards()
        except Exception as exc:  # QEMU refused a rule (a port in use): it says so on stderr
            raise vm.failure_report(f"could not publish the ports of box {self.name}") from exc
        rec = self.runtime.store.find(self.id)
        if rec is not None:
            self.runtime.store.update(self.id, options={**rec.options, "_ports": [list(b) for b in bound]})

    def _net_config(self, nic: bool | None = None) -> NetConfig | None:
        """The network card of this box's VM (None: it has none), its policy written
        where the egress proxy reads it. ``nic``: whether the VM must have one (a
        restore has the devices of its saved state, whatever the policy now says:
        a card under policy 'none' lets nothing in or out)."""
        rec = self.runtime.store.find(self.id) if self._record is not None else None
        if rec is not None:  # set_network in another process may have changed it since
            self.spec.network = rec.options.get("network", self.spec.network)
            self.spec.allow = rec.options.get("allow", self.spec.allow)
        policy = self.spec.policy
        if nic is None:
            nic = policy.has_nic
        if not nic:
            return None
        if not policy.has_nic:
            return NetConfig(restrict=True)
        policy_file = self.state_dir / "egress-policy.json"
        write_policy(policy_file, policy)

        def helper(module: str) -> str:  # started by QEMU for each guest connection
            argv = (sys.executable, "-m", module, str(policy_file), str(self.state_dir / "egress.log"))
            return " ".join(shlex.quote(x) for x in argv)

        proxy = helper("sandlot.net.proxy") if policy.proxied else None
        # open mode too: a guest restored from a snapshot of a proxied box asks it for names
        dns = helper("sandlot.net.dns")
        forwards = [(p.address, p.host, p.guest) for p in self.spec.ports]
        restrict = policy.mode != "open"
        return NetConfig(restrict=restrict, proxy_command=proxy, dns_command=dns, forwards=forwards,
                         transparent_ports=self.spec.transparent_ports())  # fmt: skip

    def _existing_vm(self, rec: BoxRecord) -> QemuVM:
        """The VM process of a box started elsewhere (or earlier)."""
        if self._vm is not None and self._vm.pid == rec.qemu_pid:
            return self._vm
        o = rec.options
        cfg = VMConfig(
            kernel=Path(o.get("_kernel", "")), initrd=Path(o.get("_initrd", "")), disk=self.disk_path,
            run_dir=self.runtime.run_dir(self.id), state_dir=self.state_dir, accel=o.get("_accel", "tcg"),
            memory_mib=self.spec.memory_mib, cpus=self.spec.cpus, hostname=self.hostname, ports=AGENT_PORTS,
        )  # fmt: skip
        assert rec.qemu_pid is not None
        self._vm = QemuVM.attach(cfg, rec.qemu_pid, rec.qemu_start)
        return self._vm

    async def start(self) -> AsyncBox:
        """Boot the box (creating it first if needed) and wait for its agent.
        A running box is left as it is; the disk is kept across stop/start."""
        await self._create()
        if self.record.state == "suspended":
            await self.resume()
            return self
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state == "running":
                return self
            if rec.state == "paused":
                raise InvalidState(f"box {self.name} is paused: unpause() it")
            if rec.state not in ("created", "stopped", "crashed"):
                raise InvalidState(f"box {self.name} is {rec.state}")
            origin = self.runtime.store.find_snapshot(rec.origin) if rec.origin else None
            if rec.state == "created" and origin is not None:
                await self._start_from(origin, rec)
                return self
            t0 = time.monotonic()
            flavor = "generic" if self.spec.volumes else "cloud"  # the cloud kernel has no 9p
            extra: tuple[str, ...] = ("9p", "9pnet_virtio") if self.spec.volumes else ()
            if self.spec.policy.has_nic:
                extra += ("virtio_net",)
            assets = await asyncio.to_thread(
                self.runtime.assets,
                kernel=self.spec.kernel,
                accel=self.spec.accel,
                flavor=flavor,
                extra_modules=extra,
            )
            options = {**rec.options, "_kernel": str(assets.kernel.vmlinux), "_initrd": str(assets.initrd),
                       "_accel": assets.accel.name}  # fmt: skip
            rec = self.runtime.store.update(self.id, options=options) or rec
            vm = QemuVM(self._vm_config(rec, assets))
            await vm.start()
            self._vm = vm
            pid, start = _proc.me()
            self.runtime.store.update(
                self.id, state="starting", qemu_pid=vm.pid, qemu_start=vm.start_time, owner_pid=pid,
                owner_start=start, reason=None,
            )  # fmt: skip
            timeout = self.spec.boot_timeout or _default_boot_timeout(assets.accel.name)
            try:
                await self._record_ports(vm)  # recorded, so a failure here kills the VM below
                self._conn = await self._boot_attach(vm, timeout)
                for i, v in enumerate(self.spec.volumes):
                    mount = (
                        tlv(Tag.PATH, v.guest) + tlv(Tag.PATH2, f"vol{i}") + tlv(Tag.FLAGS, int(v.readonly))
                    )
                    await self._control(ControlOp.MOUNT, mount, conn=self._conn)  # still "starting"
                await self._install_trust()
            except BaseException as exc:
                await vm.kill(grace=0.5)
                self._disconnect()
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.runtime.store.update(
                    self.id, state="crashed", reason=f"boot failed: {reason}", qemu_pid=None
                )
                raise
            self.runtime.store.update(self.id, state="running", started_at=time.time())
            self.boot_seconds = time.monotonic() - t0
            self._watch_idle()
            # the image's first boot: later boxes restore it instead (not a box with secrets:
            # its disk now trusts its own CA, which no other box should)
            if self._auto_key is not None and not self.spec.secrets:
                try:
                    await self._capture("template", template_key=self._auto_key)
                except Exception as exc:  # a box that booted is never failed for its template
                    log.warning("could not make a template of %s: %s", self.spec.image, exc)
            return self

    async def _start_from(self, snap: SnapshotRecord, rec: BoxRecord) -> None:
        """First start of a box made from a snapshot or template: restore, not boot."""
        t0 = time.monotonic()
        facts = snap.options["vm"]
        assets = await asyncio.to_thread(self.runtime.assets, kernel=self.spec.kernel, accel=self.spec.accel)
        snapshots.check_compatible(facts, assets.accel.name)
        options = {**rec.options, "_kernel": str(assets.kernel.vmlinux), "_initrd": str(assets.initrd),
                   "_accel": facts["accel"]}  # fmt: skip
        pid, start = _proc.me()
        rec = self.runtime.store.update(self.id, state="starting", options=options, owner_pid=pid,
                                        owner_start=start, reason=None) or rec  # fmt: skip
        try:
            await self._resume_vm(snap, rec, attach=True)
            await self._install_trust()
        except BaseException as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self._vm is not None:  # it may have come up before what failed
                await self._vm.kill(grace=0.5)
            self._disconnect()
            self.runtime.store.update(
                self.id, state="crashed", reason=f"start failed: {reason}", qemu_pid=None
            )
            raise
        self.runtime.store.update(self.id, state="running", started_at=time.time())
        self.boot_seconds = time.monotonic() - t0
        self._watch_idle()

    async def _resume_vm(self, snap: SnapshotRecord, rec: BoxRecord, *, attach: bool) -> QemuVM:
        """Start QEMU on ``rec``'s disk from ``snap``'s saved state, let it run, and
        (``attach``) connect to its agent. The row gets the QEMU pid at once, so a
        crash of this process leaves nothing reconciliation cannot find."""
        facts = snap.options["vm"]
        o = rec.options
        cfg = VMConfig(
            kernel=Path(o.get("_kernel") or facts["kernel"]),
            initrd=Path(o.get("_initrd") or facts["initrd"]),
            disk=Path(rec.disk or self.disk_path), run_dir=self.runtime.run_dir(self.id),
            state_dir=self.state_dir, accel=facts["accel"], memory_mib=facts["memory_mib"],
            cpus=facts["cpus"], hostname=self.hostname, ports=facts["ports"],
            network=self._net_config(nic=bool(facts.get("network"))),
        )  # fmt: skip
        timeout = self.spec.boot_timeout or _default_boot_timeout(facts["accel"])

        def started(vm: QemuVM) -> None:
            self._vm = vm
            self.runtime.store.update(self.id, qemu_pid=vm.pid, qemu_start=vm.start_time)

        vm = await snapshots.start_from(self.runtime.home, snap, cfg, on_started=started)
        try:
            await self._record_ports(vm)
            # attaching races QEMU's exit, so a failed load is reported either way
            await vm.run_restored(wait=not attach)
            if attach:
                self._conn = await self._boot_attach(vm, timeout)
        except BaseException:
            await vm.kill(grace=0.5)
            self._disconnect()
            raise
        return vm

    async def _capture(
        self, kind: str, *, name: str | None = None, template_key: str | None = None, auto: bool = False
    ) -> AsyncSnapshot:
        """Save the running state (locks held by the caller); the box goes on."""
        if self.spec.volumes:
            raise InvalidState(
                f"box {self.name} has volumes: their host directories are not part of a saved state"
            )
        rec = self.record
        if rec.state not in ("running", "paused"):
            raise InvalidState(
                f"box {self.name} is {rec.state}: only a running or paused box has a state to save"
            )
        pid, start = _proc.me()
        self.runtime.store.update(self.id, state="snapshotting", owner_pid=pid, owner_start=start)
        try:
            snap, pause = await snapshots.capture(
                self.runtime,
                self._existing_vm(rec),
                rec,
                kind=kind,
                name=name,
                template_key=template_key,
                options={"auto": True} if auto else None,
            )
        finally:
            self.runtime.store.update(self.id, expect=("snapshotting",), state=rec.state)
        self.last_pause = pause
        return AsyncSnapshot(self.runtime, snap)

    # -- live state -------------------------------------------------------------------------------

    async def snapshot(self, name: str | None = None) -> AsyncSnapshot:
        """Save memory, processes and disk while the box runs (it pauses only for the
        save; ``last_pause`` says how long). Roll back to it, or start boxes from it."""
        if name is not None:
            validate_name(name)
        async with self._lock, self._box_lock():
            return await self._capture("snapshot", name=name)

    async def fork(self, n: int = 1, *, name: str | None = None) -> builtins.list[AsyncBox]:
        """``n`` running copies of this box, from a snapshot taken now; see ``AsyncSnapshot.start``."""
        async with self._lock, self._box_lock():
            snap = await self._capture("snapshot", auto=True)  # removed with its last child
        return await snap.start(n, name=name or self.name, _as_prefix=True)

    async def rollback(self, snapshot: Any) -> None:
        """Take this box back to one of its snapshots: memory, processes and disk.
        Same id and name; commands running now end (their connection ends with ConnectionLost)."""
        rt = self.runtime
        snap = resolve_snapshot(rt, snapshot, box_id=self.id, kinds=("snapshot",))
        if snap.box_id != self.id:
            raise InvalidArgument(
                f"snapshot {snap.name or snap.id} is of box {snap.box_name}; a box rolls back to its own "
                "snapshots (snapshot.start() makes a new box from any)"
            )
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state not in ("running", "paused", "stopped", "crashed", "suspended", "created"):
                raise InvalidState(f"box {self.name} is {rec.state}")
            frozen = Path(snap.layer)
            top = await asyncio.to_thread(
                snapshots.new_layer, rt.home, frozen, snapshots.virtual_size(frozen)
            )
            pid, start = _proc.me()
            base_opts = {k: v for k, v in rec.options.items() if k not in ("_op", "_suspend")}
            rt.store.update(self.id, state="restoring", owner_pid=pid, owner_start=start,
                            options={**base_opts, "_op": {"disk": str(top)}})  # fmt: skip
            self._disconnect()  # first: its end must not look like a crash to reconnect from
            if rec.qemu_pid and _proc.alive(rec.qemu_pid, rec.qemu_start):
                old = self._existing_vm(rec)
                await old.kill(grace=0.5)
                vm_cleanup(old)
            try:
                await self._resume_vm(snap, replace_disk(rec, top), attach=True)
            except BaseException as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                reason = f"rollback failed, the disk is as it was before: {reason}"
                rt.store.update(self.id, state="stopped", qemu_pid=None, options=base_opts, reason=reason)
                snapshots.gc_layers(rt, also=[top])
                raise
            rt.store.update(
                self.id, state="running", disk=str(top), options=self._options_without("_op", "_suspend"),
                started_at=time.time(),
            )  # fmt: skip
            old_suspend = rec.options.get("_suspend")
            if old_suspend:
                rt.store.delete_snapshot(old_suspend)
                snapshots.remove_files(rt.home, old_suspend)
            if rec.disk:
                await asyncio.to_thread(snapshots.gc_layers, rt, also=[Path(rec.disk)])
        self._watch_idle()

    async def suspend(self) -> None:
        """Write the running state to disk and end the VM: no CPU, no RAM. ``resume()``
        (from any process), ``start()``, or the next command brings it back."""
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state == "suspended":
                return
            if rec.state not in ("running", "paused"):
                raise InvalidState(f"box {self.name} is {rec.state}, not running")
            if self.spec.volumes:
                raise InvalidState(f"box {self.name} has volumes: it cannot be suspended, only stopped")
            pid, start = _proc.me()
            self.runtime.store.update(self.id, state="suspending", owner_pid=pid, owner_start=start)
            self._resumed.clear()
            vm = self._existing_vm(rec)
            try:
                snap, pause = await snapshots.capture(
                    self.runtime, vm, rec, kind="suspend", keep_running=False
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    if rec.state == "running":
                        await vm.qmp("cont")
                self.runtime.store.update(self.id, expect=("suspending",), state=rec.state)
                raise
            self.runtime.store.update(self.id, state="suspended", qemu_pid=None, stopped_at=time.time(),
                                      options={**rec.options, "_suspend": snap.id})  # fmt: skip
            self.last_pause = pause
            await vm.kill(grace=1.0)
            vm_cleanup(vm)

    async def resume(self) -> None:
        """Bring a suspended box back with its processes; this process's open commands
        and streams carry on where they were."""
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state in ("running", "paused"):
                return
            if rec.state != "suspended":
                raise InvalidState(f"box {self.name} is {rec.state}, not suspended")
            rt = self.runtime
            snap = rt.store.find_snapshot(rec.options.get("_suspend") or "")
            if snap is None:
                rt.store.update(self.id, state="crashed", reason="its suspended state is missing")
                raise InvalidState(
                    f"box {self.name}: its suspended state is missing; start() boots it afresh"
                )
            pid, start = _proc.me()
            rt.store.update(self.id, state="resuming", owner_pid=pid, owner_start=start)
            keep_conn = self._conn is not None and self._conn.failed is None
            try:
                await self._resume_vm(snap, rec, attach=not keep_conn)
            except BaseException:
                rt.store.update(self.id, expect=("resuming",), state="suspended", qemu_pid=None)
                raise
            opts = self._options_without("_suspend")  # as now: the restore recorded its ports
            rt.store.update(self.id, state="running", options=opts, started_at=time.time())
            rt.store.delete_snapshot(snap.id)
            snapshots.remove_files(rt.home, snap.id)
        self._resumed.set()
        self._watch_idle()
        if keep_conn and self._conn is not None:
            await self._conn.wait_ready()

    async def _boot_attach(self, vm: QemuVM, timeout: float) -> AgentConnection:
        """Connect to port 0 and handshake, racing QEMU's exit and the deadline."""
        deadline = time.monotonic() + timeout
        port, self._port_fd = self._free_port()
        sock = str(vm.cfg.agent_socket(port))

        async def connect_and_handshake() -> AgentConnection:
            while True:
                try:
                    conn = self._new_connection(sock)
                    await conn.connect(max(0.1, deadline - time.monotonic()))
                    return conn
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.01)

        attach: asyncio.Future[AgentConnection] = asyncio.ensure_future(connect_and_handshake())
        exited: asyncio.Future[Any] = vm.exited_future()
        try:
            done, _ = await asyncio.wait(
                [attach, exited], timeout=max(0.0, deadline - time.monotonic()), return_when="FIRST_COMPLETED"
            )
        except BaseException:
            attach.cancel()
            raise
        if attach in done:
            try:
                return attach.result()
            except (AgentTimeout, FileNotFoundError, ConnectionRefusedError):
                pass  # reported as a boot timeout below, with the console
        else:
            attach.cancel()
            with contextlib.suppress(BaseException):
                await attach
        if exited in done or not vm.running:
            await asyncio.sleep(0.05)  # let the console file catch up
            raise vm.failure_report("the VM exited before its agent answered")
        await vm.kill(grace=0.5)
        raise BootTimeout(
            f"the agent did not answer within {timeout:.0f}s (accel={vm.cfg.accel})", vm.console_tail()
        )

    def _new_connection(self, sock: str) -> AgentConnection:
        async def connector() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_unix_connection(sock, limit=1 << 22)

        async def on_lost() -> BaseException | None:
            reason = await self._on_agent_lost(self._vm)
            if reason is None and self._conn is not conn:
                # replaced meanwhile (a rollback): reconnecting would only take a port
                return ConnectionLost("the box was rolled back; this connection ended")
            return reason

        rec = self._record
        conn = AgentConnection(
            connector,
            request_timeout=self.spec.request_timeout,
            hostname=self.hostname,
            machine_id=rec.options.get("_machine_id") if rec else None,
            pids_max=self.spec.pids_limit,
            on_lost=on_lost,
        )
        return conn

    async def _connection(self) -> AgentConnection:
        """This process's session with the agent, made on first use."""
        if self._record is None:
            raise InvalidState(f"box {self.name} was not started; call start()")
        rec = self.record  # every call: another process may have paused or stopped it
        if rec.state in ("suspended", "suspending", "resuming"):
            await self.resume()  # transparently: an idle box was put to sleep
            rec = self.record
        if rec.state not in ("running", "snapshotting"):
            raise InvalidState(
                f"box {self.name} is {rec.state}" + ("; call start()" if rec.state != "paused" else "")
            )
        conn = self._conn
        if conn is not None and conn.failed is None:
            await conn.wait_ready()
            return conn
        if conn is not None:
            self._disconnect()
            raise conn.failed  # type: ignore[misc]
        async with self._lock:
            if self._conn is not None and self._conn.failed is None:
                return self._conn
            vm = self._existing_vm(rec)
            port, fd = self._free_port()
            try:
                conn = self._new_connection(str(vm.cfg.agent_socket(port)))
                await conn.connect(self.spec.request_timeout)
            except BaseException:
                os.close(fd)
                raise
            self._port_fd, self._conn = fd, conn
            return conn

    def _free_port(self) -> tuple[int, int]:
        """An agent port no other connection holds: (port, its lock fd)."""
        (self.state_dir / "ports").mkdir(parents=True, exist_ok=True)
        for port in range(AGENT_PORTS):
            fd = _try_flock(self.state_dir / "ports" / f"{port}.lock")
            if fd is not None:
                return port, fd
        raise InvalidState(f"{AGENT_PORTS} connections to box {self.name} are open already")

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.closing()  # its reader must not take the coming EOF for a crash
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().create_task(conn.close())
        if self._port_fd is not None:
            os.close(self._port_fd)
            self._port_fd = None

    async def _on_agent_lost(self, vm: QemuVM | None) -> BaseException | None:
        """The agent socket of ``vm`` closed: reconnect if that VM lives (or once a
        suspended box resumes, here or in another process); else say why it is gone."""
        await asyncio.sleep(0.05)
        if vm is not None and vm.running:
            return None
        while (rec := self.runtime.store.find(self.id)) is not None and rec.state in (
            "suspending", "suspended", "resuming", "restoring"
        ):  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resumed.wait(), 0.5)
        if rec is not None and rec.state == "running" and self._conn is not None:
            if self._vm is None or self._vm.pid != rec.qemu_pid:
                self._existing_vm(rec)
            if self._vm is not None and self._vm.running:
                return None
        if self._port_fd is not None:  # the VM is gone: free our port for whoever starts it next
            os.close(self._port_fd)
            self._port_fd = None
        rec = self.runtime.store.find(self.id)
        if rec is None:
            return InvalidState(f"box {self.name} was removed")
        if rec.state in ("stopping", "stopped", "removing", "created"):
            return InvalidState(f"box {self.name} was stopped")
        tail_text = self.console_tail()
        if vm is not None and vm.pid is not None:
            # only if the row still describes this VM: a restart may have started another
            self.runtime.store.update(
                self.id, expect=("running", "paused"), expect_pid=vm.pid, state="crashed",
                reason="the VM process exited unexpectedly", qemu_pid=None,
            )  # fmt: skip
        return BoxCrashed(f"box {self.name} stopped unexpectedly", tail_text)

    async def _control(
        self,
        op: ControlOp,
        payload: bytes = b"",
        timeout: float | None = None,
        conn: AgentConnection | None = None,
    ) -> Fields:
        conn = conn or await self._connection()
        ch = conn.open_channel()
        try:
            ch.send(T.CONTROL, tlv(Tag.OP, op) + payload)
            frame = await ch.expect(T.CONTROL_OK, timeout=timeout or conn.request_timeout)
            return Fields(frame.payload)
        finally:
            ch.close()

    async def activity(self) -> tuple[int, float]:
        """(operations in progress from any process, seconds since the last request):
        what the idle timeout looks at. Asking does not count as activity."""
        f = await self._control(ControlOp.STATUS)
        return f.u32(Tag.COUNT, 0) or 0, (f.u64(Tag.IDLE_MS, 0) or 0) / 1000

    def _watch_idle(self) -> None:
        """Make sure a watchdog suspends this box once idle (``idle_timeout``); it is a
        detached process, so the box sleeps even after every user process has exited."""
        if self.spec.idle_timeout:
            from .. import watchdog

            watchdog.spawn(self.runtime.home, self.id)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully: every process gets SIGTERM, then SIGKILL after half of
        ``timeout``; the disk is synced and unmounted; the VM powers off. Forced
        once ``timeout`` has passed. The disk is kept."""
        positive("timeout", timeout)
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state in ("created", "stopped", "crashed"):
                return
            if rec.state == "suspended":  # its saved processes end; the disk stays
                snap_id = rec.options.get("_suspend")
                opts = {k: v for k, v in rec.options.items() if k != "_suspend"}
                self.runtime.store.update(self.id, state="stopped", options=opts, stopped_at=time.time())
                if snap_id:
                    self.runtime.store.delete_snapshot(snap_id)
                    snapshots.remove_files(self.runtime.home, snap_id)
                return
            if rec.state not in ("running", "paused", "starting"):
                raise InvalidState(f"box {self.name} is {rec.state}")
            pid, start = _proc.me()
            self.runtime.store.update(self.id, state="stopping", owner_pid=pid, owner_start=start)
            vm = self._existing_vm(rec)
            if rec.state == "paused":
                with contextlib.suppress(Exception):
                    await vm.qmp("cont")
            with contextlib.suppress(Exception):
                grace_ms = int(max(0.5, timeout * 0.5) * 1000)
                await asyncio.wait_for(self._shutdown_via_agent(vm, grace_ms), timeout=timeout)
            if not await vm.wait_exit(max(1.0, timeout * 0.3)):
                await vm.kill(grace=2.0)
            self._disconnect()
            vm_cleanup(vm)
            self.runtime.store.update(self.id, state="stopped", stopped_at=time.time(), qemu_pid=None)
        if self.spec.auto_remove:
            await self.remove()

    async def _shutdown_via_agent(self, vm: QemuVM, grace_ms: int) -> None:
        if self._conn is None or self._conn.failed is not None:
            self._disconnect()
            port, fd = self._free_port()
            conn = self._new_connection(str(vm.cfg.agent_socket(port)))
            try:
                await conn.connect(5.0)
            except BaseException:
                os.close(fd)
                raise
            self._port_fd, self._conn = fd, conn
        ch = self._conn.open_channel()
        ch.send(T.CONTROL, tlv(Tag.OP, ControlOp.SHUTDOWN) + tlv(Tag.TIMEOUT_MS, grace_ms))
        await ch.expect(T.CONTROL_OK, timeout=grace_ms / 1000 + 10)
        await vm.wait_exit(5.0)

    async def restart(self, timeout: float = 10.0) -> None:
        await self.stop(timeout)
        await self.start()

    async def kill(self) -> None:
        """Stop at once, like pulling the plug (the disk's journal recovers on next boot)."""
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state not in ("running", "paused", "starting", "stopping"):
                return
            vm = self._existing_vm(rec)
            await vm.kill(grace=1.0)  # QMP quit: immediate, no guest involvement
            self._disconnect()
            vm_cleanup(vm)
            self.runtime.store.update(self.id, state="stopped", stopped_at=time.time(), qemu_pid=None,
                                      reason="killed")  # fmt: skip
        if self.spec.auto_remove:
            await self.remove()

    async def pause(self) -> None:
        """Freeze the vCPUs; RAM and processes stay. Commands wait until unpause()."""
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state == "paused":
                return
            if rec.state != "running":
                raise InvalidState(f"box {self.name} is {rec.state}, not running")
            await self._existing_vm(rec).qmp("stop")
            self.runtime.store.update(self.id, state="paused")

    async def unpause(self) -> None:
        async with self._lock, self._box_lock():
            rec = self.record
            if rec.state == "running":
                return
            if rec.state != "paused":
                raise InvalidState(f"box {self.name} is {rec.state}, not paused")
            await self._existing_vm(rec).qmp("cont")
            self.runtime.store.update(self.id, state="running")
        # the guest clock stood still while paused: set it to now
        with contextlib.suppress(Exception):
            await self._control(ControlOp.SET_TIME, tlv_u64(Tag.TIME_NS, time.time_ns()))

    async def remove(self, *, force: bool = False) -> None:
        """Delete the box: its disk, logs and record. A running box needs ``force=True``
        (it is killed first). Removing a removed box does nothing."""
        async with self._lock:
            try:
                async with self._box_lock():
                    rec = self.runtime.store.find(self.id)
                    if rec is None:
                        return
                    if rec.state in ("running", "paused", "starting", "stopping") and not force:
                        raise InvalidState(
                            f"box {self.name} is {rec.state}: stop it first, or remove(force=True)"
                        )
                    pid, start = _proc.me()
                    self.runtime.store.update(self.id, state="removing", owner_pid=pid, owner_start=start)
                    if rec.qemu_pid and _proc.alive(rec.qemu_pid, rec.qemu_start):
                        await self._existing_vm(rec).kill(grace=1.0)
                    self._disconnect()
                    self.runtime.discard_box(self.id)
            except FileNotFoundError:
                self.runtime.store.delete(self.id)

    # -- exec ------------------------------------------------------------------------------------

    async def spawn(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bool = True,
    ) -> AsyncProcess:
        """Start a command and return at once with a handle to stream its output."""
        args = _argv(argv)
        if tty and not (0 < rows <= 10000 and 0 < cols <= 10000):
            raise InvalidArgument("rows and cols must be in 1..10000")
        req = ExecRequest(
            argv=args,
            env={**self.spec.default_env(), **check_env(env)} or None,
            cwd=guest_path(cwd) if cwd is not None else self.spec.default_cwd(),
            user=check_user(user) or self.spec.default_user(),
            tty=tty,
            rows=rows,
            cols=cols,
            stdin=stdin,
        )
        remote = await RemoteProcess.start(await self._connection(), req)
        return AsyncProcess(args, remote)

    async def exec(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: StdinSource = None,
        timeout: float | None = None,
        tty: bool = False,
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion and return its exit code and output.

        ``stdin`` may be bytes, text, a binary file object or an async iterable of
        bytes; without it the command reads /dev/null. On ``timeout`` the command's
        process group is killed and ExecTimeout raised (the box stays usable).
        ``check=True`` raises CommandFailed on a nonzero exit.
        """
        positive("timeout", timeout)
        proc = await self.spawn(*argv, env=env, cwd=cwd, user=user, tty=tty, stdin=stdin is not None)
        feeder = asyncio.ensure_future(_feed(proc, stdin)) if stdin is not None else None
        try:
            result = await proc.result(timeout)
        finally:
            if feeder is not None:
                if not feeder.done():
                    feeder.cancel()
                with contextlib.suppress(BaseException):
                    await feeder
        return result.check() if check else result

    async def sh(self, script: str, **kwargs: Any) -> ExecResult:
        """Run a shell command line with ``/bin/sh -c``."""
        return await self.exec("/bin/sh", "-c", script, **kwargs)

    async def ping(self) -> float:
        """Agent round trip in seconds."""
        return await (await self._connection()).ping()

    async def set_network(
        self, network: str | bool | None = None, *, allow: Sequence[str] | str | None = None
    ) -> None:
        """Change the egress policy: ``network`` (the mode; unchanged if None) and
        ``allow`` (replaces the list; unchanged if None). Between 'public' and
        'allowlist', and for ``allow``, a running box applies it to its next
        connection. Adding or removing the network card, or going to or from
        'open', needs the VM to boot again: stop() the box first."""
        mode = self.spec.network if network is None else network
        if allow is None:  # kept, where the new mode has a use for it
            allow = (list(self.spec.allow) or None) if mode in PROXIED else None
        new = Policy.build(mode, allow)
        async with self._lock, self._box_lock():
            rec = self.record
            old = self.spec.policy
            live = rec.state in ("running", "paused", "suspended", "starting", "restoring", "resuming")
            if live and (new.has_nic != old.has_nic or (new.mode == "open") != (old.mode == "open")):
                raise InvalidState(
                    f"box {self.name} is {rec.state}: going from network={old.mode!r} to {new.mode!r} "
                    "changes its network card; stop() it first"
                )
            if self.spec.ports and not new.has_nic:
                raise InvalidArgument(f"box {self.name} publishes ports: it needs a network card")
            if self.spec.secrets and not new.proxied:
                raise InvalidArgument(
                    f"box {self.name} has secrets: they need network='allowlist' or 'public'"
                )
            self.spec.network, self.spec.allow = new.mode, [str(r) for r in new.allow]
            if new.proxied:
                write_policy(self.state_dir / "egress-policy.json", self.spec.policy)
            opts = {**rec.options, "network": self.spec.network, "allow": self.spec.allow}
            self.runtime.store.update(self.id, options=opts)


def _hostname_for(name: str) -> str:
    h = "".join(c if c.isalnum() or c in ".-" else "-" for c in name).strip("-.")[:63]
    return h or "sandlot"


def replace_disk(rec: BoxRecord, disk: Path) -> BoxRecord:
    from dataclasses import replace

    return replace(rec, disk=str(disk))


def vm_cleanup(vm: QemuVM) -> None:
    with contextlib.suppress(Exception):
        vm.cleanup()


async def _feed(proc: AsyncProcess, stdin: StdinSource) -> None:
    """Send ``stdin`` to the process, then close it. A process that exits first is not an error."""
    with contextlib.suppress(ConnectionLost):
        if isinstance(stdin, str):
            await proc.write_stdin(stdin.encode())
        elif isinstance(stdin, bytes | bytearray | memoryview):
            await proc.write_stdin(bytes(stdin))
        elif hasattr(stdin, "read"):
            while chunk := await asyncio.to_thread(stdin.read, 256 * 1024):  # type: ignore[union-attr]
                await proc.write_stdin(chunk)
        else:
            async for chunk in stdin:  # type: ignore[union-attr]
                await proc.write_stdin(chunk)
        await proc.close_stdin()


class Box:
    """A microVM sandbox (sync API); see :class:`AsyncBox` for the arguments.

    >>> with sandlot.Box("python:3.12-slim") as box:           # doctest: +SKIP
    ...     r = box.exec("python3", "-c", "print(6*7)")
    ...     r.stdout
    '42\\n'
    """

    def __init__(self, image: str | Image | None = None, **kwargs: Any) -> None:
        self._a = AsyncBox(image, **kwargs)
        self.files = Files(self._a.files)

    @classmethod
    def _wrap(cls, a: AsyncBox) -> Box:
        box = cls.__new__(cls)
        box._a = a
        box.files = Files(a.files)
        return box

    @classmethod
    def get(cls, key: str, *, home: str | os.PathLike[str] | None = None) -> Box:
        return cls._wrap(AsyncBox.get(key, home=home))

    @classmethod
    def list(
        cls,
        *,
        all: bool = True,
        state: str | None = None,
        labels: Mapping[str, str] | None = None,
        home: str | os.PathLike[str] | None = None,
    ) -> builtins.list[Box]:
        return [cls._wrap(a) for a in AsyncBox.list(all=all, state=state, labels=labels, home=home)]

    @classmethod
    def create(cls, image: str | Image | None = None, **kwargs: Any) -> Box:
        return cls._wrap(_sync.run(AsyncBox.create(image, **kwargs)))

    # facts
    @property
    def id(self) -> str:
        return self._a.id

    @property
    def name(self) -> str:
        return self._a.name

    @property
    def state(self) -> str:
        return self._a.state

    @property
    def running(self) -> bool:
        return self._a.running

    @property
    def hostname(self) -> str:
        return self._a.hostname

    @property
    def accel(self) -> str | None:
        return self._a.accel

    @property
    def image(self) -> Image | None:
        return self._a.image

    @property
    def boot_seconds(self) -> float | None:
        return self._a.boot_seconds

    @property
    def aio(self) -> AsyncBox:
        """The async box behind this one, for use on sandlot's loop."""
        return self._a

    def default_command(self, command: Sequence[str] | None = None) -> builtins.list[str]:
        return self._a.default_command(command)

    def inspect(self) -> dict[str, Any]:
        return self._a.inspect()

    def stats(self) -> dict[str, Any]:
        return self._a.stats()

    def logs(self, lines: int | None = None) -> str:
        return self._a.logs(lines)

    def console_tail(self, lines: int = 40) -> str:
        return self._a.console_tail(lines)

    # lifecycle
    def __enter__(self) -> Box:
        _sync.run(self._a.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        _sync.run(self._a.__aexit__(*exc))

    def start(self) -> Box:
        _sync.run(self._a.start())
        return self

    def stop(self, timeout: float = 10.0) -> None:
        _sync.run(self._a.stop(timeout))

    def restart(self, timeout: float = 10.0) -> None:
        _sync.run(self._a.restart(timeout))

    def kill(self) -> None:
        _sync.run(self._a.kill())

    def pause(self) -> None:
        _sync.run(self._a.pause())

    def unpause(self) -> None:
        _sync.run(self._a.unpause())

    def remove(self, *, force: bool = False) -> None:
        _sync.run(self._a.remove(force=force))

    # exec
    def exec(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: StdinSource = None,
        timeout: float | None = None,
        tty: bool = False,
        check: bool = False,
    ) -> ExecResult:
        return _sync.run(
            self._a.exec(
                *argv, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout, tty=tty, check=check
            )
        )

    def sh(self, script: str, **kwargs: Any) -> ExecResult:
        return _sync.run(self._a.sh(script, **kwargs))

    def spawn(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bool = True,
    ) -> Process:
        return Process(
            _sync.run(
                self._a.spawn(*argv, env=env, cwd=cwd, user=user, tty=tty, rows=rows, cols=cols, stdin=stdin)
            )
        )

    def ping(self) -> float:
        return _sync.run(self._a.ping())

    def set_network(
        self, network: str | bool | None = None, *, allow: Sequence[str] | str | None = None
    ) -> None:
        """See :meth:`AsyncBox.set_network`."""
        _sync.run(self._a.set_network(network, allow=allow))

    def port(self, guest_port: int) -> tuple[str, int]:
        """(host address, host port) where the box's published ``guest_port`` is reachable."""
        return self._a.port(guest_port)

    # live state
    @property
    def last_pause(self) -> float | None:
        return self._a.last_pause

    def snapshot(self, name: str | None = None) -> Snapshot:
        return Snapshot(_sync.run(self._a.snapshot(name)))

    def snapshots(self) -> builtins.list[Snapshot]:
        """This box's snapshots, oldest first."""
        found: builtins.list[Snapshot] = Snapshot.list(box=self.id, home=self._a.runtime.home)
        return found

    def rollback(self, snapshot: Snapshot | AsyncSnapshot | str) -> None:
        _sync.run(self._a.rollback(snapshot))

    def fork(self, n: int = 1, *, name: str | None = None) -> builtins.list[Box]:
        return [Box._wrap(a) for a in _sync.run(self._a.fork(n, name=name))]

    def suspend(self) -> None:
        _sync.run(self._a.suspend())

    def resume(self) -> None:
        _sync.run(self._a.resume())
