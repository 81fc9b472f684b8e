"""The fleet on Ray (``sandlot.fleet``): its cluster, its boxes, its nodes, moving a box.

sandlot fleet token                              the cluster's token (made, mode 0600, if none)
sandlot fleet start --head|--address A --cpus N --memory-mib M [--insecure-cluster]
                                                 start Ray on this node, token-authenticated
sandlot fleet join [--address A]                 start this node's sandlot actor
sandlot fleet nodes [--address A] [--json]       the sandlot nodes, live and dead
sandlot fleet ls [--address A] [--json]          every box, where it is (lost ones too)
sandlot fleet migrate BOX NODE [--address A]     move a box, its processes running

Ray is imported only when one of these runs (``pip install 'sandlot[fleet]'``); ``token``
and ``start`` import none of it (``start`` runs Ray's own ``ray start``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .. import clusterauth
from ..errors import InvalidArgument, SandlotError
from .common import Sandlot, age, app, fail

if TYPE_CHECKING:
    from ..fleet import Fleet

fleet_app = Sandlot(help="Boxes over the nodes of a Ray cluster: token, start, join, nodes, ls, migrate.",
                    no_args_is_help=True)  # fmt: skip
app.add_typer(fleet_app, name="fleet")

Address = Annotated[
    str, typer.Option("--address", help="The Ray cluster: auto (this machine's), ray://host:10001, ...")
]
AsJson = Annotated[bool, typer.Option("--json", help="JSON instead of a table.")]
InNamespace = Annotated[
    str | None, typer.Option("--namespace", help="Act for this namespace only (its boxes, labelled so).")
]


def connected(address: str, namespace: str | None = None) -> Fleet:
    try:
        from .. import fleet
    except ImportError as exc:
        raise fail(f"the fleet needs Ray: pip install 'sandlot[fleet]' ({exc})", 125) from exc
    try:
        return fleet.connect(address, namespace=namespace)
    except (ConnectionError, RuntimeError) as exc:
        raise fail(f"cannot join the Ray cluster at {address}: {exc}", 125) from exc
    except SandlotError as exc:  # Unauthorized: no token, or not the cluster's
        raise fail(exc, 125) from exc


@fleet_app.command("token")
def token() -> None:
    """The cluster's token, found as Ray finds it ($RAY_AUTH_TOKEN, the file
    $RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token), made there (mode 0600) if there is
    none: on stdout, for a copy to each node and driver; where it is, on stderr."""
    try:
        found = clusterauth.find_token(strict=False)
        made = found is None
        found = found or clusterauth.make_token()
        loose = clusterauth.loose_mode(found.path) if found.path is not None else None
    except (SandlotError, OSError) as exc:
        raise fail(exc) from exc
    where = "$RAY_AUTH_TOKEN" if found.path is None else str(found.path)
    print(f"{'made' if made else 'found'}: {where}", file=sys.stderr)
    if loose:
        print(f"warning: {loose}", file=sys.stderr)
    print(found.value)


def ray_start(
    *, head: bool, address: str | None, cpus: float, memory_mib: float, port: int = 6379,
    node_ip: str | None = None, dashboard_host: str = "127.0.0.1", ray_client_port: int = 0,
    insecure_cluster: bool = False, extra: tuple[str, ...] = (), environ: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """The ``ray start`` command of a sandlot node and its environment: token
    authentication on (a head makes the token if it has none; a worker must have the
    head's), the dashboard on loopback and no Ray Client unless asked, the node's
    sandlot resources. ``insecure_cluster``: the node may serve a cluster without
    authentication (docs/fleet.md, "Security")."""
    env = dict(os.environ if environ is None else environ)
    if head == (address is not None):
        raise InvalidArgument("give --head to start a cluster, or --address HEAD:PORT to join one (not both)")
    if cpus <= 0 or memory_mib <= 0:
        raise InvalidArgument("--cpus and --memory-mib are what boxes may reserve here: both above 0")
    found = clusterauth.find_token(env, strict=False)
    if clusterauth.auth_mode(env) == "disabled" and not insecure_cluster:
        raise InvalidArgument(
            f"{clusterauth.AUTH_MODE_ENV}=disabled starts a cluster anyone who reaches it may use as root; "
            "this node would refuse to serve boxes on it (--insecure-cluster to allow it)"
        )
    if found is None and not insecure_cluster:
        if not head:
            raise InvalidArgument(
                f"no cluster token here (looked in ${clusterauth.TOKEN_ENV}, ${clusterauth.TOKEN_PATH_ENV} "
                f"and {clusterauth.default_token_path()}): copy the head's (`sandlot fleet token` there) to "
                f"{clusterauth.token_file(env)}, mode 0600"
            )
        found = clusterauth.make_token(clusterauth.token_file(env))
    if found is not None and clusterauth.auth_mode(env) is None:
        env[clusterauth.AUTH_MODE_ENV] = "token"
    if insecure_cluster:
        env[clusterauth.INSECURE_ENV] = "1"
    # placement.CPUS and placement.MEMORY, named here: importing the fleet imports Ray
    resources = json.dumps({"sandlot_cpus": cpus, "sandlot_memory_mib": memory_mib})
    ray = str(Path(sys.executable).parent / "ray")
    ray = ray if Path(ray).exists() else (shutil.which("ray") or "ray")
    argv = [ray, "start", "--resources", resources]
    if head:
        # Ray's usage statistics go to its vendor unless turned off: a node of boxes sends
        # nothing anywhere its operator did not ask for (RAY_USAGE_STATS_ENABLED=1 to send them)
        argv += ["--head", "--port", str(port), "--dashboard-host", dashboard_host]
        if env.get("RAY_USAGE_STATS_ENABLED") != "1":
            argv += ["--disable-usage-stats"]
        # Ray starts its client server on 10001 wherever ray[client] (grpc) is installed, and
        # refuses the option (even 0, "none") where it is not: there it runs no client server
        if ray_client_port or importlib.util.find_spec("grpc") is not None:
            argv += ["--ray-client-server-port", str(ray_client_port)]
    else:
        argv += ["--address", str(address)]
    if node_ip:
        argv += ["--node-ip-address", node_ip]
    return [*argv, *extra], env


@fleet_app.command("start", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def start(
    ctx: typer.Context,
    head: Annotated[bool, typer.Option("--head", help="Start a new cluster, this node its head.")] = False,
    address: Annotated[
        str | None, typer.Option("--address", help="Join the cluster whose head is HOST:PORT.")
    ] = None,
    cpus: Annotated[float, typer.Option("--cpus", help="CPUs boxes may reserve on this node.")] = 0,
    memory_mib: Annotated[
        float, typer.Option("--memory-mib", help="MiB of memory boxes may reserve on this node.")
    ] = 0,
    port: Annotated[int, typer.Option("--port", help="The head's GCS port.")] = 6379,
    node_ip: Annotated[
        str | None, typer.Option("--node-ip-address", help="This node's address as the others reach it.")
    ] = None,
    dashboard_host: Annotated[
        str,
        typer.Option("--dashboard-host", help="Where the head's dashboard listens (loopback unless asked)."),
    ] = "127.0.0.1",
    ray_client_port: Annotated[
        int, typer.Option("--ray-client-port", help="Serve Ray Client (ray://) on this port (0: not at all).")
    ] = 0,
    insecure_cluster: Annotated[
        bool,
        typer.Option(
            "--insecure-cluster",
            help="Let this node serve boxes on a cluster without authentication (anyone who reaches its "
            "ports is root on it).",
        ),
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command, run nothing.")] = False,
) -> None:
    """Start Ray on this node as a sandlot node: token authentication on, the dashboard on
    loopback, no Ray Client unless asked, the node's sandlot resources; arguments after
    the options go to `ray start` as they are. SANDLOT_HOME here is the node's home."""
    try:
        argv, env = ray_start(
            head=head, address=address, cpus=cpus, memory_mib=memory_mib, port=port, node_ip=node_ip,
            dashboard_host=dashboard_host, ray_client_port=ray_client_port,
            insecure_cluster=insecure_cluster, extra=tuple(ctx.args),
        )  # fmt: skip
    except SandlotError as exc:
        raise fail(exc) from exc
    shown = " ".join(
        f"{k}={env[k]}" for k in (clusterauth.AUTH_MODE_ENV, clusterauth.INSECURE_ENV) if k in env
    )
    print(f"{shown} {' '.join(argv)}".strip(), file=sys.stderr)
    if dry_run:
        return
    raise typer.Exit(subprocess.run(argv, env=env).returncode)


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
def ls(address: Address = "auto", as_json: AsJson = False, namespace: InNamespace = None) -> None:
    """Every box of the fleet (or of a namespace) and its node; a lost one with the node and
    when it was lost."""
    f = connected(address, namespace)
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
    namespace: InNamespace = None,
) -> None:
    """Move a box to another node; it goes on there with its processes, id, name and labels."""
    f = connected(address, namespace)
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
