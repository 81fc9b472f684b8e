"""What a box is made of: its options, validated once, persisted with its record."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..images.reference import Reference
from ..net.addresses import DNS_PORT, PROXY_PORT, proxy_env
from ..net.policy import Policy, Rule
from ..net.secrets import DEFAULT_PORT, Secret, host_rule, new_placeholder, trust_env
from .option_values import MAX_MOUNTS, Mount, Port, Volume, parse_mount
from .options import OPTIONS, SPEC_DEFAULTS


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
    """Everything that defines a box; persisted in its record. Its options are declared
    in ``core/options.py``, which says what each means; a secret is kept as its name,
    placeholder and hosts (its value is in the box's secrets file)."""

    image: str | None = None
    # -- the options (core/options.py), written by scripts/gen_sync.py: edit there --
    rootfs: str | None = None
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    volumes: list[Volume] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    memory_mib: int = 512
    cpus: int = 1
    disk_size_gb: int = 8
    auto_remove: bool = False
    engine: str = "qemu"
    accel: str = "auto"
    kernel: str | None = None
    hostname: str | None = None
    timezone: str | None = None
    boot_timeout: float | None = None
    request_timeout: float = 30.0
    idle_timeout: float | None = None
    network: str = "none"
    allow: list[str] = field(default_factory=list)
    ports: list[Port] = field(default_factory=list)
    wake_on_traffic: bool = False
    pids_limit: int | None = None
    nested_virt: bool = False
    containers: bool = False
    aslr: bool = True
    secrets: list[dict[str, Any]] = field(default_factory=list)
    # -- end of the options --
    mounts: list[Mount] = field(default_factory=list)  # the named volumes of ``volumes``
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
        saved_secrets: Sequence[dict[str, Any]] = (),
        saved: bool = False,
        **options: Any,
    ) -> BoxSpec:
        """A box's spec from ``AsyncBox``'s options (``SPEC_OPTIONS``; those not given
        take their defaults), each checked by its declaration, then against the others.
        ``saved``: the box starts from a saved state, which may name neither an image nor
        a root filesystem here (an imported snapshot). ``saved_secrets``: the secrets of
        that state (their placeholders are in its memory)."""
        unknown = sorted(set(options) - set(SPEC_DEFAULTS))
        if unknown:
            raise InvalidArgument(f"unknown box option(s): {', '.join(unknown)}")
        given = {**SPEC_DEFAULTS, **options}
        kept = {o.name: o.check(given[o.name]) for o in OPTIONS if o.kind == "box" and o.check is not None}
        rootfs = given["rootfs"]
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
        kept["rootfs"] = None
        if has_rootfs:
            p = Path(rootfs).expanduser()
            if not p.exists() and not saved:
                raise InvalidArgument(f"rootfs {p} does not exist")
            kept["rootfs"] = str(p.absolute())
        volumes = given["volumes"]
        if isinstance(volumes, Mapping):
            volumes = [(str(h), str(g)) for h, g in volumes.items()]
        if isinstance(volumes, str) or not isinstance(volumes, Sequence | None):
            raise InvalidArgument(f"volumes must be a list or a mapping, not {volumes!r}")
        parsed = [parse_mount(v) for v in (volumes or [])]
        kept["volumes"] = [v for v in parsed if isinstance(v, Volume)]
        mounts = [m for m in parsed if isinstance(m, Mount)]
        if len({v.guest for v in parsed}) != len(parsed):
            raise InvalidArgument("two volumes share one guest path")
        if len({m.volume for m in mounts}) != len(mounts):
            raise InvalidArgument("a box mounts a named volume once")
        if len(parsed) > MAX_MOUNTS:
            raise InvalidArgument(f"a box mounts at most {MAX_MOUNTS} volumes, not {len(parsed)}")
        policy = Policy.build(given["network"], given["allow"])
        kept["network"], kept["allow"] = policy.mode, [str(r) for r in policy.allow]
        ports = given["ports"]
        if ports is not None and not isinstance(ports, list | tuple):
            raise InvalidArgument(f"ports must be a list, such as [8080] or [(8080, 80)], not {ports!r}")
        kept["ports"] = published = [Port.parse(p) for p in (ports or [])]
        taken = [(p.address, p.host) for p in published if p.host]
        if len(set(taken)) != len(taken):
            raise InvalidArgument("two published ports use the same host address and port")
        if published and not policy.has_nic and not kept["wake_on_traffic"]:
            raise InvalidArgument(
                "published ports need a network card: network='none' has none "
                "(network='allowlist' with no allow entries publishes ports and lets nothing out; "
                "wake_on_traffic=True brings them in through the agent, with no card)"
            )
        kept["secrets"] = secret_specs = _secret_specs(given["secrets"], saved_secrets)
        if secret_specs and not policy.proxied:
            raise InvalidArgument(
                f"secrets need network='allowlist' or 'public' (the egress proxy swaps them in), "
                f"not network={policy.mode!r}"
            )
        clash = sorted({s["name"] for s in secret_specs} & set(kept["env"]))
        if clash:
            raise InvalidArgument(f"{', '.join(clash)} is both a secret and an env= variable")
        kept["aslr"] = kept["aslr"] is not False
        return cls(image=image, mounts=mounts, **kept)

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
        if self.timezone is not None:
            image_env["TZ"] = self.timezone
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
