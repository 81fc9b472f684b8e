"""The engine interface: what the core asks of a VM technology, and nothing more.

The core (``sandlot.core``) decides *what* a box is and which state it is in;
an engine only runs VMs. It prepares what a boot needs, launches a VM on a disk
(booting it, or loading a saved state), finds a running VM again from the
reference the store recorded, reports its status without an event loop (for
recovery after crashes), connects to the agent inside, saves and shares
running state, and says which saved states it can load.

``engine/qemu`` implements it with QEMU (KVM or TCG). A fake engine for unit
tests lives in ``tests/support``: it runs no VM, and lets lifecycle, recovery,
locking and error paths be tested in milliseconds.

A VM reference is engine-neutral: the pid and start time of the process that
*is* the VM (``VMRef``); the store keeps it in ``vm_pid``/``vm_start`` with the
engine's name beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .. import pids
from ..errors import BootError, SavedStateError
from ..net.addresses import DNS_PORT, PROXY_ADDRESS, PROXY_PORT
from ..pids import VMRef
from . import hostcgroup

Connector = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class VMStatus(enum.StrEnum):
    """What a VM process is doing, as recovery sees it."""

    GONE = "gone"  # no such process (or another process reused its pid)
    RUNNING = "running"  # the guest runs
    PAUSED = "paused"  # vCPUs stopped: a pause, a finished save, or a loaded state not yet let run
    LOADING = "loading"  # still loading a saved state
    SAVING = "saving"  # writing its state out
    UNKNOWN = "unknown"  # the process lives but did not say


# a SIGKILLed VM tears its memory down before it is gone: well under a second, but a
# loaded host has been seen to take longer than a caller's next look
KILL_WAIT = 5.0


@dataclass(frozen=True, slots=True)
class BootRequest:
    """What a boot needs decided before anything is launched."""

    accel: str = "auto"  # "auto", or a name the engine knows ("kvm", "tcg")
    kernel: str | None = None  # a kernel of the user's, instead of the engine's default
    volumes: bool = False  # host directories are shared into the guest
    drives: int = 0  # block devices beside the root disk (named volumes)
    network: bool = False  # the guest has a network card
    disk_gb: int = 0  # the box's disk size (0: unknown)
    disk_required: bool = False  # the user asked for that size (it is not the default)
    nested_virt: bool = False  # the guest runs VMs of its own: /dev/kvm in the box
    containers: bool = False  # the guest runs a container engine: its kernel's modules loaded
    aslr: bool = True  # the guest kernel randomizes its processes' address spaces


@dataclass(frozen=True, slots=True)
class Boot:
    """What an engine resolved for a boot (kernel, initramfs, accelerator...).

    ``record`` is what the store keeps so that any process can attach to the VM
    later; ``identity`` is what a saved state booted this way depends on, for
    the keys of automatic templates."""

    engine: str
    accel: str
    accel_reason: str
    record: dict[str, Any]
    identity: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NetSpec:
    """A network card on the engine's user-mode network. ``restrict``: nothing
    leaves but the egress proxy, the DNS answerer and the published ports;
    ``proxy_command`` and ``dns_command`` are run once per guest connection to
    their port of ``sandlot.net.addresses.PROXY_ADDRESS``, with the connection
    as their standard input and output; the proxy also on ``transparent_ports``
    (with ``--transparent PORT``). ``guest_forwards``: more of the same, each a
    guest address and port and the command its connections go to. ``egress_mux``: where
    an engine that can may carry the proxy address's connections instead (the helpers'
    commands say what serves each port there)."""

    restrict: bool = True
    proxy_command: str | None = None
    dns_command: str | None = None
    forwards: tuple[tuple[str, int, int], ...] = ()  # host address, host port, guest port
    transparent_ports: tuple[int, ...] = ()
    guest_forwards: tuple[tuple[str, int, str], ...] = ()  # guest address, guest port, command
    # where the home's egress server takes a VM's egress port (``sandlot.net.mux``): the
    # proxy address's connections without a process started for each; None: none
    egress_mux: str | None = None

    def helpers(self) -> list[tuple[str, int, str]]:
        """(guest address, port, command) of each helper the guest's connections reach:
        what an engine routes, each connection to its own run of the command."""
        out = []
        if self.proxy_command:
            out.append((PROXY_ADDRESS, PROXY_PORT, self.proxy_command))
            out += [(PROXY_ADDRESS, port, f"{self.proxy_command} --transparent {port}")
                    for port in self.transparent_ports]  # fmt: skip
        if self.dns_command:
            out.append((PROXY_ADDRESS, DNS_PORT, self.dns_command))
        return [*out, *self.guest_forwards]

    @property
    def dns_relay(self) -> bool:
        """Whether the guest asks ``dns_command`` for names through the agent's relay
        (where the network is restricted, the engine's own resolver is out of reach)."""
        return self.restrict and self.dns_command is not None


@dataclass(frozen=True, slots=True)
class Volume:
    """A host directory shared into the guest at ``guest``: mounted there by the agent,
    which knows it by ``tag`` (or by the sandbox, ``Engine.mounts_shares``)."""

    host: str
    tag: str
    readonly: bool = False
    guest: str = ""


@dataclass(frozen=True, slots=True)
class Drive:
    """A block device beside the root disk (a named volume's top layer), found in the
    guest by its ``serial`` (which the agent mounts; its ``/dev/vdX`` name is not fixed),
    or mounted at ``guest`` by the sandbox (``Engine.mounts_drives``). ``readonly``: the
    device itself; ``guest_readonly``: the mount (an ``ro`` volume's top stays writable,
    for the journal a holder left unfinished)."""

    path: Path
    serial: str
    readonly: bool = False
    guest: str = ""
    guest_readonly: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a VM's files live: ``state_dir`` (console log, engine logs, locks;
    kept with the box) and ``run_dir`` (sockets; short paths, removed at exit)."""

    box_id: str
    hostname: str
    state_dir: Path
    run_dir: Path
    agent_ports: int


class ImageSink(ABC):
    """One memory image of a state being saved (a RAM block), written page by page, in
    any order, each page once; a page never written is a page never sent (an error)."""

    @abstractmethod
    def pages(self, offset: int, data: bytes | memoryview) -> None:
        """``data`` (whole pages) at ``offset``."""

    @abstractmethod
    def zeros(self, offset: int, length: int) -> None:
        """``length`` bytes of zero pages at ``offset``."""


class StateSink(ABC):
    """Where an engine that can (``Engine.chunked_state``) writes a state it saves, for
    the core to keep as content-addressed chunks: memory images by page, and the rest as
    named byte streams. Blocking: an engine calls it from a thread of its own."""

    # many VMs restore the state right after it is saved (a fork's, a template's): an engine
    # whose save leaves the form they read anyway keeps it in the state's directory (its
    # ``share_memory`` then has nothing left to do)
    shared: bool = False

    @abstractmethod
    def image(self, name: str, size: int) -> ImageSink:
        """A memory image of ``size`` bytes (a multiple of the page size)."""

    @abstractmethod
    def stream(self, name: str, data: bytes) -> None:
        """The whole of one named byte stream."""

    def stream_pieces(self, name: str, pieces: Iterable[bytes]) -> None:
        """A named byte stream, each piece a chunk of its own (where the engine knows
        better cuts than fixed offsets), without holding all of it at once where the
        sink can."""
        self.stream(name, b"".join(pieces))


class StateSource(ABC):
    """A state saved through a ``StateSink``, read back. Every piece is checked against
    its hash as it is read: a damaged one raises ``CorruptSnapshot`` naming it."""

    @abstractmethod
    def images(self) -> dict[str, int]:
        """Each memory image's name and size, in the order they were declared."""

    @abstractmethod
    def extents(self, name: str) -> Iterator[tuple[int, bytes]]:
        """The non-zero parts of an image as (offset, bytes), in ascending order: what
        is not yielded is zeros."""

    @abstractmethod
    def stream(self, name: str) -> bytes: ...

    def stream_pieces(self, name: str) -> Iterator[bytes]:
        """A named byte stream in pieces, in order, without holding all of it at once
        where the source can."""
        yield self.stream(name)

    @abstractmethod
    def streams(self) -> list[str]:
        """The names of the state's byte streams."""


@dataclass(frozen=True, slots=True)
class SavedState:
    """A saved running state to start from: its directory, the facts it was saved with,
    and (a state saved through a ``StateSink``) where its chunks are read from; the
    directory then holds only what the engine derived from them (the form forks map)."""

    directory: Path
    facts: dict[str, Any]
    source: StateSource | None = None
    # the engine's ``lazy_image`` served as this file (``core.lazymem``): the VM maps it
    # copy-on-write, and ``source`` leaves that image out
    memory: Path | None = None


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything a VM is launched with."""

    where: Placement
    disk: Path
    memory_mib: int
    cpus: int
    boot: dict[str, Any]  # a ``Boot.record``, with the VM's shape (memory_mib, cpus, agent_ports, network)
    network: NetSpec | None = None  # None: no network card at all
    volumes: tuple[Volume, ...] = ()
    drives: tuple[Drive, ...] = ()  # after the root disk, in this order (a saved state's order)
    saved: SavedState | None = None  # load this state instead of booting
    disk_readonly: bool = False
    detached: bool = True  # outlives the process that launched it
    extra: dict[str, Any] = field(default_factory=dict)


class VM(ABC):
    """One running VM, launched here or found again by its reference."""

    ref: VMRef
    # resolves when the VM process exits, with its status where known; set by the
    # engine once the process is launched or found again
    _exited: asyncio.Future[int | None] | None = None

    @property
    @abstractmethod
    def running(self) -> bool:
        """The process lives (as far as this process has seen)."""

    def exited(self) -> asyncio.Future[int | None]:
        """Resolves when the VM process exits (with its status where known)."""
        assert self._exited is not None
        return self._exited

    async def wait_exit(self, timeout: float | None = None) -> bool:
        """True once the VM process has exited; False if ``timeout`` passed first."""
        if self._exited is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except TimeoutError:
            return False
        return True

    @abstractmethod
    async def kill(self, grace: float = 2.0) -> None:
        """End the VM: an orderly exit of the VM process first, SIGKILL after ``grace``."""

    @abstractmethod
    async def pause(self) -> None:
        """Stop the vCPUs; memory and processes stay."""

    @abstractmethod
    async def resume(self) -> None:
        """Let stopped vCPUs run again."""

    @abstractmethod
    async def status(self) -> VMStatus: ...

    @abstractmethod
    async def run_restored(self, timeout: float) -> None:
        """A VM launched from a saved state: wait until the state is loaded, let the
        guest run, and return only once it does. Raises ``BootError`` (with the
        engine's reason) if the state cannot be loaded."""

    @abstractmethod
    async def save(
        self,
        directory: Path,
        *,
        new_disk: Path | None,
        keep_running: bool,
        new_drives: Mapping[str, Path] | None = None,
        sink: StateSink | None = None,
        fixed: asyncio.Event | None = None,
    ) -> float:
        """Save memory and devices into ``sink`` where one is given and the engine
        writes chunks (``Engine.chunked_state``), else into ``directory`` (which exists
        and is empty).
        ``new_disk``: the VM goes on writing to this new top layer (it starts empty
        over the current one), switched while the VM is stopped; ``new_drives``: the
        same for its drives, by serial (every disk is switched at once, or none is). ``keep_running``:
        let the guest run again afterwards (a snapshot), or leave it stopped (a
        suspend). ``fixed``: set as soon as the state being saved can no longer change
        (the guest runs again while its memory is still written: the flight recorder's
        next step may begin then); an engine that cannot tell leaves it to the caller,
        who sets it once the save returns. Returns the seconds the guest was stopped."""

    async def disk_full(self) -> bool:
        """Whether the VM stopped because a write to one of its disks found the host's
        filesystem full (QEMU stops the guest then, rather than fail its write); False
        where the engine cannot tell."""
        return False

    async def agent_opened(self) -> bool | None:
        """Whether the guest has opened its agent's port (its init ran); None where the
        engine cannot tell. A boot past its deadline with the port never opened hung
        before init, and is tried once more."""
        return None

    @abstractmethod
    async def published_ports(self) -> list[tuple[str, int, int]]:
        """(host address, host port, guest port) of each published port, as bound."""

    @abstractmethod
    def agent_connector(self, port: int) -> Connector:
        """Opens a byte stream to the agent's ``port``."""

    @abstractmethod
    def saved_facts(self) -> dict[str, Any]:
        """The facts a state saved from this VM can only be loaded with."""

    @abstractmethod
    def console_tail(self, lines: int = 40) -> str: ...

    @abstractmethod
    def failure(self, what: str) -> BootError:
        """``what`` went wrong, with the engine's own last words and the guest console."""

    @abstractmethod
    def cleanup(self) -> None:
        """Remove what the VM left behind (sockets...) once it has exited."""


class Engine(ABC):
    """A VM technology. One instance per process and home; cheap to create."""

    name: ClassVar[str]
    # "qcow2": a box's disk is a qcow2 layer chain over the image's ext4 base;
    # "dir": a layer directory over the image's unpacked root (an overlay mount)
    disk_format: ClassVar[str] = "qcow2"
    live_state: ClassVar[bool] = True  # saves and loads running states (snapshot, suspend, fork...)
    # saving a running state ends the VM process, which a restore then replaces (runsc
    # checkpoint): recovery knows a VM gone mid-save is no crash of it
    save_ends_vm: ClassVar[bool] = False
    # its VMs are host processes that ``vm_of`` knows by their command lines, so a process
    # other than their launcher finds them (a home's watcher, ``sandlot doctor``)
    host_processes: ClassVar[bool] = False
    # its sandbox mounts the shares (``LaunchSpec.volumes``) where the box wants them, and
    # keeps them through a save (gVisor's bind mounts); else the guest's agent mounts each
    # by its tag, and a save needs them unmounted (QEMU's 9p: ``BoxController.still``)
    mounts_shares: ClassVar[bool] = False
    mounts_drives: ClassVar[bool] = False  # the sandbox mounts named volumes, not the agent
    # its saves go to a ``StateSink`` (memory by page, kept as content-addressed chunks);
    # else they are files in the state's directory
    chunked_state: ClassVar[bool] = False
    # the memory image of its chunked states that it can map from a file instead of
    # loading it (``SavedState.memory``): its guest RAM, read as it is touched
    lazy_image: ClassVar[str | None] = None

    def refuse(self, request: BootRequest) -> None:
        """Raise ``InvalidArgument`` for what this engine cannot run, at all or on this
        host. Cheap and blocking nothing: the core asks before it makes a box, so a
        request the engine refuses leaves no box behind."""
        return None  # an engine that runs every request refuses nothing

    @abstractmethod
    def prepare(self, request: BootRequest) -> Boot:
        """Resolve (fetching or building on first use) what a boot needs. Blocking."""

    @abstractmethod
    async def launch(self, spec: LaunchSpec) -> VM:
        """Start a VM. It boots, or (``spec.saved``) waits to load a state until
        ``VM.run_restored``. Returns once the VM process exists."""

    @abstractmethod
    def attach(self, ref: VMRef, where: Placement, boot: dict[str, Any]) -> VM:
        """The VM behind ``ref`` (started by another process, or earlier); ``boot``: its
        launch record (``LaunchSpec.boot``), from which it knows its own shape."""

    def alive(self, ref: VMRef | None, box_id: str) -> bool:
        """Whether ``ref`` still names the VM of ``box_id``. Blocking, loop-free. For a VM
        that is a host process: it lives, and its command line names the box (the store's
        quick listing, ``core.boxrecord``, asks the same of the engines it reads)."""
        return pids.vm_alive(ref, box_id)

    @abstractmethod
    def probe(self, ref: VMRef | None, where: Placement) -> VMStatus:
        """The VM's status, asked without an event loop (recovery runs anywhere)."""

    def held_for_room(self, ref: VMRef | None, where: Placement) -> bool:
        """Whether the VM stopped its guest because a disk write met a full host
        filesystem, and holds that write until it is let run (``let_run``). Blocking,
        loop-free. An engine whose guests see ENOSPC themselves never holds one."""
        return False

    def let_run(self, ref: VMRef, where: Placement) -> None:
        """Let a guest ``held_for_room`` run on: its held writes are tried again (and
        hold it once more if the filesystem is still full). Blocking, loop-free."""
        return None  # nothing an engine that holds no write need do

    def kill_now(self, ref: VMRef | None, box_id: str) -> None:
        """SIGKILL the VM if ``ref`` still names it, and wait until it is gone
        (``KILL_WAIT`` at most): whoever goes on to remove its files or report it ended
        finds it so. Blocking, loop-free."""
        if ref is None or not self.alive(ref, box_id):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(ref.pid, signal.SIGKILL)
        pids.wait_gone(ref.pid, ref.start, KILL_WAIT)

    def vm_of(self, process: pids.Process) -> tuple[VMRef, Path] | None:
        """The VM a host process of this mount namespace stands for (the process its
        ``VMRef`` names, or the one that runs it there), and the ``Placement.state_dir`` it
        was launched with, from the process's command line; None where it stands for
        none of this engine's VMs (each VM is found once). Blocking."""
        return None

    def console_log(self, where: Placement) -> Path:
        """The file a VM's console (the guest kernel's and its init's words) goes to."""
        return where.state_dir / "console.log"

    def console_tail(self, where: Placement, nbytes: int = 4096) -> str:
        """The last ``nbytes`` of a VM's console, read from its file (the VM may be gone)."""
        try:
            with open(self.console_log(where), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def forget(self, where: Placement) -> None:  # noqa: B027 (a hook most engines need not fill)
        """Remove what a VM that is gone (or that no row names) left on the host: an
        engine's container state and mounts. Blocking, idempotent; nothing by default."""

    @abstractmethod
    def abort_save(self, ref: VMRef, where: Placement, *, resume: bool) -> None:
        """A save was cut short (its process died): cancel it, and (``resume``) let the guest run."""

    @abstractmethod
    async def share_memory(
        self, state: SavedState, disk: Path, drives: tuple[Drive, ...] = (), shares: tuple[Volume, ...] = ()
    ) -> None:
        """Give a saved state the form that many VMs map copy-on-write (forks,
        templates, exports): ``drives`` and ``shares`` are the devices it was saved with.
        Idempotent; concurrent callers wait for one another."""

    @abstractmethod
    def memory_shared(self, directory: Path) -> bool: ...

    @abstractmethod
    def state_files(self, directory: Path) -> dict[str, Path]:
        """The files of a shared saved state, by archive member name."""

    @abstractmethod
    def check_compatible(self, facts: dict[str, Any], boot: Boot) -> None:
        """Raise ``IncompatibleSnapshot`` unless a state saved with ``facts`` loads here."""

    @abstractmethod
    def facts_for_import(self, facts: dict[str, Any], boot: Boot) -> dict[str, Any]:
        """The facts of an imported state, with this host's paths (kernel, initramfs)."""

    def flatten_root(self, layer: Path, dest: Path) -> None:
        """Write everything a layer directory's box sees (every frozen layer below it and
        the image's root) to ``dest`` as one tar: the disk of an exported saved state, for
        engines whose disk is a layer directory (``disk_format`` "dir")."""
        raise SavedStateError(f"engine {self.name!r} keeps no layer directories")

    def usage(self, ref: VMRef | None) -> dict[str, Any]:
        """Host CPU seconds and resident memory of the VM (None where unknown): those of
        the process ``ref`` names, for an engine whose VM is one host process."""
        out: dict[str, Any] = {"cpu_seconds": None, "rss_bytes": None}
        if ref is None or not pids.alive(ref.pid, ref.start):
            return out
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = pids.stat_fields(ref.pid)
            if fields is not None:
                ticks = os.sysconf("SC_CLK_TCK")
                out["cpu_seconds"] = round((int(fields[11]) + int(fields[12])) / ticks, 2)
            for line in Path(f"/proc/{ref.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
        return out

    def host_limits(self, ref: VMRef | None) -> dict[str, Any] | None:
        """Where the host bounds the VM (the cgroup of the process ``ref`` names), if anywhere."""
        if ref is None or not pids.alive(ref.pid, ref.start):
            return None
        placement = hostcgroup.placement_of(ref.pid)
        return placement.report() if placement else None

    @abstractmethod
    def doctor(self) -> dict[str, Any]:
        """Facts about this host for ``sandlot doctor``; never raises for a missing part."""


__all__ = [
    "VM",
    "Boot",
    "BootRequest",
    "Connector",
    "Engine",
    "ImageSink",
    "LaunchSpec",
    "NetSpec",
    "Placement",
    "SavedState",
    "StateSink",
    "StateSource",
    "VMRef",
    "VMStatus",
    "Volume",
]
