"""Whether gVisor really works on this host: what ``engine="auto"`` and ``doctor`` ask.

A ``runsc`` on the PATH is not enough (a container without the rights runsc needs, a
kernel that refuses its ptrace or seccomp use): the answer is a probe sandbox that
runs ``true``, cached per host boot and runsc binary, as the KVM probe is.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from ...errors import HostSetupError
from . import runsc

PROBE_FILE = "gvisor-probe.json"
PROBE_TIMEOUT_S = 30.0


def _host_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def prerequisites() -> str | None:
    """None where the host has what the engine needs before any sandbox runs; else why not."""
    if os.geteuid() != 0:
        return (
            "not root: the box's overlay root and its host cgroups need root (runsc --rootless has neither)"
        )
    try:
        if "overlay" not in Path("/proc/filesystems").read_text():
            return "the host kernel has no overlayfs"
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc}"
    try:
        runsc.runsc_binary()
    except HostSetupError as exc:
        return str(exc)
    return None


def run_probe(binary: str, platform: str) -> str | None:
    """Run ``true`` in a throwaway sandbox (``runsc do``: the host's root, read-only, no
    network). None if it ran; else runsc's last words."""
    with tempfile.TemporaryDirectory(prefix="sandlot-runsc-probe-") as tmp:
        argv = [binary, f"--root={tmp}/state", f"--platform={platform}", "--network=none", "do", "true"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, cwd=tmp)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"a probe sandbox did not finish within {PROBE_TIMEOUT_S:.0f} s"
        except OSError as exc:
            return f"runsc could not be run: {exc}"
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        return f"a probe sandbox failed (runsc exit {proc.returncode}): {said[-1] if said else 'no output'}"
    return None


def why_unusable(home: Path) -> str | None:
    """None where gVisor boxes can run here; else why not (a probe sandbox the first
    time per host boot and runsc binary; the answer is kept in the home)."""
    blocker = prerequisites()
    if blocker is not None:
        return blocker
    binary = runsc.runsc_binary()
    version = runsc.runsc_version(binary)
    platform = runsc.platform_for(version)
    try:
        st = os.stat(binary)
        key = f"{_host_boot_id()}:{binary}:{st.st_size}:{st.st_mtime_ns}:{version}:{platform}"
    except OSError as exc:
        return f"runsc at {binary}: {exc}"
    cache = home / PROBE_FILE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return str(cached["why"]) if cached.get("why") else None
    except (OSError, ValueError, AttributeError):
        pass
    why = run_probe(binary, platform)
    try:
        home.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{PROBE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "why": why}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home: probe again next time
    return why
