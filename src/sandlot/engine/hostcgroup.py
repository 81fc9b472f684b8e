"""Host cgroups for QEMU processes: a runaway QEMU (or a guest that takes it
over) is bounded on the host too, not only by the guest kernel's own limits.

Right after it is spawned, each QEMU is moved into a cgroup of its own with
memory, CPU and process-count limits (``Limits``). The guestfwd proxies QEMU
spawns are its children and start in that cgroup too. Where it can live:

- cgroup v2 (``/sys/fs/cgroup/cgroup.controllers`` exists): in
  ``sandlot/<vm>`` under the highest cgroup, from ours upward, that this user
  may write: the subtree delegated to it (a systemd user's
  ``user@UID.service``; the root for root).
- cgroup v1: in each writable memory, cpu and pids hierarchy, at
  ``<mount>/<our cgroup there>/sandlot/<vm>``.
- nowhere otherwise; ``detect()`` says why.

Placement is best-effort: a VM whose QEMU cannot be placed still runs, and
the reason is logged once as a warning. ``SANDLOT_HOST_CGROUP=0`` turns
placement off.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("sandlot.hostcgroup")

SWITCH = "SANDLOT_HOST_CGROUP"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")
BASE_NAME = "sandlot"

# What QEMU takes beyond guest RAM and the TCG code cache (added on top where
# TCG runs). Measured after a Python workload: ~50 MiB of QEMU's own heap and
# device state, ~45 MiB for the guest kernel image it keeps mapped after a cold
# boot, and ~7 MiB (13 MiB resident) per Python egress proxy, one per open
# guest connection. 256 MiB leaves room for a dozen or more connections at
# once; past the limit the OOM killer ends this box's QEMU, not another process.
QEMU_OVERHEAD_MIB = 256
# Each vCPU thread can use a core, and QEMU's main loop (virtio, slirp) and the
# proxies need part of one more while the guest does I/O. Measured with a
# 1-vCPU box running a shell loop and streaming 50 MB of stdout: a quota of
# cpus cores throttled it in up to 85% of periods; cpus + 1 cores in none. So the
# quota never holds back a box at work, and still keeps one from taking every
# core of a larger host.
SPARE_CORES = 1
CPU_PERIOD_US = 100_000
# QEMU runs about ten threads; each guest connection to the egress proxy adds a
# process. Far above both, low enough that a fork bomb stops there.
PIDS_MAX = 512
# cgroup v1 reads back a bound of "none" as the largest page-aligned value
UNBOUNDED_V1 = 1 << 62
# Written only where swap is accounted. Swap is held at zero: the memory limit
# already holds all a VM needs, so swap would only let a runaway spill past it
# into the host's swap.
SWAP_FILES = frozenset({"memory.swap.max", "memory.memsw.limit_in_bytes"})
# sandlot's own long-lived helpers (the home's box link) run in a cgroup of their own,
# ``sandlot/helper-<name>-<pid>``, never in the cgroup of the box whose connection
# started them: they serve every box, and outlive that one. Bounded all the same.
HELPER_LIMITS_MIB, HELPER_CPUS, HELPER_PIDS = 512, 1, 256
HELPER_PREFIX = "helper-"
# A cgroup is made and given its QEMU within milliseconds: an empty one older
# than this belongs to a QEMU that is gone (its owner was SIGKILLed).
STALE_AFTER_S = 60.0

Writable = Callable[[Path], bool]


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


@dataclass(frozen=True, slots=True)
class Limits:
    memory_bytes: int
    cpu_quota_us: int  # per CPU_PERIOD_US
    pids: int = PIDS_MAX

    @classmethod
    def for_vm(cls, memory_mib: int, cpus: int, code_cache_mib: int = 0) -> Limits:
        """The bounds of a QEMU with this much guest RAM and this many vCPUs;
        ``code_cache_mib``: its TCG translation cache (0 under KVM)."""
        memory_mib += QEMU_OVERHEAD_MIB + code_cache_mib
        return cls(memory_mib << 20, (cpus + SPARE_CORES) * CPU_PERIOD_US)

    def files(self, version: int, controllers: Iterable[str]) -> list[tuple[str, str]]:
        """(file, value) to write into a new cgroup of that version, in order."""
        memory, quota = str(self.memory_bytes), str(self.cpu_quota_us)
        if version == 2:
            by_controller = {
                "memory": [("memory.max", memory), ("memory.swap.max", "0")],
                "cpu": [("cpu.max", f"{quota} {CPU_PERIOD_US}")],
            }
        else:  # the memory+swap bound must not be below the memory one: written second
            by_controller = {
                "memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
                "cpu": [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", quota)],
            }
        by_controller["pids"] = [("pids.max", str(self.pids))]
        return [item for c in controllers for item in by_controller[c]]


@dataclass(frozen=True, slots=True)
class Tree:
    """Where the VM cgroups of one hierarchy go: ``parent/sandlot/<vm>``."""

    parent: Path
    controllers: tuple[str, ...]

    @property
    def base(self) -> Path:
        return self.parent / BASE_NAME


@dataclass(frozen=True, slots=True)
class HostCgroups:
    """What the host offers: cgroup ``version`` (1 or 2) and the trees to use,
    or version 0, no trees and the ``reason``."""

    version: int
    trees: tuple[Tree, ...] = ()
    reason: str = ""

    def report(self) -> dict[str, object]:
        if not self.trees:
            return {"version": None, "reason": self.reason}
        return {
            "version": self.version,
            "where": [str(t.base) for t in self.trees],
            "controllers": [c for t in self.trees for c in t.controllers],
        }


@dataclass(frozen=True, slots=True)
class Placement:
    """The host cgroups one QEMU was moved into: one on cgroup v2, one per
    hierarchy on v1."""

    version: int
    paths: tuple[Path, ...]

    def report(self) -> dict[str, object]:
        return {"version": self.version, "paths": [str(p) for p in self.paths]}

    def remove(self) -> None:
        """Remove the cgroups once QEMU is gone, and ``sandlot/`` with the last
        of them. One that still holds a process (a proxy that outlived QEMU)
        stays for a later ``sweep``. Never raises."""
        for leaf in self.paths:
            for path in (leaf, leaf.parent):
                with contextlib.suppress(OSError):
                    path.rmdir()

    @contextlib.contextmanager
    def memory_lifted(self, extra_bytes: int) -> Iterator[None]:
        """Raise the memory bound by ``extra_bytes`` for a while, then put it back (where
        the cgroup still exists). For work the host does on the box's behalf while the box
        itself stands still, such as a checkpoint. Best-effort: a bound that cannot be
        read or written stays as it was."""
        # v1: the memory+swap bound must never be below the memory one, so it is raised
        # first and lowered last
        v1 = ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes")
        names = ("memory.max",) if self.version == 2 else v1
        lifted: list[tuple[Path, str]] = []
        for leaf in self.paths:
            for name in names:
                path = leaf / name
                try:
                    before = path.read_text().strip()
                    if before == "max" or int(before) >= UNBOUNDED_V1:
                        continue
                    path.write_text(str(int(before) + extra_bytes))
                except (OSError, ValueError):
                    continue
                lifted.append((path, before))
        try:
            yield
        finally:
            for path, before in reversed(lifted):
                with contextlib.suppress(OSError):
                    path.write_text(before)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """The cgroup path per controller in ``/proc/PID/cgroup`` (lines
    ``ID:CONTROLLERS:PATH``); the cgroup v2 one (``0::PATH``) is under ``""``."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            for controller in fields[1].split(","):
                paths[controller] = fields[2]
    return paths


def _unescape(field: str) -> str:
    """A mountinfo field, whose spaces and the like are written as ``\\040``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_v1_mounts(mountinfo: str) -> dict[str, tuple[Path, str]]:
    """(mount point, cgroup the mount shows as its root) of each cgroup v1
    controller in ``/proc/self/mountinfo``; the first mount of each wins."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, fs = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(fs) < 3 or fs[0] != "cgroup":
            continue
        for option in fs[2].split(","):
            mounts.setdefault(option, (Path(_unescape(fields[4])), _unescape(fields[3])))
    return mounts


def _cgroup_dir(mount: Path, mount_root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount``
    from ``mount_root`` down; None when the mount does not show it."""
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    parts = [p for p in path[len(root) :].split("/") if p]
    return None if ".." in parts else mount.joinpath(*parts)


def delegated_ancestor(root: Path, own: str, writable: Writable = _writable) -> Path | None:
    """The highest cgroup v2, from ``own`` upward, whose directory,
    ``cgroup.procs`` and ``cgroup.subtree_control`` this user may write: the
    top of the subtree delegated to it. Moving a process needs write access to
    ``cgroup.procs`` of the common ancestor of its old and new cgroup, which a
    cgroup made under this one always is."""
    parts = [p for p in own.split("/") if p]
    if ".." in parts:  # our cgroup is outside this namespace's view
        return None
    found = None
    for depth in range(len(parts), -1, -1):
        cgroup = root.joinpath(*parts[:depth])
        if not all(writable(p) for p in (cgroup, cgroup / "cgroup.procs", cgroup / "cgroup.subtree_control")):
            break
        found = cgroup
    return found


def detect_v2(root: Path, own: str, writable: Writable = _writable) -> HostCgroups:
    parent = delegated_ancestor(root, own, writable)
    if parent is None:
        why = f"cgroup v2 without a delegated subtree this user may write (ours: {own})"
        return HostCgroups(0, reason=why)
    enabled = _read_words(parent / "cgroup.subtree_control")
    controllers = tuple(c for c in CONTROLLERS if c in enabled)
    if not controllers:
        why = f"cgroup v2: {parent} enables none of {', '.join(CONTROLLERS)} for its children"
        return HostCgroups(0, reason=why)
    return HostCgroups(2, (Tree(parent, controllers),))


def detect_v1(
    own: dict[str, str], mounts: dict[str, tuple[Path, str]], writable: Writable = _writable
) -> HostCgroups:
    controllers_at: dict[Path, tuple[str, ...]] = {}  # co-mounted controllers (cpu,cpuacct) share one
    for controller in CONTROLLERS:
        if controller not in mounts or controller not in own:
            continue
        cgroup = _cgroup_dir(*mounts[controller], own[controller])
        if cgroup is not None and writable(cgroup) and writable(cgroup / "cgroup.procs"):
            controllers_at[cgroup] = (*controllers_at.get(cgroup, ()), controller)
    if not controllers_at:
        return HostCgroups(0, reason="cgroup v1 without a memory, cpu or pids hierarchy this user may write")
    return HostCgroups(1, tuple(Tree(p, c) for p, c in controllers_at.items()))


def detect(root: Path = CGROUP_ROOT) -> HostCgroups:
    """Where this process can put VM cgroups (a few small reads; not cached, as
    our own cgroup may change)."""
    if os.environ.get(SWITCH) == "0":
        return HostCgroups(0, reason=f"turned off ({SWITCH}=0)")
    try:
        own = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
        mounts = parse_v1_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError as exc:
        return HostCgroups(0, reason=f"cannot read this process's cgroups: {exc}")
    if (root / "cgroup.controllers").exists():
        return detect_v2(root, own.get("", "/"))
    if any(c in mounts for c in CONTROLLERS):
        return detect_v1(own, mounts)
    return HostCgroups(0, reason=f"no cgroup hierarchy with {', '.join(CONTROLLERS)} is mounted")


def _read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def leaf_name(label: str, pid: int) -> str:
    """The cgroup of one QEMU: the VM's label and QEMU's pid, so the restores
    and forks of one box never collide."""
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in label)[:64]
    return f"{safe}-{pid}"


def sweep(base: Path, now: float | None = None) -> None:
    """Remove the leftover cgroups of QEMUs that are gone (their owner was
    SIGKILLed before it could clean up). Safe: rmdir refuses a cgroup that
    still holds a process, and a young empty one may be being filled."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False) and now - entry.stat().st_mtime > STALE_AFTER_S:
                os.rmdir(entry.path)


def _make_leaf(tree: Tree, version: int, name: str) -> Path:
    tree.base.mkdir(exist_ok=True)
    if version == 2:
        # ``sandlot/`` holds no processes, as cgroup v2 requires of one whose children use controllers
        enabled = _read_words(tree.base / "cgroup.subtree_control")
        missing = [c for c in tree.controllers if c not in enabled]
        if missing:
            (tree.base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
    sweep(tree.base)
    leaf = tree.base / name
    leaf.mkdir(exist_ok=True)
    return leaf


def _place_in(tree: Tree, version: int, name: str, pid: int, limits: Limits) -> Path:
    try:
        leaf = _make_leaf(tree, version, name)
    except FileNotFoundError:  # another process removed an empty ``sandlot/`` between our mkdirs
        leaf = _make_leaf(tree, version, name)
    try:
        # limits first: QEMU never runs unbounded in its new cgroup
        for file, value in limits.files(version, tree.controllers):
            if file not in SWAP_FILES or (leaf / file).exists():
                (leaf / file).write_text(value)
        (leaf / "cgroup.procs").write_text(str(pid))
    except OSError:
        with contextlib.suppress(OSError):
            leaf.rmdir()
        raise
    return leaf


_warned: set[tuple[Path, int | None]] = set()


def place_helper(pid: int, name: str, host: HostCgroups | None = None) -> Placement | None:
    """Move sandlot's helper process ``pid`` (``name``: what it is) out of whatever
    cgroup it started in, into one of its own under sandlot's (``HELPER_LIMITS_MIB``
    and the rest); as ``place``."""
    limits = Limits(HELPER_LIMITS_MIB << 20, HELPER_CPUS * CPU_PERIOD_US, HELPER_PIDS)
    return place(pid, HELPER_PREFIX + name, limits, host, what=f"the {name} helper")


def place(pid: int, label: str, limits: Limits, host: HostCgroups | None = None,
          what: str = "QEMU") -> Placement | None:  # fmt: skip
    """Move process ``pid`` into a new cgroup with ``limits`` in each tree the
    host offers; returns where it went, None for nowhere. Never raises: a tree
    that refuses is logged once (per tree and error) as a warning."""
    host = host or detect()
    name = leaf_name(label, pid)
    paths = []
    for tree in host.trees:
        try:
            paths.append(_place_in(tree, host.version, name, pid, limits))
        except ProcessLookupError:
            break  # it exited at once (a QEMU: the boot reports why)
        except OSError as exc:
            if (tree.base, exc.errno) in _warned:
                continue
            _warned.add((tree.base, exc.errno))
            why = f"{what} (pid {pid}) is not bounded by a host cgroup under {tree.base}: {exc}"
            if host.version == 2 and exc.errno in (errno.EACCES, errno.EPERM):
                why += (
                    f" (cgroup v2 moves a process only for a user who may write cgroup.procs "
                    f"of the common ancestor of its old and new cgroup: {tree.parent})"
                )
            log.warning(why)
    return Placement(host.version, tuple(paths)) if paths else None


def placement_of(pid: int, root: Path = CGROUP_ROOT) -> Placement | None:
    """The sandlot cgroups a running process is in: where a QEMU started by
    another process was placed. None when it is in none, or is gone."""
    try:
        cgroups = parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        mounts = parse_v1_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None
    if (root / "cgroup.controllers").exists():
        version, candidates = 2, [_cgroup_dir(root, "/", cgroups.get("", "/"))]
    else:
        version = 1
        shown = [c for c in CONTROLLERS if c in mounts and c in cgroups]
        candidates = [_cgroup_dir(*mounts[c], cgroups[c]) for c in shown]
    leaves = tuple(dict.fromkeys(p for p in candidates if p is not None and p.parent.name == BASE_NAME))
    return Placement(version, leaves) if leaves else None
