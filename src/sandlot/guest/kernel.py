"""The guest kernel: fetch the distro's cloud kernel, or take the user's, and
turn it into what QEMU's microvm boots directly: an uncompressed PVH ``vmlinux``
plus the few modules the guest needs.

Default source: the Debian/Ubuntu package behind ``linux-image-cloud-amd64``,
fetched with ``apt-get download`` (never installed on the host). Override with
``SANDLOT_KERNEL=/path/to/vmlinux-or-bzImage`` (and ``SANDLOT_KERNEL_MODULES``
pointing at its ``lib/modules/<version>`` tree if it needs modules).

Cached under ``$SANDLOT_HOME/kernels/<id>/`` with a ``kernel.json`` manifest;
the directory appears atomically, complete or not at all.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import lzma
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..config import atomic_dir, atomic_write, sha256_file
from ..errors import HostSetupError

log = logging.getLogger("sandlot")

# The cloud flavour boots faster and is smaller; the generic one also has 9p (volumes).
META_PACKAGES = {"cloud": "linux-image-cloud-amd64", "generic": "linux-image-amd64"}

# Modules the guest may load, by need. Their dependencies come from modules.dep.
# Built-in in one kernel flavour, modules in another: whatever this kernel has as a
# module is loaded (with its dependencies); what is built in needs nothing.
# (ext4 asks the crypto API for crc32c, which cannot load modules on its own here)
# virtio_pci carries the agent ports (their queues are smaller on PCI: see the QEMU
# engine's device sets); virtio_balloon reports the pages the guest frees (free page
# reporting), which QEMU then gives back to the host: an idle box does not keep what its
# programs once used. A kernel without either boots all the same (the engine asks).
BASE_MODULES: tuple[str, ...] = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_console",
    "virtio_blk",
    "crc32c_generic",
    "ext4",
    "virtio_balloon",
)
OPTIONAL_MODULES: tuple[str, ...] = ("virtio_net", "virtio_rng", "overlay", "fuse", "virtiofs")
OPTIONAL_MODULES += ("vmw_vsock_virtio_transport", "9p", "9pnet_virtio")
OPTIONAL_MODULES += ("kvm", "kvm_amd", "kvm_intel")  # nested virtualization: a box's own VMs
# What a container engine in a box (containers=True) asks of its kernel: overlayfs for
# image layers; a bridge, veth pairs and br_netfilter for its networks; nf_tables and the
# iptables matches and targets Docker's rules use (Debian's iptables is iptables-nft),
# NAT for published ports and outgoing traffic; tun for rootless networking (slirp4netns,
# pasta). Their dependencies (x_tables, nf_conntrack, stp, llc...) come with them.
CONTAINER_MODULES: tuple[str, ...] = (
    "overlay", "bridge", "br_netfilter", "veth", "tun",
    "nf_tables", "nft_compat", "nft_chain_nat", "nft_nat", "nft_masq", "nft_ct", "nf_conntrack_netlink",
    "ip_tables", "iptable_filter", "iptable_nat", "ip6_tables", "ip6table_filter", "ip6table_nat",
    "xt_conntrack", "xt_MASQUERADE", "xt_addrtype", "xt_nat", "xt_tcpudp", "xt_comment", "xt_mark",
    "ipt_REJECT", "ip6t_REJECT",
)  # fmt: skip
OPTIONAL_MODULES += CONTAINER_MODULES

_XEN_ELFNOTE_PHYS32_ENTRY = 18
MODULE_SIGNATURE_MARK = b"~Module signature appended~\n"  # the kernel's own tail of a signed .ko
DOWNLOAD_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class Kernel:
    """A prepared kernel: ``vmlinux`` plus ``modules`` (name -> file) in load order."""

    root: Path
    vmlinux: Path
    version: str
    sha256: str
    modules: dict[str, Path]
    deps: dict[str, list[str]]
    source: str

    def modules_signed(self) -> bool:
        """Whether this kernel has modules and every one carries a signature: a kernel in
        lockdown loads no unsigned module (a custom kernel's own builds seldom are)."""
        if not self.modules:
            return False
        for path in self.modules.values():
            try:
                with path.open("rb") as f:
                    f.seek(-len(MODULE_SIGNATURE_MARK), os.SEEK_END)
                    if f.read() != MODULE_SIGNATURE_MARK:
                        return False
            except OSError:
                return False
        return True

    def load_order(self, wanted: tuple[str, ...] = BASE_MODULES) -> list[str]:
        """Wanted modules (those this kernel has) and their dependencies, dependencies first."""
        order: list[str] = []
        seen: set[str] = set()

        def visit(name: str, depth: int = 0) -> None:
            if name in seen or name not in self.modules or depth > 64:
                return
            seen.add(name)
            for dep in self.deps.get(name, []):
                visit(dep, depth + 1)
            order.append(name)

        for name in wanted:
            visit(name)
        return order


def _norm(name: str) -> str:
    return name.replace("-", "_")


def _module_name(path: str) -> str:
    base = os.path.basename(path)
    for suffix in (".ko.xz", ".ko.zst", ".ko.gz", ".ko"):
        if base.endswith(suffix):
            return _norm(base[: -len(suffix)])
    return _norm(base)


# ---- bzImage -> vmlinux -------------------------------------------------------------------


def _has_pvh_note(elf: bytes) -> bool:
    """True if the ELF carries XEN_ELFNOTE_PHYS32_ENTRY (the PVH entry QEMU needs)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return False
    (e_phoff,) = struct.unpack_from("<Q", elf, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", elf, off)
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == _XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            pos += 12 + ((namesz + 3) & ~3) + ((descsz + 3) & ~3)
    return False


def copy_loadable(vmlinux: Path, dest: Path) -> None:
    """Write a copy of ``vmlinux`` holding only what a loader reads: the ELF header,
    the program headers and the segments they name, at their offsets (the rest is a
    hole). It has no section headers, so a loader finds no symbol table to keep
    (QEMU reads one into its heap for its disassembler)."""
    with open(vmlinux, "rb") as src, open(dest, "wb") as out:
        ident = os.pread(src.fileno(), 64, 0)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise HostSetupError(f"{vmlinux} is not a 64-bit little-endian ELF kernel")
        (e_phoff,) = struct.unpack_from("<Q", ident, 0x20)
        e_phentsize, e_phnum = struct.unpack_from("<HH", ident, 0x36)
        table = os.pread(src.fileno(), e_phentsize * e_phnum, e_phoff)
        if e_phentsize < 56 or len(table) != e_phentsize * e_phnum:
            raise HostSetupError(f"{vmlinux}: its program headers are cut short")
        header = bytearray(ident)
        struct.pack_into("<Q", header, 0x28, 0)  # e_shoff
        struct.pack_into("<HH", header, 0x3C, 0, 0)  # e_shnum, e_shstrndx
        out.write(header)
        os.pwrite(out.fileno(), table, e_phoff)
        for i in range(e_phnum):
            entry = struct.unpack_from("<IIQQQQ", table, i * e_phentsize)
            p_type, p_offset, p_filesz = entry[0], entry[2], entry[5]
            if p_type in (1, 4) and p_filesz:  # PT_LOAD, PT_NOTE
                _copy_range(src.fileno(), out.fileno(), p_offset, p_filesz)


def _copy_range(src: int, dst: int, offset: int, size: int) -> None:
    """Copy ``size`` bytes at ``offset`` to the same offset, in the kernel where it can."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, size - done, offset + done, offset + done)
        except OSError:  # another filesystem, or no copy_file_range: through a buffer
            n = os.pwrite(dst, os.pread(src, min(size - done, 1 << 22), offset + done), offset + done)
        if n <= 0:
            raise HostSetupError(f"the kernel image ended early, at byte {offset + done}")
        done += n


def _decompress(payload: bytes) -> bytes:
    if payload[:4] == b"\x02\x21\x4c\x18":  # lz4 legacy, as the kernel writes it
        if not shutil.which("lz4"):
            raise HostSetupError("the kernel is LZ4-compressed: install lz4")
        # the kernel appends the uncompressed size (4 bytes) after the lz4 stream
        proc = subprocess.run(["lz4", "-dc"], input=payload[:-4], capture_output=True)
        if not proc.stdout.startswith(b"\x7fELF"):
            proc = subprocess.run(["lz4", "-dc"], input=payload, capture_output=True)
        return proc.stdout
    # the kernel appends the uncompressed size after the stream: decoders must stop at its end
    if payload[:2] == b"\x1f\x8b":
        return zlib.decompressobj(wbits=31).decompress(payload)
    if payload[:6] == b"\xfd7zXZ\x00":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    if payload[:4] == b"\x28\xb5\x2f\xfd":
        if not shutil.which("zstd"):
            raise HostSetupError("the kernel is zstd-compressed: install zstd")
        return subprocess.run(["zstd", "-dc"], input=payload, capture_output=True).stdout
    raise HostSetupError(f"unsupported kernel compression (payload starts with {payload[:6].hex()})")


def to_vmlinux(image: bytes) -> bytes:
    """Return an uncompressed ELF vmlinux from a bzImage, or the input if already ELF."""
    if image[:4] == b"\x7fELF":
        elf = image
    elif len(image) > 0x250 and image[0x202:0x206] == b"HdrS":
        setup_sects = image[0x1F1] or 4
        payload_offset, payload_length = struct.unpack_from("<II", image, 0x248)
        start = (setup_sects + 1) * 512 + payload_offset
        elf = _decompress(image[start : start + payload_length])
        if elf[:4] != b"\x7fELF":
            raise HostSetupError("decompressing the bzImage did not give an ELF vmlinux")
    else:
        raise HostSetupError("kernel image is neither an ELF vmlinux nor a bzImage")
    if not _has_pvh_note(elf):
        raise HostSetupError(
            "the kernel has no PVH entry point (XEN_ELFNOTE_PHYS32_ENTRY); build it with CONFIG_PVH=y"
        )
    return elf


# ---- modules ---------------------------------------------------------------------------------


def _modinfo(ko: bytes) -> dict[str, str]:
    """The ``.modinfo`` section of a module (key=value strings)."""
    if ko[:4] != b"\x7fELF" or ko[4] != 2:
        return {}
    (e_shoff,) = struct.unpack_from("<Q", ko, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", ko, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", ko, e_shoff + i * e_shentsize
        )
        return name, offset, size

    _, str_off, _ = section(e_shstrndx)
    for i in range(e_shnum):
        name_off, offset, size = section(i)
        end = ko.index(b"\0", str_off + name_off)
        if ko[str_off + name_off : end] == b".modinfo":
            info: dict[str, str] = {}
            for item in ko[offset : offset + size].split(b"\0"):
                key, sep, value = item.partition(b"=")
                if sep:
                    info.setdefault(key.decode(), value.decode(errors="replace"))
            return info
    return {}


def _read_ko(path: Path) -> bytes:
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(path.read_bytes())
    if path.name.endswith(".ko.gz"):
        return gzip.decompress(path.read_bytes())
    if path.name.endswith(".ko.zst"):
        return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True).stdout
    return path.read_bytes()


def _read_modules_tree(tree: Path) -> dict[str, Path]:
    """Map module name -> file in a lib/modules/<version> tree. Packages ship no
    modules.dep (depmod makes it at install), so dependencies come from each
    module's own .modinfo."""
    files: dict[str, Path] = {}
    for path in tree.rglob("*.ko*"):
        files[_module_name(path.name)] = path
    return files


def _install_modules(tree: Path, dest: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Copy the wanted modules and their dependencies (uncompressed) into ``dest``."""
    files = _read_modules_tree(tree)
    deps: dict[str, list[str]] = {}
    blobs: dict[str, bytes] = {}

    def visit(name: str) -> None:
        if name in blobs or name not in files:
            return
        blob = _read_ko(files[name])
        blobs[name] = blob
        deps[name] = [_norm(d) for d in _modinfo(blob).get("depends", "").split(",") if d]
        for d in deps[name]:
            visit(d)

    for name in (*BASE_MODULES, *OPTIONAL_MODULES):
        visit(name)
    dest.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    for name, blob in sorted(blobs.items()):
        (dest / f"{name}.ko").write_bytes(blob)
        out[name] = f"modules/{name}.ko"
    return out, deps


# ---- cache -----------------------------------------------------------------------------------


def wanted_modules() -> list[str]:
    """Every module this sandlot may load into a guest."""
    return sorted({*BASE_MODULES, *OPTIONAL_MODULES})


def _load(root: Path) -> Kernel:
    meta = json.loads((root / "kernel.json").read_text())
    return Kernel(
        root=root,
        vmlinux=root / "vmlinux",
        version=meta["version"],
        sha256=meta["sha256"],
        modules={k: root / v for k, v in meta["modules"].items()},
        deps=meta["deps"],
        source=meta["source"],
    )


def _store(final: Path, elf: bytes, version: str, source: str, modules_tree: Path | None) -> Kernel:
    if (final / "kernel.json").exists():
        return _load(final)
    with atomic_dir(final) as tmp:
        (tmp / "vmlinux").write_bytes(elf)
        modules: dict[str, str] = {}
        deps: dict[str, list[str]] = {}
        if modules_tree is not None and modules_tree.exists():
            modules, deps = _install_modules(modules_tree, tmp / "modules")
        meta = {
            "version": version,
            "sha256": sha256_file(tmp / "vmlinux"),
            "modules": modules,
            "deps": deps,
            "source": source,
            "wanted": wanted_modules(),
        }
        (tmp / "kernel.json").write_text(json.dumps(meta, indent=1))
    return _load(final)


def _apt_kernel_package(meta: str) -> str:
    if not shutil.which("apt-get") or not shutil.which("apt-cache"):
        raise HostSetupError(
            "no guest kernel: this host has no apt to fetch the distro cloud kernel; "
            "set SANDLOT_KERNEL to a vmlinux or bzImage built with CONFIG_PVH=y"
        )
    proc = subprocess.run(["apt-cache", "depends", meta], capture_output=True, text=True)
    m = re.search(r"Depends:\s+(linux-image-\S+)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise HostSetupError(
            f"apt does not know {meta}; run 'apt-get update' (Debian/Ubuntu hosts), or set SANDLOT_KERNEL"
        )
    return m.group(1)


def has_distro_kernel(home: Path, flavor: str = "cloud") -> bool:
    """Whether a distro kernel is already fetched and pinned in ``home`` (no apt needed)."""
    pointer = home / "kernels" / ("default" if flavor == "cloud" else f"default-{flavor}")
    try:
        return (home / "kernels" / pointer.read_text().strip() / "kernel.json").exists()
    except OSError:
        return False


def fetch_distro_kernel(home: Path, *, refresh: bool = False, flavor: str = "cloud") -> Kernel:
    """Download the concrete package behind linux-image-cloud-amd64 (or the generic
    linux-image-amd64) and prepare it.

    The choice is pinned in ``kernels/default``: later calls reuse it without
    asking apt, so boxes keep booting the kernel their snapshots were made with
    until ``refresh=True`` (``sandlot setup --refresh-kernel``) picks a newer one.
    """
    if flavor not in META_PACKAGES:
        raise HostSetupError(f"unknown kernel flavour {flavor!r}")
    pointer = home / "kernels" / ("default" if flavor == "cloud" else f"default-{flavor}")
    if not refresh:
        try:
            pinned = home / "kernels" / pointer.read_text().strip()
            if (pinned / "kernel.json").exists():
                return _topped_up(pinned, pinned.name)
        except OSError:
            pass
    package = _apt_kernel_package(META_PACKAGES[flavor])
    final = home / "kernels" / package
    if (final / "kernel.json").exists():
        atomic_write(pointer, package.encode())
        return _topped_up(final, package)
    (home / "kernels").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=home / "kernels") as tmpdir:
        version, elf, tree = _unpack_package(package, Path(tmpdir))
        kernel = _store(final, elf, version, f"apt:{package}", tree)
    atomic_write(pointer, package.encode())
    return kernel


def _unpack_package(package: str, tmp: Path) -> tuple[str, bytes, Path | None]:
    """Download and unpack a kernel package: its version, vmlinux, and modules tree."""
    if not shutil.which("dpkg-deb"):
        raise HostSetupError("dpkg-deb is needed to unpack the kernel package")
    try:
        argv = ["apt-get", "download", package]
        proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise HostSetupError(f"apt-get download {package} took over {DOWNLOAD_TIMEOUT:.0f} s") from exc
    debs = list(tmp.glob("*.deb"))
    if proc.returncode != 0 or not debs:
        raise HostSetupError(f"apt-get download {package} failed:\n{proc.stderr[-2000:]}")
    unpacked = tmp / "x"
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True, capture_output=True)
    images = sorted((unpacked / "boot").glob("vmlinuz-*"))
    if not images:
        raise HostSetupError(f"{package} holds no /boot/vmlinuz")
    version = images[0].name.removeprefix("vmlinuz-")
    elf = to_vmlinux(images[0].read_bytes())
    trees = [p for p in (unpacked / "lib" / "modules", unpacked / "usr" / "lib" / "modules") if p.exists()]
    return version, elf, (trees[0] / version if trees else None)


def _topped_up(root: Path, package: str) -> Kernel:
    """A kernel prepared by an earlier sandlot that wanted fewer modules: add the ones
    it lacks, from its own package, beside the others. The vmlinux, which saved states
    depend on, stays as it is; a package whose vmlinux differs is not used. Where the
    package cannot be had now, the kernel is used as it is (and asked again next time):
    what the added modules do is never needed to boot (the QEMU engine puts the agent
    ports on virtio-mmio where the kernel lacks virtio_pci)."""
    meta = json.loads((root / "kernel.json").read_text())
    wanted = wanted_modules()
    if set(wanted) <= set(meta.get("wanted", ())):
        return _load(root)
    try:
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root.parent) as tmpdir:
            tmp = Path(tmpdir)
            version, elf, tree = _unpack_package(package, tmp)
            if hashlib.sha256(elf).hexdigest() != meta["sha256"] or version != meta["version"]:
                raise HostSetupError(f"{package} is now another build than the kernel prepared from it")
            modules, deps = _install_modules(tree, tmp / "modules") if tree is not None else ({}, {})
            for name, rel in modules.items():
                if name not in meta["modules"]:
                    os.replace(tmp / rel, root / rel)
            meta["modules"] = {**modules, **meta["modules"]}
            meta["deps"] = {**deps, **meta["deps"]}
            meta["wanted"] = wanted
            atomic_write(root / "kernel.json", json.dumps(meta, indent=1).encode())
    except (HostSetupError, OSError, subprocess.SubprocessError) as exc:
        # not asked again at every start (a host offline would wait each time)
        log.warning("kernel %s keeps the modules it has (%s); 'sandlot setup --refresh-kernel' "
                    "prepares the newest kernel with all of them", meta["version"], exc)  # fmt: skip
        meta["wanted"] = wanted
        with contextlib.suppress(OSError):
            atomic_write(root / "kernel.json", json.dumps(meta, indent=1).encode())
    return _load(root)


def custom_kernel(home: Path, path: Path, modules_tree: Path | None) -> Kernel:
    if not path.is_file():
        raise HostSetupError(f"kernel {path} does not exist")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    tree_tag = hashlib.sha256(str(modules_tree).encode()).hexdigest()[:8] if modules_tree else "nomods"
    final = home / "kernels" / f"custom-{digest}-{tree_tag}"
    if (final / "kernel.json").exists():
        return _load(final)
    elf = to_vmlinux(data)
    version = modules_tree.name if modules_tree else f"custom-{digest}"
    return _store(final, elf, version, f"file:{path}", modules_tree)


def ensure_kernel(
    home: Path, override: str | os.PathLike[str] | None = None, *, flavor: str = "cloud"
) -> Kernel:
    """The kernel to boot: ``override``, else ``$SANDLOT_KERNEL``, else the distro kernel of ``flavor``."""
    chosen = override or os.environ.get("SANDLOT_KERNEL")
    if chosen:
        mods = os.environ.get("SANDLOT_KERNEL_MODULES")
        return custom_kernel(home, Path(chosen).expanduser(), Path(mods) if mods else None)
    return fetch_distro_kernel(home, flavor=flavor)
