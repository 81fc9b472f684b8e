"""What a box is made of: its options, validated once, persisted with its record."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import auto as engine_choice
from ..errors import InvalidArgument
from ..images.reference import Reference
from ..net.addresses import DNS_PORT, PROXY_PORT, proxy_env
from ..net.policy import Policy, Rule, parse_ip
from ..net.secrets import DEFAULT_PORT, Secret, host_rule, new_placeholder, trust_env
from .store import validate_name
from .validate import check_env, check_user, guest_path, positive

DEFAULT_MEMORY_MIB = 512
DEFAULT_DISK_GB = 8
# microvm has 8 virtio-mmio transports: the agent's serial ports, the root disk, the
# balloon and the network card take up to 4, which leaves 4 for volumes (the disks of
# named ones and the shares of host directories)
MAX_MOUNTS = 4
_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")

VolumeSpec = str | tuple[str, str] | tuple[str, str, str] | tuple[str, str, bool]


@dataclass(frozen=True, slots=True)
class Volume:
    """A directory of the host shared into the box (virtio-9p), live: what a box writes
    there, the host and every other box sharing it see at once; a snapshot has it
    unmounted for its save, and a restore, a rollback or a fork mounts it again as it is
    then. ``volume``: the shared volume (``sandlot.volume.create(shared=True)``) whose
    directory it is, or "" for a host directory the box was given by path."""

    host: str
    guest: str
    readonly: bool = False
    volume: str = ""

    @classmethod
    def parse(cls, spec: Any) -> Volume:
        """``"HOST:GUEST[:ro|rw]"``, ``(host, guest)``, ``(host, guest, "ro")`` or a Volume."""
        if isinstance(spec, Volume):
            v = spec
        elif isinstance(spec, str):
            parts = spec.split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw", "shared")):
                raise InvalidArgument(f"volume {spec!r} is not HOST:GUEST[:ro]")
            v = cls(parts[0], parts[1], len(parts) == 3 and parts[2] == "ro")
        elif isinstance(spec, tuple) and len(spec) in (2, 3):
            ro = spec[2] if len(spec) == 3 else False
            if isinstance(ro, str):
                if ro not in ("ro", "rw", "shared"):
                    raise InvalidArgument(f"volume mode must be 'ro' or 'rw', not {ro!r}")
                ro = ro == "ro"
            v = cls(str(spec[0]), str(spec[1]), bool(ro))
        else:
            raise InvalidArgument(f"invalid volume {spec!r}")
        host = Path(v.host).expanduser()
        if not host.is_dir():
            raise InvalidArgument(f"volume source {v.host!r} is not an existing directory")
        guest = guest_path(v.guest)
        if guest == "/" or guest.rstrip("/") in ("/proc", "/sys", "/dev"):
            raise InvalidArgument(f"a volume cannot be mounted on {guest}")
        return cls(str(host.resolve()), guest, v.readonly)

    @classmethod
    def saved(cls, item: list[Any]) -> Volume:
        """A share as a saved box's options keep it (``[host, guest, readonly, volume?]``),
        for a box started from that state: its directory must still be there."""
        v = cls(str(item[0]), str(item[1]), bool(item[2]), *(str(x) for x in item[3:4]))
        if not Path(v.host).is_dir():
            what = f"shared volume {v.volume!r}" if v.volume else f"host directory {v.host}"
            raise InvalidArgument(f"the saved state shares {what} at {v.guest}, which is gone")
        return v


MOUNT_MODES = ("copy", "ro", "shared")
_VOLUME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def is_volume_name(source: str) -> bool:
    """A mount's source names a volume unless it is a path: ``data`` is the volume, while
    ``./data``, ``/srv/data`` and ``~/data`` are host directories."""
    return bool(_VOLUME_NAME.match(source)) and not source.startswith(".")


@dataclass(frozen=True, slots=True)
class Mount:
    """A named volume (``sandlot.volume``) mounted in the box at ``guest``. ``copy``: the
    box writes its own copy-on-write layer over the volume, saved with its snapshots,
    given to its forks as copies and restored by a rollback; the box that mounted the
    volume by name writes it back when it is removed. ``ro``: read-only, any number of
    boxes at once. A shared volume (made with ``shared=True``) is mounted ``shared``
    (or ``ro``): the box is given its directory, a ``Volume`` (``volumes.resolve``)."""

    volume: str
    guest: str
    mode: str = ""  # "copy", "ro" or "shared"; "" (the volume's own) until the box is made


def parse_mount(spec: Any) -> Volume | Mount:
    """``"SOURCE:GUEST[:MODE]"`` or ``(source, guest[, mode])``: a named volume (modes
    ``copy``, ``ro`` and ``shared``; by default the volume's own, ``copy`` or ``shared``)
    or a host directory (``rw``, the default, and ``ro``)."""
    if isinstance(spec, Volume | Mount):
        return spec
    if isinstance(spec, str):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise InvalidArgument(f"volume {spec!r} is not SOURCE:GUEST[:MODE]")
    elif isinstance(spec, tuple) and len(spec) in (2, 3):
        parts = [str(spec[0]), str(spec[1]), *spec[2:]]
    else:
        raise InvalidArgument(f"invalid volume {spec!r}: give 'SOURCE:GUEST[:MODE]' or (source, guest, mode)")
    source, mode = str(parts[0]), parts[2] if len(parts) == 3 else None
    if not is_volume_name(source):
        return Volume.parse(spec)
    if isinstance(mode, bool):
        mode = "ro" if mode else ""
    mode = "" if mode in (None, "", "rw") else mode
    if mode and mode not in MOUNT_MODES:
        raise InvalidArgument(f"volume {source!r}: mode must be 'copy', 'ro' or 'shared', not {mode!r}")
    guest = guest_path(str(parts[1]))
    if guest == "/" or guest.rstrip("/") in ("/proc", "/sys", "/dev"):
        raise InvalidArgument(f"a volume cannot be mounted on {guest}")
    return Mount(source, guest, mode)


PortSpec = int | str | tuple[int, int] | tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Port:
    """A guest TCP port published on the host: ``address:host`` -> the box's ``guest``.
    ``host`` 0 takes any free port (``inspect()["network"]["ports"]`` says which)."""

    guest: int
    host: int = 0
    address: str = "127.0.0.1"

    @classmethod
    def parse(cls, spec: Any) -> Port:
        """``80`` (any host port), ``"8080:80"``, ``"0.0.0.0:8080:80"``, ``(8080, 80)``,
        ``("0.0.0.0", 8080, 80)`` or a Port. Bound to 127.0.0.1 unless an address is given."""
        if isinstance(spec, Port):
            p = spec
        elif isinstance(spec, int) and not isinstance(spec, bool):
            p = cls(guest=spec)
        elif isinstance(spec, str):
            parts = spec.rsplit(":", 2)
            if not all(x.isdigit() for x in parts[-2:] if x) or not parts[-1]:
                raise InvalidArgument(f"port {spec!r} is not GUEST, HOST:GUEST or ADDRESS:HOST:GUEST")
            if len(parts) == 1:
                p = cls(guest=int(parts[0]))
            elif len(parts) == 2:
                p = cls(guest=int(parts[1]), host=int(parts[0] or 0))
            else:
                p = cls(guest=int(parts[2]), host=int(parts[1] or 0), address=parts[0])
        elif isinstance(spec, tuple) and len(spec) == 2:
            p = cls(guest=spec[1], host=spec[0] or 0)
        elif isinstance(spec, tuple) and len(spec) == 3:
            p = cls(guest=spec[2], host=spec[1] or 0, address=spec[0])
        else:
            raise InvalidArgument(f"invalid port {spec!r}")
        for what, n, low in (("guest port", p.guest, 1), ("host port", p.host, 0)):
            if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= 65535:
                raise InvalidArgument(f"{what} must be a number in {low}..65535, not {n!r}")
        address = parse_ip(p.address) if isinstance(p.address, str) else None
        if address is None:
            raise InvalidArgument(f"a published port binds to an IP address, not {p.address!r}")
        if address.version != 4:  # QEMU 7.2's hostfwd
            raise InvalidArgument(f"published ports bind to IPv4 addresses here, not {p.address!r}")
        return cls(p.guest, p.host, str(address))


def _secret_specs(given: Sequence[Secret] | None, saved: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The secrets' records: a secret the saved state had keeps its placeholder
    (programs running in that state hold it); a new one gets a new placeholder."""
    if given is not None and (isinstance(given, str | Secret) or not isinstance(given, Sequence)):
        raise InvalidArgument(f"secrets must be a list of sandlot.Secret, not {type(given).__name__}")
    specs = {s["name"]: dict(s) for s in saved}
    seen = set()
    for s in given or ():
        if not isinstance(s, Secret):
            raise InvalidArgument(f"secrets must be sandlot.Secret objects, not {type(s).__name__}")
        if s.name in seen:
            raise InvalidArgument(f"two secrets are named {s.name}")
        seen.add(s.name)
        placeholder = specs.get(s.name, {}).get("placeholder") or new_placeholder(s.name)
        specs[s.name] = {"name": s.name, "placeholder": placeholder, "hosts": list(s.hosts)}
    return list(specs.values())


def _plain(value: Any) -> Any:
    """A copy of JSON-like data (dicts, lists, tuples and scalars) that shares nothing
    mutable with ``value``."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


@dataclass
class BoxSpec:
    """Everything that defines a box; persisted (minus secrets) in its record."""

    image: str | None = None
    rootfs: str | None = None
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    volumes: list[Volume] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)  # named volumes
    labels: dict[str, str] = field(default_factory=dict)
    memory_mib: int = DEFAULT_MEMORY_MIB
    cpus: int = 1
    disk_size_gb: int = DEFAULT_DISK_GB
    auto_remove: bool = False
    engine: str = "qemu"
    accel: str = "auto"
    kernel: str | None = None
    hostname: str | None = None
    boot_timeout: float | None = None
    request_timeout: float = 30.0
    idle_timeout: float | None = None  # suspend after this many seconds without requests
    pids_limit: int | None = None  # processes all commands together may have
    nested_virt: bool = False  # the box runs VMs of its own: /dev/kvm, on the guest's KVM
    containers: bool = False  # the box runs a container engine (Docker, Podman): see core.containers
    aslr: bool = True  # the guest kernel randomizes its processes' address spaces
    network: str = "none"  # see sandlot.net.policy
    allow: list[str] = field(default_factory=list)
    ports: list[Port] = field(default_factory=list)
    # its published ports are held by a process of the host's own (``api.port_keeper``) that
    # wakes the box when a connection comes while it sleeps, and bridges it through the agent
    wake_on_traffic: bool = False
    # {"name", "placeholder", "hosts"} of each secret; the values are in the box's secrets file
    secrets: list[dict[str, Any]] = field(default_factory=list)
    image_config: dict[str, Any] | None = None  # the image's Env/WorkingDir/User/Entrypoint/Cmd, kept
    # its first boot is saved as the image's automatic template (for any process that starts it)
    auto_template: bool = False
    # the content key of its rootfs= (images.rootfs.rootfs_key) when it was made: what the
    # automatic template of a box from a directory or tarball is found by, as an image's is
    # by its digest; taken at creation, not at the first boot's save, so a directory
    # changed between the two never names the older tree's boot
    rootfs_digest: str | None = None
    # a warm pool's VM: the template it waits in the pool of, until a box claims it (core.pools)
    pool: str | None = None

    @classmethod
    def build(
        cls,
        image: str | None,
        *,
        rootfs: str | os.PathLike[str] | None = None,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        volumes: Sequence[VolumeSpec] | Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        memory_mib: int = DEFAULT_MEMORY_MIB,
        cpus: int = 1,
        disk_size_gb: int = DEFAULT_DISK_GB,
        auto_remove: bool = False,
        engine: str | None = None,
        accel: str = "auto",
        kernel: str | os.PathLike[str] | None = None,
        hostname: str | None = None,
        boot_timeout: float | None = None,
        request_timeout: float = 30.0,
        idle_timeout: float | None = None,
        network: str | bool | None = None,
        allow: Sequence[str] | str | None = None,
        ports: Sequence[PortSpec] | None = None,
        wake_on_traffic: bool = False,
        pids_limit: int | None = None,
        nested_virt: bool = False,
        containers: bool = False,
        aslr: bool | None = None,
        secrets: Sequence[Secret] | None = None,
        saved_secrets: Sequence[dict[str, Any]] = (),
        saved: bool = False,
    ) -> BoxSpec:
        """``saved``: the box starts from a saved state, which may name neither an
        image nor a root filesystem here (an imported snapshot). ``saved_secrets``:
        the secrets of that state (their placeholders are in its memory)."""
        has_rootfs = rootfs is not None and bool(os.fspath(rootfs))
        if saved and image is None and not has_rootfs:
            pass
        elif (image is None) == (not has_rootfs):
            raise InvalidArgument(
                "a box needs exactly one of: an image, or rootfs= (a directory or a tarball)"
            )
        if image is not None:
            if not isinstance(image, str):
                raise InvalidArgument(f"image must be a reference string, not {type(image).__name__}")
            Reference.parse(image)  # malformed references fail now, before anything is made
        root = None
        if has_rootfs:
            assert rootfs is not None
            p = Path(rootfs).expanduser()
            if not p.exists() and not saved:
                raise InvalidArgument(f"rootfs {p} does not exist")
            root = str(p.absolute())
        engine = engine_choice.requested(engine)  # "auto" is resolved when the box is made
        if accel not in ("auto", "kvm", "tcg"):
            raise InvalidArgument(f"accel must be 'auto', 'kvm' or 'tcg', not {accel!r}")
        positive("memory_mib", memory_mib, integer=True)
        positive("cpus", cpus, integer=True)
        positive("disk_size_gb", disk_size_gb, integer=True)
        positive("boot_timeout", boot_timeout)
        positive("request_timeout", request_timeout)
        positive("idle_timeout", idle_timeout)
        positive("pids_limit", pids_limit, integer=True)
        if pids_limit is not None and pids_limit < 8:
            raise InvalidArgument(f"pids_limit must be at least 8 (a shell needs a few), not {pids_limit}")
        if not isinstance(nested_virt, bool):
            raise InvalidArgument(f"nested_virt must be True or False, not {nested_virt!r}")
        if not isinstance(containers, bool):
            raise InvalidArgument(f"containers must be True or False, not {containers!r}")
        if not isinstance(wake_on_traffic, bool):
            raise InvalidArgument(f"wake_on_traffic must be True or False, not {wake_on_traffic!r}")
        if aslr is not None and not isinstance(aslr, bool):
            raise InvalidArgument(f"aslr must be True or False, not {aslr!r}")
        if memory_mib < 64:
            raise InvalidArgument(f"memory_mib must be at least 64, not {memory_mib}")
        if cpus > (os.cpu_count() or 1) * 4:
            raise InvalidArgument(f"cpus={cpus} is more than this host can emulate sensibly")
        if hostname is not None and not _HOSTNAME.match(hostname):
            raise InvalidArgument(f"invalid hostname {hostname!r}")
        if name is not None:
            validate_name(name)
        if isinstance(volumes, Mapping):
            volumes = [(str(h), str(g)) for h, g in volumes.items()]
        if isinstance(volumes, str) or not isinstance(volumes, Sequence | None):
            raise InvalidArgument(f"volumes must be a list or a mapping, not {volumes!r}")
        parsed = [parse_mount(v) for v in (volumes or [])]
        vols = [v for v in parsed if isinstance(v, Volume)]
        mounts = [m for m in parsed if isinstance(m, Mount)]
        if len({v.guest for v in parsed}) != len(parsed):
            raise InvalidArgument("two volumes share one guest path")
        if len({m.volume for m in mounts}) != len(mounts):
            raise InvalidArgument("a box mounts a named volume once")
        if len(parsed) > MAX_MOUNTS:
            raise InvalidArgument(f"a box mounts at most {MAX_MOUNTS} volumes, not {len(parsed)}")
        policy = Policy.build(network, allow)
        if ports is not None and not isinstance(ports, list | tuple):
            raise InvalidArgument(f"ports must be a list, such as [8080] or [(8080, 80)], not {ports!r}")
        published = [Port.parse(p) for p in (ports or [])]
        taken = [(p.address, p.host) for p in published if p.host]
        if len(set(taken)) != len(taken):
            raise InvalidArgument("two published ports use the same host address and port")
        if published and not policy.has_nic and not wake_on_traffic:
            raise InvalidArgument(
                "published ports need a network card: network='none' has none "
                "(network='allowlist' with no allow entries publishes ports and lets nothing out; "
                "wake_on_traffic=True brings them in through the agent, with no card)"
            )
        secret_specs = _secret_specs(secrets, saved_secrets)
        if secret_specs and not policy.proxied:
            raise InvalidArgument(
                f"secrets need network='allowlist' or 'public' (the egress proxy swaps them in), "
                f"not network={policy.mode!r}"
            )
        clash = sorted({s["name"] for s in secret_specs} & set(env or {}))
        if clash:
            raise InvalidArgument(f"{', '.join(clash)} is both a secret and an env= variable")
        lab = {}
        for k, v in (labels or {}).items():
            if not isinstance(k, str) or not _LABEL_KEY.match(k) or not isinstance(v, str):
                raise InvalidArgument(f"invalid label {k!r}={v!r}")
            lab[k] = v
        return cls(
            image=image,
            rootfs=root,
            name=name,
            env=check_env(env),
            workdir=guest_path(workdir) if workdir is not None else None,
            user=check_user(user),
            volumes=vols,
            mounts=mounts,
            labels=lab,
            memory_mib=memory_mib,
            cpus=cpus,
            disk_size_gb=disk_size_gb,
            auto_remove=bool(auto_remove),
            engine=engine,
            accel=accel,
            kernel=str(kernel) if kernel else None,
            hostname=hostname,
            boot_timeout=boot_timeout,
            request_timeout=request_timeout,
            idle_timeout=idle_timeout,
            network=policy.mode,
            allow=[str(r) for r in policy.allow],
            ports=published,
            wake_on_traffic=wake_on_traffic,
            pids_limit=pids_limit,
            nested_virt=nested_virt,
            containers=containers,
            aslr=aslr is not False,
            secrets=secret_specs,
        )

    @property
    def policy(self) -> Policy:
        """The egress policy in force: in allowlist mode, a secret's hosts are reachable too."""
        allow = list(self.allow)
        if self.network == "allowlist":
            for s in self.secrets:
                allow += [h if host_rule(s["name"], h).port else f"{h}:{DEFAULT_PORT}" for h in s["hosts"]]
        return Policy.build(self.network, allow or None)

    def transparent_ports(self) -> list[int]:
        """The ports a program may connect to straight (not through HTTP(S)_PROXY) at
        the address sandlot's DNS gives allowed names: 80, 443 and those the allow
        entries and secrets name. Fixed when the VM starts: QEMU cannot add them later."""
        ports = {80, 443}
        ports.update(r.port for r in self.policy.allow if r.port and r.box is None)
        for s in self.secrets:
            ports.update(r.port for r in map(Rule.parse, s["hosts"]) if r.port)
        return sorted(ports - {PROXY_PORT, DNS_PORT})

    def to_options(self) -> dict[str, Any]:
        # by hand rather than dataclasses.asdict, whose generic recursion deep-copies every
        # value (0.24 ms a call, measured; a pool claim made four): the same plain copy
        d = {name: _plain(getattr(self, name)) for name in self.__dataclass_fields__}
        d["volumes"] = [[v.host, v.guest, v.readonly, *[v.volume][: bool(v.volume)]] for v in self.volumes]
        d["mounts"] = [[m.volume, m.guest, m.mode] for m in self.mounts]
        d["ports"] = [[p.address, p.host, p.guest] for p in self.ports]
        return d

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> BoxSpec:
        d = dict(options)
        d["volumes"] = [Volume(str(v[0]), str(v[1]), bool(v[2]), *v[3:4]) for v in d.get("volumes", [])]
        d["mounts"] = [Mount(v, g, mode) for v, g, mode in d.get("mounts", [])]
        d["ports"] = [Port(g, h, a) for a, h, g in d.get("ports", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    # -- what a command gets by default -------------------------------------------------

    def default_env(self) -> dict[str, str]:
        image_env = {}
        for e in (self.image_config or {}).get("env", []):
            k, _, v = e.partition("=")
            image_env[k] = v
        if self.policy.proxied:
            image_env.update(proxy_env())
        if self.secrets:
            image_env.update(trust_env())
            image_env.update({s["name"]: s["placeholder"] for s in self.secrets})
        return {**image_env, **self.env}

    def default_cwd(self) -> str | None:
        return self.workdir or (self.image_config or {}).get("workdir") or None

    def default_user(self) -> str | None:
        return self.user or (self.image_config or {}).get("user") or None

    def boot_timeout_for(self, accel: str) -> float:
        """The boot deadline: the box's own, ``$SANDLOT_BOOT_TIMEOUT``, else 30 s under
        TCG and 15 s under KVM. It counts the box's own progress, not time in line."""
        if self.boot_timeout:
            return self.boot_timeout
        env = os.environ.get("SANDLOT_BOOT_TIMEOUT")
        if env:
            return float(env)
        return 15.0 if accel == "kvm" else 30.0
