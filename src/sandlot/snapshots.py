"""Saved running state: disk layers, snapshots and how they are written and read back.

A box's disk is a chain of qcow2 layers in ``layers/``: the image's ext4 base at
the bottom, the box's writable *top* layer above. A snapshot pauses the VM,
freezes the top (the box goes on writing to a new layer on top of it), and
saves RAM and device state with QEMU's migration into ``snapshots/<id>/state``;
the pause lasts as long as the save. Layers are never copied and never
rewritten once frozen, so snapshots, forks and rollbacks cost a qemu-img call.

A saved state has one of two forms in its directory:

* ``state``: QEMU's migration stream, RAM and devices in one file. Any VM of the
  same shape loads it; its RAM ends up private to that VM.
* ``memory`` + ``devices``: the guest RAM as a raw file and the device state
  without RAM (``x-ignore-shared``). VMs map ``memory`` copy-on-write
  (``memory-backend-file,share=off``), so twenty children of one snapshot share
  every page none of them wrote. ``materialize`` turns the first form into the
  second, once, with a helper QEMU; forks, templates and exports use it.

Crash safety: files are written under a temporary name and renamed into place,
rows are committed after the files exist, and a box's row always names a top
layer whose chain holds all of its data (a new top is recorded before QEMU
switches to it; it starts empty and its backing is the old top). Whatever a
crash leaves unreferenced is swept by ``sweep``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import fsync_dir, runtime_dir
from .engine.qemu import TCG_CPU, NetConfig, QemuVM, VMConfig, qemu_version
from .errors import HostSetupError, StateError
from .images.rootfs import qcow2_backing_file
from .store import BoxRecord, SnapshotRecord

if TYPE_CHECKING:
    from .runtime import Runtime

MACHINE = "microvm"
ORPHAN_AGE = 60.0  # seconds before an unreferenced file may be a crash's leftover


def layers_dir(home: Path) -> Path:
    return home / "layers"


def snapshot_dir(home: Path, snap_id: str) -> Path:
    return home / "snapshots" / snap_id


def new_layer(home: Path, backing: Path, size: int, backing_format: str = "qcow2") -> Path:
    """An empty qcow2 layer on ``backing`` (``-u``: the backing may be open in a running VM)."""
    qemu_img = shutil.which("qemu-img")
    if not qemu_img:
        raise HostSetupError("qemu-img not found: install qemu-utils")
    d = layers_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{secrets.token_hex(8)}.qcow2"
    cmd = [qemu_img, "create", "-q", "-f", "qcow2", "-u", "-F", backing_format, "-b", str(backing), str(path),
           str(size)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HostSetupError(f"qemu-img create failed: {proc.stderr.strip()}")
    return path


def child_layer(home: Path, snap: SnapshotRecord) -> Path:
    """A new top layer over a snapshot's: a copy of an empty overlay made once per
    snapshot (a file copy instead of a qemu-img process per child of a fan-out)."""
    blank = snapshot_dir(home, snap.id) / "blank.qcow2"
    if not blank.is_file():
        frozen = Path(snap.layer)
        made = new_layer(home, frozen, virtual_size(frozen))
        try:
            os.rename(made, blank)  # the same file system; a racing maker's copy is as good
        except OSError:
            made.unlink(missing_ok=True)
            if not blank.is_file():
                raise
    path = layers_dir(home) / f"{secrets.token_hex(8)}.qcow2"
    shutil.copyfile(blank, path)
    return path


def layer_chain(top: Path) -> list[Path]:
    """``top`` and every file below it, down to the base."""
    out = [top]
    seen = {top}
    while True:
        backing = qcow2_backing_file(out[-1])
        if not backing:
            return out
        p = Path(backing)
        if p in seen or len(out) > 1000:
            raise StateError(f"the disk chain of {top} loops")
        seen.add(p)
        out.append(p)


def virtual_size(path: Path) -> int:
    with open(path, "rb") as f:
        header = f.read(32)
    return int.from_bytes(header[24:32], "big")


def vm_facts(cfg: VMConfig) -> dict[str, Any]:
    """What a saved state can only be loaded with: the same VM shape, QEMU and accelerator."""
    return {
        "machine": MACHINE,
        "qemu_version": qemu_version(),
        "accel": cfg.accel,
        "cpu_model": "host" if cfg.accel == "kvm" else TCG_CPU,
        "memory_mib": cfg.memory_mib,
        "cpus": cfg.cpus,
        "ports": cfg.ports,
        "kernel": str(cfg.kernel),
        "initrd": str(cfg.initrd),
        "network": cfg.network is not None,  # a network card is part of the device state
    }


def is_materialized(home: Path, snap_id: str) -> bool:
    d = snapshot_dir(home, snap_id)
    return (d / "devices").is_file() and (d / "memory").is_file()


def state_source(home: Path, snap: SnapshotRecord, cfg: VMConfig) -> None:
    """Make ``cfg`` a VM that restores this snapshot (``QemuVM.run_restored`` loads it),
    mapping its RAM file copy-on-write when the snapshot has one."""
    d = snapshot_dir(home, snap.id)
    if is_materialized(home, snap.id):
        cfg.ram_file, cfg.ram_shared = d / "memory", False
        cfg.restore_from, cfg.restore_ignore_shared = d / "devices", True
        return
    if not (d / "state").is_file():
        raise StateError(f"snapshot {snap.id} has no saved state (its files are gone)")
    cfg.restore_from, cfg.restore_ignore_shared = d / "state", False


def dir_size(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for f in path.iterdir():
            with contextlib.suppress(OSError):
                total += f.stat().st_blocks * 512
    return total


async def capture(
    rt: Runtime,
    vm: QemuVM,
    rec: BoxRecord,
    *,
    kind: str,
    name: str | None = None,
    keep_running: bool = True,
    template_key: str | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[SnapshotRecord, float]:
    """Save the running state of ``vm`` (the VM of box ``rec``) as a new snapshot.

    With ``keep_running`` the box goes on, on a new top layer, after a pause as
    long as the save; without it (suspend) the VM stays stopped and its top
    layer is the snapshot's. Returns the committed row and the pause in seconds.
    """
    assert rec.disk is not None
    home = rt.home
    snap_id = secrets.token_hex(6)
    final = snapshot_dir(home, snap_id)
    tmp = final.parent / f".tmp-{snap_id}"
    tmp.mkdir(parents=True)
    frozen = Path(rec.disk)
    try:
        if keep_running:
            top = await asyncio.to_thread(new_layer, home, frozen, virtual_size(frozen))
            # recorded before QEMU switches: the new top starts empty over the old one,
            # so the row names a complete disk whether or not the switch happens
            rt.store.update(rec.id, disk=str(top))
        status = await vm.qmp("query-status")
        was_running = status.get("status") == "running"
        t0 = time.monotonic()
        if was_running:
            await vm.qmp("stop")
        try:
            if keep_running:
                await vm.qmp("blockdev-snapshot-sync", {"device": "root", "snapshot-file": str(top),
                                                        "format": "qcow2", "mode": "existing"})  # fmt: skip
            await vm.save_state(tmp / "state")
        finally:
            if keep_running and was_running:
                await vm.qmp("cont")
        pause = time.monotonic() - t0
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    snap = SnapshotRecord(
        id=snap_id, kind=kind, layer=str(frozen), name=name, box_id=rec.id, box_name=rec.name,
        template_key=template_key, created_at=time.time(), size=dir_size(final),
        options={"box": rec.options, "image_ref": rec.image_ref, "image_digest": rec.image_digest,
                 "rootfs": rec.rootfs, "vm": vm_facts(vm.cfg), **(options or {})},
    )  # fmt: skip
    try:
        rt.store.insert_snapshot(snap)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    return snap, pause


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


async def materialize(rt: Runtime, snap: SnapshotRecord) -> None:
    """Give a snapshot its ``memory`` + ``devices`` form (once; other processes wait)."""
    home = rt.home
    d = snapshot_dir(home, snap.id)
    if is_materialized(home, snap.id):
        return
    fd = await asyncio.to_thread(_lock, d / ".materialize.lock")
    try:
        if is_materialized(home, snap.id):
            return
        facts = snap.options["vm"]
        work = Path(await asyncio.to_thread(lambda: str(_mkdtemp(d))))
        mem_tmp = d / ".memory.tmp"
        with contextlib.suppress(FileNotFoundError):
            mem_tmp.unlink()
        cfg = VMConfig(
            kernel=Path(facts["kernel"]), initrd=Path(facts["initrd"]), disk=Path(snap.layer),
            disk_readonly=True, run_dir=runtime_dir() / f"m-{snap.id}", state_dir=work, accel=facts["accel"],
            memory_mib=facts["memory_mib"], cpus=facts["cpus"], hostname=f"materialize-{snap.id}",
            ports=facts["ports"], detached=False, ram_file=mem_tmp, ram_shared=True, incoming=True,
            network=NetConfig() if facts.get("network") else None,  # the same devices; it never runs
        )  # fmt: skip
        vm = QemuVM(cfg)
        try:
            await vm.start()
            await vm.load_state(d / "state")
            await vm.save_state(d / ".devices.tmp", ignore_shared=True)
        except Exception as exc:
            raise StateError(
                f"snapshot {snap.id} could not be prepared for forks: {exc}\n{vm.stderr_tail()}"
            ) from exc
        finally:
            await vm.kill(grace=1.0)
            vm.cleanup()
            shutil.rmtree(work, ignore_errors=True)
        await asyncio.to_thread(_fsync_file, mem_tmp)
        os.rename(mem_tmp, d / "memory")
        os.rename(d / ".devices.tmp", d / "devices")
        fsync_dir(d)
        # the stream says nothing the two files do not
        with contextlib.suppress(FileNotFoundError):
            (d / "state").unlink()
        rt.store.update_snapshot(snap.id, size=dir_size(d))
    finally:
        os.close(fd)


def _mkdtemp(parent: Path) -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=".work-", dir=parent))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def start_from(
    home: Path, snap: SnapshotRecord, cfg: VMConfig, on_started: Callable[[QemuVM], None] | None = None
) -> QemuVM:
    """A paused QEMU holding ``snap``'s state file open: ``QemuVM.run_restored`` loads it
    and lets the guest run. A state that cannot be loaded makes QEMU exit, saying why
    on its stderr (``QemuVM.failure_report``)."""
    state_source(home, snap, cfg)
    vm = QemuVM(cfg)
    await vm.start()
    if on_started is not None:
        on_started(vm)
    return vm


def check_compatible(facts: dict[str, Any], accel: str) -> None:
    """Refuse a state this host's QEMU and accelerator cannot load."""
    from .errors import IncompatibleSnapshot

    mine = qemu_version()
    if facts.get("machine") != MACHINE:
        raise IncompatibleSnapshot(
            f"the snapshot is of a {facts.get('machine')!r} machine; sandlot runs {MACHINE}"
        )
    if _major_minor(facts.get("qemu_version", "")) != _major_minor(mine):
        raise IncompatibleSnapshot(
            f"the snapshot was saved by QEMU {facts.get('qemu_version')}; this host has QEMU {mine}"
        )
    if facts.get("accel") != accel:
        raise IncompatibleSnapshot(
            f"the snapshot was saved under {facts.get('accel')}; this host runs boxes under {accel}"
        )
    wanted_cpu = "host" if accel == "kvm" else TCG_CPU
    if facts.get("cpu_model") != wanted_cpu:
        raise IncompatibleSnapshot(
            f"the snapshot's CPU model {facts.get('cpu_model')!r} is not {wanted_cpu!r}"
        )


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(" ")[0].split(".")[:2])


def remove_files(home: Path, snap_id: str) -> None:
    shutil.rmtree(snapshot_dir(home, snap_id), ignore_errors=True)


def sweep(rt: Runtime) -> None:
    """Delete what crashes left behind: unfinished snapshot directories, directories
    without a row, states of suspensions that never committed, unreferenced layers."""
    home = rt.home
    now = time.time()
    store = rt.store
    snaps = {s.id: s for s in store.snapshots()}
    boxes = store.list()
    suspended = {b.options.get("_suspend") for b in boxes}
    for s in snaps.values():
        if s.kind == "suspend" and s.id not in suspended and now - s.created_at > ORPHAN_AGE:
            store.delete_snapshot(s.id)
            remove_files(home, s.id)
    root = home / "snapshots"
    if root.is_dir():
        for d in root.iterdir():
            with contextlib.suppress(OSError):
                if d.name in snaps:  # a preparation for forks cut short leaves work files
                    for f in d.glob(".*"):
                        if f.name != ".materialize.lock" and now - f.stat().st_mtime > ORPHAN_AGE:
                            shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink()
                    continue
                if now - d.stat().st_mtime < ORPHAN_AGE:
                    continue
                shutil.rmtree(d, ignore_errors=True)
    gc_layers(rt, boxes=boxes, snapshots=[s for s in store.snapshots()], min_age=ORPHAN_AGE)


def gc_layers(
    rt: Runtime,
    *,
    boxes: Iterable[BoxRecord] | None = None,
    snapshots: Iterable[SnapshotRecord] | None = None,
    min_age: float = ORPHAN_AGE,
    also: Iterable[Path] = (),
) -> None:
    """Delete layers no box and no snapshot reaches. ``also``: unreferenced layers
    to delete now, whatever their age (a removed box's top)."""
    d = layers_dir(rt.home)
    if not d.is_dir():
        return
    boxes = rt.store.list() if boxes is None else boxes
    snapshots = rt.store.snapshots() if snapshots is None else snapshots
    tops = [Path(b.disk) for b in boxes if b.disk]
    tops += [Path(b.options["_op"]["disk"]) for b in boxes if isinstance(b.options.get("_op"), dict)]
    tops += [Path(s.layer) for s in snapshots]
    keep: set[Path] = set()
    for top in tops:
        with contextlib.suppress(StateError, OSError):
            keep.update(layer_chain(top))
    now = time.time()
    forced = set(also)
    for f in d.glob("*.qcow2"):
        if f in keep:
            continue
        with contextlib.suppress(OSError):
            if f in forced or now - f.stat().st_mtime > min_age:
                f.unlink()


# -- a QMP exchange without an event loop, for reconciliation ------------------------------


def qmp_sync(sock_path: Path, lock_path: Path, commands: list[tuple[str, dict[str, Any] | None]],
             timeout: float = 5.0) -> list[Any]:  # fmt: skip
    """Run QMP commands from synchronous code (reconciliation runs inside and outside
    event loops, where ``qemu.qmp``'s sync wrapper cannot start its own loop)."""
    fd = _lock(lock_path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(sock_path))
            f = s.makefile("rwb")

            def call(cmd: str, args: dict[str, Any] | None) -> Any:
                msg: dict[str, Any] = {"execute": cmd}
                if args:
                    msg["arguments"] = args
                f.write(json.dumps(msg).encode() + b"\n")
                f.flush()
                while True:
                    line = f.readline()
                    if not line:
                        raise StateError("QMP closed")
                    reply = json.loads(line)
                    if "return" in reply:
                        return reply["return"]
                    if "error" in reply:
                        raise StateError(reply["error"].get("desc", "QMP error"))

            json.loads(f.readline())  # greeting
            call("qmp_capabilities", None)
            return [call(c, a) for c, a in commands]
    finally:
        os.close(fd)


__all__ = [
    "capture",
    "check_compatible",
    "gc_layers",
    "is_materialized",
    "layer_chain",
    "materialize",
    "new_layer",
    "snapshot_dir",
    "start_from",
    "sweep",
]
