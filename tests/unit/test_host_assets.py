"""Pure logic: accelerator choice, initramfs format, kernel conversion and modules."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

import sandlot
from sandlot.core.runtime import Runtime
from sandlot.engine.base import BootRequest
from sandlot.engine.qemu import accel
from sandlot.guest import initramfs, kernel


def test_accel_precheck_reasons(tmp_path: Path) -> None:
    assert "does not exist" in (accel.kvm_precheck(str(tmp_path / "kvm")) or "")
    dev = tmp_path / "kvm"
    dev.write_text("")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse sse2 hypervisor\n")
    reason = accel.kvm_precheck(str(dev), str(cpuinfo)) or ""
    assert "neither vmx nor svm" in reason
    cpuinfo.write_text("flags : fpu vmx sse\n")
    assert accel.kvm_precheck(str(dev), str(cpuinfo)) is None


def test_accel_choice_and_probe_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(sandlot.InvalidArgument):
        accel.choose("warp", cache_dir=tmp_path, probe_key="k", probe=lambda: None)
    assert accel.choose("tcg", cache_dir=tmp_path, probe_key="k", probe=lambda: None).name == "tcg"
    monkeypatch.setattr(accel, "kvm_precheck", lambda: None)
    calls = []

    def probe() -> str | None:
        calls.append(1)
        return "no kernel output within 8s"

    first = accel.choose("auto", cache_dir=tmp_path, probe_key="k", probe=probe)
    second = accel.choose("auto", cache_dir=tmp_path, probe_key="k", probe=probe)
    assert first.name == second.name == "tcg" and "probe boot failed" in first.reason
    assert len(calls) == 1  # cached per host boot, QEMU and kernel


def test_this_host_picks_tcg_and_says_why() -> None:
    """This machine's /dev/kvm is nested PVM without vmx/svm: auto must choose TCG."""
    boot = Runtime.for_home().prepare()
    if accel.kvm_precheck() is None:
        pytest.skip("this host has usable-looking KVM")
    assert boot.accel == "tcg"
    reason = boot.accel_reason
    assert "vmx" in reason or "does not exist" in reason or "readable" in reason


def test_newc_roundtrip() -> None:
    entries = initramfs.agent_entries(b"\x7fELFagent", [("virtio", b"ko1"), ("virtio_blk", b"ko22")])
    data = initramfs.write_newc(entries)
    back = initramfs.parse_newc(data)
    names = [e.name for e in back]
    assert names[:2] == ["dev", "dev/console"] and "init" in names
    init = next(e for e in back if e.name == "init")
    assert init.data == b"\x7fELFagent" and stat.S_IMODE(init.mode) == 0o755
    console = next(e for e in back if e.name == "dev/console")
    assert stat.S_ISCHR(console.mode) and console.rdev == (5, 1)
    order = next(e for e in back if e.name == "sandlot/modules.order")
    assert order.data == b"virtio.ko\nvirtio_blk.ko\n"
    assert len(data) % 4 == 0
    assert initramfs.write_newc(entries) == data  # reproducible


def test_distro_kernel_is_pvh_with_modules_in_dependency_order() -> None:
    engine = Runtime.for_home().engine("qemu")
    k = engine.resolve(BootRequest()).kernel  # type: ignore[attr-defined]
    elf = k.vmlinux.read_bytes()
    assert elf[:4] == b"\x7fELF" and kernel._has_pvh_note(elf)
    order = k.load_order()
    assert order.index("virtio_ring") < order.index("virtio") < order.index("virtio_mmio")
    assert order.index("virtio_mmio") < order.index("virtio_console") < order.index("virtio_blk")
    assert order.index("virtio_pci_modern_dev") < order.index("virtio_pci") < order.index("virtio_console")
    assert order[-1] == "virtio_balloon"  # free page reporting: wanted, never needed to boot
    info = kernel._modinfo(k.modules["virtio_blk"].read_bytes())
    assert set(info["depends"].split(",")) == {"virtio", "virtio_ring"}
    assert k.modules_signed()  # the distro signs its modules: boxes boot it in lockdown


def test_a_kernel_with_an_unsigned_module_is_not_locked_down(tmp_path: Path) -> None:
    signed, unsigned = tmp_path / "a.ko", tmp_path / "b.ko"
    signed.write_bytes(b"\x7fELF...sig" + kernel.MODULE_SIGNATURE_MARK)
    unsigned.write_bytes(b"\x7fELF... no signature")

    def kernel_with(modules: dict[str, Path]) -> kernel.Kernel:
        return kernel.Kernel(tmp_path, tmp_path / "vmlinux", "6.1", "0", modules, {}, "test")

    assert kernel_with({"a": signed}).modules_signed()
    assert not kernel_with({"a": signed, "b": unsigned}).modules_signed()
    assert not kernel_with({}).modules_signed()  # no module to tell: a custom build
    assert not kernel_with({"a": tmp_path / "gone.ko"}).modules_signed()


def test_the_kernel_copy_qemu_loads_holds_the_segments_and_no_symbols(tmp_path: Path) -> None:
    """What QEMU loads: the same bytes for every segment, no section headers (so no
    symbol table in QEMU's heap), and the rest of the file a hole."""
    engine = Runtime.for_home().engine("qemu")
    src = engine.resolve(BootRequest()).kernel.vmlinux  # type: ignore[attr-defined]
    dest = tmp_path / "vmlinux"
    kernel.copy_loadable(src, dest)
    elf, copy = src.read_bytes(), dest.read_bytes()
    assert kernel._has_pvh_note(copy)
    assert struct.unpack_from("<Q", copy, 0x28) == (0,) and struct.unpack_from("<HH", copy, 0x3C) == (0, 0)
    (e_phoff,) = struct.unpack_from("<Q", elf, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", elf, 0x36)
    loaded = 0
    for i in range(e_phnum):
        p_type, _f, off, _va, _pa, size = struct.unpack_from("<IIQQQQ", elf, e_phoff + i * e_phentsize)
        if p_type == 1:
            assert copy[off : off + size] == elf[off : off + size]
            loaded += size
    assert dest.stat().st_blocks * 512 < loaded + (1 << 20) < len(elf)  # only the segments take space
    (tmp_path / "junk").write_bytes(b"MZ" + bytes(100))
    with pytest.raises(sandlot.HostSetupError, match="not a 64-bit"):
        kernel.copy_loadable(tmp_path / "junk", tmp_path / "again")
    cut = bytearray(_tiny_pvh_elf())
    cut[5] = 1  # little-endian
    struct.pack_into("<H", cut, 0x38, 40)  # more program headers than the file holds
    (tmp_path / "cut").write_bytes(bytes(cut))
    with pytest.raises(sandlot.HostSetupError, match="cut short"):
        kernel.copy_loadable(tmp_path / "cut", tmp_path / "again")


def test_kernel_conversion_rejects_garbage() -> None:
    with pytest.raises(sandlot.HostSetupError, match="neither an ELF"):
        kernel.to_vmlinux(b"not a kernel" * 100)
    fake_bz = bytearray(0x300)
    fake_bz[0x202:0x206] = b"HdrS"
    fake_bz[0x1F1] = 1
    struct.pack_into("<II", fake_bz, 0x248, 0, 16)
    with pytest.raises(sandlot.HostSetupError, match="compression"):
        kernel.to_vmlinux(bytes(fake_bz) + bytes(0x400))
    elf_without_pvh = b"\x7fELF\x02" + bytes(200)
    with pytest.raises(sandlot.HostSetupError, match="PVH"):
        kernel.to_vmlinux(elf_without_pvh)


def _tiny_pvh_elf() -> bytes:
    """A minimal ELF64 whose only program header is a note with the Xen PVH entry."""
    name = b"Xen\0"
    note = struct.pack("<III", len(name), 4, 18) + name + struct.pack("<I", 0x1000000)
    ehdr_size, phdr_size = 64, 56
    ehdr = bytearray(ehdr_size)
    ehdr[:4] = b"\x7fELF"
    ehdr[4] = 2  # 64-bit
    struct.pack_into("<Q", ehdr, 0x20, ehdr_size)  # e_phoff
    struct.pack_into("<HH", ehdr, 0x36, phdr_size, 1)  # e_phentsize, e_phnum
    phdr = struct.pack("<IIQQQQQQ", 4, 0, ehdr_size + phdr_size, 0, 0, len(note), len(note), 4)
    return bytes(ehdr) + phdr + note


@pytest.mark.parametrize("codec", ["gzip", "xz"])
def test_bzimage_with_trailing_size_decompresses(codec: str) -> None:
    """Kernels append the uncompressed size after the payload: decoders must stop at the stream's end."""
    import gzip as gz
    import lzma

    elf = _tiny_pvh_elf() + bytes(4096)
    payload = gz.compress(elf) if codec == "gzip" else lzma.compress(elf, format=lzma.FORMAT_XZ)
    payload += struct.pack("<I", len(elf))
    image = bytearray(0x400)
    image[0x1F1] = 1  # setup sectors: the payload starts at (1 + 1) * 512 + offset
    image[0x202:0x206] = b"HdrS"
    struct.pack_into("<II", image, 0x248, 0, len(payload))
    assert kernel.to_vmlinux(bytes(image) + payload) == elf


def _fake_apt(tmp_path: Path, deb: Path | None) -> tuple[Path, Path]:
    """An ``apt-get`` that 'downloads' ``deb`` (or fails), counting its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "apt-calls"
    bin_dir.mkdir(parents=True)
    body = f'cp "{deb}" . && ' if deb is not None else ""
    script = bin_dir / "apt-get"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n{body}{"true" if deb else "exit 100"}\n')
    script.chmod(0o755)
    return bin_dir, calls


def test_a_kernel_prepared_with_fewer_modules_gets_the_missing_ones_from_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel an earlier sandlot prepared (no 'wanted' list) is topped up from its own
    package, once; its vmlinux is untouched; a package whose vmlinux differs is not used;
    where apt fails, the kernel is used as it is and apt is not asked again."""
    engine = Runtime.for_home().engine("qemu")
    real_ko = engine.resolve(BootRequest()).kernel.modules["virtio_balloon"]  # type: ignore[attr-defined]
    elf, version, package = _tiny_pvh_elf(), "6.1.0-test-cloud-amd64", "linux-image-6.1.0-test-cloud-amd64"

    def make_home(name: str) -> Path:
        home = tmp_path / name
        root = home / "kernels" / package
        (root / "modules").mkdir(parents=True)
        (root / "vmlinux").write_bytes(elf)
        meta = {"version": version, "sha256": hashlib.sha256(elf).hexdigest(), "modules": {}, "deps": {},
                "source": f"apt:{package}"}  # fmt: skip
        (root / "kernel.json").write_text(json.dumps(meta))
        (home / "kernels" / "default").write_text(package)
        return home

    def make_deb(name: str, vmlinuz: bytes) -> Path:
        tree = tmp_path / name
        (tree / "DEBIAN").mkdir(parents=True)
        (tree / "DEBIAN" / "control").write_text(
            f"Package: {package}\nVersion: 1\nArchitecture: amd64\nMaintainer: t <t@t>\nDescription: t\n"
        )
        (tree / "boot").mkdir()
        (tree / "boot" / f"vmlinuz-{version}").write_bytes(vmlinuz)
        mods = tree / "lib" / "modules" / version / "kernel" / "drivers" / "virtio"
        mods.mkdir(parents=True)
        shutil.copy(real_ko, mods / "virtio_balloon.ko")
        subprocess.run(["dpkg-deb", "--build", str(tree), str(tmp_path / f"{name}.deb")], check=True,
                       capture_output=True)  # fmt: skip
        return tmp_path / f"{name}.deb"

    # the same build: the module is added beside the others, once
    home = make_home("same")
    bin_dir, calls = _fake_apt(tmp_path / "a", make_deb("same", elf))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    k = kernel.fetch_distro_kernel(home)
    assert "virtio_balloon" in k.modules and k.modules["virtio_balloon"].read_bytes() == real_ko.read_bytes()
    assert k.vmlinux.read_bytes() == elf and k.load_order() == ["virtio_balloon"]
    assert kernel.fetch_distro_kernel(home).modules == k.modules
    assert len(calls.read_text().splitlines()) == 1

    # another build under the same name: not used
    home = make_home("other")
    bin_dir, calls = _fake_apt(tmp_path / "b", make_deb("other", elf + b"\0"))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert kernel.fetch_distro_kernel(home).modules == {}

    # apt fails: used as it is, and not asked again
    home = make_home("offline")
    bin_dir, calls = _fake_apt(tmp_path / "c", None)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert kernel.fetch_distro_kernel(home).modules == {}
    assert kernel.fetch_distro_kernel(home).modules == {}
    assert len(calls.read_text().splitlines()) == 1


def test_nested_virt_support_by_accelerator_and_host_setting(tmp_path: Path) -> None:
    tcg = accel.nested_support("tcg")
    assert tcg.available and tcg.module == "kvm_amd"  # QEMU's TCG CPU is an AMD one with SVM
    cpuinfo, modules = tmp_path / "cpuinfo", tmp_path / "module"
    cpuinfo.write_text("processor : 0\nvendor_id : GenuineIntel\nflags : fpu vmx\n")
    on_kvm = lambda: accel.nested_support("kvm", cpuinfo_path=str(cpuinfo), modules_dir=str(modules))  # noqa: E731
    assert not on_kvm().available and "kvm_intel module is not loaded" in on_kvm().why
    params = modules / "kvm_intel" / "parameters"
    params.mkdir(parents=True)
    (params / "nested").write_text("N\n")
    refused = on_kvm()
    # the refusal names the host setting, and the way out
    assert refused.module is None and "nested=N" in refused.why
    assert "options kvm_intel nested=1" in refused.why and "accel='tcg'" in refused.why
    (params / "nested").write_text("Y\n")
    assert on_kvm().module == "kvm_intel"
    cpuinfo.write_text("vendor_id : AuthenticAMD\n")
    (modules / "kvm_amd" / "parameters").mkdir(parents=True)
    (modules / "kvm_amd" / "parameters" / "nested").write_text("1\n")
    assert on_kvm().module == "kvm_amd"
    cpuinfo.write_text("vendor_id : CentaurHauls\n")
    assert not on_kvm().available and "CentaurHauls" in on_kvm().why


def test_nested_virt_is_refused_where_the_box_would_get_kvm_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cheap check, before a box is made: KVM usable-looking, nested off."""
    from sandlot.engine.qemu.engine import QemuEngine

    engine = QemuEngine(tmp_path)
    engine.refuse(BootRequest(nested_virt=True, accel="tcg"))  # emulated SVM: always there
    monkeypatch.setattr(accel, "kvm_precheck", lambda: None)
    off = accel.NestedSupport(None, "the host's kvm_intel module runs with nested=N")
    monkeypatch.setattr(accel, "nested_support", lambda name: off)
    with pytest.raises(sandlot.Unsupported, match="nested=N"):
        engine.refuse(BootRequest(nested_virt=True))
    engine.refuse(BootRequest(nested_virt=True, accel="tcg"))
    engine.refuse(BootRequest())  # no nested virtualization asked: nothing to refuse


def test_nested_virt_is_a_box_option_on_qemu_only(tmp_path: Path) -> None:
    from sandlot.core.spec import BoxSpec
    from sandlot.engine.gvisor.engine import GvisorEngine

    root = tmp_path / "root"
    root.mkdir()
    assert BoxSpec.build(None, rootfs=root, nested_virt=True).nested_virt is True
    with pytest.raises(sandlot.InvalidArgument, match="nested_virt must be True or False"):
        BoxSpec.build(None, rootfs=root, nested_virt="yes")  # type: ignore[arg-type]
    with pytest.raises(sandlot.InvalidArgument, match="nested_virt"):
        GvisorEngine(tmp_path).refuse(BootRequest(nested_virt=True))


def test_containers_load_their_modules_on_qemu_and_are_refused_on_gvisor(tmp_path: Path) -> None:
    from sandlot.core.launch import boot_request
    from sandlot.core.requests import SPEC_OPTIONS
    from sandlot.core.spec import BoxSpec
    from sandlot.engine.gvisor.engine import GvisorEngine
    from sandlot.guest.kernel import CONTAINER_MODULES

    root = tmp_path / "root"
    root.mkdir()
    spec = BoxSpec.build(None, rootfs=root, containers=True)
    assert "containers" in SPEC_OPTIONS and BoxSpec.from_options(spec.to_options()).containers is True
    assert BoxSpec.build(None, rootfs=root).containers is False
    with pytest.raises(sandlot.InvalidArgument, match="containers must be True or False, not 'yes'"):
        BoxSpec.build(None, rootfs=root, containers="yes")  # type: ignore[arg-type]
    with pytest.raises(sandlot.InvalidArgument, match="runs no container engine"):
        GvisorEngine(tmp_path).refuse(boot_request(spec, network=False))
    # the distro kernel has each as a module: loaded at boot, dependencies first, in an
    # initramfs of their own (a saved state of either kind is another template's)
    engine = Runtime.for_home().engine("qemu")
    plain = engine.resolve(BootRequest())  # type: ignore[attr-defined]
    boxed = engine.resolve(boot_request(spec, network=False))  # type: ignore[attr-defined]
    assert set(CONTAINER_MODULES) <= set(boxed.kernel.modules)
    order = boxed.kernel.load_order((*kernel.BASE_MODULES, *CONTAINER_MODULES))
    assert order.index("x_tables") < order.index("xt_MASQUERADE") and order.index("nf_tables") < order.index(
        "nft_compat"
    )  # fmt: skip
    assert plain.initrd != boxed.initrd and plain.initrd.stat().st_size < boxed.initrd.stat().st_size
    # one wire contract: the option reaches a server's and a fleet's boxes as it is
    from sandlot.api.contract import BoxCreate, box_create

    assert box_create(None, {"rootfs": None, "containers": True}, "ray")["containers"] is True
    assert BoxCreate(containers=True).containers is True  # type: ignore[call-arg]


def test_aslr_is_on_unless_asked_off_and_off_on_qemu_only(tmp_path: Path) -> None:
    from sandlot.core.launch import boot_request
    from sandlot.core.spec import BoxSpec
    from sandlot.engine.gvisor.engine import GvisorEngine

    root = tmp_path / "root"
    root.mkdir()
    assert BoxSpec.build(None, rootfs=root).aslr is True
    off = BoxSpec.build(None, rootfs=root, aslr=False)
    assert off.aslr is False and BoxSpec.from_options(off.to_options()).aslr is False
    assert BoxSpec.from_options({}).aslr is True  # a record from before the setting: on, as it was
    with pytest.raises(sandlot.InvalidArgument, match="aslr must be True or False, not 0"):
        BoxSpec.build(None, rootfs=root, aslr=0)  # type: ignore[arg-type]
    GvisorEngine(tmp_path).refuse(boot_request(BoxSpec.build(None, rootfs=root), network=False))
    with pytest.raises(sandlot.InvalidArgument, match="always randomizes"):
        GvisorEngine(tmp_path).refuse(boot_request(off, network=False))
    # one wire contract: the option reaches a server's and a fleet's boxes as it is
    from sandlot.api.contract import BoxCreate, box_create

    assert box_create(None, {"rootfs": None, "aslr": False}, "http")["aslr"] is False
    assert BoxCreate(aslr=False).aslr is False  # type: ignore[call-arg]
