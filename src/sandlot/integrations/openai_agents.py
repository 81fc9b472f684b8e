"""sandlot as a sandbox of the OpenAI Agents SDK (``agents.sandbox``).

``SandlotSandboxClient`` makes each SDK session one sandlot box, however the box is
reached: this host's home (the default, or ``home=``), a ``sandlot serve`` (a URL, or a
``sandlot.connect`` client) or a fleet (``sandlot.fleet.connect()``), since every one of
them is the same ``AsyncBox``. The session's commands, files, terminals and ports are
the box's own calls; what the SDK persists to pause a session and hydrates to resume it
is the box's live state (a snapshot, or the box suspended), never a tar of its files,
so a resumed session finds the processes it started still running.

    from agents import Runner, RunConfig
    from agents.run_config import SandboxRunConfig
    from sandlot.integrations.openai_agents import SandlotSandboxClient, SandlotSandboxClientOptions

    run_config = RunConfig(sandbox=SandboxRunConfig(
        client=SandlotSandboxClient(), options=SandlotSandboxClientOptions(image="python:3.12-slim")))

Requires ``pip install 'sandlot[openai-agents]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import posixpath
import shlex
import stat
import tarfile
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

try:
    from agents.sandbox.errors import (
        ExecTimeoutError,
        ExecTransportError,
        ExposedPortUnavailableError,
        PtySessionNotFoundError,
        WorkspaceArchiveReadError,
        WorkspaceArchiveWriteError,
        WorkspaceReadNotFoundError,
        WorkspaceStartError,
        WorkspaceWriteTypeError,
    )
    from agents.sandbox.files import EntryKind, FileEntry
    from agents.sandbox.manifest import Manifest
    from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
    from agents.sandbox.session.dependencies import Dependencies
    from agents.sandbox.session.manager import Instrumentation
    from agents.sandbox.session.pty_types import (
        PTY_PROCESSES_MAX,
        PtyExecUpdate,
        allocate_pty_process_id,
        clamp_pty_yield_time_ms,
        process_id_to_prune_from_meta,
        resolve_pty_write_yield_time_ms,
    )
    from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
    from agents.sandbox.session.sandbox_session import SandboxSession
    from agents.sandbox.session.sandbox_session_state import SandboxSessionState
    from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
    from agents.sandbox.types import ExecResult as SdkExecResult
    from agents.sandbox.types import ExposedPortEndpoint, Permissions, User
except ImportError as e:  # pragma: no cover - the extra not installed
    raise ImportError(
        "sandlot.integrations.openai_agents needs the OpenAI Agents SDK: pip install 'sandlot[openai-agents]'"
    ) from e

from pydantic import ValidationError

from ..api.backend import Backend
from ..api.box import AsyncBox, AsyncSnapshot
from ..api.client import AsyncClient
from ..api.local import LocalBackend
from ..api.process import AsyncProcess
from ..errors import (
    BoxNotFound,
    ExecTimeout,
    InvalidArgument,
    NotFound,
    SandlotError,
    SnapshotInUse,
    SnapshotNotFound,
)
from ..net.secrets import Secret

__all__ = [
    "SandlotSandboxClient",
    "SandlotSandboxClientOptions",
    "SandlotSandboxSession",
    "SandlotSandboxSessionState",
]

BACKEND_ID = "sandlot"
DEFAULT_IMAGE = "python:3.12-slim"
OnExit = Literal["remove", "suspend", "keep"]
ON_EXIT = ("remove", "suspend", "keep")
# What persist_workspace hands the SDK's snapshot store: a reference to a saved state of
# the box (its memory, processes and disk), told from a portable tar by this first line.
REF_MAGIC = b"sandlot-live-state/1\n"
# The SDK's shell tool waits this long for a command's first output unless told otherwise.
DEFAULT_YIELD_MS = 10_000
WRITE_YIELD_MS = 250


class SandlotSandboxClientOptions(BaseSandboxClientOptions):
    """The box a new session gets; JSON round-trips as the SDK's options do.

    ``image`` (or ``template``: a sandlot template or snapshot, by name or id), and the
    box's ``env``, ``user``, ``memory_mib``, ``cpus``, ``disk_size_gb``, ``network``,
    ``allow``, ``labels`` and ``idle_timeout`` as ``sandlot.Box`` takes them.
    ``exposed_ports``: ports in the box the session can resolve to an address on the
    host (``resolve_exposed_port``). ``on_exit``: what the session's end does to the
    box: ``"remove"`` it, ``"suspend"`` it (memory, processes and disk kept on the host,
    no VM; the session's state resumes it, from any process), or ``"keep"`` it running.
    """

    type: Literal["sandlot"] = "sandlot"
    image: str | None = None
    template: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None
    memory_mib: int | None = None
    cpus: int | None = None
    disk_size_gb: int | None = None
    network: str | None = None
    allow: tuple[str, ...] = ()
    labels: dict[str, str] | None = None
    idle_timeout: float | None = None
    exposed_ports: tuple[int, ...] = ()
    on_exit: OnExit = "remove"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except ValidationError as e:
            raise InvalidArgument(f"SandlotSandboxClientOptions: {problems_of(e)}") from None
        except TypeError as e:
            raise InvalidArgument(f"SandlotSandboxClientOptions: {e}") from None
        check_options(self)

    def box_options(self) -> dict[str, Any]:
        """The keyword arguments of the box these options describe (``AsyncClient.create``)."""
        given: dict[str, Any] = {
            "env": self.env, "user": self.user, "memory_mib": self.memory_mib, "cpus": self.cpus,
            "disk_size_gb": self.disk_size_gb, "network": self.network, "allow": list(self.allow) or None,
            "labels": self.labels, "idle_timeout": self.idle_timeout, "template": self.template,
        }  # fmt: skip
        return {k: v for k, v in given.items() if v is not None}


def problems_of(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'options'}: {err['msg']}" for err in error.errors()
    )


def check_options(options: object) -> SandlotSandboxClientOptions:
    """The options, checked beyond their types; InvalidArgument names the first problem."""
    if not isinstance(options, SandlotSandboxClientOptions):
        raise InvalidArgument(
            f"SandlotSandboxClient takes SandlotSandboxClientOptions, not {type(options).__name__}"
        )
    if options.image is not None and options.template is not None:
        raise InvalidArgument("give image or template, not both: a template fixes the image")
    for name in ("image", "template", "user", "network"):
        value = getattr(options, name)
        if value is not None and not value.strip():
            raise InvalidArgument(f"{name} must not be empty")
    seen: set[int] = set()
    for port in options.exposed_ports:
        if isinstance(port, bool) or not 1 <= port <= 65535:
            raise InvalidArgument(f"exposed_ports: {port!r} is not a TCP port (1 to 65535)")
        if port in seen:
            raise InvalidArgument(f"exposed_ports: {port} is given twice")
        seen.add(port)
    if options.on_exit not in ON_EXIT:
        raise InvalidArgument(f"on_exit is one of {', '.join(ON_EXIT)}, not {options.on_exit!r}")
    if options.idle_timeout is not None and options.idle_timeout <= 0:
        raise InvalidArgument(f"idle_timeout must be positive, not {options.idle_timeout}")
    return options


class SandlotSandboxSessionState(SandboxSessionState):
    """What the SDK keeps of a session between processes: the box, the options it was
    made with, and the last saved state of it (``live_snapshot_id``) that the session
    persisted, from which it is started again if the box itself is gone."""

    type: Literal["sandlot"] = "sandlot"
    box_id: str
    options: SandlotSandboxClientOptions
    live_snapshot_id: str | None = None


def encode_ref(snapshot_id: str, box_id: str) -> bytes:
    return REF_MAGIC + json.dumps({"snapshot": snapshot_id, "box": box_id}).encode()


def decode_ref(raw: bytes) -> str | None:
    """The snapshot a persisted payload names, or None for a portable tar."""
    if not raw.startswith(REF_MAGIC):
        return None
    try:
        body = json.loads(raw[len(REF_MAGIC) :])
    except ValueError:
        return None
    snap = body.get("snapshot") if isinstance(body, dict) else None
    return snap if isinstance(snap, str) and snap else None


def user_name(user: str | User | None) -> str | None:
    return user.name if isinstance(user, User) else user


def shell_command(command: Sequence[str | Path], shell: bool | list[str]) -> list[str]:
    """The command as the SDK's shell option wants it run (``sh -lc`` by default)."""
    argv = [str(c) for c in command]
    if not shell:
        return argv
    joined = argv[0] if len(argv) == 1 else shlex.join(argv)
    return [*shell, joined] if isinstance(shell, list) else ["sh", "-lc", joined]


def as_user(command: Sequence[str]) -> tuple[list[str], str | None]:
    """The SDK asks for another user with a ``sudo -u USER --`` prefix; a box runs a
    command as any user itself, with no sudo in the image."""
    argv = list(command)
    if len(argv) >= 4 and argv[0] == "sudo" and argv[1] == "-u" and argv[3] == "--":
        return argv[4:], argv[2]
    return argv, None


@dataclass
class Running:
    """A command the model's shell tool started and polls (``write_stdin``)."""

    process: AsyncProcess
    tty: bool
    chunks: deque[bytes] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    last_used: float = field(default_factory=time.monotonic)
    exit_code: int | None = None
    pump: asyncio.Task[None] | None = None


class SandlotSandboxSession(BaseSandboxSession):
    """One SDK session over one box. ``box`` is the box itself (an ``AsyncBox``): what
    the SDK does not ask for (``fork``, ``snapshot``, ``rollback``, ``diff``,
    ``run_code``...) is there."""

    state: SandlotSandboxSessionState

    def __init__(
        self,
        *,
        state: SandlotSandboxSessionState,
        box: AsyncBox,
        client: AsyncClient,
        secrets: Sequence[Secret] = (),
        live: bool = False,
    ) -> None:
        self.state = state
        self.box = box
        self.client = client
        self.secrets = list(secrets)
        # the box holds the state the session persisted last (reattached, or started
        # from that state): nothing to restore into it
        self.live = live
        self.root_ready = state.workspace_root_ready
        self.running_processes: dict[int, Running] = {}
        self.reserved_ids: set[int] = set()
        self.pty_lock = asyncio.Lock()

    # -- the box's life ------------------------------------------------------------------------

    def _set_start_state_preserved(self, workspace: bool, *, system: bool | None = None) -> None:
        super()._set_start_state_preserved(workspace, system=system)

    async def _ensure_backend_started(self) -> None:
        try:
            state = await self.box.refresh()
            if state == "suspended":
                await self.box.resume()
            elif state == "paused":
                await self.box.unpause()
            elif state != "running":
                await self.box.start()
        except SandlotError as e:
            raise WorkspaceStartError(
                path=Path(self.state.manifest.root), context={"box": self.box.id}, cause=e,
                message=f"box {self.box.name} did not start: {e}",
            ) from e  # fmt: skip

    async def _prepare_backend_workspace(self) -> None:
        root = self.state.manifest.root
        try:
            await self.box.files.mkdir(root, parents=True)
        except SandlotError as e:
            raise WorkspaceStartError(path=Path(root), cause=e) from e
        self.root_ready = True

    def _should_compute_snapshot_fingerprint_on_persist(self) -> bool:
        # the persisted state is the box's own, saved whole: no tar of the files to fingerprint
        return False

    async def _can_skip_snapshot_restore_on_resume(self, *, is_running: bool) -> bool:
        return is_running and self.live

    async def running(self) -> bool:
        try:
            return await self.box.refresh() == "running"
        except SandlotError:
            return False

    async def _shutdown_backend(self) -> None:
        on_exit = self.state.options.on_exit
        try:
            if on_exit == "suspend":
                await self.box.suspend()
            elif on_exit == "remove":
                await self.box.remove(force=True)
        except BoxNotFound:
            pass

    # -- commands --------------------------------------------------------------------------------

    async def env(self) -> dict[str, str]:
        return dict(await self.state.manifest.environment.resolve())

    def cwd(self) -> str | None:
        return self.state.manifest.root if self.root_ready else None

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> SdkExecResult:
        argv, user = as_user([str(c) for c in command])
        if not argv:
            raise ExecTransportError(command=command, message="an empty command")
        if timeout is not None:
            timeout = max(float(timeout), 0.001)  # the SDK may pass 0; a box wants a positive one
        try:
            result = await self.box.exec(*argv, env=await self.env(), cwd=self.cwd(), user=user,
                                         timeout=timeout)  # fmt: skip
        except ExecTimeout as e:
            raise ExecTimeoutError(command=command, timeout_s=timeout, cause=e) from e
        except FileNotFoundError as e:  # no such program: what a shell answers
            return SdkExecResult(stdout=b"", stderr=f"{argv[0]}: {e}\n".encode(), exit_code=127)
        except SandlotError as e:
            raise ExecTransportError(
                command=command, cause=e, message=f"exec in box {self.box.name}: {e}"
            ) from e
        return SdkExecResult(
            stdout=result.stdout_bytes, stderr=result.stderr_bytes, exit_code=result.exit_code
        )

    def supports_pty(self) -> bool:
        return True

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        argv, as_whom = shell_command(command, shell), user_name(user)
        try:
            process = await self.box.spawn(*argv, env=await self.env(), cwd=self.cwd(), user=as_whom,
                                           tty=tty, stdin=tty)  # fmt: skip
        except FileNotFoundError as e:
            return PtyExecUpdate(process_id=None, output=f"{argv[0]}: {e}\n".encode(), exit_code=127,
                                 original_token_count=None)  # fmt: skip
        except SandlotError as e:
            raise ExecTransportError(
                command=command, cause=e, message=f"spawn in box {self.box.name}: {e}"
            ) from e
        entry = Running(process=process, tty=tty)
        entry.pump = asyncio.ensure_future(self.pump(entry, timeout))
        async with self.pty_lock:
            pid = allocate_pty_process_id(self.reserved_ids)
            self.reserved_ids.add(pid)
            pruned = self.prune()
            self.running_processes[pid] = entry
        if pruned is not None:
            await self.end(pruned)
        wait_ms = DEFAULT_YIELD_MS if yield_time_s is None else int(yield_time_s * 1000)
        return await self.update(pid, entry, clamp_pty_yield_time_ms(wait_ms), max_output_tokens)

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        async with self.pty_lock:
            entry = self.running_processes.get(session_id)
        if entry is None:
            raise PtySessionNotFoundError(session_id=session_id)
        if chars:
            if not entry.tty:
                raise InvalidArgument("stdin is not available for this process: it was started without a tty")
            await entry.process.write_stdin(chars.encode())
        wait_ms = WRITE_YIELD_MS if yield_time_s is None else int(yield_time_s * 1000)
        entry.last_used = time.monotonic()
        wait_ms = resolve_pty_write_yield_time_ms(yield_time_ms=wait_ms, input_empty=chars == "")
        return await self.update(session_id, entry, wait_ms, max_output_tokens)

    async def pty_terminate_all(self) -> None:
        async with self.pty_lock:
            entries = list(self.running_processes.values())
            self.running_processes.clear()
            self.reserved_ids.clear()
        for entry in entries:
            await self.end(entry)

    async def pump(self, entry: Running, timeout: float | None) -> None:
        """The process's output into its entry as it comes, then its exit."""

        async def copy(stream: Any) -> None:
            async for chunk in stream:
                async with entry.lock:
                    entry.chunks.append(bytes(chunk))
                entry.notify.set()

        try:
            streams = asyncio.gather(copy(entry.process.stdout), copy(entry.process.stderr))
            await (asyncio.wait_for(streams, timeout) if timeout else streams)
            entry.exit_code = await entry.process.wait()
        except (TimeoutError, ExecTimeout):
            await self.kill(entry)
            entry.exit_code = 124
        except SandlotError:
            entry.exit_code = entry.process.returncode if entry.process.returncode is not None else 1
        finally:
            entry.closed.set()
            entry.notify.set()

    async def update(self, pid: int, entry: Running, wait_ms: int, max_tokens: int | None) -> PtyExecUpdate:
        from agents.sandbox.session.pty_output import collect_pty_output

        output, tokens, closed = await collect_pty_output(
            output_chunks=entry.chunks, output_lock=entry.lock, output_notify=entry.notify,
            is_done=entry.closed.is_set, yield_time_ms=wait_ms, max_output_tokens=max_tokens,
        )  # fmt: skip
        if closed and entry.exit_code is not None:
            async with self.pty_lock:
                self.running_processes.pop(pid, None)
                self.reserved_ids.discard(pid)
            return PtyExecUpdate(process_id=None, output=output, exit_code=entry.exit_code,
                                 original_token_count=tokens)  # fmt: skip
        return PtyExecUpdate(process_id=pid, output=output, exit_code=None, original_token_count=tokens)

    def prune(self) -> Running | None:
        if len(self.running_processes) < PTY_PROCESSES_MAX:
            return None
        meta = [(pid, e.last_used, e.closed.is_set()) for pid, e in self.running_processes.items()]
        pid = process_id_to_prune_from_meta(meta)
        if pid is None:
            return None
        self.reserved_ids.discard(pid)
        return self.running_processes.pop(pid, None)

    async def kill(self, entry: Running) -> None:
        if entry.process.returncode is None:
            with contextlib.suppress(SandlotError):
                await entry.process.kill()

    async def end(self, entry: Running) -> None:
        await self.kill(entry)
        if entry.pump is not None:
            entry.pump.cancel()
            await asyncio.gather(entry.pump, return_exceptions=True)

    # -- files -------------------------------------------------------------------------------------

    async def check_as(self, test: str, path: Path, user: str | User | None) -> None:
        """What ``user`` may do with ``path``, asked in the box as that user: the box's file
        calls run as root."""
        if user is None:
            return
        result = await self.exec("sh", "-c", test, "sh", str(path), shell=False, user=user)
        if not result.ok():
            raise WorkspaceArchiveWriteError(
                path=path, message=f"user {user_name(user)} may not do that to {path}",
                context={"user": user_name(user), "stderr": result.stderr.decode(errors="replace")},
            )  # fmt: skip

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        target = self.normalize_path(path)
        await self.check_as('[ -r "$1" ]', target, user)
        with reading(path):
            data = await self.box.files.read(target.as_posix())
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode()
        if not isinstance(payload, bytes | bytearray):
            raise WorkspaceWriteTypeError(path=path, actual_type=type(payload).__name__)
        target = self.normalize_path(path, for_write=True)
        await self.check_as(_WRITABLE, target, user)
        try:
            await self.box.files.write(target.as_posix(), bytes(payload), user=user_name(user))
        except SandlotError as e:
            raise WorkspaceArchiveWriteError(path=target, cause=e) from e

    async def mkdir(self, path: Path | str, *, parents: bool = False, user: str | User | None = None) -> None:
        target = self.normalize_path(path, for_write=True)
        await self.check_as(_MAKEABLE, target, user)
        try:
            await self.box.files.mkdir(target.as_posix(), parents=parents, user=user_name(user))
        except SandlotError as e:
            raise WorkspaceArchiveWriteError(path=target, cause=e) from e

    async def rm(self, path: Path | str, *, recursive: bool = False, user: str | User | None = None) -> None:
        target = self.normalize_path(path, for_write=True)
        await self.check_as('[ -w "$(dirname "$1")" ]', target, user)
        try:
            await self.box.files.remove(target.as_posix(), recursive=recursive, missing_ok=recursive)
        except SandlotError as e:
            raise WorkspaceArchiveWriteError(path=target, cause=e) from e

    async def mv(
        self, source: Path | str, destination: Path | str, *, user: str | User | None = None
    ) -> None:
        src = self.normalize_path(source, for_write=True)
        dst = self.normalize_path(destination, for_write=True)
        await self.check_as('[ -w "$(dirname "$1")" ]', src, user)
        try:
            info = await self.box.files.stat(src.as_posix(), follow_symlinks=False)
            if info.type not in ("file", "symlink"):
                raise WorkspaceArchiveWriteError(path=src, message=f"{src} is not a regular file or symlink")
            await self.box.files.rename(src.as_posix(), dst.as_posix())
        except SandlotError as e:
            raise WorkspaceArchiveWriteError(path=src, cause=e) from e

    async def ls(self, path: Path | str, *, user: str | User | None = None) -> list[FileEntry]:
        target = self.normalize_path(path)
        await self.check_as('[ -r "$1" ] && [ -x "$1" ]', target, user)
        with reading(target):
            found = await self.box.files.list(target.as_posix())
        kinds = {"file": EntryKind.FILE, "dir": EntryKind.DIRECTORY, "symlink": EntryKind.SYMLINK}
        return [
            FileEntry(
                path=posixpath.join(target.as_posix(), f.name), size=f.size,
                owner=str(f.uid), group=str(f.gid),
                permissions=Permissions.from_mode(f.mode | (stat.S_IFDIR if f.type == "dir" else 0)),
                kind=kinds.get(f.type, EntryKind.OTHER),
            )
            for f in found
        ]  # fmt: skip

    # -- ports -------------------------------------------------------------------------------------

    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        try:
            if self.box.transport == "http":
                # a server's box: the server's signed URL to the port's own host (an endpoint
                # is a host and a query, no path: a server without --port-domain has none)
                url = urlsplit(await self.box.preview_url(port, at_host=True))
                tls = url.scheme == "https"
                return ExposedPortEndpoint(host=url.hostname or "", port=url.port or (443 if tls else 80),
                                           tls=tls, query=url.query)  # fmt: skip
            address, host_port = await self.box.port(port)
        except SandlotError as e:
            raise ExposedPortUnavailableError(
                port=port, exposed_ports=self.state.exposed_ports, reason="backend_unavailable",
                context={"backend": BACKEND_ID, "detail": str(e)}, cause=e,
            ) from e  # fmt: skip
        return ExposedPortEndpoint(
            host="127.0.0.1" if address in ("", "0.0.0.0") else address, port=host_port
        )

    # -- live state: what the SDK persists to pause a session and hydrates to resume it ------------

    async def persist_workspace(self) -> io.IOBase:
        """A saved state of the whole box (memory, processes, disk), named by reference."""
        try:
            snap = await self.box.snapshot()
        except SandlotError as e:
            raise WorkspaceArchiveReadError(path=Path(self.state.manifest.root), cause=e,
                                            context={"box": self.box.id}) from e  # fmt: skip
        earlier, self.state.live_snapshot_id = self.state.live_snapshot_id, snap.id
        if earlier is not None and earlier != snap.id:
            await self.drop_snapshot(earlier)
        self.live = True
        return io.BytesIO(encode_ref(snap.id, self.box.id))

    async def drop_snapshot(self, key: str) -> None:
        """An earlier state this session saved, no longer the one it resumes from."""
        # gone already, or boxes were started from it: theirs now
        with contextlib.suppress(SnapshotNotFound, SnapshotInUse):
            await (await self.client.get_snapshot(key)).remove()

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        raw = data.read()
        if isinstance(raw, str):
            raw = raw.encode()
        if not isinstance(raw, bytes | bytearray):
            raise WorkspaceWriteTypeError(path=Path(self.state.manifest.root), actual_type=type(raw).__name__)
        key = decode_ref(bytes(raw))
        if key is not None:
            await self.restore_live(key)
        else:
            await self.unpack(bytes(raw))

    async def restore_live(self, key: str) -> None:
        """The box as the saved state has it: its own state rolled back, or, where the state
        is another box's, a box started from it in this one's place."""
        root = Path(self.state.manifest.root)
        try:
            snap = await self.client.get_snapshot(key)
            if snap.box_id == self.box.id:
                await self.box.rollback(snap)
            else:
                old, self.box = self.box, await start_from(snap, self.state.options, self.secrets)
                self.state.box_id = self.box.id
                with contextlib.suppress(NotFound):
                    await old.remove(force=True)
        except SandlotError as e:
            raise WorkspaceArchiveWriteError(path=root, cause=e, message=f"restoring saved state {key}: {e}",
                                             context={"snapshot": key}) from e  # fmt: skip
        self.state.live_snapshot_id = key
        self.live = True
        self.root_ready = True

    async def unpack(self, raw: bytes) -> None:
        """A portable tar (another backend's workspace) into the workspace: unpacked on this
        host with tarfile's ``data`` filter (no links out, no devices), then sent as a tree."""
        root = Path(self.state.manifest.root)
        with tempfile.TemporaryDirectory(prefix="sandlot-hydrate-") as tmp:
            try:
                with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                    tar.extractall(tmp, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise WorkspaceArchiveWriteError(
                    path=root, cause=e, context={"reason": "unsafe_or_invalid_tar"},
                    message=f"not a workspace tar: {e}",
                ) from e  # fmt: skip
            try:
                await self.box.files.upload(tmp, root.as_posix())
            except SandlotError as e:
                raise WorkspaceArchiveWriteError(path=root, cause=e) from e


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """A box's errors in reading ``path``, as the SDK's."""
    try:
        yield
    except FileNotFoundError as e:
        raise WorkspaceReadNotFoundError(path=path, cause=e) from e
    except SandlotError as e:
        raise WorkspaceArchiveReadError(path=path, cause=e) from e


_WRITABLE = (
    'if [ -e "$1" ]; then [ -f "$1" ] && [ -w "$1" ]; exit; fi; '
    'p=$(dirname "$1"); while [ ! -e "$p" ]; do p=$(dirname "$p"); done; [ -d "$p" ] && [ -w "$p" ]'
)
_MAKEABLE = (
    'if [ -e "$1" ]; then [ -d "$1" ]; exit; fi; '
    'p=$(dirname "$1"); while [ ! -e "$p" ]; do p=$(dirname "$p"); done; [ -d "$p" ] && [ -w "$p" ]'
)


async def start_from(
    snap: AsyncSnapshot, options: SandlotSandboxClientOptions, secrets: Sequence[Secret]
) -> AsyncBox:
    """A box from a saved state, with what the state does not carry: its host ports and
    secrets' values."""
    extra: dict[str, Any] = {"labels": options.labels} if options.labels else {}
    if options.exposed_ports:
        extra["ports"] = [f"0:{p}" for p in options.exposed_ports]
    if secrets:
        extra["secrets"] = list(secrets)
    [box] = await snap.start(**extra)
    return box


def client_of(target: object, home: str | os.PathLike[str] | None, api_key: str | None) -> AsyncClient:
    """The boxes a target names, as one ``AsyncClient``: this host's home, a server (URL
    or client) or a fleet."""
    if target is None:
        if api_key is not None:
            raise InvalidArgument("api_key is for a server: give its URL as target")
        return AsyncClient.over(LocalBackend.for_home(home))
    if home is not None:
        raise InvalidArgument("home names this host's boxes; a server or fleet target has its own")
    if isinstance(target, str):
        if not target.startswith(("http://", "https://")):
            raise InvalidArgument(f"target {target!r} is not a server's URL (http:// or https://)")
        return AsyncClient(target, api_key)
    if api_key is not None:
        raise InvalidArgument("api_key goes with a server's URL, not with a client or fleet")
    aio = getattr(type(target), "aio", None)
    if isinstance(aio, property):  # a sync Client: its async twin
        target = target.aio  # type: ignore[attr-defined]
    if isinstance(target, AsyncClient):
        return target
    backend = getattr(target, "backend", None)
    if isinstance(backend, Backend):  # a fleet
        return AsyncClient.over(backend)
    raise InvalidArgument(
        "target is a sandlot client, a fleet or a server's URL (None: this host's boxes), "
        f"not {type(target).__name__}"
    )


class SandlotSandboxClient(BaseSandboxClient[SandlotSandboxClientOptions]):
    """Sessions of the OpenAI Agents SDK in sandlot boxes.

    ``target``: where the boxes are: None (this host's home, ``home=`` or
    ``$SANDLOT_HOME``), a ``sandlot serve`` URL (with ``api_key``, else
    ``$SANDLOT_API_KEY``), a client (``sandlot.connect``) or a fleet
    (``sandlot.fleet.connect()``). ``secrets``: ``sandlot.Secret`` values every box
    uses without holding them (swapped in on the host by the egress proxy for their
    hosts); they stay in this object, never in the session's serialized state.
    """

    backend_id = BACKEND_ID
    supports_default_options = True

    def __init__(
        self,
        target: object = None,
        *,
        home: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        secrets: Sequence[Secret] = (),
        instrumentation: Instrumentation | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        self.client = client_of(target, home, api_key)
        for s in secrets:
            if not isinstance(s, Secret):
                raise InvalidArgument(f"secrets are sandlot.Secret objects, not {type(s).__name__}")
        self.secrets = list(secrets)
        self.instrumentation = instrumentation if instrumentation is not None else Instrumentation()
        self._dependencies = dependencies

    def _wrap_session(
        self, inner: BaseSandboxSession, *, instrumentation: Instrumentation | None = None
    ) -> SandboxSession:
        return super()._wrap_session(inner, instrumentation=instrumentation)

    async def new_box(self, options: SandlotSandboxClientOptions) -> AsyncBox:
        kwargs = options.box_options()
        if options.exposed_ports:
            kwargs["ports"] = [f"0:{p}" for p in options.exposed_ports]
            # a published port needs a network card; "allowlist" with nothing allowed has one
            # and lets nothing out
            kwargs.setdefault("network", "allowlist")
        if self.secrets:
            kwargs["secrets"] = self.secrets
        image = None if options.template else options.image or DEFAULT_IMAGE
        return await self.client.create(image, **kwargs)

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: SandlotSandboxClientOptions | None = None,
    ) -> SandboxSession:
        """A new session in a new box (made now; it boots as the session starts)."""
        options = check_options(options if options is not None else SandlotSandboxClientOptions())
        if manifest is not None and not isinstance(manifest, Manifest):
            raise InvalidArgument(f"manifest is an agents.sandbox.Manifest, not {type(manifest).__name__}")
        manifest = self._validate_manifest_for_create(manifest if manifest is not None else Manifest())
        box = await self.new_box(options)
        session_id = uuid.uuid4()
        state = SandlotSandboxSessionState(
            session_id=session_id, manifest=manifest, snapshot=resolve_snapshot(snapshot, str(session_id)),
            box_id=box.id, options=options, exposed_ports=options.exposed_ports,
        )  # fmt: skip
        inner = SandlotSandboxSession(state=state, box=box, client=self.client, secrets=self.secrets)
        return self._wrap_session(inner, instrumentation=self.instrumentation)

    def _validate_manifest_for_create(self, manifest: Manifest) -> Manifest:
        checked: Manifest = super()._validate_manifest_for_create(manifest)
        return checked

    async def delete(self, session: SandboxSession) -> SandboxSession:
        """Nothing more to do: the session's shutdown did what ``on_exit`` says."""
        if not isinstance(session, SandboxSession):
            raise InvalidArgument(f"delete takes a SandboxSession, not {type(session).__name__}")
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """The session again: its box if it is still there (suspended, it resumes with its
        processes), else a box started from the last state the session persisted, else a
        new box that the SDK fills from its snapshot or manifest."""
        if not isinstance(state, SandlotSandboxSessionState):
            raise InvalidArgument(f"resume takes a SandlotSandboxSessionState, not {type(state).__name__}")
        state.assert_path_grants_rebound()
        check_options(state.options)
        box: AsyncBox | None = None
        live = False
        try:
            box = await self.client.get(state.box_id)
        except BoxNotFound:
            if state.live_snapshot_id is not None:
                try:
                    snap = await self.client.get_snapshot(state.live_snapshot_id)
                except SnapshotNotFound:
                    pass
                else:
                    box, live = await start_from(snap, state.options, self.secrets), True
        preserved = box is not None
        if box is None:
            box = await self.new_box(state.options)
            state.workspace_root_ready = False
        elif not live:
            # its own box: whatever it holds is at least as new as what the session persisted
            live = state.live_snapshot_id is not None
        state.box_id = box.id
        inner = SandlotSandboxSession(
            state=state, box=box, client=self.client, secrets=self.secrets, live=live
        )
        inner._set_start_state_preserved(preserved, system=preserved)
        return self._wrap_session(inner, instrumentation=self.instrumentation)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        if not isinstance(payload, dict):
            raise InvalidArgument(f"a session state payload is a dict, not {type(payload).__name__}")
        return self._deserialize_session_state_payload(payload, SandlotSandboxSessionState)

    @staticmethod
    def _deserialize_session_state_payload(
        payload: Mapping[str, object], state_class: type[SandboxSessionState]
    ) -> SandboxSessionState:
        state: SandboxSessionState = BaseSandboxClient._deserialize_session_state_payload(
            payload, state_class
        )
        return state

    async def box_of(self, session: SandboxSession | SandboxSessionState) -> AsyncBox:
        """The box of a session (or of its state): for what the SDK does not ask for, such as
        ``fork``, ``snapshot``, ``rollback`` or ``diff``."""
        state = session.state if isinstance(session, SandboxSession) else session
        if not isinstance(state, SandlotSandboxSessionState):
            raise InvalidArgument(f"not a sandlot session: {type(state).__name__}")
        return await self.client.get(state.box_id)

    async def fork(self, session: SandboxSession, n: int = 1) -> list[SandboxSession]:
        """``n`` new sessions, each in a copy of the session's running box (memory,
        processes, disk) made now; each is started already and removed at its end as the
        session's ``on_exit`` says."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n is a positive number of forks, not {n!r}")
        parent = await self.box_of(session)
        state = session.state
        assert isinstance(state, SandlotSandboxSessionState)
        out = []
        for child in await parent.fork(n):
            child_state = state.model_copy(deep=True, update={"session_id": uuid.uuid4()})
            child_state.box_id = child.id
            child_state.live_snapshot_id = None
            inner = SandlotSandboxSession(
                state=child_state, box=child, client=self.client, secrets=self.secrets
            )
            inner._set_start_state_preserved(True, system=True)
            out.append(self._wrap_session(inner, instrumentation=self.instrumentation))
        return out
