"""A box's options, each declared once (``OPTIONS``).

A declaration says what every layer needs to know about an option:

- its type and default as ``AsyncBox`` takes it, and a sentence of help;
- its check (``InvalidArgument`` for a bad value) and the form ``BoxSpec`` keeps;
- its flag on the command line (``sandlot run`` and ``sandlot create``), and how the
  flag's text becomes the value;
- its form on the wire (``BoxCreate``, the body of ``POST /v1/boxes``), or that it stays
  on the caller's host (``LOCAL``), or that only an admin key may send it (a path on
  the server's host).

What is derived from the table:

- ``AsyncBox.__init__``'s signature and docstring (and so ``sandlot.Box``'s),
  ``BoxSpec``'s fields, and the listing of ``sandlot.Box(...)`` on the API page
  (docs/api.md: each option's ``brief``), written by ``scripts/gen_sync.py`` and
  checked by it in CI (``--check``);
- the checks ``BoxSpec.build`` runs on each option (it keeps the checks that weigh
  one option against another: image or root filesystem, network and ports, secrets);
- the wire model (``api/contract.py``);
- the flags of the command line (``cli/boxes.py``).

Adding an option is its row here, ``scripts/gen_sync.py``, and the code that uses it.

>>> from sandlot.core.options import BY_NAME
>>> BY_NAME["memory_mib"].default, BY_NAME["memory_mib"].flag.names
(512, ('--memory', '-m'))
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired

from annotated_types import Interval
from typing_extensions import TypedDict

from ..engine import auto as engine_choice
from ..errors import InvalidArgument, Unsupported
from ..net.secrets import Secret
from .option_values import Mount, Port, is_volume_name, parse_mount
from .store import validate_name
from .validate import check_env, check_user, env_pairs, guest_path, label_pairs, positive

DEFAULT_MEMORY_MIB = 512
DEFAULT_DISK_GB = 8
PULL_POLICIES = ("missing", "always", "never")
ACCELS = ("auto", "kvm", "tcg")
_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")
_TIMEZONE = re.compile(r"^[A-Za-z][A-Za-z0-9_+.-]{0,29}(/[A-Za-z0-9_+.-]{1,30}){0,2}$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")

# kind: "box", what the box is (a field of BoxSpec, kept with its record); "request",
# how it is made (where it starts from, how its image is fetched); "handle", the
# facade's own (``keep``, ``record``, ``home``), never sent to a backend
Kind = Literal["box", "request", "handle"]


class LocalOnly:
    """The wire form of an option that names something of the caller's own host, which a
    server or another node does not have: it is never sent."""

    def __repr__(self) -> str:
        return "LOCAL"


LOCAL = LocalOnly()


@dataclass(frozen=True, slots=True)
class Flag:
    """How the command line spells an option: ``names`` (the first the long one),
    ``help``, ``type`` (what the flag parses: a list for a repeated flag), and ``parse``
    (the flag's value as the option takes it; ``InvalidArgument`` is a usage error)."""

    names: tuple[str, ...]
    help: str
    type: Any
    parse: Callable[[Any], Any] | None = None
    complete: Callable[[str], list[str]] | None = None
    min: float | None = None


@dataclass(frozen=True, slots=True)
class BoxOption:
    """One option of ``AsyncBox`` (see the module's description). ``type`` is its
    annotation as the generated signature writes it (names ``api/box.py`` imports);
    ``check`` returns the value as ``BoxSpec`` keeps it, or None where ``BoxSpec.build``
    checks it against others; ``keeps`` is ``BoxSpec``'s annotation and default, where
    they are not ``type`` and ``default``; ``wire`` the type of its JSON form (or
    ``LOCAL``), ``to_wire`` how a value becomes it (given the transport's name) and
    ``from_wire`` how it becomes a value ``AsyncBox`` takes again."""

    name: str
    type: str
    default: Any
    help: str
    kind: Kind = "box"
    check: Callable[[Any], Any] | None = None
    keeps: tuple[str, str] | None = None
    flag: Flag | None = None
    wire: Any = LOCAL
    to_wire: Callable[[Any, str], Any] | None = None
    from_wire: Callable[[Any], Any] | None = None
    admin: bool = False
    # the API page's listing of ``Box(...)`` (docs/api.md, written by scripts/gen_sync.py):
    # its one-line comment there, and its type there where not ``type`` (a reader's words)
    brief: str = ""
    shown: str | None = None


# -- checks -------------------------------------------------------------------------------


def _positive(name: str, *, integer: bool = False, least: int | None = None) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        positive(name, value, integer=integer)
        if least is not None and value is not None and value < least:
            raise InvalidArgument(f"{name} must be at least {least}, not {value}")
        return value

    return check


def _boolean(name: str, *, optional: bool = False) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, bool) and not (optional and value is None):
            raise InvalidArgument(f"{name} must be True or False, not {value!r}")
        return value

    return check


def _cpus(value: Any) -> int:
    positive("cpus", value, integer=True)
    if value > (os.cpu_count() or 1) * 4:
        raise InvalidArgument(f"cpus={value} is more than this host can emulate sensibly")
    return int(value)


def _accel(value: Any) -> str:
    if value not in ACCELS:
        raise InvalidArgument(f"accel must be 'auto', 'kvm' or 'tcg', not {value!r}")
    return str(value)


def _hostname(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not _HOSTNAME.match(value)):
        raise InvalidArgument(f"invalid hostname {value!r}")
    return value


def _timezone(value: Any) -> str | None:
    """An IANA zone's name (``Area/Location``, ``Etc/GMT+5``), a path under the guest's
    zoneinfo, so never absolute and never with ``..``; or a POSIX one (``UTC-3``)."""
    if value is not None and (not isinstance(value, str) or not _TIMEZONE.match(value) or ".." in value):
        raise InvalidArgument(
            f"timezone must be a time zone's name such as Europe/Paris or UTC-3, not {value!r}"
        )
    return value


def _labels(value: Any) -> dict[str, str]:
    if value is not None and not isinstance(value, Mapping):
        raise InvalidArgument(f"labels must be a mapping of keys to values, not {value!r}")
    out = {}
    for k, v in (value or {}).items():
        if not isinstance(k, str) or not _LABEL_KEY.match(k) or not isinstance(v, str):
            raise InvalidArgument(f"invalid label {k!r}={v!r}")
        out[k] = v
    return out


def _pull(value: Any) -> str:
    if value not in PULL_POLICIES:
        raise InvalidArgument(f"pull must be 'missing', 'always' or 'never', not {value!r}")
    return str(value)


# -- flags: the command line's text as the option's value ------------------------------------


def secret_flags(items: list[str] | None) -> list[Secret] | None:
    """``NAME@HOST[,HOST...]``: the value is this process's ``$NAME``, never a command-line
    argument (which any user of the host can read in the process list)."""
    out = []
    for item in items or []:
        name, sep, hosts = item.partition("@")
        if not sep or not hosts:
            raise InvalidArgument(f"--secret needs NAME@HOST[,HOST...], got {item!r}")
        value = os.environ.get(name)
        if value is None:
            raise InvalidArgument(f"--secret {name}: set ${name} in this environment to its value")
        out.append(Secret(name, value, hosts=hosts.split(",")))
    return out or None


def _some(items: list[str] | None) -> list[str] | None:
    return items or None


def _engine_flag(value: str | None) -> str | None:
    """``--engine``: a usage error now, not a failure once the image is pulled."""
    if value is not None:
        engine_choice.requested(value)
    return value


def _engines(incomplete: str) -> list[str]:
    return [e for e in engine_choice.choices() if e.startswith(incomplete)]


# -- wire forms ----------------------------------------------------------------------------


# Typed dicts, not pydantic models: this module is imported by every command on a box,
# and pydantic only by what makes a wire model of them (``api/contract.py``)
class PortIn(TypedDict):
    guest: Annotated[int, Interval(ge=1, le=65535)]
    host: NotRequired[Annotated[int, Interval(ge=0, le=65535)]]


class SecretIn(TypedDict):
    name: str
    value: str
    hosts: NotRequired[list[str]]


PortIn.__pydantic_config__ = SecretIn.__pydantic_config__ = {"extra": "forbid"}  # type: ignore[attr-defined]


def _path_json(value: Any, _transport: str) -> Any:
    return os.fspath(value)


def _pairs_json(value: Any, _transport: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(value).items()}


def _allow_json(value: Any, _transport: str) -> list[str]:
    return [value] if isinstance(value, str) else [str(a) for a in value]


def volumes_json(value: Any, transport: str) -> list[str]:
    """``volumes=`` as a server takes it: named volumes only, each ``NAME:GUEST[:MODE]``
    (checked as a local box's); a host directory is the caller's, which a server has not."""
    specs = [(str(k), str(v)) for k, v in value.items()] if isinstance(value, Mapping) else value
    if isinstance(specs, str) or not isinstance(specs, list | tuple):
        raise InvalidArgument(f"volumes must be a list or a mapping, not {value!r}")
    out = []
    for spec in specs:
        source = spec.split(":", 1)[0] if isinstance(spec, str) else ""
        if isinstance(spec, tuple) and spec:
            source = str(spec[0])
        if isinstance(spec, Mount) or is_volume_name(source):
            m = parse_mount(spec)
            assert isinstance(m, Mount)
            out.append(f"{m.volume}:{m.guest}" + (f":{m.mode}" if m.mode else ""))  # no mode: the volume's
        else:
            raise Unsupported(f"a host directory as a volume ({spec!r}) is not offered over the {transport} "
                              "transport: create a named volume (client.volume.create) and mount it by name",
                              transport=transport)  # fmt: skip
    return out


def _ports_json(value: Any, transport: str) -> list[dict[str, int]]:
    return [_port_json(p, transport) for p in value]


def _port_json(spec: Any, transport: str) -> dict[str, int]:
    """``80``, ``"8080:80"``, ``(8080, 80)`` or ``{"guest", "host"}`` as a server takes it,
    checked as a local box's port (``Port.parse``); the server picks the address it binds."""
    if isinstance(spec, Mapping):
        spec = Port(spec.get("guest"), spec.get("host", 0))  # type: ignore[arg-type]  # Port.parse checks
    elif (
        isinstance(spec, Port)
        or (isinstance(spec, str) and spec.count(":") > 1)
        or (isinstance(spec, tuple) and len(spec) == 3)
    ):
        raise Unsupported(f"a port's address ({spec!r}) is not offered over the {transport} transport: the "
                          "server chooses it", transport=transport)  # fmt: skip
    port = Port.parse(spec)
    return {"guest": port.guest, "host": port.host}


def _ports_of_json(ports: list[dict[str, int]]) -> list[str]:
    return [f"{p['host']}:{p['guest']}" if p.get("host") else str(p["guest"]) for p in ports]


def _secrets_of_json(secrets: list[dict[str, Any]]) -> list[Secret]:
    return [Secret(s["name"], s["value"], hosts=s.get("hosts") or []) for s in secrets]


def _secrets_json(value: Any, transport: str) -> list[dict[str, Any]]:
    out = []
    for secret in value:
        if isinstance(secret, Mapping):
            out.append(
                {"name": secret["name"], "value": secret["value"], "hosts": list(secret.get("hosts", []))}
            )
            continue
        if getattr(secret, "ca_pem", None):
            raise Unsupported(f"a secret's ca= is not offered over the {transport} transport (secret "
                              f"{secret.name})", transport=transport)  # fmt: skip
        out.append({"name": secret.name, "value": secret.value, "hosts": list(secret.hosts)})
    return out


# -- the table -----------------------------------------------------------------------------

A_LIST = "field(default_factory=list)"  # a BoxSpec field that starts as an empty list
OPTIONS: tuple[BoxOption, ...] = (
    BoxOption(
        "rootfs",
        "str | os.PathLike[str] | None",
        None,
        "A root filesystem to boot instead of an image: a directory or a tarball.",
        keeps=("str | None", "None"),
        wire=str | None,
        to_wire=_path_json,
        admin=True,
        flag=Flag(("--rootfs",), "Boot this directory or tarball, not an image.", Path | None),
        brief="instead of an image: a directory or a tarball",
    ),
    BoxOption(
        "name",
        "str | None",
        None,
        "The box's name, unique in its home (default: box-<id>).",
        check=lambda v: v if v is None else validate_name(v),
        wire=str | None,
        flag=Flag(("--name",), "Name of the box (unique).", str | None),
        brief="unique; default box-<id>",
    ),
    BoxOption(
        "env",
        "Mapping[str, str] | None",
        None,
        "Environment variables of every command.",
        check=check_env,
        keeps=("dict[str, str]", "field(default_factory=dict)"),
        wire=dict[str, str] | None,
        to_wire=_pairs_json,
        flag=Flag(("--env", "-e"), "KEY=VALUE (or KEY: take it from here).", list[str] | None, env_pairs),
        brief="added to the image's Env for every command",
    ),
    BoxOption(
        "workdir",
        "str | None",
        None,
        "The working directory of commands (default: the image's).",
        check=lambda v: v if v is None else guest_path(v),
        wire=str | None,
        flag=Flag(("--workdir", "-w"), "Working directory in the guest.", str | None),
        brief="default working directory (else the image's WorkingDir, else /)",
    ),
    BoxOption(
        "user",
        "str | None",
        None,
        "Who commands run as: name, uid, name:group or uid:gid.",
        check=check_user,
        wire=str | None,
        flag=Flag(("--user", "-u"), "name, uid, name:group or uid:gid.", str | None),
        brief="default user (else the image's User, else root)",
    ),
    BoxOption(
        "volumes",
        "Sequence[VolumeSpec] | Mapping[str, str] | None",
        None,
        "Named volumes (NAME:GUEST[:copy|ro|shared]) and host directories (HOST:GUEST[:ro]) "
        "mounted in the box, at most 4.",
        keeps=("list[Volume]", A_LIST),
        wire=list[str] | None,
        to_wire=volumes_json,
        flag=Flag(
            ("--volume", "-v"),
            "NAME:GUEST[:copy|ro] named volume, or HOST:GUEST[:ro] shared directory.",
            list[str] | None,
            _some,
        ),
        brief='"NAME:GUEST[:copy|ro|shared]" (a named volume), "HOST:GUEST[:ro]", or {source: guest}',
        shown="list | dict | None",
    ),
    BoxOption(
        "labels",
        "Mapping[str, str] | None",
        None,
        "Labels to find the box by (KEY=VALUE).",
        check=_labels,
        keeps=("dict[str, str]", "field(default_factory=dict)"),
        wire=dict[str, str] | None,
        to_wire=_pairs_json,
        flag=Flag(("--label", "-l"), "KEY=VALUE label.", list[str] | None, label_pairs),
    ),
    BoxOption(
        "memory_mib",
        "int",
        DEFAULT_MEMORY_MIB,
        "Guest memory in MiB (at least 64).",
        check=_positive("memory_mib", integer=True, least=64),
        wire=int,
        flag=Flag(("--memory", "-m"), "Guest memory in MiB.", int),
        brief="guest RAM (>= 64)",
    ),
    BoxOption(
        "cpus", "int", 1, "Virtual CPUs.", check=_cpus, wire=int, flag=Flag(("--cpus",), "Virtual CPUs.", int)
    ),
    BoxOption(
        "disk_size_gb",
        "int",
        DEFAULT_DISK_GB,
        "The root disk's size in GiB.",
        check=_positive("disk_size_gb", integer=True),
        wire=int,
        flag=Flag(("--disk",), "Disk size in GiB.", int),
        brief="the box's disk; sparse, costs what is written; grown at first boot",
    ),
    BoxOption(
        "auto_remove",
        "bool",
        False,
        "Remove the box when it stops.",
        check=bool,
        flag=Flag(("--rm",), "Remove the box when it stops (run: when the command ends).", bool),
        brief="remove the box when it stops",
    ),
    BoxOption(
        "keep",
        "bool",
        False,
        "Leave the box when a ``with`` block ends (else it is removed).",
        kind="handle",
        brief="leaving a `with` block leaves the box running",
    ),
    BoxOption(
        "pull",
        "str",
        "missing",
        "When to pull the image: missing, always or never.",
        kind="request",
        check=_pull,
        wire=Literal["missing", "always", "never"] | None,
        flag=Flag(("--pull",), "missing, always or never.", str),
        brief='"missing" | "always" | "never"',
    ),
    BoxOption(
        "insecure",
        "bool",
        False,
        "Allow plain HTTP to the registry.",
        kind="request",
        wire=bool | None,
        flag=Flag(("--insecure",), "Allow plain HTTP to the registry.", bool),
        brief="allow plain HTTP to a non-loopback registry",
    ),
    BoxOption(
        "ca_cert",
        "str | os.PathLike[str] | None",
        None,
        "A PEM file of CA certificates to trust for the registry.",
        kind="request",
        wire=str | None,
        to_wire=_path_json,
        admin=True,
        brief="trust this CA for the registry",
    ),
    BoxOption(
        "credentials",
        "tuple[str, str] | None",
        None,
        "The registry's user name and password.",
        kind="request",
        brief="else ~/.docker/config.json",
    ),
    BoxOption(
        "engine",
        "str | None",
        None,
        "qemu (a microVM), gvisor (a user-space kernel) or auto (default: $SANDLOT_ENGINE, else qemu).",
        check=engine_choice.requested,
        keeps=("str", '"qemu"'),
        flag=Flag(
            ("--engine",),
            "qemu (a microVM), gvisor (a user-space kernel, runsc) or auto (the best "
            "one this host runs); default: $SANDLOT_ENGINE, else qemu.",
            str | None,
            _engine_flag,
            _engines,
        ),
        brief='"qemu", "gvisor" or "auto"; None: $SANDLOT_ENGINE, else "qemu"',
    ),
    BoxOption(
        "accel",
        "str",
        "auto",
        "QEMU's accelerator: auto, kvm or tcg.",
        check=_accel,
        flag=Flag(("--accel",), "QEMU's accelerator: auto, kvm or tcg.", str),
        brief='"auto" | "kvm" | "tcg"',
    ),
    BoxOption(
        "kernel",
        "str | os.PathLike[str] | None",
        None,
        "A guest kernel to boot instead of sandlot's.",
        check=lambda v: str(v) if v else None,
        keeps=("str | None", "None"),
        wire=str | None,
        to_wire=_path_json,
        admin=True,
        brief="default: $SANDLOT_KERNEL or the distro cloud kernel",
    ),
    BoxOption(
        "hostname",
        "str | None",
        None,
        "The guest's host name.",
        check=_hostname,
        wire=str | None,
        brief="default: sandlot-<id>",
    ),
    BoxOption(
        "timezone",
        "str | None",
        None,
        "The time zone of the box's commands: their $TZ, an IANA name (Europe/Paris, read from the "
        "image's /usr/share/zoneinfo) or a POSIX one (UTC-3). Default: UTC.",
        check=_timezone,
        wire=str | None,
        flag=Flag(("--tz",), "Time zone of the box's commands: Europe/Paris, UTC-3...", str | None),
        brief='the commands\' $TZ: "Europe/Paris" (the image\'s zoneinfo) or "UTC-3"; default UTC',
    ),
    BoxOption(
        "boot_timeout",
        "float | None",
        None,
        "Seconds a boot may take (default: $SANDLOT_BOOT_TIMEOUT, else 30 under TCG, 15 under KVM).",
        check=_positive("boot_timeout"),
        wire=float | None,
        brief="default 30 s under TCG, 15 s under KVM",
    ),
    BoxOption(
        "request_timeout",
        "float",
        30.0,
        "Seconds a call to the guest's agent may take.",
        check=_positive("request_timeout"),
        wire=float,
        brief="deadline of every non-exec guest request",
    ),
    BoxOption(
        "idle_timeout",
        "float | None",
        None,
        "Suspend the box after this many seconds without requests or open connections.",
        check=_positive("idle_timeout"),
        wire=float | None,
        flag=Flag(
            ("--idle-timeout",),
            "Suspend the box after this many seconds without requests or open connections.",
            float | None,
            min=0.001,
        ),
        brief="suspend after this many idle seconds (see Live state)",
    ),
    BoxOption(
        "network",
        "str | bool | None",
        None,
        "none (the default: no network card), public, allowlist or open (see sandlot.net.policy).",
        keeps=("str", '"none"'),
        wire=str | bool | None,
        flag=Flag(
            ("--network",), "none (the default: no network card), public, allowlist or open.", str | None
        ),
        brief='"none" (default) | "public" (True) | "allowlist" | "open"',
    ),
    BoxOption(
        "allow",
        "Sequence[str] | str | None",
        None,
        "What an allowlist lets the box reach: NAME, *.DOMAIN, ADDRESS or NETWORK, each [:PORT].",
        keeps=("list[str]", A_LIST),
        wire=list[str] | None,
        to_wire=_allow_json,
        flag=Flag(
            ("--allow",),
            "NAME, *.DOMAIN, ADDRESS or NETWORK[:PORT] the box may reach (allowlist).",
            list[str] | None,
            _some,
        ),
        brief="names, *.domains, addresses, networks, each [:PORT]",
        shown="list[str] | str | None",
    ),
    BoxOption(
        "ports",
        "Sequence[PortSpec] | None",
        None,
        "Guest TCP ports published on the host: GUEST, HOST:GUEST or ADDRESS:HOST:GUEST.",
        keeps=("list[Port]", A_LIST),
        wire=list[PortIn] | None,
        to_wire=_ports_json,
        from_wire=_ports_of_json,
        flag=Flag(
            ("--publish", "-p"),
            "[ADDRESS:]HOST:GUEST, or GUEST: a guest TCP port on the host.",
            list[str] | None,
            _some,
        ),
        brief='published TCP ports: 8000, "8080:80", ("0.0.0.0", 8080, 80)',
        shown="list | None",
    ),
    BoxOption(
        "wake_on_traffic",
        "bool",
        False,
        "Keep the published ports open while the box sleeps: a connection wakes it.",
        check=_boolean("wake_on_traffic"),
        wire=bool,
        flag=Flag(
            ("--wake-on-traffic",),
            "Keep its published ports open while it sleeps: a connection wakes it.",
            bool,
        ),
        brief="its ports stay open while it sleeps, and a connection wakes it (see Network)",
    ),
    BoxOption(
        "pids_limit",
        "int | None",
        None,
        "Processes all commands together may have (at least 8).",
        check=_positive("pids_limit", integer=True, least=8),
        wire=int | None,
        brief="processes all commands together may have (a fork bomb stops there)",
    ),
    BoxOption(
        "nested_virt",
        "bool",
        False,
        "The box runs VMs of its own: /dev/kvm in it (qemu engine).",
        check=_boolean("nested_virt"),
        wire=bool,
        flag=Flag(("--nested-virt",), "The box runs VMs of its own: /dev/kvm in it (qemu engine).", bool),
        brief="VMs of its own: /dev/kvm in the box (see Nested virtualization)",
    ),
    BoxOption(
        "containers",
        "bool",
        False,
        "The box runs a container engine (Docker, Podman): its kernel's modules loaded, and the image's "
        "dockerd started (qemu engine).",
        check=_boolean("containers"),
        wire=bool,
        flag=Flag(
            ("--containers",),
            "The box runs a container engine (Docker, Podman): its kernel's "
            "modules loaded, and the image's dockerd started (qemu engine).",
            bool,
        ),
        brief="Docker and Podman in the box: their kernel modules, dockerd started (docs/containers.md)",
    ),
    BoxOption(
        "aslr",
        "bool | None",
        None,
        "Address-space randomization of the box's processes (None: on, or as its saved state had it).",
        check=_boolean("aslr", optional=True),
        keeps=("bool", "True"),
        wire=bool | None,
        flag=Flag(
            ("--aslr/--no-aslr",),
            "Address-space randomization of the box's processes (default "
            "on; off makes each program start faster under TCG; qemu engine).",
            bool | None,
        ),
        brief="address-space randomization; None: on, or as a saved state had it (see below)",
    ),
    BoxOption(
        "secrets",
        "Sequence[Secret] | None",
        None,
        "Values the box may use but never see, swapped in on HTTPS to their hosts (sandlot.Secret).",
        keeps=("list[dict[str, Any]]", A_LIST),
        wire=list[SecretIn] | None,
        to_wire=_secrets_json,
        from_wire=_secrets_of_json,
        flag=Flag(
            ("--secret",),
            "NAME@HOST[,HOST]: $NAME of this shell, swapped in for a placeholder "
            "only on HTTPS to those hosts; the box never holds it.",
            list[str] | None,
            secret_flags,
        ),
        brief="values the box uses without holding them (see Secrets)",
        shown="list[Secret] | None",
    ),
    BoxOption(
        "template",
        "Any",
        None,
        "A template or snapshot (or its name) to start from; False: none, not even the image's "
        "automatic template.",
        kind="request",
        wire=str | None,
        brief="start from a template or snapshot (False: no automatic one)",
        shown="str | Snapshot | None",
    ),
    BoxOption(
        "record",
        "bool | Mapping[str, Any]",
        False,
        "Record every step from the first start: True, or box.record()'s arguments.",
        kind="handle",
        brief="the flight recorder from the first start; a dict: record()'s arguments",
        shown="bool | dict",
    ),
    BoxOption(
        "home",
        "Home",
        None,
        "The home the box lives in (default: $SANDLOT_HOME).",
        kind="handle",
        brief="default $SANDLOT_HOME or ~/.local/share/sandlot",
        shown="str | PathLike | None",
    ),
)
BY_NAME: dict[str, BoxOption] = {o.name: o for o in OPTIONS}
assert len(BY_NAME) == len(OPTIONS), "one declaration per option"

# the options of the box itself (BoxSpec's), with their defaults
SPEC_OPTIONS: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.kind == "box")
SPEC_DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS if o.kind == "box"}
# what AsyncBox hands its backend to describe a box: the box's options and the request's
DESCRIBED: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.kind != "handle")
# how a box is made (``BoxRequest.build``'s keywords), beside what it starts from (``template``)
REQUEST_OPTIONS: tuple[str, ...] = tuple(
    o.name for o in OPTIONS if o.kind == "request" and o.name != "template"
)
