"""Kernel samepage merging (KSM) of box memory: whether the host runs it, what it
saves, and turning it on (``sandlot setup --ksm``).

Boxes started from one template share the template's saved RAM as page cache
already (a private mapping of the same file); what each box then writes is its own
anonymous memory, and much of it is the same in every box: the pages a restored
guest's first commands touch, the kernel's own bookkeeping. QEMU marks a box's RAM
mergeable (``madvise(MADV_MERGEABLE)``: its ``mem-merge``, on for every box), so
where the host's ``ksmd`` runs, identical pages across boxes are kept once. It is
a host-wide setting that only root may change, and it costs ``ksmd``'s scanning
(a share of one core while there are new pages to scan), so sandlot never turns it
on by itself: ``sandlot doctor`` says whether it is on and what it saves, and
``sandlot setup --ksm`` turns it on with the user's say-so, until the host reboots.

What it gives (measured under TCG, ``benchmarks/density.py --ksm``): boxes booted from
one image share most of their RAM, their kernels and page caches alike (20 boxes:
126 -> 77 MiB PSS each, 3.8 s of ksmd's CPU to get there); boxes started from a
template share it through the page cache already, and KSM finds ~1 MiB more each.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from .errors import HostSetupError

KSM_DIR = Path("/sys/kernel/mm/ksm")
RUN_STATES = {0: "off", 1: "on", 2: "off (unmerging)"}


def _read(name: str, where: Path) -> int | None:
    try:
        return int((where / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def status(where: Path = KSM_DIR) -> dict[str, Any]:
    """``{"available", "on", "state", "saved_mib", "pages_sharing", "why"}``; never raises."""
    run = _read("run", where)
    if run is None:
        return {"available": False, "on": False, "state": "unavailable",
                "why": f"the host kernel has no KSM ({where} is missing: CONFIG_KSM)"}  # fmt: skip
    sharing = _read("pages_sharing", where) or 0
    page = os.sysconf("SC_PAGE_SIZE")
    report: dict[str, Any] = {
        "available": True,
        "on": run == 1,
        "state": RUN_STATES.get(run, str(run)),
        "pages_sharing": sharing,
        "saved_mib": round(sharing * page / (1 << 20), 1),
    }
    if run != 1:
        report["why"] = (
            "identical pages of boxes are not merged (booted boxes would share ~40% of their RAM): "
            "`sandlot setup --ksm` turns it on (as root)"
        )
    return report


def enable_command(where: Path = KSM_DIR) -> str:
    """What a user types to turn KSM on."""
    sudo = "" if os.geteuid() == 0 else "sudo "
    return f"echo 1 | {sudo}tee {where / 'run'}"


def enable(where: Path = KSM_DIR) -> dict[str, Any]:
    """Turn KSM on (as root, or with a sudo that asks no password); the new status, or
    HostSetupError with the reason and the command to run instead."""
    before = status(where)
    if not before["available"]:
        raise HostSetupError(f"cannot turn KSM on: {before['why']}")
    if before["on"]:
        return before
    run = where / "run"
    try:
        if os.geteuid() == 0:
            run.write_text("1\n")
        else:
            proc = subprocess.run(["sudo", "-n", "tee", str(run)], input="1\n", capture_output=True,
                                  text=True, timeout=30)  # fmt: skip
            if proc.returncode != 0:
                raise HostSetupError(
                    f"turning KSM on needs root (sudo -n: {proc.stderr.strip() or 'refused'}): "
                    f"run `{enable_command(where)}`"
                )
    except (OSError, subprocess.SubprocessError) as exc:
        raise HostSetupError(f"cannot write {run}: {exc}; run `{enable_command(where)}`") from exc
    after = status(where)
    if not after["on"]:
        raise HostSetupError(f"{run} says {after['state']} after writing 1")
    return after
