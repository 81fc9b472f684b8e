"""One QEMU process: launch, exit watch, QMP, saving and loading state.

A VM is a QEMU process plus a few files: the console log, QEMU's stderr, and
unix sockets for QMP and the agent's virtio-serial ports. Nothing here speaks
the agent protocol; the core connects to the agent through ``agent_connector``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ... import pids
from ...config import flock_within, free_bytes, tail, try_flock
from ...errors import (
    BootError,
    CorruptSnapshot,
    EngineTimeout,
    InvalidArgument,
    InvalidState,
    NoSpace,
    SavedStateError,
    no_space,
)
from .. import hostcgroup
from ..base import VM, Connector, StateSink, StateSource, VMRef, VMStatus
from . import seccomp, stream
from .command import (
    MACHINE,
    TCG_CODE_CACHE_MIB,
    VMConfig,
    build_command,
    cpu_model,
    qemu_binary,
    qemu_version,
)

if TYPE_CHECKING:
    from qemu.qmp import EventListener, QMPClient

# QEMU's run states, as ``query-status`` names them, in engine-neutral terms.
STATUS = {
    "running": VMStatus.RUNNING,
    "paused": VMStatus.PAUSED,
    "postmigrate": VMStatus.PAUSED,
    "prelaunch": VMStatus.PAUSED,
    "suspended": VMStatus.PAUSED,
    "inmigrate": VMStatus.LOADING,
    "finish-migrate": VMStatus.SAVING,
    "save-vm": VMStatus.SAVING,
    "restore-vm": VMStatus.LOADING,
}


PR_SET_PDEATHSIG = 1
PR_SET_THP_DISABLE = 41


def _preexec(cfg: VMConfig) -> Callable[[], None] | None:
    """What QEMU's process is set up with before its exec (None: nothing, which lets
    Python spawn it without a fork). An attached (not detached) VM is SIGKILLed when
    the process that made it dies. Under TCG, no transparent huge pages: QEMU asks for
    them for its code cache and guest RAM, where a restored VM touches a few MiB in
    each 2 MiB page (measured: 34 -> 31 MiB of PSS per fork child); KVM keeps them for
    the guest's own page walks. A VM that maps a saved state's memory file gets the
    filter that keeps it from punching holes in it (``seccomp``)."""
    die_with_parent, small_pages = not cfg.detached, cfg.accel != "kvm"
    keep_file = seccomp.installer() if cfg.maps_saved_memory else None
    if not (die_with_parent or small_pages or keep_file):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child

    def setup() -> None:
        if die_with_parent:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if small_pages:
            prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)
        if keep_file is not None:
            keep_file()

    return setup


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


async def set_migration(q: QMPClient, ignore_shared: bool, background: bool = False) -> None:
    # events: QEMU says when a migration ends, so nobody polls for it (a poll's backoff
    # overshot the end of a 100 ms load by tens of milliseconds)
    caps = [
        {"capability": "x-ignore-shared", "state": ignore_shared},
        {"capability": "events", "state": True},
        {"capability": "background-snapshot", "state": background},
    ]
    await q.execute("migrate-set-capabilities", {"capabilities": caps})
    # the default bandwidth cap (128 MiB/s) is for networks, not a local file
    await q.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})


QMP_TIMEOUT = 10.0  # seconds for one QMP command under KVM (a migration has a deadline of its own)
# Under TCG QEMU's main loop, which answers the monitor, competes for the big lock with
# the vCPU threads' emulation, and on a host loaded several times over its cores an
# answer has taken over 10 s (the KVM tier's nested fork, stop 80): a slow host is not a
# dead QEMU. Three times as long there, or $SANDLOT_QMP_TIMEOUT.
TCG_QMP_FACTOR = 3.0


def qmp_deadline(accel: str) -> float:
    """Seconds one QMP command of a VM under ``accel`` may take before ``EngineTimeout``."""
    given = os.environ.get("SANDLOT_QMP_TIMEOUT")
    if given:
        try:
            seconds = float(given)
        except ValueError:
            raise InvalidArgument(f"SANDLOT_QMP_TIMEOUT must be a number of seconds, not {given!r}") from None
        if not 0 < seconds <= 3600:
            raise InvalidArgument(f"SANDLOT_QMP_TIMEOUT must be over 0 and at most 3600 s, not {given!r}")
        return seconds
    return QMP_TIMEOUT if accel == "kvm" else QMP_TIMEOUT * TCG_QMP_FACTOR


QMP_LOCK_TIMEOUT = 300.0  # seconds to wait for another client of the monitor (a save) to finish


# A migration that ended (saved, or failed on a full disk) is finalized by QEMU a moment
# after its event says so, seconds on a busy host; until then QEMU refuses both a new
# migration and ``cont`` ("Migration is not finalized yet").
FINALIZE_LIMIT = 30.0


async def once_finalized(action: Callable[[], Awaitable[Any]], within: float) -> Any:
    """Run a QMP ``action``; while QEMU says its last migration is not finalized, again
    (for ``within`` seconds at most)."""
    from qemu.qmp import ExecuteError

    loop = asyncio.get_running_loop()
    settled_by = loop.time() + within
    wait = 0.02
    while True:
        try:
            return await action()
        except ExecuteError as exc:
            if "not finalized" not in str(exc) or loop.time() > settled_by:
                raise
        await asyncio.sleep(wait)
        wait = min(wait * 2, 1.0)


SPILL_SLACK = 64 << 20  # room beyond the VM's RAM that a spilled stream may need (devices), and some left
PIPE_SIZE = 1 << 20  # a saved state's pipe: fewer wake-ups of QEMU and of the thread at its other end
F_SETPIPE_SZ = 1031

# Whether this host's QEMU and kernel write a running VM's memory out while it goes on
# (migration's background-snapshot: userfaultfd write protection copies each page the
# guest is about to write first). None: not tried yet in this process; False where QEMU
# refused it (a kernel without uffd-wp, or no permission for userfaultfd), and a
# snapshot then stops the guest for the whole save, as before.
background_snapshots: bool | None = None


def _pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
    return r, w


class _Feeder:
    """A saved state's chunks written as a migration stream into a pipe QEMU loads
    from, by a thread of its own. QEMU inherits ``read_fd``."""

    def __init__(self, source: StateSource) -> None:
        self.read_fd, self._w = _pipe()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(source,), daemon=True, name="sandlot-restore")

    def start(self) -> None:
        self._thread.start()

    def _run(self, source: StateSource) -> None:
        try:
            stream.join(source, stream.write_all(self._w))
        except BrokenPipeError:
            pass  # QEMU stopped reading: its own error says why
        except BaseException as exc:
            self.error = exc
        finally:
            os.close(self._w)

    async def done(self, timeout: float) -> None:
        """Wait for the whole stream to be written; its error, if it had one."""
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            raise SavedStateError(f"the saved state was not written to QEMU within {timeout:.0f}s")
        if self.error is not None:
            raise self.error


# seconds a failed save waits for the thread that took its stream apart to say why
SPLIT_FAILED_WAIT = 2.0
PROGRESS_EVERY = 5.0  # seconds between two looks at how far a long migration has come


async def answered(reply: Awaitable[Any], command: str, timeout: float) -> Any:
    """QEMU's answer to a QMP ``command``, or ``EngineTimeout`` naming it past ``timeout``."""
    try:
        return await asyncio.wait_for(reply, timeout)
    except TimeoutError as exc:
        raise EngineTimeout(f"QEMU's monitor did not answer {command} within {timeout:g} s") from exc


async def _migration_progress(q: QMPClient) -> Any:
    """What QEMU says its migration has moved so far (None where it says nothing: an
    incoming one, whose stream this process feeds and bounds itself)."""
    with contextlib.suppress(Exception):
        info = await asyncio.wait_for(q.execute("query-migrate"), QMP_TIMEOUT)
        ram = info.get("ram") if isinstance(info, dict) else None
        if isinstance(ram, dict):
            return (ram.get("transferred"), ram.get("dirty-sync-count"))
    return None


async def migration_done(
    q: QMPClient, events: EventListener, exited: asyncio.Future[Any], timeout: float, *, saving: bool = False
) -> None:
    """Until the migration in progress (a save or a load) on session ``q`` completes, as
    its MIGRATION ``events`` say; racing QEMU's exit (``exited``) and ``timeout``. For a
    save (``saving``), ``timeout`` is the seconds in which it moved no byte: a save that
    goes on writing is slow, not stuck (a large guest, an emulated one, a loaded host);
    one whose bytes stop for that long fails, so a save never hangs. A load has
    ``timeout`` seconds in all: QEMU tells no progress of an incoming migration, and
    its monitor is not asked anything while one runs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    moved: Any = None
    while True:
        event = asyncio.ensure_future(events.get())
        waiting: set[asyncio.Future[Any]] = {event, exited}
        wait = max(0.0, deadline - loop.time())
        wait = min(wait, PROGRESS_EVERY) if saving else wait
        done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        if event not in done:
            event.cancel()
            if exited in done:
                raise SavedStateError("QEMU exited while saving or loading the state")
            if saving and loop.time() < deadline:
                now_moved = await _migration_progress(q)
                if now_moved is not None and now_moved != moved:
                    moved, deadline = now_moved, loop.time() + timeout
                continue
            with contextlib.suppress(Exception):
                await q.execute("migrate_cancel")
            what = f"moved nothing for {timeout:.0f}s" if saving else f"took more than {timeout:.0f}s"
            raise SavedStateError(f"saving or loading the state {what}")
        message: Any = event.result()
        status = (message.get("data") or {}).get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            info: Any = {}
            with contextlib.suppress(Exception):
                info = await q.execute("query-migrate")
            why = info.get("error-desc", status) if isinstance(info, dict) else status
            if "No space left" in str(why):  # save_state names the file's filesystem
                raise NoSpace(f"QEMU could not save the state ({why})")
            raise SavedStateError(f"QEMU could not save or load the state: {why}")


def _split(fd: int, sink: StateSink) -> None:
    """Read QEMU's migration stream from ``fd`` into ``sink``; the pipe is closed at the
    end, or at an error (QEMU's write then fails, and its save with it)."""
    try:
        stream.split(lambda n: os.read(fd, n), sink)
    finally:
        os.close(fd)


class _Follower:
    """Reads a file QEMU is still writing, as ``tail -f`` does, until the migration
    that writes it has ended (``ended``: set by the event loop's side; ``failed`` with it
    when the migration did not complete)."""

    POLL = 0.002

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.ended = threading.Event()
        self.failed = False

    def read(self, n: int) -> bytes:
        while True:
            if self.failed:  # the rest of the file is no state: reading it only delays the error
                raise SavedStateError("the save ended before QEMU had written the whole state")
            data = os.read(self.fd, n)
            if data:
                return data
            if self.ended.is_set():
                data = os.read(self.fd, n)  # what came between the last read and the end
                if data:
                    return data
                if self.failed:
                    raise SavedStateError("the save ended before QEMU had written the whole state")
                return b""
            self.ended.wait(self.POLL)

    def close(self) -> None:
        os.close(self.fd)


class QemuVM(VM):
    """One QEMU process: started here, or found again by pid from another process.

    Its exit is watched through a pidfd, which works for processes that are not
    our children too. QMP is used in short exchanges under a file lock, since
    the QMP socket takes one client at a time and any process may need it.
    """

    def __init__(self, cfg: VMConfig) -> None:
        self.cfg = cfg
        self.ref = VMRef(0, "")
        self._popen: subprocess.Popen[bytes] | None = None
        self._exited: asyncio.Future[int | None] | None = None
        self._pidfd: int | None = None
        self._state_fd: int | None = None  # its number in QEMU, which inherits it
        self._feeder: _Feeder | None = None  # writes a state of chunks to QEMU (``restore_source``)
        self.host_cgroup: hostcgroup.Placement | None = None  # where the host bounds it
        self.qmp_timeout = qmp_deadline(cfg.accel)

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
        if cfg.boots:
            from ...guest.kernel import copy_loadable  # here: commands on a running box never need it

            await asyncio.to_thread(copy_loadable, cfg.kernel, cfg.kernel_copy)
        with contextlib.ExitStack() as files:
            if cfg.restore_from is not None:
                self._state_fd = files.enter_context(open(cfg.restore_from, "rb")).fileno()
            elif cfg.restore_source is not None:
                self._feeder = _Feeder(cfg.restore_source)
                self._state_fd = self._feeder.read_fd
                files.callback(os.close, self._feeder.read_fd)
            err = files.enter_context(open(cfg.stderr_log, "wb"))
            self._popen = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                pass_fds=() if self._state_fd is None else (self._state_fd,),
                preexec_fn=_preexec(cfg),
            )
        if self._feeder is not None:
            self._feeder.start()  # it waits on the pipe until the load begins
        pid = self._popen.pid
        self.ref = VMRef(pid, pids.start_time(pid) or "")
        # Right after the spawn, while QEMU still sets itself up: guest RAM and the code
        # cache fill only once the guest runs or a state loads, so they are charged here.
        code_cache = 0 if cfg.accel == "kvm" else TCG_CODE_CACHE_MIB
        limits = hostcgroup.Limits.for_vm(cfg.memory_mib, cfg.cpus, code_cache)
        self.host_cgroup = hostcgroup.place(pid, cfg.hostname, limits)
        self._watch_exit()
        if cfg.boots:
            await self._give_back_kernel_copy()

    async def _give_back_kernel_copy(self) -> None:
        """QEMU keeps the kernel file it loaded mapped, to copy it into guest RAM again
        at a reset (44 MiB of its memory for Debian's cloud kernel). A box's VM never
        resets: ``-no-reboot`` ends it instead, and nothing here sends ``system_reset``.
        QEMU answers QMP only after its first reset, once the guest's RAM holds the
        kernel: truncating the copy then takes its pages out of QEMU's memory. A QEMU
        that does not answer in time keeps its copy until ``cleanup``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.qmp_timeout
        while self.running and loop.time() < deadline:
            if await self._qmp_quick("query-status"):
                with contextlib.suppress(FileNotFoundError):
                    os.truncate(self.cfg.kernel_copy, 0)
                    self.cfg.kernel_copy.unlink()
                return
            await asyncio.sleep(0.005)

    @classmethod
    def attach(cls, cfg: VMConfig, ref: VMRef) -> QemuVM:
        """A QEMU started by another process (or an earlier one of ours)."""
        vm = cls(cfg)
        vm.ref = ref
        if pids.alive(ref.pid, ref.start):
            vm.host_cgroup = hostcgroup.placement_of(ref.pid)
        vm._watch_exit()
        return vm

    def _watch_exit(self) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        if self._popen is None and not pids.alive(self.ref.pid, self.ref.start):
            self._exited.set_result(None)
            return
        try:
            self._pidfd = os.pidfd_open(self.ref.pid)
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

    # -- the VM interface ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exited is not None and not self._exited.done()

    @property
    def exit_code(self) -> int | None:
        if self._exited is not None and self._exited.done():
            return self._exited.result()
        return None

    async def kill(self, grace: float = 2.0) -> None:
        """QMP quit first, SIGKILL after ``grace`` seconds."""
        if not self.running:
            return
        with contextlib.suppress(Exception):
            await self.qmp("quit", timeout=max(grace, 0.5))
        gone = await self.wait_exit(grace)
        if not gone and pids.alive(self.ref.pid, self.ref.start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.ref.pid, signal.SIGKILL)
            await self.wait_exit(5.0)

    async def pause(self) -> None:
        if not await self._qmp_quick("stop"):
            await self.qmp("stop")

    async def resume(self) -> None:
        if not await self._qmp_quick("cont"):
            await self.qmp("cont")

    async def status(self) -> VMStatus:
        if not self.running:
            return VMStatus.GONE
        try:
            reply = await self.qmp("query-status", timeout=5.0)
        except Exception:
            return VMStatus.GONE if not self.running else VMStatus.UNKNOWN
        return STATUS.get(str(reply.get("status")) if isinstance(reply, dict) else "", VMStatus.UNKNOWN)

    def agent_connector(self, port: int) -> Connector:
        sock = str(self.cfg.agent_socket(port))

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_unix_connection(sock, limit=1 << 22)

        return connect

    def saved_facts(self) -> dict[str, Any]:
        """What a state saved now can only be loaded with: the same VM shape, QEMU and accelerator."""
        cfg = self.cfg
        return {
            "engine": "qemu",
            "memory_mib": cfg.memory_mib,
            "cpus": cfg.cpus,
            "agent_ports": cfg.ports,
            "network": cfg.network is not None,  # a network card is part of the device state
            "accel": cfg.accel,
            "engine_facts": {
                "machine": MACHINE,
                "devices": cfg.devices,
                "qemu_version": qemu_version(),
                "cpu_model": cpu_model(cfg.accel),
                "kernel": str(cfg.kernel),
                "initrd": str(cfg.initrd),
            },
        }

    def console_tail(self, lines: int = 40) -> str:
        return tail(self.cfg.console_log, lines)

    def stderr_tail(self, lines: int = 20) -> str:
        return tail(self.cfg.stderr_log, lines)

    def failure(self, what: str) -> BootError:
        code = self.exit_code
        msg = what
        if code is not None:
            msg += f" (QEMU exited with status {code})"
        err = self.stderr_tail()
        if err:
            msg += f"\n--- QEMU stderr ---\n{err}"
        return BootError(msg, self.console_tail())

    def cleanup(self) -> None:
        """Remove sockets, and the host cgroup that outlived QEMU's exit, once QEMU is gone."""
        if self.host_cgroup is not None:
            self.host_cgroup.remove()
        for port in range(self.cfg.ports):
            with contextlib.suppress(FileNotFoundError):
                self.cfg.agent_socket(port).unlink()
        for path in (self.cfg.qmp_socket, self.cfg.kernel_copy):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.cfg.run_dir.rmdir()

    # -- QMP ------------------------------------------------------------------------------

    async def qmp(
        self, command: str, arguments: dict[str, Any] | None = None, timeout: float | None = None,
        lock_timeout: float = QMP_LOCK_TIMEOUT,
    ) -> Any:  # fmt: skip
        """Run one QMP command (serialised with every other process through a lock);
        ``timeout``: seconds for its answer, the VM's ``qmp_timeout`` by default."""
        timeout = timeout or self.qmp_timeout
        async with self.qmp_session(timeout, lock_timeout) as client:
            return await answered(client.execute(command, arguments), command, timeout)

    async def _qmp_quick(self, command: str) -> bool:
        """Run an argument-less command over a bare QMP connection (the handshake and the
        command sent at once, one round trip) if no other client holds the QMP lock now:
        a warm pool's claim waits on this ``cont`` (measured here under TCG: median 1.0 ms
        against 2.5 ms through qemu.qmp, whose worst cases were ten times the bare one's).
        False, with nothing done, where it could not (the caller then uses ``qmp``)."""
        try:
            fd = try_flock(self.cfg.qmp_lock)
        except OSError:
            return False
        if fd is None:
            return False
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(self.cfg.qmp_socket)), self.qmp_timeout
            )
            try:
                writer.write(
                    b'{"execute": "qmp_capabilities"}\n' + json.dumps({"execute": command}).encode() + b"\n"
                )

                async def replies() -> bool:
                    done = 0
                    while done < 2:  # the greeting and events come between; errors end it
                        line = await reader.readline()
                        if not line:
                            return False
                        msg = json.loads(line)
                        if "error" in msg:
                            return False
                        done += "return" in msg
                    return True

                return await asyncio.wait_for(replies(), self.qmp_timeout)
            finally:
                writer.close()
        except (OSError, ValueError, TimeoutError):
            return False
        finally:
            os.close(fd)

    @contextlib.asynccontextmanager
    async def qmp_session(
        self, timeout: float | None = None, lock_timeout: float = QMP_LOCK_TIMEOUT
    ) -> AsyncIterator[QMPClient]:
        """A QMP client for several commands in a row, holding the QMP lock."""
        fd = await flock_within(self.cfg.qmp_lock, lock_timeout, f"the monitor of VM {self.cfg.hostname}")
        try:
            client = await self._qmp_connect(timeout or self.qmp_timeout)
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
            from qemu.qmp import QMPClient  # not at the top: commands on a running box never need it

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

    async def _migration_done(
        self, q: QMPClient, events: EventListener, timeout: float, saving: bool
    ) -> None:
        await migration_done(q, events, self.exited(), timeout, saving=saving)

    # -- saved state ----------------------------------------------------------------------

    async def _migrate(
        self, q: QMPClient, command: str, uri: str, ignore_shared: bool, timeout: float,
        background: bool = False,
    ) -> None:  # fmt: skip
        """Run one migration (``migrate`` out, ``migrate-incoming`` in) on session ``q``
        until it completes."""

        with q.listener("MIGRATION") as events:

            async def start() -> None:
                from qemu.qmp import ExecuteError

                await set_migration(q, ignore_shared, background)
                try:
                    await q.execute(command, {"uri": uri})
                except ExecuteError as exc:
                    if "VirtFS" not in str(exc):
                        raise
                    # a share still mounted: a box paused with files open under one (the
                    # agent takes shares down for a save of a running box)
                    raise InvalidState(
                        f"the VM cannot be saved while a host directory is mounted in its guest ({exc}): "
                        "unpause the box, close what is open under its shares and save it again"
                    ) from None

            await once_finalized(start, min(timeout, FINALIZE_LIMIT))
            await self._migration_done(q, events, timeout, saving=command == "migrate")

    async def _migrate_file(
        self, f: IO[bytes], command: str, ignore_shared: bool, timeout: float, session: QMPClient | None
    ) -> None:
        """A migration to or from ``f``, whose descriptor QEMU is handed; on ``session``
        if the caller holds one (it then holds the QMP lock across its commands)."""
        opened = contextlib.nullcontext(session) if session is not None else self.qmp_session()
        async with opened as q:
            q.send_fd_scm(f.fileno())
            await q.execute("getfd", {"fdname": "sandlot-state"})
            await self._migrate(q, command, "fd:sandlot-state", ignore_shared, timeout)

    async def save_state(
        self,
        path: Path,
        *,
        ignore_shared: bool = False,
        timeout: float = 120.0,
        session: QMPClient | None = None,
    ) -> int:
        """Write the VM's device state (and RAM, unless it lives in a shared file
        and ``ignore_shared``) to ``path`` with QEMU's migration. The VM must be
        stopped. Returns the bytes written."""
        try:
            with open(path, "wb") as f:
                await self._migrate_file(f, "migrate", ignore_shared, timeout, session)
                os.fsync(f.fileno())
                return f.tell()
        except NoSpace:
            raise no_space(path.parent, "QEMU could not save the state") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(path.parent, "the state could not be saved") from None
            raise

    async def load_state(self, path: Path, *, ignore_shared: bool = False, timeout: float = 120.0) -> None:
        """Load a state written by ``save_state`` into a VM started with ``incoming``;
        the VM stays stopped."""
        with open(path, "rb") as f:
            await self._migrate_file(f, "migrate-incoming", ignore_shared, timeout, None)

    async def load_source(self, source: StateSource, *, timeout: float = 120.0) -> None:
        """Load a state of chunks into a VM started with ``incoming``; it stays stopped."""
        feeder = _Feeder(source)
        try:
            async with self.qmp_session() as q:
                q.send_fd_scm(feeder.read_fd)
                await q.execute("getfd", {"fdname": "sandlot-state"})
                os.close(feeder.read_fd)  # QEMU holds its own now
                feeder.read_fd = -1
                feeder.start()
                try:
                    await self._migrate(q, "migrate-incoming", "fd:sandlot-state", False, timeout)
                except SavedStateError:
                    await feeder.done(5.0)  # the stream's own error says more than QEMU's
                    raise
            await feeder.done(timeout)
        finally:
            if feeder.read_fd >= 0:
                os.close(feeder.read_fd)

    async def _save_to(self, q: QMPClient, sink: StateSink, timeout: float, spill: Path | None) -> None:
        """Run one save of the whole VM into ``sink`` on session ``q``: QEMU writes its
        stream into a pipe, which a thread takes apart as it comes (``stream.split``); or
        (``spill``: a background snapshot) into that file, followed as it grows."""
        if spill is not None:
            await self._save_spilled(q, sink, timeout, spill)
            return
        r, w = _pipe()
        split = asyncio.ensure_future(asyncio.to_thread(_split, r, sink))
        try:
            try:
                q.send_fd_scm(w)
                await q.execute("getfd", {"fdname": "sandlot-state"})
            finally:
                os.close(w)  # QEMU's copy is the writer now: its end is the stream's end
            try:
                await self._migrate(q, "migrate", "fd:sandlot-state", False, timeout)
            except Exception:  # (a cancelled save is not waited on: it ends below)
                # a stream that could not be taken apart (or kept: a full disk) ended the
                # save: its error says why, where QEMU says only that its pipe broke. The
                # thread closed the pipe as it failed, before QEMU's write did, but its end
                # may reach this loop after QEMU's event: a moment is waited for it. A split
                # that saw only the stream end early says less than QEMU, whose end it was.
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(split), SPLIT_FAILED_WAIT)
                failed = split.exception() if split.done() and not split.cancelled() else None
                if failed is not None and stream.ENDED_EARLY not in str(failed):
                    await split
                raise
            await asyncio.wait_for(asyncio.shield(split), timeout)
        finally:
            if not split.done():
                with contextlib.suppress(BaseException):
                    await q.execute("migrate_cancel")
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(split), 10.0)

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
        """A snapshot of a running VM into ``sink`` stops the guest only while its
        devices are saved and its disks switched: its memory is written while it runs
        (background-snapshot), each page as it was at the stop. Otherwise (a suspend,
        a paused VM, a host that cannot) the guest stays stopped for the whole save."""
        global background_snapshots
        from qemu.qmp import ExecuteError

        # One QMP session for the whole save: every connection made while the VM is
        # stopped lengthens the pause, and no other process's command may come between.
        loop = asyncio.get_running_loop()
        async with self.qmp_session() as q:

            async def run(command: str, arguments: dict[str, Any] | None = None) -> Any:
                return await answered(q.execute(command, arguments), command, self.qmp_timeout)

            status = await run("query-status")
            was_running = isinstance(status, dict) and status.get("status") == "running"
            # a guest whose disk write met a full home filesystem is stopped by QEMU
            # (werror=enospc) with that write held: it runs on, and QEMU retries it,
            # once continued; a save must not leave it stopped for good
            held_write = isinstance(status, dict) and status.get("status") == "io-error"
            # a background snapshot writes the whole stream to a file first: only where it fits
            room = free_bytes(directory) > (self.cfg.memory_mib << 20) + SPILL_SLACK
            # QEMU tracks writes to anonymous RAM only: a VM whose RAM is a file (started from
            # a template's or a fork's prepared state) is refused, and stops for its whole save
            background = bool(sink) and keep_running and was_running and room and self.cfg.ram_file is None
            background = background and background_snapshots is not False
            if background and background_snapshots is None:
                background_snapshots = await self._background_supported(q)
                background = background_snapshots
            with q.listener("RESUME") as resumes:
                # the guest runs again once its devices are saved (a background snapshot's
                # memory is written after, each page as it was at the stop): what is saved
                # is fixed from then on
                told = asyncio.create_task(told_of_resume(resumes, fixed)) if fixed is not None else None
                t0, stopped = loop.time(), time.time()
                if was_running:
                    await run("stop")
                try:
                    if new_disk is not None:
                        # one transaction: every disk switches to its new top, or none does
                        switches = [("root", new_disk), *(new_drives or {}).items()]
                        actions = [
                            {"type": "blockdev-snapshot-sync",
                             "data": {"device": device, "snapshot-file": str(top), "format": "qcow2",
                                      "mode": "existing"}}
                            for device, top in switches
                        ]  # fmt: skip
                        await run("transaction", {"actions": actions})
                    if sink is not None and background:
                        try:
                            await self._save_to(q, sink, 120.0, directory / ".stream")
                        except ExecuteError as exc:
                            # refused before it began (the VM stays stopped): a guest whose RAM
                            # is a private map of a file (restored from a template's or a
                            # fork's memory) cannot be write-protected; saved stopped instead
                            if "Background-snapshot" not in str(exc):
                                raise
                            background = False
                            await self._save_to(q, sink, 120.0, None)
                    elif sink is not None:
                        await self._save_to(q, sink, 120.0, None)
                    else:
                        await self.save_state(directory / "state", session=q)
                finally:
                    if keep_running and (was_running or held_write):
                        reply = await run("query-status")
                        if not (isinstance(reply, dict) and reply.get("status") == "running"):
                            await once_finalized(lambda: run("cont"), FINALIZE_LIMIT)
                if told is not None:
                    told.cancel()
                pause = loop.time() - t0
                if background:
                    # QEMU let the guest run on once its devices were saved: the pause
                    # ended then, as its RESUME event's time says, not when the memory was written
                    with contextlib.suppress(LookupError, TypeError):
                        stamp: Any = resumes.history[0]["timestamp"]
                        pause = max(0.0, min(pause, stamp["seconds"] + stamp["microseconds"] / 1e6 - stopped))
            return pause

    async def _background_supported(self, q: QMPClient) -> bool:
        """Whether QEMU takes the background-snapshot capability on this host."""
        from qemu.qmp import ExecuteError

        def caps(on: bool) -> dict[str, Any]:
            return {"capabilities": [{"capability": "background-snapshot", "state": on}]}

        try:
            await q.execute("migrate-set-capabilities", caps(True))
        except ExecuteError:
            return False
        await q.execute("migrate-set-capabilities", caps(False))
        return True

    async def _save_spilled(self, q: QMPClient, sink: StateSink, timeout: float, spill: Path) -> None:
        """A background snapshot's save, through a file. QEMU 7.2 leaves the guest's memory
        write-protected when a background snapshot fails (its cleanup stops the tracking only
        after a save that completed), and a vCPU that then writes waits forever: a pipe
        whose reader died (a kill -9 of this process mid-save) would wedge the box. A file
        never fails QEMU's writes (the caller sees to the room), so the save completes
        whatever becomes of this process; what it leaves is a file in a temporary directory."""
        with open(spill, "wb") as f:
            q.send_fd_scm(f.fileno())
            await q.execute("getfd", {"fdname": "sandlot-state"})
        follower = _Follower(spill)
        split = asyncio.ensure_future(asyncio.to_thread(stream.split, follower.read, sink))
        try:
            try:
                await self._migrate(q, "migrate", "fd:sandlot-state", False, timeout, background=True)
            except BaseException:
                follower.failed = True
                raise
            finally:
                follower.ended.set()
            await asyncio.wait_for(asyncio.shield(split), timeout)
        finally:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(split), 10.0)

            # the file is closed once its reader has ended (a descriptor closed under a
            # thread that reads it could be another file's by its next read), and the
            # reader's error, if the save failed for another reason first, is taken
            def reader_ended(done: asyncio.Future[None]) -> None:
                follower.close()
                if not done.cancelled():
                    done.exception()

            split.add_done_callback(reader_ended)
            with contextlib.suppress(FileNotFoundError):
                spill.unlink()

    async def run_restored(self, timeout: float) -> None:
        """Load the state this VM was started with (``restore_from``), then let it run.

        ``cont`` is sent only once the load has completed, and the VM is confirmed
        running after it. Sent while the state still loads, ``cont`` only sets
        QEMU's autostart flag, and autostart is ignored when the saved state
        records a stopped VM (ours are saved stopped): QEMU then leaves the loaded
        VM paused for good. That was the race behind boxes that never answered when
        many started at once.
        """
        assert self._state_fd is not None, "a VM started with restore_from"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with self.qmp_session() as q:
                uri = f"fd:{self._state_fd}"  # inherited at spawn: no getfd
                try:
                    await self._migrate(q, "migrate-incoming", uri, self.cfg.restore_ignore_shared, timeout)
                except SavedStateError:
                    if self._feeder is not None:  # a chunk that could not be read says more than QEMU
                        await self._feeder.done(5.0)
                    raise
                if self._feeder is not None:
                    await self._feeder.done(timeout)
                    self._feeder = None
                delay = 0.001
                while True:
                    reply = await q.execute("query-status")
                    status = reply.get("status") if isinstance(reply, dict) else None
                    if status == "running":
                        return
                    if status != "inmigrate":  # loaded and stopped: let it run (again, if
                        # a cont raced the load's last step)
                        await once_finalized(lambda: q.execute("cont"), FINALIZE_LIMIT)
                    if loop.time() > deadline:
                        raise SavedStateError(
                            f"the restored VM did not run within {timeout:.0f}s (QEMU: {status})"
                        )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.05)
        except Exception as exc:
            if isinstance(exc, CorruptSnapshot):
                raise
            # a load that fails ends QEMU, which says why on its stderr: wait for that
            if await self.wait_exit(1.0) is False:
                raise
            await asyncio.sleep(0.05)  # let its stderr catch up
            raise self.failure("QEMU could not load the saved state") from exc

    async def disk_full(self) -> bool:
        """A disk's ``io-status`` (virtio-blk stops the VM on ENOSPC, QEMU's default)."""
        try:
            disks = await self.qmp("query-block", timeout=5.0, lock_timeout=5.0)
        except Exception:  # a QEMU too busy or gone: not known to be full
            return False
        return any(d.get("io-status") == "nospace" for d in disks if isinstance(d, dict))

    async def agent_opened(self) -> bool | None:
        """The guest side of the first agent port, as QEMU sees it (``frontend-open``)."""
        try:
            chardevs = await self.qmp("query-chardev", timeout=5.0, lock_timeout=5.0)
        except Exception:  # a QEMU too busy or gone: unknown
            return None
        for dev in chardevs if isinstance(chardevs, list) else []:
            if dev.get("label") == "agent0":
                return bool(dev.get("frontend-open"))
        return None

    async def published_ports(self) -> list[tuple[str, int, int]]:
        if not self.cfg.network or not self.cfg.network.forwards:
            return []
        text = await self.qmp("human-monitor-command", {"command-line": "info usernet"})
        return parse_host_forwards(text if isinstance(text, str) else "")


async def told_of_resume(resumes: Any, fixed: asyncio.Event) -> None:
    """``fixed`` set at the first RESUME event a save's listener hears."""
    await resumes.get()
    fixed.set()
