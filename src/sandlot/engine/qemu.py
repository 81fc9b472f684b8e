"""QEMU microvm processes: command line, launch, exit watch, QMP, console log.

A VM is a QEMU process plus a few files: the console log, QEMU's stderr, and
unix sockets for QMP and the agent's virtio-serial ports. Nothing here speaks
the agent protocol; ``runtime`` wires the two together.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from .. import _proc
from ..errors import BootError, HostSetupError, StateError
from . import hostcgroup

QEMU_BINARY = "qemu-system-x86_64"

# Facts measured for fast, reliable microvm boots (see DESIGN.md): without
# tsc_early_khz about half of TCG boots hang; rtc=off costs 2 s; ACPI stays on
# for virtio-mmio discovery.
KERNEL_ARGS = (
    "console=ttyS0 panic=-1 reboot=t quiet cryptomgr.notests no_timer_check tsc=reliable "
    "mitigations=off i8042.noaux i8042.nokbd i8042.nopnp 8250.nr_uarts=1"
)


# Under TCG: "max" gives the guest the SSE4.2/AVX2 that modern wheels (numpy...)
# require, but its ERMS/FSRM make the kernel and libc copy with `rep movsb`,
# which TCG emulates byte by byte: without them pipes and virtio-serial run
# 2-3x faster (measured: 66 -> 170 MB/s of exec stdout).
TCG_CPU = "max,erms=off,fsrm=off"
# The translated-code cache grows to 1 GiB by default; 128 MiB holds what a
# Python workload translates (~100 MiB, no measurable slowdown) and bounds a
# busy box's host memory. 32 MiB would save 13 MiB idle but cost 50% on Python.
TCG_CODE_CACHE_MIB = 128


def qemu_binary() -> str:
    path = os.environ.get("SANDLOT_QEMU") or shutil.which(QEMU_BINARY)
    if not path:
        raise HostSetupError(f"{QEMU_BINARY} not found: install qemu-system-x86 (Debian/Ubuntu)")
    return path


def qemu_version(binary: str | None = None) -> str:
    return _qemu_version(binary or qemu_binary())


@functools.lru_cache(maxsize=8)
def _qemu_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out else ""
    return first.removeprefix("QEMU emulator version ").strip()


def host_tsc_khz() -> int | None:
    """The host TSC frequency, which a TCG guest's TSC runs at."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    except (OSError, ValueError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


# QEMU user networking (libslirp) gives the guest 10.0.2.15 behind a virtual
# gateway 10.0.2.2; the egress proxy answers at this address and port, and the
# host's DNS answerer at port 53.
PROXY_ADDRESS = "10.0.2.100"
PROXY_PORT = 3128
DNS_PORT = 53


@dataclass(slots=True)
class NetConfig:
    """A network card on QEMU's user networking. ``restrict``: nothing leaves but
    the proxy, the DNS answerer and the forwards; ``proxy_command`` and
    ``dns_command`` run once per guest connection to their port of the proxy
    address, with the connection as their standard input and output; the proxy
    also on the ``transparent_ports`` of that address, with ``--transparent PORT``."""

    restrict: bool = True
    proxy_command: str | None = None
    dns_command: str | None = None
    forwards: list[tuple[str, int, int]] = field(default_factory=list)  # host address, host port, guest port
    transparent_ports: list[int] = field(default_factory=list)

    @property
    def dns_relay(self) -> bool:
        """Whether the guest asks ``dns_command`` for names (through the agent's relay):
        where the network is restricted, QEMU's own resolver is out of its reach."""
        return self.restrict and self.dns_command is not None

    def netdev(self) -> str:
        opts = f"user,id=net0,ipv6=off,restrict={'on' if self.restrict else 'off'}"
        for address, host_port, guest_port in self.forwards:
            opts += f",hostfwd=tcp:{address}:{host_port}-:{guest_port}"
        if self.proxy_command:
            opts += f",guestfwd=tcp:{PROXY_ADDRESS}:{PROXY_PORT}-cmd:{_q(self.proxy_command)}"
            for port in self.transparent_ports:
                cmd = f"{self.proxy_command} --transparent {port}"
                opts += f",guestfwd=tcp:{PROXY_ADDRESS}:{port}-cmd:{_q(cmd)}"
        if self.dns_command:
            opts += f",guestfwd=tcp:{PROXY_ADDRESS}:{DNS_PORT}-cmd:{_q(self.dns_command)}"
        return opts


@dataclass(slots=True)
class VMConfig:
    kernel: Path
    initrd: Path
    disk: Path
    run_dir: Path  # sockets (short path)
    state_dir: Path  # console log, QEMU stderr
    accel: str = "tcg"
    memory_mib: int = 512
    cpus: int = 1
    hostname: str = "sandlot"
    ports: int = 1
    detached: bool = True
    volumes: list[tuple[str, str, bool]] = field(default_factory=list)  # host dir, mount tag, read-only
    extra_kernel_args: list[str] = field(default_factory=list)
    network: NetConfig | None = None  # None: no network card at all
    # Guest RAM in a file: shared (the file *is* the RAM: a template being made)
    # or private (copy-on-write over a snapshot's memory image: a restore or a fork).
    disk_readonly: bool = False
    ram_file: Path | None = None
    ram_shared: bool = False
    incoming: bool = False  # wait for a saved state (``QemuVM.load_state``) instead of booting
    # Or load this saved state, read from a descriptor QEMU inherits, in the one QMP
    # exchange that also lets the guest run (``run_restored``): every restore's path.
    restore_from: Path | None = None
    restore_ignore_shared: bool = False  # the state holds no RAM: it is in ``ram_file``

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    def agent_socket(self, port: int = 0) -> Path:
        return self.run_dir / f"agent.{port}.sock"

    @property
    def console_log(self) -> Path:
        return self.state_dir / "console.log"

    @property
    def stderr_log(self) -> Path:
        return self.state_dir / "qemu.stderr"


def _q(value: object) -> str:
    """A value inside a QEMU option list: commas are doubled."""
    return str(value).replace(",", ",,")


def build_command(cfg: VMConfig, binary: str) -> list[str]:
    append = KERNEL_ARGS
    tsc = host_tsc_khz()
    if tsc:
        append += f" tsc_early_khz={tsc}"
    append += f" sandlot.hostname={cfg.hostname}"
    if cfg.network is not None:
        append += " sandlot.net=1"
        if cfg.network.dns_relay:
            append += " sandlot.dns=relay"
    if cfg.extra_kernel_args:
        append += " " + " ".join(cfg.extra_kernel_args)
    machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on"
    ram: list[str] = []
    if cfg.ram_file is not None:
        # named like the machine's default RAM block, so a state saved by any VM loads into any other
        machine += ",memory-backend=microvm.ram"
        share = "on" if cfg.ram_shared else "off"
        backend = f"memory-backend-file,id=microvm.ram,size={cfg.memory_mib}M,mem-path={_q(cfg.ram_file)}"
        ram = ["-object", f"{backend},share={share}"]
    if cfg.accel == "kvm":
        accel = ["-accel", "kvm", "-cpu", "host"]
    else:
        accel = ["-accel", f"tcg,tb-size={TCG_CODE_CACHE_MIB}", "-cpu", TCG_CPU]
    cmd = [
        binary,
        "-name", f"sandlot-{cfg.hostname}",
        "-M", machine,
        *accel,
        "-smp", str(cfg.cpus),
        "-m", f"{cfg.memory_mib}M",
        *ram,
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-chardev", f"file,id=console,path={_q(cfg.console_log)}",
        "-serial", "chardev:console",
        "-device", f"virtio-serial-device,max_ports={cfg.ports + 1}",  # port 0 is reserved for consoles
    ]  # fmt: skip
    if not (cfg.incoming or cfg.restore_from):
        # a VM that loads a saved state gets its kernel from that state; loading the
        # 45 MB vmlinux again would only cost time and memory
        cmd += ["-kernel", str(cfg.kernel), "-initrd", str(cfg.initrd), "-append", append]
    for port in range(cfg.ports):
        cmd += [
            "-chardev", f"socket,id=agent{port},path={_q(cfg.agent_socket(port))},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent{port},name=sandlot.{port}",
        ]  # fmt: skip
    cmd += [
        "-drive", f"id=root,file={_q(cfg.disk)},format=qcow2,if=none,discard=unmap,detect-zeroes=unmap"
                  + (",readonly=on" if cfg.disk_readonly else ""),
        "-device", "virtio-blk-device,drive=root",
        "-qmp", f"unix:{_q(cfg.qmp_socket)},server=on,wait=off",
    ]  # fmt: skip
    if cfg.network is not None:
        cmd += ["-netdev", cfg.network.netdev(), "-device", "virtio-net-device,netdev=net0"]
    for host, tag, readonly in cfg.volumes:
        # security_model=none: files keep the host user's ownership; no root needed
        opts = f"local,id={tag},path={_q(host)},security_model=none" + (",readonly=on" if readonly else "")
        cmd += ["-fsdev", opts, "-device", f"virtio-9p-device,fsdev={tag},mount_tag={tag}"]
    if cfg.incoming or cfg.restore_from is not None:
        # -S: the guest runs only once the host says ``cont``
        cmd += ["-S", "-incoming", "defer"]
    return cmd


async def _set_migration(q: QMPClient, ignore_shared: bool) -> None:
    caps = [{"capability": "x-ignore-shared", "state": ignore_shared}]
    await q.execute("migrate-set-capabilities", {"capabilities": caps})
    # the default bandwidth cap (128 MiB/s) is for networks, not a local file
    await q.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})


async def _wait_migration(q: QMPClient, timeout: float, vm: QemuVM) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    delay = 0.002
    while True:
        info = await q.execute("query-migrate")
        if not isinstance(info, dict):
            info = {}
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise StateError(f"QEMU could not save or load the state: {info.get('error-desc', status)}")
        if status is None and not vm.running:
            raise StateError("QEMU exited while saving or loading the state")
        if asyncio.get_running_loop().time() > deadline:
            with contextlib.suppress(Exception):
                await q.execute("migrate_cancel")
            raise StateError(f"saving or loading the state took more than {timeout:.0f}s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def parse_host_forwards(usernet: str) -> list[tuple[str, int, int]]:
    """The TCP host forwards in HMP ``info usernet``, whose rows read
    ``TCP[HOST_FORWARD]  FD  SRC_ADDR SRC_PORT  DST_ADDR DST_PORT  RECVQ SENDQ``."""
    out = []
    for line in usernet.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == "TCP[HOST_FORWARD]":
            with contextlib.suppress(ValueError):
                out.append((fields[2], int(fields[3]), int(fields[5])))
    return out


def _die_with_parent() -> None:
    """preexec: an ephemeral VM is SIGKILLed when the process that made it dies."""
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _flock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n")
    return "\n".join(text.splitlines()[-lines:])


class QemuVM:
    """One QEMU process: started here, or found again by pid from another process.

    Its exit is watched through a pidfd, which works for processes that are not
    our children too. QMP is used in short exchanges under a file lock, since
    the QMP socket takes one client at a time and any process may need it.
    """

    def __init__(self, cfg: VMConfig) -> None:
        self.cfg = cfg
        self.pid: int | None = None
        self.start_time: str | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._exited: asyncio.Future[int | None] | None = None
        self._pidfd: int | None = None
        self._state_fd: int | None = None  # its number in QEMU, which inherits it
        self.host_cgroup: hostcgroup.Placement | None = None  # where the host bounds it

    @property
    def command(self) -> list[str]:
        return build_command(self.cfg, qemu_binary())

    async def start(self) -> None:
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        for port in range(cfg.ports):
            with contextlib.suppress(FileNotFoundError):
                cfg.agent_socket(port).unlink()
        with contextlib.suppress(FileNotFoundError):
            cfg.qmp_socket.unlink()
        cfg.console_log.write_bytes(b"")
        with contextlib.ExitStack() as files:
            if cfg.restore_from is not None:
                self._state_fd = files.enter_context(open(cfg.restore_from, "rb")).fileno()
            err = files.enter_context(open(cfg.stderr_log, "wb"))
            self._popen = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                pass_fds=() if self._state_fd is None else (self._state_fd,),
                preexec_fn=None if cfg.detached else _die_with_parent,
            )
        self.pid = self._popen.pid
        self.start_time = _proc.start_time(self.pid)
        # Right after the spawn, while QEMU still sets itself up: guest RAM and the code
        # cache fill only once the guest runs or a state loads, so they are charged here.
        code_cache = 0 if cfg.accel == "kvm" else TCG_CODE_CACHE_MIB
        limits = hostcgroup.Limits.for_vm(cfg.memory_mib, cfg.cpus, code_cache)
        self.host_cgroup = hostcgroup.place(self.pid, cfg.hostname, limits)
        self._watch_exit()

    @classmethod
    def attach(cls, cfg: VMConfig, pid: int, start_time: str | None) -> QemuVM:
        """A QEMU started by another process (or an earlier one of ours)."""
        vm = cls(cfg)
        vm.pid, vm.start_time = pid, start_time
        if _proc.alive(pid, start_time):
            vm.host_cgroup = hostcgroup.placement_of(pid)
        vm._watch_exit()
        return vm

    def _watch_exit(self) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        assert self.pid is not None
        if self._popen is None and not _proc.alive(self.pid, self.start_time):
            self._exited.set_result(None)
            return
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:  # already gone
            self._reap()
            return
        loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        code: int | None = None
        if self._popen is not None:
            code = self._popen.poll()
            if code is None:
                return  # spurious wake-up
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self.host_cgroup is not None:
            self.host_cgroup.remove()
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(code)

    @property
    def running(self) -> bool:
        return self._exited is not None and not self._exited.done()

    @property
    def exit_code(self) -> int | None:
        if self._exited is not None and self._exited.done():
            return self._exited.result()
        return None

    async def wait_exit(self, timeout: float | None = None) -> bool:
        """True once QEMU has exited; False if ``timeout`` passed first."""
        if self._exited is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except TimeoutError:
            return False
        return True

    def exited_future(self) -> asyncio.Future[int | None]:
        assert self._exited is not None
        return self._exited

    def console_tail(self, lines: int = 40) -> str:
        return tail(self.cfg.console_log, lines)

    def stderr_tail(self, lines: int = 20) -> str:
        return tail(self.cfg.stderr_log, lines)

    def failure_report(self, what: str) -> BootError:
        code = self.exit_code
        msg = what
        if code is not None:
            msg += f" (QEMU exited with status {code})"
        err = self.stderr_tail()
        if err:
            msg += f"\n--- QEMU stderr ---\n{err}"
        return BootError(msg, self.console_tail())

    async def qmp(self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        """Run one QMP command (serialised with every other process through a lock)."""
        async with self.qmp_session(timeout) as client:
            return await asyncio.wait_for(client.execute(command, arguments), timeout)

    @contextlib.asynccontextmanager
    async def qmp_session(self, timeout: float = 10.0) -> AsyncIterator[QMPClient]:
        """A QMP client for several commands in a row, holding the QMP lock."""
        lock_path = self.cfg.state_dir / "qmp.lock"
        fd = await asyncio.to_thread(_flock, lock_path)
        try:
            client = await self._qmp_connect(timeout)
            try:
                yield client
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.disconnect(), 2.0)
        finally:
            os.close(fd)

    async def _qmp_connect(self, timeout: float) -> QMPClient:
        """Connect, waiting for the socket of a QEMU that is still starting."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # QEMU may still be starting, and qemu.qmp logs every refused try: wait for the socket
        while True:
            if self.cfg.qmp_socket.exists() or not self.running or loop.time() > deadline:
                break
            await asyncio.sleep(0.005)
        while True:
            client = QMPClient(f"sandlot-{self.cfg.hostname}")
            try:
                await asyncio.wait_for(client.connect(str(self.cfg.qmp_socket)), timeout)
                return client
            except Exception as exc:
                cause = getattr(exc, "exc", None) or exc.__cause__
                starting = isinstance(cause, FileNotFoundError | ConnectionRefusedError)
                if not starting or not self.running or loop.time() > deadline:
                    raise
            await asyncio.sleep(0.005)

    async def save_state(self, path: Path, *, ignore_shared: bool = False, timeout: float = 120.0) -> int:
        """Write the VM's device state (and RAM, unless it lives in a shared file
        and ``ignore_shared``) to ``path`` with QEMU's migration. The VM must be
        stopped. Returns the bytes written."""
        with open(path, "wb") as f:
            async with self.qmp_session() as q:
                await _set_migration(q, ignore_shared)
                q.send_fd_scm(f.fileno())
                await q.execute("getfd", {"fdname": "sandlot-state"})
                await q.execute("migrate", {"uri": "fd:sandlot-state"})
                await _wait_migration(q, timeout, self)
            os.fsync(f.fileno())
            return f.tell()

    async def load_state(self, path: Path, *, ignore_shared: bool = False, timeout: float = 120.0) -> None:
        """Load a state written by ``save_state`` into a VM started with ``incoming``;
        the VM stays stopped until ``cont``."""
        with open(path, "rb") as f:
            async with self.qmp_session() as q:
                await _set_migration(q, ignore_shared)
                q.send_fd_scm(f.fileno())
                await q.execute("getfd", {"fdname": "sandlot-state"})
                await q.execute("migrate-incoming", {"uri": "fd:sandlot-state"})
                await _wait_migration(q, timeout, self)

    async def run_restored(self, *, wait: bool, timeout: float = 120.0) -> None:
        """Let a VM started with ``restore_from`` run: at once if its state is loaded,
        else as soon as it is. ``wait``: return only once the guest runs. A state
        that cannot be loaded ends QEMU: raised as ``BootError`` with its stderr."""
        assert self._state_fd is not None, "a VM started with restore_from"
        try:
            async with self.qmp_session() as q:
                await _set_migration(q, self.cfg.restore_ignore_shared)
                await q.execute("migrate-incoming", {"uri": f"fd:{self._state_fd}"})
                await q.execute("cont")  # while the state loads: run once it is loaded
                deadline = asyncio.get_running_loop().time() + timeout
                while wait:
                    status = await q.execute("query-status")
                    if isinstance(status, dict) and status.get("status") == "running":
                        break
                    if asyncio.get_running_loop().time() > deadline:
                        raise StateError(f"loading the saved state took more than {timeout:.0f}s")
                    await asyncio.sleep(0.002)
        except Exception as exc:
            if isinstance(exc, StateError) or await self.wait_exit(0.5) is False:
                raise
            await asyncio.sleep(0.05)  # let its stderr catch up
            raise self.failure_report("QEMU could not load the saved state") from exc

    async def host_forwards(self) -> list[tuple[str, int, int]]:
        """(host address, host port, guest port) of each published port, as bound
        (a rule asking for port 0 got a free one)."""
        text = await self.qmp("human-monitor-command", {"command-line": "info usernet"})
        return parse_host_forwards(text if isinstance(text, str) else "")

    async def kill(self, grace: float = 2.0) -> None:
        """End QEMU: QMP quit first, SIGKILL after ``grace`` seconds."""
        if not self.running:
            return
        with contextlib.suppress(Exception):
            await self.qmp("quit", timeout=max(grace, 0.5))
        gone = await self.wait_exit(grace)
        if not gone and self.pid is not None and _proc.alive(self.pid, self.start_time):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            await self.wait_exit(5.0)

    def cleanup(self) -> None:
        """Remove sockets, and the host cgroup that outlived QEMU's exit, once QEMU is gone."""
        if self.host_cgroup is not None:
            self.host_cgroup.remove()
        for port in range(self.cfg.ports):
            with contextlib.suppress(FileNotFoundError):
                self.cfg.agent_socket(port).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.cfg.qmp_socket.unlink()
        with contextlib.suppress(OSError):
            self.cfg.run_dir.rmdir()
