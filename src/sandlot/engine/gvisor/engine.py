"""The gVisor engine (``runsc``): boxes in a user-space kernel, at near-native CPU
speed where KVM is not usable. Not hardware isolation.

A box's disk is a *layer directory* (``layers/<id>.dir``): ``upper/`` and
``work/`` of a host overlay mount, ``base``, the path of the image's unpacked
root at the bottom, and ``parent``, the frozen layer directory right below (a
snapshot's), if any. A saved state is a ``runsc checkpoint`` image: forks,
templates and rollbacks each restore it over a new layer on the frozen one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from ... import pids
from ...config import atomic_write, flock_within, fsync_dir
from ...errors import HostSetupError, IncompatibleSnapshot, InvalidArgument, SavedStateError
from ...guest.agent import build_agent
from ..base import (
    Boot,
    BootRequest,
    Drive,
    Engine,
    LaunchSpec,
    Placement,
    SavedState,
    StateSource,
    VMRef,
    VMStatus,
    Volume,
)
from . import drives, limits, network, probe, runsc
from .mountinfo import unmount
from .vm import (
    CHECKPOINT,
    RUNSC_LOG,
    SANDBOX_PROCESS,
    STATUS,
    GvisorVM,
    SandboxConfig,
    container_state,
    destroy,
    from_source,
    lower_dirs,
    mount_read_only,
)

MATERIALIZE_WAIT = 600.0  # seconds to wait for another process writing out the same image


def _written_out(source: StateSource, directory: Path) -> None:
    """The image into ``directory`` whole or not at all: written beside, synced, renamed.
    Compressed as runsc compresses it (deflate's fastest level): it is kept, so it takes
    about what runsc's own image took, not the inflated state's size."""
    work = directory / ".image"
    try:
        from_source(source, work, level=1)
        with open(work / CHECKPOINT, "rb") as f:
            os.fsync(f.fileno())
        os.replace(work / CHECKPOINT, directory / CHECKPOINT)
        fsync_dir(directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def layer_base(layer: Path) -> Path:
    """The image root a layer directory lies over (its ``base`` file)."""
    try:
        return Path((layer / "base").read_text().strip())
    except OSError as exc:
        raise SavedStateError(f"the box's layer {layer} has no base: {exc}") from exc


class GvisorEngine(Engine):
    name = "gvisor"
    disk_format: ClassVar[str] = "dir"
    live_state: ClassVar[bool] = True
    save_ends_vm: ClassVar[bool] = True  # runsc checkpoint ends the sandbox
    host_processes: ClassVar[bool] = True
    mounts_shares: ClassVar[bool] = True  # bind mounts in the sandbox's spec, kept by a checkpoint
    mounts_drives: ClassVar[bool] = True  # served by a user-space ext4 and bound in (``drives``)
    # its checkpoint image, kept as chunks (its state inflated and cut by content, so that
    # checkpoints share what did not change: ``checkpoint``): checked when read, sent to the
    # storage tier and evicted as every state is
    chunked_state: ClassVar[bool] = True

    def __init__(self, home: Path) -> None:
        self.home = home

    # -- boots -------------------------------------------------------------------------

    def refuse(self, request: BootRequest) -> None:
        if request.drives and (lacking := drives.missing_tools()):
            raise InvalidArgument(
                f"engine='gvisor' serves named volumes with tools this host lacks: {', '.join(lacking)} "
                "(engine='qemu' mounts them in its guest instead)"
            )
        if request.kernel:
            raise InvalidArgument("engine='gvisor' has no guest kernel to replace (kernel= is for qemu)")
        if request.nested_virt:
            raise InvalidArgument("engine='gvisor' has no /dev/kvm for a box's own VMs (nested_virt: qemu)")
        if request.containers:
            raise InvalidArgument(
                "engine='gvisor' runs no container engine in a box: gVisor's kernel gives Docker no "
                "cgroups and Podman no layer unpacking (docs/containers.md; containers=True: engine='qemu')"
            )
        if not request.aslr:
            raise InvalidArgument(
                "engine='gvisor' always randomizes its processes' address spaces (aslr=False: engine='qemu')"
            )
        limits.disk_bound(request, self.home / "layers")  # a size this host cannot hold a box to

    def prepare(self, request: BootRequest) -> Boot:
        self.refuse(request)
        disk_gb = limits.disk_bound(request, self.home / "layers")
        runsc.require_root()
        binary = runsc.runsc_binary()
        version = runsc.runsc_version(binary)
        platform = runsc.platform_for(version)
        agent = build_agent(self.home)
        return Boot(
            engine=self.name,
            accel=platform,
            accel_reason=f"gVisor's {platform} platform (runsc {version}): a user-space kernel, "
            "not hardware virtualization",
            record={
                "runsc_version": version,
                "platform": platform,
                "agent_dir": str(agent.path.parent),
                "disk_gb": disk_gb,
            },
            identity=("gvisor", version, platform, agent.digest),
        )

    def _config(self, where: Placement, boot: dict[str, Any], disk: Path, **kw: Any) -> SandboxConfig:
        agent_dir = boot.get("agent_dir") or ""
        return SandboxConfig(
            box_id=where.box_id, hostname=where.hostname, run_dir=where.run_dir, state_dir=where.state_dir,
            layer=disk, base=layer_base(disk) if disk != Path() else Path(), agent_dir=Path(agent_dir),
            platform=boot.get("platform") or "ptrace", ports=where.agent_ports,
            memory_mib=kw.get("memory_mib", boot.get("memory_mib", 512)),
            cpus=kw.get("cpus", boot.get("cpus", 1)), disk_gb=boot.get("disk_gb") or 0,
            shares=kw.get("shares", ()), drives=kw.get("drives", ()),
        )  # fmt: skip

    async def launch(self, spec: LaunchSpec) -> GvisorVM:
        boot = spec.boot
        if spec.saved is not None:  # the agent build the state was saved with, not today's
            boot = {**boot, "agent_dir": str(self._saved_agent(spec.saved.facts))}
        cfg = self._config(
            spec.where,
            boot,
            spec.disk,
            memory_mib=spec.memory_mib,
            cpus=spec.cpus,
            shares=spec.volumes,
            drives=spec.drives,
        )
        if spec.network is not None:
            cfg.net = network.forwarder_spec(spec.network)
            cfg.net_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cfg.net_file, json.dumps(cfg.net).encode(), mode=0o600)
        else:
            cfg.net_file.unlink(missing_ok=True)
        vm = GvisorVM(cfg)
        saved = spec.saved
        if saved is None or saved.source is None:
            await vm.start(restore_from=saved.directory if saved is not None else None)
            return vm
        # a state of chunks: its image written out for runsc (which reads it all before the
        # restored sandbox runs) while the sandbox's mounts and network are made
        image_dir = cfg.state_dir / "restoring"
        written = asyncio.ensure_future(asyncio.to_thread(from_source, saved.source, image_dir))
        try:
            await vm.start(restore_from=image_dir, written=written)
        finally:
            await asyncio.wait([written])  # (a start that failed before it waited for it)
            await asyncio.to_thread(shutil.rmtree, image_dir, True)
        return vm

    def _saved_agent(self, facts: dict[str, Any]) -> Path:
        build = str((facts.get("engine_facts") or {}).get("agent_build") or "")
        path = self.home / "agent" / build
        if not build or "/" in build or build.startswith(".") or not (path / "sandlot-agent").is_file():
            raise IncompatibleSnapshot(
                f"the snapshot's agent build ({build or 'unnamed'}) is not in this home: a gVisor state "
                "restores only with the very agent binary it was saved with"
            )
        return path

    def attach(self, ref: VMRef, where: Placement, boot: dict[str, Any]) -> GvisorVM:
        cfg = self._config(where, boot, Path(), drives=drives.recorded(where.run_dir))
        if boot.get("network"):  # what its launcher asked for, for the restores this process runs
            with contextlib.suppress(OSError, ValueError):
                cfg.net = json.loads(cfg.net_file.read_text())
        return GvisorVM.attach(cfg, ref)

    # -- recovery (no event loop) --------------------------------------------------------

    def _bare(self, where: Placement) -> SandboxConfig:
        return SandboxConfig(where.box_id, where.hostname, where.run_dir, where.state_dir, Path(), Path(),
                             Path(), "ptrace", where.agent_ports, 0, 0)  # fmt: skip

    def probe(self, ref: VMRef | None, where: Placement) -> VMStatus:
        if not self.alive(ref, where.box_id):
            return VMStatus.GONE
        state = container_state(self._bare(where))
        if state is None:
            return VMStatus.UNKNOWN
        return STATUS.get(str(state.get("status")), VMStatus.UNKNOWN)

    def vm_of(self, process: pids.Process) -> tuple[VMRef, Path] | None:
        # Found through the runsc that runs the sandbox (``run`` or ``restore``, not an
        # ``exec``): the sandbox process, which the box's VMRef names, is its child, in a
        # mount namespace of its own (no process there is looked at, see ``pids.processes``)
        argv = process.argv
        if not argv or Path(argv[0]).name != "runsc" or not {"run", "restore"} & set(argv):
            return None
        log = next((Path(a.removeprefix("--log=")) for a in argv if a.startswith("--log=")), None)
        if log is None or log.name != RUNSC_LOG:
            return None
        for child in pids.children(process.pid):
            start = pids.start_time(child)
            if start is not None and pids.cmdline(child)[:1] == [SANDBOX_PROCESS]:
                return VMRef(child, start), log.parent
        return None

    def abort_save(self, ref: VMRef, where: Placement, *, resume: bool) -> None:
        if resume:  # a save pauses the container first
            with contextlib.suppress(Exception):
                cfg = self._bare(where)
                runsc.run([*cfg.flags(), "resume", cfg.cid], timeout=10)

    def console_log(self, where: Placement) -> Path:
        return self._bare(where).console_log

    def forget(self, where: Placement) -> None:
        """Remove a dead sandbox's container state and root mount (recovery's cleanup)."""
        destroy(self._bare(where))

    # -- saved states ----------------------------------------------------------------------

    async def share_memory(
        self, state: SavedState, disk: Path, drives: tuple[Drive, ...] = (), shares: tuple[Volume, ...] = ()
    ) -> None:
        """The checkpoint image, written out of its chunks into the state's directory
        once: what forks, templates and exports read."""
        d = state.directory
        if self.memory_shared(d) or state.source is None:
            return
        fd = await flock_within(d / ".materialize.lock", MATERIALIZE_WAIT, "this snapshot's checkpoint image")
        try:
            if self.memory_shared(d):
                return
            await asyncio.to_thread(_written_out, state.source, d)
        finally:
            os.close(fd)

    def memory_shared(self, directory: Path) -> bool:
        return (directory / CHECKPOINT).is_file()

    def state_files(self, directory: Path) -> dict[str, Path]:
        return {CHECKPOINT: directory / CHECKPOINT}

    def check_compatible(self, facts: dict[str, Any], boot: Boot) -> None:
        if facts.get("engine", "qemu") != self.name:
            raise IncompatibleSnapshot(
                f"the snapshot was saved by the {facts.get('engine', 'qemu')!r} engine; this box runs on "
                f"{self.name}, which cannot load it"
            )
        engine_facts = facts.get("engine_facts") or {}
        saved, mine = engine_facts.get("runsc_version"), boot.record.get("runsc_version")
        if saved != mine:
            raise IncompatibleSnapshot(f"the snapshot was saved by runsc {saved}; this host has runsc {mine}")
        if engine_facts.get("platform") != boot.record.get("platform"):
            raise IncompatibleSnapshot(
                f"the snapshot was saved on gVisor's {engine_facts.get('platform')} platform; this host "
                f"runs {boot.record.get('platform')}"
            )
        self._saved_agent(facts)

    def facts_for_import(self, facts: dict[str, Any], boot: Boot) -> dict[str, Any]:
        return dict(facts)

    def flatten_root(self, layer: Path, dest: Path) -> None:
        """A read-only overlay of the layer and all below it (the merged view the box saw,
        whiteouts applied), written out by tar with owners, modes and xattrs."""
        mnt = Path(tempfile.mkdtemp(prefix=".flatten-", dir=layer.parent))
        try:
            mount_read_only([layer / "upper", *lower_dirs(layer, layer_base(layer))], mnt)
            try:
                proc = subprocess.run(
                    ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sparse", "-C", str(mnt),
                     "-cf", str(dest), "."],
                    capture_output=True, text=True,
                )  # fmt: skip
                if proc.returncode != 0:
                    raise SavedStateError(f"writing the box's files out failed: {proc.stderr.strip()[-400:]}")
            finally:
                unmount(mnt)
        finally:
            with contextlib.suppress(OSError):
                mnt.rmdir()

    # -- facts ----------------------------------------------------------------------------

    def doctor(self) -> dict[str, Any]:
        report: dict[str, Any] = {"engine": self.name}
        try:
            binary = runsc.runsc_binary()
        except HostSetupError as exc:
            report.update(usable=False, why=str(exc))
            return report
        version = runsc.runsc_version(binary)
        platform = runsc.platform_for(version)
        report["runsc"] = {"path": binary, "version": version, "platform": platform}
        why = []
        if os.geteuid() != 0:
            why.append("not root: the box's overlay root and its host cgroups need root "
                       "(runsc --rootless has neither)")  # fmt: skip
        if "overlay" not in Path("/proc/filesystems").read_text():
            why.append("the host kernel has no overlayfs")
        if not why:  # a runsc that cannot run a sandbox here is found out now, not by a box
            failed = probe.why_unusable(self.home)
            if failed:
                why.append(failed)
        report["usable"] = not why
        report["why"] = "; ".join(why) or (
            f"runsc {version} on its {platform} platform: a user-space kernel, not hardware isolation"
        )
        report["network"] = (
            "every mode: a network namespace per box, its card given to gVisor's netstack "
            "(open mode needs iptables)"
        )
        report["live_state"] = "snapshot, suspend, fork, templates, export: runsc checkpoint and restore"
        lacking = drives.missing_tools()
        report["disk_volumes"] = (
            f"not on this host: it lacks {', '.join(lacking)}" if lacking
            else "served on the host by a user-space ext4 (qemu-storage-daemon, fuse2fs)"
        )  # fmt: skip
        return report
