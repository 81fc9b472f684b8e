"""The Ray backend: the boxes of a fleet, reached through the actor of the node that
has each (``fleet/node.py``). A fleet box is a ``sandlot.Box`` like any other; this
module is what its calls become.

Every operation of ``api/contract.py``'s table is one actor call (``call``) with
the contract's JSON in and out; commands, held processes (followed with the
contract's frames over a Ray streaming generator, input by actor calls), files,
archives, watches and code cells stream as the HTTP backend's do over a server.
Where a box is comes from the directory actor (``fleet/directory.py``); placement
(what a new box, a fork's children or a started snapshot reserve) goes through
Ray's scheduler (``fleet/placement.py``). Saved state moves between the driver and
a node as checksummed chunks through the object store (``fleet/transfer.py``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import ray

from ..api.backend import Backend, BoxRef, SnapshotRef
from ..api.code import Callbacks, Execution, code_event
from ..api.contract import (
    BoxOut,
    SnapshotOut,
    box_create,
    exec_result,
    file_event,
    operation,
    raise_if_error,
)
from ..api.follow import FollowedProcess, Link, LinkClosed
from ..api.fs import FileEvent, WatchSource
from ..api.process import AsyncProcess, ExecResult
from ..core.spec import DEFAULT_MEMORY_MIB
from ..errors import (
    BoxNotFound,
    InvalidArgument,
    InvalidState,
    NotFound,
    ProtocolError,
    SandlotError,
    from_dict,
)
from . import placement, transfer
from .directory import LOST, Record, new_record


class Fleet(Protocol):
    """What the backend asks of its fleet (``client.Fleet``): the actors, and placement."""

    placement_timeout: float

    def directory(self) -> Any: ...

    def node(self, node_id: str) -> Any: ...

    def resolve_node(self, key: str) -> str: ...

    def reserve_spread(self, one: dict[str, float], timeout: float) -> placement.Reservation: ...


INLINE_STDIN = 64 << 20  # stdin up to this size travels with an exec's call (the object store carries it)
CHUNK = 1 << 20  # bytes of a file or archive per upload call


def unwrap(reply: Mapping[str, Any]) -> Any:
    """A node call's value, or its error raised again as the same sandlot class."""
    if "error" in reply:
        raise from_dict(reply["error"])
    return reply["ok"]


async def got(ref: Any) -> Any:
    """An actor call's answer, awaited; a node's error reply, or a sandlot error the
    directory raised, is raised as itself."""
    try:
        value = await ref
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, SandlotError):
            raise exc.cause from None
        raise
    if isinstance(value, dict) and ("ok" in value or "error" in value) and len(value) == 1:
        return unwrap(value)
    return value


def box_bundle(rec: Mapping[str, Any]) -> dict[str, float]:
    """What a box of this record reserves."""
    return placement.bundle(rec.get("cpus") or 1, rec.get("memory_mib") or DEFAULT_MEMORY_MIB)


class RayBoxRef(BoxRef):
    """A fleet box: its directory record (its node, reservation, replica), or the box to make."""

    def __init__(
        self, backend: RayBackend, rec: Record | None, pending: dict[str, Any] | None = None
    ) -> None:
        self.backend = backend
        self.rec = rec
        self.pending = pending  # image, body (contract.BoxCreate) and placement of a box to make
        self.removed = False

    @property
    def id(self) -> str:
        self.need_made()
        assert self.rec is not None
        return str(self.rec["id"])

    @property
    def name(self) -> str:
        if self.rec is None:
            return str(((self.pending or {}).get("body") or {}).get("name") or "")
        return str(self.rec["name"])

    @property
    def state(self) -> str:
        if self.removed:
            return "removed"
        return "new" if self.rec is None else str(self.rec.get("state"))

    @property
    def info(self) -> dict[str, Any]:
        self.need_made()
        assert self.rec is not None
        return {k: self.rec.get(k) for k in BoxOut.model_fields} | {
            "labels": dict(self.rec.get("labels") or {})
        }

    @property
    def node(self) -> str:
        return str(self.info["node"])

    def update(self, info: Mapping[str, Any]) -> None:
        assert self.rec is not None
        self.rec = {**self.rec, **{k: v for k, v in info.items() if k in BoxOut.model_fields}}


class RaySnapshotRef(SnapshotRef):
    def __init__(self, backend: RayBackend, rec: Mapping[str, Any]) -> None:
        self.backend = backend
        self.rec = SnapshotOut.model_validate(rec).model_dump()
        if not self.rec.get("node"):
            raise ProtocolError(f"a fleet snapshot's description names no node: {dict(rec)!r:.200}")

    @property
    def info(self) -> dict[str, Any]:
        return self.rec

    @property
    def node(self) -> str:
        return str(self.rec["node"])


class RayLink:
    """A held process on a node as a ``follow.Link``: frames from a streaming generator
    of the node's ``follow``, input by its ``send``."""

    def __init__(self, actor: Any, key: str, process_id: str, offsets: tuple[int, int]) -> None:
        self.actor, self.key, self.process_id = actor, key, process_id
        self.gen = actor.follow.options(num_returns="streaming").remote(key, process_id, offsets)

    async def recv(self) -> str | bytes:
        try:
            ref = await self.gen.__anext__()
            frame = await ref
        except StopAsyncIteration:
            raise LinkClosed from None
        except ray.exceptions.RayError:
            raise LinkClosed from None
        if not isinstance(frame, str | bytes):
            raise ProtocolError(f"a node sent a frame of type {type(frame).__name__}")
        return frame

    async def send(self, message: str | bytes) -> None:
        try:
            await got(self.actor.send.remote(self.key, self.process_id, message))
        except ray.exceptions.RayError:
            raise LinkClosed from None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.cancel(self.gen)


class RayWatch:
    """A watch on a node: its messages from a streaming generator, read by a task of its own."""

    def __init__(self, gen: Any, where: str) -> None:
        self._gen = gen
        self._where = where
        self._events: asyncio.Queue[FileEvent | BaseException | None] = asyncio.Queue(1024)
        self._reader: asyncio.Task[None] | None = None
        self._done = False

    async def open(self) -> RayWatch:
        first = await self._message()
        if first is None or first.get("type") != "watching":
            raise ProtocolError(f"{self._where}: a watch began with {first!r:.200}")
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _message(self) -> dict[str, Any] | None:
        try:
            msg = await (await self._gen.__anext__())
        except StopAsyncIteration:
            return None
        raise_if_error(msg)
        return dict(msg)

    async def _read(self) -> None:
        item: FileEvent | BaseException | None
        try:
            while True:
                msg = await self._message()
                if msg is None:
                    item = None
                    break
                if msg.get("type") == "ping":
                    continue
                if msg.get("type") == "end":
                    item = None
                    break
                await self._events.put(file_event(msg, self._where))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            item = e
        await self._events.put(item)

    async def next(self) -> FileEvent | None:
        if self._done:
            return None
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is None:
            self._done = True
        return item

    async def aclose(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        with contextlib.suppress(Exception):
            ray.cancel(self._gen)


class RayBackend(Backend):
    """The boxes of a fleet (made by ``Fleet``)."""

    transport: ClassVar[str] = "ray"
    inline_stdin: ClassVar[int] = INLINE_STDIN

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def __repr__(self) -> str:
        return "<RayBackend>"

    def actor(self, ref: RayBoxRef) -> Any:
        rec = ref.rec
        assert rec is not None
        if rec["state"] == LOST:
            raise InvalidState(
                f"box {rec['name']} is lost: its node {rec['node'][:12]} died at "
                f"{time.strftime('%H:%M:%S', time.localtime(rec['lost']['at']))}",
                box=rec["name"],
                state=LOST,
            )
        return self.fleet.node(rec["node"])

    async def ask(self, ref: RayBoxRef, call: Any) -> Any:
        """A node call about a box; a node that died meanwhile makes the box lost (InvalidState)."""
        try:
            return await got(call)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            await self.reconcile()
            await self.reread(ref)
            self.actor(ref)  # raises InvalidState(lost) if its node is gone
            raise

    async def reread(self, ref: RayBoxRef) -> Record:
        ref.rec = await got(self.fleet.directory().get.remote(ref.id))
        return ref.rec

    async def record(self, ref: RayBoxRef, changes: Mapping[str, Any]) -> None:
        """The box's directory record, changed (its state after an operation...)."""
        updated = await got(self.fleet.directory().update.remote(ref.id, dict(changes)))
        if updated is not None:
            ref.rec = updated

    async def reconcile(self) -> list[Record]:
        """Make the directory agree with the live nodes (``directory.reconcile``), give back
        the reservations of boxes dropped or lost, and return the records."""
        alive = [n["NodeID"] for n in await asyncio.to_thread(placement.sandlot_nodes)]
        seen: dict[str, Any] = {}
        for nid in alive:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError, SandlotError):
                seen[nid] = await asyncio.wait_for(got(self.fleet.node(nid).list.remote()), 30)
        records, released = await got(self.fleet.directory().reconcile.remote(alive, seen))
        for name in released:
            await asyncio.to_thread(placement.release, name)
        return list(records)

    # -- boxes ------------------------------------------------------------------------------

    def describe(self, image: Any, options: Mapping[str, Any], *, keep: bool) -> RayBoxRef:
        opts = dict(options)
        where = {k: opts.pop(k) for k in ("strategy", "node", "replicas", "placement_timeout") if k in opts}
        if "home" in opts:
            raise self.unsupported("home=", hint="a fleet box lives in its node's home")
        if where.get("replicas", 0) not in (0, 1):
            raise InvalidArgument("replicas is 0 or 1")
        if where.get("strategy", "pack") not in ("pack", "spread"):
            raise InvalidArgument(f"strategy must be 'pack' or 'spread', not {where['strategy']!r}")
        body = box_create(image, opts, self.transport)
        return RayBoxRef(self, None, {"image": body.pop("image", None), "body": body, "where": where})

    async def create(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> None:
        box = ray_box(ref)
        if box.pending is not None:
            pending, box.pending = box.pending, None
            try:
                box.rec = await self.place(pending, start=start and not ephemeral)
            except BaseException:
                box.pending = pending
                raise
            if not (start and ephemeral):
                return
        elif not start:
            return
        try:
            await self.call("box", "start", box, {})
        except BaseException:
            if ephemeral:
                with contextlib.suppress(Exception):
                    await self.call("box", "remove", box, {"force": True})
            raise

    async def place(self, pending: dict[str, Any], *, start: bool) -> Record:
        """A box made on the node Ray's scheduler picks (or the node asked for), its room
        reserved first (NoCapacity if none in time), and its directory record."""
        body, where = pending["body"], pending["where"]
        cpus, memory = int(body.get("cpus") or 1), int(body.get("memory_mib") or DEFAULT_MEMORY_MIB)
        target = self.fleet.resolve_node(where["node"]) if where.get("node") else None
        one = placement.bundle(cpus, memory)
        timeout = where.get("placement_timeout") or self.fleet.placement_timeout
        if where.get("strategy") == "spread" and target is None:
            res = await asyncio.to_thread(self.fleet.reserve_spread, one, timeout)
        else:
            res = await asyncio.to_thread(
                placement.reserve, [one], strategy=where.get("strategy", "pack"), node=target, timeout=timeout
            )
        node = res.nodes[0]
        try:
            made = await got(self.fleet.node(node).create.remote(pending["image"], body, start))
        except BaseException:
            await asyncio.to_thread(placement.release, res.name)
            raise
        rec = new_record(made, node, time.time(), reservation=res.name, replicas=where.get("replicas", 0))
        created: Record = await got(self.fleet.directory().put.remote(rec))
        return created

    async def find(self, key: str) -> RayBoxRef:
        try:
            return RayBoxRef(self, await got(self.fleet.directory().get.remote(key)))
        except BoxNotFound:
            await self.reconcile()  # perhaps a box the directory has not seen yet
            return RayBoxRef(self, await got(self.fleet.directory().get.remote(key)))

    async def boxes(self, *, state: str | None, labels: Mapping[str, str] | None) -> list[BoxRef]:
        out: list[BoxRef] = []
        for rec in await self.reconcile():
            if labels and any(rec["labels"].get(k) != v for k, v in labels.items()):
                continue
            if state is not None and rec["state"] != state:
                continue
            out.append(RayBoxRef(self, rec))
        return out

    async def call(self, scope: str, name: str, target: Any, args: dict[str, Any]) -> Any:
        op = operation(scope, name)  # type: ignore[arg-type]
        params = op.arguments(args).model_dump()
        if scope == "snapshot":
            snap = ray_snapshot(target)
            if name == "start":
                return await self.start_snapshot(snap, params)
            value = op.result.decode(
                await got(self.fleet.node(snap.node).call.remote(scope, name, snap.id, params))
            )
            return value
        box = ray_box(target)
        if op.key == "box.refresh":  # a lost box is what the directory says: its node cannot be asked
            await self.reconcile()
            try:
                rec = await self.reread(box)
            except NotFound:
                box.removed = True
                return None
            if rec["state"] == LOST:
                return None
        if op.key == "box.remove":
            return await self.remove(box, bool(params.get("force")))
        if op.key == "box.fork":
            return await self.fork(box, params["n"], params.get("name"))
        if op.key == "box.suspend" and box.rec and box.rec.get("replicas"):
            return await self.suspend_replicated(box)
        answer = await self.ask(box, self.actor(box).call.remote(scope, name, box.id, params))
        value = op.result.decode(answer) if op.result.kind != "text" else answer
        kind = op.result.kind
        if kind == "box":
            if value["state"] != box.state:
                await self.record(box, {"state": value["state"]})
            box.update(value)
            return None
        if kind == "snapshot":
            made = RaySnapshotRef(self, value)
            if op.key == "box.snapshot" and box.rec and box.rec.get("replicas"):
                box.rec = await self.replicate(box.rec, made.id)
            return made
        if kind == "snapshots":
            return [RaySnapshotRef(self, rec) for rec in value]
        return value

    async def remove(self, box: RayBoxRef, force: bool) -> None:
        """Delete the box on its node and from the directory, and give its room back
        (a lost box is only forgotten; so is its replica)."""
        try:
            rec = await self.reread(box)
        except NotFound:
            box.removed = True
            return
        if rec["state"] != LOST:
            await self.ask(box, self.actor(box).remove.remote(box.id, force))
        replica = rec.get("replica")
        if replica:
            with contextlib.suppress(Exception):
                await got(self.fleet.node(replica["node"]).drop_snapshot.remote(replica["snapshot"]))
        for name in await got(self.fleet.directory().release.remote(box.id)):
            await asyncio.to_thread(placement.release, name)
        box.removed = True

    async def fork(
        self,
        box: RayBoxRef,
        n: int,
        name: str | None,
        *,
        spread: bool = False,
        placement_timeout: float | None = None,
    ) -> Forked:
        """``n`` running copies of the box from a snapshot taken now (``Fleet.fork``)."""
        if n < 1:
            raise InvalidArgument("n must be at least 1")
        rec = box.rec
        assert rec is not None
        actor = self.actor(box)
        one = box_bundle(rec)
        timeout = placement_timeout or self.fleet.placement_timeout
        t0 = time.monotonic()
        if spread:
            held = await asyncio.to_thread(placement.spread, one, n, timeout=timeout)
        else:
            held = [await asyncio.to_thread(placement.reserve, [one] * n, node=rec["node"], timeout=timeout)]
        per_node: dict[str, int] = {}
        reservations: dict[str, list[str]] = {}  # per node, the group of each of its children
        for res in held:
            for nid in res.nodes:
                per_node[nid] = per_node.get(nid, 0) + 1
                reservations.setdefault(nid, []).append(res.name)
        timings: dict[str, float] = {"reserve_s": time.monotonic() - t0}
        made: list[tuple[str, dict[str, Any]]] = []
        try:
            if set(per_node) == {rec["node"]}:
                kids = await self.ask(box, actor.call.remote("box", "fork", box.id, {"n": n, "name": name}))
                made += [(rec["node"], k) for k in kids["boxes"]]
            else:
                made += await self._fork_spread(box, actor, per_node, name or rec["name"], timings)
        except BaseException:
            for nid, k in made:
                with contextlib.suppress(Exception):
                    await got(self.fleet.node(nid).remove.remote(k["id"], True))
            for res in held:
                await asyncio.to_thread(placement.release, res.name)
            raise
        now = time.time()
        out = Forked()
        for nid, k in made:
            kid = new_record(k, nid, now, reservation=reservations[nid].pop())
            out.append(RayBoxRef(self, await got(self.fleet.directory().put.remote(kid))))
        out.per_node = per_node
        timings["total_s"] = time.monotonic() - t0
        out.timings = timings
        return out

    async def _fork_spread(
        self, box: RayBoxRef, actor: Any, per_node: dict[str, int], prefix: str, timings: dict[str, float]
    ) -> list[tuple[str, dict[str, Any]]]:
        rec = box.rec
        assert rec is not None
        t = time.monotonic()
        snap = await self.ask(
            box, actor.call.remote("box", "snapshot", box.id, {"name": f"fork-{secrets.token_hex(4)}"})
        )
        timings["snapshot_s"] = time.monotonic() - t
        made: list[tuple[str, dict[str, Any]]] = []
        others = {nid: k for nid, k in per_node.items() if nid != rec["node"]}
        try:
            t = time.monotonic()
            moved = await self.ask(box, actor.export.remote(snap["id"]))
            timings["export_s"] = time.monotonic() - t
            t = time.monotonic()
            # every node fetches, imports once and starts its children, all at the same time
            start = {"name": prefix, "as_prefix": True, "labels": rec["labels"]}
            calls = {
                nid: self.fleet.node(nid).import_state.remote(moved, {**start, "n": k})
                for nid, k in others.items()
            }
            local = per_node.get(rec["node"], 0)
            if local:
                calls[rec["node"]] = actor.start_from.remote(
                    snap["id"], local, prefix, None, rec["labels"], True
                )
            answers = await asyncio.gather(*(got(c) for c in calls.values()), return_exceptions=True)
            errors: list[BaseException] = []
            for nid, answer in zip(calls, answers, strict=True):
                if isinstance(answer, BaseException):
                    errors.append(answer)
                else:
                    made += [(nid, k) for k in (answer["boxes"] if isinstance(answer, dict) else answer)]
            timings["import_start_s"] = time.monotonic() - t
            if errors:
                for nid, k in made:
                    with contextlib.suppress(Exception):
                        await got(self.fleet.node(nid).remove.remote(k["id"], True))
                made.clear()
                raise errors[0]
        finally:
            if not per_node.get(rec["node"]) or not made:
                with contextlib.suppress(Exception):
                    await got(actor.drop_snapshot.remote(snap["id"]))
        return made

    async def start_snapshot(self, snap: RaySnapshotRef, params: dict[str, Any]) -> list[BoxRef]:
        """Boxes from a snapshot, on its node, their room reserved there first."""
        node = self.fleet.node(snap.node)
        facts = await got(node.call.remote("snapshot", "inspect", snap.id, {}))
        vm = (facts.get("options") or {}).get("vm") or {}
        one = placement.bundle(int(vm.get("cpus") or 1), int(vm.get("memory_mib") or DEFAULT_MEMORY_MIB))
        n = int(params.get("n") or 1)
        res = await asyncio.to_thread(
            placement.reserve, [one] * n, node=snap.node, timeout=self.fleet.placement_timeout
        )
        try:
            started = await got(node.call.remote("snapshot", "start", snap.id, params))
        except BaseException:
            await asyncio.to_thread(placement.release, res.name)
            raise
        now = time.time()
        return [
            RayBoxRef(
                self,
                await got(
                    self.fleet.directory().put.remote(new_record(k, snap.node, now, reservation=res.name))
                ),
            )
            for k in started["boxes"]
        ]

    async def suspend_replicated(self, box: RayBoxRef) -> None:
        """Write the running state to disk on its node and end the VM; that state (saved
        while the box is frozen, so the same) is kept on a second node too."""
        actor = self.actor(box)
        await self.ask(box, actor.call.remote("box", "pause", box.id, {}))
        try:
            snap = await self.ask(
                box, actor.call.remote("box", "snapshot", box.id, {"name": f"replica-{secrets.token_hex(4)}"})
            )
            assert box.rec is not None
            box.rec = await self.replicate(box.rec, snap["id"])
        except BaseException:
            with contextlib.suppress(Exception):
                await self.ask(box, actor.call.remote("box", "unpause", box.id, {}))
            raise
        info = await self.ask(box, actor.call.remote("box", "suspend", box.id, {}))
        with contextlib.suppress(SandlotError):
            await got(actor.drop_snapshot.remote(snap["id"]))
        box.update(info)
        await self.record(box, {"state": info["state"]})

    async def replicate(self, rec: Record, snapshot: str) -> Record:
        """Keep ``snapshot`` (of the box's node) on a second node as the box's replica,
        in place of the one before."""
        nodes = [
            n["NodeID"]
            for n in await asyncio.to_thread(placement.sandlot_nodes)
            if n["NodeID"] != rec["node"]
        ]
        if not nodes:
            from ..errors import NodeNotFound

            raise NodeNotFound(f"box {rec['name']} wants a replica, and the fleet has no second live node")
        old = rec.get("replica") or {}
        records = await got(self.fleet.directory().all.remote())

        def load(nid: str) -> tuple[int, int]:  # the node that keeps the fewest boxes and replicas
            keeps = sum(1 for r in records if r["node"] == nid or (r.get("replica") or {}).get("node") == nid)
            return keeps, 0 if nid == old.get("node") else 1

        target = min(nodes, key=load)
        moved = await got(self.fleet.node(rec["node"]).export.remote(snapshot))
        kept = await got(self.fleet.node(target).import_state.remote(moved, None))
        if old.get("node"):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    got(self.fleet.node(old["node"]).drop_snapshot.remote(old["snapshot"])), 30
                )
        replica = {"node": target, "snapshot": kept["snapshot"], "at": time.time()}
        updated: Record = (
            await got(self.fleet.directory().update.remote(rec["id"], {"replica": replica})) or rec
        )
        return updated

    # -- commands ---------------------------------------------------------------------------

    async def exec(
        self,
        ref: BoxRef,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None,
        cwd: str | None,
        user: str | None,
        stdin: bytes | None,
        timeout: float | None,
    ) -> ExecResult:
        box = ray_box(ref)
        body: dict[str, Any] = {
            "argv": list(argv),
            "env": dict(env) if env else None,
            "cwd": cwd,
            "user": user,
            "timeout": timeout,
        }
        if stdin is not None:
            body["stdin_b64"] = base64.b64encode(stdin).decode()
        answer = await self.ask(
            box, self.actor(box).exec.remote(box.id, {k: v for k, v in body.items() if v is not None})
        )
        return exec_result(answer, tuple(argv))

    async def spawn(
        self,
        ref: BoxRef,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None,
        cwd: str | None,
        user: str | None,
        tty: bool,
        rows: int,
        cols: int,
        stdin: bool,
        keep: str | None,
    ) -> AsyncProcess:
        box = ray_box(ref)
        actor = self.actor(box)
        body = {
            "argv": list(argv),
            "env": dict(env) if env else None,
            "cwd": cwd,
            "user": user,
            "tty": tty,
            "rows": rows,
            "cols": cols,
            "stdin": stdin,
        }
        started = await self.ask(
            box, actor.spawn.remote(box.id, {k: v for k, v in body.items() if v is not None})
        )
        return AsyncProcess(
            tuple(argv), self._followed(box, started["id"], int(started["pid"]), tty), key=keep
        )

    def _followed(
        self,
        box: RayBoxRef,
        process_id: str,
        pid: int,
        tty: bool,
        offsets: tuple[int, int] = (0, 0),
        *,
        link: bool = True,
    ) -> FollowedProcess:
        actor, key = self.actor(box), box.id

        async def opener(at: tuple[int, int]) -> Link:
            return RayLink(actor, key, process_id, at)

        first = RayLink(actor, key, process_id, offsets) if link else None
        return FollowedProcess(process_id, pid, tty, opener, f"node {box.node[:12]}", first, offsets=offsets)

    async def attach(self, ref: BoxRef, process_id: str, offsets: tuple[int, int]) -> AsyncProcess:
        box = ray_box(ref)
        held = next(
            (p for p in await self.call("box", "processes", box, {}) if p.get("id") == process_id), None
        )
        if held is None:
            raise NotFound(
                f"box {box.name} has no process {process_id} on node {box.node[:12]}", box=box.name
            )
        proc = self._followed(
            box, process_id, int(held.get("pid") or 0), bool(held.get("tty")), offsets, link=False
        )
        await proc.connect()
        return AsyncProcess(tuple(str(a) for a in held.get("argv", ())), proc)

    async def run_code(
        self,
        ref: BoxRef,
        code: str,
        *,
        language: str,
        context: str | None,
        timeout: float | None,
        callbacks: Callbacks,
    ) -> Execution:
        box = ray_box(ref)
        body = {"code": code, "language": language, "context": context, "timeout": timeout}
        gen = self.actor(box).run_code.options(num_returns="streaming").remote(box.id, body)
        async for item in gen:
            done = await code_event(await item, callbacks)
            if done is not None:
                return done
        raise ProtocolError(f"node {box.node[:12]} ended the cell's events before its end")

    # -- files ------------------------------------------------------------------------------

    async def _chunks(self, gen: Any) -> AsyncIterator[bytes]:
        try:
            async for item in gen:
                chunk = await item
                if isinstance(chunk, dict):
                    raise_if_error(chunk)
                    raise ProtocolError(f"a node sent {chunk!r:.200} among a file's bytes")
                yield chunk
        finally:
            with contextlib.suppress(Exception):
                ray.cancel(gen)

    async def read(self, ref: BoxRef, path: str, offset: int, length: int | None) -> AsyncIterator[bytes]:
        box = ray_box(ref)
        body = {"path": path, "offset": offset, "length": length}
        async for chunk in self._chunks(
            self.actor(box).read.options(num_returns="streaming").remote(box.id, body)
        ):
            yield chunk

    async def _upload(
        self, box: RayBoxRef, kind: str, body: dict[str, Any], data: AsyncIterable[bytes]
    ) -> Any:
        actor = self.actor(box)
        upload = await self.ask(box, actor.upload_begin.remote(box.id, kind, body))
        async for chunk in data:
            view = memoryview(chunk)
            for i in range(0, len(view), CHUNK):
                await got(actor.upload_chunk.remote(upload, bytes(view[i : i + CHUNK])))
        return await got(actor.upload_end.remote(upload))

    async def write(
        self,
        ref: BoxRef,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int | None,
        user: str | None,
        append: bool,
        parents: bool,
        exclusive: bool,
    ) -> int:
        body = {
            "path": path,
            "mode": mode,
            "user": user,
            "append": append,
            "parents": parents,
            "exclusive": exclusive,
        }
        source = one(data) if isinstance(data, bytes) else data
        return int(
            await self._upload(ray_box(ref), "file", {k: v for k, v in body.items() if v is not None}, source)
        )

    async def get_archive(self, ref: BoxRef, path: str) -> AsyncIterator[bytes]:
        box = ray_box(ref)
        gen = self.actor(box).get_archive.options(num_returns="streaming").remote(box.id, {"path": path})
        async for chunk in self._chunks(gen):
            yield chunk

    async def put_archive(
        self, ref: BoxRef, path: str, tar: AsyncIterable[bytes], *, user: str | None
    ) -> None:
        body = {"path": path} | ({"user": user} if user else {})
        await self._upload(ray_box(ref), "archive", body, tar)

    async def watch(self, ref: BoxRef, path: str, recursive: bool) -> WatchSource:
        box = ray_box(ref)
        gen = (
            self.actor(box)
            .watch.options(num_returns="streaming")
            .remote(box.id, {"path": path, "recursive": recursive})
        )
        return await RayWatch(gen, f"node {box.node[:12]}").open()

    # -- snapshots --------------------------------------------------------------------------

    async def _live_nodes(self) -> list[str]:
        return [n["NodeID"] for n in await asyncio.to_thread(placement.sandlot_nodes)]

    async def find_snapshot(self, key: str) -> RaySnapshotRef:
        found = []
        for nid in await self._live_nodes():
            with contextlib.suppress(NotFound):
                found.append(await got(self.fleet.node(nid).find_snapshot.remote(key)))
        if not found:
            from ..errors import SnapshotNotFound

            raise SnapshotNotFound(f"no snapshot {key!r} on any live node of the fleet")
        if len(found) > 1:
            raise InvalidArgument(f"snapshot {key!r} is on more than one node; use its id")
        return RaySnapshotRef(self, found[0])

    async def snapshot_list(self, *, box: str | None, kind: str | None) -> list[SnapshotRef]:
        if box is not None:
            nodes = [(await self.find(box)).node]
        else:
            nodes = await self._live_nodes()
        out: list[SnapshotRef] = []
        for nid in nodes:
            out += [
                RaySnapshotRef(self, s)
                for s in await got(self.fleet.node(nid).snapshot_list.remote(box, kind))
            ]
        return out

    async def export(self, snap: SnapshotRef, path: Path) -> Path:
        moved = await got(self.fleet.node(ray_snapshot(snap).node).export.remote(snap.id))
        assembly = transfer.Assembly(path, moved["sha256"])
        try:
            for piece, ref in moved["chunks"]:
                await asyncio.to_thread(assembly.add, piece, await ref)
            return await asyncio.to_thread(assembly.finish)
        except BaseException:
            assembly.abort()
            raise

    async def import_snapshot(
        self, path: Path, *, name: str | None, start: bool, options: Mapping[str, Any]
    ) -> BoxRef | SnapshotRef:
        if options:
            raise self.unsupported(
                f"options for the box an import starts ({', '.join(options)})",
                hint="start it with snapshot.start(...)",
            )
        nodes = await self._live_nodes()
        if not nodes:
            from ..errors import NoCapacity

            raise NoCapacity(
                "no node of the Ray cluster offers sandlot resources (see `sandlot fleet nodes`)"
            )
        target = nodes[0]
        res = None
        if start:
            res = await asyncio.to_thread(
                placement.reserve,
                [placement.bundle(1, DEFAULT_MEMORY_MIB)],
                timeout=self.fleet.placement_timeout,
            )
            target = res.nodes[0]
        total = await asyncio.to_thread(transfer.digest, path)
        chunks = [
            (piece, ray.put(data))
            for piece, data in await asyncio.to_thread(lambda: list(transfer.pieces(path)))
        ]
        moved = {"chunks": chunks, "sha256": total, "size": path.stat().st_size}
        try:
            landed = await got(
                self.fleet.node(target).import_state.remote(moved, {"n": 1, "name": name} if start else None)
            )
        except BaseException:
            if res is not None:
                await asyncio.to_thread(placement.release, res.name)
            raise
        if not start:
            return await self.find_snapshot(landed["snapshot"])
        [kid] = landed["boxes"]
        assert res is not None
        return RayBoxRef(
            self,
            await got(
                self.fleet.directory().put.remote(new_record(kid, target, time.time(), reservation=res.name))
            ),
        )

    async def info(self) -> dict[str, Any]:
        return {"transport": self.transport, "nodes": len(await self._live_nodes())}


class Forked(list[BoxRef]):
    """The children of a fork, with ``per_node``: how many landed on each node."""

    per_node: dict[str, int]
    timings: dict[str, float]


async def one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def ray_box(ref: BoxRef) -> RayBoxRef:
    if not isinstance(ref, RayBoxRef):
        raise InvalidArgument(f"not a box of a fleet: {ref!r}")
    return ref


def ray_snapshot(snap: SnapshotRef) -> RaySnapshotRef:
    if not isinstance(snap, RaySnapshotRef):
        raise InvalidArgument(f"not a snapshot of a fleet: {snap!r}")
    return snap
