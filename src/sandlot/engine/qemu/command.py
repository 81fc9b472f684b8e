"""The QEMU command line of a microVM, and the facts measured that shape it."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import HostSetupError
from ...net.addresses import FALLBACK_ADDRESS, PROXY_ADDRESS
from ...net.mux import PORT_NAME as MUX_PORT_NAME
from ..base import Drive, NetSpec, StateSource, Volume

QEMU_BINARY = "qemu-system-x86_64"
MACHINE = "microvm"
# The devices a VM has besides the per-box ones, as saved states record them (text, as
# all the engine's facts; ``VMConfig.devices``): "1" the first; "2" adds a virtio balloon
# for free page reporting; "3" puts the agent ports' virtio-serial on PCI (microvm
# pcie=on) instead of virtio-mmio. QEMU's virtio-mmio offers every queue at 1024 entries
# whatever the device's own size, and the guest's virtio_console fills each port's receive
# queue with 4 KiB buffers: 36 MiB of an idle box's RAM for 8 ports. On PCI a queue has
# the device's 128 entries (4.5 MiB). "4" is "3" without the i8254 PIT (microvm pit=off):
# the guest never uses it (its clock is the TSC, its timer the local APIC's),
# yet QEMU's PIT, left counting from reset, woke the VM's main loop every 27 ms, for
# nothing: 60% of an idle box's host CPU (measured: 7.0 of 11.3 ms a second). "5" adds,
# to a VM with a network card, the egress port (``sandlot.net.mux``): the guest's
# connections to the proxy and the DNS answerer without QEMU forking for each (a VM
# without one has set "4"'s devices, and its command line reads as "4"). A kernel
# without virtio_pci boots set "2".
DEVICE_SETS = ("1", "2", "3", "4", "5")
DEVICE_SET = DEVICE_SETS[-1]
SERIAL_ON_PCI_MODULE = "virtio_pci"

# Boot-time self-tests the kernel runs whatever cryptomgr.notests says, and nothing
# else: the SP800-108 KDF's (30 ms under TCG) and BLAKE2s's (10 ms), of the 0.6 s its
# initcalls take (measured with initcall_debug, benchmarks/boot.py). Both functions
# stay, untested, as the crypto manager's algorithms do. A kernel without them
# ignores the names.
SELF_TESTS_OFF = "initcall_blacklist=crypto_kdf108_init,blake2s_mod_init"

# What an idle box's kernel would wake up for, and no box needs (traced in a box: each
# wakeup is a few hundred microseconds of host CPU under TCG, and a box is idle most of
# its life): the lockup watchdog's timer; kcompactd's proactive compaction, which checks
# every 500 ms for huge pages a box's small RAM has no use for; the per-CPU statistics
# folded every second rather than every ten (reads of /proc/meminfo stay exact enough:
# the fold also happens past a small threshold); and the neighbour tables' probe of
# "managed" entries every 5 s, which no box makes. 8.5 wakeups a second became 5.1.
IDLE_ARGS = (
    "nowatchdog",
    "sysctl.vm.compaction_proactiveness=0",
    "sysctl.vm.stat_interval=10",
    "sysctl.net.ipv4.neigh.default.interval_probe_time_ms=3600000",
    "sysctl.net.ipv6.neigh.default.interval_probe_time_ms=3600000",
)

# Facts measured for fast, reliable microvm boots (see DESIGN.md): without
# tsc_early_khz about half of TCG boots hang; rtc=off costs 2 s; ACPI stays on
# for virtio-mmio discovery. cgroup.memory=nokmem and psi=0 take kernel-memory
# charging and pressure accounting off every fork, exec and allocation (the
# agent's per-command cgroups charge and report user memory, which is what an
# OOM is about); lsm= keeps the security modules a program in the box may use
# (landlock, yama's ptrace scope, bpf) and drops those that act only on a policy
# no box loads (AppArmor, TOMOYO, SELinux...), whose hooks still run on every
# exec. Under TCG each such path is code a restored VM translates again (measured:
# ~1.7k of a first command's ~11k blocks).
KERNEL_ARGS = (
    "console=ttyS0 panic=-1 reboot=t quiet cryptomgr.notests no_timer_check tsc=reliable "
    "mitigations=off i8042.noaux i8042.nokbd i8042.nopnp 8250.nr_uarts=1 cgroup.memory=nokmem psi=0 "
    "lsm=landlock,yama,bpf " + SELF_TESTS_OFF + " " + " ".join(IDLE_ARGS)
)

# Under TCG: "max" gives the guest the SSE4.2/AVX2 that modern wheels (numpy...)
# require, but its ERMS/FSRM make the kernel and libc copy with `rep movsb`,
# which TCG emulates byte by byte: without them pipes and virtio-serial run
# 2-3x faster (measured: 66 -> 170 MB/s of exec stdout).
TCG_CPU = "max,erms=off,fsrm=off"
# The translated-code cache grows to 1 GiB by default; 128 MiB holds what a
# Python workload translates (~100 MiB, no measurable slowdown) and bounds a
# busy box's host memory. 32 MiB would save 13 MiB idle but cost 50% on Python.
TCG_CODE_CACHE_MIB = 128
# The code cache as a memfd mapped twice (written through one view, run through the
# other) rather than private anonymous memory: shared mappings' page tables are not
# copied by fork(), and QEMU forks twice for each guest connection to a guestfwd
# address (libslirp's g_spawn_async with a child setup), its main loop waiting for the
# first child meanwhile. Measured with a 512 MiB Debian box's egress: fork 7 -> 3 ms,
# that wait 15 -> 7 ms, a request through the proxy 38-47 -> 27-29 ms; PSS, boot,
# exec and CPU-bound Python unchanged within noise.
TCG_ACCEL = f"tcg,tb-size={TCG_CODE_CACHE_MIB},split-wx=on"

# Kernel lockdown in the box, for kernels whose modules are all signed (lockdown loads
# no other). Nothing in a box needs what it withholds (tracefs, kprobes, BPF and perf
# reads of kernel memory, /dev/mem, /proc/kcore), and 6.1 builds tracefs's event tree
# at boot unless locked down: 10k inodes, about 9 MiB of every idle box's RAM and
# 0.1 s of its boot.
LOCKDOWN_ARG = "lockdown=confidentiality"


def qemu_binary() -> str:
    path = os.environ.get("SANDLOT_QEMU") or shutil.which(QEMU_BINARY)
    if not path:
        raise HostSetupError(f"{QEMU_BINARY} not found: install qemu-system-x86 (Debian/Ubuntu)")
    return path


def qemu_version(binary: str | None = None) -> str:
    return _qemu_version(binary or qemu_binary())


@functools.lru_cache(maxsize=8)
def _qemu_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out else ""
    return first.removeprefix("QEMU emulator version ").strip()


def cpu_model(accel: str) -> str:
    return "host" if accel == "kvm" else TCG_CPU


def host_tsc_khz() -> int | None:
    """The host TSC frequency, which a TCG guest's TSC runs at."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    except (OSError, ValueError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


@dataclass(slots=True)
class VMConfig:
    """One QEMU process's configuration (the engine's own view of a ``LaunchSpec``)."""

    kernel: Path
    initrd: Path
    disk: Path
    run_dir: Path  # sockets (short path)
    state_dir: Path  # console log, QEMU stderr, the QMP lock
    accel: str = "tcg"
    memory_mib: int = 512
    cpus: int = 1
    hostname: str = "sandlot"
    ports: int = 1
    detached: bool = True
    volumes: tuple[Volume, ...] = ()
    drives: tuple[Drive, ...] = ()
    extra_kernel_args: list[str] = field(default_factory=list)
    lockdown: bool = False  # boot the kernel in lockdown (``LOCKDOWN_ARG``): its modules are signed
    network: NetSpec | None = None  # None: no network card at all
    disk_readonly: bool = False
    # Guest RAM in a file: shared (the file *is* the RAM: a state being prepared
    # for forks) or private (copy-on-write over a saved memory image: a restore).
    ram_file: Path | None = None
    ram_shared: bool = False
    incoming: bool = False  # wait for a saved state (``QemuVM.load_state``) instead of booting
    # Or load this saved state, read from a descriptor QEMU inherits, when
    # ``QemuVM.run_restored`` says so: every restore's path.
    restore_from: Path | None = None
    # or this saved state's chunks, written to QEMU as a migration stream through a pipe
    restore_source: StateSource | None = None
    restore_ignore_shared: bool = False  # the state holds no RAM: it is in ``ram_file``
    # The device set (``DEVICE_SETS``). Devices are part of a saved state: a VM loading
    # one has the devices of the VM that saved it.
    devices: str = DEVICE_SET

    @property
    def maps_saved_memory(self) -> bool:
        """Its RAM is a saved state's memory file, mapped copy-on-write, which other VMs
        map too: QEMU must never write that file (``seccomp``), and its disks take no
        discards (a punch of theirs would be one the filter makes a no-op)."""
        return self.ram_file is not None and not self.ram_shared

    @property
    def balloon(self) -> bool:
        """A virtio balloon, never inflated, through which the guest reports the pages it frees."""
        return self.devices != "1"

    @property
    def serial_on_pci(self) -> bool:
        return self.devices not in ("1", "2")

    @property
    def egress_port(self) -> bool:
        """The virtio-serial port ``sandlot.net.mux`` carries the guest's egress over."""
        return self.network is not None and self.devices not in ("1", "2", "3", "4")

    @property
    def pit(self) -> bool:
        return self.devices in ("1", "2", "3")

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def qmp_lock(self) -> Path:
        return self.state_dir / "qmp.lock"

    @property
    def boots(self) -> bool:
        """Whether this VM boots a kernel (else it loads a saved state)."""
        return not (self.incoming or self.restore_from or self.restore_source)

    @property
    def kernel_copy(self) -> Path:
        """The copy of the kernel that QEMU loads, given back once loaded (``QemuVM.start``)."""
        return self.run_dir / "vmlinux"

    def agent_socket(self, port: int = 0) -> Path:
        return self.run_dir / f"agent.{port}.sock"

    @property
    def console_log(self) -> Path:
        return self.state_dir / "console.log"

    @property
    def stderr_log(self) -> Path:
        return self.state_dir / "qemu.stderr"


NAME_PREFIX = "sandlot-"  # of ``-name``: every VM sandlot starts
# The console log's chardev, its path last. Appended to (``append=on``: O_APPEND), so that
# the home's keeper can cut the log's head in place while QEMU writes on (``core.keeper``);
# a VM started before that has the other form.
CONSOLE_CHARDEV = "file,id=console,append=on,path="
CONSOLE_CHARDEVS = (CONSOLE_CHARDEV, "file,id=console,path=")


def _q(value: object) -> str:
    """A value inside a QEMU option list: commas are doubled."""
    return str(value).replace(",", ",,")


def netdev(net: NetSpec, egress_port: bool = False) -> str:
    """libslirp user networking: ``restrict=on`` blocks everything but hostfwd and
    guestfwd; the helpers answer at the proxy address through guestfwd. With the egress
    port, the guest's connections to the proxy address go through the port; the helpers
    answer at ``FALLBACK_ADDRESS`` too, for those connections when the port's host end
    is away."""
    opts = f"user,id=net0,ipv6=off,restrict={'on' if net.restrict else 'off'}"
    for address, host_port, guest_port in net.forwards:
        opts += f",hostfwd=tcp:{address}:{host_port}-:{guest_port}"
    helpers = net.helpers()
    if egress_port:
        helpers += [(FALLBACK_ADDRESS, port, cmd) for addr, port, cmd in helpers if addr == PROXY_ADDRESS]
    for address, port, cmd in helpers:
        opts += f",guestfwd=tcp:{address}:{port}-cmd:{_q(cmd)}"
    return opts


EGRESS_PORT_CHARDEV = "egress"


def egress_port(cfg: VMConfig) -> list[str]:
    """The egress port: a client of the home's egress server (``NetSpec.egress_mux``),
    connecting again each second while none listens; without one, a port whose host end
    never opens, so the guest goes through QEMU's user network."""
    assert cfg.network is not None
    mux, chardev = cfg.network.egress_mux, EGRESS_PORT_CHARDEV
    backend = f"socket,id={chardev},path={_q(mux)},reconnect=1" if mux else f"null,id={chardev}"
    return ["-chardev", backend, "-device", f"virtserialport,chardev={chardev},name={MUX_PORT_NAME}"]


def serial_device(cfg: VMConfig) -> str:
    return "virtio-serial-pci" if cfg.serial_on_pci else "virtio-serial-device"


def device_set_of(argv: list[str]) -> str | None:
    """The device set of a running QEMU, from its command line (None: not a VM's)."""
    options = [a for prev, a in itertools.pairwise(argv) if prev == "-device"]
    devices = [a.split(",", 1)[0] for a in options]
    if not devices:
        return None
    if any(f"name={MUX_PORT_NAME}" in a.split(",") for a in options):
        return "5"
    if "virtio-serial-pci" in devices:
        machine = next((a for prev, a in itertools.pairwise(argv) if prev == "-M"), "")
        return "4" if "pit=off" in machine.split(",") else "3"
    return "2" if "virtio-balloon-device" in devices else "1"


def state_dir_of(argv: list[str]) -> Path | None:
    """The state directory of a running QEMU, from its command line (the one its
    console log is in); None: not a VM of sandlot's."""
    named, console = False, None
    for prev, arg in itertools.pairwise(argv):
        if prev == "-name":
            named = arg.startswith(NAME_PREFIX)
        elif prev == "-chardev" and arg.startswith(CONSOLE_CHARDEVS):
            prefix = next(p for p in CONSOLE_CHARDEVS if arg.startswith(p))
            console = Path(arg.removeprefix(prefix).replace(",,", ","))
    return console.parent if named and console is not None else None


KERNEL_ARGS_MAX = 512  # bytes of SANDLOT_KERNEL_ARGS (x86's command line holds 2048 in all)


def kernel_args_from_env() -> list[str]:
    """``SANDLOT_KERNEL_ARGS``, a debugging aid: words added at the end of a booting
    guest kernel's command line (``loglevel=7 earlyprintk=ttyS0`` to see the boot on
    the console, ``initcall_debug``). Later words win where the kernel reads one twice."""
    raw = os.environ.get("SANDLOT_KERNEL_ARGS", "")
    if len(raw) > KERNEL_ARGS_MAX or not all(c.isascii() and (c.isprintable() or c == " ") for c in raw):
        raise HostSetupError(
            f"SANDLOT_KERNEL_ARGS must be printable ASCII words, at most {KERNEL_ARGS_MAX} bytes in all"
        )
    return raw.split()


def build_command(cfg: VMConfig, binary: str) -> list[str]:
    append = KERNEL_ARGS
    tsc = host_tsc_khz()
    if tsc:
        append += f" tsc_early_khz={tsc}"
    append += f" sandlot.hostname={cfg.hostname} sandlot.ports={cfg.ports}"
    if cfg.network is not None:
        append += " sandlot.net=1"
        if cfg.network.dns_relay:
            append += " sandlot.dns=relay"
        if cfg.egress_port:
            append += " sandlot.egress=1"
    if cfg.lockdown:
        append += " " + LOCKDOWN_ARG
    if cfg.extra_kernel_args:
        append += " " + " ".join(cfg.extra_kernel_args)
    # mem-merge: the guest's RAM is marked mergeable (QEMU's default, said here): where the
    # host runs KSM, pages that boxes hold alike are kept once (sandlot.ksm)
    machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on,mem-merge=on"
    machine += ",pcie=on" if cfg.serial_on_pci else ""
    machine += "" if cfg.pit else ",pit=off"
    ram: list[str] = []
    if cfg.ram_file is not None:
        # named like the machine's default RAM block, so a state saved by any VM loads into any other
        machine += ",memory-backend=microvm.ram"
        share = "on" if cfg.ram_shared else "off"
        backend = f"memory-backend-file,id=microvm.ram,size={cfg.memory_mib}M,mem-path={_q(cfg.ram_file)}"
        ram = ["-object", f"{backend},share={share},merge=on"]
    if cfg.accel == "kvm":
        accel = ["-accel", "kvm", "-cpu", "host"]
    else:
        accel = ["-accel", TCG_ACCEL, "-cpu", TCG_CPU]
    cmd = [
        binary,
        "-name", f"{NAME_PREFIX}{cfg.hostname}",
        "-M", machine,
        *accel,
        "-smp", str(cfg.cpus),
        "-m", f"{cfg.memory_mib}M",
        *ram,
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-chardev", f"{CONSOLE_CHARDEV}{_q(cfg.console_log)}",
        "-serial", "chardev:console",
        # port 0 is reserved for consoles
        "-device", f"{serial_device(cfg)},max_ports={cfg.ports + 1 + cfg.egress_port}",
    ]  # fmt: skip
    if cfg.boots:
        # a VM that loads a saved state gets its kernel from that state; loading the
        # 45 MB vmlinux again would only cost time and memory
        cmd += ["-kernel", str(cfg.kernel_copy), "-initrd", str(cfg.initrd), "-append", append]
    for port in range(cfg.ports):
        cmd += [
            "-chardev", f"socket,id=agent{port},path={_q(cfg.agent_socket(port))},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent{port},name=sandlot.{port}",
        ]  # fmt: skip
    if cfg.egress_port:
        cmd += egress_port(cfg)
    # discards free a box's disk space back to the host; where QEMU may punch no hole
    # (``maps_saved_memory``), zeros are still written as zero clusters, not punched
    discard = "discard=unmap,detect-zeroes=unmap"
    if cfg.maps_saved_memory:
        discard = "discard=ignore,detect-zeroes=on"
    cmd += [
        "-drive", f"id=root,file={_q(cfg.disk)},format=qcow2,if=none,{discard}"
                  + (",readonly=on" if cfg.disk_readonly else ""),
        "-device", "virtio-blk-device,drive=root",
        "-qmp", f"unix:{_q(cfg.qmp_socket)},server=on,wait=off",
    ]  # fmt: skip
    if cfg.balloon:
        # never inflated: only free page reporting (in 128 KiB blocks: the agent sets the order)
        cmd += ["-device", "virtio-balloon-device,free-page-reporting=on"]
    if cfg.network is not None:
        cmd += ["-netdev", netdev(cfg.network, cfg.egress_port), "-device", "virtio-net-device,netdev=net0"]
    for drive in cfg.drives:
        # after every other block device: the root stays the guest's first (/dev/vda)
        cmd += [
            "-drive", f"id={drive.serial},file={_q(drive.path)},format=qcow2,if=none,{discard}"
                      + (",readonly=on" if drive.readonly else ""),
            "-device", f"virtio-blk-device,drive={drive.serial},serial={drive.serial}",
        ]  # fmt: skip
    for vol in cfg.volumes:
        # security_model=none: files keep the host user's ownership; no root needed
        opts = f"local,id={vol.tag},path={_q(vol.host)},security_model=none" + (
            ",readonly=on" if vol.readonly else ""
        )
        cmd += ["-fsdev", opts, "-device", f"virtio-9p-device,fsdev={vol.tag},mount_tag={vol.tag}"]
    if cfg.incoming or cfg.restore_from is not None or cfg.restore_source is not None:
        # -S: the guest runs only once the host says ``cont``
        cmd += ["-S", "-incoming", "defer"]
    return cmd
