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
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import ray

from ..api.backend import (
    BoxRef,
    Command,
    DescribedBoxRef,
    SnapshotRef,
    answered,
    narrowed,
)
from ..api.contract import (
    BY_KEY,
    SNAPSHOT,
    BoxOut,
    Operation,
    Stream,
    Strict,
    box_create,
    exec_result,
    operation,
    raise_if_error,
)
from ..api.follow import Link, LinkClosed
from ..api.loop import cancel_and_reap
from ..api.process import ExecResult
from ..api.remote import Data, StreamingBackend
from ..core.diffs import side_key
from ..core.events import Event
from ..core.options import DEFAULT_MEMORY_MIB
from ..errors import (
    BoxNotFound,
    ConnectionLost,
    InvalidArgument,
    InvalidState,
    NoCapacity,
    NodeNotFound,
    NotFound,
    ProtocolError,
    SandlotError,
    SnapshotNotFound,
    Unsupported,
    from_dict,
)
from . import placement, transfer
from .directory import LOST, Record, new_record


class Fleet(Protocol):
    """What the backend asks of its fleet (``client.Fleet``): the actors, and placement."""

    placement_timeout: float

    def directory(self) -> Any: ...

    def node(self, node_id: str, *, every_namespace: bool = False) -> Any: ...

    def sees(self, labels: Mapping[str, str] | None) -> bool: ...

    def forget_node(self, node_id: str) -> None: ...

    def driver_mark(self) -> str: ...

    def resolve_node(self, key: str) -> str: ...

    def reserve_spread(self, one: dict[str, float], timeout: float) -> placement.Reservation: ...


INLINE_STDIN = 64 << 20  # stdin up to this size travels with an exec's call (the object store carries it)
CHUNK = 1 << 20  # bytes of a file or archive per upload call


async def got(ref: Any) -> Any:
    """An actor call's answer, awaited; a node's error reply, or a sandlot error the
    directory raised, is raised as itself."""
    try:
        return opened(await ref)
    except ray.exceptions.RayTaskError as exc:
        raise cause(exc) from None


def answer(ref: Any, timeout: float | None = None) -> Any:
    """``got`` for the driver's synchronous calls."""
    try:
        return opened(ray.get(ref, timeout=timeout))
    except ray.exceptions.RayTaskError as exc:
        raise cause(exc) from None


def opened(value: Any) -> Any:
    """A node call's value (its reply ``{"ok": value}``), or its error (``{"error": ...}``)
    raised again as the same sandlot class; anything else (the directory's answers) as it is."""
    if isinstance(value, dict) and len(value) == 1:
        if "error" in value:
            raise from_dict(value["error"])
        if "ok" in value:
            return value["ok"]
    return value


def cause(exc: ray.exceptions.RayTaskError) -> BaseException:
    return exc.cause if isinstance(exc.cause, SandlotError) else exc


def box_bundle(rec: Mapping[str, Any]) -> dict[str, float]:
    """What a box of this record reserves."""
    return placement.bundle(rec.get("cpus") or 1, rec.get("memory_mib") or DEFAULT_MEMORY_MIB)


class RayBoxRef(DescribedBoxRef):
    """A fleet box: its directory record (its node, reservation, replica), or the box to make
    and ``where`` (its placement: strategy, node, replicas, placement_timeout)."""

    backend: RayBackend

    def __init__(self, backend: RayBackend, rec: Record | None, wanted: dict[str, Any] | None = None,
                 where: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(backend, wanted, rec)
        self.where = where or {}

    @property
    def info(self) -> dict[str, Any]:
        rec = super().info
        return {k: rec.get(k) for k in BoxOut.model_fields} | {"labels": dict(rec.get("labels") or {})}

    @property
    def node(self) -> str:
        return str(self.info["node"])


class RaySnapshotRef(SnapshotRef):
    def __init__(self, backend: RayBackend, rec: Mapping[str, Any]) -> None:
        self.backend = backend
        self.rec: dict[str, Any] = SNAPSHOT.decode(rec)
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


class NodeStream:
    """What a node streams, item by item: a box's (``of_box``: ``NodeService.stream``) or
    its own (``of_node``: ``NodeService.events``). A node lost midway is ConnectionLost;
    ``close`` cancels the node's side (a cell left is interrupted)."""

    def __init__(self, where: str, gen: Any) -> None:
        self.where = where
        self.gen = gen

    @classmethod
    def of_box(cls, backend: RayBackend, box: RayBoxRef, kind: str, body: dict[str, Any]) -> NodeStream:
        stream = backend.actor(box).stream.options(num_returns="streaming")
        return cls(f"node {box.node[:12]}", stream.remote(kind, box.id, body))

    @classmethod
    def of_node(cls, actor: Any, node_id: str, method: str, body: dict[str, Any]) -> NodeStream:
        stream = getattr(actor, method).options(num_returns="streaming")
        return cls(f"node {node_id[:12]}", stream.remote(body))

    async def next(self) -> Any:
        """The next item, None at the end."""
        try:
            return await (await self.gen.__anext__())
        except StopAsyncIteration:
            return None
        except ray.exceptions.RayError as exc:
            raise ConnectionLost(f"lost {self.where} while it streamed ({type(exc).__name__})") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.cancel(self.gen)


async def events_of(stream: NodeStream) -> AsyncIterator[Event]:
    while (message := await stream.next()) is not None:
        raise_if_error(message)
        yield Event.from_json(message)


async def merged_as_they_come(streams: list[NodeStream]) -> AsyncIterator[Event]:
    """The events of several nodes' streams, each as it arrives, until they all end; the
    first failure ends it."""
    queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

    async def pump(stream: NodeStream) -> None:
        try:
            async for ev in events_of(stream):
                await queue.put(ev)
            await queue.put(None)
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    running = len(tasks)
    try:
        while running:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                continue
            yield item
    finally:
        await cancel_and_reap(tasks)


# The operations a fleet runs as more than one call to the box's node (a fork spread and
# placed, a replica kept, a diff's sides on one node, boxes placed from a snapshot), each
# registered by ``fleet_runs``; ``RayBackend.call`` runs the rest on the box's node.
FleetRun = Callable[[Any, Operation, Any, dict[str, Any]], Awaitable[Any]]
FLEET_RUNS: dict[str, FleetRun] = {}


def fleet_runs(key: str) -> Callable[[FleetRun], FleetRun]:
    assert key in BY_KEY and key not in FLEET_RUNS, f"{key}: not an operation, or registered twice"

    def register(run: FleetRun) -> FleetRun:
        FLEET_RUNS[key] = run
        return run

    return register


class RayBackend(StreamingBackend):
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
        """A node call about a box; a node that died meanwhile makes the box lost (InvalidState),
        one that does not answer (yet alive to Ray) is ConnectionLost."""
        try:
            return await got(call)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.ActorUnavailableError,
            # the node's actor asked for anew, pinned to a node Ray has since found dead
            ray.exceptions.ActorUnschedulableError,
        ) as exc:
            if not isinstance(exc, ray.exceptions.ActorUnavailableError):
                self.fleet.forget_node(ref.node)  # the next call gets the node's next actor
            await self.reconcile()
            await self.reread(ref)
            self.actor(ref)  # raises InvalidState(lost) if its node is gone
            raise ConnectionLost(
                f"node {ref.node[:12]} of box {ref.name} did not answer ({type(exc).__name__})"
            ) from None

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
        alive = await self.live_nodes()
        seen: dict[str, Any] = {}
        for nid in alive:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError, SandlotError):
                # every box of the node, whoever asks: what a node does not list, the directory drops
                seen[nid] = await asyncio.wait_for(
                    got(self.fleet.node(nid, every_namespace=True).list.remote()), 30
                )
        records, released = await got(self.fleet.directory().reconcile.remote(alive, seen))
        for name in released:
            await asyncio.to_thread(placement.release, name)
        return list(records)

    # -- boxes ------------------------------------------------------------------------------

    def describe(self, image: Any, options: Mapping[str, Any], *, keep: bool) -> RayBoxRef:
        opts = dict(options)
        where: dict[str, Any] = {k: opts.pop(k) for k in ("strategy", "node", "replicas", "placement_timeout")
                                 if k in opts}  # fmt: skip
        if "home" in opts:
            raise self.unsupported("home=", hint="a fleet box lives in its node's home")
        if where.get("replicas", 0) not in (0, 1):
            raise InvalidArgument("replicas is 0 or 1")
        if where.get("strategy", "pack") not in ("pack", "spread"):
            raise InvalidArgument(f"strategy must be 'pack' or 'spread', not {where['strategy']!r}")
        return RayBoxRef(self, None, box_create(image, opts, self.transport), where)

    async def make(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> dict[str, Any]:
        # a with block's box goes by the block's end, or with its driver: the record names
        # the driver's mark, an actor that dies with the driver's job, and the box's node
        # removes a box whose mark is gone
        box = ray_box(ref)
        assert box.wanted is not None
        where = dict(box.where)
        if ephemeral:
            where["held_by"] = await asyncio.to_thread(self.fleet.driver_mark)
        return await self.place(box.wanted, where, start=start)

    @contextlib.asynccontextmanager
    async def reserved(self, bundles: list[dict[str, float]], *, spread: bool = False,
                       **how: Any) -> AsyncIterator[placement.Reservation]:  # fmt: skip
        """Room for ``bundles`` held through Ray (``placement.reserve``; ``spread``: one box on
        the node with the fewest, ``Fleet.reserve_spread``), NoCapacity if none in time; given
        back if what it was for fails."""
        how.setdefault("timeout", self.fleet.placement_timeout)
        if spread:
            res = await asyncio.to_thread(self.fleet.reserve_spread, bundles[0], how["timeout"])
        else:
            res = await asyncio.to_thread(placement.reserve, bundles, **how)
        try:
            yield res
        except BaseException:
            await asyncio.to_thread(placement.release, res.name)
            raise

    async def place(self, wanted: dict[str, Any], where: dict[str, Any], *, start: bool) -> Record:
        """A box made on the node Ray's scheduler picks (or the node asked for), its room
        reserved first (NoCapacity if none in time), and its directory record."""
        one = placement.bundle(
            int(wanted.get("cpus") or 1), int(wanted.get("memory_mib") or DEFAULT_MEMORY_MIB)
        )
        target = self.fleet.resolve_node(where["node"]) if where.get("node") else None
        timeout = where.get("placement_timeout") or self.fleet.placement_timeout
        spread = where.get("strategy") == "spread" and target is None
        how = {} if spread else {"strategy": where.get("strategy", "pack"), "node": target}
        async with self.reserved([one], spread=spread, timeout=timeout, **how) as res:
            node = res.nodes[0]
            body = {k: v for k, v in wanted.items() if k != "image"}
            made = await got(self.fleet.node(node).create.remote(wanted.get("image"), body, start))
        rec = new_record(made, node, time.time(), reservation=res.name, replicas=where.get("replicas", 0),
                         held_by=where.get("held_by"))  # fmt: skip
        created: Record = await got(self.fleet.directory().put.remote(rec))
        return created

    async def find(self, key: str) -> RayBoxRef:
        try:
            rec = await got(self.fleet.directory().get.remote(key))
        except BoxNotFound:
            await self.reconcile()  # perhaps a box the directory has not seen yet
            rec = await got(self.fleet.directory().get.remote(key))
        if not self.fleet.sees(rec.get("labels")):
            raise BoxNotFound(f"no box {key!r}", box=key)
        return RayBoxRef(self, rec)

    async def boxes(self, *, state: str | None, labels: Mapping[str, str] | None) -> list[BoxRef]:
        out: list[BoxRef] = []
        for rec in await self.reconcile():
            if labels and any(rec["labels"].get(k) != v for k, v in labels.items()):
                continue
            if not self.fleet.sees(rec.get("labels")):
                continue
            if state is not None and rec["state"] != state:
                continue
            out.append(RayBoxRef(self, rec))
        return out

    async def call(self, scope: str, name: str, target: Any, args: dict[str, Any]) -> Any:
        op = operation(scope, name)  # type: ignore[arg-type]
        params = op.arguments(args).model_dump()
        own = FLEET_RUNS.get(op.key)
        if own is not None:
            return await own(self, op, target, params)
        if scope == "snapshot":
            snap = ray_snapshot(target)
            return op.result.decode(
                await got(self.fleet.node(snap.node).call.remote(scope, name, snap.id, params))
            )
        box = ray_box(target)
        if op.describes:
            return await self.refresh(box, op)
        if op.removes:
            return await self.remove(box, bool(params.get("force")))
        return await self.on_node(op, box, params)

    async def on_node(self, op: Operation, box: RayBoxRef, params: dict[str, Any]) -> Any:
        """Operation ``op`` of the box run by its node; the box's state in the directory
        follows what the answer says of it."""
        answer = await self.ask(box, self.actor(box).call.remote(op.scope, op.name, box.id, params))
        value = op.result.decode(answer) if op.result.kind != "text" else answer
        if op.result.kind == "box" and value["state"] != box.state:
            await self.record(box, {"state": value["state"]})
        return answered(op.result.kind, value, box, lambda rec: RayBoxRef(self, rec),
                        lambda rec: RaySnapshotRef(self, rec))  # fmt: skip

    # the operations the fleet runs as more than a call to the box's node (``fleet_runs``)

    @fleet_runs("box.fork")
    async def _fork(self, op: Operation, target: Any, params: dict[str, Any]) -> Any:
        return await self.fork(ray_box(target), params["n"], params.get("name"))

    @fleet_runs("box.suspend")
    async def _suspend(self, op: Operation, target: Any, params: dict[str, Any]) -> Any:
        box = ray_box(target)
        if box.rec and box.rec.get("replicas"):
            return await self.suspend_replicated(box)
        return await self.on_node(op, box, params)

    @fleet_runs("box.snapshot")
    async def _snapshot(self, op: Operation, target: Any, params: dict[str, Any]) -> Any:
        box = ray_box(target)
        made = await self.on_node(op, box, params)
        if box.rec and box.rec.get("replicas"):
            box.rec = await self.replicate(box.rec, made.id)
        return made

    @fleet_runs("box.diff")
    async def _diff(self, op: Operation, target: Any, params: dict[str, Any]) -> Any:
        box = ray_box(target)
        return await self.on_node(op, box, await self.same_node_sides(box, params))

    @fleet_runs("snapshot.start")
    async def _start_snapshot(self, op: Operation, target: Any, params: dict[str, Any]) -> Any:
        return await self.start_snapshot(ray_snapshot(target), params)

    async def same_node_sides(self, box: RayBoxRef, params: dict[str, Any]) -> dict[str, Any]:
        """A diff runs on the box's node, against states of that node: another box is
        named by its id there, and one on another node is refused."""
        for field in ("a", "b"):
            kind, key = side_key(params.get(field), "image" if field == "a" else "now")
            if kind != "box":
                continue
            other = await self.find(key)
            if other.node != box.node:
                raise Unsupported(
                    f"diff() compares boxes of one node: {box.name} is on node {box.node[:12]}, "
                    f"{other.name} on node {other.node[:12]} (migrate one, or fork onto one node)",
                    transport=self.transport, box=box.name,
                )  # fmt: skip
            params = {**params, field: f"box:{other.id}"}
        return params

    async def refresh(self, box: RayBoxRef, op: Any) -> None:
        """The box's state from its node; a lost box's is what the directory says (its node
        cannot be asked), as is the state of one whose node does not answer now (Ray has not
        found it dead yet); a box gone from its node is removed."""
        try:
            rec = await self.reread(box)
            if rec["state"] != LOST:
                box.update(
                    op.result.decode(
                        await self.ask(box, self.actor(box).call.remote("box", "refresh", box.id, {}))
                    )
                )
                if box.state != rec["state"]:
                    await self.record(box, {"state": box.state})
        except NotFound:
            await self.reconcile()  # the directory forgets it too
            box.removed = True
        except InvalidState:
            if box.state != LOST:  # not the node's death (ask makes the box lost then)
                raise
        except ConnectionLost:
            pass

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
        vm = ((await got(node.call.remote("snapshot", "inspect", snap.id, {}))).get("options") or {}).get(
            "vm"
        ) or {}
        one = placement.bundle(int(vm.get("cpus") or 1), int(vm.get("memory_mib") or DEFAULT_MEMORY_MIB))
        async with self.reserved([one] * int(params.get("n") or 1), node=snap.node) as res:
            started = await got(node.call.remote("snapshot", "start", snap.id, params))
        now = time.time()
        return [await self.put(new_record(k, snap.node, now, reservation=res.name)) for k in started["boxes"]]

    async def put(self, rec: Record) -> RayBoxRef:
        """A box's record written to the directory, and the box's ref."""
        return RayBoxRef(self, await got(self.fleet.directory().put.remote(rec)))

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
        nodes = [nid for nid in await self.live_nodes() if nid != rec["node"]]
        if not nodes:
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

    async def exec(self, ref: BoxRef, cmd: Command, stdin: bytes | None, timeout: float | None) -> ExecResult:
        box = ray_box(ref)
        answer = await self.ask(box, self.actor(box).exec.remote(box.id, cmd.exec_fields(stdin, timeout)))
        return exec_result(answer, cmd.argv)

    async def start_process(self, ref: BoxRef, cmd: Command) -> tuple[str, int, Link]:
        box = ray_box(ref)
        started = await self.ask(box, self.actor(box).spawn.remote(box.id, cmd.fields()))
        return started["id"], int(started["pid"]), RayLink(self.actor(box), box.id, started["id"], (0, 0))

    async def process_link(self, ref: BoxRef, process_id: str, offsets: tuple[int, int]) -> Link:
        box = ray_box(ref)
        return RayLink(self.actor(box), box.id, process_id, offsets)

    # -- files ------------------------------------------------------------------------------

    async def frames(self, stream: Stream, ref: BoxRef, params: Strict) -> AsyncGenerator[Any, None]:
        """The node's streaming generator of the stream (``NodeService.stream``): a node that
        fails says so as its last item, an error message; one among bytes is raised here."""
        box = ray_box(ref)
        items = NodeStream.of_box(self, box, stream.key, stream.fields(params))
        try:  # a stream left (a cell cancelled) is cancelled on the node: the cell is interrupted
            while (item := await items.next()) is not None:
                if stream.frames == "bytes" and isinstance(item, dict):
                    raise_if_error(item)
                    raise ProtocolError(f"{items.where} sent {item!r:.200} among a stream's bytes")
                yield item
        finally:
            items.close()

    async def send(self, stream: Stream, ref: BoxRef, params: Strict, data: Data) -> Any:
        """An upload to the node (``NodeService.upload_begin``), a chunk at a time."""
        box = ray_box(ref)
        actor = self.actor(box)
        upload = await self.ask(box, actor.upload_begin.remote(box.id, stream.key, stream.fields(params)))
        try:
            async for chunk in one(data) if isinstance(data, bytes) else data:
                view = memoryview(chunk)
                for i in range(0, len(view), CHUNK):
                    await self.ask(box, actor.upload_chunk.remote(upload, bytes(view[i : i + CHUNK])))
            return await self.ask(box, actor.upload_end.remote(upload))
        except BaseException:
            with contextlib.suppress(Exception):
                await got(actor.upload_abort.remote(upload))
            raise

    def where(self, ref: BoxRef) -> str:
        return f"node {ray_box(ref).node[:12]}"

    # -- events ---------------------------------------------------------------------------

    async def events(
        self, *, box: str | None, since: float | None, after: int | None, follow: bool
    ) -> AsyncIterator[Event]:
        """Each node keeps its own boxes' events. A box's come from its node; every box's
        from every live node, merged by time (as they come, when following). Event ids
        count on each node, so ``after`` needs ``box``."""
        body = {"since": since, "after": after, "follow": follow}
        if box is not None:
            ref = await self.find(box)
            streams = [NodeStream.of_node(self.actor(ref), ref.node, "events", {**body, "box": ref.id})]
        elif after is not None:
            raise InvalidArgument(
                "a fleet's event ids count on each node: after= needs box=; every box's events from a "
                "time need since="
            )
        else:
            nodes = await self.live_nodes()
            streams = [NodeStream.of_node(self.fleet.node(n), n, "events", body) for n in nodes]
        try:
            if follow:
                async for ev in merged_as_they_come(streams):
                    yield ev
            else:
                found = [ev for s in streams async for ev in events_of(s)]
                for ev in sorted(found, key=lambda e: e.at):
                    yield ev
        finally:
            for s in streams:
                s.close()

    # -- snapshots --------------------------------------------------------------------------

    async def live_nodes(self) -> list[str]:
        """The nodes of the Ray cluster that offer sandlot resources and are alive."""
        return [n["NodeID"] for n in await asyncio.to_thread(placement.sandlot_nodes)]

    async def find_snapshot(self, key: str) -> RaySnapshotRef:
        found = []
        for nid in await self.live_nodes():
            with contextlib.suppress(NotFound):
                found.append(await got(self.fleet.node(nid).find_snapshot.remote(key)))
        if not found:
            raise SnapshotNotFound(f"no snapshot {key!r} on any live node of the fleet")
        if len(found) > 1:
            raise InvalidArgument(f"snapshot {key!r} is on more than one node; use its id")
        return RaySnapshotRef(self, found[0])

    async def snapshot_list(self, *, box: str | None, kind: str | None) -> list[SnapshotRef]:
        if box is not None:
            nodes = [(await self.find(box)).node]
        else:
            nodes = await self.live_nodes()
        out: list[SnapshotRef] = []
        for nid in nodes:
            out += [
                RaySnapshotRef(self, s)
                for s in await got(self.fleet.node(nid).snapshot_list.remote(box, kind))
            ]
        return out

    async def export(self, snap: SnapshotRef, path: Path, since: SnapshotRef | None = None) -> Path:
        node = ray_snapshot(snap).node
        if since is not None and ray_snapshot(since).node != node:
            raise InvalidArgument(f"snapshot {since.id} is on another node than {snap.id}: no base of it")
        moved = await got(
            self.fleet.node(node).export.remote(snap.id, since.id if since is not None else None)
        )
        return await transfer.receive(moved, path)

    async def import_snapshot(
        self, path: Path, *, name: str | None, start: bool, options: Mapping[str, Any]
    ) -> BoxRef | SnapshotRef:
        """The archive moved in chunks to the live node with the fewest boxes, imported there
        (and with ``start``, a box started from it, its room reserved first)."""
        self.refuse_start_options(options)
        nodes = await self.live_nodes()
        if not nodes:
            raise NoCapacity(
                "no node of the Ray cluster offers sandlot resources (see `sandlot fleet nodes`)"
            )
        records = await got(self.fleet.directory().all.remote())
        target = min(nodes, key=lambda nid: sum(1 for r in records if r["node"] == nid))
        moved = await transfer.offer(path, ray.put)
        landed = await got(self.fleet.node(target).import_state.remote(moved, None))
        snap = RaySnapshotRef(self, {"id": landed["snapshot"], "node": target})
        if not start:
            return snap
        return (await self.start_snapshot(snap, {"n": 1, "name": name}))[0]

    async def info(self) -> dict[str, Any]:
        return {"transport": self.transport, "nodes": len(await self.live_nodes())}


class Forked(list[BoxRef]):
    """The children of a fork, with ``per_node``: how many landed on each node."""

    per_node: dict[str, int]
    timings: dict[str, float]


async def one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def ray_box(ref: BoxRef) -> RayBoxRef:
    return narrowed(ref, RayBoxRef, "a box of a fleet")


def ray_snapshot(snap: SnapshotRef) -> RaySnapshotRef:
    return narrowed(snap, RaySnapshotRef, "a snapshot of a fleet")
