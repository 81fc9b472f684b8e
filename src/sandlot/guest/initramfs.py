"""Build the guest initramfs: a newc cpio holding the agent as ``/init`` and the
kernel modules it loads, optionally LZ4-compressed (legacy framing, as the
kernel's RD_LZ4 expects).

Written in Python rather than with cpio(1) so the archive is reproducible
(fixed inode numbers, owners and times) and can hold /dev/console without root.
Cached by content under ``$SANDLOT_HOME/initramfs/``.
"""

from __future__ import annotations

import hashlib
import shutil
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..config import atomic_write
from ..errors import HostSetupError

COMPRESSIONS = ("none", "lz4")


@dataclass(frozen=True, slots=True)
class Entry:
    name: str  # path inside the archive, without a leading "/"
    mode: int  # full st_mode, type bits included
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def _pad4(n: int) -> bytes:
    return b"\0" * (-n & 3)


def _header(ino: int, entry: Entry, namesize: int) -> bytes:
    fields = (
        ino,
        entry.mode,
        0,  # uid
        0,  # gid
        2 if stat.S_ISDIR(entry.mode) else 1,
        0,  # mtime: fixed for reproducibility
        len(entry.data),
        0,
        0,
        entry.rdev[0],
        entry.rdev[1],
        namesize,
        0,
    )
    return b"070701" + b"".join(f"{v:08x}".encode() for v in fields)


def write_newc(entries: Iterable[Entry]) -> bytes:
    """Serialize entries as a newc cpio archive (with the trailer)."""
    out = bytearray()
    ino = 1
    for entry in [*entries, Entry("TRAILER!!!", 0)]:
        name = entry.name.encode() + b"\0"
        hdr = _header(ino if entry.name != "TRAILER!!!" else 0, entry, len(name))
        out += hdr + name + _pad4(len(hdr) + len(name))
        out += entry.data + _pad4(len(entry.data))
        ino += 1
    return bytes(out)


def parse_newc(data: bytes) -> list[Entry]:
    """Read a newc archive back (used by tests and ``sandlot doctor``)."""
    entries: list[Entry] = []
    pos = 0
    while True:
        if data[pos : pos + 6] != b"070701":
            raise ValueError(f"bad cpio magic at offset {pos}")
        f = [int(data[pos + 6 + i * 8 : pos + 14 + i * 8], 16) for i in range(13)]
        mode, filesize, rmaj, rmin, namesize = f[1], f[6], f[9], f[10], f[11]
        name_start = pos + 110
        name = data[name_start : name_start + namesize - 1].decode()
        data_start = name_start + namesize + (-(110 + namesize) & 3)
        if name == "TRAILER!!!":
            return entries
        body = data[data_start : data_start + filesize]
        entries.append(Entry(name, mode, body, (rmaj, rmin)))
        pos = data_start + filesize + (-filesize & 3)


def lz4_legacy(data: bytes) -> bytes:
    if not shutil.which("lz4"):
        raise HostSetupError("lz4 compression of the initramfs needs the lz4 tool")
    proc = subprocess.run(["lz4", "-l", "-9", "-c"], input=data, capture_output=True)
    if proc.returncode != 0:
        raise HostSetupError(f"lz4 failed: {proc.stderr.decode(errors='replace')}")
    return proc.stdout


def agent_entries(agent: bytes, modules: list[tuple[str, bytes]]) -> list[Entry]:
    d = stat.S_IFDIR | 0o755
    entries = [
        Entry("dev", d),
        Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        Entry("proc", d),
        Entry("sys", d),
        Entry("newroot", d),
        Entry("sandlot", d),
        Entry("sandlot/modules", d),
        Entry("init", stat.S_IFREG | 0o755, agent),
    ]
    for name, blob in modules:
        entries.append(Entry(f"sandlot/modules/{name}.ko", stat.S_IFREG | 0o644, blob))
    order = "".join(f"{name}.ko\n" for name, _ in modules).encode()
    entries.append(Entry("sandlot/modules.order", stat.S_IFREG | 0o644, order))
    return entries


def build_initramfs(
    cache_dir: Path, agent: Path, modules: list[tuple[str, Path]], compression: str = "none"
) -> Path:
    """Return the path of an initramfs holding ``agent`` as /init and ``modules`` in load order."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}")
    blobs = [(name, path.read_bytes()) for name, path in modules]
    agent_bytes = agent.read_bytes()
    h = hashlib.sha256(compression.encode())
    h.update(hashlib.sha256(agent_bytes).digest())
    for name, blob in blobs:
        h.update(name.encode() + b"\0" + hashlib.sha256(blob).digest())
    out = cache_dir / f"{h.hexdigest()[:24]}.cpio{'.lz4' if compression == 'lz4' else ''}"
    if out.exists():
        return out
    archive = write_newc(agent_entries(agent_bytes, blobs))
    if compression == "lz4":
        archive = lz4_legacy(archive)
    atomic_write(out, archive)
    return out
