"""``Box`` and ``AsyncBox``: a microVM with its own kernel, disk and processes.

``AsyncBox`` is the implementation; ``Box`` is a thin sync facade that runs the
same coroutines on sandlot's loop thread.

>>> import sandlot
>>> with sandlot.Box(rootfs="/path/to/rootfs") as box:        # doctest: +SKIP
...     print(box.exec("echo", "hello").stdout)
hello
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ..engine.qemu import QemuVM, VMConfig
from ..errors import (
    AgentTimeout,
    BootTimeout,
    BoxCrashed,
    BoxStateError,
    ConnectionLost,
    InvalidArgument,
)
from ..images.reference import Reference
from ..images.rootfs import base_for, create_overlay
from ..images.store import Image
from ..protocol.connection import AgentConnection
from ..protocol.exec import ExecRequest, RemoteProcess
from ..protocol.wire import ControlOp, T, Tag, tlv
from ..runtime import Runtime
from . import _sync
from .files import AsyncFiles, Files, guest_path
from .process import AsyncProcess, ExecResult, Process

GiB = 1 << 30
DEFAULT_MEMORY_MIB = 512
DEFAULT_DISK_GB = 8
_ENV_NAME = re.compile(r"^[^=\0]+$")

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


def _env(env: Mapping[str, str] | None) -> dict[str, str] | None:
    if env is None:
        return None
    out = {}
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise InvalidArgument(f"invalid environment variable name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise InvalidArgument(f"environment value of {k} must be a string without NUL bytes")
        out[k] = v
    return out


def _positive(name: str, value: float | int | None, *, integer: bool = False) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        raise InvalidArgument(f"{name} must be a {'whole ' if integer else ''}number, not {value!r}")
    if value <= 0:
        raise InvalidArgument(f"{name} must be positive, not {value!r}")


class AsyncBox:
    """A microVM sandbox (async API). Use as ``async with AsyncBox(rootfs=...) as box``.

    Leaving the ``async with`` block stops the VM and deletes the box's disk.
    ``stop()`` and ``start()`` keep the disk: files written before ``stop()`` are
    there after the next ``start()``.
    """

    def __init__(
        self,
        image: str | Image | None = None,
        *,
        rootfs: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        memory_mib: int = DEFAULT_MEMORY_MIB,
        cpus: int = 1,
        disk_size_gb: int = DEFAULT_DISK_GB,
        pull: str = "missing",
        insecure: bool = False,
        ca_cert: str | os.PathLike[str] | None = None,
        credentials: tuple[str, str] | None = None,
        accel: str = "auto",
        kernel: str | os.PathLike[str] | None = None,
        hostname: str | None = None,
        boot_timeout: float | None = None,
        request_timeout: float = 30.0,
        home: str | os.PathLike[str] | None = None,
    ) -> None:
        if (image is None) == (rootfs is None or not os.fspath(rootfs)):
            raise InvalidArgument(
                "a box needs exactly one of: an image, or rootfs= (a directory or a tarball)"
            )
        _positive("memory_mib", memory_mib, integer=True)
        _positive("cpus", cpus, integer=True)
        _positive("disk_size_gb", disk_size_gb, integer=True)
        _positive("boot_timeout", boot_timeout)
        _positive("request_timeout", request_timeout)
        if memory_mib < 64:
            raise InvalidArgument(f"memory_mib must be at least 64, not {memory_mib}")
        if cpus > (os.cpu_count() or 1) * 4:
            raise InvalidArgument(f"cpus={cpus} is more than this host can emulate sensibly")
        if hostname is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}", hostname):
            raise InvalidArgument(f"invalid hostname {hostname!r}")
        if pull not in ("missing", "always", "never"):
            raise InvalidArgument(f"pull must be 'missing', 'always' or 'never', not {pull!r}")
        self.rootfs: Path | None = None
        self._image_ref: str | None = None
        self.image: Image | None = None
        if isinstance(image, Image):
            self.image = image
        elif image is not None:
            if not isinstance(image, str):
                raise InvalidArgument(
                    f"image must be a reference string or an Image, not {type(image).__name__}"
                )
            Reference.parse(image)  # reject malformed references now
            self._image_ref = image
        else:
            assert rootfs is not None
            rootfs_path = Path(rootfs).expanduser()
            if not rootfs_path.exists():
                raise InvalidArgument(f"rootfs {rootfs_path} does not exist")
            self.rootfs = rootfs_path.absolute()
        self._env = _env(env) or {}
        self._workdir = guest_path(workdir) if workdir is not None else None
        self._user_default = self._user(user)
        self._pull = pull
        self._pull_opts = {
            "insecure": insecure,
            "ca_cert": Path(ca_cert) if ca_cert else None,
            "credentials": credentials,
        }
        self.id = secrets.token_hex(6)
        self.memory_mib = memory_mib
        self.cpus = cpus
        self.disk_size_gb = disk_size_gb
        self.hostname = hostname or f"sandlot-{self.id[:6]}"
        self._accel_request = accel
        self._kernel = kernel
        self._boot_timeout = boot_timeout
        self._request_timeout = request_timeout
        self.runtime = Runtime.for_home(home)
        self._vm: QemuVM | None = None
        self._conn: AgentConnection | None = None
        self._removed = False
        self._lock = asyncio.Lock()
        self.files = AsyncFiles(self._connection)
        self.accel: str | None = None
        self.boot_seconds: float | None = None

    async def _resolve_image(self) -> Image:
        if self.image is not None:
            return self.image
        assert self._image_ref is not None
        images = self.runtime.images
        found = None if self._pull == "always" else images.get(self._image_ref)
        if found is None:
            if self._pull == "never":
                raise InvalidArgument(f"image {self._image_ref!r} is not here and pull='never'")
            found = await images.pull(self._image_ref, **self._pull_opts)  # type: ignore[arg-type]
        self.image = found
        return found

    def default_command(self, command: Sequence[str] | None = None) -> list[str]:
        """What ``docker run IMAGE [command]`` would run: Entrypoint + (command or Cmd)."""
        if self.image is None:
            if not command:
                raise InvalidArgument("a root filesystem has no default command; give one")
            return list(command)
        argv = self.image.config.argv(list(command) if command else None)
        if not argv:
            raise InvalidArgument(f"image {self.image.name} has no Entrypoint or Cmd; give a command")
        return argv

    # -- paths ------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.runtime.boxes_dir / self.id

    @property
    def disk_path(self) -> Path:
        return self.state_dir / "disk.qcow2"

    @property
    def console_log(self) -> Path:
        return self.state_dir / "console.log"

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._vm is not None and self._vm.running and self._conn is not None

    async def __aenter__(self) -> AsyncBox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.remove()

    async def start(self) -> AsyncBox:
        """Boot the VM (cold boot; the disk is kept from earlier runs) and wait for the agent."""
        async with self._lock:
            if self._removed:
                raise BoxStateError(f"box {self.id} was removed")
            if self.running:
                return self
            t0 = time.monotonic()
            assets = await asyncio.to_thread(
                self.runtime.assets, kernel=self._kernel, accel=self._accel_request
            )
            self.accel = assets.accel.name
            await self._prepare_disk()
            cfg = VMConfig(
                kernel=assets.kernel.vmlinux,
                initrd=assets.initrd,
                disk=self.disk_path,
                run_dir=self.runtime.run_dir(self.id),
                state_dir=self.state_dir,
                accel=assets.accel.name,
                memory_mib=self.memory_mib,
                cpus=self.cpus,
                hostname=self.hostname,
            )
            vm = QemuVM(cfg)
            await vm.start()
            self._vm = vm
            timeout = self._boot_timeout or _default_boot_timeout(assets.accel.name)
            try:
                self._conn = await self._attach(vm, timeout)
            except BaseException:
                await vm.kill(grace=0.5)
                vm.cleanup()
                self._vm = None
                raise
            self.boot_seconds = time.monotonic() - t0
            return self

    async def _prepare_disk(self) -> None:
        """The box's disk: a qcow2 overlay on the image's (or rootfs's) cached base."""
        if self.disk_path.exists():
            return
        if self.rootfs is not None:
            base = await asyncio.to_thread(base_for, self.runtime.bases_dir, self.rootfs)
        else:
            image = await self._resolve_image()
            base = await asyncio.to_thread(self.runtime.images.ensure_base, image)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.runtime.claim(self.state_dir)
        await asyncio.to_thread(create_overlay, base, self.disk_path, self.disk_size_gb * GiB)

    async def _attach(self, vm: QemuVM, timeout: float) -> AgentConnection:
        """Connect to the agent socket and handshake, racing QEMU's exit and the deadline."""
        sock = str(vm.cfg.agent_socket(0))
        deadline = time.monotonic() + timeout

        async def connector() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_unix_connection(sock, limit=1 << 22)

        async def connect_and_handshake() -> AgentConnection:
            while True:
                try:
                    conn = AgentConnection(
                        connector,
                        request_timeout=self._request_timeout,
                        on_lost=self._on_agent_lost,
                    )
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

    async def _on_agent_lost(self) -> BaseException | None:
        """Called when the agent socket closes: reconnect if the VM lives, else report the crash."""
        vm = self._vm
        if vm is None:
            return ConnectionLost("the box was stopped")
        await asyncio.sleep(0.05)
        if vm.running:
            return None
        return BoxCrashed(
            f"box {self.id} stopped unexpectedly (QEMU exit status {vm.exit_code})", vm.console_tail()
        )

    async def _connection(self) -> AgentConnection:
        conn = self._conn
        if conn is None or self._vm is None:
            raise BoxStateError(f"box {self.id} is not running; call start()")
        if conn.failed is not None:
            raise conn.failed
        return conn

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully: processes get SIGTERM, then SIGKILL; the disk is synced and
        unmounted; the VM powers off. Forced after ``timeout`` seconds."""
        async with self._lock:
            vm, conn = self._vm, self._conn
            if vm is None:
                return
            if conn is not None and conn.failed is None and vm.running:
                with contextlib.suppress(Exception):
                    ch = conn.open_channel()
                    grace_ms = int(max(0.5, timeout * 0.5) * 1000)
                    ch.send(T.CONTROL, tlv(Tag.OP, ControlOp.SHUTDOWN) + tlv(Tag.TIMEOUT_MS, grace_ms))
                    await ch.expect(T.CONTROL_OK, timeout=timeout)
                await vm.wait_exit(max(1.0, timeout * 0.3))
            self._vm = None
            self._conn = None
            if conn is not None:
                await conn.close()
            await vm.kill(grace=2.0)
            vm.cleanup()

    async def kill(self) -> None:
        """Stop at once, like pulling the plug (the guest disk journal recovers on next boot)."""
        async with self._lock:
            vm, conn = self._vm, self._conn
            self._vm = None
            self._conn = None
            if conn is not None:
                await conn.close()
            if vm is not None:
                await vm.kill(grace=1.0)  # QMP quit: immediate, no guest involvement
                vm.cleanup()

    async def remove(self) -> None:
        """Stop if running and delete the box's disk and logs."""
        await self.stop()
        self._removed = True
        await asyncio.to_thread(shutil.rmtree, self.state_dir, True)

    def console_tail(self, lines: int = 40) -> str:
        from ..engine.qemu import tail

        return tail(self.console_log, lines)

    # -- exec -------------------------------------------------------------------------------

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
        merged_env = {**self._image_env(), **self._env, **(_env(env) or {})}
        req = ExecRequest(
            argv=args,
            env=merged_env or None,
            cwd=guest_path(cwd) if cwd is not None else self._default_cwd(),
            user=self._user(user)
            or self._user_default
            or (self.image.config.user if self.image else None)
            or None,
            tty=tty,
            rows=rows,
            cols=cols,
            stdin=stdin,
        )
        if tty and not (0 < rows <= 10000 and 0 < cols <= 10000):
            raise InvalidArgument("rows and cols must be in 1..10000")
        remote = await RemoteProcess.start(await self._connection(), req)
        return AsyncProcess(args, remote)

    def _image_env(self) -> dict[str, str]:
        return self.image.config.env_dict() if self.image else {}

    def _default_cwd(self) -> str | None:
        if self._workdir:
            return self._workdir
        if self.image and self.image.config.workdir:
            return self.image.config.workdir
        return None

    @staticmethod
    def _user(user: str | None) -> str | None:
        if user is None:
            return None
        if not isinstance(user, str) or not re.fullmatch(
            r"[A-Za-z0-9_.][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?", user
        ):
            raise InvalidArgument(f"user must be 'name', 'uid', 'name:group' or 'uid:gid', not {user!r}")
        return user

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
        _positive("timeout", timeout)
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

    >>> with sandlot.Box(rootfs="rootfs/") as box:                 # doctest: +SKIP
    ...     r = box.exec("python3", "-c", "print(6*7)")
    ...     r.stdout
    '42\\n'
    """

    def __init__(self, image: str | Image | None = None, **kwargs: Any) -> None:
        self._a = AsyncBox(image, **kwargs)
        self.files = Files(self._a.files)

    @property
    def image(self) -> Image | None:
        """The image this box was made from (resolved at start), or None for a rootfs."""
        return self._a.image

    def default_command(self, command: Sequence[str] | None = None) -> list[str]:
        return self._a.default_command(command)

    @property
    def id(self) -> str:
        return self._a.id

    @property
    def hostname(self) -> str:
        return self._a.hostname

    @property
    def accel(self) -> str | None:
        return self._a.accel

    @property
    def running(self) -> bool:
        return self._a.running

    @property
    def boot_seconds(self) -> float | None:
        return self._a.boot_seconds

    @property
    def aio(self) -> AsyncBox:
        """The async box behind this one, for use on sandlot's loop."""
        return self._a

    def __enter__(self) -> Box:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def start(self) -> Box:
        _sync.run(self._a.start())
        return self

    def stop(self, timeout: float = 10.0) -> None:
        _sync.run(self._a.stop(timeout))

    def kill(self) -> None:
        _sync.run(self._a.kill())

    def remove(self) -> None:
        _sync.run(self._a.remove())

    def console_tail(self, lines: int = 40) -> str:
        return self._a.console_tail(lines)

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
