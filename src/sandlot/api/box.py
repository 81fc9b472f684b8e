"""``AsyncBox`` and ``AsyncSnapshot``: durable microVMs and their saved running states (async API).

A box is a row in the home's state store plus its disk and logs; its VM runs
detached, so the box outlives the Python process that made it, and
``await AsyncBox.get(name)`` from any process finds it again. Every handle of
a box in a process shares one agent session and one view of its state
(``sandlot.core``); this class only translates calls into core operations.

The sync ``sandlot.Box`` is generated from this class (``scripts/gen_sync.py``)
and runs the same coroutines on sandlot's loop thread.

>>> import asyncio, sandlot
>>> async def main() -> None:                                   # doctest: +SKIP
...     async with sandlot.AsyncBox("python:3.12-slim") as box:
...         print((await box.exec("python3", "-c", "print(6*7)")).stdout)
>>> asyncio.run(main())                                         # doctest: +SKIP
42
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import socket
from collections.abc import AsyncIterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..core.controller import BoxController
from ..core.entry import BoxEntry, hostname_for
from ..core.requests import SPEC_OPTIONS, BoxRequest
from ..core.runtime import Runtime
from ..core.service import Core, core_for
from ..core.sessions import Kept
from ..core.spec import DEFAULT_DISK_GB, DEFAULT_MEMORY_MIB, PortSpec, VolumeSpec
from ..core.state import BoxState
from ..core.store import SnapshotRecord, validate_name
from ..core.validate import argv as check_argv
from ..core.validate import check_env, check_user, guest_path, positive
from ..errors import BoxNotFound, ConnectionLost, InvalidArgument, InvalidState, SnapshotNotFound
from ..net.secrets import Secret
from ..protocol.exec import ExecRequest, RemoteProcess
from .process import AsyncProcess, ExecResult

if TYPE_CHECKING:  # imported where used: a command that runs no code nor files starts without them
    from ..images.store import Image
    from .code import CodeContext, ContextArg, Execution, Interpreter, OutputCallback, ResultCallback
    from .files import AsyncFiles

StdinSource = bytes | str | IO[bytes] | AsyncIterable[bytes] | None
Home = str | os.PathLike[str] | None


def take_over_sessions(home: str | os.PathLike[str] | None = None, *, heir: str = "") -> None:
    """Make this process the heir of the agent sessions that processes of this home
    with the same ``heir`` name left when they died: processes they started with
    ``spawn(keep=...)`` can be followed again (``AsyncBox.taken_over()``). ``sandlot
    serve`` does this with its address as the name, so a server restarted there
    serves reattaches to what the last one ran, and another server of the home
    never takes them from it."""
    if not isinstance(heir, str):
        raise InvalidArgument(f"heir must be a string, not {heir!r}")
    Runtime.for_home(home).takes_over_sessions = heir


class AsyncBox:
    """A microVM sandbox (async API).

    ``AsyncBox(image)`` describes a box; ``start()`` creates it (pulling the image
    if needed) and boots it. ``async with AsyncBox(image) as box`` does the same
    and removes the box when the block ends; pass ``keep=True`` to leave it
    running instead (find it again later with ``AsyncBox.get(name)``). A box whose
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
        engine: str | None = None,
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
        home: Home = None,
    ) -> None:
        given = locals()  # the box's own options are those BoxSpec.build takes, by the same names
        self.runtime = Runtime.for_home(home)
        options = {k: given[k] for k in SPEC_OPTIONS}
        self._request: BoxRequest | None = BoxRequest.build(
            image,
            options,
            template=_template_arg(template),
            keep=keep,
            pull=pull,
            insecure=insecure,
            ca_cert=ca_cert,
            credentials=credentials,
        )
        self._id, self._name = self._request.id, self._request.name
        self.keep = keep
        self._image = self._request.image
        self._entry: BoxEntry | None = None
        self._core: Core | None = None
        self._claimed = False
        self._files: AsyncFiles | None = None

    @classmethod
    def of(cls, core: Core, entry: BoxEntry) -> AsyncBox:
        """The handle of a box the core already holds (for front ends built on the core)."""
        box = cls.__new__(cls)
        box.runtime = core.rt
        box._request = None
        box._id, box._name = entry.id, entry.name
        box.keep = True
        box._image = None
        box._entry, box._core = entry, core
        box._claimed = False
        box._files = None
        return box

    # -- finding boxes ------------------------------------------------------------------------

    @classmethod
    async def get(cls, key: str, *, home: Home = None) -> AsyncBox:
        """The box with this id, name or id prefix (``BoxNotFound`` if none)."""
        core = core_for(Runtime.for_home(home))
        return cls.of(core, await core.controller.find(key))

    @classmethod
    async def list(
        cls,
        *,
        all: bool = True,
        state: str | None = None,
        labels: Mapping[str, str] | None = None,
        home: Home = None,
    ) -> builtins.list[AsyncBox]:
        """Boxes of this home, oldest first. ``all=False``: only running or paused ones;
        ``state``: only that state; ``labels``: only boxes carrying all of them."""
        core = core_for(Runtime.for_home(home))
        entries = await core.controller.list(all=all, state=state, labels=labels)
        return [cls.of(core, e) for e in entries]

    @classmethod
    async def create(cls, image: str | Image | None = None, **options: Any) -> AsyncBox:
        """Create a box (disk ready, image pulled) without starting it; ``options`` as for ``AsyncBox``."""
        box = cls(image, **options)
        await box._created()
        return box

    # -- what the core knows ---------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def name(self) -> str:
        return self._name

    @property
    def files(self) -> AsyncFiles:
        """The guest's file system: ``await box.files.read(path)`` and so on."""
        if self._files is None:
            from .files import AsyncFiles

            self._files = AsyncFiles(self._connection)
        return self._files

    def _here(self) -> tuple[Core, BoxEntry | None]:
        """The core of the running loop, and the box's entry there if it was seen."""
        core = core_for(self.runtime)
        if self._core is not core:
            self._core = core
            self._entry = core.entries.get(self.id)
        return core, self._entry

    async def _created(
        self, *, ephemeral: bool = False, claim: bool = False
    ) -> tuple[BoxController, BoxEntry]:
        """The controller and the box's entry, creating the box first if it is new.
        ``claim``: it is about to start, so a ready VM of its template's warm pool may
        be it (already running)."""
        core, entry = self._here()
        if entry is not None and not entry.removed:
            return core.controller, entry
        if self._request is None:  # a box found by id, seen before on another loop
            entry = await core.controller.find(self.id)
        else:
            try:
                entry = await core.controller.find(self.id)
            except BoxNotFound:
                claimed = await core.pools.claim(self._request, ephemeral=ephemeral) if claim else None
                if claimed is not None:
                    entry = claimed
                    self._id, self._claimed = entry.id, True  # the pool VM's row is the box's now
                else:
                    entry = await core.controller.create(self._request, ephemeral=ephemeral)
                self._image = self._request.image
            self._request = None
        self._entry = entry
        return core.controller, entry

    async def _existing(self) -> tuple[BoxController, BoxEntry]:
        if self._request is not None and self._entry is None:
            raise InvalidState(f"box {self.name} was not created; call start()", box=self.name, state="new")
        return await self._created()

    async def _live(self) -> tuple[Core, BoxEntry]:
        """The core (its live state) and the entry of a box that exists."""
        _, entry = await self._existing()
        return self._here()[0], entry

    @property
    def state(self) -> str:
        """The state as of this process's last operation on the box, or ``refresh()``:
        created, running, paused, suspended, stopped or crashed ("new" before it was
        created, "removed" once it is gone)."""
        entry = self._entry
        if entry is None:
            return "new" if self._request is not None else "removed"
        return "removed" if entry.removed else str(entry.record.state)

    @property
    def info(self) -> dict[str, Any]:
        """The box's record as this process last read it (``list``, ``get`` and every
        operation read it), JSON-ready, without reading it again; ``inspect()`` for now."""
        if self._entry is None:
            raise InvalidState(f"box {self.name} was not created; call start()", box=self.name, state="new")
        return self._entry.record.to_json()

    async def refresh(self) -> str:
        """Read the box's state anew (another process may have changed it)."""
        if self._request is not None and self._entry is None:
            return "new"
        try:
            ctl, entry = await self._created()
            await ctl.refresh(entry)
        except BoxNotFound:
            return "removed"
        return self.state

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def hostname(self) -> str:
        if self._entry is not None:
            return self._entry.hostname
        return (self._request.spec_for(None).hostname if self._request else None) or hostname_for(self.name)

    @property
    def accel(self) -> str | None:
        """The accelerator its VM runs under ("kvm" or "tcg"; None before its first start)."""
        return (self._entry.record.boot.get("accel") if self._entry else None) or None

    @property
    def image(self) -> Image | None:
        return self._image

    @property
    def boot_seconds(self) -> float | None:
        """How long the last start took, in this process."""
        return self._entry.boot_seconds if self._entry else None

    @property
    def last_pause(self) -> float | None:
        """Seconds the last snapshot or suspend (in this process) paused the VM."""
        return self._entry.last_pause if self._entry else None

    async def inspect(self) -> dict[str, Any]:
        """Everything about the box, JSON-ready."""
        ctl, entry = await self._existing()
        return await ctl.inspect(entry)

    async def stats(self) -> dict[str, Any]:
        """Host CPU time and memory of the VM, and the disk it uses."""
        ctl, entry = await self._existing()
        return await ctl.stats(entry)

    async def logs(self, lines: int | None = None) -> str:
        """The guest console (kernel and agent messages) of the last boot; ``lines``: its last lines."""
        path = self.runtime.box_dir(self.id) / "console.log"
        return await asyncio.to_thread(_read_console, path, lines)

    async def port(self, guest_port: int) -> tuple[str, int]:
        """(host address, host port) where the box's published ``guest_port`` is reachable."""
        for p in (await self.inspect())["network"]["ports"]:
            if p["guest"] == guest_port and p["host"]:
                return p["address"], p["host"]
        raise InvalidArgument(f"box {self.name} does not publish port {guest_port} (or is not running)")

    def default_command(self, command: Sequence[str] | None = None) -> builtins.list[str]:
        """What ``docker run IMAGE [command]`` would run: Entrypoint + (command or Cmd)."""
        cfg = self._entry.spec.image_config if self._entry else None
        if cfg is None and self._image is not None:
            cfg = {"entrypoint": list(self._image.config.entrypoint), "cmd": list(self._image.config.cmd)}
        if cfg is None:
            if not command:
                raise InvalidArgument("a root filesystem has no default command; give one")
            return list(command)
        out = [*cfg.get("entrypoint", []), *(command if command else cfg.get("cmd", []))]
        if not out:
            raise InvalidArgument("the image has no Entrypoint or Cmd; give a command")
        return out

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncBox:
        ctl, entry = await self._created(ephemeral=not self.keep, claim=True)
        if self._claimed:  # a ready VM of its template's warm pool: running already
            self._claimed = False
            return self
        try:
            await ctl.start(entry)
        except BaseException:
            if not self.keep:  # __aexit__ will not run: do its work
                with contextlib.suppress(Exception):
                    await ctl.remove(entry, force=True)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        ctl, entry = await self._existing()
        if self.keep:  # the session stays for other handles; idle, it gives its port back
            if not entry.removed:
                rec = await ctl.db.update(entry.id, ephemeral=False)
                if rec is not None:
                    entry.update(rec)
        else:
            await ctl.remove(entry, force=True)

    async def start(self) -> AsyncBox:
        """Boot the box (creating it first if needed) and wait for its agent.
        A running box is left as it is; the disk is kept across stop/start."""
        ctl, entry = await self._created(claim=True)
        if self._claimed:  # a claimed pool VM runs already
            self._claimed = False
            return self
        await ctl.start(entry)
        return self

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully: every process gets SIGTERM, then SIGKILL after half of
        ``timeout``; the disk is synced and unmounted; the VM powers off. Forced
        once ``timeout`` has passed. The disk is kept."""
        ctl, entry = await self._existing()
        await ctl.stop(entry, timeout)

    async def restart(self, timeout: float = 10.0) -> None:
        ctl, entry = await self._existing()
        await ctl.restart(entry, timeout)

    async def kill(self) -> None:
        """Stop at once, like pulling the plug (the disk's journal recovers on next boot)."""
        ctl, entry = await self._existing()
        await ctl.kill(entry)

    async def pause(self) -> None:
        """Freeze the vCPUs; RAM and processes stay. Commands wait until unpause()."""
        ctl, entry = await self._existing()
        await ctl.pause(entry)

    async def unpause(self) -> None:
        ctl, entry = await self._existing()
        await ctl.unpause(entry)

    async def remove(self, *, force: bool = False) -> None:
        """Delete the box: its disk, logs and record. A running box needs ``force=True``
        (it is killed first). Removing a removed box does nothing."""
        if self._request is not None and self._entry is None:
            return
        try:
            ctl, entry = await self._existing()
        except BoxNotFound:
            return
        await ctl.remove(entry, force=force)

    # -- exec ----------------------------------------------------------------------------------

    async def _connection(self) -> Any:
        ctl, entry = await self._existing()
        return await ctl.connection(entry)

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
        keep: str | None = None,
    ) -> AsyncProcess:
        """Start a command and return at once with a handle to stream its output.

        ``keep`` names the process (as ``AsyncProcess.key``) for a process of this
        host that follows it again if this one dies: the heir of agent sessions
        (``take_over_sessions``, as ``sandlot serve`` is) gets it from
        ``taken_over()``. Elsewhere it only names the process.
        """
        args = check_argv(argv)
        if tty and not (0 < rows <= 10000 and 0 < cols <= 10000):
            raise InvalidArgument("rows and cols must be in 1..10000")
        ctl, entry = await self._existing()
        spec = entry.spec
        req = ExecRequest(
            argv=args,
            env={**spec.default_env(), **check_env(env)} or None,
            cwd=guest_path(cwd) if cwd is not None else spec.default_cwd(),
            user=check_user(user) or spec.default_user(),
            tty=tty,
            rows=rows,
            cols=cols,
            stdin=stdin,
        )
        remote = await RemoteProcess.start(await ctl.connection(entry), req)
        if keep is not None:
            entry.session.keep(remote.channel_id, Kept(keep, args, remote.pid, tty))
        return AsyncProcess(args, remote, key=keep)

    async def taken_over(self) -> builtins.list[AsyncProcess]:
        """The processes started with ``keep=`` by a process of this host that died,
        now followed by this one (which must ``take_over_sessions``): their output
        from what the box still held on, their exit, their stdin. Each is returned
        once. Output the dead process had taken and not passed on is not there:
        ``process.stdout.offset`` after a read says where the stream is.

        >>> take_over_sessions()
        >>> for p in await box.taken_over():
        ...     print(p.key, p.argv, await p.wait())
        """
        ctl, entry = await self._existing()
        session = entry.session
        if session.conn is None and entry.state == BoxState.RUNNING and session.inheritance_left():
            await ctl.connection(entry)  # leasing the port a dead host left takes its processes over
        taken, session.taken_over = session.taken_over, []
        return [AsyncProcess(kept.argv, remote, key=kept.key) for kept, remote in taken]

    async def connect(self, port: int, *, timeout: float = 10.0) -> socket.socket:
        """A socket connected to TCP ``port`` on the box's loopback, through the agent:
        the port needs no publishing and the box no network. Use it as any socket;
        closing it ends the connection (``shutdown(SHUT_WR)`` is a half close).
        A port nothing listens on raises GuestOSError (``ECONNREFUSED``).

        >>> s = await box.connect(8080)
        >>> reader, writer = await asyncio.open_connection(sock=s)
        """
        from .bridge import check_port, open_relay, socket_bridge

        check_port(port)
        positive("timeout", timeout)
        return socket_bridge(await open_relay(self.spawn, port, timeout))

    def _interpreter(self) -> Interpreter:
        from .code import CodeBox, Interpreter

        return Interpreter(CodeBox(self.id, self.files, self.spawn, self.exec))

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        context: CodeContext | str | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        """Run a cell of code in the box's interpreter and return what it did: the last
        expression's value and what it ``display()``-ed (``results``, rich formats where
        the value offers them), its output and its error with traceback. Variables stay
        for the next cell of the same context; without ``context`` the cell runs in the
        language's default one, started on first use. The callbacks get output and
        results as they come. Past ``timeout`` the cell is interrupted and CodeTimeout
        raised (with the execution so far). Needs python3 in the image; a language
        other than Python needs the image's Jupyter kernel for it.

        >>> ex = await box.run_code("x = 41\\nx + 1")
        >>> ex.text
        '42'
        """
        return await self._interpreter().run(
            code,
            language=language,
            context=context,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
        )

    async def create_code_context(
        self,
        *,
        language: str = "python",
        cwd: str | None = None,
        kernel: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> CodeContext:
        """Start a new interpreter in the box, independent of the others: pass it as
        ``run_code(..., context=ctx)``. ``kernel`` is None (sandlot's own for Python,
        the image's Jupyter kernel for other languages), "builtin", "jupyter" (the
        image's Jupyter kernel for ``language``) or "jupyter:NAME".

        >>> ctx = await box.create_code_context(cwd="/srv")
        >>> (await box.run_code("import os; os.getcwd()", context=ctx)).text
        "'/srv'"
        """
        return await self._interpreter().create(language=language, cwd=cwd, kernel=kernel, env=env, user=user)

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        """The interpreters running in the box (default ones included once started)."""
        return await self._interpreter().list()

    async def interrupt_code_context(self, context: ContextArg) -> None:
        """Interrupt the cell the context is running (KeyboardInterrupt in Python); the
        context keeps its variables."""
        await self._interpreter().interrupt(context)

    async def restart_code_context(self, context: ContextArg) -> CodeContext:
        """End the context's interpreter and start a fresh one with the same settings
        (its variables are gone)."""
        return await self._interpreter().restart(context)

    async def remove_code_context(self, context: ContextArg) -> None:
        """End the context's interpreter and forget it."""
        await self._interpreter().remove(context)

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
        """Run a shell command line with ``/bin/sh -c``; ``kwargs`` as for ``exec``."""
        return await self.exec("/bin/sh", "-c", script, **kwargs)

    async def ping(self) -> float:
        """Agent round trip in seconds."""
        conn = await self._connection()
        rtt: float = await conn.ping()
        return rtt

    async def activity(self) -> tuple[int, float]:
        """(operations in progress from any process, seconds since the last request):
        what the idle timeout looks at. Asking does not count as activity."""
        ctl, entry = await self._existing()
        return await ctl.activity(entry)

    async def set_network(
        self, network: str | bool | None = None, *, allow: Sequence[str] | str | None = None
    ) -> None:
        """Change the egress policy: ``network`` (the mode; unchanged if None) and
        ``allow`` (replaces the list; unchanged if None). Between 'public' and
        'allowlist', and for ``allow``, a running box applies it to its next
        connection. Adding or removing the network card, or going to or from
        'open', needs the VM to boot again: stop() the box first."""
        ctl, entry = await self._existing()
        await ctl.set_network(entry, network, allow=allow)

    # -- live state -------------------------------------------------------------------------

    async def snapshot(self, name: str | None = None) -> AsyncSnapshot:
        """Save memory, processes and disk while the box runs (it pauses only for the
        save; ``last_pause`` says how long). Roll back to it, or start boxes from it."""
        if name is not None:
            validate_name(name)
        core, entry = await self._live()
        return AsyncSnapshot(self.runtime, await core.live.snapshot(entry, name))

    async def snapshots(self) -> builtins.list[AsyncSnapshot]:
        """This box's snapshots, oldest first."""
        found: builtins.list[AsyncSnapshot] = await AsyncSnapshot.list(box=self.id, home=self.runtime.home)
        return found

    async def rollback(self, snapshot: AsyncSnapshot | str | Any) -> None:
        """Take this box back to one of its snapshots: memory, processes and disk.
        Same id and name; commands running now end (their connection ends with ConnectionLost)."""
        core, entry = await self._live()
        snap = await snapshot_record(core, snapshot, box_id=self.id, kinds=("snapshot",))
        await core.live.rollback(entry, snap)

    async def fork(self, n: int = 1, *, name: str | None = None) -> builtins.list[AsyncBox]:
        """``n`` running copies of this box, from a snapshot taken now; see ``AsyncSnapshot.start``."""
        core, entry = await self._live()
        kids = await core.live.fork(entry, n, name=name)
        return [AsyncBox.of(core, k) for k in kids]

    async def suspend(self) -> None:
        """Write the running state to disk and end the VM: no CPU, no RAM. ``resume()``
        (from any process), ``start()``, or the next command brings it back."""
        core, entry = await self._live()
        await core.live.suspend(entry)

    async def resume(self) -> None:
        """Bring a suspended box back with its processes; this process's open commands
        and streams carry on where they were."""
        core, entry = await self._live()
        await core.live.resume(entry)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.id}) {self.state}>"


async def snapshot_record(
    core: Core, snap: Any, *, box_id: str | None = None, kinds: tuple[str, ...] = ("snapshot", "template")
) -> SnapshotRecord:
    """A snapshot's row, from a snapshot object (async or sync), an id or a name."""
    record = getattr(snap, "record", None)
    if isinstance(record, SnapshotRecord):
        found = await core.db.find_snapshot(record.id)
        if found is None:
            raise SnapshotNotFound(f"snapshot {record.id} was removed")
        return found
    if not isinstance(snap, str):
        raise InvalidArgument(f"a snapshot, or its id or name, is needed, not {type(snap).__name__}")
    return await core.live.find_snapshot(snap, box_id=box_id, kinds=kinds)


class AsyncSnapshot:
    """A saved running state (async API): memory, devices and a frozen disk layer."""

    def __init__(self, runtime: Runtime, rec: SnapshotRecord) -> None:
        self.runtime = runtime
        self._rec = rec

    @classmethod
    async def get(cls, key: str, *, home: Home = None) -> AsyncSnapshot:
        """By id, id prefix or name (SnapshotNotFound if none)."""
        rt = Runtime.for_home(home)
        return cls(rt, await core_for(rt).live.find_snapshot(key))

    @classmethod
    async def list(
        cls, *, box: str | None = None, kind: str | None = None, home: Home = None
    ) -> builtins.list[AsyncSnapshot]:
        """Snapshots and templates of this home, oldest first (``box``: of that box)."""
        rt = Runtime.for_home(home)
        return [cls(rt, r) for r in await core_for(rt).live.list_snapshots(box=box, kind=kind)]

    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def name(self) -> str | None:
        return self._rec.name

    @property
    def kind(self) -> str:
        """ "snapshot" or "template"."""
        return self._rec.kind

    @property
    def box_name(self) -> str | None:
        return self._rec.box_name

    @property
    def created_at(self) -> float:
        return self._rec.created_at

    @property
    def size(self) -> int:
        """Bytes of saved state on disk (the frozen disk layer aside)."""
        return self._rec.size

    @property
    def record(self) -> SnapshotRecord:
        return self._rec

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Snapshot {self.id}{label} of {self.box_name}>"

    async def inspect(self) -> dict[str, Any]:
        """Everything about the snapshot, and the boxes started from it."""
        core = core_for(self.runtime)
        d = self._rec.to_json()
        d["children"] = await core.live.children(self._rec)
        d["path"] = str(self.runtime.home / "snapshots" / self.id)
        return d

    async def start(self, n: int = 1, *, name: str | None = None, **options: Any) -> builtins.list[AsyncBox]:
        """Start ``n`` boxes from this state, processes running. They share unchanged
        memory copy-on-write and each has its own disk layer, hostname, machine-id,
        RNG state and wall clock. ``name``: the box's name if ``n`` is 1, else the
        prefix of their names; ``options``: env, labels, workdir, user,
        idle_timeout and the like for each (as for ``AsyncBox``)."""
        core = core_for(self.runtime)
        entries = await core.live.start_boxes(self._rec, n, name=name, **options)
        return [AsyncBox.of(core, e) for e in entries]

    async def export(self, path: str | os.PathLike[str]) -> Path:
        """Write this snapshot to one file (zstd tar) that ``sandlot.import_snapshot``
        starts elsewhere. Written under a temporary name and renamed when complete."""
        return await core_for(self.runtime).live.export(self._rec, Path(path))

    async def remove(self) -> None:
        """Delete the snapshot; refused (SnapshotInUse) while boxes started from it exist.
        A template's warm pool goes first (its VMs are no boxes yet)."""
        core = core_for(self.runtime)
        if self._rec.kind == "template":
            found = await core.db.find_snapshot(self._rec.id)
            if found is not None:
                await core.pools.drop(found)
        await core.live.remove_snapshot(self._rec)


def _template_arg(template: Any) -> str | SnapshotRecord | bool | None:
    """``template=``: a snapshot object (async or sync), its id or name, False or None."""
    if template is None or template is False or isinstance(template, str | SnapshotRecord):
        return template
    record = getattr(template, "record", None)
    if isinstance(record, SnapshotRecord):
        return record
    raise InvalidArgument(f"template= takes a template or snapshot, its name, or False; not {template!r}")


def _read_console(path: Path, lines: int | None) -> str:
    if lines is None:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").replace("\r\n", "\n").splitlines()[-lines:])


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
