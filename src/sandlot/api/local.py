"""The local backend: boxes of a home of this host, run by the core in this process.

Every operation of ``api/contract.py``'s table is a method ``{scope}_{name}`` here,
which translates it into calls of the core (``core/``): the controller for the
lifecycle, live state for snapshots, forks and suspends, the agent session for
commands and files. A box's ``LocalBoxRef`` shares the core's ``BoxEntry`` with
every handle of the box in this process, so its state is what this process last
saw of it, without asking again.

``sandlot serve`` and a fleet node run these same methods for their clients
(``api/host.py``): what a box does is written here once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..config import tail
from ..core import diffs, events, metrics, snapshots, tracing, volumes
from ..core.controller import BoxController
from ..core.entry import BoxEntry, hostname_for
from ..core.options import REQUEST_OPTIONS
from ..core.requests import BoxRequest
from ..core.runtime import Runtime
from ..core.service import Core, core_for
from ..core.service import settle_recorders as service_settle_recorders
from ..core.sessions import Kept
from ..core.state import BoxState
from ..core.store import BoxRecord, BoxStore, SnapshotRecord, validate_name
from ..core.validate import check_env, check_user, guest_path, positive
from ..errors import BoxNotFound, GuestOSError, InvalidArgument, SnapshotNotFound
from ..protocol import archive as proto_archive
from ..protocol import files as proto
from ..protocol.exec import ExecRequest, RemoteProcess
from ..protocol.watch import WatchStream
from ..protocol.wire import FsFlag, FsOp
from . import port_hold
from .backend import Backend, BoxRef, Cell, Command, SnapshotRef, Write, narrowed
from .fs import AgentWatch, FileInfo, WatchSource, check_mode, check_prefix, check_xattrs, entry_info
from .process import AsyncProcess, ExecResult, feed_and_wait

if TYPE_CHECKING:
    from ..core.recorder import StepDraft
    from ..images.store import Image
    from .code import Callbacks, CodeContext, Execution, Interpreter

CONSOLE_TAIL = 256 * 1024  # bytes of the console read for its last lines
CONSOLE_POLL = 0.2  # seconds between two looks at a followed console that has nothing new
TREE_REMOVE_TIMEOUT = 600.0  # seconds for the agent to remove a tree (a recursive remove)
CODE_SHOWN = 16 * 1024  # characters of a code cell a recorded step keeps


async def settle_recorders() -> None:
    """The checkpoints of the steps this loop recorded, all taken: the CLI's commands and
    the sync API's exit wait for them, so that the last step of a program is kept."""
    await service_settle_recorders()


def command_step(cmd: Command, stdin: bytes | None) -> dict[str, Any]:
    """What a recorded step shows of a command: its argv, directory and user, and the
    names of the variables it set, never their values (secrets)."""
    what: dict[str, Any] = {"argv": list(cmd.argv)}
    if cmd.cwd is not None:
        what["cwd"] = cmd.cwd
    if cmd.user is not None:
        what["user"] = cmd.user
    if cmd.env:
        what["env"] = sorted(cmd.env)
    if stdin is not None:
        what["stdin_bytes"] = len(stdin)
    if cmd.tty:
        what["tty"] = True
    return what


def box_info(rec: BoxRecord, state: str | None = None, store: BoxStore | None = None) -> dict[str, Any]:
    """A box's record as every transport describes a box (``contract.BoxOut``); its
    sizes where the home's ``store`` is given."""
    opts = rec.options
    size, logical = snapshots.box_sizes(rec, store) if store is not None else (None, None)
    return {
        "id": rec.id,
        "name": rec.name,
        "state": state or str(rec.state),
        "image": rec.image_ref,
        "labels": dict(rec.labels),
        "created_at": rec.created_at,
        "started_at": rec.started_at,
        "memory_mib": opts.get("memory_mib"),
        "cpus": opts.get("cpus"),
        "disk_size_gb": opts.get("disk_size_gb"),
        "network": opts.get("network"),
        "hostname": opts.get("hostname") or hostname_for(rec.name),
        "engine": rec.engine,
        "accel": rec.boot.get("accel") or None,
        "origin": rec.origin,
        "reason": rec.reason,
        "size": size,
        "logical_size": logical,
        "node": None,
    }


def snapshot_info(rec: SnapshotRecord) -> dict[str, Any]:
    """A snapshot's record as every transport describes it (``contract.SnapshotOut``)."""
    return {
        "id": rec.id,
        "name": rec.name,
        "kind": rec.kind,
        "box_id": rec.box_id,
        "box_name": rec.box_name,
        "created_at": rec.created_at,
        "size": rec.size,
        "logical_size": int(rec.options.get("logical_bytes", rec.size)),
        "node": None,
    }


KEEPER_ASK_EVERY = 10.0  # seconds between two asks of the port keeper, by one process, for one box


class LocalBoxRef(BoxRef):
    """A box of this host's home: described (its ``BoxRequest``), or made (its entry)."""

    backend: LocalBackend

    def __init__(
        self,
        backend: LocalBackend,
        request: BoxRequest | None,
        entry: BoxEntry | None,
        core: Core | None = None,
    ) -> None:
        self.backend = backend
        self.request = request
        self.entry = entry
        self.core = core
        self.box_id = request.id if request is not None else entry.id if entry is not None else ""
        self.box_name = request.name if request is not None else entry.name if entry is not None else ""
        self.given_image: Image | None = request.image if request is not None else None
        self.claimed = False  # made from a warm pool's VM, running already (made_entry with claim)
        self.making = False  # a made_entry of this request has begun (on some loop)

    @property
    def runtime(self) -> Runtime:
        return self.backend.runtime

    @property
    def id(self) -> str:
        return self.box_id

    @property
    def name(self) -> str:
        return self.box_name

    @property
    def state(self) -> str:
        entry = self.entry
        if entry is None:
            return "new" if self.request is not None else "removed"
        return "removed" if entry.removed else str(entry.record.state)

    @property
    def info(self) -> dict[str, Any]:
        self.need_made()
        assert self.entry is not None
        return box_info(self.entry.record, self.state, self.runtime.store)

    @property
    def record(self) -> BoxRecord:
        """The core's record of the box (front ends on this host: the server, the box link)."""
        self.need_made()
        assert self.entry is not None
        return self.entry.record

    @property
    def image(self) -> Any:
        if self.given_image is not None:
            return self.given_image
        return self.entry.record.image_ref if self.entry is not None else None

    @property
    def hostname(self) -> str | None:
        if self.entry is not None:
            return self.entry.hostname
        assert self.request is not None
        return self.request.spec_for(None).hostname or hostname_for(self.name)

    @property
    def accel(self) -> str | None:
        return (self.entry.record.boot.get("accel") if self.entry else None) or None

    @property
    def boot_seconds(self) -> float | None:
        return self.entry.boot_seconds if self.entry else None

    @property
    def last_pause(self) -> float | None:
        return self.entry.last_pause if self.entry else None

    def image_config(self) -> dict[str, Any] | None:
        cfg = self.entry.spec.image_config if self.entry else None
        if cfg is None and self.given_image is not None:
            cfg = {
                "entrypoint": list(self.given_image.config.entrypoint),
                "cmd": list(self.given_image.config.cmd),
            }
        return cfg

    # -- the core of the running loop -------------------------------------------------------

    def here(self) -> tuple[Core, BoxEntry | None]:
        """The core of the running loop, and the box's entry there if it was seen."""
        core = core_for(self.runtime)
        if self.core is not core:
            self.core = core
            self.entry = core.entries.get(self.id)
        return core, self.entry

    async def made_entry(
        self, *, ephemeral: bool = False, claim: bool = False
    ) -> tuple[BoxController, BoxEntry]:
        """The controller and the box's entry, making the box first if it is new. ``claim``:
        it is about to start, so a ready VM of its template's warm pool may be it."""
        core, entry = self.here()
        if entry is not None and not entry.removed:
            return core.controller, entry
        request = self.request
        if request is None:  # a box found by id, seen before on another loop
            entry = await core.controller.find(self.id)
        else:
            # a new request's id names no row (no store round trip for it), unless another
            # loop began making this box
            entry = None
            if self.making:
                with contextlib.suppress(BoxNotFound):
                    entry = await core.controller.find(self.id)
            self.making = True
            if entry is None:
                claimed = await core.pools.claim(request, ephemeral=ephemeral) if claim else None
                if claimed is not None:
                    entry = claimed
                    self.box_id = entry.id  # the pool VM's row is the box's now
                    self.claimed = True
                else:
                    entry = await core.controller.create(request, ephemeral=ephemeral)
            self.request = None
        self.entry = entry
        return core.controller, entry

    async def existing(self) -> tuple[BoxController, BoxEntry]:
        if self.request is not None and self.entry is None:
            self.need_made()
        return await self.made_entry()

    async def live(self) -> tuple[Core, BoxEntry]:
        _, entry = await self.existing()
        return self.here()[0], entry


class LocalSnapshotRef(SnapshotRef):
    backend: LocalBackend

    def __init__(self, backend: LocalBackend, rec: SnapshotRecord) -> None:
        self.backend = backend
        self.record = rec

    @property
    def info(self) -> dict[str, Any]:
        return snapshot_info(self.record)


class LocalBackend(Backend):
    """Boxes of one home of this host."""

    transport: ClassVar[str] = "local"
    _by_home: ClassVar[dict[Path, LocalBackend]] = {}

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._kept: dict[str, float] = {}  # when this process last had the port keeper hold a box's ports

    @classmethod
    def for_home(cls, home: str | os.PathLike[str] | None = None) -> LocalBackend:
        rt = Runtime.for_home(home)
        found = cls._by_home.get(rt.home)
        if found is None or found.runtime is not rt:
            found = cls._by_home[rt.home] = cls(rt)
        return found

    def ref_of(self, core: Core, entry: BoxEntry) -> LocalBoxRef:
        return LocalBoxRef(self, None, entry, core)

    def core(self) -> Core:
        return core_for(self.runtime)

    # -- boxes ------------------------------------------------------------------------------

    def describe(self, image: Any, options: Mapping[str, Any], *, keep: bool) -> LocalBoxRef:
        opts = dict(options)
        template = template_arg(opts.pop("template", None))
        request_options = {k: opts.pop(k) for k in REQUEST_OPTIONS if k in opts}
        request = BoxRequest.build(image, opts, template=template, keep=keep, **request_options)
        return LocalBoxRef(self, request, None)

    async def create(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> None:
        box = local(ref)
        ctl, entry = await box.made_entry(ephemeral=ephemeral, claim=start)
        if not start:
            return
        try:
            await boot(box, ctl, entry)
        except BaseException:
            if ephemeral:  # the with block will not run its end: do its work
                with contextlib.suppress(Exception):
                    await ctl.remove(entry, force=True)
            raise

    async def release(self, ref: BoxRef) -> None:
        ctl, entry = await local(ref).existing()
        if not entry.removed:  # the session stays for other handles; idle, it gives its port back
            rec = await ctl.db.update(entry.id, ephemeral=False)
            if rec is not None:
                entry.update(rec)

    async def find(self, key: str) -> LocalBoxRef:
        core = self.core()
        entry = await core.controller.find(key)
        if entry.spec.wake_on_traffic and entry.record.state != BoxState.CREATED:
            # a keeper killed holds them no more: this call starts the next one
            now = asyncio.get_running_loop().time()
            if now - self._kept.get(entry.id, -KEEPER_ASK_EVERY) >= KEEPER_ASK_EVERY:
                await port_hold.ensure(core.controller, entry)
                self._kept[entry.id] = now
        return self.ref_of(core, entry)

    async def boxes(self, *, state: str | None, labels: Mapping[str, str] | None) -> list[BoxRef]:
        core = self.core()
        return [self.ref_of(core, e) for e in await core.controller.list(state=state, labels=labels)]

    async def call(self, scope: str, name: str, target: Any, args: dict[str, Any]) -> Any:
        method = getattr(self, f"{scope}_{name}", None)
        if method is None:
            raise InvalidArgument(f"a box has no operation {scope}.{name}")
        return await method(target, **args)

    # -- the box's operations ---------------------------------------------------------------

    async def box_refresh(self, ref: BoxRef) -> None:
        box = local(ref)
        if box.request is not None and box.entry is None:
            return
        try:
            ctl, entry = await box.made_entry()
            await ctl.refresh(entry)
        except BoxNotFound:
            if box.entry is not None:
                box.entry.removed = True
            else:
                box.request = None

    async def box_inspect(self, ref: BoxRef) -> dict[str, Any]:
        ctl, entry = await local(ref).existing()
        return await ctl.inspect(entry)

    async def box_stats(self, ref: BoxRef) -> dict[str, Any]:
        ctl, entry = await local(ref).existing()
        return await ctl.stats(entry)

    async def box_metrics(
        self, ref: BoxRef, since: float | None = None, limit: int | None = None
    ) -> list[Any]:
        since = events.since_time(since)
        positive("limit", limit, integer=True)
        _, entry = await local(ref).existing()
        found = await self.core().db.call(metrics.samples, entry.id, since=since, limit=limit or 10_000)
        return metrics.rates(found)

    async def box_logs(self, ref: BoxRef, lines: int | None = None) -> str:
        positive("lines", lines, integer=True)
        path = self.runtime.box_dir(ref.id) / "console.log"
        return await asyncio.to_thread(read_console, path, lines)

    async def follow_logs(self, ref: BoxRef, lines: int | None) -> AsyncIterator[bytes]:
        positive("lines", lines, integer=True)
        path = self.runtime.box_dir(ref.id) / "console.log"
        text, at = await asyncio.to_thread(console_from, path, lines)
        yield text
        while True:
            chunk, at = await asyncio.to_thread(console_from, path, None, at)
            if chunk:
                yield chunk
                continue
            await self.box_refresh(ref)
            if ref.state not in ("running", "paused"):
                return
            await asyncio.sleep(CONSOLE_POLL)

    async def box_start(self, ref: BoxRef) -> None:
        box = local(ref)
        await boot(box, *await box.made_entry(claim=True))

    async def box_stop(self, ref: BoxRef, timeout: float = 10.0) -> None:
        positive("timeout", timeout)
        ctl, entry = await local(ref).existing()
        await ctl.stop(entry, timeout)

    async def box_restart(self, ref: BoxRef, timeout: float = 10.0) -> None:
        positive("timeout", timeout)
        ctl, entry = await local(ref).existing()
        await ctl.restart(entry, timeout)

    async def box_kill(self, ref: BoxRef) -> None:
        ctl, entry = await local(ref).existing()
        await ctl.kill(entry)

    async def box_pause(self, ref: BoxRef) -> None:
        ctl, entry = await local(ref).existing()
        await ctl.pause(entry)

    async def box_unpause(self, ref: BoxRef) -> None:
        ctl, entry = await local(ref).existing()
        await ctl.unpause(entry)

    async def box_suspend(self, ref: BoxRef) -> None:
        core, entry = await local(ref).live()
        await core.live.suspend(entry)

    async def box_resume(self, ref: BoxRef) -> None:
        core, entry = await local(ref).live()
        await port_hold.ensure(core.controller, entry)
        await core.live.resume(entry)

    async def box_remove(self, ref: BoxRef, force: bool = False) -> None:
        box = local(ref)
        if box.request is not None and box.entry is None:
            return
        try:
            ctl, entry = await box.existing()
        except BoxNotFound:
            return
        await ctl.remove(entry, force=force)
        await port_hold.release(ctl, entry)

    async def box_set_network(
        self, ref: BoxRef, network: str | bool | None = None, allow: Sequence[str] | str | None = None
    ) -> dict[str, Any]:
        ctl, entry = await local(ref).existing()
        await ctl.set_network(entry, network, allow=allow)
        net = (await ctl.inspect(entry))["network"]
        return {"network": net.get("mode"), "allow": net.get("allow", [])}

    async def box_ports(self, ref: BoxRef) -> list[dict[str, Any]]:
        ports: list[dict[str, Any]] = (await self.box_inspect(ref))["network"]["ports"]
        return ports

    async def box_ping(self, ref: BoxRef) -> float:
        ctl, entry = await local(ref).existing()
        rtt: float = await (await ctl.connection(entry)).ping()
        return rtt

    async def box_activity(self, ref: BoxRef) -> tuple[int, float]:
        ctl, entry = await local(ref).existing()
        return await ctl.activity(entry)

    async def box_snapshot(self, ref: BoxRef, name: str | None = None) -> LocalSnapshotRef:
        if name is not None:
            validate_name(name, "snapshot")
        core, entry = await local(ref).live()
        return LocalSnapshotRef(self, await core.live.snapshot(entry, name))

    async def box_snapshots(self, ref: BoxRef) -> list[SnapshotRef]:
        return await self.snapshot_list(box=ref.id, kind=None)

    async def box_rollback(self, ref: BoxRef, snapshot: str) -> None:
        core, entry = await local(ref).live()
        snap = await core.live.find_snapshot(snapshot, box_id=ref.id, kinds=("snapshot",))
        await core.live.rollback(entry, snap)

    async def box_fork(self, ref: BoxRef, n: int = 1, name: str | None = None) -> list[BoxRef]:
        core, entry = await local(ref).live()
        return [self.ref_of(core, k) for k in await core.live.fork(entry, n, name=name)]

    async def box_diff(
        self,
        ref: BoxRef,
        a: str | None = None,
        b: str | None = None,
        paths: Sequence[str] | None = None,
        text_limit: int | None = None,
    ) -> dict[str, Any]:
        core, entry = await local(ref).live()
        limit = diffs.TEXT_LIMIT if text_limit is None else text_limit
        return await diffs.diff(core, entry, a, b, paths=paths, text_limit=limit)

    # -- the flight recorder (``core.recorder``) ------------------------------------------

    async def box_record(
        self,
        ref: BoxRef,
        on: bool = True,
        every: float = 0.0,
        keep_last: int | None = None,
        keep_for: float | None = None,
    ) -> dict[str, Any]:
        from ..core.recorder import Policy

        core, entry = await local(ref).live()
        policy = Policy(every, keep_last, keep_for) if on else None
        await core.recorder.set_policy(entry, policy)
        return {"recording": policy.to_json() if policy else None}

    async def box_timeline(self, ref: BoxRef, after: int = 0, limit: int | None = None) -> dict[str, Any]:
        from ..core import timeline
        from ..core.recorder import egress_counts, egress_during

        core, entry = await local(ref).live()
        await core.recorder.settled(entry.id)
        steps = await core.db.call(timeline.steps, entry.id, after=after, limit=limit)
        windows = [(s.seq, s.started_at, s.ended_at) for s in steps]
        egress = await asyncio.to_thread(egress_during, entry.dir, windows) if steps else {}
        listed = [
            s.to_json() | ({"egress": egress_counts(egress[s.seq])} if s.seq in egress else {}) for s in steps
        ]
        return {"recording": entry.record.recording, "steps": listed}

    async def box_step(
        self, ref: BoxRef, step: str, diff: bool = False, text_limit: int | None = None
    ) -> dict[str, Any]:
        from ..core.recorder import EGRESS_LISTED, egress_counts, egress_during

        core, entry = await local(ref).live()
        found = await core.recorder.find(entry, step)
        window = [(found.seq, found.started_at, found.ended_at)]
        decided = (await asyncio.to_thread(egress_during, entry.dir, window)).get(found.seq)
        egress = {"egress": egress_counts(decided), "egress_log": decided[:EGRESS_LISTED]} if decided else {}
        if not diff:
            return found.to_json() | egress
        limit = diffs.TEXT_LIMIT if text_limit is None else text_limit
        since, a, b = await core.recorder.compared(entry, found)
        changes = await diffs.diff(core, entry, a, b, text_limit=limit)
        changes["since_step"] = since.seq
        await core.recorder.keep_files(entry, found, since, changes)
        return {**(await core.recorder.find(entry, found.seq)).to_json(), **egress, "diff": changes}

    async def box_name_step(self, ref: BoxRef, step: str, name: str | None = None) -> dict[str, Any]:
        from ..core import timeline

        if name is not None:
            validate_name(name, "step")
            if name.isdigit():
                raise InvalidArgument(f"a step's name is not a number: {name!r} would read as step {name}")
        core, entry = await local(ref).live()
        found = await core.recorder.find(entry, step)
        return (await core.db.call(timeline.set_name, entry.id, found.seq, name)).to_json()

    async def box_rewind(self, ref: BoxRef, step: str) -> None:
        core, entry = await local(ref).live()
        await core.recorder.rewind(entry, step)

    async def box_fork_at(self, ref: BoxRef, step: str, n: int = 1, name: str | None = None) -> list[BoxRef]:
        core, entry = await local(ref).live()
        return [self.ref_of(core, k) for k in await core.recorder.fork_at(entry, step, n, name=name)]

    async def box_promote(self, ref: BoxRef, child: str) -> LocalSnapshotRef:
        core, entry = await local(ref).live()
        kid = await core.controller.find(child)
        return LocalSnapshotRef(self, await core.recorder.promote(entry, kid))

    async def box_processes(self, ref: BoxRef) -> list[dict[str, Any]]:
        raise self.unsupported(
            "processes()",
            ref.name,
            "a local process is followed by its AsyncProcess, and by taken_over() once its process died",
        )

    async def box_preview_url(
        self, ref: BoxRef, port: int, ttl: float = 3600, at_host: bool | None = None
    ) -> str:
        raise self.unsupported(
            "preview_url()",
            ref.name,
            "a preview URL is signed by a sandlot serve; locally, connect(port) reaches the port",
        )

    # -- code contexts ----------------------------------------------------------------------

    def _interpreter(self, ref: BoxRef) -> Interpreter:
        from .code import CodeBox, Interpreter
        from .files import AsyncFiles

        async def spawn(*argv: str, user: str | None = None, stdin: bool = True) -> AsyncProcess:
            return await self.spawn(ref, Command(argv, user=user, stdin=stdin))

        async def exec_(*argv: str, env: Mapping[str, str] | None = None, cwd: str | None = None,
                        user: str | None = None, timeout: float | None = None) -> ExecResult:  # fmt: skip
            return await self.exec(ref, Command(argv, env, cwd, user, stdin=False), None, timeout)

        return Interpreter(CodeBox(ref.id, AsyncFiles(self, ref), spawn, exec_))

    async def run_code(self, ref: BoxRef, cell: Cell, callbacks: Callbacks) -> Execution:
        what: dict[str, Any] = {
            "code": cell.code[:CODE_SHOWN],
            "language": cell.language,
            "context": cell.context,
        }
        if cell.env:  # the names: their values may be secrets
            what["env"] = sorted(cell.env)
        async with self._step(ref, "code", lambda: what) as step:
            done = await self._interpreter(ref).run(
                cell.code,
                language=cell.language,
                context=cell.context,
                timeout=cell.timeout,
                env=cell.env,
                on_stdout=callbacks.on_stdout,
                on_stderr=callbacks.on_stderr,
                on_result=callbacks.on_result,
            )
            if step is not None and done.error is not None:
                step.result["error"] = f"{done.error.name}: {done.error.value}"[:500]
            return done

    async def box_create_code_context(self, ref: BoxRef, **options: Any) -> CodeContext:
        """``Interpreter.create``'s options, as the table's model (``CodeContextIn``) let them by."""
        return await self._interpreter(ref).create(**options)

    async def box_list_code_contexts(self, ref: BoxRef) -> list[CodeContext]:
        return await self._interpreter(ref).list()

    async def box_interrupt_code_context(self, ref: BoxRef, context: str) -> None:
        await self._interpreter(ref).interrupt(context)

    async def box_restart_code_context(self, ref: BoxRef, context: str) -> CodeContext:
        return await self._interpreter(ref).restart(context)

    async def box_remove_code_context(self, ref: BoxRef, context: str) -> None:
        await self._interpreter(ref).remove(context)

    # -- files ------------------------------------------------------------------------------

    async def _conn(self, ref: BoxRef) -> Any:
        ctl, entry = await local(ref).existing()
        return await ctl.connection(entry)

    async def files_stat(
        self, ref: BoxRef, path: str, follow_symlinks: bool = True, xattrs: str | None = None
    ) -> FileInfo:
        p, prefix = guest_path(path), check_prefix(xattrs)
        flags = (0 if follow_symlinks else FsFlag.NOFOLLOW) | (FsFlag.XATTRS if prefix else 0)
        entries = await proto.fs_request(await self._conn(ref), FsOp.STAT, p, flags=flags, prefix=prefix)
        return entry_info(None, entries[0], path=p)

    async def files_list(self, ref: BoxRef, path: str, xattrs: str | None = None) -> list[FileInfo]:
        p, prefix = guest_path(path), check_prefix(xattrs)
        flags = FsFlag.XATTRS if prefix else 0
        entries = await proto.fs_request(await self._conn(ref), FsOp.LIST, p, flags=flags, prefix=prefix)
        return sorted((entry_info(p, e) for e in entries), key=lambda i: i.name)

    async def files_set_xattrs(self, ref: BoxRef, path: str, prefix: str, values: dict[str, str]) -> None:
        where, (start, checked) = guest_path(path), check_xattrs(values, prefix)
        raw = {name: value.encode() for name, value in checked.items()}
        async with self._step(ref, "files", lambda: {"op": "set_xattrs", "path": where}):
            try:
                await proto.fs_request(await self._conn(ref), FsOp.SETXATTRS, where, prefix=start, xattrs=raw)
            except GuestOSError as e:
                if e.errno != errno.ENOTSUP:
                    raise
                raise InvalidArgument(
                    f"{where}: its file system keeps no extended attributes (on gVisor, the root's "
                    "does not: tmpfs ones such as /tmp do)",
                    box=ref.id,
                ) from None

    async def files_mkdir(
        self, ref: BoxRef, path: str, parents: bool = True, mode: int = 0o755, user: str | None = None
    ) -> None:
        flags = FsFlag.PARENTS if parents else 0
        owner, where = check_user(user), guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "mkdir", "path": where}):
            await proto.fs_request(
                await self._conn(ref), FsOp.MKDIR, where, mode=check_mode(mode), flags=flags, user=owner
            )

    async def files_remove(
        self, ref: BoxRef, path: str, recursive: bool = False, missing_ok: bool = False
    ) -> None:
        flags = (FsFlag.RECURSIVE if recursive else 0) | (FsFlag.MISSING_OK if missing_ok else 0)
        # a tree's removal is one request, answered when it is done: ten thousand files
        # on a loaded, emulated host take longer than a request's usual deadline
        timeout = TREE_REMOVE_TIMEOUT if recursive else None
        where = guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "remove", "path": where, "recursive": recursive}):
            conn = await self._conn(ref)
            await proto.fs_request(conn, FsOp.REMOVE, where, flags=flags, timeout=timeout)

    async def files_rename(self, ref: BoxRef, src: str, dst: str) -> None:
        a, b = guest_path(src), guest_path(dst)
        async with self._step(ref, "files", lambda: {"op": "rename", "path": a, "to": b}):
            await proto.fs_request(await self._conn(ref), FsOp.RENAME, a, path2=b)

    async def files_restore(self, ref: BoxRef, path: str, snapshot: str) -> dict[str, Any]:
        core, entry = await local(ref).live()
        where = guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "restore", "path": where, "snapshot": snapshot}):
            return await diffs.restore(core, entry, where, snapshot)

    async def files_chmod(self, ref: BoxRef, path: str, mode: int) -> None:
        if mode is None:
            raise InvalidArgument("chmod needs a mode")
        where = guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "chmod", "path": where, "mode": mode}):
            await proto.fs_request(await self._conn(ref), FsOp.CHMOD, where, mode=check_mode(mode))

    async def files_chown(self, ref: BoxRef, path: str, user: str, follow_symlinks: bool = True) -> None:
        if not user:
            raise InvalidArgument("chown needs a user")
        check_user(user)
        flags = 0 if follow_symlinks else FsFlag.NOFOLLOW
        where = guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "chown", "path": where, "user": user}):
            await proto.fs_request(await self._conn(ref), FsOp.CHOWN, where, user=user, flags=flags)

    async def read(self, ref: BoxRef, path: str, offset: int, length: int | None) -> AsyncIterator[bytes]:
        p = guest_path(path)
        _size, _mode, chunks = await proto.read_stream(await self._conn(ref), p, offset=offset, length=length)
        async for chunk in chunks:
            yield chunk

    async def write(self, ref: BoxRef, path: str, data: bytes | AsyncIterable[bytes], how: Write) -> int:
        p = guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "write", "path": p, "append": how.append}) as step:
            wrote = await proto.write_stream(
                await self._conn(ref), p, data, mode=check_mode(how.mode),
                user=check_user(how.user), append=how.append, parents=how.parents, exclusive=how.exclusive,
            )  # fmt: skip
            if step is not None:
                step.result["bytes"] = wrote
            return wrote

    async def get_archive(
        self, ref: BoxRef, path: str, *, follow_symlinks: bool = False
    ) -> AsyncIterator[bytes]:
        p = guest_path(path)
        async for chunk in proto_archive.read_tree(await self._conn(ref), p, follow=follow_symlinks):
            yield chunk

    async def put_archive(
        self, ref: BoxRef, path: str, tar: AsyncIterable[bytes], *, user: str | None
    ) -> dict[str, Any]:
        p = guest_path(path)
        async with self._step(ref, "files", lambda: {"op": "put_archive", "path": p}) as step:
            conn = await self._conn(ref)
            report = (await proto_archive.write_tree(conn, p, tar, user=check_user(user))).to_json()
            if step is not None:
                step.result.update(report)
            return report

    async def watch(self, ref: BoxRef, path: str, recursive: bool) -> WatchSource:
        conn = await self._conn(ref)
        return AgentWatch(conn, await WatchStream.start(conn, guest_path(path), recursive=recursive), ref.id)

    # -- commands ---------------------------------------------------------------------------

    async def exec(self, ref: BoxRef, cmd: Command, stdin: bytes | None, timeout: float | None) -> ExecResult:
        positive("timeout", timeout)
        with tracing.span("exec", box=ref.id, command=cmd.argv[0]):
            async with self._step(ref, "exec", lambda: command_step(cmd, stdin)) as step:
                proc = await self.spawn(ref, replace(cmd, tty=False, stdin=stdin is not None))
                if stdin is None:
                    result = await proc.result(timeout)
                else:
                    result = await feed_and_wait(proc, stdin, timeout)
                if step is not None:
                    step.result.update(
                        exit_code=result.exit_code, signal=result.signal,
                        stdout_bytes=len(result.stdout_bytes), stderr_bytes=len(result.stderr_bytes),
                    )  # fmt: skip
                return result

    @contextlib.asynccontextmanager
    async def _grouped(self, ref: BoxRef, kind: str, what: dict[str, Any]) -> AsyncIterator[None]:
        entry = await self._recording(ref)
        if entry is None:
            yield
            return
        async with self.core().recorder.group(entry, kind, what):
            yield

    def as_step(
        self, ref: BoxRef, kind: str, what: dict[str, Any]
    ) -> contextlib.AbstractAsyncContextManager[None]:
        if not isinstance(kind, str) or not kind or len(kind) > 63:
            raise InvalidArgument(f"a step's kind is a short name, not {kind!r}")
        return self._grouped(ref, kind, dict(what))

    @contextlib.asynccontextmanager
    async def _step(
        self, ref: BoxRef, kind: str, what: Callable[[], dict[str, Any]]
    ) -> AsyncIterator[StepDraft | None]:
        """One step of the box's timeline where it records (``core.recorder``), else
        nothing: a box that does not record loads none of the recorder."""
        entry = await self._recording(ref)
        if entry is None:
            yield None
            return
        async with self.core().recorder.step(entry, kind, what()) as draft:
            yield draft

    async def _recording(self, ref: BoxRef) -> BoxEntry | None:
        """The box's entry if it records, its row read as it is now (another process may
        have begun recording: the connection reads it again once the store moved). Not
        before this process's checkpoint of the box's last step is fixed: a save may run
        the box in another VM (gVisor's), which its row names only once the save is done."""
        ctl, entry = await local(ref).existing()
        if entry.record.recording is not None:
            await self.core().recorder.fixed(entry.id)
        await ctl.connection(entry)
        return entry if entry.record.recording is not None else None

    async def spawn(self, ref: BoxRef, cmd: Command, keep: str | None = None) -> AsyncProcess:
        ctl, entry = await local(ref).existing()
        spec = entry.spec
        req = ExecRequest(
            argv=cmd.argv, env={**spec.default_env(), **check_env(cmd.env)} or None,
            cwd=guest_path(cmd.cwd) if cmd.cwd is not None else spec.default_cwd(),
            user=check_user(cmd.user) or spec.default_user(), tty=cmd.tty, rows=cmd.rows, cols=cmd.cols,
            stdin=cmd.stdin,
        )  # fmt: skip
        remote = await RemoteProcess.start(await ctl.connection(entry), req)
        if keep is not None:
            entry.session.keep(remote.channel_id, Kept(keep, cmd.argv, remote.pid, cmd.tty))
        if entry.record.recording is not None:
            self.core().recorder.follow(entry, remote, command_step(cmd, None))

        async def news(kind: str, reason: str, detail: dict[str, Any]) -> None:
            await ctl.db.add_event(events.draft(kind, reason, **detail), entry.id)

        return AsyncProcess(cmd.argv, remote, key=keep, _on_news=news)

    async def taken_over(self, ref: BoxRef) -> list[AsyncProcess]:
        ctl, entry = await local(ref).existing()
        session = entry.session
        if session.conn is None and entry.state == BoxState.RUNNING and session.inheritance_left():
            await ctl.connection(entry)  # leasing the port a dead host left takes its processes over
        taken, session.taken_over = session.taken_over, []
        return [AsyncProcess(kept.argv, remote, key=kept.key) for kept, remote in taken]

    # -- events ---------------------------------------------------------------------------

    async def events(
        self, *, box: str | None, since: float | None, after: int | None, follow: bool
    ) -> AsyncIterator[events.Event]:
        async for ev in events.follow(self.core().db, after=after, since=since, box=box, wait=follow):
            yield ev

    # -- snapshots --------------------------------------------------------------------------

    async def find_snapshot(self, key: str) -> LocalSnapshotRef:
        return LocalSnapshotRef(self, await self.core().live.find_snapshot(key))

    async def snapshot_list(self, *, box: str | None, kind: str | None) -> list[SnapshotRef]:
        return [LocalSnapshotRef(self, r) for r in await self.core().live.list_snapshots(box=box, kind=kind)]

    async def _record(self, snap: SnapshotRef) -> SnapshotRecord:
        rec = local_snapshot(snap).record
        found = await self.core().db.find_snapshot(rec.id)
        if found is None:
            raise SnapshotNotFound(f"snapshot {rec.id} was removed")
        return found

    async def snapshot_inspect(self, snap: SnapshotRef) -> dict[str, Any]:
        rec = await self._record(snap)
        d = rec.to_json()
        d["children"] = await self.core().live.children(rec)
        d["path"] = str(self.runtime.home / "snapshots" / rec.id)
        return d

    async def snapshot_start(
        self, snap: SnapshotRef, n: int = 1, name: str | None = None, **options: Any
    ) -> list[BoxRef]:
        core = self.core()
        entries = await core.live.start_boxes(local_snapshot(snap).record, n, name=name, **options)
        return [self.ref_of(core, e) for e in entries]

    async def snapshot_remove(self, snap: SnapshotRef) -> None:
        core = self.core()
        rec = local_snapshot(snap).record
        if rec.kind == "template":  # a template's warm pool goes first (its VMs are no boxes yet)
            found = await core.db.find_snapshot(rec.id)
            if found is not None:
                await core.pools.drop(found)
        await core.live.remove_snapshot(rec)

    async def export(self, snap: SnapshotRef, path: Path, since: SnapshotRef | None = None) -> Path:
        base = local_snapshot(since).record if since is not None else None
        return await self.core().live.export(local_snapshot(snap).record, path, base)

    async def import_snapshot(
        self,
        path: Path,
        *,
        name: str | None,
        start: bool,
        options: Mapping[str, Any],
        namespace: str | None = None,
    ) -> BoxRef | SnapshotRef:
        """``namespace``: whose the snapshot is in this home (a server's caller's, a fleet
        driver's), whatever the archive's box was."""
        snap = LocalSnapshotRef(self, await self.core().live.import_snapshot(path, namespace))
        if not start:
            return snap
        return (await self.snapshot_start(snap, 1, name, **options))[0]

    # -- named volumes ----------------------------------------------------------------------

    async def volume_create(
        self, name: str, size_gb: float | None, labels: Mapping[str, str] | None, shared: bool = False
    ) -> dict[str, Any]:
        rt = self.runtime
        rec = await asyncio.to_thread(volumes.create, rt.home, rt.store, name, size_gb, labels, shared=shared)
        return await self.volume_get(rec.id)

    async def volume_list(self) -> list[dict[str, Any]]:
        store = self.runtime.store
        found = await asyncio.to_thread(
            lambda: [volumes.inspect(store, v.id) for v in volumes.volume_rows(store)]
        )
        return [v.to_json() for v in found]

    async def volume_get(self, key: str) -> dict[str, Any]:
        return (await asyncio.to_thread(volumes.inspect, self.runtime.store, key)).to_json()

    async def volume_remove(self, key: str) -> None:
        await asyncio.to_thread(volumes.remove, self.runtime.home, self.runtime.store, key)

    async def info(self) -> dict[str, Any]:
        return {"transport": self.transport, "home": str(self.runtime.home)}


async def boot(box: LocalBoxRef, ctl: BoxController, entry: BoxEntry) -> None:
    """Start the box, unless a ready VM of its template's warm pool became it (running already)."""
    # its ports first, where it wakes on traffic: a host port in use fails the start before it boots
    await port_hold.ensure(ctl, entry)
    if box.claimed:
        box.claimed = False
        return
    await ctl.start(entry)


def local(ref: BoxRef) -> LocalBoxRef:
    return narrowed(ref, LocalBoxRef, "a box of this host")


def local_snapshot(snap: SnapshotRef) -> LocalSnapshotRef:
    return narrowed(snap, LocalSnapshotRef, "a snapshot of this host")


def snapshot_labels(snap: SnapshotRef) -> dict[str, str]:
    """The labels of the box a snapshot of this host was taken of (its namespace's among
    them): whose the snapshot is, to ``sandlot serve`` and a fleet's node."""
    labels: dict[str, str] = (local_snapshot(snap).record.options.get("box") or {}).get("labels") or {}
    return labels


def template_arg(template: Any) -> str | SnapshotRecord | bool | None:
    """``template=``: a snapshot object of this host, its id or name, False or None."""
    if template is None or template is False or isinstance(template, str | SnapshotRecord):
        return template
    ref = getattr(template, "ref", None)
    if isinstance(ref, LocalSnapshotRef):
        return ref.record
    if isinstance(ref, SnapshotRef):
        return ref.id
    raise InvalidArgument(f"template= takes a template or snapshot, its name, or False; not {template!r}")


def console_from(path: Path, lines: int | None, at: int = 0) -> tuple[bytes, int]:
    """The console's bytes from offset ``at`` (or its last ``lines``, if given: within its
    last ``CONSOLE_TAIL`` bytes), and the offset after them; a console shorter than ``at``
    was begun again by a new boot: from its start."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if lines is not None:
                at = max(size - CONSOLE_TAIL, 0)
            f.seek(at if at <= size else 0)
            data = f.read(size - f.tell())
    except FileNotFoundError:
        return b"", 0
    if lines is not None:  # from just after the newline that ends the line before them
        cut = end = len(data) - data.endswith(b"\n")
        for _ in range(lines):
            end = data.rfind(b"\n", 0, end)
            cut = end + 1
            if end < 0:
                break
        data = data[cut:]
    return data, size


def read_console(path: Path, lines: int | None) -> str:
    if lines is None:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
    return tail(path, lines, CONSOLE_TAIL)
