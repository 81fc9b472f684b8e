"""The sandlot node actor: one per Ray node, detached, holding that node's own
sandlot home (its store, its engine, its VMs). Everything a fleet does to a box
happens here, on the node that has it; the driver's backend (``fleet/backend.py``)
only says which node.

The actor is the Ray face of ``api/host.py``, as ``sandlot serve`` is its HTTP
face: ``call`` runs any operation of ``api/contract.py``'s table, its arguments
and answer in the contract's JSON; processes are held in a ``ProcessTable`` and
followed by offset with the contract's frames (``follow``, ``send``); files,
archives, watches and code cells stream as Ray streaming generators. A sandlot
error comes back as ``{"error": ...}`` (the contract's error shape) and is raised
again as the same class by the driver, since Ray would wrap it in its own
exception. Saved state leaves a node as chunks it ``ray.put``s and enters another
as the chunks that node fetches and verifies (``transfer``).

Ray lets whoever holds an actor's handle call any method of its class, so Ray is given
``NodeActor``: the calls of ``NODE_CALLS`` and nothing else of the body. Each call's
arguments are checked against its signature (strictly: no coercion) and an operation's
against its model of the contract, as the server checks a request; what does not fit is
InvalidArgument naming it. Before its first call the actor checks that its cluster
authenticates its callers (``trust``) and refuses every call if it does not.

A driver may act for a namespace (``fleet.connect(namespace=...)``, as a key of ``sandlot
serve`` does): each of its calls carries it (``namespace=``), and the node answers by the
labels of its own boxes and snapshots, as the server does: a box of another namespace is
not found, a listing and the events hold the namespace's only, a box made or started for
it is labelled with it (``core.access``'s rules, the server's).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import functools
import inspect
import json
import os
import secrets
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray
from pydantic import ConfigDict, ValidationError, validate_call

from ..api import access, host
from ..api.backend import BoxRef, SnapshotRef
from ..api.box import AsyncBox, AsyncSnapshot
from ..api.contract import (
    BY_KEY,
    STDERR,
    STDOUT,
    STREAM_BY_KEY,
    ExecIn,
    SpawnIn,
    Stream,
    box_create,
    error_json,
    error_message,
    refusal,
    validated,
)
from ..api.local import LocalBackend, snapshot_labels
from ..api.templates import restore_moved_box_async
from ..config import atomic_write, runtime_dir
from ..core.events import query as check_events_query
from ..crashpoints import crash_point
from ..errors import (
    BoxNotFound,
    InvalidArgument,
    InvalidState,
    RequestError,
    SandlotError,
    SnapshotNotFound,
    Unsupported,
)
from ..version import __version__
from . import directory, placement, transfer, trust
from .directory import Record
from .placement import NAMESPACE

# the names of the snapshots the fleet makes to move a box or a fork's state (on the
# source, and as imported on each target): they go with the last box started from them
TRANSIENT = ("move-", "fork-", "replica-")
WORK_DIRS = ("fleet-export-*", "fleet-import-*")  # a node's temporary directories in its home
NODE_ACTOR = "sandlot-node:{}"  # a node actor's name, by its Ray node id
HELD_SWEEP = 5.0  # seconds between two looks for boxes of dead drivers' with blocks
UPLOAD_IDLE = 120.0  # seconds an upload may wait for its next chunk before it is given up
P = ParamSpec("P")
T = TypeVar("T")
Reply = dict[str, Any]
Writer = Callable[[AsyncIterator[bytes]], Awaitable[Any]]  # a write that takes its chunks as they come


STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)
# the namespace the driver of the call in progress acts for (None: every namespace); set by
# the relay of each call (``NodeActor``), read where the node finds what the call names
ASKER: contextvars.ContextVar[str | None] = contextvars.ContextVar("sandlot_fleet_namespace", default=None)
KEY_MAX = 256  # characters of a box's or a snapshot's key (an id, a name or a prefix)


def guarded(
    fn: Callable[Concatenate[NodeService, P], Awaitable[T]],
) -> Callable[Concatenate[NodeService, P], Awaitable[Reply]]:
    """A node call's result as ``{"ok": value}``, or its sandlot error as ``{"error": ...}``;
    its arguments checked against its signature first (InvalidArgument), and the first call
    of an actor waits for it to check its cluster and settle what its predecessor left."""
    checked: Callable[..., Awaitable[T]] = validate_call(config=STRICT)(fn)
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    async def call(self: NodeService, /, *args: P.args, **kwargs: P.kwargs) -> Reply:
        try:
            await self.settled()
            try:  # by name, so that a refusal names the argument
                named = signature.bind(self, *args, **kwargs).arguments
            except TypeError as exc:
                raise InvalidArgument(f"{fn.__name__}(): {exc}") from None
            try:
                value = await checked(**named)
            except ValidationError as exc:
                raise refusal(exc) from None
            return {"ok": value}
        except SandlotError as exc:
            return {"error": error_json(exc)}

    return call


def key_of(value: Any, what: str = "box") -> str:
    """A box's or a snapshot's key as a caller gave it: a short non-empty string."""
    if not isinstance(value, str) or not value or len(value) > KEY_MAX:
        raise InvalidArgument(
            f"a {what} is named by a string of 1 to {KEY_MAX} characters, not {value!r:.80}"
        )
    return value


def offered(scope: Any, name: Any) -> Any:
    """The contract's operation ``scope.name`` (``api/contract.py``'s table); nothing else runs."""
    op = BY_KEY.get(f"{scope}.{name}") if isinstance(scope, str) and isinstance(name, str) else None
    if op is None:
        raise InvalidArgument(f"{scope!r:.40}.{name!r:.60} is not an operation of the contract")
    return op


class Upload:
    """A file or an archive arriving in chunks: one task writes what a queue yields. Once
    the write ends, ``forget`` runs after UPLOAD_IDLE (the time its driver has to ask how
    it ended), so an upload its driver abandoned does not stay."""

    def __init__(self, write: Writer, forget: Callable[[], object]) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
        self.task = asyncio.ensure_future(write(self.chunks()))

        def ended(task: asyncio.Future[Any]) -> None:
            if not task.cancelled():
                task.exception()  # retrieved here: the driver may never ask
            asyncio.get_running_loop().call_later(UPLOAD_IDLE, forget)

        self.task.add_done_callback(ended)

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await asyncio.wait_for(self.queue.get(), UPLOAD_IDLE)
            except TimeoutError:
                raise RequestError(f"an upload had no chunk for {UPLOAD_IDLE:g} s and was given up") from None
            if chunk is None:
                return
            yield chunk

    async def put(self, chunk: bytes | None) -> None:
        """Hand the write a chunk (None: the end); if the write ended first, say why."""
        if not self.task.done():
            put = asyncio.ensure_future(self.queue.put(chunk))
            await asyncio.wait({put, self.task}, return_when=asyncio.FIRST_COMPLETED)
            if put.done():
                return
            put.cancel()
        await self.task  # its error
        raise RequestError("the write ended before the upload's last chunk")

    async def finish(self) -> Any:
        if not self.task.done():
            await self.put(None)
        return await self.task


class NodeService:
    """The body of a node actor (``ray.remote`` is applied by the driver)."""

    def __init__(self, node_id: str, home: str | None = None) -> None:
        self.node_id = node_id
        self.backend = LocalBackend.for_home(home)  # the node's SANDLOT_HOME (set where `ray start` runs)
        self.home = self.backend.runtime.home
        self.started_at = time.time()
        self.refs: dict[str, BoxRef] = {}
        self.moving: dict[str, dict[str, Any]] = {}
        self.processes = host.ProcessTable(self.backend)
        self.uploads: dict[str, Upload] = {}
        self.holds = self.home / "fleet" / "holds"  # the boxes held for a move, one file each
        self._settling: asyncio.Future[None] | None = None
        self._sweeping: asyncio.Future[None] | None = None
        self._trusting: asyncio.Future[Any] | None = None

    async def ref(self, key: str) -> BoxRef:
        """The box ``key`` names, if it is the caller's namespace's (else BoxNotFound, as if
        there were none)."""
        found = self.refs.get(key)
        if found is None or found.state == "removed":
            found = await self.backend.find(key)
            self.refs[found.id] = found
        if not access.visible(ASKER.get(), found.info.get("labels")):
            raise BoxNotFound(f"no box {key!r}", box=key)
        return found

    async def snapshot(self, key: str) -> SnapshotRef:
        """The snapshot ``key`` names, if its box was the caller's namespace's."""
        found = await self.backend.find_snapshot(key)
        if not access.visible(ASKER.get(), snapshot_labels(found)):
            raise SnapshotNotFound(f"no snapshot {key!r}")
        return found

    async def refuse_unseen(self, box_id: str) -> None:
        """BoxNotFound where this node has box ``box_id`` and it is not the caller's
        namespace's (one it does not have is no refusal: a move's end cleans up after it)."""
        asker = ASKER.get()
        if asker is None:
            return
        try:
            found = await self.backend.find(box_id)
        except BoxNotFound:
            return
        if not access.visible(asker, found.info.get("labels")):
            raise BoxNotFound(f"no box {box_id!r}", box=box_id)

    def info(self, ref: BoxRef) -> dict[str, Any]:
        return {**ref.info, "node": self.node_id}

    # -- the node --------------------------------------------------------------------------

    async def trusted(self) -> None:
        """Refuse to serve a cluster that does not authenticate its callers (InsecureCluster,
        unless the node's operator allowed it: ``trust.check_cluster``), checked once per
        actor. Outside Ray (the node's body run alone, as the fast tier does) there is no
        cluster to check."""
        if not ray.is_initialized():
            return
        if self._trusting is None:
            self._trusting = asyncio.ensure_future(
                asyncio.to_thread(trust.check_cluster, self.home, self.node_id)
            )
        await asyncio.shield(self._trusting)

    async def settled(self) -> None:
        """Check the cluster (``trusted``), then settle, once per actor and before its first
        call, what an earlier actor of this node left half done (``settle``)."""
        await self.trusted()
        if self._settling is None:  # the node's own work, for no caller's namespace
            loop, own = asyncio.get_running_loop(), contextvars.Context()
            self._settling = loop.create_task(self.settle(), context=own)
            self._sweeping = loop.create_task(self._sweep_unheld(), context=own)
        with contextlib.suppress(Exception):  # what it could not settle must not stop the node
            await asyncio.shield(self._settling)

    async def settle(self) -> None:
        """A node actor killed mid-move (its process, or its whole node with a host that
        comes back with its home) leaves work half done; the directory, where a move
        commits, says how each piece ends:

        - a box it held for a move goes on here as it was if the directory still places
          it here, or goes from here if the move was recorded (the box runs elsewhere);
        - a box of this home started from a moved state (a ``move-`` snapshot) that the
          directory places on another node (not lost) is a copy a move started here and
          did not record: it goes, with that state. Only such a copy: a box made here any
          other way is never this actor's to judge (were two nodes' homes one, against
          the rule, each node's own boxes would be placed "elsewhere");
        - the temporary directories of exports and imports go."""
        for pattern in WORK_DIRS:
            for work in self.home.glob(pattern):
                await asyncio.to_thread(_rmtree, work)
        placed = await self._placements()
        for path in sorted(self.holds.glob("*.json")):
            box_id = path.stem
            with contextlib.suppress(SandlotError, OSError, ValueError):
                if placed.get(box_id, self.node_id) == self.node_id:
                    await self._release(box_id)
                else:
                    await self._finish(box_id)
        for ref in await self.backend.boxes(state=None, labels=None):
            elsewhere = placed.get(ref.id)
            if elsewhere is not None and elsewhere != self.node_id:
                with contextlib.suppress(SandlotError):
                    if await self._moved_here(ref):
                        await self._remove(ref, True)

    async def _moved_here(self, ref: BoxRef) -> bool:
        """The box was started here from a state a move brought (a ``move-`` snapshot)."""
        origin = (await self.backend.box_inspect(ref)).get("origin")
        if not origin:
            return False
        snap = await self.backend.find_snapshot(origin)
        return (snap.info.get("name") or "").startswith("move-")

    async def _sweep_unheld(self) -> None:
        while True:
            await asyncio.sleep(HELD_SWEEP)
            with contextlib.suppress(Exception):  # a directory restarting: the next round
                await self.end_unheld()

    async def end_unheld(self) -> builtins.list[str]:
        """Remove this node's boxes of ``with`` blocks whose driver died (the driver's mark,
        an actor its job owns, is gone), with their replicas and reservations, as the
        driver would have at the block's end. The ids of the boxes removed."""
        found = await _directory_records()
        if found is None:
            return []
        book, records = found
        ended = []
        for rec in records:
            mark = rec.get("held_by")
            if not mark or rec.get("node") != self.node_id or rec.get("state") == directory.LOST:
                continue
            if await asyncio.to_thread(actor_lives, mark):
                continue
            with contextlib.suppress(BoxNotFound):
                await self._remove(await self.ref(rec["id"]), True)
            replica = rec.get("replica")
            if replica:
                with contextlib.suppress(ValueError, ray.exceptions.RayError):
                    node = ray.get_actor(node_actor_name(replica["node"]), namespace=NAMESPACE)
                    await node.drop_snapshot.remote(replica["snapshot"])
            for name in await book.release.remote(rec["id"]):
                await asyncio.to_thread(placement.release, name)
            ended.append(rec["id"])
        return ended

    async def _placements(self) -> dict[str, str]:
        """The node of each box the directory does not count lost (none if it does not run)."""
        found = await _directory_records()
        records = found[1] if found is not None else []
        return {r["id"]: r["node"] for r in records if r.get("state") != directory.LOST}

    async def facts(self) -> dict[str, Any]:
        await self.settled()
        boxes = await self.backend.boxes(state=None, labels=None)
        return {
            "node_id": self.node_id,
            "home": str(self.home),
            "version": __version__,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "runtime_dir": str(runtime_dir()),
            "started_at": self.started_at,
            "boxes": len(boxes),
            "running": sum(1 for b in boxes if b.state == "running"),
            "storage_tier": await asyncio.to_thread(_tier_url, self.home),
        }

    @guarded
    async def list(self) -> builtins.list[dict[str, Any]]:
        """This node's boxes (the caller's namespace's)."""
        asker = ASKER.get()
        boxes = await self.backend.boxes(state=None, labels=None)
        return [self.info(r) for r in boxes if access.visible(asker, r.info.get("labels"))]

    # -- the contract ------------------------------------------------------------------------

    @guarded
    async def create(self, image: str | None, body: dict[str, Any], start: bool) -> dict[str, Any]:
        """A box made here from ``contract.BoxCreate``'s fields (validated again here)."""
        wanted = box_create(image, body, "ray")
        asker = ASKER.get()  # the labels a caller gives: never sandlot's own, unless it acts for all
        wanted["labels"] = access.stamped(asker, wanted.get("labels"), admin=asker is None)
        image, options = wanted.get("image"), host.box_options(wanted)
        ref = self.backend.describe(image, options, keep=True)
        await self.backend.create(ref, start=start)
        self.refs[ref.id] = ref
        return self.info(ref)

    @guarded
    async def call(self, scope: str, name: str, key: str, params: dict[str, Any]) -> Any:
        """Operation ``scope.name`` on box or snapshot ``key``: the answer in the contract's JSON."""
        op = offered(scope, name)
        key_of(key, scope)
        args = host.arguments(op, params)
        if op.answers == "host":  # what this node holds for its clients
            return await self.processes.listed(await self.ref(key))
        if op.answers == "server":
            raise Unsupported(
                f"{op.name}() is not offered over the ray transport: only a sandlot serve answers it "
                "(it signs with its key)",
                transport="ray",
            )
        target: Any = await self.ref(key) if scope != "snapshot" else await self.snapshot(key)
        asker = ASKER.get()
        if op.stamps and asker is not None:  # the caller's, as the server's are
            kept = access.own_labels(snapshot_labels(target))
            args = args.model_copy(update={"labels": {**kept, **access.stamped(asker, args.labels)}})  # type: ignore[attr-defined]
        if op.removes:
            await self._remove(target, bool(args.force))  # type: ignore[attr-defined]
            return None
        answer = await host.run(self.backend, op, target, args)
        if op.result.kind == "box":
            answer = self.info(target)
        elif op.result.kind == "boxes":
            answer = {"boxes": [{**b, "node": self.node_id} for b in answer["boxes"]]}
        elif op.result.kind in ("snapshot", "snapshots"):
            answer = node_snapshots(answer, self.node_id)
        return answer

    @guarded
    async def exec(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        return await host.run_exec(self.backend, await self.ref(key), validated(ExecIn, body))

    @guarded
    async def spawn(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        held = await self.processes.spawn(await self.ref(key), validated(SpawnIn, body))
        return {"id": held.id, "pid": held.proc.pid}

    async def follow(self, key: str, process_id: str, offsets: tuple[int, int]) -> AsyncIterator[bytes | str]:
        """A held process's frames from ``offsets`` (a Ray streaming generator)."""
        try:
            await self.settled()
            if not (isinstance(offsets, tuple | builtins.list) and len(offsets) == 2
                    and all(type(o) is int and o >= 0 for o in offsets)):  # fmt: skip
                raise InvalidArgument(f"offsets are two counts of bytes, not {offsets!r:.80}")
            held = await self.processes.found(await self.ref(key_of(key)), key_of(process_id, "process"))
        except SandlotError as exc:
            yield json.dumps(error_message(exc))  # a process's frames are text or bytes
            return
        async for frame in held.frames({STDOUT: offsets[0], STDERR: offsets[1]}):
            yield frame

    @guarded
    async def send(self, key: str, process_id: str, frame: bytes | str) -> str | None:
        """A client's frame to a held process (stdin bytes, or a control message)."""
        await self.ref(key_of(key))
        return await self.processes.find(key, process_id).take_input(frame)

    async def stream(self, stream_key: str, key: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """Server stream ``stream_key`` of ``contract.STREAMS`` on box ``key``, as a Ray
        streaming generator (``host.STREAMED`` runs it); a sandlot error is its last message."""
        try:
            await self.settled()
            stream = _stream(stream_key, "server")
            if not isinstance(body, dict):
                raise InvalidArgument(f"a stream's arguments are an object, not {type(body).__name__}")
            params = stream.arguments(body)
            async for item in host.STREAMED[stream.key](self.backend, await self.ref(key_of(key)), params):
                yield item
        except SandlotError as exc:
            yield error_message(exc)

    async def events(self, body: dict[str, Any]) -> AsyncIterator[Any]:
        """This node's events (``Backend.events``: ``box``, ``since``, ``after``, ``follow``),
        each as its JSON, as a Ray streaming generator; a sandlot error is the last message."""
        try:
            await self.settled()
            if not isinstance(body, dict):
                raise InvalidArgument(f"an events query is an object, not {type(body).__name__}")
            box, since, after = check_events_query(body.get("box"), body.get("since"), body.get("after"))
            asker = ASKER.get()
            found = self.backend.events(box=box, since=since, after=after, follow=bool(body.get("follow")))
            async for ev in found:
                if access.visible(asker, ev.labels):
                    yield ev.to_json()
        except SandlotError as exc:
            yield error_message(exc)

    @guarded
    async def upload_begin(self, key: str, stream_key: str, body: dict[str, Any]) -> str:
        """Begin client stream ``stream_key`` of ``contract.STREAMS`` on box ``key`` (a
        file, an archive), whose bytes arrive in chunks (``upload_chunk``; ``upload_end``
        answers how it ended, ``upload_abort`` gives it up)."""
        ref = await self.ref(key)
        stream = _stream(stream_key, "client")
        write = functools.partial(host.TAKEN[stream.key], self.backend, ref, stream.arguments(body))
        upload_id = secrets.token_hex(8)
        self.uploads[upload_id] = Upload(write, lambda: self.uploads.pop(upload_id, None))
        return upload_id

    @guarded
    async def upload_chunk(self, upload_id: str, data: bytes) -> None:
        await self._upload(upload_id).put(data)

    @guarded
    async def upload_end(self, upload_id: str) -> Any:
        try:
            return await self._upload(upload_id).finish()
        finally:
            self.uploads.pop(upload_id, None)

    @guarded
    async def upload_abort(self, upload_id: str) -> None:
        upload = self.uploads.pop(upload_id, None)
        if upload is not None:
            upload.task.cancel()

    def _upload(self, upload_id: str) -> Upload:
        upload = self.uploads.get(upload_id)
        if upload is None:
            raise RequestError(f"no upload {upload_id!r} (it ended, or waited too long for its next chunk)")
        return upload

    @guarded
    async def find_snapshot(self, key: str) -> dict[str, Any]:
        return {**(await self.snapshot(key)).info, "node": self.node_id}

    @guarded
    async def snapshot_list(self, box: str | None, kind: str | None) -> builtins.list[dict[str, Any]]:
        asker = ASKER.get()
        return [
            {**s.info, "node": self.node_id}
            for s in await self.backend.snapshot_list(box=box, kind=kind)
            if access.visible(asker, snapshot_labels(s))
        ]

    @guarded
    async def remove(self, key: str, force: bool) -> None:
        try:
            ref = await self.ref(key)
        except BoxNotFound:  # a box already gone is removed
            return
        await self._remove(ref, force)

    async def _remove(self, ref: BoxRef, force: bool) -> None:
        """Remove a box, and the state the fleet moved here for it once no box needs it."""
        origin = (await self.backend.box_inspect(ref)).get("origin")
        await self.backend.box_remove(ref, force=force)
        self.refs.pop(ref.id, None)
        if origin:
            with contextlib.suppress(SandlotError):  # SnapshotInUse: other children still need it
                snap = await self.backend.find_snapshot(origin)
                if (snap.info.get("name") or "").startswith(TRANSIENT):
                    await self.backend.snapshot_remove(snap)

    # -- live state across nodes -------------------------------------------------------------

    @guarded
    async def start_from(
        self,
        snapshot: str,
        n: int,
        name: str | None,
        box_id: str | None,
        labels: Mapping[str, str],
        as_prefix: bool = False,
    ) -> builtins.list[dict[str, Any]]:
        """Start boxes from a snapshot of this home; ``as_prefix``: ``name`` is the prefix
        of their names even for one (a fork's child)."""
        if as_prefix and name is not None:
            name = prefixed(name)
        snap = AsyncSnapshot(await self.snapshot(snapshot))
        kids = await start_boxes(snap, n, name, box_id, stamped(labels), self.home)
        self.refs.update({k.id: k.ref for k in kids})
        return [self.info(k.ref) for k in kids]

    @guarded
    async def drop_snapshot(self, snapshot: str) -> None:
        with contextlib.suppress(SandlotError):
            await self.backend.snapshot_remove(await self.snapshot(snapshot))

    # -- moving saved state ----------------------------------------------------------------

    @guarded
    async def export(self, snapshot: str, since: str | None = None) -> dict[str, Any]:
        """A snapshot of this node as chunks in the object store: their descriptions and
        references (owned by this actor, which lives as long as the node); ``since``: only
        what changed after that snapshot."""
        snap = await self.snapshot(snapshot)
        base = await self.snapshot(since) if since is not None else None
        work = Path(tempfile.mkdtemp(prefix="fleet-export-", dir=self.home))
        try:
            t0 = time.monotonic()
            path = await self.backend.export(snap, work / "state.sandlot", base)
            crash_point("fleet.export-after-save")
            saved = time.monotonic() - t0
            moved = await transfer.offer(path, ray.put)
            return {**moved, "export_s": saved, "snapshot": {**snap.info, "node": self.node_id}}
        finally:
            await asyncio.to_thread(_rmtree, work)

    @guarded
    async def import_state(self, moved: dict[str, Any], start: dict[str, Any] | None) -> dict[str, Any]:
        """Fetch and verify the chunks of a moved snapshot, import it into this home
        (the archive's own integrity and compatibility checks apply), and with
        ``start`` ({"n", "name", "box_id", "labels"}) start boxes from it."""
        labels = stamped((start or {}).get("labels") or {})  # refused before anything is fetched
        work = Path(tempfile.mkdtemp(prefix="fleet-import-", dir=self.home))
        try:
            t0 = time.monotonic()
            archive = await transfer.receive(moved, work / "state.sandlot")
            fetched_s = time.monotonic() - t0
            t1 = time.monotonic()
            made = await self.backend.import_snapshot(archive, name=None, start=False, options={},
                                                      namespace=ASKER.get())  # fmt: skip
            assert isinstance(made, SnapshotRef)
            snap = AsyncSnapshot(made)
            imported_s = time.monotonic() - t1
        finally:
            await asyncio.to_thread(_rmtree, work)
        out: dict[str, Any] = {"snapshot": snap.id, "fetch_s": fetched_s, "import_s": imported_s, "boxes": []}
        if start is not None:
            t2 = time.monotonic()
            try:
                name = start.get("name")
                if start.get("as_prefix") and name is not None:
                    name = prefixed(name)
                kids = await start_boxes(
                    snap, start.get("n", 1), name, start.get("box_id"), labels, self.home
                )
            except BaseException:
                with contextlib.suppress(SandlotError):
                    await snap.remove()  # nothing half-moved stays behind
                raise
            crash_point("fleet.import-after-start")
            self.refs.update({k.id: k.ref for k in kids})
            out["boxes"] = [self.info(k.ref) for k in kids]
            out["start_s"] = time.monotonic() - t2
        return out

    # -- moving a box through the storage tier (docs/storage.md) -------------------------------

    async def _movable(self, box_id: str) -> tuple[AsyncBox, str]:
        """The box, and its state, if it may move with its processes (running, paused or suspended)."""
        box = AsyncBox.bound(await self.ref(box_id))
        await box.refresh()
        was = box.state
        if was not in ("running", "paused", "suspended"):
            raise InvalidArgument(
                f"box {box.name} is {was}: only a running, paused or suspended box moves with its processes",
            )
        return box, was

    @guarded
    async def push_box(self, box_id: str) -> dict[str, Any]:
        """Send a box to the home's storage tier for a move, and let it go from this node:
        a running or paused one is suspended first (its processes move with it)."""
        from ..api import storage

        box, was = await self._movable(box_id)
        t0 = time.monotonic()
        if was != "suspended":
            await box.suspend()
        t1 = time.monotonic()
        report = await asyncio.to_thread(storage.push, box_id, release=True, home=self.home)
        self.refs.pop(box_id, None)
        return {"was": was, "suspend_s": t1 - t0, "push_s": time.monotonic() - t1, "chunks": report.chunks,
                "bytes": report.bytes}  # fmt: skip

    @guarded
    async def pull_box(self, box_id: str, force: bool, state: str) -> dict[str, Any]:
        """Take a box from the home's storage tier onto this node, and bring it to ``state``
        ("running", "paused" or "suspended"). ``force``: its holder is known to be dead."""
        from ..api import storage

        if ASKER.get() is not None and not await self._in_tier(box_id):
            raise BoxNotFound(f"no box {box_id!r} in the storage tier", box=box_id)
        t0 = time.monotonic()
        await asyncio.to_thread(storage.pull_id, box_id, force=force, home=self.home)
        t1 = time.monotonic()
        ref = await self.ref(box_id)
        box = AsyncBox.bound(ref)
        try:
            if state in ("running", "paused"):
                await box.resume()
            if state == "paused":
                await box.pause()
        except BaseException:
            with contextlib.suppress(SandlotError):  # it goes back to the tier for another node
                await asyncio.to_thread(storage.push, box_id, release=True, home=self.home)
                self.refs.pop(box_id, None)
            raise
        return {**self.info(ref), "pull_s": t1 - t0, "start_s": time.monotonic() - t1}

    @guarded
    async def tier_holds(self, box_id: str) -> bool:
        """Whether the home's storage tier holds this box (a suspended box of a dead node
        that its pusher sent; the caller's namespace's)."""
        return await self._in_tier(box_id)

    async def _in_tier(self, box_id: str) -> bool:
        from ..api import storage

        asker = ASKER.get()

        def look() -> bool:
            found = storage.box(box_id, home=self.home)
            return found is not None and access.visible(asker, found["labels"])

        return await asyncio.to_thread(look) if _tier_url(self.home) else False

    @guarded
    async def hold(self, box_id: str) -> dict[str, Any]:
        """Freeze a box for a move: a suspended one is resumed first; then it is paused
        and snapshotted (the state that moves). ``release`` undoes this, ``finish`` ends
        the box here once it runs elsewhere. The hold is a file of the home, so that
        the next actor of this node ends it if this one dies (``settle``)."""
        if box_id in self.moving or self._hold_file(box_id).exists():
            raise InvalidState(f"box {box_id} is being moved already", box=box_id, state="moving")
        box, was = await self._movable(box_id)
        t0 = time.monotonic()
        self._write_hold(box_id, {"was": was, "snapshot": None})
        try:
            if was == "suspended":
                await box.resume()
            if box.state == "running":
                await box.pause()
            snap = await box.snapshot(f"move-{secrets.token_hex(4)}")
        except BaseException:
            await self._undo_hold(box, was)
            self._hold_file(box_id).unlink(missing_ok=True)
            raise
        self.moving[box_id] = {"was": was, "snapshot": snap.id}
        self._write_hold(box_id, self.moving[box_id])
        return {"was": was, "snapshot": snap.id, "hold_s": time.monotonic() - t0}

    def _hold_file(self, box_id: str) -> Path:
        return self.holds / f"{box_id}.json"

    def _write_hold(self, box_id: str, held: dict[str, Any]) -> None:
        atomic_write(self._hold_file(box_id), json.dumps(held).encode())

    def _take_hold(self, box_id: str) -> dict[str, Any] | None:
        """The hold of a box, this actor's or an earlier one's, ended for the caller."""
        held = self.moving.pop(box_id, None)
        path = self._hold_file(box_id)
        if held is None and path.exists():
            held = json.loads(path.read_text())
        path.unlink(missing_ok=True)
        return held

    async def _undo_hold(self, box: AsyncBox, was: str) -> None:
        with contextlib.suppress(SandlotError):
            await box.refresh()
            if was in ("running", "suspended") and box.state == "paused":
                await box.unpause()
            if was == "suspended":
                await box.suspend()

    async def _drop_move_snapshot(self, held: Mapping[str, Any]) -> None:
        if held.get("snapshot"):
            with contextlib.suppress(SandlotError):
                await self.backend.snapshot_remove(await self.backend.find_snapshot(held["snapshot"]))

    @guarded
    async def release(self, box_id: str) -> None:
        """A move failed: the box goes on here as it was."""
        await self.refuse_unseen(box_id)
        await self._release(box_id)

    async def _release(self, box_id: str) -> None:
        held = self._take_hold(box_id)
        if held is None:
            return
        await self._drop_move_snapshot(held)
        await self._undo_hold(AsyncBox.bound(await self.ref(box_id)), held["was"])

    @guarded
    async def finish(self, box_id: str) -> None:
        """A move succeeded: the box and its move snapshot go from this node."""
        await self.refuse_unseen(box_id)
        await self._finish(box_id)

    async def _finish(self, box_id: str) -> None:
        held = self._take_hold(box_id)
        with contextlib.suppress(BoxNotFound):
            await self._remove(await self.ref(box_id), True)  # and the state moved here for it
        if held is not None:
            await self._drop_move_snapshot(held)


# What a driver may call on a node actor: the contract's operations (``call``, and the
# commands, processes, files and streams the table does not carry) and the fleet's own
# moves of saved state. The body's other methods are its own.
NODE_CALLS = (
    "facts", "list", "create", "call", "exec", "spawn", "follow", "send", "stream", "events",
    "upload_begin", "upload_chunk", "upload_end", "upload_abort", "find_snapshot", "snapshot_list",
    "remove", "start_from", "drop_snapshot", "export", "import_state", "push_box", "pull_box",
    "tier_holds", "hold", "release", "finish",
)  # fmt: skip


def _relayed(name: str) -> Callable[..., Any]:
    """``NodeService.<name>`` as a method of ``NodeActor``, of the same kind (a coroutine or
    an async generator: Ray streams the one and awaits the other) and signature, with one
    keyword more: ``namespace``, the one its driver acts for (``ASKER`` while it runs)."""
    fn = getattr(NodeService, name)
    if inspect.isasyncgenfunction(fn):

        async def streamed(
            self: NodeActor, /, *args: Any, namespace: Any = None, **kwargs: Any
        ) -> AsyncIterator[Any]:
            try:
                acting_for(namespace)
            except SandlotError as exc:
                yield error_message(exc)
                return
            async for item in getattr(self.body, name)(*args, **kwargs):
                yield item

        relay: Callable[..., Any] = streamed
    else:

        async def called(self: NodeActor, /, *args: Any, namespace: Any = None, **kwargs: Any) -> Any:
            try:
                acting_for(namespace)
            except SandlotError as exc:
                return {"error": error_json(exc)}
            return await getattr(self.body, name)(*args, **kwargs)

        relay = called
    functools.update_wrapper(relay, fn)
    del relay.__wrapped__  # type: ignore[attr-defined]  # Ray unwraps a method to read its signature
    body = inspect.signature(fn)
    scoped = inspect.Parameter(
        "namespace", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None"
    )
    relay.__signature__ = body.replace(parameters=[*body.parameters.values(), scoped])  # type: ignore[attr-defined]
    return relay


def acting_for(namespace: Any) -> None:
    """The call in progress is for ``namespace`` (checked). (A function of the module: Ray
    pickles the relays by value, and with them what they name, which a ContextVar is not.)"""
    ASKER.set(None if namespace is None else access.check_namespace(namespace))


class NodeActor:
    """The node actor as Ray sees it: ``NODE_CALLS``, each relayed to a ``NodeService``."""

    def __init__(self, node_id: str, home: str | None = None) -> None:
        self.body = NodeService(node_id, home)


for _name in NODE_CALLS:
    setattr(NodeActor, _name, _relayed(_name))


async def _directory_records() -> tuple[Any, builtins.list[Record]] | None:
    """The directory actor and its records, if it runs (a node never starts it). Outside
    Ray (the node's body run alone, as the fast tier does) there is none: asking Ray for an
    actor there would start a local cluster (7-20 s and processes that outlive the call)."""
    if not ray.is_initialized():
        return None
    try:
        book = ray.get_actor(directory.NAME, namespace=NAMESPACE)
        return book, await book.all.remote()
    except (ValueError, ray.exceptions.RayError):
        return None


def actor_lives(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _tier_url(home: Path) -> str | None:
    from ..api import storage

    with contextlib.suppress(SandlotError):
        return storage.tier_url(home=home)
    return None


def node_actor_name(node_id: str) -> str:
    return NODE_ACTOR.format(node_id)


def node_snapshots(answer: Any, node: str) -> Any:
    if isinstance(answer, dict) and isinstance(answer.get("snapshots"), builtins.list):
        return {"snapshots": [{**s, "node": node} for s in answer["snapshots"]]}
    return {**answer, "node": node}


async def start_boxes(
    snap: AsyncSnapshot, n: int, name: str | None, box_id: str | None, labels: Mapping[str, str], home: Path
) -> builtins.list[AsyncBox]:
    """Boxes from a snapshot of this home: a moved box under its own id and name, or
    ``n`` new ones (a fork's children)."""
    if box_id is not None:
        if name is None:
            raise InvalidArgument("a moved box keeps its name; give it")
        return [await restore_moved_box_async(snap, box_id=box_id, name=name, labels=dict(labels), home=home)]
    return await snap.start(n, name=name, labels=dict(labels))


def stamped(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels of boxes started for the caller from a state (a fork's, a move's): those
    of the box the state was taken of, which the driver passes on, stamped with the
    caller's namespace (whatever namespace they claim)."""
    return access.stamped(ASKER.get(), labels, admin=True)


def prefixed(name: str) -> str:
    """A child's own name under a fork's prefix: ``snap.start`` takes one box's name as
    exact, and the children of one fork on several nodes must not share one (the prefix
    cut to leave room within a name's 63 characters)."""
    return f"{name[:56]}-{secrets.token_hex(3)}"


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _stream(key: str, kind: str) -> Stream:
    stream = STREAM_BY_KEY.get(key) if isinstance(key, str) else None
    if stream is None or stream.kind != kind:
        raise InvalidArgument(f"no {kind} stream {key!r} (contract.STREAMS)")
    return stream
