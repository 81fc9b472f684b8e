"""The fleet as a driver sees it: ``connect`` and ``Fleet``.

A fleet's boxes are ``sandlot.Box`` objects like any others (their backend is
``fleet/backend.py``): every call on one goes to the node actor of the node that
has it. What only a fleet does is the ``Fleet``'s: where boxes go (``create`` with
a strategy or a node), forks spread over nodes, moving a box, recovering a lost
one from its replica, and the nodes themselves. Placement goes through Ray's
scheduler (``placement``); the directory actor says which node has which box
(``directory``).

A driver may act for a namespace (``connect(namespace=...)``): what a platform's front
end does for the tenant of an API key, as ``sandlot serve`` does for its keys. Every
call it sends a node carries the namespace (``NamespacedNode``) and the node answers
for that namespace's boxes only (``fleet/node.py``).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import clusterauth
from ..api import access, loop
from ..api.box import AsyncBox
from ..api.client import AsyncClient
from ..api.sync import Box as SyncBox
from ..api.sync import Client
from ..core.events import Event
from ..errors import BoxNotFound, ConnectionLost, InvalidArgument, InvalidState, NodeNotFound, SandlotError
from . import placement, trust
from .backend import Forked, RayBackend, RayBoxRef, answer, box_bundle, got, opened, ray_box
from .directory import LOST, Directory, Record
from .directory import NAME as DIRECTORY
from .node import NodeActor, node_actor_name

NODE_SETTLE = 120.0  # seconds a node may take to end a move (undo or finish a hold), its successor included

NAMESPACE = placement.NAMESPACE
HEAD = "node:__internal_head__"


def host_resources() -> dict[str, float]:
    """What a node started by ``connect(None)`` offers boxes: its cores, and half its memory."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {placement.CPUS: float(os.cpu_count() or 1), placement.MEMORY: float(pages // 2 >> 20)}


def connect(
    address: str | None = "auto",
    *,
    resources: Mapping[str, float] | None = None,
    placement_timeout: float = 30.0,
    insecure_cluster: bool = False,
    namespace: str | None = None,
    **init_options: Any,
) -> Fleet:
    """Join a Ray cluster (``"auto"``: the one this machine belongs to; ``"ray://host:10001"``:
    through Ray Client), or with ``None`` start a local one whose node offers this host's
    cores and half its memory to boxes (``resources`` to say otherwise). A Ray already
    initialized in this process is used as it is. ``init_options`` go to ``ray.init``.

    The driver sends the cluster's token, found as Ray finds it (``RAY_AUTH_TOKEN``, the
    file ``RAY_AUTH_TOKEN_PATH`` names, ``~/.ray/auth_token``); a local cluster is started
    with token authentication, its token made (mode 0600) if there is none. A cluster that
    refuses the driver raises Unauthorized. ``insecure_cluster=True`` (a local cluster
    only) lets its node serve boxes even where ``RAY_AUTH_MODE=disabled`` turned
    authentication off (docs/fleet.md, "Security").

    ``namespace``: act for that namespace only, as a ``sandlot serve`` key of that namespace
    does. The boxes made are labelled with it (``sandlot.namespace``), and every node
    answers as if the boxes and snapshots of other namespaces were not there: ``list``,
    ``get``, ``events`` and every call on a box. It separates the tenants of a front end
    that holds the cluster's token; it is no wall against a holder of the token, who can
    run code on every node (docs/fleet.md, "Namespaces").

    >>> from sandlot import fleet
    >>> f = fleet.connect("auto", namespace="team-a")   # doctest: +SKIP
    >>> box = f.create("python:3.12-slim")               # doctest: +SKIP
    >>> box.info["labels"]["sandlot.namespace"]          # doctest: +SKIP
    'team-a'
    """
    if namespace is not None:
        access.check_namespace(namespace)
    if insecure_cluster and address is not None:
        raise InvalidArgument(
            "insecure_cluster= is for a local cluster (address=None): a cluster's nodes are allowed "
            "an open cluster by their operator (`sandlot fleet start --insecure-cluster`)"
        )
    if not ray.is_initialized():
        opts: dict[str, Any] = {"namespace": NAMESPACE, **init_options}
        if address is None:  # what a new local Ray is; Ray refuses these when it joins one
            # "local": a Ray of its own, even where `ray start` runs a cluster on this machine,
            # which ray.init() with no address joins instead (and then refuses the resources)
            opts["address"] = "local"
            opts["resources"] = {**host_resources(), **(resources or {})}
            opts.setdefault("include_dashboard", False)
            if insecure_cluster:  # the local node's actor inherits this process's environment
                os.environ[clusterauth.INSECURE_ENV] = "1"
        else:
            opts["address"] = address
        opts.setdefault("log_to_driver", False)
        token = trust.use_token(address)
        try:
            if address is not None:
                trust.check_driver(address)
            ray.init(**opts)
        except (ray.exceptions.AuthenticationError, ConnectionError, RuntimeError) as exc:
            if not trust.is_refusal(exc):
                raise
            with contextlib.suppress(Exception):
                ray.shutdown()
            raise trust.refused(address, token, exc) from None
    return Fleet(placement_timeout=placement_timeout, namespace=namespace)


class DriverMark:
    """A do-nothing actor a driver owns, so it lives exactly as long as the driver's job:
    a box of a ``with`` block names it (``held_by``), and the box's node removes the box
    once the name is gone (``NodeService.end_unheld``)."""

    def ping(self) -> bool:
        return True


_marks: dict[str, tuple[str, Any]] = {}  # job id -> (the name of its driver's mark, its handle)


def driver_mark() -> str:
    """The name of this driver's mark, made on first use (one per job: its handle is
    kept here, as the actor goes with its last handle)."""
    job = ray.get_runtime_context().get_job_id()
    if job not in _marks:
        name = f"sandlot-driver-{job}-{secrets.token_hex(4)}"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        handle: Any = (  # on the driver's node: a mark on another node would die with that one
            ray.remote(DriverMark)
            .options(name=name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=here)
            .remote()
        )
        answer(handle.ping.remote(), timeout=120)  # named once it answers
        _marks[job] = (name, handle)
    return _marks[job][0]


class Fleet:
    """The boxes of every sandlot node of a Ray cluster: a client of them
    (``create``, ``get``, ``list``, ``SyncBox``, ``snapshots``... as ``sandlot.Client``
    has, giving ``sandlot.Box`` objects), and what only a fleet does."""

    def __init__(self, *, placement_timeout: float = 30.0, namespace: str | None = None) -> None:
        self.placement_timeout = placement_timeout
        self.namespace = None if namespace is None else access.check_namespace(namespace)
        self._nodes: dict[str, Any] = {}
        self._directory: Any = None
        self.backend = RayBackend(self)
        self.client = Client.wrap(AsyncClient.over(self.backend))
        self.last_migration: dict[str, Any] | None = None

    # -- actors ----------------------------------------------------------------------------

    def directory(self) -> Any:
        """The directory actor (created on the head node by the first driver that needs it)."""
        if self._directory is None:
            actor = ray.remote(Directory).options(
                name=DIRECTORY,
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_restarts=-1,
                max_task_retries=-1,
                resources={HEAD: 0.001},
            )
            self._directory = actor.remote()
        return self._directory

    def sees(self, labels: Mapping[str, str] | None) -> bool:
        """Whether a box with these labels is this driver's namespace's (all are, without one)."""
        return access.visible(self.namespace, labels)

    def node(self, node_id: str, *, every_namespace: bool = False) -> Any:
        """The sandlot actor of a node, started there if it is not running yet; its calls
        carry the driver's namespace unless ``every_namespace`` (the directory's own look
        at every box of the node)."""
        handle = self._handle(node_id)
        if self.namespace is None or every_namespace:
            return handle
        return NamespacedNode(handle, self.namespace)

    def _handle(self, node_id: str) -> Any:
        handle = self._nodes.get(node_id)
        if handle is None:
            actor = ray.remote(NodeActor).options(
                name=node_actor_name(node_id),
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            handle = self._nodes[node_id] = actor.remote(node_id)
        return handle

    def driver_mark(self) -> str:
        return driver_mark()

    def forget_node(self, node_id: str) -> None:
        """Drop the handle of a node actor that died: the next ``node()`` gets its successor
        (``get_if_exists``), which settles what the dead one left first."""
        self._nodes.pop(node_id, None)

    def tell_node(self, node_id: str, method: str, *args: Any) -> None:
        """Best effort: call a node, and once more through a new actor if its actor died
        while its node lives on (the caller goes on either way)."""
        for _ in range(2):
            try:
                answer(getattr(self.node(node_id), method).remote(*args), timeout=NODE_SETTLE)
                return
            except ray.exceptions.RayActorError:
                self.forget_node(node_id)
                if node_id not in {n["NodeID"] for n in placement.sandlot_nodes()}:
                    return
            except (ray.exceptions.RayError, SandlotError):
                return

    def resolve_node(self, key: str) -> str:
        """The id of a live sandlot node from its id or a unique prefix of it."""
        ids = [n["NodeID"] for n in placement.sandlot_nodes()]
        found = ([i for i in ids if i == key] or [i for i in ids if i.startswith(key)]) if key else []
        if len(found) != 1:
            known = ", ".join(i[:12] for i in ids) or "none"
            what = "more than one node" if len(found) > 1 else "no live sandlot node"
            raise NodeNotFound(f"{key!r} names {what} of the fleet (live nodes: {known})")
        return str(found[0])

    def join(self, node_id: str | None = None) -> dict[str, Any]:
        """Start the node actor of this node (or of ``node_id``) and return its facts."""
        node_id = node_id or ray.get_runtime_context().get_node_id()
        if node_id not in {n["NodeID"] for n in placement.sandlot_nodes()}:
            raise NodeNotFound(
                f"node {node_id[:12]} offers no sandlot resources: start Ray there with `sandlot fleet start "
                "--address HEAD:6379 --cpus N --memory-mib MIB` (token-authenticated: docs/fleet.md), or `ray"
                f' start` with --resources \'{{"{placement.CPUS}": N, "{placement.MEMORY}": MIB}}\' and '
                "RAY_AUTH_MODE=token"
            )
        facts: dict[str, Any] = answer(self.node(node_id).facts.remote())
        return facts

    # -- nodes and boxes -------------------------------------------------------------------

    def nodes(self) -> builtins.list[dict[str, Any]]:
        """Every sandlot node Ray knows of, dead ones too: its id, whether it is alive,
        the resources it offers, what its boxes reserve, and (live ones) its home and boxes."""
        records = [r for r in answer(self.directory().all.remote()) if self.sees(r.get("labels"))]
        out = []
        for n in placement.sandlot_nodes(alive_only=False):
            nid = n["NodeID"]
            mine = [r for r in records if r["node"] == nid and r["state"] != LOST]
            out.append(
                {
                    "node_id": nid,
                    "alive": bool(n["Alive"]),
                    "address": n.get("NodeManagerAddress"),
                    "cpus": n["Resources"].get(placement.CPUS, 0.0),
                    "memory_mib": n["Resources"].get(placement.MEMORY, 0.0),
                    "reserved_memory_mib": sum(r.get("memory_mib") or 0 for r in mine),
                    "boxes": len(mine),
                    "replicas": sum(1 for r in records if (r.get("replica") or {}).get("node") == nid),
                }
            )
        live = [o for o in out if o["alive"]]
        facts = self._gather({o["node_id"]: self.node(o["node_id"]).facts.remote() for o in live}, timeout=30)
        for o in live:
            f = facts.get(o["node_id"])
            if isinstance(f, dict):
                o.update(home=f["home"], version=f["version"], running=f["running"])
        return out

    def _gather(self, refs: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Results of calls to several nodes; a node that fails or does not answer in time is left out."""
        out: dict[str, Any] = {}
        for key, ref in refs.items():
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                out[key] = ray.get(ref, timeout=timeout)
        return out

    def reconcile(self) -> builtins.list[Record]:
        """Make the directory agree with the live nodes, give back the reservations of boxes
        dropped or lost, and return the records (the driver's namespace's)."""
        return [r for r in loop.run(self.backend.reconcile()) if self.sees(r.get("labels"))]

    def Box(self, image: str | None = None, **options: Any) -> SyncBox:
        """A box to make with ``start()`` or ``with``: ``options`` as for ``create``
        (``start`` aside)."""
        return self.client.Box(image, **options)

    def create(
        self,
        image: str | None = None,
        *,
        strategy: str = "pack",
        node: str | None = None,
        replicas: int = 0,
        start: bool = True,
        placement_timeout: float | None = None,
        **options: Any,
    ) -> SyncBox:
        """Place a box with Ray's scheduler and make it on the node chosen (started, unless
        ``start=False``). ``options`` as for ``sandlot.Box`` (``cpus`` and ``memory_mib``
        are what it reserves; what names something of this host, such as ``volumes``,
        raises Unsupported); ``strategy``: "pack" or "spread"; ``node``: that node;
        ``replicas=1``: keep its latest suspended or snapshot state on a second node too,
        for ``recover``. NoCapacity if no node has room in time."""
        options.pop("keep", None)  # a fleet box is kept until removed: its node outlives the driver
        where = {
            "strategy": strategy,
            "node": node,
            "replicas": replicas,
            "placement_timeout": placement_timeout,
        }
        box = self.client.Box(image, **options, **{k: v for k, v in where.items() if v is not None})
        if start:
            box.start()
        else:
            loop.run(self.backend.create(box.aio.ref, start=False))
        return box

    def get(self, key: str) -> SyncBox:
        """The box with this id, name or id prefix, wherever it is (BoxNotFound if none)."""
        return self.client.get(key)

    def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[SyncBox]:
        """Every box of the fleet (lost ones too, with ``state == "lost"``), oldest first;
        ``labels``: only those carrying all of them."""
        return self.client.list(labels=labels)

    def events(
        self, *, box: str | None = None, since: float | None = None, after: int | None = None,
        follow: bool = True,
    ) -> Iterator[Event]:  # fmt: skip
        """What happened to the fleet's boxes, from each node's store (``sandlot.events``):
        ``box``'s from its node, every box's from every live node merged by time. Event
        ids count on each node, so ``after`` needs ``box``; ``since`` works for all."""
        return self.client.events(box=box, since=since, after=after, follow=follow)

    def record(self, box: SyncBox | AsyncBox | str) -> Record:
        """The directory's record of a box, read anew: its node, its reservation, its
        replica (``{"node", "snapshot", "at"}``) and, for a lost box, ``lost`` (the node it
        was on and when it was found lost)."""
        key = box if isinstance(box, str) else box.id
        rec = dict(answer(self.directory().get.remote(key)))
        if not self.sees(rec.get("labels")):
            raise BoxNotFound(f"no box {key!r}", box=key)
        return rec

    def reserve_spread(self, one: dict[str, float], timeout: float) -> placement.Reservation:
        """One box's reservation on the node with the fewest boxes of the fleet (then the
        least share of its memory reserved), which Ray then admits or not; if it has no room now, wherever Ray
        spreads it. Ray balances the bundles of one group, not separate groups."""
        records = answer(self.directory().all.remote())
        offered = {n["NodeID"]: n["Resources"].get(placement.MEMORY, 0.0) for n in placement.sandlot_nodes()}
        used = dict.fromkeys(offered, 0.0)
        boxes = dict.fromkeys(offered, 0)
        for r in records:
            if r["node"] in used and r["state"] != LOST:
                used[r["node"]] += r.get("memory_mib") or 0
                boxes[r["node"]] += 1
        for nid in sorted(offered, key=lambda n: (boxes[n], used[n] / max(offered[n], 1.0))):
            if offered[nid] - used[nid] >= one[placement.MEMORY]:
                with contextlib.suppress(SandlotError):
                    return placement.reserve([one], node=nid, timeout=min(placement.ROUND_WAIT, timeout))
                break
        return placement.reserve([one], strategy="spread", timeout=timeout)

    def fork(
        self,
        box: SyncBox | str,
        n: int = 1,
        *,
        name: str | None = None,
        spread: bool = False,
        placement_timeout: float | None = None,
    ) -> Spread:
        """``n`` running copies of a box from a snapshot taken now, as ``box.fork(n)``;
        ``spread=True``: Ray spreads their reservations over the nodes, the snapshot is
        exported once, moved as chunks through the object store, imported once per node,
        and that node's children start there. ``name``: the prefix of their names (the
        box's by default). ``per_node`` of the result says where they landed."""
        ref = self._ref(box)
        made = loop.run(self.backend.fork(ref, n, name, spread=spread, placement_timeout=placement_timeout))
        out = Spread(SyncBox.wrap(AsyncBox.bound(k)) for k in made)
        out.per_node, out.timings = made.per_node, made.timings
        return out

    def _ref(self, box: SyncBox | AsyncBox | str) -> RayBoxRef:
        found = self.get(box) if isinstance(box, str) else box
        return ray_box(found.aio.ref if isinstance(found, SyncBox) else found.ref)

    def migrate(self, box: SyncBox | str, node: str, *, placement_timeout: float | None = None) -> SyncBox:
        """Move a box to ``node``: a running one is frozen (paused, its state saved), its
        state moves through the object store, and it goes on there with its processes,
        id, name and labels; a suspended one arrives suspended. The target's room is
        reserved first (NoCapacity), the archive's compatibility checks apply
        (IncompatibleSnapshot); on any failure the box goes on where it was and nothing
        stays on the target. A handle given follows the box and is returned;
        ``last_migration`` has the timings."""
        ref = self._ref(box)
        rec = loop.run(self.backend.reread(ref))
        if rec["state"] == LOST:
            raise InvalidState(
                f"box {rec['name']} is lost with its node; recover() it", box=rec["name"], state=LOST
            )
        target = self.resolve_node(node)
        source = rec["node"]
        if target == source:
            raise InvalidArgument(f"box {rec['name']} is already on node {target[:12]}")
        tier = self.shared_tier(source, target)
        self.check_separate(source, target)
        t0 = time.monotonic()
        res = placement.reserve(
            [box_bundle(rec)], node=target, timeout=placement_timeout or self.placement_timeout
        )
        if tier is not None:
            return self._migrate_through_tier(box, ref, rec, source, target, res, t0, tier)
        src, dst = self.node(source), self.node(target)
        step = source
        try:
            held = answer(src.hold.remote(rec["id"]))
            t1 = time.monotonic()
            try:
                moved = answer(src.export.remote(held["snapshot"]))
                t2 = time.monotonic()
                start = {"n": 1, "box_id": rec["id"], "name": rec["name"], "labels": rec["labels"]}
                step = target
                landed = answer(dst.import_state.remote(moved, start))
                if held["was"] in ("suspended", "paused"):
                    method = "suspend" if held["was"] == "suspended" else "pause"
                    try:
                        answer(dst.call.remote("box", method, rec["id"], {}))
                    except BaseException:
                        with contextlib.suppress(Exception):  # a dead target: its next actor removes it
                            answer(dst.remove.remote(rec["id"], True))
                            answer(dst.drop_snapshot.remote(landed["snapshot"]))
                        raise
            except BaseException:
                self.tell_node(source, "release", rec["id"])
                raise
        except ray.exceptions.RayActorError as exc:
            placement.release(res.name)
            self.forget_node(step)
            raise ConnectionLost(
                f"node {step[:12]} died during the move of box {rec['name']} ({type(exc).__name__}): "
                f"the move was undone, the box stays on node {source[:12]}",
                box=rec["name"],
            ) from None
        except BaseException:
            placement.release(res.name)
            raise
        t3 = time.monotonic()
        old = rec.get("reservation")
        # the move is done when the directory says so; only then does the source's copy go
        # (a source that dies before it does leaves a hold its next actor ends by this record)
        ref.rec = answer(
            self.directory().put.remote(
                {**rec, "node": target, "reservation": res.name, "state": held["was"], "lost": None}
            )
        )
        self.tell_node(source, "finish", rec["id"])
        if old and not any(r.get("reservation") == old for r in answer(self.directory().all.remote())):
            placement.release(old)
        self.last_migration = {
            "save_s": t1 - t0,
            "export_s": moved["export_s"],
            "move_s": landed["fetch_s"],
            "import_s": landed["import_s"],
            "restore_s": landed.get("start_s", 0.0),
            "total_s": time.monotonic() - t0,
            "transfer_s": t3 - t2,
            "bytes": moved["size"],
            "chunks": len(moved["chunks"]),
        }
        return box if isinstance(box, SyncBox) else SyncBox.wrap(AsyncBox.bound(ref))

    def shared_tier(self, source: str, target: str) -> str | None:
        """The storage tier both nodes' homes have, if they share one (docs/storage.md)."""
        facts = self._gather({n: self.node(n).facts.remote() for n in (source, target)}, timeout=30)
        tiers = {(facts.get(n) or {}).get("storage_tier") for n in (source, target)}
        return tiers.pop() if len(tiers) == 1 and None not in tiers else None

    def _migrate_through_tier(
        self, box: SyncBox | str, ref: RayBoxRef, rec: Record, source: str, target: str, res: Any, t0: float,
        tier: str,
    ) -> SyncBox:  # fmt: skip
        """A move through the storage tier both nodes share: the source suspends the box and
        sends the tier only what it lacks, the target reads from it only the chunks it
        does not hold itself. A target that fails sends it back to the source."""
        src, dst = self.node(source), self.node(target)
        try:
            sent = answer(src.push_box.remote(rec["id"]))
            t1 = time.monotonic()
            try:
                landed = answer(dst.pull_box.remote(rec["id"], False, sent["was"]))
            except BaseException:
                with contextlib.suppress(Exception):  # back where it was; the box is in the tier either way
                    answer(src.pull_box.remote(rec["id"], True, sent["was"]))
                raise
        except BaseException:
            placement.release(res.name)
            raise
        old = rec.get("reservation")
        ref.rec = answer(
            self.directory().put.remote(
                {**rec, "node": target, "reservation": res.name, "state": sent["was"], "lost": None}
            )
        )
        if old and not any(r.get("reservation") == old for r in answer(self.directory().all.remote())):
            placement.release(old)
        self.last_migration = {
            "through": tier,
            "save_s": sent["suspend_s"],
            "push_s": sent["push_s"],
            "pull_s": landed["pull_s"],
            "restore_s": landed["start_s"],
            "total_s": time.monotonic() - t0,
            "transfer_s": time.monotonic() - t1,
            "bytes": sent["bytes"],
            "chunks": sent["chunks"],
        }
        return box if isinstance(box, SyncBox) else SyncBox.wrap(AsyncBox.bound(ref))

    def check_separate(self, source: str, target: str) -> None:
        """Two nodes on one host must not share a run directory: a moved box keeps its id,
        and a VM's sockets are in the run directory under the box's id."""
        facts = self._gather({n: self.node(n).facts.remote() for n in (source, target)}, timeout=30)
        a, b = facts.get(source), facts.get(target)
        if a and b and (a["host"], a["runtime_dir"]) == (b["host"], b["runtime_dir"]):
            raise InvalidArgument(
                f"nodes {source[:12]} and {target[:12]} run on one host with one run directory "
                f"({a['runtime_dir']}): give each its own SANDLOT_RUNTIME_DIR to move boxes between them"
            )

    def recover(self, box: SyncBox | str, *, placement_timeout: float | None = None) -> SyncBox:
        """Bring a lost box back on the node that keeps its replica, from its latest
        suspended or snapshot state (what it did after that is gone): same id, name and
        labels, running."""
        self.reconcile()
        rec = self.record(box)  # the driver's namespace's
        if rec["state"] != LOST:
            raise InvalidState(
                f"box {rec['name']} is not lost (it is {rec['state']})", box=rec["name"], state=rec["state"]
            )
        replica = rec.get("replica")
        if not replica:
            found, why = self._recover_from_tier(rec, placement_timeout)
            if found is not None:
                return found
            raise InvalidState(
                f"box {rec['name']} was lost with node {rec['node'][:12]} and has no replica on a live node "
                "(replicas=1 keeps its last suspended or snapshot state on a second node; a storage tier, "
                f"every suspended box: {why})",
                box=rec["name"],
                state=LOST,
            )
        res = placement.reserve(
            [box_bundle(rec)], node=replica["node"], timeout=placement_timeout or self.placement_timeout
        )
        try:
            started = answer(
                self.node(replica["node"]).start_from.remote(
                    replica["snapshot"], 1, rec["name"], rec["id"], rec["labels"]
                )
            )
        except BaseException:
            placement.release(res.name)
            raise
        rec = answer(
            self.directory().put.remote(
                {
                    **rec,
                    **started[0],
                    "node": replica["node"],
                    "reservation": res.name,
                    "lost": None,
                    "replica": None,
                    "recovered": {"from": rec["lost"], "at": time.time()},
                }
            )
        )
        return SyncBox.wrap(AsyncBox.bound(RayBoxRef(self.backend, rec)))

    def _recover_from_tier(self, rec: Record, placement_timeout: float | None) -> tuple[SyncBox | None, str]:
        """A lost box its dead node's pusher sent to the storage tier (docs/storage.md),
        pulled by a live node that shares the tier, which takes it from the dead home (by
        force: the directory knows that node is gone), and started there. None where no
        live node's tier holds it (and why)."""
        live = [n["NodeID"] for n in placement.sandlot_nodes() if n["NodeID"] != rec["node"]]
        asked = self._gather({n: self.node(n).tier_holds.remote(rec["id"]) for n in live}, timeout=60)
        holds: dict[str, Any] = {}
        for n, reply in asked.items():
            try:
                holds[n] = opened(reply)
            except SandlotError as exc:
                holds[n] = str(exc)
        said = "; ".join(f"node {n[:12]}: {holds.get(n, 'no answer')}" for n in live)
        for node in [n for n in live if holds.get(n) is True]:
            try:
                res = placement.reserve(
                    [box_bundle(rec)], node=node, timeout=placement_timeout or self.placement_timeout
                )
            except SandlotError:
                continue  # no room there: the next node that shares the tier
            try:
                started = answer(self.node(node).pull_box.remote(rec["id"], True, "running"))
            except BaseException:
                placement.release(res.name)
                raise
            info = {k: v for k, v in started.items() if k not in ("pull_s", "start_s")}
            found = answer(
                self.directory().put.remote(
                    {**rec, **info, "node": node, "reservation": res.name, "lost": None, "replica": None,
                     "recovered": {"from": rec["lost"], "at": time.time(), "through": "storage tier"}}
                )
            )  # fmt: skip
            return SyncBox.wrap(AsyncBox.bound(RayBoxRef(self.backend, found))), said
        return None, f"no live node's storage tier holds it ({said})"


class NamespacedNode:
    """A node actor's handle whose every call carries a namespace (``namespace=``, which
    each of the node's calls takes: ``node._relayed``)."""

    def __init__(self, handle: Any, namespace: str) -> None:
        self.handle, self.namespace = handle, namespace

    def __getattr__(self, method: str) -> NamespacedCall:
        return NamespacedCall(getattr(self.handle, method), self.namespace)


class NamespacedCall:
    def __init__(self, method: Any, namespace: str) -> None:
        self.method, self.namespace = method, namespace

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.method.remote(*args, namespace=self.namespace, **kwargs)

    def options(self, **options: Any) -> NamespacedCall:
        return NamespacedCall(self.method.options(**options), self.namespace)


class Spread(builtins.list[SyncBox]):
    """The children of a fleet's fork, with ``per_node``: how many landed on each node,
    and ``timings``."""

    per_node: dict[str, int]
    timings: dict[str, float]


__all__ = ["Fleet", "Forked", "Spread", "connect", "got"]
