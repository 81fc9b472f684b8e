"""The runtime: one ``$SANDLOT_HOME`` and what every box there shares.

It resolves, once per process, the pieces a boot needs: the QEMU binary, the
accelerator (and why), the guest kernel, the agent build and the initramfs.
Boxes ask the runtime; nothing here is per box.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _proc
from .config import default_home, runtime_dir
from .engine import accel as accel_mod
from .engine import hostcgroup
from .engine.qemu import KERNEL_ARGS, host_tsc_khz, qemu_binary, qemu_version
from .errors import HostSetupError
from .guest.agent import AgentBuild, build_agent
from .guest.initramfs import build_initramfs
from .guest.kernel import BASE_MODULES, Kernel, ensure_kernel
from .images.manager import ImageManager
from .store import BoxRecord, BoxStore

if TYPE_CHECKING:
    from .api.box import Box


@dataclass(frozen=True, slots=True)
class BootAssets:
    """Everything a boot needs besides the disk."""

    qemu: str
    kernel: Kernel
    agent: AgentBuild
    initrd: Path
    accel: accel_mod.AccelChoice


class Runtime:
    """Shared state of one sandlot home. Cheap to create; work happens on first use.

    >>> import sandlot
    >>> rt = sandlot.Runtime()            # $SANDLOT_HOME or ~/.local/share/sandlot
    >>> rt.home.name
    'sandlot'
    """

    _instances: dict[Path, Runtime] = {}
    _instances_lock = threading.Lock()

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = Path(home).expanduser().absolute() if home else default_home()
        self._lock = threading.Lock()
        self._store: BoxStore | None = None
        self.images = ImageManager(self.home)
        self._assets: dict[tuple[Any, ...], BootAssets] = {}

    @classmethod
    def for_home(cls, home: str | os.PathLike[str] | None = None) -> Runtime:
        """The shared runtime of a home (one per process)."""
        key = Path(home).expanduser().absolute() if home else default_home()
        with cls._instances_lock:
            rt = cls._instances.get(key)
            if rt is None:
                rt = cls._instances[key] = cls(key)
            return rt

    # -- layout ----------------------------------------------------------------------

    @property
    def boxes_dir(self) -> Path:
        return self.home / "boxes"

    @property
    def bases_dir(self) -> Path:
        return self.home / "bases"

    def run_dir(self, box_id: str) -> Path:
        return runtime_dir() / box_id

    # -- boxes ----------------------------------------------------------------------------

    def get(self, key: str) -> Box:
        """The box with this id, name or id prefix in this home (``sandlot.get`` with ``home=``)."""
        from .api.box import Box

        return Box.get(key, home=self.home)

    def list(self, **filters: Any) -> list[Box]:
        """Boxes of this home (``sandlot.list`` with ``home=``)."""
        from .api.box import Box

        return Box.list(home=self.home, **filters)

    def create(self, image: str | None = None, **options: Any) -> Box:
        """Create a box in this home (``sandlot.create`` with ``home=``)."""
        from .api.box import Box

        return Box.create(image, home=self.home, **options)

    @property
    def store(self) -> BoxStore:
        """The box registry (``sandlot.db``), opened on first use."""
        with self._lock:
            if self._store is None:
                self._store = BoxStore(self.home / "sandlot.db")
                self._sweep_orphan_dirs(self._store)
            else:
                return self._store
        from . import snapshots

        with contextlib.suppress(OSError):
            snapshots.sweep(self)
        with self._lock:
            return self._store

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

    def _qemu_alive(self, rec: BoxRecord) -> bool:
        if not _proc.alive(rec.qemu_pid, rec.qemu_start):
            return False
        assert rec.qemu_pid is not None
        return any(rec.id in arg for arg in _proc.cmdline(rec.qemu_pid))

    def _kill_qemu(self, rec: BoxRecord) -> None:
        if self._qemu_alive(rec):
            assert rec.qemu_pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.qemu_pid, signal.SIGKILL)

    def discard_box(self, box_id: str) -> None:
        """Delete a box's files, then its row (a crash in between is reconciled),
        then the disk layers only it used."""
        from . import snapshots

        rec = self.store.find(box_id)
        shutil.rmtree(self.boxes_dir / box_id, ignore_errors=True)
        with contextlib.suppress(HostSetupError):
            shutil.rmtree(runtime_dir() / box_id, ignore_errors=True)
        self.store.delete(box_id)
        if rec is None:
            return
        suspended = rec.options.get("_suspend")
        if suspended:
            self.store.delete_snapshot(suspended)
            snapshots.remove_files(self.home, suspended)
        if rec.origin:  # a fork's own snapshot goes with the last of its children
            origin = self.store.find_snapshot(rec.origin)
            if origin is not None and origin.options.get("auto") and not self.store.children(origin.id):
                self.store.delete_snapshot(origin.id)
                snapshots.remove_files(self.home, origin.id)
        mine = [Path(rec.disk)] if rec.disk else []
        op = rec.options.get("_op")
        if isinstance(op, dict) and op.get("disk"):
            mine.append(Path(op["disk"]))
        snapshots.gc_layers(self, also=mine)

    def reconcile(self, rec: BoxRecord) -> BoxRecord | None:
        """Make a box's row agree with its processes after crashes: finish or undo
        what a dead process left half done. Returns the row, or None if the box is gone."""
        owner_alive = _proc.alive(rec.owner_pid, rec.owner_start)
        s = rec.state
        if rec.ephemeral and not owner_alive:
            # a `with` block whose process died: the box goes with it
            self._kill_qemu(rec)
            self.discard_box(rec.id)
            return None
        if s in ("creating", "removing"):
            if owner_alive:
                return rec
            self._kill_qemu(rec)
            self.discard_box(rec.id)
            return None
        if s == "starting" and not owner_alive:
            if self._qemu_alive(rec):
                return self.store.update(rec.id, expect=(s,), state="running") or self.store.find(rec.id)
            return self.store.update(
                rec.id, expect=(s,), state="crashed", qemu_pid=None,
                reason="the process starting it died, and the VM with it",
            ) or self.store.find(rec.id)  # fmt: skip
        if s == "stopping" and not owner_alive:
            self._kill_qemu(rec)
            return self.store.update(rec.id, expect=(s,), state="stopped", qemu_pid=None,
                                     stopped_at=time.time()) or self.store.find(rec.id)  # fmt: skip
        if s in ("snapshotting", "suspending", "resuming", "restoring") and not owner_alive:
            return self._finish_live_op(rec)
        if s == "suspended" and self._qemu_alive(rec):
            self._kill_qemu(rec)  # the state was saved; the VM was about to be ended
        if s in ("running", "paused") and not self._qemu_alive(rec):
            return self.store.update(
                rec.id, expect=(s,), state="crashed", qemu_pid=None,
                reason="the VM process exited unexpectedly (killed, or the host restarted)",
            ) or self.store.find(rec.id)  # fmt: skip
        return rec

    def _qmp(self, rec: BoxRecord, *commands: tuple[str, dict[str, Any] | None]) -> Any:
        from .snapshots import qmp_sync

        return qmp_sync(
            self.run_dir(rec.id) / "qmp.sock", self.boxes_dir / rec.id / "qmp.lock", list(commands)
        )

    def _finish_live_op(self, rec: BoxRecord) -> BoxRecord | None:
        """A snapshot, suspend, resume or rollback whose process died: finish it where
        the saved state allows, else undo it; the box is never lost."""
        s = rec.state
        alive = self._qemu_alive(rec)
        opts = {k: v for k, v in rec.options.items() if k != "_op"}
        status = None
        if alive:
            try:
                status = self._qmp(rec, ("query-status", None))[0].get("status")
            except Exception:
                status = None
        if s in ("snapshotting", "suspending"):
            if s == "suspending" and rec.options.get("_suspend"):
                self._kill_qemu(rec)
                return self.store.update(rec.id, expect=(s,), state="suspended", qemu_pid=None)
            if alive:  # the save was cut short: the VM goes on as it was
                with contextlib.suppress(Exception):
                    self._qmp(rec, ("migrate_cancel", None))
                with contextlib.suppress(Exception):
                    self._qmp(rec, ("cont", None))
                return self.store.update(rec.id, expect=(s,), state="running") or self.store.find(rec.id)
        elif s == "resuming":
            if alive and status == "running":
                opts.pop("_suspend", None)
                return self.store.update(rec.id, expect=(s,), state="running", options=opts)
            # the guest never ran: the saved state still matches the disk
            self._kill_qemu(rec)
            return self.store.update(rec.id, expect=(s,), state="suspended", qemu_pid=None)
        elif s == "restoring":
            op = rec.options.get("_op") or {}
            if alive and status == "running" and op.get("disk"):
                return self.store.update(rec.id, expect=(s,), state="running", disk=op["disk"], options=opts)
            self._kill_qemu(rec)
            return self.store.update(
                rec.id, expect=(s,), state="stopped", qemu_pid=None, options=opts,
                reason="a rollback was interrupted; the disk is as it was before it",
            )  # fmt: skip
        return self.store.update(
            rec.id, expect=(s,), state="crashed", qemu_pid=None, options=opts,
            reason=f"the VM exited while {s}",
        ) or self.store.find(rec.id)  # fmt: skip

    # -- boot assets ---------------------------------------------------------------------

    def assets(
        self,
        *,
        kernel: str | os.PathLike[str] | None = None,
        accel: str = "auto",
        flavor: str = "cloud",
        extra_modules: tuple[str, ...] = (),
    ) -> BootAssets:
        """Resolve (building or fetching on first use) what a boot needs. ``flavor``
        picks the distro kernel ("cloud", or "generic" which has 9p for volumes)."""
        key = (
            str(kernel) if kernel else None,
            accel,
            flavor,
            extra_modules,
            os.environ.get("SANDLOT_INITRAMFS"),
        )
        with self._lock:
            cached = self._assets.get(key)
            if cached is not None:
                return cached
            qemu = qemu_binary()
            kern = ensure_kernel(self.home, kernel, flavor=flavor)
            agent = build_agent(self.home)
            override = os.environ.get("SANDLOT_INITRAMFS")  # debugging aid: boot another initramfs
            if override:
                initrd = Path(override).expanduser().absolute()
                if not initrd.is_file():
                    raise HostSetupError(f"SANDLOT_INITRAMFS={override} is not a file")
            else:
                wanted = (*BASE_MODULES, *extra_modules)
                missing = [m for m in extra_modules if m not in kern.modules]
                if missing:
                    raise HostSetupError(f"kernel {kern.version} lacks modules {', '.join(missing)}")
                modules = [(name, kern.modules[name]) for name in kern.load_order(wanted)]
                initrd = build_initramfs(self.home / "initramfs", agent.path, modules)
            choice = accel_mod.choose(
                accel,
                cache_dir=self.home,
                probe_key=f"{qemu}:{kern.sha256[:16]}",
                probe=lambda: probe_kvm(qemu, kern.vmlinux),
            )
            assets = BootAssets(qemu, kern, agent, initrd, choice)
            self._assets[key] = assets
            return assets

    def doctor(self) -> dict[str, object]:
        """Facts about this host for ``sandlot doctor``; never raises for a missing part."""
        report: dict[str, object] = {"home": str(self.home)}
        try:
            qemu = qemu_binary()
            report["qemu"] = {"path": qemu, "version": qemu_version(qemu)}
        except HostSetupError as exc:
            report["qemu"] = {"error": str(exc)}
        blocker = accel_mod.kvm_precheck()
        report["kvm_precheck"] = "ok" if blocker is None else blocker
        try:
            assets = self.assets()
            report["accel"] = {"name": assets.accel.name, "reason": assets.accel.reason}
            report["kernel"] = {
                "version": assets.kernel.version,
                "source": assets.kernel.source,
                "vmlinux": str(assets.kernel.vmlinux),
                "sha256": assets.kernel.sha256,
                "modules": assets.kernel.load_order(BASE_MODULES),
            }
            report["agent"] = {"path": str(assets.agent.path), "compiler": assets.agent.compiler}
            report["initramfs"] = str(assets.initrd)
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["tsc_khz"] = host_tsc_khz()
        report["host_cgroup"] = hostcgroup.detect().report()
        self.home.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.home)
        report["disk_free_gib"] = round(usage.free / (1 << 30), 1)
        report["runtime_dir"] = str(runtime_dir())
        return report


def probe_kvm(qemu: str, vmlinux: Path, timeout: float = 8.0) -> str | None:
    """Boot the kernel under KVM without a root disk; None if it prints its banner in time."""
    cmd = [
        qemu, "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on", "-accel", "kvm", "-cpu", "host",
        "-m", "128M", "-smp", "1", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(vmlinux), "-append", KERNEL_ARGS.replace("quiet", "") + " panic=-1",
        "-serial", "stdio",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    except OSError as exc:
        return str(exc)
    deadline = time.monotonic() + timeout
    out = b""
    assert proc.stdout is not None
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        while time.monotonic() < deadline:
            chunk = proc.stdout.read()
            if chunk:
                out += chunk
                if b"Linux version" in out or b"Run /init" in out or b"Kernel panic" in out:
                    return None
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                return f"QEMU exited ({proc.returncode}): {err.strip()[-300:]}"
            time.sleep(0.05)
        return f"no kernel output within {timeout:.0f}s"
    finally:
        proc.kill()
        proc.wait()
