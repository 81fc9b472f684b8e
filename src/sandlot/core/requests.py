"""A box to create, as a user described it: validated when it is described, made
into a ``BoxSpec`` when it is created (a box started from a saved state takes
that state's shape, environment and network where the user did not say)."""

from __future__ import annotations

import os
import secrets as random_ids
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument
from ..net.secrets import Secret
from .option_values import Mount, Volume
from .options import DEFAULT_DISK_GB, DEFAULT_MEMORY_MIB, PULL_POLICIES, SPEC_DEFAULTS, SPEC_OPTIONS
from .spec import BoxSpec
from .store import SnapshotRecord

if TYPE_CHECKING:
    from ..images.store import Image


@dataclass
class BoxRequest:
    """Everything ``AsyncBox(...)`` was given. ``template``: a snapshot or template
    to start from (an id, name or row), False for none (not even the image's
    automatic template), None for the automatic template if there is one."""

    image_ref: str | None
    image: Image | None
    options: dict[str, Any]
    secrets: list[Secret]
    template: str | SnapshotRecord | bool | None
    pull: str = "missing"
    pull_options: dict[str, Any] = field(default_factory=dict)
    keep: bool = False
    id: str = field(default_factory=lambda: random_ids.token_hex(6))
    name: str = ""
    pool: str | None = None  # a VM for the warm pool of this template (core.pools), not a box

    @classmethod
    def build(
        cls,
        image: str | Image | None,
        options: Mapping[str, Any],
        *,
        template: str | SnapshotRecord | bool | None = None,
        keep: bool = False,
        pull: str = "missing",
        insecure: bool = False,
        ca_cert: str | os.PathLike[str] | None = None,
        credentials: tuple[str, str] | None = None,
    ) -> BoxRequest:
        """``options``: the box's own (``SPEC_OPTIONS``, declared in ``core/options.py``);
        the rest says where it starts from and how its image is fetched."""
        from ..images.store import Image  # not at the top: commands on an existing box never build one

        unknown = sorted(set(options) - set(SPEC_OPTIONS))
        if unknown:
            raise InvalidArgument(f"unknown box option(s): {', '.join(unknown)}")
        if pull not in PULL_POLICIES:
            raise InvalidArgument(f"pull must be 'missing', 'always' or 'never', not {pull!r}")
        if template is True:
            raise InvalidArgument("template= takes a template or snapshot (or its name), or False")
        req = cls(
            image_ref=image.digest if isinstance(image, Image) else image,
            image=image if isinstance(image, Image) else None,
            options=dict(options),
            secrets=list(options.get("secrets") or []),
            template=template,
            pull=pull,
            pull_options={
                "insecure": insecure,
                "ca_cert": Path(ca_cert) if ca_cert else None,
                "credentials": credentials,
            },
            keep=keep,
        )
        # every argument is checked now, before anything is made (against the saved state,
        # if it is given as an object; one given by name is looked up when the box is made)
        spec = req.spec_for(template if isinstance(template, SnapshotRecord) else None)
        req.name = spec.name or f"box-{req.id[:6]}"
        return req

    @property
    def saved(self) -> bool:
        return self.template is not None and self.template is not False

    def spec_for(self, snap: SnapshotRecord | None) -> BoxSpec:
        """The box's spec; from saved state ``snap``, its shape and (unless given anew)
        the environment, working directory, user and network policy it was saved with."""
        o = {**SPEC_DEFAULTS, **self.options}
        image_ref = self.image_ref
        if snap is None and self.saved and o["network"] is None and o["allow"] is None:
            o["network"] = "allowlist"  # unknown until the saved state is looked up: the lenient one
        if snap is not None:
            saved_box, facts = snap.options.get("box", {}), snap.facts
            if image_ref is None and o["rootfs"] is None:
                image_ref, o["rootfs"] = snap.options.get("image_ref"), snap.options.get("rootfs")
            # its shape, unless asked for another (which check_fits refuses)
            if o["memory_mib"] == DEFAULT_MEMORY_MIB:
                o["memory_mib"] = facts["memory_mib"]
            if o["cpus"] == 1:
                o["cpus"] = facts["cpus"]
            if o["disk_size_gb"] == DEFAULT_DISK_GB:
                o["disk_size_gb"] = saved_box.get("disk_size_gb", DEFAULT_DISK_GB)
            # its KVM modules are loaded in the saved memory: a box from it has them
            o["nested_virt"] = bool(o["nested_virt"] or saved_box.get("nested_virt"))
            o["containers"] = bool(o["containers"] or saved_box.get("containers"))  # and these modules
            if o["engine"] in (None, "auto"):  # a saved state runs on the engine that saved it
                o["engine"] = facts.get("engine", "qemu")
            # An automatic template is sandlot's saved boot of an image or tree, standing in
            # for a new box's boot: the box it was saved of chose its own limits, randomization,
            # environment, user and network, and none of them is a later box's (its key holds
            # what the boot fixed). Any other saved state is the same box going on.
            if snap.template_key is None:
                if o["pids_limit"] is None:
                    o["pids_limit"] = saved_box.get("pids_limit")
                if o["aslr"] is None:  # as it was saved, unless given anew (every HELLO sets it)
                    o["aslr"] = saved_box.get("aslr", True)
                # what its commands ran with, unless given anew: a fork is the same box
                for key in ("env", "workdir", "user"):
                    if o[key] is None:
                        o[key] = saved_box.get(key)
                if o["network"] is None and o["allow"] is None:  # its policy too (its ports stay its own)
                    o["network"] = saved_box.get("network", "none")
                    o["allow"] = saved_box.get("allow") or None
        spec = BoxSpec.build(
            image_ref,
            saved_secrets=(snap.options.get("box", {}).get("secrets", []) if snap else ()),
            saved=self.saved,
            **o,
        )
        spec.pool = self.pool
        if snap is not None:
            check_fits(snap, spec)
            spec.image_config = snap.options.get("box", {}).get("image_config")
            # its named volumes are mounted in the saved memory: a box from it has its copies;
            # and its shares, the same host directories (which must still be there)
            spec.mounts = [Mount(*m) for m in snap.options.get("box", {}).get("mounts", [])]
            spec.volumes = shares_from(snap, spec.volumes)
        return spec


def shares_from(snap: SnapshotRecord, given: list[Volume]) -> list[Volume]:
    """The shares of a box started from ``snap``: those it was saved with (they are
    mounted in its saved memory), each the same directory; or, for a host directory an
    archive could not carry, the one given now (``given``) at that guest path."""
    label = snap.name or snap.id
    mine = {v.guest: v for v in given}
    out = []
    for item in snap.options.get("box", {}).get("volumes", []):
        host, guest, readonly = str(item[0]), str(item[1]), bool(item[2])
        asked = mine.pop(guest, None)
        if not host:
            if asked is None:
                raise InvalidArgument(
                    f"snapshot {label} shared a host directory at {guest}, which its archive does not carry: "
                    f"give the directory to share there, volumes={{'/a/host/dir': {guest!r}}}"
                )
            out.append(Volume(asked.host, guest, readonly or asked.readonly))
        elif asked is not None and (asked.host, asked.readonly) != (host, readonly):
            raise InvalidArgument(f"snapshot {label} shares {host} at {guest}: a box from it shares the same")
        else:
            out.append(Volume.saved(item))
    if mine:
        raise InvalidArgument(
            f"snapshot {label} shares nothing at {', '.join(mine)}: a box started from it has the shares it "
            "was saved with, and no others"
        )
    return out


def check_fits(snap: SnapshotRecord, spec: BoxSpec) -> None:
    """A box started from a saved state has the shape of that state."""
    facts = snap.facts
    label = snap.name or snap.id
    if spec.memory_mib != facts["memory_mib"] or spec.cpus != facts["cpus"]:
        raise InvalidArgument(
            f"snapshot {label} is of a box with {facts['memory_mib']} MiB and {facts['cpus']} CPU(s); "
            f"a box started from it cannot have {spec.memory_mib} MiB and {spec.cpus}"
        )
    saved_mounts = [m[:3] for m in snap.options.get("box", {}).get("mounts", [])]
    asked = [[m.volume, m.guest, m.mode] for m in spec.mounts]  # a mode of "": the saved one
    if spec.mounts and (
        len(asked) != len(saved_mounts)
        or any(a[:2] != s[:2] or a[2] not in ("", s[2]) for a, s in zip(asked, saved_mounts, strict=False))
    ):
        raise InvalidArgument(
            f"snapshot {label} has its own named volumes ({saved_mounts or 'none'}): a box started from it "
            "mounts copies of those as they were, and no others"
        )
    if spec.nested_virt and not snap.options.get("box", {}).get("nested_virt"):
        raise InvalidArgument(
            f"snapshot {label} is of a box without nested virtualization (its kernel booted without "
            "KVM); a box started from it cannot have nested_virt=True"
        )
    if spec.containers and not snap.options.get("box", {}).get("containers"):
        raise InvalidArgument(
            f"snapshot {label} is of a box without containers=True (its kernel booted without the "
            "modules a container engine needs); a box started from it cannot have containers=True"
        )
    saved_nic = bool(facts.get("network"))
    if spec.policy.has_nic != saved_nic:
        had = "a network card" if saved_nic else "no network card"
        hint = " (any other mode; 'allowlist' with no entries lets nothing out)" if saved_nic else ""
        raise InvalidArgument(
            f"snapshot {label} is of a box with {had}; a box started from it cannot have "
            f"network={spec.network!r}{hint}"
        )
