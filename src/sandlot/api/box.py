"""``AsyncBox`` and ``AsyncSnapshot``: durable microVMs and their saved running states
(async API), written once for every way a box is reached.

A box of this host's home (``AsyncBox(image)``, ``AsyncBox.get(name)``) is run by
the core in this process: its VM runs detached, so the box outlives the Python
process that made it, and ``await AsyncBox.get(name)`` from any process finds it
again. A box of a ``sandlot serve`` (``sandlot.connect(url).Box(...)``) or of a
fleet node (``fleet.create(...)``) is the same class, with the same methods,
results and errors: each call is an operation of ``api/contract.py``'s table,
run by the box's backend (``api/backend.py``). ``box.transport`` says which.

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
import codecs
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.events import Event
from ..core.events import query as check_events_query
from ..core.option_values import PortSpec, VolumeSpec
from ..core.options import DESCRIBED
from ..core.runtime import Runtime
from ..core.validate import check_env, positive
from ..errors import InvalidArgument, StepNotFound
from ..net.secrets import Secret
from .backend import Backend, BoxRef, Cell, Command, SnapshotRef, snapshot_key
from .diffs import Diff, side_arg
from .local import LocalBackend
from .process import AsyncProcess, ExecResult, StdinSource, feed_and_wait
from .timeline import Bisection, Step, probes

if TYPE_CHECKING:  # imported where used: a command that runs no code nor files starts without them
    from ..core.entry import BoxEntry
    from ..core.service import Core
    from ..images.store import Image
    from .code import CodeContext, ContextArg, Execution, OutputCallback, ResultCallback
    from .desktop import AsyncDesktop
    from .files import AsyncFiles

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

    ``AsyncBox(image)`` describes a box of this host's home; ``start()`` creates it
    (pulling the image if needed) and boots it. ``async with AsyncBox(image) as box``
    does the same and removes the box when the block ends; pass ``keep=True`` to
    leave it running instead (find it again later with ``AsyncBox.get(name)``). A
    box whose ``with`` block never ended because its process died is removed by the
    next sandlot call in any process. The boxes of a server (``sandlot.connect``)
    and of a fleet (``sandlot.fleet``) are this class too.
    """

    # -- AsyncBox.__init__, from core/options.py: written by scripts/gen_sync.py, edit there --
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
        memory_mib: int = 512,
        cpus: int = 1,
        disk_size_gb: int = 8,
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
        timezone: str | None = None,
        boot_timeout: float | None = None,
        request_timeout: float = 30.0,
        idle_timeout: float | None = None,
        network: str | bool | None = None,
        allow: Sequence[str] | str | None = None,
        ports: Sequence[PortSpec] | None = None,
        wake_on_traffic: bool = False,
        pids_limit: int | None = None,
        nested_virt: bool = False,
        containers: bool = False,
        aslr: bool | None = None,
        secrets: Sequence[Secret] | None = None,
        template: Any = None,
        record: bool | Mapping[str, Any] = False,
        home: Home = None,
    ) -> None:
        """Describe a box; ``start()`` makes it and boots it (``async with`` too, and removes it
        at the block's end unless ``keep``). ``image``: an image reference (``python:3.12-slim``),
        or an ``Image``; else ``rootfs``. The options (``core/options.py`` declares each):

        - ``rootfs``: A root filesystem to boot instead of an image: a directory or a tarball.
        - ``name``: The box's name, unique in its home (default: box-<id>).
        - ``env``: Environment variables of every command.
        - ``workdir``: The working directory of commands (default: the image's).
        - ``user``: Who commands run as: name, uid, name:group or uid:gid.
        - ``volumes``: Named volumes (NAME:GUEST[:copy|ro|shared]) and host directories (HOST:GUEST[:ro])
          mounted in the box, at most 4.
        - ``labels``: Labels to find the box by (KEY=VALUE).
        - ``memory_mib``: Guest memory in MiB (at least 64). Default: ``512``.
        - ``cpus``: Virtual CPUs. Default: ``1``.
        - ``disk_size_gb``: The root disk's size in GiB. Default: ``8``.
        - ``auto_remove``: Remove the box when it stops.
        - ``keep``: Leave the box when a ``with`` block ends (else it is removed).
        - ``pull``: When to pull the image: missing, always or never. Default: ``"missing"``.
        - ``insecure``: Allow plain HTTP to the registry.
        - ``ca_cert``: A PEM file of CA certificates to trust for the registry.
        - ``credentials``: The registry's user name and password.
        - ``engine``: qemu (a microVM), gvisor (a user-space kernel) or auto (default: $SANDLOT_ENGINE, else
          qemu).
        - ``accel``: QEMU's accelerator: auto, kvm or tcg. Default: ``"auto"``.
        - ``kernel``: A guest kernel to boot instead of sandlot's.
        - ``hostname``: The guest's host name.
        - ``timezone``: The time zone of the box's commands: their $TZ, an IANA name (Europe/Paris, read
          from the image's /usr/share/zoneinfo) or a POSIX one (UTC-3). Default: UTC.
        - ``boot_timeout``: Seconds a boot may take (default: $SANDLOT_BOOT_TIMEOUT, else 30 under TCG, 15
          under KVM).
        - ``request_timeout``: Seconds a call to the guest's agent may take. Default: ``30.0``.
        - ``idle_timeout``: Suspend the box after this many seconds without requests or open connections.
        - ``network``: none (the default: no network card), public, allowlist or open (see
          sandlot.net.policy).
        - ``allow``: What an allowlist lets the box reach: NAME, *.DOMAIN, ADDRESS or NETWORK, each [:PORT].
        - ``ports``: Guest TCP ports published on the host: GUEST, HOST:GUEST or ADDRESS:HOST:GUEST.
        - ``wake_on_traffic``: Keep the published ports open while the box sleeps: a connection wakes it.
        - ``pids_limit``: Processes all commands together may have (at least 8).
        - ``nested_virt``: The box runs VMs of its own: /dev/kvm in it (qemu engine).
        - ``containers``: The box runs a container engine (Docker, Podman): its kernel's modules loaded, and
          the image's dockerd started (qemu engine).
        - ``aslr``: Address-space randomization of the box's processes (None: on, or as its saved state had
          it).
        - ``secrets``: Values the box may use but never see, swapped in on HTTPS to their hosts
          (sandlot.Secret).
        - ``template``: A template or snapshot (or its name) to start from; False: none, not even the
          image's automatic template.
        - ``record``: Record every step from the first start: True, or box.record()'s arguments.
        - ``home``: The home the box lives in (default: $SANDLOT_HOME).
        """
        self._describe(image, locals())

    # -- end of AsyncBox.__init__ --

    def _describe(self, image: str | Image | None, given: Mapping[str, Any]) -> None:
        """``__init__``'s work: the box's and the request's options to its home's backend."""
        keep, record = given["keep"], given["record"]
        backend = LocalBackend.for_home(given["home"])
        self._bind(backend.describe(image, {k: given[k] for k in DESCRIBED}, keep=keep), keep)
        if record:  # the flight recorder, from the box's first start (``record``'s arguments)
            self._record_on_start: dict[str, Any] | None = {} if record is True else dict(record)

    def _bind(self, ref: BoxRef, keep: bool) -> None:
        self._ref = ref
        self._backend: Backend = ref.backend
        self.keep = keep
        self._files: AsyncFiles | None = None
        self._desktop: AsyncDesktop | None = None
        self._record_on_start = None

    @classmethod
    def bound(cls, ref: BoxRef, *, keep: bool = True) -> AsyncBox:
        """The handle of a box a backend describes (for clients and front ends): kept
        when a ``with`` block ends, as a box found by ``get`` is."""
        box = cls.__new__(cls)
        box._bind(ref, keep)
        return box

    @classmethod
    def of(cls, core: Core, entry: BoxEntry) -> AsyncBox:
        """The handle of a box the core already holds (for front ends built on the core)."""
        backend = LocalBackend.for_home(core.rt.home)
        return cls.bound(backend.ref_of(core, entry))

    # -- finding boxes ------------------------------------------------------------------------

    @classmethod
    async def get(cls, key: str, *, home: Home = None) -> AsyncBox:
        """The box of this host's home with this id, name or id prefix (``BoxNotFound`` if none)."""
        return cls.bound(await LocalBackend.for_home(home).find(key))

    @classmethod
    async def list(
        cls,
        *,
        all: bool = True,
        state: str | None = None,
        labels: Mapping[str, str] | None = None,
        home: Home = None,
    ) -> builtins.list[AsyncBox]:
        """Boxes of this host's home, oldest first. ``all=False``: only running or paused
        ones; ``state``: only that state; ``labels``: only boxes carrying all of them."""
        return await boxes_of(LocalBackend.for_home(home), all=all, state=state, labels=labels)

    @classmethod
    async def create(cls, image: str | Image | None = None, **options: Any) -> AsyncBox:
        """Create a box (disk ready, image pulled) without starting it; ``options`` as for ``AsyncBox``."""
        box = cls(image, **options)
        await box._backend.create(box._ref, start=False)
        return box

    # -- what is known of it ------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._ref.id

    @property
    def name(self) -> str:
        """The box's name; before a server or fleet made it, the name asked for ("" if it picks one)."""
        return self._ref.name

    @property
    def transport(self) -> str:
        """How the box is reached: "local" (this host's home), "http" (a ``sandlot
        serve``) or "ray" (a fleet node)."""
        return self._backend.transport

    @property
    def ref(self) -> BoxRef:
        """What the box's backend knows of it (for front ends built on a backend)."""
        return self._ref

    @property
    def files(self) -> AsyncFiles:
        """The guest's file system: ``await box.files.read(path)`` and so on."""
        if self._files is None:
            from .files import AsyncFiles

            self._files = AsyncFiles(self._backend, self._ref)
        return self._files

    @property
    def desktop(self) -> AsyncDesktop:
        """The screen, mouse and keyboard of a desktop box (an image made by ``sandlot
        rootfs desktop``): ``await box.desktop.screenshot()``, ``click(x, y)``, ``type(text)``,
        ``stream_url()``. See docs/desktop.md."""
        if self._desktop is None:
            from .desktop import AsyncDesktop

            self._desktop = AsyncDesktop(self)
        return self._desktop

    @property
    def state(self) -> str:
        """The state as of the last operation through this handle (locally: of this
        process on the box), or ``refresh()``: created, running, paused, suspended,
        stopped or crashed ("new" before it was created, "removed" once it is gone)."""
        return self._ref.state

    @property
    def info(self) -> dict[str, Any]:
        """The box's description as last read, without reading it again: id, name,
        state, image, labels, created_at, started_at, memory_mib, cpus, disk_size_gb,
        network, hostname, engine, accel, origin, reason, size, logical_size and node
        (a fleet box's). ``inspect()`` says everything, now."""
        return self._ref.info

    @property
    def size(self) -> int | None:
        """The bytes the box takes in its home beyond its snapshots and its image: its own
        disk layers and, suspended, its saved state (as last read; None where the
        transport does not say)."""
        size = self._ref.info.get("size")
        return None if size is None else int(size)

    async def refresh(self) -> str:
        """Read the box's state anew (another process or client may have changed it)."""
        if self._ref.made:
            await self._backend.call("box", "refresh", self._ref, {})
        return self.state

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def hostname(self) -> str | None:
        return self._ref.hostname

    @property
    def accel(self) -> str | None:
        """The accelerator its VM runs under ("kvm" or "tcg"; None before its first start)."""
        return self._ref.accel

    @property
    def image(self) -> Any:
        """The image the box was made from: its reference (an ``Image`` given locally)."""
        return self._ref.image

    @property
    def boot_seconds(self) -> float | None:
        """How long the last start took, in this process (None over other transports)."""
        return self._ref.boot_seconds

    @property
    def last_pause(self) -> float | None:
        """Seconds the last snapshot or suspend (in this process) paused the VM."""
        return self._ref.last_pause

    async def _op(self, operation: str, /, **args: Any) -> Any:
        self._ref.need_made()
        return await self._backend.call("box", operation, self._ref, args)

    async def inspect(self) -> dict[str, Any]:
        """Everything about the box, JSON-ready."""
        found: dict[str, Any] = await self._op("inspect")
        return found

    async def stats(self) -> dict[str, Any]:
        """Host CPU time and memory of the VM, and the disk it uses."""
        found: dict[str, Any] = await self._op("stats")
        return found

    async def metrics(
        self, since: float | None = None, limit: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The box's sampled metrics, oldest first (every 10 s while it runs: docs/events.md):
        host CPU seconds, RSS and PSS, its disk's bytes; the guest's memory, network and
        disk bytes, commands started; and per second since the sample before
        (``cpu_percent``, ``net_rx_Bps``, ``execs_per_s``, ``exec_start_ms``...).
        ``since``: from that Unix time (negative: seconds ago); ``limit``: the newest that many.

        >>> [round(s["cpu_percent"] or 0) for s in box.metrics(since=-60)]   # doctest: +SKIP
        [0, 12, 97, 3]
        """
        found: builtins.list[dict[str, Any]] = await self._op("metrics", since=since, limit=limit)
        return found

    async def logs(self, lines: int | None = None) -> str:
        """The guest console (kernel and agent messages) of the last boot; ``lines``: its last lines."""
        text: str = await self._op("logs", lines=lines)
        return text

    async def follow_logs(self, lines: int | None = None) -> AsyncIterator[str]:
        """The guest console of the last boot (``lines``: its last lines), then what the
        guest writes to it as it comes, until the box stops running.

        >>> async for text in box.follow_logs(lines=20):           # doctest: +SKIP
        ...     print(text, end="")
        """
        self._ref.need_made()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for chunk in self._backend.follow_logs(self._ref, lines):
            if text := decoder.decode(chunk):
                yield text

    async def events(
        self, *, since: float | None = None, after: int | None = None, follow: bool = True
    ) -> AsyncIterator[Event]:
        """What happened to this box, oldest first (``sandlot.events`` for this box): from
        Unix time ``since`` (negative: seconds ago), after event id ``after``; with
        ``follow`` (the default), each new event as it comes.

        >>> for event in box.events(follow=False):            # doctest: +SKIP
        ...     print(event.kind, event.state, event.by, event.reason)
        created created process 4242 (python3 agent.py) None
        started running process 4242 (python3 agent.py) None
        """
        _, since, after = check_events_query(None, since, after)
        async for ev in self._backend.events(box=self.id, since=since, after=after, follow=follow):
            yield ev

    async def ports(self) -> builtins.list[dict[str, Any]]:
        """The box's published ports: ``{"address", "host", "guest"}`` each (an address of
        the host the box runs on; ``host`` is 0 while the box is not running)."""
        found: builtins.list[dict[str, Any]] = await self._op("ports")
        return found

    async def port(self, guest_port: int) -> tuple[str, int]:
        """(host address, host port) where the box's published ``guest_port`` is reachable."""
        for p in await self.ports():
            if p.get("guest") == guest_port and p.get("host"):
                return str(p["address"]), int(p["host"])
        raise InvalidArgument(f"box {self.name} does not publish port {guest_port} (or is not running)")

    def default_command(self, command: Sequence[str] | None = None) -> builtins.list[str]:
        """What ``docker run IMAGE [command]`` would run: Entrypoint + (command or Cmd)."""
        cfg = self._ref.image_config()
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
        await self._backend.create(self._ref, start=True, ephemeral=not self.keep)
        await self._start_recording()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.keep:
            await self._backend.release(self._ref)
        else:
            await self.remove(force=True)

    async def start(self) -> AsyncBox:
        """Boot the box (creating it first if needed) and wait for its agent.
        A running box is left as it is; the disk is kept across stop/start."""
        if not self._ref.made:
            await self._backend.create(self._ref, start=True)
        else:
            await self._op("start")
        await self._start_recording()
        return self

    async def _start_recording(self) -> None:
        if self._record_on_start is not None:
            policy, self._record_on_start = self._record_on_start, None
            await self.record(**policy)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully: every process gets SIGTERM, then SIGKILL after half of
        ``timeout``; the disk is synced and unmounted; the VM powers off. Forced
        once ``timeout`` has passed. The disk is kept."""
        await self._op("stop", timeout=timeout)

    async def restart(self, timeout: float = 10.0) -> None:
        """Stop (as ``stop``), then start again."""
        await self._op("restart", timeout=timeout)

    async def kill(self) -> None:
        """Stop at once, like pulling the plug (the disk's journal recovers on next boot)."""
        await self._op("kill")

    async def pause(self) -> None:
        """Freeze the vCPUs; RAM and processes stay. Commands wait until unpause()."""
        await self._op("pause")

    async def unpause(self) -> None:
        """Let a paused box run again."""
        await self._op("unpause")

    async def remove(self, *, force: bool = False) -> None:
        """Delete the box: its disk, logs and record. A running box needs ``force=True``
        (it is killed first). Removing a removed box does nothing."""
        if not self._ref.made:
            return
        await self._backend.call("box", "remove", self._ref, {"force": force})

    # -- commands ------------------------------------------------------------------------------

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

        ``keep`` names the process (as ``AsyncProcess.key``). Locally, a process of this
        host that is the heir of agent sessions (``take_over_sessions``, as ``sandlot
        serve`` is) follows it again if this one dies (``taken_over()``). A box of a
        server or a fleet node is followed over a link that is made again by itself
        if it drops; the host holds the process (``processes()``, ``attach()``).
        """
        self._ref.need_made()
        cmd = Command(tuple(argv), env, cwd, user, tty, rows, cols, stdin)  # type: ignore[arg-type]
        return await self._backend.spawn(self._ref, cmd, keep)

    async def taken_over(self) -> builtins.list[AsyncProcess]:
        """The processes started with ``keep=`` by a process of this host that died,
        now followed by this one (which must ``take_over_sessions``): their output
        from what the box still held on, their exit, their stdin. Each is returned
        once. Output the dead process had taken and not passed on is not there:
        ``process.stdout.offset`` after a read says where the stream is. (Local boxes:
        a server or a node holds its processes itself: ``processes()``.)

        >>> take_over_sessions()
        >>> for p in await box.taken_over():
        ...     print(p.key, p.argv, await p.wait())
        """
        self._ref.need_made()
        return await self._backend.taken_over(self._ref)

    async def processes(self) -> builtins.list[dict[str, Any]]:
        """The processes the box's host holds (a server's or a fleet node's, started by
        ``spawn`` from any client): ``{"id", "pid", "argv", "tty", "exit_code", "clients"}``
        each."""
        found: builtins.list[dict[str, Any]] = await self._op("processes")
        return found

    async def attach(self, process_id: str, *, stdout: int = 0, stderr: int = 0) -> AsyncProcess:
        """Follow a process the box's host holds (its id from ``processes()``), from these
        offsets of its output on (what its buffer no longer holds is skipped)."""
        if stdout < 0 or stderr < 0:
            raise InvalidArgument("offsets must not be negative")
        self._ref.need_made()
        return await self._backend.attach(self._ref, process_id, (stdout, stderr))

    async def connect(self, port: int, *, timeout: float = 10.0) -> socket.socket:
        """A socket connected to TCP ``port`` on the box's loopback, through the agent
        (over whatever reaches the box): the port needs no publishing and the box no
        network. Use it as any socket; closing it ends the connection
        (``shutdown(SHUT_WR)`` is a half close). A port nothing listens on raises
        GuestOSError (``ECONNREFUSED``).

        >>> s = await box.connect(8080)
        >>> reader, writer = await asyncio.open_connection(sock=s)
        """
        from .bridge import check_port, open_relay, socket_bridge

        check_port(port)
        positive("timeout", timeout)
        return socket_bridge(await open_relay(self.spawn, port, timeout))

    async def preview_url(self, port: int, ttl: float = 3600, *, at_host: bool = False) -> str:
        """A URL to ``port`` in the box that works without an API key (for a browser,
        a webhook, a teammate) until ``ttl`` seconds from now; signed by the server the
        box is on (Unsupported elsewhere). It is a path of the server's content port
        (``/p/TOKEN/``); ``at_host=True``: the root of the port's own host
        (``PORT-BOX.DOMAIN``, with the token once in the query), what an app that links
        from ``/`` needs, where the server has a ``--port-domain`` (Unsupported if not)."""
        from .bridge import check_port

        check_port(port)
        positive("ttl", ttl)
        if not isinstance(at_host, bool):
            raise InvalidArgument(f"at_host is True or False, not {at_host!r}")
        url: str = await self._op("preview_url", port=port, ttl=ttl, at_host=at_host or None)
        return url

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
        cmd = Command(tuple(argv), dict(env) if env else None, cwd, user, tty, stdin=stdin is not None)  # type: ignore[arg-type]
        self._ref.need_made()
        if isinstance(stdin, str):
            stdin = stdin.encode()
        whole = stdin is None or (isinstance(stdin, bytes | bytearray | memoryview)
                                  and len(stdin) <= self._backend.inline_stdin)  # fmt: skip
        if tty or not whole:  # through a process: a terminal, or stdin streamed as it is read
            result = await feed_and_wait(await self._backend.spawn(self._ref, cmd), stdin, timeout)
        else:
            data = bytes(stdin) if stdin is not None else None  # type: ignore[arg-type]
            result = await self._backend.exec(self._ref, cmd, data, timeout)
        return result.check() if check else result

    async def sh(self, script: str, **kwargs: Any) -> ExecResult:
        """Run a shell command line with ``/bin/sh -c``; ``kwargs`` as for ``exec``."""
        return await self.exec("/bin/sh", "-c", script, **kwargs)

    async def ping(self) -> float:
        """The agent's round trip in seconds, as measured where the box runs."""
        rtt: float = await self._op("ping")
        return rtt

    async def activity(self) -> tuple[int, float]:
        """(operations in progress from any process, seconds since the last request):
        what the idle timeout looks at. Asking does not count as activity."""
        found: tuple[int, float] = await self._op("activity")
        return found

    async def set_network(
        self, network: str | bool | None = None, *, allow: Sequence[str] | str | None = None
    ) -> None:
        """Change the egress policy: ``network`` (the mode; unchanged if None) and
        ``allow`` (replaces the list; unchanged if None). Between 'public' and
        'allowlist', and for ``allow``, a running box applies it to its next
        connection. Adding or removing the network card, or going to or from
        'open', needs the VM to boot again: stop() the box first."""
        if isinstance(allow, str):
            allow = [allow]
        await self._op("set_network", network=network, allow=None if allow is None else list(allow))

    # -- code interpreter ----------------------------------------------------------------------

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        context: CodeContext | str | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
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
        raised (with the execution so far). ``env``: environment variables for this cell
        alone (and what it starts); afterwards each is as it was, unless the cell set it
        itself (sandlot's own kernels, and an image's Jupyter kernels of Python, R, bash and
        JavaScript; one of another language takes ``env`` when its context is created). Needs
        python3 in the image; ``language`` "bash" needs bash, "javascript" and
        "typescript" node (sandlot's own kernels), any other the image's Jupyter kernel.

        >>> ex = await box.run_code("x = 41\\nx + 1")
        >>> ex.text
        '42'
        >>> (await box.run_code("import os; os.environ['STAGE'] == 'eval'", env={"STAGE": "eval"})).text
        'True'
        """
        from .code import Callbacks, check_language, context_id

        if not isinstance(code, str):
            raise InvalidArgument(f"code must be a str, not {type(code).__name__}")
        positive("timeout", timeout)
        cid = None if context is None else context_id(context, language)
        self._ref.need_made()
        given = check_env(env) if env is not None else None
        cell = Cell(code, check_language(language), cid, timeout, given)
        return await self._backend.run_code(self._ref, cell, Callbacks(on_stdout, on_stderr, on_result))

    async def create_code_context(
        self,
        *,
        language: str = "python",
        cwd: str | None = None,
        kernel: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        id: str | None = None,
    ) -> CodeContext:
        """Start a new interpreter in the box, independent of the others: pass it as
        ``run_code(..., context=ctx)``. ``kernel`` is None (sandlot's own for Python;
        for another language the image's Jupyter kernel, else sandlot's own for bash,
        JavaScript and TypeScript), "builtin" (sandlot's own), "jupyter" (the image's
        Jupyter kernel for ``language``) or "jupyter:NAME". ``user`` runs it as
        that user of the box; ``id`` names it (letters, digits, ``_.-``; a name in use
        is refused), else it gets one: ``create_code_context(id="default-python", ...)``
        sets up the context a ``run_code`` without one runs in, before its first use.

        >>> ctx = await box.create_code_context(cwd="/srv")
        >>> (await box.run_code("import os; os.getcwd()", context=ctx)).text
        "'/srv'"
        """
        made: CodeContext = await self._op(
            "create_code_context",
            language=language,
            cwd=cwd,
            kernel=kernel,
            env=None if env is None else dict(env),
            user=user,
            id=id,
        )
        return made

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        """The interpreters running in the box, oldest first (default ones included once started)."""
        found: builtins.list[CodeContext] = await self._op("list_code_contexts")
        return found

    async def interrupt_code_context(self, context: ContextArg) -> None:
        """Interrupt the cell the context is running (KeyboardInterrupt in Python); the
        context keeps its variables."""
        from .code import context_id

        await self._op("interrupt_code_context", context=context_id(context, "python"))

    async def restart_code_context(self, context: ContextArg) -> CodeContext:
        """End the context's interpreter and start a fresh one with the same settings
        (its variables are gone)."""
        from .code import context_id

        made: CodeContext = await self._op("restart_code_context", context=context_id(context, "python"))
        return made

    async def remove_code_context(self, context: ContextArg) -> None:
        """End the context's interpreter and forget it."""
        from .code import context_id

        await self._op("remove_code_context", context=context_id(context, "python"))

    # -- live state -------------------------------------------------------------------------

    async def snapshot(self, name: str | None = None) -> AsyncSnapshot:
        """Save memory, processes and disk while the box runs (it pauses only for the
        save; ``last_pause`` says how long). Roll back to it, or start boxes from it."""
        return AsyncSnapshot(await self._op("snapshot", name=name))

    async def snapshots(self) -> builtins.list[AsyncSnapshot]:
        """This box's snapshots, oldest first."""
        return [AsyncSnapshot(r) for r in await self._op("snapshots")]

    async def rollback(self, snapshot: AsyncSnapshot | str | Any) -> None:
        """Take this box back to one of its snapshots (the object, its id or its name):
        memory, processes and disk. Same id and name; commands running now end
        (their connection ends with ConnectionLost)."""
        await self._op("rollback", snapshot=snapshot_key(snapshot))

    async def fork(self, n: int = 1, *, name: str | None = None) -> builtins.list[AsyncBox]:
        """``n`` running copies of this box, from a snapshot taken now; see ``AsyncSnapshot.start``."""
        return [AsyncBox.bound(r) for r in await self._op("fork", n=n, name=name)]

    async def diff(
        self,
        a: AsyncSnapshot | AsyncBox | str | Any = None,
        b: AsyncSnapshot | AsyncBox | str | Any = None,
        *,
        paths: Sequence[str] | str | None = None,
        text_limit: int | None = None,
    ) -> Diff:
        """What changed in the box's files from ``a`` to ``b``: files added, deleted,
        modified (content, type, mode, owner, link target) and renamed, with a unified
        diff for text and sizes and SHA-256 hashes for the rest (docs/diffs.md).

        ``a`` defaults to the box's image, ``b`` to the box now. Either may be a snapshot
        (the object, its id or its name: any snapshot of the home, so forks compare with
        each other), another box (its files now), ``"image"`` or ``"now"``. ``paths``:
        only these subtrees. ``text_limit``: the largest text file that gets a unified
        diff (1 MiB; 0: none). A side that is a snapshot or the image is started as a
        box of its own for the comparison and removed after it.

        >>> snap = box.snapshot()                                   # doctest: +SKIP
        >>> box.sh("echo hi > /root/new.txt && rm /etc/motd")      # doctest: +SKIP
        >>> print(box.diff(snap).summary())                         # doctest: +SKIP
        D /etc/motd  +0 -5
        A /root/new.txt  +1 -0
        2 changes (1 added, 1 deleted), +1 -5 lines, from snapshot ... to box now
        """
        if isinstance(paths, str):
            paths = [paths]
        found = await self._op(
            "diff", a=side_arg(a), b=side_arg(b), paths=list(paths) if paths else None, text_limit=text_limit
        )
        return Diff.from_json(found)

    # -- the flight recorder -------------------------------------------------------------------

    async def record(
        self,
        on: bool = True,
        *,
        every: float = 0.0,
        keep_last: int | None = None,
        keep_for: float | None = None,
    ) -> dict[str, Any] | None:
        """Record every step taken in the box from now on, each with a checkpoint of the
        state it left (docs/recorder.md): an exec, a spawned process once it ends, a code
        cell, a file operation, a tool call. The state now becomes the first step.
        ``every``: at most one checkpoint per that many seconds (the steps between are in
        the timeline without one); ``keep_last``, ``keep_for``: the checkpoints kept (a
        named step's are kept always). ``on=False`` stops recording; the timeline stays.
        Answers the policy in force (None once stopped).

        >>> box.record(keep_last=50)                           # doctest: +SKIP
        {'every': 0.0, 'keep_last': 50, 'keep_for': None}
        """
        found = await self._op("record", on=on, every=every, keep_last=keep_last, keep_for=keep_for)
        policy: dict[str, Any] | None = found.get("recording")
        return policy

    async def timeline(self, *, after: int = 0, limit: int | None = None) -> builtins.list[Step]:
        """The recorded steps after step ``after``, oldest first (at most ``limit``)."""
        found = await self._op("timeline", after=after, limit=limit)
        return [Step.from_json(s) for s in found["steps"]]

    async def step(self, step: int | str, *, diff: bool = False, text_limit: int | None = None) -> Step:
        """One recorded step, by its number or name; with ``diff``, what it changed in the
        box's files (its checkpoint against the one before it), in ``Step.diff``."""
        found = await self._op("step", step=str(step), diff=diff, text_limit=text_limit)
        return Step.from_json(found)

    async def name_step(self, step: int | str, name: str | None) -> Step:
        """Name a step (its checkpoint is then kept whatever the retention), or take its
        name back with None."""
        return Step.from_json(await self._op("name_step", step=str(step), name=name))

    async def rewind(self, step: int | str) -> None:
        """Take the box back, in place, to the state just after a recorded step: memory,
        processes and disk (a rollback to its checkpoint). Same id and name; commands
        running now end. While it records, the rewind is a step of its own."""
        await self._op("rewind", step=str(step))

    async def fork_at(
        self, step: int | str, n: int = 1, *, name: str | None = None
    ) -> builtins.list[AsyncBox]:
        """``n`` running boxes in the state just after a recorded step; this box goes on."""
        return [AsyncBox.bound(r) for r in await self._op("fork_at", step=str(step), n=n, name=name)]

    async def promote(self, child: AsyncBox | str | Any) -> AsyncSnapshot:
        """A box started from a state of this one (a fork, a fork at a step) takes its
        place: the child's memory, processes and disk move in under this box's id, name,
        published ports, preview URLs, volumes and lease, and the child is removed. What
        this box was is kept: the snapshot returned. For the fix that worked in one of two
        forks, made the box everybody already reaches.

        >>> a, b = box.fork_at(12, 2)                              # doctest: +SKIP
        >>> a.sh("apply fix A"); b.sh("apply fix B")               # doctest: +SKIP
        >>> old = box.promote(b)                                   # doctest: +SKIP
        """
        key = child if isinstance(child, str) else getattr(child, "id", None)  # a box of either API
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"promote takes a box or its id or name, not {child!r}")
        return AsyncSnapshot(await self._op("promote", child=key))

    async def bisect(
        self,
        test: str | Sequence[str],
        *,
        parallel: int = 4,
        timeout: float | None = 600.0,
        diff: bool = True,
        good: int | str | None = None,
    ) -> Bisection:
        """The first recorded step after which ``test`` fails: a search over the steps
        whose state is kept, running ``test`` (a shell line, or an argv) in a box forked
        at each step tried, ``parallel`` at once (each round splits what is left in
        ``parallel`` + 1), each fork removed after its test. The box itself is not
        touched. The answer names the step, the test's output there, and (``diff``) what
        the step changed in the files since the last step where the test passed.
        ``good``: a step (number or name) after which the test is known to pass; the
        search starts there (by default at the first step).

        >>> found = box.bisect("python3 -m pytest -q tests")     # doctest: +SKIP
        >>> print(found.first_bad)                                # doctest: +SKIP
          42  exec     sed -i s/x/y/ app.py  exit 0  0.180s  checkpoint
        """
        argv = ["/bin/sh", "-c", test] if isinstance(test, str) else [os.fspath(a) for a in test]
        if not argv or not all(isinstance(a, str) and a for a in argv):
            raise InvalidArgument(f"a test is a shell line or a non-empty argv, not {test!r}")
        if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 32:
            raise InvalidArgument(f"parallel must be a whole number in 1..32, not {parallel!r}")
        positive("timeout", timeout)
        steps = [s for s in await self.timeline() if s.kept]
        if good is not None:
            start = (await self.step(good)).seq
            steps = [s for s in steps if s.seq >= start]
        if not steps:
            raise StepNotFound(f"box {self.name} has no recorded step with a checkpoint kept: record() first")
        began = time.monotonic()
        results: dict[int, ExecResult] = {}

        async def run(i: int) -> None:
            (child,) = await self.fork_at(steps[i].seq, 1, name=f"{self.name[:40]}-bisect")
            try:
                results[i] = await child.exec(*argv, timeout=timeout)
            finally:
                await child.remove(force=True)

        def passes(i: int) -> bool:
            return results[i].exit_code == 0

        last = len(steps) - 1
        await asyncio.gather(*(run(i) for i in sorted({0, last})))
        rounds, lo, hi = 1, 0, last
        if passes(last) or not passes(0):
            lo, hi = (last, -1) if passes(last) else (-1, 0)
        while hi >= 0 and lo >= 0 and hi - lo > 1:
            tried = probes(lo, hi, parallel)
            await asyncio.gather(*(run(i) for i in tried))
            rounds += 1
            failing = [i for i in tried if not passes(i)]
            hi = failing[0] if failing else hi
            lo = max([lo, *(i for i in tried if i < hi and passes(i))])
        tested = {steps[i].seq: r.exit_code for i, r in sorted(results.items())}
        if hi < 0:  # it passes after the last step
            return Bisection(None, steps[last], None, "", "", None, tested, rounds, time.monotonic() - began)
        bad, passed = steps[hi], steps[lo] if lo >= 0 else None
        changed = None
        if diff and passed is not None:
            changed = await self.diff(f"snapshot:{passed.checkpoint}", f"snapshot:{bad.checkpoint}")
        r = results[hi]
        return Bisection(bad, passed, r.exit_code, r.stdout, r.stderr, changed, tested, rounds,
                         time.monotonic() - began)  # fmt: skip

    def as_step(self, kind: str, **what: Any) -> contextlib.AbstractAsyncContextManager[None]:
        """Everything done in the box inside the block is one step of its timeline, shown
        as ``kind`` with ``what`` (a tool call and its arguments): its commands and file
        writes are not steps of their own. On a box that does not record, or over a
        transport where each request is its own step, it groups nothing.

        >>> async with box.as_step("tool", tool="run_tests", arguments={"path": "tests"}):  # doctest: +SKIP
        ...     await box.exec("pytest", "-q", "tests")
        """
        return self._backend.as_step(self._ref, kind, what)

    async def suspend(self) -> None:
        """Write the running state to disk and end the VM: no CPU, no RAM. ``resume()``
        (from any process), ``start()``, or the next command brings it back."""
        await self._op("suspend")

    async def resume(self) -> None:
        """Bring a suspended box back with its processes; this process's open commands
        and streams carry on where they were."""
        await self._op("resume")

    def __repr__(self) -> str:
        where = "" if self.transport == "local" else f" via {self.transport}"
        ident = self._ref.id if self._ref.made else "new"
        return f"<{type(self).__name__} {self.name} ({ident}) {self.state}{where}>"


async def boxes_of(
    backend: Backend, *, all: bool = True, state: str | None = None, labels: Mapping[str, str] | None = None
) -> builtins.list[AsyncBox]:
    """The boxes a backend reaches, as ``AsyncBox.list`` gives them."""
    found = await backend.boxes(state=state, labels=dict(labels) if labels else None)
    if not all:
        found = [r for r in found if r.state in ("running", "paused")]
    return [AsyncBox.bound(r) for r in found]


class AsyncSnapshot:
    """A saved running state (async API): memory, devices and a frozen disk layer."""

    def __init__(self, ref: SnapshotRef) -> None:
        self._ref = ref

    @classmethod
    async def get(cls, key: str, *, home: Home = None) -> AsyncSnapshot:
        """A snapshot or template of this host's home by id, id prefix or name
        (SnapshotNotFound if none)."""
        return cls(await LocalBackend.for_home(home).find_snapshot(key))

    @classmethod
    async def list(
        cls, *, box: str | None = None, kind: str | None = None, home: Home = None
    ) -> builtins.list[AsyncSnapshot]:
        """Snapshots and templates of this host's home, oldest first (``box``: of that box)."""
        return [cls(r) for r in await LocalBackend.for_home(home).snapshot_list(box=box, kind=kind)]

    @property
    def ref(self) -> SnapshotRef:
        """What the backend knows of the snapshot (for front ends built on a backend)."""
        return self._ref

    @property
    def info(self) -> dict[str, Any]:
        """id, name, kind, box_id, box_name, created_at, size, logical_size and node (a fleet's)."""
        return dict(self._ref.info)

    @property
    def id(self) -> str:
        return self._ref.id

    @property
    def name(self) -> str | None:
        return self._ref.info.get("name")

    @property
    def kind(self) -> str:
        """ "snapshot" or "template"."""
        return str(self._ref.info.get("kind"))

    @property
    def box_id(self) -> str | None:
        return self._ref.info.get("box_id")

    @property
    def box_name(self) -> str | None:
        return self._ref.info.get("box_name")

    @property
    def created_at(self) -> float:
        return float(self._ref.info.get("created_at") or 0.0)

    @property
    def logical_size(self) -> int:
        """The bytes of state it holds (its memory that is not zeros, its devices' state,
        its disk layer's data) before sharing with other states and compression."""
        return int(self._ref.info.get("logical_size") or 0)

    @property
    def size(self) -> int:
        """The bytes its save added to its home: the chunks of its memory and devices that
        no earlier state held (compressed), its disk layer, and (a template, a fork's
        state, an export's) the memory file that forks map (docs/storage.md)."""
        return int(self._ref.info.get("size") or 0)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Snapshot {self.id}{label} of {self.box_name}>"

    async def _op(self, operation: str, /, **args: Any) -> Any:
        return await self._ref.backend.call("snapshot", operation, self._ref, args)

    async def inspect(self) -> dict[str, Any]:
        """Everything about the snapshot, and the boxes started from it."""
        found: dict[str, Any] = await self._op("inspect")
        return found

    async def start(self, n: int = 1, *, name: str | None = None, **options: Any) -> builtins.list[AsyncBox]:
        """Start ``n`` boxes from this state, processes running. They share unchanged
        memory copy-on-write and each has its own disk layer, hostname, machine-id,
        RNG state and wall clock. ``name``: the box's name if ``n`` is 1, else the
        prefix of their names; ``options``: env, labels, workdir, user,
        idle_timeout, request_timeout, network and allow for each (as for ``AsyncBox``)."""
        return [AsyncBox.bound(r) for r in await self._op("start", n=n, name=name, **options)]

    async def export(self, path: str | os.PathLike[str], *, since: AsyncSnapshot | str | Any = None) -> Path:
        """Write this snapshot to one file (zstd tar) that ``sandlot.import_snapshot``
        starts elsewhere. Written under a temporary name and renamed when complete.
        ``since``: an earlier snapshot of the same box (the object, its id or its name):
        the archive then carries only the chunks and disk layers that one has not, and
        the home that imports it must have imported that one first (docs/storage.md)."""
        backend = self._ref.backend
        base = None if since is None else await backend.find_snapshot(snapshot_key(since))
        return await backend.export(self._ref, Path(path), base)

    async def remove(self) -> None:
        """Delete the snapshot; refused (SnapshotInUse) while boxes started from it exist.
        A template's warm pool goes first (its VMs are no boxes yet)."""
        await self._op("remove")
