"""The values of a box's options that are more than a scalar: host directories and
named volumes mounted in it (``Volume``, ``Mount``) and its published ports
(``Port``), each parsed from what a user writes and checked once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..net.policy import parse_ip
from .validate import guest_path

# microvm has 8 virtio-mmio transports: the agent's serial ports, the root disk, the
# balloon and the network card take up to 4, which leaves 4 for volumes (the disks of
# named ones and the shares of host directories)
MAX_MOUNTS = 4

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
