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
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import pids
from ...errors import BootError, HostSetupError, SavedStateError
from .. import hostcgroup
from ..base import VM, Connector, VMRef, VMStatus
from . import runsc

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

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


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
    def console_log(self) -> Path:
        return self.state_dir / "console.log"

    @property
    def runsc_log(self) -> Path:
        return self.state_dir / "runsc.log"

    def flags(self) -> list[str]:
        return [runsc.runsc_binary(), *runsc.global_flags(self.platform, self.runsc_log)]


def tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def is_mounted(path: Path) -> bool:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    target = str(path)
    return any(line.split()[4] == target for line in text.splitlines() if len(line.split()) > 4)


def mount_overlay(cfg: SandboxConfig) -> None:
    """The box's root: its layer over the image's root (a host overlayfs; root only)."""
    upper, work = cfg.layer / "upper", cfg.layer / "work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    cfg.root.mkdir(parents=True, exist_ok=True)
    unmount(cfg.root)
    opts = f"lowerdir={cfg.base},upperdir={upper},workdir={work}".encode()
    if _libc.mount(b"overlay", str(cfg.root).encode(), b"overlay", 0, opts) != 0:
        err = ctypes.get_errno()
        raise HostSetupError(f"cannot mount the box's overlay root at {cfg.root}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    while is_mounted(path):
        if _libc.umount2(str(path).encode(), MNT_DETACH) != 0:
            return


def oci_config(cfg: SandboxConfig) -> dict[str, Any]:
    caps = list(CAPABILITIES)
    resources: dict[str, Any] = {
        "memory": {"limit": cfg.memory_mib << 20},
        "cpu": {"quota": 100_000 * max(1, cfg.cpus), "period": 100_000},
    }
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [AGENT, "--listen", SOCKETS, "--ports", str(cfg.ports)],
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
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "resources": resources,
            "cgroupsPath": f"/sandlot/{cfg.cid}",
        },
    }


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


def destroy(cfg: SandboxConfig) -> None:
    """Remove the container (killing what is left of it) and unmount its root. Idempotent."""
    with contextlib.suppress(subprocess.TimeoutExpired, OSError, HostSetupError):
        runsc.run([*cfg.flags(), "delete", "--force", cfg.cid], timeout=15)
    unmount(cfg.root)


class GvisorVM(VM):
    """One sandbox: started here, or found again by its sandbox process from another process."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.ref = VMRef(0, "")
        self._exited: asyncio.Future[int | None] | None = None
        self._pidfd: int | None = None
        self._relays: set[asyncio.subprocess.Process] = set()

    async def start(self) -> None:
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.bundle.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(destroy, cfg)  # a crash's leftovers under the same id
        await asyncio.to_thread(mount_overlay, cfg)
        (cfg.bundle / "config.json").write_text(json.dumps(oci_config(cfg)))
        cfg.runsc_log.write_bytes(b"")
        # The container's stdout and stderr are runsc's own, inherited by the sandbox for
        # its whole life: a pipe would never reach its end, so both go to the console log
        # (where runsc's own complaints then land too).
        with open(cfg.console_log, "wb") as console:
            proc = await asyncio.to_thread(
                subprocess.run,
                [*cfg.flags(), "run", "--detach", f"--bundle={cfg.bundle}", cfg.cid],
                stdin=subprocess.DEVNULL, stdout=console, stderr=console, timeout=60,
            )  # fmt: skip
        if proc.returncode != 0:
            await asyncio.to_thread(destroy, cfg)
            raise BootError(f"runsc could not start the sandbox:\n{tail(cfg.runsc_log, 20)}",
                            tail(cfg.console_log))  # fmt: skip
        state = await asyncio.to_thread(container_state, cfg)
        pid = int(state.get("pid") or 0) if state else 0
        if pid <= 0:
            await asyncio.to_thread(destroy, cfg)
            raise BootError("runsc started the sandbox but did not report its process", tail(cfg.console_log))
        self.ref = VMRef(pid, pids.start_time(pid) or "")
        self._watch_exit()

    @classmethod
    def attach(cls, cfg: SandboxConfig, ref: VMRef) -> GvisorVM:
        vm = cls(cfg)
        vm.ref = ref
        vm._watch_exit()
        return vm

    def _watch_exit(self) -> None:
        loop = asyncio.get_running_loop()
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

    def _gone(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)  # not our child: its status is runsc's to know

    # -- the VM interface ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exited is not None and not self._exited.done()

    def exited(self) -> asyncio.Future[int | None]:
        assert self._exited is not None
        return self._exited

    async def wait_exit(self, timeout: float | None = None) -> bool:
        if self._exited is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except TimeoutError:
            return False
        return True

    async def kill(self, grace: float = 2.0) -> None:
        """SIGTERM to the box's init first, the whole sandbox killed after ``grace``."""
        if self.running:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(runsc.run, [*self.cfg.flags(), "kill", self.cfg.cid, "TERM"], 10.0)
            if not await self.wait_exit(grace) and pids.alive(self.ref.pid, self.ref.start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.ref.pid, signal.SIGKILL)
                await self.wait_exit(5.0)
        await asyncio.to_thread(destroy, self.cfg)

    async def _runsc(self, *args: str) -> None:
        proc = await asyncio.to_thread(runsc.run, [*self.cfg.flags(), *args], 30.0)
        if proc.returncode != 0:
            raise SavedStateError(f"runsc {args[0]} failed: {proc.stderr.strip()}")

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
        raise SavedStateError("engine 'gvisor' does not restore saved states yet")

    async def save(self, directory: Path, *, new_disk: Path | None, keep_running: bool) -> float:
        raise SavedStateError("engine 'gvisor' does not save running states yet")

    async def published_ports(self) -> list[tuple[str, int, int]]:
        return []

    def agent_connector(self, port: int) -> Connector:
        cfg = self.cfg

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
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
            "network": False,
            "accel": cfg.platform,
            "engine_facts": {"runsc_version": runsc.runsc_version(), "platform": cfg.platform},
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


async def _drain(proc: asyncio.subprocess.Process) -> None:
    """Read the relay's stderr to its end (so it never blocks on it) and reap it."""
    assert proc.stderr is not None
    with contextlib.suppress(Exception):
        while await proc.stderr.read(4096):
            pass
    with contextlib.suppress(Exception):
        await proc.wait()
