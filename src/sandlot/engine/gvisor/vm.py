"""One gVisor sandbox: its overlay root, its OCI bundle, the ``runsc`` commands that
run it, and the byte streams to its agent.

The box's root is a host overlay mount: the image's unpacked root (read-only,
shared by every box of the image) below, the box's own layer directory (its
``upper``) on top, so what the box writes survives stop and start. The agent is
the container's init (``--listen``): it serves one Unix socket per agent port
inside the sandbox. The host reaches port N through ``runsc exec`` of the agent's
own relay mode (``--relay /run/.sandlot/port.N``), whose standard input and output
are the stream: no host socket crosses into the sandbox, so nothing of the host
is part of the sandbox's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ... import pids, records
from ...config import free_bytes, tail
from ...crashpoints import crash_point
from ...errors import BootError, HostSetupError, SavedStateError, no_space
from ...net.addresses import GUEST_ADDRESS
from .. import hostcgroup
from ..base import VM, Connector, Drive, StateSink, StateSource, VMRef, VMStatus, Volume
from . import checkpoint, drives, limits, network, runsc
from .mountinfo import is_mounted, unmount

AGENT_DIR = "/.sandlot"  # where the host's agent directory is bound, read-only
AGENT = f"{AGENT_DIR}/sandlot-agent"
SOCKETS = "/run/.sandlot"  # the agent's port sockets (on the box's /run tmpfs)

STATUS = {"running": VMStatus.RUNNING, "paused": VMStatus.PAUSED, "created": VMStatus.LOADING,
          "creating": VMStatus.LOADING, "stopped": VMStatus.GONE}  # fmt: skip

# Every capability gVisor knows in its 2022 release: the agent is the box's root,
# as it is a VM's, and hands commands the users and capabilities they ask for.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN",
    "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
]  # fmt: skip

MS_RDONLY = 1
MAX_LOWER = 400  # overlayfs takes 500 lower layers; each snapshot of a box adds one
START_TIMEOUT = 120.0  # a large saved state from a cold page cache takes a while
MOUNT_DATA_MAX = 4096  # the kernel copies one page of mount options
CHECKPOINT_OVERHEAD = 4 << 20  # bytes of a checkpoint beyond the sandbox's memory: its kernel's state
CONSOLE_DIR = "/.sandlot-console"  # the box's console directory on the host, bound read-write
RUNSC_LOG = "runsc.log"  # in the state directory; every runsc command of the box names it
TIME_WAIT_LIMIT = 65.0  # a save waits this long for the box's TIME_WAITs to end (gVisor's last 60 s)
SANDBOX_PROCESS = "runsc-sandbox"  # the sandbox's own process (its VMRef): argv[0] as runsc sets it
CHECKPOINT = "checkpoint.img"  # what runsc checkpoint writes into its --image-path
HEAD, STATE = "checkpoint.head", "checkpoint.state"  # its streams, taken apart (``checkpoint``)
_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger("sandlot.gvisor")


@dataclass(slots=True)
class SandboxConfig:
    box_id: str
    hostname: str
    run_dir: Path
    state_dir: Path
    layer: Path  # the box's layer directory: upper/, work/ and the name of its base
    base: Path  # the image's unpacked root, shared and read-only
    agent_dir: Path  # the host directory holding the static agent
    platform: str
    ports: int
    memory_mib: int
    cpus: int
    disk_gb: int = 0  # the project quota of the layer directory (limits.bound_disk); 0: none
    shares: tuple[Volume, ...] = ()  # host directories bound into the sandbox, each at its guest path
    drives: tuple[Drive, ...] = ()  # named volumes' tops, each served at a directory bound in (``drives``)
    # the network card's forwarder spec (``network.forwarder_spec``); None: no card, or not known
    # to this process (then ``networked`` asks whether the box's namespace exists)
    net: dict[str, Any] | None = None

    @property
    def cid(self) -> str:
        return f"sandlot-{self.box_id}"

    @property
    def root(self) -> Path:
        return self.run_dir / "root"

    @property
    def bundle(self) -> Path:
        return self.state_dir / "bundle"

    @property
    def console_dir(self) -> Path:
        """Bound into the sandbox, where its init writes its log (see ``--console``)."""
        return self.state_dir / "console"

    @property
    def console_log(self) -> Path:
        return self.console_dir / "console.log"

    @property
    def runsc_log(self) -> Path:
        return self.state_dir / RUNSC_LOG

    @property
    def networked(self) -> bool:
        return self.net is not None or network.exists(self.cid)

    @property
    def net_file(self) -> Path:
        """The forwarder's spec, kept for whichever process restores the sandbox next."""
        return self.state_dir / "network.json"

    @property
    def forwarder_file(self) -> Path:
        return self.state_dir / "forwarder.pid"

    @property
    def ports_file(self) -> Path:
        return self.state_dir / "ports.json"

    def flags(self) -> list[str]:
        """Every runsc command but ``run`` and ``restore`` (``launch_flags``)."""
        return self._runsc(network.entered(self.cid))

    def launch_flags(self) -> list[str]:
        return self._runsc(network.launcher(self.cid))

    def _runsc(self, in_netns: list[str]) -> list[str]:
        net = self.networked
        flags = runsc.global_flags(self.platform, self.runsc_log, network=net)
        return [*(in_netns if net else []), runsc.runsc_binary(), *flags]


def lower_dirs(layer: Path, base: Path) -> list[Path]:
    """What lies below a layer directory, top first: the ``upper`` of each frozen layer
    its ``parent`` files name (snapshots froze them), then the image's root."""
    out: list[Path] = []
    here = layer
    while True:
        try:
            parent = Path((here / "parent").read_text().strip())
        except FileNotFoundError:
            return [*out, base]
        except OSError as exc:
            raise SavedStateError(f"the layer {here} cannot be read: {exc}") from exc
        if len(out) >= MAX_LOWER:
            raise SavedStateError(f"the layer chain of {layer} is deeper than {MAX_LOWER} (or loops)")
        out.append(parent / "upper")
        here = parent


def mount_overlay(cfg: SandboxConfig) -> None:
    """The box's root: its layer over the frozen layers below and the image's root (a
    host overlayfs; root only)."""
    upper, work = cfg.layer / "upper", cfg.layer / "work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    cfg.root.mkdir(parents=True, exist_ok=True)
    unmount(cfg.root)
    lower = ":".join(str(p) for p in lower_dirs(cfg.layer, cfg.base))
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if len(opts) >= MOUNT_DATA_MAX:
        raise SavedStateError(
            f"the box's disk is too many snapshots deep for one overlay mount ({len(opts)} bytes of "
            "layer paths): start a new box from its latest snapshot, or copy its files out"
        )
    if _libc.mount(b"overlay", str(cfg.root).encode(), b"overlay", 0, opts) != 0:
        err = ctypes.get_errno()
        raise HostSetupError(f"cannot mount the box's overlay root at {cfg.root}: {os.strerror(err)}")


MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
CONSOLE_INODES = 16  # files the console's tmpfs holds: the log, and a few a guest may make there


def mount_console(cfg: SandboxConfig) -> None:
    """The console directory the sandbox writes its log into: a tmpfs of the console's
    bound (``SANDLOT_CONSOLE_LOG_MIB``), since anything in the box may write there (the
    directory is bound into it read-write: the init's log must be a file of the
    sandbox's own, not a host descriptor). The newest of a log kept on disk comes along.
    Root only, as every gVisor box; mounted once, kept through saves, ``unmount_console``
    writes the log back to disk as the box ends."""
    if is_mounted(cfg.console_dir):
        return
    size = records.bounds().console_bytes
    kept = _newest(cfg.console_log, size // 2)
    opts = f"size={size},nr_inodes={CONSOLE_INODES},mode=0755".encode()
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc.mount(b"tmpfs", str(cfg.console_dir).encode(), b"tmpfs", flags, opts) != 0:
        err = ctypes.get_errno()
        raise HostSetupError(f"cannot mount the box's console at {cfg.console_dir}: {os.strerror(err)}")
    cfg.console_log.write_bytes(kept)


def unmount_console(cfg: SandboxConfig) -> None:
    """Unmount the console's tmpfs, its log written back to the directory below."""
    if not is_mounted(cfg.console_dir):
        return
    kept = _newest(cfg.console_log, records.bounds().console_bytes)
    unmount(cfg.console_dir, lazy=False)
    with contextlib.suppress(OSError):
        cfg.console_log.write_bytes(kept)


def _newest(path: Path, nbytes: int) -> bytes:
    """The last ``nbytes`` of a file (the head of a log cut in place reads as zeros)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
            return f.read().lstrip(b"\0")
    except OSError:
        return b""


def mount_read_only(lower: list[Path], target: Path) -> None:
    """A read-only overlay of ``lower`` (top first; two at least) at ``target``."""
    opts = ("lowerdir=" + ":".join(str(p) for p in lower)).encode()
    if len(opts) >= MOUNT_DATA_MAX:
        raise SavedStateError("the layer chain is too deep for one overlay mount")
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", MS_RDONLY, opts) != 0:
        err = ctypes.get_errno()
        raise HostSetupError(f"cannot mount a read-only overlay at {target}: {os.strerror(err)}")


def oci_config(cfg: SandboxConfig) -> dict[str, Any]:
    caps = list(CAPABILITIES)
    resources = limits.resources(cfg.memory_mib, cfg.cpus)
    netns: dict[str, str] = {"type": "network"}  # a new one, with loopback only
    if cfg.networked:
        netns["path"] = str(network.netns_path(cfg.cid))
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [
                AGENT,
                "--listen",
                SOCKETS,
                "--ports",
                str(cfg.ports),
                "--console",
                f"{CONSOLE_DIR}/console.log",
                *limits.agent_args(cfg.memory_mib),
                *([("--net=relay" if cfg.net.get("dns_relay") else "--net")] if cfg.net is not None else []),
            ],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}],
        },
        "root": {"path": str(cfg.root), "readonly": False},
        "hostname": cfg.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec"]},
            {"destination": AGENT_DIR, "type": "bind", "source": str(cfg.agent_dir), "options": ["ro"]},
            {"destination": CONSOLE_DIR, "type": "bind", "source": str(cfg.console_dir), "options": ["rw"]},
            # gofer-served: the sandbox reaches no host file outside them, and a checkpoint
            # names them by path, so a restore (a rollback, a fork) binds the same ones
            *(
                {
                    "destination": v.guest,
                    "type": "bind",
                    "source": v.host,
                    "options": ["rbind", "ro" if v.readonly else "rw"],
                }
                for v in cfg.shares
            ),
            *(
                {
                    "destination": d.guest,
                    "type": "bind",
                    "source": str(drives.drives_dir(cfg.run_dir) / d.serial),
                    "options": ["rbind", "ro" if d.guest_readonly else "rw"],
                }
                for d in cfg.drives
            ),
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")] + [netns],
            "resources": resources,
            "cgroupsPath": f"/sandlot/{cfg.cid}",
        },
    }


def _read_pid(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def parent_of(pid: int) -> VMRef | None:
    """The parent of ``pid``, unless it is the host's init (an orphan's adopter)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
    start = pids.start_time(ppid)
    return VMRef(ppid, start) if ppid > 1 and start else None


def container_state(cfg: SandboxConfig) -> dict[str, Any] | None:
    """``runsc state``: the container's status and its sandbox's pid (None: no such container)."""
    try:
        proc = runsc.run([*cfg.flags(), "state", cfg.cid], timeout=10)
    except (subprocess.TimeoutExpired, OSError):
        return None
    if proc.returncode != 0:
        return None
    try:
        state: dict[str, Any] = json.loads(proc.stdout)
    except ValueError:
        return None
    return state


def leftovers(cfg: SandboxConfig) -> bool:
    """Whether runsc or the host still holds anything of the container: a file of it in
    runsc's state root, or its root mounted. Looked at instead of running ``runsc
    delete`` (20 ms) for nothing."""
    return runsc_holds(cfg) or is_mounted(cfg.root) or drives.any_left(cfg.run_dir)


def runsc_holds(cfg: SandboxConfig) -> bool:
    """Whether runsc's state root has a file of the container (whatever runsc names
    them, they carry the container's id)."""
    try:
        names = os.listdir(runsc.state_root())
    except OSError:
        return True  # unknown: ``runsc delete`` finds out
    return any(cfg.cid in name for name in names)


def destroy(cfg: SandboxConfig) -> None:
    """Remove the container (killing what is left of it), its forwarder and network
    namespace, and unmount its root. Idempotent, and cheap where there is nothing left
    (the core ends a VM, then cleans up after it)."""
    if runsc_holds(cfg):
        with contextlib.suppress(subprocess.TimeoutExpired, OSError, HostSetupError):
            runsc.run([*cfg.flags(), "delete", "--force", cfg.cid], timeout=15)
    end_forwarder(cfg)
    with contextlib.suppress(HostSetupError, OSError, subprocess.TimeoutExpired):
        network.remove(cfg.cid)
    unmount(cfg.root)
    unmount_console(cfg)
    drives.stop_all(cfg.run_dir)  # after the sandbox: what it wrote is written back as they end


def end_forwarder(cfg: SandboxConfig) -> None:
    """End the sandbox's forwarder, if one runs (it ends with its sandbox anyway)."""
    try:
        pid_text, _, start = cfg.forwarder_file.read_text().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return
    if pids.alive(pid, start.strip()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            if not pids.alive(pid, start.strip()):
                break
            time.sleep(0.005)
    cfg.forwarder_file.unlink(missing_ok=True)


def launch_forwarder(cfg: SandboxConfig, runner_pid: int) -> subprocess.Popen[bytes]:
    """The box's network, host side (``sandlot.net.forwarder``): started beside ``runsc
    run``/``restore`` rather than after it (a Python process takes ~70 ms to start), and
    ended with ``runner_pid``, the runsc that stays the sandbox's parent. Its listeners
    in the namespace need no address yet (``IP_FREEBIND``). ``forwarder_ready`` waits."""
    assert cfg.net is not None
    end_forwarder(cfg)
    try:
        bound = json.loads(cfg.ports_file.read_text())
    except (OSError, ValueError):
        bound = []
    spec = {**cfg.net, "netns": str(network.netns_path(cfg.cid)), "watch_pid": runner_pid, "bound": bound}
    with open(cfg.state_dir / "forwarder.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandlot.net.forwarder", json.dumps(spec)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        )  # fmt: skip
    cfg.forwarder_file.write_text(f"{proc.pid} {pids.start_time(proc.pid) or ''}")
    return proc


def forwarder_ready(cfg: SandboxConfig, proc: subprocess.Popen[bytes]) -> None:
    """Wait for the forwarder's listeners; record the host ports it published."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if not line:
        proc.wait()
        raise HostSetupError(f"the box's network did not start:\n{tail(cfg.state_dir / 'forwarder.log', 10)}")
    ports = json.loads(line).get("ports", [])
    cfg.ports_file.write_text(json.dumps(ports))


class GvisorVM(VM):
    """One sandbox: started here, or found again by its sandbox process from another process.

    A saved state is written by ``runsc checkpoint``, which ends the sandbox: a snapshot
    restores it at once over the box's new top layer, so the sandbox process changes
    (``ref``) while the VM, for the core, runs on."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.ref = VMRef(0, "")
        self._exited: asyncio.Future[int | None] | None = None
        self._pidfd: int | None = None
        self._relays: set[asyncio.subprocess.Process] = set()
        self._open: asyncio.Event | None = None  # cleared while a save runs: no new relay may start
        self._ending = False  # a save that leaves the sandbox stopped (a suspend) is under way

    async def start(self, restore_from: Path | None = None, written: Awaitable[object] | None = None) -> None:
        """Run the sandbox: booted, or (``restore_from``) from a checkpoint image, which
        ``written`` (where given) is still writing out while the sandbox's mounts and
        network are made: runsc is started once it is done."""
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.bundle.mkdir(parents=True, exist_ok=True)
        cfg.console_dir.mkdir(parents=True, exist_ok=True)
        if await asyncio.to_thread(leftovers, cfg):  # a crash's, under the same id
            await asyncio.to_thread(destroy, cfg)
        if cfg.disk_gb:
            await asyncio.to_thread(limits.bound_disk, cfg.layer, cfg.disk_gb)
        await asyncio.to_thread(mount_overlay, cfg)
        await asyncio.to_thread(mount_console, cfg)
        if cfg.drives:
            try:
                await asyncio.to_thread(drives.serve, cfg.run_dir, cfg.drives)
            except BaseException:
                await asyncio.to_thread(destroy, cfg)
                raise
        if cfg.net is not None:
            open_mode = bool(cfg.net.get("open_port"))
            rules = cfg.state_dir / "netns-rules"
            await asyncio.to_thread(network.prepare, cfg.cid, open_mode=open_mode, rules=rules)
        (cfg.bundle / "config.json").write_text(json.dumps(oci_config(cfg)))
        if written is not None:
            try:
                await written
            except BaseException:
                await asyncio.to_thread(destroy, cfg)
                raise
        cfg.runsc_log.write_bytes(b"")
        pid_file = cfg.state_dir / "sandbox.pid"  # written once the sandbox runs
        pid_file.unlink(missing_ok=True)
        common = [f"--bundle={cfg.bundle}", f"--pid-file={pid_file}"]
        if restore_from is None:
            cfg.console_log.write_bytes(b"")
            argv = [*cfg.launch_flags(), *limits.runsc_flags(), "run", *common, cfg.cid]
        else:
            cfg.console_log.touch()  # the restored init's log is reopened by its path
            argv = [
                *cfg.launch_flags(),
                *limits.runsc_flags(),
                "restore",
                f"--image-path={restore_from}",
                *common,
                cfg.cid,
            ]
        what = "start the sandbox" if restore_from is None else "restore the saved state"
        # Not --detach: this runsc stays the sandbox's parent and reaps it the moment it
        # ends, so that nothing waits on an orphan for whatever init the host has (runsc
        # delete does, and a checkpoint ends the sandbox). Its own session: it outlives
        # this process, as the box does. The container's stdout and stderr are runsc's
        # own, so both go to the console log (where runsc's complaints then land too).
        with open(cfg.console_log, "ab") as console:
            runner = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=console, stderr=console, start_new_session=True
            )
        forwarder = None
        if cfg.net is not None:
            try:
                forwarder = await asyncio.to_thread(launch_forwarder, cfg, runner.pid)
            except BaseException:
                runner.kill()
                await asyncio.to_thread(runner.wait)
                await asyncio.to_thread(destroy, cfg)
                raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        delay = 0.005
        while True:
            if _read_pid(pid_file):
                state = await asyncio.to_thread(container_state, cfg)
                pid = int(state.get("pid") or 0) if state else 0
                if state is not None and state.get("status") == "running" and pid > 0:
                    break
            if runner.poll() is not None or loop.time() > deadline:
                if runner.returncode is None:
                    runner.kill()
                await asyncio.to_thread(runner.wait)
                await asyncio.to_thread(destroy, cfg)
                raise BootError(f"runsc could not {what}:\n{tail(cfg.runsc_log, 20)}", tail(cfg.console_log))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        self.ref = VMRef(pid, pids.start_time(pid) or "")
        if cfg.net is not None and forwarder is not None:
            try:
                await asyncio.to_thread(network.started, cfg.cid, list(cfg.net.get("addresses", [])))
                await asyncio.to_thread(forwarder_ready, cfg, forwarder)
            except BaseException:
                await asyncio.to_thread(destroy, cfg)
                raise
        self._watch_exit()

    @classmethod
    def attach(cls, cfg: SandboxConfig, ref: VMRef) -> GvisorVM:
        vm = cls(cfg)
        vm.ref = ref
        vm._watch_exit()
        return vm

    def _watch_exit(self) -> None:
        loop = asyncio.get_running_loop()
        if self._exited is None or self._exited.done():
            self._exited = loop.create_future()
        if not pids.alive(self.ref.pid, self.ref.start):
            self._exited.set_result(None)
            return
        try:
            self._pidfd = os.pidfd_open(self.ref.pid)
        except OSError:
            self._exited.set_result(None)
            return
        loop.add_reader(self._pidfd, self._gone)

    def _unwatch(self) -> None:
        """Stop taking the sandbox process's end for the VM's (a checkpoint ends it)."""
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _gone(self) -> None:
        self._unwatch()
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)  # not our child: its status is runsc's to know

    # -- the VM interface ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exited is not None and not self._exited.done() and not self._ending

    async def kill(self, grace: float = 2.0) -> None:
        """End the sandbox now. It has no orderly exit of its own to wait ``grace`` for:
        the box's init ignores SIGTERM, and an orderly stop is the agent's shutdown,
        which the core asks for first where it wants one (measured: a rollback spent
        0.5 s of its 0.8 s waiting here for a SIGTERM that did nothing)."""
        if not pids.alive(self.ref.pid, self.ref.start):
            self._gone()  # a suspend's checkpoint ended it already
        if self.running or self._ending:
            if pids.alive(self.ref.pid, self.ref.start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.ref.pid, signal.SIGKILL)
            await self.wait_exit(max(grace, 5.0))
        await asyncio.to_thread(destroy, self.cfg)

    async def _runsc(self, *args: str, timeout: float = 30.0) -> None:
        proc = await asyncio.to_thread(runsc.run, [*self.cfg.flags(), *args], timeout)
        if proc.returncode != 0:
            why = proc.stderr.strip() or tail(self.cfg.runsc_log, 5)
            raise SavedStateError(f"runsc {args[0]} failed: {why}")

    async def pause(self) -> None:
        await self._runsc("pause", self.cfg.cid)

    async def resume(self) -> None:
        await self._runsc("resume", self.cfg.cid)

    async def status(self) -> VMStatus:
        if not self.running:
            return VMStatus.GONE
        state = await asyncio.to_thread(container_state, self.cfg)
        if state is None:
            return VMStatus.GONE if not self.running else VMStatus.UNKNOWN
        return STATUS.get(str(state.get("status")), VMStatus.UNKNOWN)

    async def run_restored(self, timeout: float) -> None:
        """``start`` returned once runsc said the restored sandbox runs: only that its
        process still does is looked at again (not ``runsc state``: 20 ms)."""
        if not self.running:
            raise self.failure("the restored sandbox is not running")

    async def save(
        self,
        directory: Path,
        *,
        new_disk: Path | None,
        keep_running: bool,
        new_drives: Mapping[str, Path] | None = None,
        sink: StateSink | None = None,
        fixed: asyncio.Event | None = None,
    ) -> float:
        """Checkpoint the sandbox into ``directory`` (which ends it) and, to keep it running,
        restore it at once over ``new_disk``. No host file may be open in the sandbox
        then: its relays (this process's and any other's) are ended first, and no new one
        starts until the save is over (this process's wait; others' find it paused).
        With a ``sink``, the checkpoint image is kept as its chunks and leaves
        ``directory`` once the restore no longer reads it."""
        await asyncio.to_thread(self._check_room, directory, 2 if sink is not None else 1)
        loop = asyncio.get_running_loop()
        gate = self._gate()
        gate.clear()
        self._ending = not keep_running  # a suspend: this process's sessions wait for a resume
        try:
            await self._quiesce()
            t0 = loop.time()
            runner = parent_of(self.ref.pid)
            self._unwatch()
            placement = self.host_cgroup()
            # the checkpoint's own work may need more than the box's bound (limits.py)
            slack = limits.CHECKPOINT_SLACK_MIB << 20
            room = placement.memory_lifted(slack) if placement else contextlib.nullcontext()
            argv = [*self.cfg.flags(), "checkpoint", f"--image-path={directory}", self.cfg.cid]
            with room:
                proc = await asyncio.to_thread(runsc.run, argv, 300.0)
            if proc.returncode != 0:
                self._ending = False
                survived = pids.alive(self.ref.pid, self.ref.start)
                if survived:
                    self._watch_exit()
                    with contextlib.suppress(SavedStateError):
                        await self.resume()
                else:
                    self._gone()
                why = runsc.reason(proc.stderr) or tail(self.cfg.runsc_log, 5)
                if "no space left" in why.lower():
                    raise no_space(directory, "runsc checkpoint could not save the state")
                if not survived:
                    why += (
                        "; the sandbox ended during its checkpoint, and the box's processes with it "
                        "(its disk is kept): see the host's kernel log for an out-of-memory kill"
                    )
                raise SavedStateError(f"runsc checkpoint failed: {why}")
            # The image is whole once runsc returns; a booted sandbox then takes seconds to
            # wind down by itself (a restored one does not): nothing of it is needed any more.
            image = directory / CHECKPOINT
            # with a sink, the image is taken apart into chunks while the sandbox is restored
            # from it (both only read it); it goes once both are done
            kept = (
                asyncio.ensure_future(asyncio.to_thread(into_sink, image, sink)) if sink is not None else None
            )
            try:
                if kept is None:
                    with contextlib.suppress(OSError):
                        fd = os.open(image, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                if pids.alive(self.ref.pid, self.ref.start):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.ref.pid, signal.SIGKILL)
                await self._reaped(self.ref)
                if runner is not None:
                    # the runsc that ran it deletes the container as it ends: the restore must not
                    # make its container of the same name before that
                    await self._reaped(runner)
                if keep_running:
                    crash_point("snapshot.after-checkpoint")
                    if new_disk is not None:
                        self.cfg.layer = new_disk
                        self.cfg.base = Path((new_disk / "base").read_text().strip())
                    if self.cfg.drives:  # closed, so the layers the core froze are whole; served anew
                        await asyncio.to_thread(drives.stop_all, self.cfg.run_dir)
                        moved = new_drives or {}
                        self.cfg.drives = tuple(
                            replace(d, path=moved.get(d.serial, d.path)) for d in self.cfg.drives
                        )
                    try:
                        await self.start(restore_from=directory)
                    except BaseException:
                        self._gone()
                        raise
                stopped = loop.time() - t0
            finally:
                if kept is not None:
                    await asyncio.wait([kept])
            if kept is not None and sink is not None:
                kept.result()  # a sink that failed fails the save (the sandbox runs on regardless)
                if not sink.shared:  # (a shared state keeps it: the form its restores read, free)
                    image.unlink(missing_ok=True)  # its chunks hold it now
            return stopped
        finally:
            gate.set()

    def _check_room(self, directory: Path, copies: int) -> None:
        """NoSpace unless the checkpoint fits for sure: runsc ends a sandbox whose save
        fails, so a full home must be found before, not by the save. A checkpoint holds
        at most the sandbox's memory in use (the pages of its memory file) and its
        kernel's state; ``copies``: 2 where its state is inflated beside it (a sink's)."""
        need = CHECKPOINT_OVERHEAD
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{self.ref.pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{self.ref.pid}/fd/{fd}").startswith("/memfd:runsc-memory"):
                        need += copies * os.stat(f"/proc/{self.ref.pid}/fd/{fd}").st_blocks * 512
        if free_bytes(directory.parent) < need:
            raise no_space(directory, f"a checkpoint of this sandbox needs up to {need >> 20} MiB")

    def _gate(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def _reaped(self, ref: VMRef) -> None:
        """Wait for a process to end (the checkpointed sandbox, then the runsc that ran it)."""
        for _ in range(500):
            if not pids.alive(ref.pid, ref.start):
                return
            await asyncio.sleep(0.005)
        with contextlib.suppress(ProcessLookupError):
            os.kill(ref.pid, signal.SIGKILL)

    async def _wait_time_waits(self, held: list[network.Flow], end: float) -> None:
        """The box holds endpoints in TIME_WAIT (``network.held_time_waits``): a save
        waits for them to end, up to ``end``; then it is refused, the box left running."""
        while held:
            if time.monotonic() >= end:
                box_port, peer, peer_port = held[0]
                raise SavedStateError(
                    f"the box holds {len(held)} TCP connection(s) in TIME_WAIT ({GUEST_ADDRESS}:"
                    f"{box_port} to {peer}:{peer_port} among them), which gVisor cannot save; they end "
                    "a minute after they closed: try again then (the box is still running)"
                )
            await asyncio.sleep(1.0)
            held = await asyncio.to_thread(network.held_time_waits, self.cfg.cid)

    async def _quiesce(self) -> None:
        """End every process started from outside the sandbox (``runsc exec``: the relays
        of this process and of others), whose standard streams are host pipes no saved
        state can hold, and reset every TCP connection of the box (its netstack cannot
        save a connected endpoint: the box's programs see ECONNRESET); then pause the
        sandbox, in which no new one can start."""
        mine = list(self._relays)
        for proc in mine:
            if proc.stdin is not None:
                proc.stdin.close()  # the relay's end of input: it closes the socket and exits
        if mine:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in mine], timeout=2.0)
        for proc in mine:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        networked = self.cfg.networked
        time_waits_end = time.monotonic() + TIME_WAIT_LIMIT
        for _ in range(50):
            if networked:
                reset: int = await asyncio.to_thread(network.reset_connections, self.cfg.cid)
                if reset:
                    await asyncio.sleep(0.02)  # the resets reach the box's netstack
            outsiders = await self._outsiders()
            if not outsiders:
                await self.pause()
                live: int = await asyncio.to_thread(network.connections, self.cfg.cid) if networked else 0
                held = await asyncio.to_thread(network.held_time_waits, self.cfg.cid) if networked else []
                if not live and not held and not await self._outsiders():
                    return
                await self.resume()
                if held:
                    await self._wait_time_waits(held, time_waits_end)
                continue
            for pid in outsiders:
                await asyncio.to_thread(
                    runsc.run, [*self.cfg.flags(), "kill", f"--pid={pid}", self.cfg.cid, "KILL"], 10.0
                )
            await asyncio.sleep(0.02)
        raise SavedStateError(
            "processes started from outside the sandbox kept coming; the state was not saved"
        )

    async def _outsiders(self) -> list[int]:
        """The pids in the sandbox started by ``runsc exec`` (parent 0, and not the init)."""
        proc = await asyncio.to_thread(runsc.run, [*self.cfg.flags(), "ps", self.cfg.cid], 10.0)
        if proc.returncode != 0:
            raise SavedStateError(f"runsc ps failed: {proc.stderr.strip()}")
        out = []
        for line in proc.stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3 and fields[1].isdigit() and fields[2] == "0" and fields[1] != "1":
                out.append(int(fields[1]))
        return out

    async def published_ports(self) -> list[tuple[str, int, int]]:
        try:
            ports = json.loads(self.cfg.ports_file.read_text())
        except (OSError, ValueError):
            return []
        return [(str(a), int(h), int(g)) for a, h, g in ports]

    def agent_connector(self, port: int) -> Connector:
        cfg = self.cfg

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            await self._gate().wait()  # a save in progress: the sandbox it restores answers
            if not self.running:
                raise ConnectionRefusedError(f"agent port {port}: the sandbox has ended")
            argv = [*cfg.flags(), "exec", cfg.cid, AGENT, "--relay", f"{SOCKETS}/port.{port}"]
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                limit=1 << 22, start_new_session=True,
            )  # fmt: skip
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            said = b""
            while b"connected\n" not in said:  # the relay says so once the agent's socket took it
                line = await proc.stderr.readline()
                if not line:
                    await proc.wait()
                    # not there yet (the agent still starting) or the sandbox is gone: the
                    # session's retry loop tells the two apart by the VM's exit
                    why = said.decode(errors="replace").strip()
                    raise ConnectionRefusedError(f"agent port {port}: {why}")
                said += line
            self._relays.add(proc)
            drain = asyncio.ensure_future(_drain(proc))
            drain.add_done_callback(lambda _: self._relays.discard(proc))
            return proc.stdout, proc.stdin

        return connect

    def saved_facts(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "engine": "gvisor",
            "memory_mib": cfg.memory_mib,
            "cpus": cfg.cpus,
            "agent_ports": cfg.ports,
            "network": cfg.networked,
            "accel": cfg.platform,
            # the restored init maps its executable again by path: it must be the very same build
            "engine_facts": {
                "runsc_version": runsc.runsc_version(),
                "platform": cfg.platform,
                "agent_build": cfg.agent_dir.name,
            },
        }

    def console_tail(self, lines: int = 40) -> str:
        return tail(self.cfg.console_log, lines)

    def failure(self, what: str) -> BootError:
        msg = what
        err = tail(self.cfg.runsc_log, 20)
        if err:
            msg += f"\n--- runsc log ---\n{err}"
        return BootError(msg, self.console_tail())

    def cleanup(self) -> None:
        destroy(self.cfg)
        with contextlib.suppress(OSError):
            self.cfg.root.rmdir()
        with contextlib.suppress(OSError):
            self.cfg.run_dir.rmdir()

    def host_cgroup(self) -> hostcgroup.Placement | None:
        return hostcgroup.placement_of(self.ref.pid) if pids.alive(self.ref.pid, self.ref.start) else None


def into_sink(image: Path, sink: StateSink) -> None:
    """A checkpoint image into a saved state's chunks: its head, and its state inflated
    and cut by content, so that checkpoints share what did not change
    (``checkpoint``); an image framed otherwise, whole, as runsc wrote it."""
    inflated = image.with_name(f".{image.name}.state")
    try:
        with open(image, "rb") as f, open(inflated, "wb") as state:
            try:
                head = checkpoint.split(f, state)
            except checkpoint.NotFramed as exc:
                log.info("checkpoint image %s kept whole: %s", image, exc)
                head = None
        if head is not None:
            sink.stream(HEAD, head)
            sink.stream_pieces(STATE, checkpoint.cut(inflated))
            return
        with open(image, "rb") as f:
            sink.stream_pieces(CHECKPOINT, iter(functools.partial(f.read, 64 << 10), b""))
    finally:
        inflated.unlink(missing_ok=True)


def from_source(source: StateSource, directory: Path, *, level: int = 0) -> Path:
    """The checkpoint image of a state kept as chunks, written out into ``directory``
    (made, or emptied) for ``runsc restore`` to read; each chunk checked as it is read.
    ``level``: its state's deflate level (``checkpoint.join``: 0 for an image read once)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    with open(directory / CHECKPOINT, "wb") as out:
        if CHECKPOINT in source.streams():
            for piece in source.stream_pieces(CHECKPOINT):
                out.write(piece)
        else:
            checkpoint.join(source.stream(HEAD), source.stream_pieces(STATE), out, level=level)
    return directory


async def _drain(proc: asyncio.subprocess.Process) -> None:
    """Read the relay's stderr to its end (so it never blocks on it) and reap it."""
    assert proc.stderr is not None
    with contextlib.suppress(Exception):
        while await proc.stderr.read(4096):
            pass
    with contextlib.suppress(Exception):
        await proc.wait()
