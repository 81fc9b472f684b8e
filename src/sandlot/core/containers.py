"""A container engine in a box (``containers=True``): what sandlot does for it.

The engine (QEMU) boots the box's kernel with the modules a container engine needs
(``guest.kernel.CONTAINER_MODULES``: overlayfs, bridges, veth, nf_tables and the
iptables matches Docker's rules use). Then, at every boot, before the box is handed
to its caller (and so before an image's first boot is saved as its template), this
module's ``bring_up`` runs ``UP_SCRIPT`` in the guest, which

* checks the kernel's side, and names what is missing (a kernel of the user's may
  lack what the distro kernel has);
* opens the cgroup controllers a container may use to the box's own cgroup
  (``/sys/fs/cgroup/sandlot``, whose ``pids.max`` is the box's ``pids_limit``), so
  that containers count against the box's limits as its commands do: Docker puts
  them under ``sandlot/containers``;
* starts the image's ``dockerd`` (if it has one and none runs), logging to
  ``/var/log/dockerd.log``, and waits until it answers (``DAEMON_TIMEOUT``). Podman
  has no daemon: an image with it needs nothing started.

So ``docker run`` works from the box's first command, and a box restored from its
image's template finds the daemon already running. The daemon runs with the box's
environment: in the ``public`` and ``allowlist`` network modes its pulls go through
sandlot's egress proxy (``HTTPS_PROXY``), under the box's policy.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..errors import BootError
from . import guestshell

if TYPE_CHECKING:
    from ..protocol.connection import AgentConnection

DAEMON_TIMEOUT = 120.0  # dockerd's start: ~10 s under emulation with a cold page cache
GRACE = 30.0  # beyond the script's own wait: a guest that stops answering is given up on
OUTPUT_MAX = 64 * 1024  # what the script may print (it prints a few lines)
CGROUP_PARENT = "/sandlot/containers"

# Each check prints "missing: WHAT" for what the kernel lacks; the daemon's start
# prints "dockerd: up", or "dockerd: failed" and its log's tail.
UP_SCRIPT = r"""
missing=""
grep -qw overlay /proc/filesystems || missing="$missing overlayfs"
for m in bridge veth nf_tables; do
    [ -d /sys/module/$m ] || missing="$missing $m"
done
[ -z "$missing" ] || echo "missing:$missing"
for c in cpu io cpuset; do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control
    echo "+$c" >/sys/fs/cgroup/sandlot/cgroup.subtree_control
done 2>/dev/null
command -v dockerd >/dev/null 2>&1 || exit 0
answers() {  # the daemon's API, where the image has its CLI; else its socket
    if command -v docker >/dev/null 2>&1; then
        docker version >/dev/null 2>&1
    else
        [ -S /var/run/docker.sock ]
    fi
}
if answers; then
    echo "dockerd: up"
    exit 0
fi
mkdir -p /var/log
setsid dockerd --cgroup-parent=$CGROUP_PARENT >>/var/log/dockerd.log 2>&1 </dev/null &
pid=$!
end=$(($(date +%s) + LIMIT))
while [ "$(date +%s)" -lt $end ]; do
    if answers; then
        echo "dockerd: up"
        exit 0
    fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
done
echo "dockerd: failed"
tail -n 20 /var/log/dockerd.log
exit 1
"""


async def bring_up(conn: AgentConnection, env: dict[str, str] | None, *, box: str) -> None:
    """Ready the box for containers (see the module's text): ``BootError`` naming what
    is missing or the daemon's last words, where the engine cannot run."""
    env = {**(env or {}), "CGROUP_PARENT": CGROUP_PARENT, "LIMIT": str(int(DAEMON_TIMEOUT))}
    ran = guestshell.shell(conn, UP_SCRIPT, env, limit=OUTPUT_MAX, user="root", cwd="/")
    try:  # the script bounds its own wait; this bounds a guest that stops answering (the
        # boot that fails then ends the VM, the script with it)
        out, exit_code = await asyncio.wait_for(ran, DAEMON_TIMEOUT + GRACE)
    except (OSError, TimeoutError) as exc:
        raise BootError(f"box {box} has containers=True, but readying it failed: {exc}", box=box) from None
    lines = out.decode(errors="replace").splitlines()
    missing = [line.removeprefix("missing:").split() for line in lines if line.startswith("missing:")]
    if exit_code == 0 and not missing:
        return
    if missing:
        why = f"its kernel lacks {', '.join(missing[0])}, which a container engine needs"
    else:
        tail = "\n".join(line for line in lines if not line.startswith("dockerd:"))
        why = f"its dockerd did not start (exit {exit_code}):\n{tail}"
    raise BootError(f"box {box} has containers=True, but {why}", box=box)
