"""The fleet on Ray (``sandlot.fleet``): its boxes, its nodes, moving a box.

sandlot fleet join [--address A]                 start this node's sandlot actor
sandlot fleet nodes [--address A] [--json]       the sandlot nodes, live and dead
sandlot fleet ls [--address A] [--json]          every box, where it is (lost ones too)
sandlot fleet migrate BOX NODE [--address A]     move a box, its processes running

Ray is imported only when one of these runs (``pip install 'sandlot[fleet]'``).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import SandlotError
from .common import Sandlot, age, app, fail

if TYPE_CHECKING:
    from ..fleet import Fleet

fleet_app = Sandlot(help="Boxes over the nodes of a Ray cluster: join, nodes, ls, migrate.",
                    no_args_is_help=True)  # fmt: skip
app.add_typer(fleet_app, name="fleet")

Address = Annotated[
    str, typer.Option("--address", help="The Ray cluster: auto (this machine's), ray://host:10001, ...")
]
AsJson = Annotated[bool, typer.Option("--json", help="JSON instead of a table.")]


def connected(address: str) -> Fleet:
    try:
        from .. import fleet
    except ImportError as exc:
        raise fail(f"the fleet needs Ray: pip install 'sandlot[fleet]' ({exc})", 125) from exc
    try:
        return fleet.connect(address)
    except (ConnectionError, RuntimeError) as exc:
        raise fail(f"cannot join the Ray cluster at {address}: {exc}", 125) from exc


@fleet_app.command("join")
def join(address: Address = "auto") -> None:
    """Start the sandlot actor of this node (Ray must run here with sandlot resources)."""
    try:
        facts = connected(address).join()
    except SandlotError as exc:
        raise fail(exc, 125) from exc
    print(f"node {facts['node_id']} joined: home {facts['home']}, {facts['boxes']} box(es)")


@fleet_app.command("nodes")
def nodes(address: Address = "auto", as_json: AsJson = False) -> None:
    """The sandlot nodes of the cluster: resources, reserved memory, boxes, replicas."""
    found = connected(address).nodes()
    if as_json:
        print(json.dumps(found, indent=1))
        return
    header = f"{'NODE':<14}{'ALIVE':<7}{'CPUS':>5}{'MEMORY':>10}{'RESERVED':>10}{'BOXES':>7}{'REPLICAS':>10}"
    print(f"{header}  HOME")
    for n in found:
        print(f"{n['node_id'][:12]:<14}{'yes' if n['alive'] else 'DEAD':<7}{n['cpus']:>5g}"
              f"{n['memory_mib']:>8g}Mi{n['reserved_memory_mib']:>8g}Mi{n['boxes']:>7}{n['replicas']:>10}"
              f"  {n.get('home', '-')}")  # fmt: skip


@fleet_app.command("ls")
def ls(address: Address = "auto", as_json: AsJson = False) -> None:
    """Every box of the fleet and its node; a lost one with the node and when it was lost."""
    f = connected(address)
    records = f.reconcile()
    if as_json:
        print(json.dumps(records, indent=1))
        return
    print(f"{'ID':<14}{'NAME':<24}{'STATE':<11}{'NODE':<14}{'REPLICA':<14}CREATED")
    for r in records:
        state = r["state"]
        if r.get("lost"):
            state += f" (at {time.strftime('%H:%M:%S', time.localtime(r['lost']['at']))})"
        replica = (r.get("replica") or {}).get("node", "-")[:12]
        print(
            f"{r['id']:<14}{r['name']:<24}{state:<11}{r['node'][:12]:<14}{replica:<14}{age(r.get('created_at'))}"
        )


@fleet_app.command("migrate")
def migrate(
    box: Annotated[str, typer.Argument(help="The box: id, name or id prefix.")],
    node: Annotated[str, typer.Argument(help="The node to move it to: its id or an id prefix.")],
    address: Address = "auto",
) -> None:
    """Move a box to another node; it goes on there with its processes, id, name and labels."""
    f = connected(address)
    try:
        moved = f.migrate(box, node)
    except SandlotError as exc:
        raise fail(exc, 125) from exc
    t = f.last_migration or {}
    restore = t.get("import_s", 0) + t.get("restore_s", 0)
    where = moved.info["node"][:12]
    print(f"{moved.name} is on node {where} ({moved.state}) after {t.get('total_s', 0):.2f} s: "
          f"save {t.get('save_s', 0):.2f} s, export {t.get('export_s', 0):.2f} s, "
          f"move {t.get('move_s', 0):.2f} s, restore {restore:.2f} s")  # fmt: skip
