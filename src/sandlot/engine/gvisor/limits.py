"""What bounds a gVisor box: host cgroups for the sandbox as a whole, and the agent
inside for what gVisor does not bound itself.

- **CPU**: the OCI quota (``cpus`` cores per period), which runsc writes into the
  sandbox's host cgroup; ``--cpu-num-from-quota`` makes the box see that many CPUs
  (gVisor's floor is 2: a 1-CPU box sees 2, and may use one).
- **Memory**: gVisor has no OOM killer of its own; past its host cgroup's limit the
  host's OOM killer ends the whole sandbox. So the agent is the box's OOM killer
  (``--memory-mib``: it SIGKILLs the largest process past ``memory_mib`` and marks that
  command out-of-memory, as a VM's kernel does), and the host cgroup's limit sits
  ``HOST_MEMORY_SLACK_MIB`` above, for the Sentry itself and for a hog that outruns
  one of the agent's checks.
- **Processes**: gVisor's own cgroupfs (v1) pids controller, which the agent mounts and
  sets (``pids_limit``). Not the host's (see below).
- **Disk**: a project quota on the box's layer directory, where the file system of
  the home has them (XFS, or ext4 with the project feature, mounted ``prjquota``):
  writes past ``disk_size_gb`` fail inside the box. Elsewhere a box's disk is not
  bounded, and asking for a size is refused (``check_request``).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import struct
from pathlib import Path
from typing import Any

from ...errors import HostSetupError, InvalidArgument
from ..base import BootRequest

CPU_PERIOD_US = 100_000
# The Sentry's own heap, page tables and the gofer: measured ~60-90 MiB for an idle
# box; the rest is room for a memory hog that grows between two of the agent's checks
# (every 25 ms), and the host page cache of what the box writes, charged to its cgroup:
# 192 MiB was not enough for a memory hog and a disk fill at once (the host ended the sandbox).
HOST_MEMORY_SLACK_MIB = 384
# Room a checkpoint gets above that, for the Sentry's own work while the box stands
# still (its tasks are stopped, so nothing of the box's grows then). Measured with runsc
# 20221219 on ptrace, the sandbox's resident memory: an idle box's checkpoint peaks at
# 15 MiB, but one after 1000 short processes (a shell loop of `cat`) at 638 MiB, and after
# 2000 at 675 MiB, past the 640 MiB bound of a 256 MiB box: the host's OOM killer ended
# the sandbox, and the box's processes with it.
CHECKPOINT_SLACK_MIB = 1024
# No host pids bound: under the ptrace platform every address space in the box is a host
# stub process, made ahead and pooled, and the Sentry panics when it cannot make one
# ("error initializing first thread: resource temporarily unavailable"): measured with a
# fork bomb held at 64 processes in the box, a host bound of 4096 ended the sandbox
# within seconds. The box's own pids limit (gVisor's cgroupfs) holds the bomb instead.


def resources(memory_mib: int, cpus: int) -> dict[str, Any]:
    """The OCI ``linux.resources`` of a sandbox (runsc applies them to its host cgroup)."""
    return {
        "memory": {"limit": (memory_mib + HOST_MEMORY_SLACK_MIB) << 20},
        "cpu": {"quota": CPU_PERIOD_US * max(1, cpus), "period": CPU_PERIOD_US},
    }


def agent_args(memory_mib: int) -> list[str]:
    """What the box's init (the agent) needs to bound the box from inside."""
    return ["--memory-mib", str(memory_mib)]


def runsc_flags() -> list[str]:
    """Flags of ``runsc run`` and ``runsc restore`` for the box's shape."""
    return ["--cpu-num-from-quota"]


def disk_bound(request: BootRequest, layers_dir: Path) -> int | None:
    """The size a box's layer directory is held to (GiB), None for none; refuses, saying
    why, a size asked for where the host cannot bound it."""
    if not request.disk_gb:
        return None
    missing = project_quota_missing(layers_dir)
    if missing is None:
        return request.disk_gb
    if request.disk_required:
        raise InvalidArgument(
            f"engine='gvisor' cannot bound a box's disk here (disk_size_gb={request.disk_gb}): its files "
            f"are a host overlay layer directory, which only a project quota bounds, and {missing}; "
            "leave disk_size_gb at its default (unbounded on gVisor on this host) or use engine='qemu'"
        )
    return None


# -- the disk: a project quota on the box's layer directory -------------------------------

FS_IOC_FSGETXATTR = 0x801C581F  # _IOR('X', 31, struct fsxattr)
FS_IOC_FSSETXATTR = 0x401C5820  # _IOW('X', 32, struct fsxattr)
FS_XFLAG_PROJINHERIT = 0x200
Q_SETQUOTA = 0x800008
PRJQUOTA = 2
QIF_BLIMITS = 1
SYS_QUOTACTL_FD = 443  # x86_64, Linux 5.14+
_FSXATTR = struct.Struct("=IIIII8x")  # xflags, extsize, nextents, projid, cowextsize
_DQBLK = struct.Struct("=QQQQQQQQI4x")  # if_dqblk: block limits in KiB units of 1 KiB
_libc = ctypes.CDLL(None, use_errno=True)


def _mount_of(path: Path) -> tuple[str, str] | None:
    """(file system type, super options) of the mount holding ``path``."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str, str] | None = None
    for line in text.splitlines():
        head, _, tail = line.partition(" - ")
        fields, fs = head.split(), tail.split()
        if len(fields) < 5 or len(fs) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (
            best is None or len(point) > best[0]
        ):
            best = (len(point), fs[0], fs[2])
    return (best[1], best[2]) if best else None


def project_quota_missing(path: Path) -> str | None:
    """None where the file system holding ``path`` enforces project quotas; else why not."""
    found = _mount_of(path)
    if found is None:
        return f"the file system of {path} was not found in /proc/self/mountinfo"
    fstype, options = found
    opts = set(options.split(","))
    if fstype in ("ext4", "xfs") and opts & {"prjquota", "pquota"}:
        return None
    return (
        f"{path} is on {fstype} without project quotas (it needs XFS or ext4 with the project and "
        "quota features, mounted with prjquota)"
    )


def project_id(layer: Path) -> int:
    """The project of a layer directory: from its name (random hex), never 0 (the default project)."""
    digest = hashlib.sha256(layer.name.encode()).digest()
    return (int.from_bytes(digest[:4], "little") & 0x7FFFFFFF) or 1


def bound_disk(layer: Path, disk_gb: int) -> None:
    """Put the layer's ``upper`` and ``work`` (overlay renames from one into the other, so
    both) in a project of their own, inherited by all made below, limited to ``disk_gb``."""
    projid = project_id(layer)
    for sub in ("upper", "work"):
        d = layer / sub
        d.mkdir(exist_ok=True)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            buf = bytearray(_FSXATTR.size)
            fcntl.ioctl(fd, FS_IOC_FSGETXATTR, buf)
            xflags, extsize, nextents, _, cow = _FSXATTR.unpack(buf)
            fcntl.ioctl(fd, FS_IOC_FSSETXATTR, _FSXATTR.pack(xflags | FS_XFLAG_PROJINHERIT, extsize, nextents,
                                                             projid, cow))  # fmt: skip
        except OSError as exc:
            raise HostSetupError(f"cannot give {d} a project for its disk quota: {exc}") from exc
        finally:
            os.close(fd)
    limit = _DQBLK.pack(disk_gb << 20, disk_gb << 20, 0, 0, 0, 0, 0, 0, QIF_BLIMITS)
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cmd = (Q_SETQUOTA << 8) | PRJQUOTA
        if _libc.syscall(SYS_QUOTACTL_FD, fd, cmd, projid, ctypes.c_char_p(limit)) != 0:
            err = ctypes.get_errno()
            raise HostSetupError(f"cannot set the disk quota of {layer}: {os.strerror(err)}")
    finally:
        os.close(fd)
