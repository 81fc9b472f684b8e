"""Where boxes go: Ray's scheduler, through placement groups of sandlot resources.

A node offers boxes the custom resources ``sandlot_cpus`` and ``sandlot_memory_mib``
(given to ``ray start --resources``). Each box holds a reservation of its CPUs and
memory: a detached placement group (one bundle per box; a fork's children share
one group), so Ray's own accounting says what room is left, whichever driver
placed what, and pack or spread is Ray's strategy of the group. A box bound for
a given node (a migration, a recovery) has its bundle pinned there by the node's
``ray.io/node-id`` label. A reservation Ray cannot place within the timeout is
given back and ``NoCapacity`` raised: nothing waits forever.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.placement_group import remove_placement_group as ray_remove_placement_group

from ..errors import InvalidArgument, NoCapacity

CPUS = "sandlot_cpus"
MEMORY = "sandlot_memory_mib"
NODE_LABEL = "ray.io/node-id"
NAMESPACE = "sandlot"
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
ROUND_WAIT = 5.0  # how long a round of one box per node may wait before the rest is spread as Ray can


@dataclass(frozen=True, slots=True)
class Reservation:
    """A placement group and the node of each of its bundles."""

    name: str
    nodes: tuple[str, ...]


def bundle(cpus: int, memory_mib: int) -> dict[str, float]:
    return {CPUS: float(cpus), MEMORY: float(memory_mib)}


def sandlot_nodes(alive_only: bool = True) -> list[dict[str, Any]]:
    """Ray's nodes that offer sandlot resources."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n for n in nodes if MEMORY in n.get("Resources", {}) and (n["Alive"] or not alive_only)]


def check_feasible(bundles: Sequence[Mapping[str, float]], node: str | None) -> None:
    """Refuse at once what no node could ever hold (Ray would wait for a node to join)."""
    nodes = [n for n in sandlot_nodes() if node is None or n["NodeID"] == node]
    if not nodes:
        raise NoCapacity("no node of the Ray cluster offers sandlot resources (see `sandlot fleet nodes`)")
    for b in bundles:
        if not any(all(n["Resources"].get(k, 0.0) >= v for k, v in b.items()) for n in nodes):
            where = f"node {node}" if node else "any node"
            biggest = max(nodes, key=lambda n: n["Resources"].get(MEMORY, 0.0))["Resources"]
            raise NoCapacity(
                f"a box of {b[CPUS]:g} CPU(s) and {b[MEMORY]:g} MiB fits {where} of the fleet never "
                f"(the largest offers {biggest.get(CPUS, 0):g} CPU(s), {biggest.get(MEMORY, 0):g} MiB)"
            )


def reserve(
    bundles: Sequence[Mapping[str, float]],
    *,
    strategy: str = "pack",
    node: str | None = None,
    timeout: float = 30.0,
) -> Reservation:
    """Have Ray place ``bundles`` (on ``node`` if given) and hold them; NoCapacity
    if it cannot within ``timeout`` seconds."""
    if strategy not in STRATEGIES and strategy != "strict_spread":
        raise InvalidArgument(f"strategy must be 'pack' or 'spread', not {strategy!r}")
    check_feasible(bundles, node)
    name = f"sandlot-{secrets.token_hex(6)}"
    selector = [{NODE_LABEL: node} for _ in bundles] if node else None
    pg = placement_group(
        [dict(b) for b in bundles], strategy=STRATEGIES.get(strategy, "STRICT_SPREAD"), name=name,
        lifetime="detached",
        bundle_label_selector=selector,
    )  # fmt: skip
    if not pg.wait(timeout):
        ray_remove_placement_group(pg)
        where = f"on node {node}" if node else f"({strategy})"
        total_mem = sum(b[MEMORY] for b in bundles)
        raise NoCapacity(
            f"no room {where} for {len(bundles)} box(es), {total_mem:g} MiB in all: Ray could not place "
            f"the reservation within {timeout:g} s (free room or add nodes; `sandlot fleet nodes`)"
        )
    table = placement_group_table(pg)
    nodes = table["bundles_to_node_id"]
    return Reservation(name, tuple(nodes[i] for i in range(len(bundles))))


def spread(one: Mapping[str, float], n: int, *, timeout: float = 30.0) -> list[Reservation]:
    """``n`` boxes of ``one`` each, over the nodes as evenly as Ray can: rounds of one
    box per node (STRICT_SPREAD groups), and when a round cannot be placed (a node is
    full) the rest as one SPREAD group. Ray's SPREAD alone balances one group's
    bundles loosely (10, 9 and 1 of 20 over three nodes)."""
    width = len(sandlot_nodes())
    out: list[Reservation] = []
    left = n
    try:
        while left > 1 and width > 1:
            size = min(width, left)
            try:
                out.append(reserve([one] * size, strategy="strict_spread", timeout=ROUND_WAIT))
            except NoCapacity:
                break
            left -= size
        if left:
            out.append(reserve([one] * left, strategy="spread", timeout=timeout))
    except BaseException:
        for r in out:
            release(r.name)
        raise
    return out


def release(name: str | None) -> None:
    """Give a reservation back (one already gone is fine)."""
    if not name:
        return
    pg = find(name)
    if pg is not None:
        ray_remove_placement_group(pg)


def find(name: str) -> PlacementGroup | None:
    for pg_id, info in placement_group_table().items():
        if info.get("name") == name and info.get("state") != "REMOVED":
            return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
    return None
