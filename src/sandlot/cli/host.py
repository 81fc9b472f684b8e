"""Host commands: doctor, setup, rootfs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..errors import SandlotError
from ..version import __version__
from .common import app, fail


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    kill_orphans: Annotated[
        bool, typer.Option("--kill-orphans", help="End the VMs that no home owns (listed under 'orphans').")
    ] = False,
) -> None:
    """Check QEMU, the accelerator (and why), the guest kernel, the agent, gVisor (runsc) and
    free disk; list the VMs of this user that no home owns (its home removed, or no row of
    its home's names it)."""
    from ..core import orphans
    from ..core.runtime import Runtime

    rt = Runtime.for_home()
    report = rt.doctor()
    orphaned = orphans.find(rt)
    ended = {o.box.ref for o in orphans.end(orphaned, rt)} if kill_orphans else set()
    report["orphans"] = [{**o.to_json(), "ended": o.box.ref in ended} for o in orphaned]
    if as_json:
        print(json.dumps(report, indent=2))
        return
    out = Console(soft_wrap=True, highlight=False)
    qemu = report.get("qemu", {})
    accel = report.get("accel", {})
    kernel = report.get("kernel", {})
    agent = report.get("agent", {})
    ok = "[green]ok[/]"
    out.print(f"[bold]sandlot {__version__}[/]  home: {report['home']}")
    if isinstance(qemu, dict) and "version" in qemu:
        out.print(f"qemu         {ok}  {qemu['version']} ({qemu['path']})")
    else:
        out.print(f"qemu         [red]missing[/]  {qemu}")
    if isinstance(accel, dict) and accel:
        color = "green" if accel.get("name") == "kvm" else "yellow"
        out.print(f"accelerator  [{color}]{accel['name']}[/]  {accel['reason']}")
        if accel.get("advice"):
            out.print(f"             {accel['advice']}")
    if isinstance(kernel, dict) and kernel:
        out.print(f"kernel       {ok}  {kernel['version']} from {kernel['source']}")
        out.print(f"             modules: {', '.join(kernel['modules'])}")
        if "lockdown" in kernel:
            lockdown = "yes" if kernel["lockdown"] else "no (its modules are not all signed, or it has none)"
            out.print(f"             lockdown (confidentiality): {lockdown}")
    nested = report.get("nested_virt") or {}
    if nested:
        state = f"{ok}  boxes may have it (nested_virt=True): " if nested["available"] else "[yellow]no[/]  "
        out.print(f"nested virt  {state}{nested['why']}")
    containers = report.get("containers") or {}
    if containers:
        state = f"{ok}  " if containers["modules"] == containers["of"] else "[yellow]some[/]  "
        out.print(
            f"containers   {state}boxes may run Docker or Podman (containers=True): {containers['why']}"
        )
    if isinstance(agent, dict) and agent:
        out.print(f"agent        {ok}  {agent['path']} (built with {agent['compiler']})")
    cgroup = report.get("host_cgroup", {})
    if isinstance(cgroup, dict) and cgroup.get("version"):
        where = ", ".join(cgroup["where"])
        out.print(f"host cgroup  {ok}  v{cgroup['version']}: {', '.join(cgroup['controllers'])} in {where}")
    elif isinstance(cgroup, dict) and cgroup:
        out.print(f"host cgroup  [yellow]none[/]  {cgroup['reason']}; QEMU runs without host limits")
    gvisor = report.get("gvisor", {})
    if isinstance(gvisor, dict) and gvisor:
        runsc = gvisor.get("runsc") or {}
        color = "green" if gvisor.get("usable") else "yellow"
        state = "usable" if gvisor.get("usable") else "unusable"
        found = f"runsc {runsc['version']}, platform {runsc['platform']} ({runsc['path']}); " if runsc else ""
        out.print(f"gvisor       [{color}]{state}[/]  {found}{gvisor.get('why', '')}")
    auto = report.get("auto") or {}
    if isinstance(auto, dict) and auto:
        out.print(f"engine auto  [bold]{auto.get('engine')}[/]  {auto.get('why', '')}")
    out.print(f"engine       {report.get('default_engine')} for boxes that name none "
              "(engine= of the box, else $SANDLOT_ENGINE, else qemu)")  # fmt: skip
    packages = report.get("host_packages") or {}
    if packages.get("missing"):
        out.print(
            f"packages     [red]missing[/]  {' '.join(packages['missing'])}: sandlot setup installs them"
        )
    else:
        optional = " ".join(packages.get("optional_missing", [])) or "none"
        out.print(f"packages     {ok}  every one boxes need; optional ones not installed: {optional}")
    merging = report.get("ksm") or {}
    if merging.get("on"):
        saved = merging["saved_mib"]
        out.print(f"ksm          {ok}  on: identical pages of boxes are kept once ({saved} MiB saved now)")
    elif merging:
        out.print(f"ksm          [yellow]{merging['state']}[/]  {merging.get('why', '')}")
    _fleet_lines(out, report.get("fleet") or {})
    out.print(f"disk free    {report.get('disk_free_gib')} GiB under {report['home']}")
    out.print(f"sockets      {report.get('runtime_dir')}")
    if not orphaned:
        out.print(f"orphans      {ok}  none (VMs that no home owns)")
    else:
        out.print(f"orphans      [yellow]{len(orphaned)} VM(s) that no home owns[/]")
        for o in orphaned:
            rss = f"{o.rss_bytes / (1 << 20):.0f} MiB" if o.rss_bytes is not None else "? MiB"
            state = "  [green]ended[/]" if o.box.ref in ended else ""
            vm = f"pid {o.box.ref.pid}  {o.box.engine}  {rss}"
            out.print(f"             {vm}  {o.box.home}: {o.why}{state}")
        if not kill_orphans:
            listed = " ".join(str(o.box.ref.pid) for o in orphaned)
            out.print(f"             end them: sandlot doctor --kill-orphans (or kill {listed})")
    if "error" in report:
        out.print(f"[red]problem[/]      {report['error']}")
        raise typer.Exit(1)


def _fleet_lines(out: Console, fleet: dict[str, Any]) -> None:
    """Whether this home's fleet node serves boxes, and why; the token this user would send."""
    node, token, tls = fleet.get("node"), fleet.get("token"), fleet.get("tls") or {}
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(node["at"])) if node else ""
    if node is None:
        out.print("fleet        not a node  no fleet node actor has run in this home")
    elif not node.get("serving"):
        found = "answers callers without a token" if node["cluster_auth"] == "open" else node["cluster_auth"]
        out.print(f"fleet        [red]refusing[/]  node {node['node_id'][:12]} serves no boxes: its Ray "
                  f"cluster {found} (at {when}); start Ray with `sandlot fleet start`, or allow that: "
                  "--insecure-cluster")  # fmt: skip
    elif node.get("cluster_auth") == "token":
        allowed = " (an open one allowed too: --insecure-cluster)" if node.get("insecure_allowed") else ""
        out.print(f"fleet        [green]token[/]  node {node['node_id'][:12]} serves a cluster that "
                  f"authenticates its callers (at {when}){allowed}")  # fmt: skip
    else:
        out.print(f"fleet        [yellow]insecure[/]  node {node['node_id'][:12]} serves a cluster without "
                  f"authentication, as its operator allowed (--insecure-cluster; at {when})")  # fmt: skip
    if token is None:
        out.print("             token: none for this user (`sandlot fleet token` makes one)")
    elif "error" in token:
        out.print(f"             token: [red]{token['error']}[/]")
    else:
        out.print(f"             token: {token['source']}")
        if token.get("loose"):
            out.print(f"             [red]{token['loose']}[/]")
    if tls.get("on"):
        missing = ", ".join(tls.get("missing") or [])
        out.print(f"             tls: on{f' [red]missing: {missing}[/]' if missing else ''}")


@app.command()
def setup(
    refresh_kernel: Annotated[bool, typer.Option(help="Fetch the newest distro kernel.")] = False,
    install: Annotated[
        bool, typer.Option(help="Install missing host packages with apt (as root, or with sudo -n).")
    ] = True,
    optional: Annotated[
        bool, typer.Option("--optional", help="Also install the optional packages (gVisor, rootfs builders).")
    ] = False,
    ksm: Annotated[
        bool,
        typer.Option(
            "--ksm",
            help="Also turn on the host's kernel samepage merging (as root, until reboot): "
            "identical pages of boxes are kept once, for ksmd's scanning.",
        ),
    ] = False,
) -> None:
    """Install the host packages sandlot needs (apt), then fetch the guest kernel and
    prepare the agent and initramfs, and report them."""
    from .. import hostsetup
    from .. import ksm as merging
    from ..core.runtime import Runtime
    from ..guest.kernel import META_PACKAGES, fetch_distro_kernel, has_distro_kernel

    rt = Runtime.for_home()
    distro_kernel = not os.environ.get("SANDLOT_KERNEL")
    try:
        apt_lists = distro_kernel and (refresh_kernel or not has_distro_kernel(rt.home))
        _host_packages(
            install=install, optional=optional, kernel=META_PACKAGES["cloud"] if apt_lists else None
        )
    except SandlotError as exc:
        raise fail(exc) from exc
    try:
        if refresh_kernel and distro_kernel:
            fetch_distro_kernel(rt.home, refresh=True)
        rt.prepare()
    except SandlotError as exc:
        raise fail(exc) from exc
    if ksm:
        try:
            merging.enable()
        except SandlotError as exc:
            raise fail(exc) from exc
    report = rt.doctor()
    kernel, agent = report.get("kernel", {}), report.get("agent", {})
    print(f"kernel  {kernel.get('version')} ({kernel.get('vmlinux')})")
    print(f"agent   {agent.get('path')} ({agent.get('compiler')})")
    print(f"initrd  {report.get('initramfs')}")
    print(f"accel   {report['accel']['name']}: {report['accel']['reason']}")
    print(f"ksm     {report['ksm']['state']}" + ("" if report["ksm"]["on"] else f": {report['ksm']['why']}"))
    left = hostsetup.missing(optional=True)
    if left:
        print("optional, not installed: " + "; ".join(f"{p.name} ({p.needed_for})" for p in left))
        print(
            f"  to add them: sandlot setup --optional, or {hostsetup.install_command([p.name for p in left])}"
        )


def _host_packages(*, install: bool, optional: bool, kernel: str | None) -> None:
    """Install what is missing where apt may run as root; else name it and how to get
    it. ``kernel``: the package apt must know to fetch the guest kernel, if it must."""
    from .. import hostsetup
    from ..errors import HostSetupError

    wanted = hostsetup.missing(optional=optional)
    names = [p.name for p in wanted]
    stale_lists = kernel is not None and not hostsetup.apt_knows(kernel)
    if not names and not stale_lists:
        return
    why = "; ".join(f"{p.name} ({p.needed_for})" for p in wanted) or f"apt lists that know {kernel}"
    if not install or not hostsetup.can_install():
        raise HostSetupError(f"sandlot needs: {why}. Install with: {hostsetup.install_command(names)}")
    print(f"installing with apt: {why}", flush=True)
    hostsetup.install(names)
    still = [p.name for p in hostsetup.missing(optional=optional)]
    if still:
        raise HostSetupError(f"apt installed {' '.join(names)}, yet {', '.join(still)} are still missing")


@app.command()
def rootfs(
    kind: Annotated[str, typer.Argument(help="busybox, debian, desktop, docker or podman")],
    dest: Annotated[Path, typer.Argument(help="Directory to create (replaced if it exists).")],
    packages: Annotated[
        list[str] | None, typer.Option("--package", "-p", help="Extra Debian packages.")
    ] = None,
) -> None:
    """Build a root filesystem directory from Debian packages (no registry needed).
    ``desktop`` is the one box.desktop drives: Xvnc, openbox, Chromium, xterm, xdotool,
    and a noVNC viewer (about 800 MB; --package adds to it). ``docker`` is Debian's Docker
    with Compose, ``podman`` Podman: boot either with ``--containers`` (about 500 MB)."""
    from ..images import builders

    try:
        if kind == "busybox":
            path = builders.busybox_rootfs(dest)
        elif kind == "debian":
            path = builders.debian_rootfs(dest, packages or [])
        elif kind == "desktop":
            path = builders.desktop_rootfs(dest, [*builders.DESKTOP_PACKAGES, *(packages or [])])
        elif kind in ("docker", "podman"):
            engine = builders.DOCKER_PACKAGES if kind == "docker" else builders.PODMAN_PACKAGES
            path = builders.containers_rootfs(dest, [*engine, *(packages or [])])
        else:
            raise fail(ValueError("kind must be busybox, debian, desktop, docker or podman"), 2)
    except SandlotError as exc:
        raise fail(exc) from exc
    print(path)
