"""envd, E2B's in-sandbox API, served on the host for each box over its agent.

E2B runs a daemon (envd) in every sandbox: a Connect-RPC process service and
filesystem service, and ``/files`` over plain HTTP. sandlot needs no daemon in the
box: the same calls become the agent's own (spawn, signal, stdin, files, watches),
made by the server. Processes are held in the server's process table
(``api/host.py``), so output is buffered whoever listens, and ``Connect`` by pid
follows a process that another request started.

Where a call runs as a user (E2B's ``user`` option, sent as HTTP Basic), commands
run as that user and written files and made directories belong to it; the other
file operations run with the agent's rights. See docs/e2b.md.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import posixpath
import re
import secrets
import signal as _signal
import stat as _stat
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ... import records
from ...api.box import AsyncBox
from ...api.contract import STDERR, STDOUT
from ...api.files import AsyncWatch
from ...api.fs import FileInfo
from ...api.host import HeldProcess, new_process_id
from ...errors import (
    InvalidArgument,
    RequestError,
    SandlotError,
)
from ..state import Caller, ServerState
from . import messages as pb
from .connect import ConnectError, Dropped, Method, check, serve

# the envd release whose API this serves: octet-stream uploads, CloseStdin, metadata (0.6.2),
# watch events with their entry (0.6.3), watches of network mounts allowed (0.6.4: the
# agent's inotify watch takes any file system; its events there are the kernel's)
ENVD_VERSION = "0.6.4"
WATCHER_SETTLE_S = 5.0  # at most, for a polled watcher's barrier (a box under load answers late)
# file metadata: envd keeps it as extended attributes of these names (``user.e2b.author``),
# sent on upload as ``X-Metadata-<key>`` headers (keys lowercased) and shown in entries
METADATA_XATTRS = "user.e2b."
METADATA_HEADER = "x-metadata-"
METADATA_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]+\Z")  # an HTTP header's name (RFC 7230)
METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")  # printable US-ASCII
ENVD_PORT = 49983
WATCHER_EVENTS_KEPT = 10_000  # a polled watcher's unread events; older ones are dropped
WATCHERS_PER_BOX = 64
WATCHER_IDLE = 600.0  # seconds a polled watcher is kept without a client asking for its events
FILE_CHUNK = 1 << 20
NAMES_TTL = 10.0  # seconds a box's user and group names are kept


@dataclass
class E2bProcess:
    """A process started through envd: what E2B's List and selectors know it by."""

    held: HeldProcess
    config: dict[str, Any]
    tag: str | None


@dataclass
class Watcher:
    """A polled watcher (CreateWatcher): its watch, read into a queue by a task."""

    box: AsyncBox
    watch: AsyncWatch
    root: str
    include_entry: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    polled: float = field(default_factory=time.monotonic)  # when its events were last asked for


class Envd:
    """envd's services for every box of one server."""

    def __init__(self, state: ServerState, box_of: Callable[[Request], Any]) -> None:
        self.state = state
        self.box_of = box_of  # the box a request is for, authenticated (async)
        self.processes: dict[tuple[str, int], E2bProcess] = {}
        self.watchers: dict[str, Watcher] = {}
        self.names: dict[str, tuple[float, Names, Names]] = {}
        self.methods: dict[str, Method] = {}
        services = (("process.Process", pb.PROCESS_METHODS, self._process_impl()),
                    ("filesystem.Filesystem", pb.FILESYSTEM_METHODS, self._fs_impl()))  # fmt: skip
        for service, table, impl in services:
            for name, (req, resp, kind) in table.items():
                keepalive = _keepalive(name)
                self.methods[f"/{service}/{name}"] = Method(req, resp, kind, impl[name], keepalive)

    async def rpc(self, path: str, request: Request) -> Response:
        method = self.methods.get(path)
        if method is None:
            return JSONResponse({"code": "unimplemented", "message": f"no method {path}"}, status_code=404)
        return await serve(method, request)

    # -- the process service ------------------------------------------------------------------

    def _process_impl(self) -> dict[str, Callable[..., Any]]:
        return {
            "List": self.list_processes, "Start": self.start, "Connect": self.connect,
            "Update": self.update, "StreamInput": self.stream_input, "SendInput": self.send_input,
            "SendSignal": self.send_signal, "CloseStdin": self.close_stdin,
        }  # fmt: skip

    async def start(self, req: dict[str, Any], request: Request) -> AsyncIterator[dict[str, Any]]:
        box: AsyncBox = await self.box_of(request)
        config = req.get("process") or {}
        cmd = config.get("cmd", "")
        check(bool(cmd), "process.cmd is empty")
        pty = req.get("pty")
        size = (pty or {}).get("size") or {}
        self.state.processes.check_room()
        key = new_process_id()
        user = await self.user(box, request)
        cwd = config.get("cwd")
        if cwd:  # a relative one is under the home, as a relative path is
            cwd = await self.path(box, cwd, request, "cwd")
        elif user:  # envd starts a process in its user's home
            cwd = await self.home(box, user)
        proc = await box.spawn(
            cmd, *config.get("args", []), env=config.get("envs") or None, cwd=cwd, user=user,
            tty=pty is not None, rows=size.get("rows") or 24, cols=size.get("cols") or 80,
            stdin=req.get("stdin", True), keep=key,
        )  # fmt: skip
        labels = box.info["labels"]
        owner = Caller.owner_of(labels)
        held = self.state.processes.hold(box.id, proc, key, self.state.exited_by(owner))
        self.processes[(box.id, proc.pid)] = E2bProcess(held, config, req.get("tag"))
        yield {"event": {"start": {"pid": proc.pid}}}
        async for event in _events(held, {STDOUT: 0, STDERR: 0}, box):
            yield event

    async def connect(self, req: dict[str, Any], request: Request) -> AsyncIterator[dict[str, Any]]:
        box: AsyncBox = await self.box_of(request)
        found = self._select(box.id, req.get("process") or {})
        held = found.held
        yield {"event": {"start": {"pid": held.proc.pid}}}
        # from what comes next: output already sent to the starter is not sent again
        async for event in _events(held, {s: ring.end for s, ring in held.rings.items()}, box):
            yield event

    async def list_processes(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        self._prune()
        listed = []
        for (box_id, pid), p in self.processes.items():
            if box_id == box.id and not p.held.done:
                info: dict[str, Any] = {"config": p.config, "pid": pid}
                if p.tag is not None:
                    info["tag"] = p.tag
                listed.append(info)
        return {"processes": listed}

    async def update(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        p = self._select(box.id, req.get("process") or {})
        size = (req.get("pty") or {}).get("size")
        if size is not None:
            check(p.held.tty, "the process has no PTY to resize")
            await p.held.proc.resize(int(size.get("rows") or 24), int(size.get("cols") or 80))
        return {}

    async def send_input(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        p = self._select(box.id, req.get("process") or {})
        await _write_input(p, req.get("input") or {})
        return {}

    async def stream_input(self, reqs: AsyncIterator[dict[str, Any]], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        target: E2bProcess | None = None
        async for req in reqs:
            if "start" in req:
                target = self._select(box.id, req["start"].get("process") or {})
            elif "data" in req:
                if target is None:
                    raise InvalidArgument("StreamInput: data came before the start event naming the process")
                await _write_input(target, req["data"].get("input") or {})
        return {}

    async def send_signal(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        p = self._select(box.id, req.get("process") or {})
        number = req.get("signal", 0)
        sig = {pb.Signal.values["SIGNAL_SIGKILL"]: _signal.SIGKILL,
               pb.Signal.values["SIGNAL_SIGTERM"]: _signal.SIGTERM}.get(number)  # fmt: skip
        check(sig is not None, f"signal {number} is not one envd sends (SIGKILL or SIGTERM)")
        assert sig is not None
        with contextlib.suppress(SandlotError):  # a signal that raced the exit is no error
            await p.held.proc.kill(sig, group=True)
        return {}

    async def close_stdin(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        p = self._select(box.id, req.get("process") or {})
        check(not p.held.tty, "a PTY has no stdin to close: send Ctrl-D (0x04) instead")
        await p.held.proc.close_stdin()
        return {}

    def _select(self, box_id: str, selector: Mapping[str, Any]) -> E2bProcess:
        self._prune()
        if "pid" in selector:
            pid = int(selector["pid"])
            found = self.processes.get((box_id, pid))
            if found is None:  # one the server holds without its E2B facts: taken over after a restart
                running = (h for h in self.state.processes.of_box(box_id) if not h.done)
                held = next((h for h in running if h.proc.pid == pid), None)
                if held is not None:
                    argv = list(held.proc.argv)
                    found = E2bProcess(held, {"cmd": argv[0], "args": argv[1:]}, None)
                    self.processes[(box_id, pid)] = found
            if found is not None and not found.held.done:
                return found
            raise ConnectError("not_found", f"process with pid {pid} not found")
        if "tag" in selector:
            for (b, _), p in self.processes.items():
                if b == box_id and p.tag == selector["tag"] and not p.held.done:
                    return p
            raise ConnectError("not_found", f"process with tag {selector['tag']!r} not found")
        raise InvalidArgument("the process selector names neither a pid nor a tag")

    def _prune(self) -> None:
        """Forget processes that exited (envd lists and selects running ones only) and those
        the server's table let go, of every box: nothing is kept for a box that is gone."""
        for k, p in list(self.processes.items()):
            if p.held.done or self.state.processes.get(k[0], p.held.id) is None:
                del self.processes[k]

    # -- the filesystem service ---------------------------------------------------------------

    def _fs_impl(self) -> dict[str, Callable[..., Any]]:
        return {
            "Stat": self.stat, "MakeDir": self.make_dir, "Move": self.move, "ListDir": self.list_dir,
            "Remove": self.remove, "WatchDir": self.watch_dir, "CreateWatcher": self.create_watcher,
            "GetWatcherEvents": self.get_watcher_events, "RemoveWatcher": self.remove_watcher,
        }  # fmt: skip

    async def stat(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        path = await self.path(box, req.get("path"), request)
        info = await box.files.stat(path, follow_symlinks=False, xattrs=METADATA_XATTRS)
        return {"entry": await self.entry(box, info)}

    async def make_dir(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        path = await self.path(box, req.get("path"), request)
        if await box.files.exists(path):
            raise ConnectError("already_exists", f"directory {path} already exists")
        await box.files.mkdir(path, parents=True, user=await self.user(box, request))
        return {"entry": await self.entry(box, await box.files.stat(path))}

    async def move(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        src = await self.path(box, req.get("source"), request, "source")
        dst = await self.path(box, req.get("destination"), request, "destination")
        await box.files.rename(src, dst)
        info = await box.files.stat(dst, follow_symlinks=False, xattrs=METADATA_XATTRS)
        return {"entry": await self.entry(box, info)}

    async def remove(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        # envd removes as Go's os.RemoveAll does: a path that is not there is no error
        path = await self.path(box, req.get("path"), request)
        await box.files.remove(path, recursive=True, missing_ok=True)
        return {}

    async def list_dir(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        path = await self.path(box, req.get("path"), request)
        depth = int(req.get("depth", 0)) or 1  # (0: unset)
        check(1 <= depth <= 64, f"depth should be at least 1 and at most 64, not {depth}")
        top = await box.files.stat(path)
        if not top.is_dir:
            raise InvalidArgument(f"path {path} is not a directory")
        entries: list[dict[str, Any]] = []

        async def walk(directory: str, level: int) -> None:
            # envd's order (Go's filepath.WalkDir): by name, each folder's entries right after it
            listed = await box.files.list(directory, xattrs=METADATA_XATTRS)
            for info in sorted(listed, key=lambda i: i.name.encode()):
                entries.append(await self.entry(box, info))
                if info.is_dir and level < depth:
                    await walk(info.path, level + 1)

        await walk(top.path, 1)
        return {"entries": entries}

    async def watch_dir(self, req: dict[str, Any], request: Request) -> AsyncIterator[dict[str, Any]]:
        box: AsyncBox = await self.box_of(request)
        root, watch = await self._begin_watch(box, req, request)
        include = bool(req.get("include_entry"))
        try:
            yield {"start": {}}
            while True:
                event = await watch.next_event()
                if event is None:
                    return
                for e in await self._entries(box, root, _fs_events(root, event), include):
                    yield {"filesystem": e}
        finally:
            await watch.aclose()

    async def create_watcher(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        box: AsyncBox = await self.box_of(request)
        self._prune_watchers()
        if sum(w.box.id == box.id for w in self.watchers.values()) >= WATCHERS_PER_BOX:
            raise ConnectError("resource_exhausted", f"{WATCHERS_PER_BOX} watchers of this sandbox are open")
        root, watch = await self._begin_watch(box, req, request)
        watcher = Watcher(box, watch, root, bool(req.get("include_entry")))
        watcher_id = new_process_id()
        watcher.task = asyncio.ensure_future(self._collect(watcher))
        self.watchers[watcher_id] = watcher
        return {"watcher_id": watcher_id}

    async def get_watcher_events(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        watcher = await self._watcher(req, request)
        watcher.polled = time.monotonic()
        # what the sandbox changed before this call is in the answer, as envd's own queue
        # has it: inotify's events are queued by the guest's kernel as the change is made,
        # and reach this host after its answer (a barrier through the watch's channel)
        await watcher.watch.settle(WATCHER_SETTLE_S)
        events, watcher.events = watcher.events, []
        return {"events": events}

    async def remove_watcher(self, req: dict[str, Any], request: Request) -> dict[str, Any]:
        watcher = await self._watcher(req, request)
        self.watchers.pop(req["watcher_id"], None)
        if watcher.task is not None:
            watcher.task.cancel()
        await watcher.watch.aclose()
        return {}

    def _prune_watchers(self) -> None:
        """Close the polled watchers nobody asked for in WATCHER_IDLE seconds (their client
        went away without removing them), and forget those that ended (the box went)."""
        now = time.monotonic()
        for watcher_id, w in list(self.watchers.items()):
            ended = w.task is not None and w.task.done()
            if now - w.polled > WATCHER_IDLE or (ended and not w.events):
                del self.watchers[watcher_id]
                if w.task is not None:
                    w.task.cancel()

    async def _watcher(self, req: dict[str, Any], request: Request) -> Watcher:
        box: AsyncBox = await self.box_of(request)
        watcher = self.watchers.get(req.get("watcher_id", ""))
        if watcher is None or watcher.box.id != box.id:
            raise ConnectError("not_found", f"watcher {req.get('watcher_id', '')!r} not found")
        return watcher

    async def _collect(self, watcher: Watcher) -> None:
        """Read a polled watcher's events into its queue until it ends."""
        try:
            while True:
                event = await watcher.watch.next_event()
                if event is None:
                    return
                found = await self._entries(watcher.box, watcher.root, _fs_events(watcher.root, event),
                                            watcher.include_entry)  # fmt: skip
                watcher.events.extend(found)
                over = len(watcher.events) - WATCHER_EVENTS_KEPT
                if over > 0:  # a client that does not poll: its oldest go
                    records.TALLY.add("watch", "dropped", watcher.box.id, over)
                    del watcher.events[:-WATCHER_EVENTS_KEPT]
        except SandlotError:
            return

    async def _entries(
        self, box: AsyncBox, root: str, events: list[dict[str, Any]], include: bool
    ) -> list[dict[str, Any]]:
        """envd 0.6.3's ``include_entry``: each event of a path that is there (created,
        written, its mode changed) with its EntryInfo as it is now; a path gone since has
        none, as in envd."""
        if include:
            for e in events:
                if e["type"] in (1, 2, 5):
                    path = posixpath.join(root, e["name"])
                    with contextlib.suppress(SandlotError, OSError):
                        info = await box.files.stat(path, follow_symlinks=False, xattrs=METADATA_XATTRS)
                        e["entry"] = await self.entry(box, info)
        return events

    async def _begin_watch(
        self, box: AsyncBox, req: dict[str, Any], request: Request
    ) -> tuple[str, AsyncWatch]:
        path = await self.path(box, req.get("path"), request)
        info = await box.files.stat(path)
        if not info.is_dir:
            raise InvalidArgument(f"path {path} is not a directory")
        watch = await box.files.watch(info.path, recursive=bool(req.get("recursive", False))).start()
        return info.path, watch

    async def path(self, box: AsyncBox, value: Any, request: Request, what: str = "path") -> str:
        """A path as envd takes it: a relative one is under the home of the user the call
        runs as (from the box's /etc/passwd)."""
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"{what} is empty")
        if value.startswith("/"):
            return posixpath.normpath(value)
        if value.startswith("~"):
            value = value[1:].lstrip("/")
        home = await self.home(box, await self.user(box, request) or box.info.get("user") or "root")
        return posixpath.normpath(posixpath.join(home, value))

    async def user(self, box: AsyncBox, request: Request) -> str | None:
        """Who a call runs as: the user it names (``call_user``), else the server's default
        user for E2B's calls (``--e2b-user``: E2B's ``user``) where the box's image has
        that user, else the box's own user (None)."""
        named = call_user(request)
        if named:
            return named
        default = self.state.settings.e2b_user
        if default:
            users, _ = await self._names(box)
            if default in users.homes or default in users.by_id.values():
                return default
        return None

    async def runs_as(self, box: AsyncBox, request: Request) -> tuple[str | None, str]:
        """Who a call runs as (``user``; None: the box's own user), and that user's home."""
        user = await self.user(box, request)
        return user, await self.home(box, user or box.info.get("user") or "root")

    async def home(self, box: AsyncBox, user: str) -> str:
        """``user``'s home in the box (its /etc/passwd)."""
        users, _ = await self._names(box)
        return users.homes.get(user) or ("/root" if user == "root" else f"/home/{user}")

    async def entry(self, box: AsyncBox, info: FileInfo) -> dict[str, Any]:
        """envd's EntryInfo of a file, with its owner's and group's names. A symlink is
        the type of what it points to (a dangling one, a symlink), its target an
        absolute path, as envd says them."""
        users, groups = await self._names(box)
        target = info.link_target
        kind = {"file": 1, "dir": 2, "symlink": 3}.get(info.type, 0)
        if info.type == "symlink" and target is not None:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(info.path), target))
            with contextlib.suppress(SandlotError):
                kind = {"file": 1, "dir": 2}.get((await box.files.stat(info.path)).type, kind)
        type_bits = {"file": _stat.S_IFREG, "dir": _stat.S_IFDIR, "symlink": _stat.S_IFLNK}.get(info.type, 0)
        entry: dict[str, Any] = {
            "name": info.name, "type": kind, "path": info.path, "size": info.size, "mode": info.mode,
            "permissions": _stat.filemode(type_bits | info.mode),
            "owner": users.by_id.get(info.uid, str(info.uid)),
            "group": groups.by_id.get(info.gid, str(info.gid)), "modified_time": info.mtime,
        }  # fmt: skip
        if info.type == "symlink":
            entry["is_symlink"] = True
        if target is not None:
            entry["symlink_target"] = target
        metadata = _metadata_of(info)
        if metadata:
            entry["metadata"] = metadata
        return entry

    async def _names(self, box: AsyncBox) -> tuple[Names, Names]:
        """The box's users and groups, read from its /etc (kept a few seconds)."""
        now = time.monotonic()
        cached = self.names.get(box.id)
        if cached is not None and now - cached[0] < NAMES_TTL:
            return cached[1], cached[2]
        for other, (at, _, _) in list(self.names.items()):  # boxes no longer asked about
            if now - at >= NAMES_TTL:
                del self.names[other]
        tables: list[Names] = []
        for path in ("/etc/passwd", "/etc/group"):
            try:
                text = (await box.files.read(path)).decode("utf-8", "replace")
            except SandlotError:
                text = ""
            tables.append(Names.parse(text))
        self.names[box.id] = (now, tables[0], tables[1])
        return tables[0], tables[1]

    # -- /files ---------------------------------------------------------------------------------

    async def files(self, request: Request) -> Response:
        """``GET /files?path=`` downloads a file; ``POST /files`` uploads (multipart, one
        part per file, or the body itself as ``application/octet-stream``)."""
        box: AsyncBox = await self.box_of(request)
        user = await self.user(box, request)
        if request.method == "GET":
            path = await self.path(box, request.query_params.get("path"), request)
            info = await box.files.stat(path)
            if info.is_dir:
                raise InvalidArgument(f"path {path} is a directory")
            chunks = box.files.iter_read(path)
            first = await anext(chunks, b"")  # a missing file fails here, before the 200

            async def body() -> AsyncIterator[bytes]:
                yield first
                async for chunk in chunks:
                    yield chunk

            disposition = f'attachment; filename="{posixpath.basename(path)}"'
            # no Content-Length: the file may grow or shrink while it streams
            headers = {"Content-Disposition": disposition}
            return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        metadata = _metadata_sent(request)
        written: list[dict[str, Any]] = []
        if content_type == "application/octet-stream":
            path = await self.path(box, request.query_params.get("path"), request)
            gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
            await box.files.write(path, _body(request, gzipped), user=user)
            written.append(_written(path))
        elif content_type == "multipart/form-data":
            form = await request.form(max_files=1000, max_fields=1000)
            default = request.query_params.get("path")
            try:
                parts = []
                for field, part in form.multi_items():
                    # a part with no filename is a form field: envd takes one named "file" as
                    # a file too (its content the text; where it goes, ?path=)
                    if isinstance(part, str) and field != "file":
                        continue
                    named = None if isinstance(part, str) else part.filename
                    target = default if default is not None else (named or "")
                    parts.append((await self.path(box, target, request), part))
                check(bool(parts), "the multipart body holds no file")
                if len(parts) == 1:
                    await box.files.write(parts[0][0], _upload_chunks(parts[0][1]), user=user)
                    written.append(_written(parts[0][0]))
                else:
                    written.extend(_written(p) for p in await _write_all_or_none(box, parts, user))
            finally:
                await form.close()
        else:
            got = content_type or "none"
            raise InvalidArgument(
                f"an upload is multipart/form-data or application/octet-stream, not {got!r}"
            )
        if metadata:  # a new file has none: a file written over loses what it had (envd's way)
            xattrs = {METADATA_XATTRS + key: value for key, value in metadata.items()}
            for one in written:
                await box.files.set_xattrs(one["path"], xattrs, prefix=METADATA_XATTRS)
                one["metadata"] = metadata
        return JSONResponse(written)


def _keepalive(name: str) -> Callable[[], Mapping[str, Any]] | None:
    if name in ("Start", "Connect"):
        return lambda: {"event": {"keepalive": {}}}
    if name == "WatchDir":
        return lambda: {"keepalive": {}}
    return None


async def _events(held: HeldProcess, offsets: dict[int, int], box: AsyncBox) -> AsyncIterator[dict[str, Any]]:
    """A held process's output as envd's events, from ``offsets``, then its end; or, where
    it was lost with its box (removed, stopped), the connection dropped (``Dropped``)."""
    while True:
        changed = held.changed()
        sent = False
        for stream, ring in held.rings.items():
            at, data = ring.read_from(offsets[stream])
            if data:
                kind = "pty" if held.tty else ("stdout" if stream == STDOUT else "stderr")
                yield {"event": {"data": {kind: data}}}
                sent = True
            offsets[stream] = at + len(data)
        if sent:
            continue
        if held.done and all(offsets[s] >= r.end for s, r in held.rings.items()):
            if held.error is not None and await _gone(box):
                raise Dropped(f"sandbox {box.id} ended while its process ran")
            yield {"event": {"end": _end(held)}}
            return
        await changed.wait()


async def _gone(box: AsyncBox) -> bool:
    """Whether the box no longer runs (removed, stopped or crashed), read anew."""
    try:
        return await box.refresh() not in ("running", "paused", "suspended")
    except SandlotError:
        return True


def _end(held: HeldProcess) -> dict[str, Any]:
    if held.error is not None:
        return {"exit_code": -1, "exited": False, "status": "error", "error": str(held.error)}
    result = held.result
    assert result is not None
    if result.signal is not None:
        name = _signal.Signals(result.signal).name.lower().removeprefix("sig") if result.signal in (
            s.value for s in _signal.Signals) else str(result.signal)  # fmt: skip
        return {"exit_code": -1, "exited": False, "status": f"signal: {name}"}
    return {"exit_code": result.exit_code, "exited": True, "status": f"exit status {result.exit_code}"}


async def _write_input(p: E2bProcess, data: Mapping[str, Any]) -> None:
    chunk = data.get("pty") if p.held.tty else data.get("stdin")
    if chunk is None:
        chunk = data.get("stdin", data.get("pty", b""))
    if p.held.done:
        raise ConnectError("not_found", f"process with pid {p.held.proc.pid} has exited")
    await p.held.proc.write_stdin(chunk)


def _fs_events(root: str, event: Any) -> list[dict[str, Any]]:
    """envd's events of one sandlot event: a move is a rename away and a create at the
    new path, as inotify reports it to envd; names are relative to the watched path."""

    def name(path: str) -> str:
        return posixpath.relpath(path, root) if path != root else posixpath.basename(path)

    kinds = {"created": 1, "modified": 2, "deleted": 3}
    if _is_write_temp(event.path):
        return []
    if event.type == "moved":
        if event.old_path and _is_write_temp(event.old_path):
            # sandlot's agent writes a file beside it, its owner set, and renames it into
            # place (never a half-written file): to a watcher that is the file created,
            # written and its owner set (CHMOD), as envd's own write shows it
            return [{"name": name(event.path), "type": t} for t in (1, 2, 5)]
        out = []
        if event.old_path:
            out.append({"name": name(event.old_path), "type": 4})
        out.append({"name": name(event.path), "type": 1})
        return out
    if event.type in kinds:
        return [{"name": name(event.path), "type": kinds[event.type]}]
    return []


WRITE_TEMP = re.compile(r"^\..*\.sandlot-\d+$|\.sandlot-write-\d+$")  # the agent's files.c names them so


def _is_write_temp(path: str) -> bool:
    return WRITE_TEMP.search(posixpath.basename(path)) is not None


def user_of(request: Request) -> str | None:
    """The user an envd call runs as: HTTP Basic's user name, as the SDKs send it
    (none: the box's default user)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise RequestError("the Authorization header's Basic credentials are not base64") from None
    return decoded.partition(":")[0] or None


def call_user(request: Request) -> str | None:
    """Who a call runs as: the user a signed URL was signed for (and no other), else the
    ``username`` query parameter, else HTTP Basic's user (none: the box's default user)."""
    if request.scope.get("e2b.signed"):
        return request.query_params.get("username") or None
    return request.query_params.get("username") or user_of(request)


def _metadata_sent(request: Request) -> dict[str, str]:
    """An upload's metadata: its ``X-Metadata-<key>`` headers, keys lowercased, as envd
    takes them; a key or value a header cannot carry is refused, naming it."""
    found: dict[str, str] = {}
    for name, value in request.headers.items():
        if not name.lower().startswith(METADATA_HEADER):
            continue
        key = name[len(METADATA_HEADER) :].lower()
        if not METADATA_KEY.match(key):
            raise InvalidArgument(f"metadata key {key!r} is not an HTTP header's name")
        if not METADATA_VALUE.match(value):
            raise InvalidArgument(f"metadata value of {key!r} is not printable US-ASCII")
        found[key] = value
    return found


def _metadata_of(info: FileInfo) -> dict[str, str]:
    """A file's metadata: its ``user.e2b.*`` extended attributes, the prefix left out."""
    found = (info.xattrs or {}).items()
    return {k[len(METADATA_XATTRS) :]: v for k, v in found if k.startswith(METADATA_XATTRS)}


def _written(path: str) -> dict[str, Any]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


async def _body(request: Request, gzipped: bool) -> AsyncIterator[bytes]:
    import zlib

    inflater = zlib.decompressobj(wbits=31) if gzipped else None
    async for chunk in request.stream():
        if inflater is None:
            yield chunk
            continue
        data = chunk
        while data:  # a piece at a time: a small chunk may inflate a thousandfold
            try:
                out = inflater.decompress(data, FILE_CHUNK)
            except zlib.error as e:
                raise InvalidArgument(f"the gzip body is malformed: {e}") from None
            data = inflater.unconsumed_tail
            if out:
                yield out
    if inflater is not None and not inflater.eof:
        raise InvalidArgument("the gzip body ends early")


async def _write_all_or_none(box: AsyncBox, parts: list[tuple[str, Any]], user: str | None) -> list[str]:
    """Several files of one upload (``write_files``), all or none: each is written whole
    beside its path first (keeping the mode and owner of a file it replaces), then each
    renamed into place, so a failure while they arrive (a full disk, a path that is a
    directory) leaves none of them. A rename that fails after others were done raises,
    and those done stay (renames in place hardly fail: the disk held every file)."""
    token = secrets.token_hex(4)
    staged: list[tuple[str, str]] = []
    try:
        for i, (path, part) in enumerate(parts):
            where, name = posixpath.split(path)
            temp = posixpath.join(where, f".{name[:180]}.sandlot-upload-{token}-{i}")
            mode, owner = None, user
            with contextlib.suppress(FileNotFoundError):
                info = await box.files.stat(path)
                if info.is_dir:
                    raise InvalidArgument(f"path {path} is a directory")
                mode, owner = info.mode, user or f"{info.uid}:{info.gid}"
            await box.files.write(temp, _upload_chunks(part), mode=mode, user=owner, exclusive=True)
            staged.append((temp, path))
        done: list[str] = []
        for temp, path in staged:
            await box.files.rename(temp, path)
            done.append(path)
        staged.clear()
        return done
    finally:
        for temp, _path in staged:
            with contextlib.suppress(Exception):
                await box.files.remove(temp, missing_ok=True)


async def _upload_chunks(part: Any) -> AsyncIterator[bytes]:
    if isinstance(part, str):  # a form field's text (parts with no filename are, in Starlette)
        yield part.encode()
        return
    while chunk := await part.read(FILE_CHUNK):
        yield chunk


@dataclass(frozen=True)
class Names:
    """A box's /etc/passwd or /etc/group: names by id, and (passwd) homes by name."""

    by_id: dict[int, str]
    homes: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Names:
        by_id: dict[int, str] = {}
        homes: dict[str, str] = {}
        for line in text.splitlines():
            fields = line.split(":")
            if len(fields) >= 3 and fields[2].isdigit():
                by_id.setdefault(int(fields[2]), fields[0])
            if len(fields) >= 6 and fields[5].startswith("/"):
                homes.setdefault(fields[0], fields[5])
        return cls(by_id, homes)
