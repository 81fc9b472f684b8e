"""The fleet as a driver sees it: ``connect``, ``Fleet``, ``FleetBox`` and its files,
processes and snapshots.

Every call on a box goes to the node actor of the node that has it (one Ray actor
call); placement goes through Ray's scheduler (``placement``); the directory actor
says which node has which box (``directory``). A fleet box offers the methods of a
local ``sandlot.Box`` with the same names and arguments (``tests/unit/test_fleet.py``
checks it), plus ``fork(n, spread=True)``, ``node`` and ``migrate``.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..api.files import FileInfo
from ..api.process import ExecResult
from ..core.spec import DEFAULT_MEMORY_MIB
from ..errors import BoxNotFound, InvalidArgument, InvalidState, NodeNotFound, SandlotError, from_dict
from . import placement
from .directory import LOST, Directory, Record, new_record
from .node import NodeService

NAMESPACE = placement.NAMESPACE
DIRECTORY = "sandlot-directory"
NODE_ACTOR = "sandlot-node:{}"
HEAD = "node:__internal_head__"


def node_actor_name(node_id: str) -> str:
    return NODE_ACTOR.format(node_id)


def unwrap(reply: Mapping[str, Any]) -> Any:
    """A node call's value, or its error raised again as the same sandlot class."""
    if "error" in reply:
        raise from_dict(reply["error"])
    return reply["ok"]


def answer(ref: Any) -> Any:
    """The directory actor's answer; a sandlot error it raised is raised as itself."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, SandlotError):
            raise exc.cause from None
        raise


def host_resources() -> dict[str, float]:
    """What a node started by ``connect(None)`` offers boxes: its cores, and half its memory."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {placement.CPUS: float(os.cpu_count() or 1), placement.MEMORY: float(pages // 2 >> 20)}


def connect(
    address: str | None = "auto",
    *,
    resources: Mapping[str, float] | None = None,
    placement_timeout: float = 30.0,
    **init_options: Any,
) -> Fleet:
    """Join a Ray cluster (``"auto"``: the one this machine belongs to; ``"ray://host:10001"``:
    through Ray Client), or with ``None`` start a local one whose node offers this host's
    cores and half its memory to boxes (``resources`` to say otherwise). A Ray already
    initialized in this process is used as it is. ``init_options`` go to ``ray.init``."""
    if not ray.is_initialized():
        opts: dict[str, Any] = {"namespace": NAMESPACE, **init_options}
        if address is None:  # what a new local Ray is; Ray refuses these when it joins one
            opts["resources"] = {**host_resources(), **(resources or {})}
            opts.setdefault("include_dashboard", False)
        else:
            opts["address"] = address
        opts.setdefault("log_to_driver", False)
        ray.init(**opts)
    return Fleet(placement_timeout=placement_timeout)


class Fleet:
    """The boxes of every sandlot node of a Ray cluster."""

    def __init__(self, *, placement_timeout: float = 30.0) -> None:
        self.placement_timeout = placement_timeout
        self._nodes: dict[str, Any] = {}
        self._directory: Any = None

    # -- actors ----------------------------------------------------------------------------

    def directory(self) -> Any:
        """The directory actor (created on the head node by the first driver that needs it)."""
        if self._directory is None:
            actor = ray.remote(Directory).options(
                name=DIRECTORY, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
                max_restarts=-1, max_task_retries=-1, resources={HEAD: 0.001},
            )  # fmt: skip
            self._directory = actor.remote()
        return self._directory

    def node(self, node_id: str) -> Any:
        """The sandlot actor of a node, started there if it is not running yet."""
        handle = self._nodes.get(node_id)
        if handle is None:
            actor = ray.remote(NodeService).options(
                name=node_actor_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )  # fmt: skip
            handle = self._nodes[node_id] = actor.remote(node_id)
        return handle

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
                f"node {node_id[:12]} offers no sandlot resources: start Ray there with "
                f'--resources \'{{"{placement.CPUS}": N, "{placement.MEMORY}": MIB}}\''
            )
        facts: dict[str, Any] = ray.get(self.node(node_id).facts.remote())
        return facts

    # -- nodes and boxes -------------------------------------------------------------------

    def nodes(self) -> builtins.list[dict[str, Any]]:
        """Every sandlot node Ray knows of, dead ones too: its id, whether it is alive,
        the resources it offers, what its boxes reserve, and (live ones) its home and boxes."""
        records = ray.get(self.directory().all.remote())
        out = []
        for n in placement.sandlot_nodes(alive_only=False):
            nid = n["NodeID"]
            mine = [r for r in records if r["node"] == nid and r["state"] != LOST]
            out.append({
                "node_id": nid, "alive": bool(n["Alive"]), "address": n.get("NodeManagerAddress"),
                "cpus": n["Resources"].get(placement.CPUS, 0.0),
                "memory_mib": n["Resources"].get(placement.MEMORY, 0.0),
                "reserved_memory_mib": sum(r.get("memory_mib") or 0 for r in mine),
                "boxes": len(mine),
                "replicas": sum(1 for r in records if (r.get("replica") or {}).get("node") == nid),
            })  # fmt: skip
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
        """Make the directory agree with the live nodes (``directory.reconcile``), give back
        the reservations of boxes dropped or lost, and return the records."""
        alive = [n["NodeID"] for n in placement.sandlot_nodes()]
        answers = self._gather({nid: self.node(nid).list.remote() for nid in alive}, timeout=30)
        seen = {nid: a["ok"] for nid, a in answers.items() if "ok" in a}
        records, released = ray.get(self.directory().reconcile.remote(alive, seen))
        for name in released:
            placement.release(name)
        return list(records)

    def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[FleetBox]:
        """Every box of the fleet (lost ones too, with ``state == "lost"``), oldest first;
        ``labels``: only those carrying all of them."""
        out = []
        for rec in self.reconcile():
            if labels and any(rec["labels"].get(k) != v for k, v in labels.items()):
                continue
            out.append(FleetBox(self, rec))
        return out

    def get(self, key: str) -> FleetBox:
        """The box with this id, name or id prefix, wherever it is (BoxNotFound if none)."""
        with contextlib.suppress(BoxNotFound):
            return FleetBox(self, answer(self.directory().get.remote(key)))
        self.reconcile()  # perhaps a box the directory has not seen yet
        return FleetBox(self, answer(self.directory().get.remote(key)))

    def Box(self, image: str | None = None, **options: Any) -> FleetBox:
        """A box to make with ``start()`` or ``with``: ``options`` as for ``create``."""
        return FleetBox(self, None, pending=(image, options))

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
    ) -> FleetBox:
        """Place a box with Ray's scheduler and make it on the node chosen (started, unless
        ``start=False``). ``options`` as for ``sandlot.Box`` (``cpus`` and ``memory_mib``
        are what it reserves); ``strategy``: "pack" or "spread"; ``node``: that node;
        ``replicas=1``: keep its latest suspended or snapshot state on a second node too,
        for ``recover``. NoCapacity if no node has room in time."""
        if replicas not in (0, 1):
            raise InvalidArgument("replicas is 0 or 1")
        options.pop("keep", None)  # a fleet box is kept until removed: its node outlives the driver
        if "home" in options:
            raise InvalidArgument("a fleet box lives in its node's home; home= is not an option")
        cpus, memory = int(options.get("cpus", 1)), int(options.get("memory_mib", DEFAULT_MEMORY_MIB))
        target = self.resolve_node(node) if node else None
        one, timeout = placement.bundle(cpus, memory), placement_timeout or self.placement_timeout
        if strategy == "spread" and target is None:
            res = self.reserve_spread(one, timeout)
        else:
            res = placement.reserve([one], strategy=strategy, node=target, timeout=timeout)
        where = res.nodes[0]
        try:
            made = unwrap(ray.get(self.node(where).create.remote(image, options, start)))
        except BaseException:
            placement.release(res.name)
            raise
        rec = new_record(made, where, time.time(), reservation=res.name, replicas=replicas)
        return FleetBox(self, ray.get(self.directory().put.remote(rec)))

    def reserve_spread(self, one: dict[str, float], timeout: float) -> placement.Reservation:
        """One box's reservation on the node with the fewest boxes of the fleet (then the
        least share of its memory reserved), which Ray then admits or not; if it has no room now, wherever Ray
        spreads it. Ray balances the bundles of one group, not separate groups."""
        records = ray.get(self.directory().all.remote())
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

    def migrate(self, box: FleetBox | str, node: str, *, placement_timeout: float | None = None) -> FleetBox:
        """Move a box to ``node``: a running one is frozen (paused, its state saved), its
        state moves through the object store, and it goes on there with its processes,
        id, name and labels; a suspended one arrives suspended. The target's room is
        reserved first (NoCapacity), the archive's compatibility checks apply
        (IncompatibleSnapshot); on any failure the box goes on where it was and nothing
        stays on the target. A handle given follows the box and is returned;
        ``last_migration`` has the timings."""
        fbox = box if isinstance(box, FleetBox) else self.get(box)
        rec = fbox.record_now()
        if rec["state"] == LOST:
            raise InvalidState(f"box {rec['name']} is lost with its node; recover() it", box=rec["name"],
                               state=LOST)  # fmt: skip
        target = self.resolve_node(node)
        source = rec["node"]
        if target == source:
            raise InvalidArgument(f"box {rec['name']} is already on node {target[:12]}")
        self.check_separate(source, target)
        t0 = time.monotonic()
        res = placement.reserve([box_bundle(rec)], node=target,
                                timeout=placement_timeout or self.placement_timeout)  # fmt: skip
        src, dst = self.node(source), self.node(target)
        try:
            held = unwrap(ray.get(src.hold.remote(rec["id"])))
            t1 = time.monotonic()
            try:
                moved = unwrap(ray.get(src.export.remote(held["snapshot"])))
                t2 = time.monotonic()
                start = {"n": 1, "box_id": rec["id"], "name": rec["name"], "labels": rec["labels"]}
                landed = unwrap(ray.get(dst.import_state.remote(moved, start)))
                if held["was"] in ("suspended", "paused"):
                    method = "suspend" if held["was"] == "suspended" else "pause"
                    try:
                        unwrap(ray.get(dst.call.remote(rec["id"], method, (), {})))
                    except BaseException:
                        unwrap(ray.get(dst.remove.remote(rec["id"], True)))
                        unwrap(ray.get(dst.drop_snapshot.remote(landed["snapshot"])))
                        raise
            except BaseException:
                with contextlib.suppress(Exception):
                    unwrap(ray.get(src.release.remote(rec["id"])))
                raise
        except BaseException:
            placement.release(res.name)
            raise
        t3 = time.monotonic()
        with contextlib.suppress(SandlotError):  # the box runs on the target: the source's copy must go
            unwrap(ray.get(src.finish.remote(rec["id"])))
        old = rec.get("reservation")
        rec = ray.get(self.directory().put.remote({**rec, "node": target, "reservation": res.name,
                                                   "state": held["was"], "lost": None}))  # fmt: skip
        if old and not any(r.get("reservation") == old for r in ray.get(self.directory().all.remote())):
            placement.release(old)
        out = fbox
        out._rec = rec
        out.last_migration = {
            "save_s": t1 - t0, "export_s": moved["export_s"], "move_s": landed["fetch_s"],
            "import_s": landed["import_s"], "restore_s": landed.get("start_s", 0.0),
            "total_s": time.monotonic() - t0, "transfer_s": t3 - t2, "bytes": moved["size"],
            "chunks": len(moved["chunks"]),
        }  # fmt: skip
        return out

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

    def recover(self, box: FleetBox | str, *, placement_timeout: float | None = None) -> FleetBox:
        """Bring a lost box back on the node that keeps its replica, from its latest
        suspended or snapshot state (what it did after that is gone): same id, name and
        labels, running."""
        self.reconcile()
        key = box.id if isinstance(box, FleetBox) else box
        rec = answer(self.directory().get.remote(key))
        if rec["state"] != LOST:
            raise InvalidState(f"box {rec['name']} is not lost (it is {rec['state']})", box=rec["name"],
                               state=rec["state"])  # fmt: skip
        replica = rec.get("replica")
        if not replica:
            raise InvalidState(
                f"box {rec['name']} was lost with node {rec['node'][:12]} and has no replica on a live node "
                "(replicas=1 keeps its last suspended or snapshot state on a second node)",
                box=rec["name"], state=LOST,
            )  # fmt: skip
        res = placement.reserve([box_bundle(rec)], node=replica["node"],
                                timeout=placement_timeout or self.placement_timeout)  # fmt: skip
        try:
            started = unwrap(ray.get(self.node(replica["node"]).start_from.remote(
                replica["snapshot"], 1, rec["name"], rec["id"], rec["labels"])))  # fmt: skip
        except BaseException:
            placement.release(res.name)
            raise
        rec = ray.get(self.directory().put.remote({
            **rec, "node": replica["node"], "reservation": res.name, "state": started[0]["state"],
            "lost": None, "replica": None, "recovered": {"from": rec["lost"], "at": time.time()},
        }))  # fmt: skip
        return FleetBox(self, rec)

    # -- replicas --------------------------------------------------------------------------

    def replicate(self, rec: Record, snapshot: str) -> Record:
        """Keep ``snapshot`` (of the box's node) on a second node as the box's replica,
        in place of the one before."""
        nodes = [n["NodeID"] for n in placement.sandlot_nodes() if n["NodeID"] != rec["node"]]
        if not nodes:
            raise NodeNotFound(f"box {rec['name']} wants a replica, and the fleet has no second live node")
        old = rec.get("replica") or {}
        records = ray.get(self.directory().all.remote())

        def load(nid: str) -> tuple[int, int]:  # the node that keeps the fewest boxes and replicas
            keeps = sum(1 for r in records if r["node"] == nid or (r.get("replica") or {}).get("node") == nid)
            return keeps, 0 if nid == old.get("node") else 1

        target = min(nodes, key=load)
        moved = unwrap(ray.get(self.node(rec["node"]).export.remote(snapshot)))
        kept = unwrap(ray.get(self.node(target).import_state.remote(moved, None)))
        if old.get("node"):
            with contextlib.suppress(Exception):
                unwrap(ray.get(self.node(old["node"]).drop_snapshot.remote(old["snapshot"]), timeout=30))
        replica = {"node": target, "snapshot": kept["snapshot"], "at": time.time()}
        updated: Record = ray.get(self.directory().update.remote(rec["id"], {"replica": replica})) or rec
        return updated


def box_bundle(rec: Record) -> dict[str, float]:
    """What a box of this record reserves."""
    return placement.bundle(rec.get("cpus") or 1, rec.get("memory_mib") or DEFAULT_MEMORY_MIB)


@dataclass
class FleetSnapshot:
    """A snapshot of a fleet box, on the box's node."""

    id: str
    name: str | None
    box_id: str
    node: str
    created_at: float = 0.0
    size: int = 0


class Forked(builtins.list["FleetBox"]):
    """The children of a fork, with ``per_node``: how many landed on each node."""

    per_node: dict[str, int]
    timings: dict[str, float]


class FleetBox:
    """A box of the fleet: the methods of ``sandlot.Box``, run by the actor of its node."""

    def __init__(
        self, fleet: Fleet, record: Record | None, *, pending: tuple[Any, dict[str, Any]] | None = None
    ) -> None:
        self.fleet = fleet
        self._rec: Record | None = record
        self._pending = pending
        self.keep = bool(pending and pending[1].pop("keep", False))
        self.last_migration: dict[str, Any] | None = None

    # -- what the directory knows ----------------------------------------------------------

    def _record(self) -> Record:
        if self._rec is None:
            raise InvalidState("the fleet box was not created; call start()", state="new")
        return self._rec

    def record_now(self) -> Record:
        """The directory's record of the box, read anew."""
        self._rec = answer(self.fleet.directory().get.remote(self._record()["id"]))
        return self._rec

    @property
    def id(self) -> str:
        return str(self._record()["id"])

    @property
    def name(self) -> str:
        return str(self._record()["name"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._record()["labels"])

    @property
    def node(self) -> str:
        """The id of the Ray node the box lives on (its last one, if lost)."""
        return str(self._record()["node"])

    @property
    def state(self) -> str:
        """As of the last operation through this handle (``refresh()`` asks the node);
        "lost" when its node died."""
        if self._rec is None:
            return "new"
        return str(self._rec["state"])

    @property
    def lost(self) -> dict[str, Any] | None:
        """For a lost box: the node it was on and when it was found lost."""
        return self._record().get("lost")

    @property
    def replica(self) -> dict[str, Any] | None:
        """Where its latest saved state is kept for ``recover`` (node, snapshot, time), if anywhere."""
        return self._record().get("replica")

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._record())

    @property
    def running(self) -> bool:
        return self.state == "running"

    def __repr__(self) -> str:
        if self._rec is None:
            return "<FleetBox (new)>"
        return f"<FleetBox {self.name} ({self.id}) {self.state} on {self.node[:12]}>"

    # -- calls on its node -----------------------------------------------------------------

    def _actor(self) -> Any:
        rec = self._record()
        if rec["state"] == LOST:
            raise InvalidState(
                f"box {rec['name']} is lost: its node {rec['node'][:12]} died at "
                f"{time.strftime('%H:%M:%S', time.localtime(rec['lost']['at']))}",
                box=rec["name"], state=LOST,
            )  # fmt: skip
        return self.fleet.node(rec["node"])

    def _ask(self, ref: Any) -> Any:
        try:
            return unwrap(ray.get(ref))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            self.fleet.reconcile()
            self.record_now()
            self._actor()  # raises InvalidState(lost) if its node is gone
            raise

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._ask(self._actor().call.remote(self.id, method, args, kwargs))

    def _set_state(self, state: str) -> None:
        rec = self._record()
        if rec["state"] != state:
            rec["state"] = state
            self.fleet.directory().update.remote(rec["id"], {"state": state})  # in order, not waited for

    def _changed(self) -> None:
        self._set_state(self._ask(self._actor().state.remote(self.id))["state"])

    # lifecycle

    def start(self) -> FleetBox:
        """Create the box if it is new (placing it), else boot it; wait for its agent."""
        if self._rec is None:
            assert self._pending is not None
            image, options = self._pending
            made = self.fleet.create(image, **options)
            self._rec, self._pending = made._rec, None
            return self
        self._call("start")
        self._changed()
        return self

    def __enter__(self) -> FleetBox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self.keep and self._rec is not None:
            self.remove(force=True)

    def stop(self, timeout: float = 10.0) -> None:
        self._call("stop", timeout)
        self._changed()

    def restart(self, timeout: float = 10.0) -> None:
        self._call("restart", timeout)
        self._changed()

    def kill(self) -> None:
        self._call("kill")
        self._changed()

    def pause(self) -> None:
        self._call("pause")
        self._changed()

    def unpause(self) -> None:
        self._call("unpause")
        self._changed()

    def remove(self, *, force: bool = False) -> None:
        """Delete the box on its node and from the directory, and give its room back
        (a lost box is only forgotten; so is its replica)."""
        rec = self._record()
        if rec["state"] != LOST:
            self._ask(self._actor().remove.remote(self.id, force))
        replica = rec.get("replica")
        if replica:
            with contextlib.suppress(Exception):
                ray.get(
                    self.fleet.node(replica["node"]).drop_snapshot.remote(replica["snapshot"]), timeout=30
                )
        for name in ray.get(self.fleet.directory().release.remote(self.id)):
            placement.release(name)
        rec["state"] = "removed"

    def refresh(self) -> str:
        """The box's state, asked of its node ("lost" if the node is gone)."""
        self.fleet.reconcile()
        try:
            rec = self.record_now()
        except BoxNotFound:
            self._record()["state"] = "removed"
            return "removed"
        if rec["state"] != LOST:
            self._changed()
        return self.state

    def inspect(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("inspect")
        out["fleet"] = {
            "node": self.node,
            "replica": self.replica,
            "reservation": self._record()["reservation"],
        }
        return out

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("stats")
        return out

    def logs(self, lines: int | None = None) -> str:
        return str(self._call("logs", lines))

    def ping(self) -> float:
        return float(self._call("ping"))

    # commands

    def exec(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        tty: bool = False,
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion on the box's node; as ``sandlot.Box.exec`` (``stdin``
        is bytes or text: it travels with the call)."""
        result: ExecResult = self._call("exec", *[os.fspath(a) for a in argv], env=env, cwd=cwd, user=user,
                                        stdin=stdin, timeout=timeout, tty=tty, check=check)  # fmt: skip
        return result

    def sh(self, script: str, **kwargs: Any) -> ExecResult:
        return self.exec("/bin/sh", "-c", script, **kwargs)

    def spawn(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bytes | str | None = None,
    ) -> FleetProcess:
        """Start a command and stream its output as it comes (``FleetProcess``): a Ray
        streaming generator from the box's node. ``stdin``: all of its input, given now."""
        kwargs = {"env": env, "cwd": cwd, "user": user, "tty": tty, "rows": rows, "cols": cols}
        data = stdin.encode() if isinstance(stdin, str) else stdin
        args = tuple(os.fspath(a) for a in argv)
        return FleetProcess(args, self._actor().spawn.remote(self.id, args, kwargs, data))

    @property
    def files(self) -> FleetFiles:
        return FleetFiles(self)

    # live state

    def snapshot(self, name: str | None = None) -> FleetSnapshot:
        """Save memory, processes and disk on the box's node; with ``replicas=1`` the
        snapshot is also kept on a second node for ``recover``."""
        made = self._ask(self._actor().snapshot.remote(self.id, name))
        if self._record().get("replicas"):
            self._rec = self.fleet.replicate(self._record(), made["id"])
        return FleetSnapshot(made["id"], made["name"], self.id, self.node, made["created_at"], made["size"])

    def snapshots(self) -> builtins.list[FleetSnapshot]:
        return [FleetSnapshot(s["id"], s["name"], self.id, self.node, s["created_at"], s["size"])
                for s in self._ask(self._actor().snapshots.remote(self.id))]  # fmt: skip

    def rollback(self, snapshot: FleetSnapshot | str) -> None:
        key = snapshot.id if isinstance(snapshot, FleetSnapshot) else snapshot
        self._ask(self._actor().rollback.remote(self.id, key))
        self._set_state("running")

    def suspend(self) -> None:
        """Write the running state to disk on the node and end the VM. With ``replicas=1``
        that state (saved while the box is frozen, so the same) is kept on a second node."""
        if self._record().get("replicas"):
            actor = self._actor()
            self._call("pause")
            try:
                snap = self._ask(actor.snapshot.remote(self.id, f"replica-{secrets.token_hex(4)}"))
                self._rec = self.fleet.replicate(self._record(), snap["id"])
            except BaseException:
                with contextlib.suppress(Exception):
                    self._call("unpause")
                raise
            self._call("suspend")
            with contextlib.suppress(SandlotError):
                self._ask(actor.drop_snapshot.remote(snap["id"]))
        else:
            self._call("suspend")
        self._set_state("suspended")

    def resume(self) -> None:
        self._call("resume")
        self._set_state("running")

    def fork(
        self,
        n: int = 1,
        *,
        name: str | None = None,
        spread: bool = False,
        placement_timeout: float | None = None,
    ) -> Forked:
        """``n`` running copies of the box from a snapshot taken now. ``spread=True``: Ray
        spreads their reservations over the nodes; the snapshot is exported once, moved
        as chunks through the object store, imported once per node, and that node's
        children start there. ``name``: the prefix of their names (the box's by default).
        ``per_node`` of the result says where they landed."""
        if n < 1:
            raise InvalidArgument("n must be at least 1")
        rec = self._record()
        actor = self._actor()
        one = box_bundle(rec)
        timeout = placement_timeout or self.fleet.placement_timeout
        t0 = time.monotonic()
        if spread:
            held = placement.spread(one, n, timeout=timeout)
        else:
            held = [placement.reserve([one] * n, node=rec["node"], timeout=timeout)]
        per_node: dict[str, int] = {}
        reservations: dict[str, builtins.list[str]] = {}  # per node, the group of each of its children
        for res in held:
            for nid in res.nodes:
                per_node[nid] = per_node.get(nid, 0) + 1
                reservations.setdefault(nid, []).append(res.name)
        timings: dict[str, float] = {"reserve_s": time.monotonic() - t0}
        made: builtins.list[tuple[str, dict[str, Any]]] = []
        try:
            if set(per_node) == {rec["node"]}:
                made += [(rec["node"], k) for k in self._ask(actor.fork.remote(self.id, n, name))]
            else:
                made += self._fork_spread(actor, per_node, name or rec["name"], timings)
        except BaseException:
            for nid, k in made:
                with contextlib.suppress(Exception):
                    ray.get(self.fleet.node(nid).remove.remote(k["id"], True))
            for res in held:
                placement.release(res.name)
            raise
        now = time.time()
        out = Forked()
        for nid, k in made:
            kid = new_record(k, nid, now, reservation=reservations[nid].pop())
            out.append(FleetBox(self.fleet, ray.get(self.fleet.directory().put.remote(kid))))
        out.per_node = per_node
        timings["total_s"] = time.monotonic() - t0
        out.timings = timings
        return out

    def _fork_spread(
        self, actor: Any, per_node: dict[str, int], prefix: str, timings: dict[str, float]
    ) -> builtins.list[tuple[str, dict[str, Any]]]:
        rec = self._record()
        t = time.monotonic()
        snap = self._ask(actor.snapshot.remote(self.id, f"fork-{secrets.token_hex(4)}"))
        timings["snapshot_s"] = time.monotonic() - t
        made: builtins.list[tuple[str, dict[str, Any]]] = []
        others = {nid: k for nid, k in per_node.items() if nid != rec["node"]}
        try:
            t = time.monotonic()
            moved = self._ask(actor.export.remote(snap["id"]))
            timings["export_s"] = time.monotonic() - t
            t = time.monotonic()
            # every node fetches, imports once and starts its children, all at the same time
            refs = {
                nid: self.fleet.node(nid).import_state.remote(
                    moved, {"n": k, "name": prefix, "as_prefix": True, "labels": rec["labels"]}
                )
                for nid, k in others.items()
            }
            local = per_node.get(rec["node"], 0)
            local_ref = (
                actor.start_from.remote(snap["id"], local, prefix, None, rec["labels"], True)
                if local
                else None
            )
            errors: builtins.list[BaseException] = []
            for nid, ref in refs.items():
                try:
                    made += [(nid, k) for k in unwrap(ray.get(ref))["boxes"]]
                except BaseException as exc:
                    errors.append(exc)
            if local_ref is not None:
                try:
                    made += [(rec["node"], k) for k in unwrap(ray.get(local_ref))]
                except BaseException as exc:
                    errors.append(exc)
            timings["import_start_s"] = time.monotonic() - t
            if errors:
                for nid, k in made:
                    with contextlib.suppress(Exception):
                        ray.get(self.fleet.node(nid).remove.remote(k["id"], True))
                made.clear()
                raise errors[0]
        finally:
            if not per_node.get(rec["node"]) or not made:
                with contextlib.suppress(Exception):
                    ray.get(actor.drop_snapshot.remote(snap["id"]))
        return made

    def migrate(self, node: str, **kwargs: Any) -> FleetBox:
        """``fleet.migrate(self, node)``: this handle follows the box."""
        return self.fleet.migrate(self, node, **kwargs)


class FleetFiles:
    """The guest's file system of a fleet box (what moves as bytes; no host paths)."""

    def __init__(self, box: FleetBox) -> None:
        self._box = box

    def _do(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._box._ask(self._box._actor().files.remote(self._box.id, method, args, kwargs))

    def read(self, path: str | os.PathLike[str]) -> bytes:
        return bytes(self._do("read", os.fspath(path)))

    def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return str(self._do("read_text", os.fspath(path), encoding))

    def write(
        self,
        path: str | os.PathLike[str],
        data: bytes | str,
        *,
        mode: int | None = None,
        user: str | None = None,
        append: bool = False,
        parents: bool = True,
        exclusive: bool = False,
    ) -> int:
        """Write a whole file atomically (or append); ``data`` travels with the call."""
        wrote = self._do("write", os.fspath(path), data, mode=mode, user=user, append=append, parents=parents,
                         exclusive=exclusive)  # fmt: skip
        return int(wrote)

    def stat(self, path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> FileInfo:
        info: FileInfo = self._do("stat", os.fspath(path), follow_symlinks=follow_symlinks)
        return info

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self._do("exists", os.fspath(path)))

    def list(self, path: str | os.PathLike[str]) -> builtins.list[FileInfo]:
        found: builtins.list[FileInfo] = self._do("list", os.fspath(path))
        return found

    def mkdir(
        self,
        path: str | os.PathLike[str],
        *,
        parents: bool = True,
        mode: int = 0o755,
        user: str | None = None,
    ) -> None:
        self._do("mkdir", os.fspath(path), parents=parents, mode=mode, user=user)

    def remove(
        self, path: str | os.PathLike[str], *, recursive: bool = False, missing_ok: bool = False
    ) -> None:
        self._do("remove", os.fspath(path), recursive=recursive, missing_ok=missing_ok)

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        self._do("rename", os.fspath(src), os.fspath(dst))


@dataclass
class FleetProcess:
    """A command running in a fleet box, its output streamed from the box's node.

    Iterate it for ``(stream, bytes)`` items ("stdout" or "stderr") as they come;
    ``wait()`` drains it and returns the exit code, ``result()`` an ``ExecResult``."""

    argv: tuple[str, ...]
    gen: Any
    returncode: int | None = None
    _out: builtins.list[bytes] = field(default_factory=builtins.list)
    _err: builtins.list[bytes] = field(default_factory=builtins.list)

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        for ref in self.gen:
            kind, data = ray.get(ref)
            if kind == "exit":
                self.returncode = int(data)
                return
            if kind == "error":
                raise from_dict(data)
            (self._out if kind == "stdout" else self._err).append(data)
            yield kind, data

    def wait(self) -> int:
        for _ in self:
            pass
        if self.returncode is None:
            raise InvalidState("the command's stream ended without an exit status")
        return self.returncode

    def result(self) -> ExecResult:
        code = self.wait()
        return ExecResult(self.argv, code, b"".join(self._out), b"".join(self._err))
