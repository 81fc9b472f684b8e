"""The published ports of boxes that wake on traffic (``wake_on_traffic=True``).

QEMU's user networking (and a gVisor box's forwarder) binds a box's published ports only
while its VM runs: a box put to sleep (suspended, by hand or by its ``idle_timeout``)
refuses every connection until something resumes it. The published ports of a box that
wakes on traffic are held instead by the home's port keeper, from the box's first start
until it is removed, asleep or awake: one process per home, whatever the number of
boxes, so a thousand sleeping boxes cost one process and no VM.

    python -m sandlot.api.port_keeper HOME

Each connection the keeper takes is bridged to the guest port through the agent's relay,
the path of ``box.connect`` (``api/bridge.py``). Asking the agent of a suspended box
resumes it first (the controller's transparent resume, whose event says ``by: traffic``),
so the caller's connection waits while the box wakes and is then passed through: nothing
is refused, and the box needs no network card. Connections that come together while it
wakes share the one resume (the box's lock). While a connection is open its relay is a
command in flight in the box, so the idle watchdog does not put a box with a live
connection to sleep.

A connection that cannot be passed in is reset, as by a port that refuses it. Where the
box could not be woken (it was stopped, its saved state is gone, a resume failed), a
``wake_failed`` event says why (folded, as every happening, past the box's event rate);
where the box woke but nothing listens on the guest port, nothing is said, as a port
that refuses says nothing (a guest port that did not answer within ``RELAY_TIMEOUT``
is said). A box that is stopped keeps its ports held and refuses
connections until it is started: stopping switches it off, which traffic does not undo.

Whoever starts, resumes or finds such a box asks the keeper to hold its ports
(``api/port_hold.py``: a JSON line over the keeper's Unix socket, in the private runtime
directory), starting the keeper first where none runs. The keeper binds them and
answers with the ports, or with why it cannot (a host port in use): the call that
started the box fails with that reason, and the box's record says at once which port an
ephemeral one (``host`` 0) got. A keeper that starts takes the home's lock first (one per
home) and then holds the ports of every such box of the home the store lists, on the
ports their records name (an ephemeral one another program took meanwhile gets a new
number, which the record then says): a keeper killed leaves the ports closed only until
the next call of the home that starts, resumes or finds one of its boxes. It lets a
removed box's ports go within ``LOOK_EVERY`` seconds (at once where this host removed it;
it reads the store's rows only when the store's files changed, or ``READ_ANYWAY`` seconds
after its last read, so sleeping boxes cost it no reads), and ends ``IDLE_EXIT`` seconds
after it last held any. A keeper whose home was removed and made again at the same path
(its store another file) ends at once, answering nothing: it would serve the old store,
where no new box is, and the keepers are found by the home's path; the caller asks the
next keeper, of the new store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import private_listener, try_flock
from ..core import events
from ..core.boxrecord import STORE_FILE, store_path
from ..errors import BoxNotFound, GuestConnectionRefusedError, InvalidState, SandlotError
from .backend import Command
from .bridge import Duplex, open_relay, serve_on
from .local import LocalBackend, LocalBoxRef, local
from .port_hold import socket_path

if TYPE_CHECKING:
    from ..core.controller import BoxController
    from .process import AsyncProcess

LOOK_EVERY = 2.0  # seconds between two looks at which boxes of the home still exist
# the rows are read this often even where the store's files look unchanged: two writes in
# one tick of the file system's clock that leave the log's size alike look like none
READ_ANYWAY = 60.0
IDLE_EXIT = 30.0  # seconds holding no box before the keeper ends
# seconds for the guest port to answer, once the box is awake: a port nobody listens on
# answers at once (refused); one that is slower to start its relay than this (a box just
# woken on a loaded, emulated host, its memory still coming in lazily) has not failed
RELAY_TIMEOUT = 60.0
WAKER = "traffic"  # who the events of a wake say acted
BACKLOG = 512  # connections that wait, unaccepted, while many come at once


def store_stamp(home: Path) -> tuple[Any, ...]:
    """What a write to the home's store changes: the inode, size and time of its file and
    of its write-ahead log (None for one that is not there)."""
    stamps: list[Any] = []
    for path in (store_path(home), store_path(home).with_name(STORE_FILE + "-wal")):
        try:
            st = path.stat()
        except FileNotFoundError:
            stamps.append(None)
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def store_file(home: Path) -> tuple[int, int] | None:
    """The home's store file as the file system knows it (device, inode): None where there
    is none."""
    try:
        st = store_path(home).stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def bind_port(box: str, address: str, port: int, *, ephemeral: bool) -> socket.socket:
    """A listening socket on ``address:port``; where ``port`` was an ephemeral one the box
    had before and another program took it meanwhile, a new ephemeral one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind((address, port))
        except OSError:
            if not (ephemeral and port):
                raise
            sock.bind((address, 0))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise InvalidState(
            f"box {box}: cannot publish host port {address}:{port}: {exc.strerror or exc}", box=box
        ) from None
    return sock


async def wake_failed(ctl: BoxController, box_id: str, exc: BaseException, **detail: Any) -> None:
    """Tell in the box's events why a connection could not wake it (or its ports be held)."""
    why = str(exc) or type(exc).__name__
    await ctl.db.add_event(events.draft("wake_failed", why, error=type(exc).__name__, **detail), box_id)


@dataclass
class Held:
    """The ports the keeper holds for one box."""

    bound: list[list[Any]]  # [address, host port, guest port] each
    listeners: list[socket.socket]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for s in self.listeners:
            s.close()


class Keeper:
    """The home's keeper: the ports of every box of the home that wakes on traffic."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.backend = LocalBackend.for_home(home)
        self.held: dict[str, Held] = {}
        self._lock = asyncio.Lock()
        self._store_seen: tuple[Any, ...] | None = None  # the store's files as last looked at
        self._read_by = 0.0  # when the rows are read even if the files look the same
        self.store_file = store_file(home)  # the store this keeper serves: the one its caller wrote to
        self.ended = asyncio.Event()  # set where the store was replaced: the keeper ends

    def replaced(self) -> bool:
        """Whether the home's store is no longer the file this keeper serves (the home was
        removed, and maybe made again at its path). Once so, the keeper ends."""
        now = store_file(self.home)
        if self.store_file is None:  # started before the store was made: its first is the one
            self.store_file = now
        elif now != self.store_file:
            self.ended.set()
        return self.ended.is_set()

    async def hold(self, box_id: str) -> list[list[Any]]:
        """Bind the box's ports (once) and serve them; the ports, as the record keeps them."""
        async with self._lock:
            if box_id in self.held:
                return self.held[box_id].bound
            core = self.backend.core()
            entry = await core.controller.find(box_id)  # not backend.find, which asks this keeper
            ctl, ref = core.controller, self.backend.ref_of(core, entry)
            spec = entry.spec
            if not (spec.wake_on_traffic and spec.ports):
                return []
            had = {guest: host for _, host, guest in entry.record.ports}
            held = Held([], [])
            try:
                for p in spec.ports:
                    host = p.host or had.get(p.guest, 0)
                    sock = bind_port(entry.name, p.address, host, ephemeral=not p.host)
                    held.listeners.append(sock)
                    held.bound.append([p.address, sock.getsockname()[1], p.guest])
            except BaseException:
                held.close()
                raise
            pairs = zip(held.listeners, spec.ports, strict=True)
            held.tasks = [self._serve(ref, sock, p.guest) for sock, p in pairs]
            self.held[entry.id] = held
            if sorted(held.bound) != sorted(list(b) for b in entry.record.ports):
                rec = await ctl.db.update(entry.id, ports=held.bound)
                if rec is not None:
                    entry.update(rec)
            return held.bound

    def _serve(self, ref: LocalBoxRef, listener: socket.socket, guest: int) -> asyncio.Task[None]:
        async def spawn(*argv: str, user: str | None = None, stdin: bool = True) -> AsyncProcess:
            return await self.backend.spawn(ref, Command(argv, user=user, stdin=stdin))

        async def connect() -> Duplex:
            with events.acting_as(WAKER, f"a connection to its port {guest}"):
                return await open_relay(spawn, guest, RELAY_TIMEOUT)

        async def refused(exc: BaseException) -> None:
            if isinstance(exc, GuestConnectionRefusedError):  # it woke; nothing listens on its port
                return
            ctl, entry = await local(ref).existing()
            await wake_failed(ctl, entry.id, exc, port=guest)

        return serve_on(listener, connect, refused)

    def release(self, box_id: str) -> None:
        held = self.held.pop(box_id, None)
        if held is not None:
            held.close()

    async def adopt(self) -> None:
        """Hold the ports of every box of the home that wakes on traffic."""
        core = self.backend.core()
        for entry in await core.controller.list():
            if not (entry.spec.wake_on_traffic and entry.spec.ports):
                continue
            try:
                await self.hold(entry.id)
            except BoxNotFound:
                continue
            except SandlotError as exc:  # a port taken meanwhile: said, and tried at the next ensure
                await wake_failed(core.controller, entry.id, exc)

    async def look(self) -> None:
        """Let go of the ports of boxes that were removed: their rows are gone (the store's
        rows alone, read as they are: recovering every box of the home each round, as
        ``controller.list`` does, is the work of whoever uses them). The rows are read only
        when the store's files changed since the last look: a home whose boxes all sleep
        costs a stat of two files a round, not a read of a thousand rows."""
        if not self.held:
            return
        seen = store_stamp(self.home)
        if seen == self._store_seen and time.monotonic() < self._read_by:
            return
        if seen[0] is None:  # the home's store is gone, and every row with it
            present: set[str] = set()
        else:
            present = {rec.id for rec in await self.backend.core().controller.db.list()}
        self._store_seen, self._read_by = seen, time.monotonic() + READ_ANYWAY
        for box_id in [b for b in self.held if b not in present]:
            self.release(box_id)

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.replaced():  # no answer: the caller asks again, of the next keeper
            writer.close()
            return
        try:
            request = json.loads(await reader.readline())
            if "hold" in request:
                reply: dict[str, Any] = {"ports": await self.hold(str(request["hold"]))}
            elif "release" in request:
                self.release(str(request["release"]))
                reply = {}
            else:
                raise ValueError(f"neither hold nor release: {request!r:.200}")
        except SandlotError as exc:
            reply = {"error": str(exc), "code": exc.code}
        except (ValueError, TypeError) as exc:
            reply = {"error": f"a malformed request: {exc}", "code": "invalid_argument"}
        with contextlib.suppress(ConnectionError):
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            writer.close()

    async def run(self) -> None:
        path = socket_path(self.home)
        listener = private_listener(path, socket.SOCK_STREAM, 128)  # we hold the lock
        server = await asyncio.start_unix_server(self.answer, sock=listener)
        try:
            await self.adopt()
            idle_since = time.monotonic()
            while True:
                with contextlib.suppress(TimeoutError):  # a request that found the store replaced wakes it
                    await asyncio.wait_for(self.ended.wait(), LOOK_EVERY)
                if self.replaced():
                    break
                with contextlib.suppress(SandlotError):  # the store busy: looked at again next time
                    await self.look()
                if self.held:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > IDLE_EXIT:
                    break
        finally:
            # callers find no socket from here on (and start the next keeper); one that
            # connected meanwhile has its connection reset, and asks again
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            server.close()
            for held in self.held.values():
                held.close()
            await self.backend.core().close()


def main() -> None:
    home = Path(sys.argv[1])
    lock = try_flock(socket_path(home).with_suffix(".lock"))
    if lock is None:
        return  # another keeper runs
    # a listening socket a port of every such box of the home, and two a connection
    # through one: a thousand sleeping boxes pass the usual soft limit of 1024
    with contextlib.suppress(ValueError, OSError):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    asyncio.run(Keeper(home).run())


if __name__ == "__main__":
    main()
