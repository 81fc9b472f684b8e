"""A fake engine for fast unit tests: VMs are objects in this process, and their
agent is a few dozen lines of Python speaking the real wire protocol on the
real unix sockets. Lifecycle, recovery, locking and error paths run through the
real core (controller, transitions, store, sessions) in milliseconds.

``register()`` makes ``engine="fake"`` available; ``FakeEngine.of(home)`` is the
instance a home uses, to inspect or rig (``fail_boot``, ``fail_restore``,
``never_answer``, ``vms``).

What its agent understands: HELLO, PING, CONTROL (STATUS, SHUTDOWN, SET_TIME,
MOUNT), and EXEC of ``true``, ``false``, ``echo ...``, ``exit N`` and ``sleep S``
(nothing runs: the output is made up). Saved states are a JSON file holding
the VM's ``memory`` dict, so a test can tell which state a VM came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from pathlib import Path
from typing import Any

from sandlot import engine as engines
from sandlot.engine.base import (
    VM,
    Boot,
    BootRequest,
    Connector,
    Engine,
    LaunchSpec,
    Placement,
    SavedState,
    VMRef,
    VMStatus,
)
from sandlot.errors import BootError, IncompatibleSnapshot, SavedStateError
from sandlot.protocol import wire
from sandlot.protocol.wire import ControlOp, Fields, T, Tag

_pids = itertools.count(3_000_000_000)  # never a real pid


class FakeVM(VM):
    def __init__(self, engine: FakeEngine, where: Placement, spec: LaunchSpec | None) -> None:
        self.engine = engine
        self.where = where
        self.spec = spec
        self.ref = VMRef(next(_pids), "fake")
        self.status_now = VMStatus.LOADING if spec is not None and spec.saved else VMStatus.RUNNING
        self.memory: dict[str, Any] = {}
        self._exited: asyncio.Future[int | None] | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._clients: set[asyncio.StreamWriter] = set()
        self.last_request = 0.0
        self.busy = 0
        self._tasks: set[asyncio.Future[None]] = set()
        self.dead = False

    # -- the process -----------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        self.where.run_dir.mkdir(parents=True, exist_ok=True)
        self.where.state_dir.mkdir(parents=True, exist_ok=True)
        (self.where.state_dir / "console.log").write_text("fake console\nsandlot-agent: ready\n")
        if self.engine.never_answer:
            return
        for port in range(self.where.agent_ports):
            path = self.where.run_dir / f"agent.{port}.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._servers.append(await asyncio.start_unix_server(self._serve, path=str(path)))
        self.last_request = loop.time()

    @property
    def running(self) -> bool:
        return not self.dead

    def die(self, code: int | None = None) -> None:
        """The VM process ends (a crash, a kill, a power-off)."""
        for server in self._servers:
            server.close()
        for w in list(self._clients):
            w.close()
        self._clients.clear()
        self.dead = True
        self.engine.vms.pop(self.ref.pid, None)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(code)

    async def kill(self, grace: float = 2.0) -> None:
        self.die(0)

    def _maybe_fail(self, what: str) -> None:
        if what in self.engine.fail:
            raise SavedStateError(f"fake: {what} failed")

    async def pause(self) -> None:
        self._maybe_fail("pause")
        self.status_now = VMStatus.PAUSED

    async def resume(self) -> None:
        self._maybe_fail("resume")
        self.status_now = VMStatus.RUNNING

    async def status(self) -> VMStatus:
        return self.status_now if self.running else VMStatus.GONE

    async def run_restored(self, timeout: float) -> None:
        if self.engine.fail_restore:
            self.die(1)
            raise BootError("fake: the saved state cannot be loaded")
        assert self.spec is not None and self.spec.saved is not None
        state = json.loads((self.spec.saved.directory / "state").read_text())
        self.memory = dict(state["memory"])
        self.status_now = VMStatus.RUNNING

    async def save(self, directory: Path, *, new_disk: Path | None, keep_running: bool) -> float:
        self._maybe_fail("save")
        (directory / "state").write_text(json.dumps({"memory": self.memory}))
        self.status_now = VMStatus.RUNNING if keep_running else VMStatus.PAUSED
        return 0.001

    async def published_ports(self) -> list[tuple[str, int, int]]:
        return []

    def agent_connector(self, port: int) -> Connector:
        path = str(self.where.run_dir / f"agent.{port}.sock")

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_unix_connection(path)

        return connect

    def saved_facts(self) -> dict[str, Any]:
        spec = self.spec
        return {"engine": "fake", "accel": "fake", "agent_ports": self.where.agent_ports,
                "memory_mib": spec.memory_mib if spec else 256, "cpus": spec.cpus if spec else 1,
                "network": bool(spec and spec.network), "engine_facts": {"fake": "1"}}  # fmt: skip

    def console_tail(self, lines: int = 40) -> str:
        return "fake console"

    def failure(self, what: str) -> BootError:
        return BootError(what, "fake console")

    def cleanup(self) -> None:
        for port in range(self.where.agent_ports):
            with contextlib.suppress(FileNotFoundError):
                (self.where.run_dir / f"agent.{port}.sock").unlink()

    # -- the agent --------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        decoder = wire.FrameDecoder()
        try:
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    await self._frame(frame, writer)
        except (ConnectionError, OSError):
            pass
        finally:
            self._clients.discard(writer)
            writer.close()

    def _send(
        self, writer: asyncio.StreamWriter, frame_type: int, channel: int, payload: bytes = b""
    ) -> None:
        if not writer.is_closing():
            writer.write(wire.encode_frame(frame_type, channel, payload))

    async def _frame(self, frame: wire.Frame, w: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        if frame.type in (T.FILE_READ, T.FILE_WRITE, T.FS, T.WATCH):
            # no file system here: answered at once, as a guest without the path would
            err = wire.tlv(Tag.ERRNO, 2) + wire.tlv(Tag.MESSAGE, "the fake agent has no file system")
            self._send(w, T.ERROR, frame.channel, err)
            return
        if frame.type not in (T.HELLO, T.PING, T.CONTROL, T.EXEC):
            return  # acknowledgements, closes: nothing to keep track of here
        f = Fields(frame.payload) if frame.type != T.PING else Fields(b"")
        ch = frame.channel
        if frame.type == T.HELLO:
            hostname = f.str(Tag.HOSTNAME, "")
            if hostname:
                self.memory["hostname"] = hostname
            ack = (wire.tlv(Tag.VERSION, wire.PROTOCOL_VERSION) + wire.tlv(Tag.AGENT_VERSION, "fake")
                   + wire.tlv(Tag.BOOT_ID, "fake-boot") + wire.tlv(Tag.WINDOW, wire.WINDOW)
                   + wire.tlv(Tag.MAX_PAYLOAD, wire.MAX_PAYLOAD))  # fmt: skip
            self._send(w, T.HELLO_ACK, 0, ack)
            return
        if frame.type == T.PING:
            self._send(w, T.PONG, ch, frame.payload)
            return
        if frame.type == T.CONTROL:
            op = f.u32(Tag.OP, 0)
            if op == ControlOp.STATUS:
                idle_ms = int((loop.time() - self.last_request) * 1000)
                self._send(
                    w, T.CONTROL_OK, ch, wire.tlv(Tag.COUNT, self.busy) + wire.tlv_u64(Tag.IDLE_MS, idle_ms)
                )
                return
            self.last_request = loop.time()
            self._send(w, T.CONTROL_OK, ch)
            if op == ControlOp.SHUTDOWN:
                await w.drain()
                loop.call_later(0.01, self.die, 0)
            return
        if frame.type == T.EXEC:
            self.last_request = loop.time()
            argv = tuple(v.decode() for v in f.all(Tag.ARG))
            self._tasks.add(task := asyncio.ensure_future(self._exec(argv, ch, w)))
            task.add_done_callback(self._tasks.discard)

    async def _exec(self, argv: tuple[str, ...], ch: int, w: asyncio.StreamWriter) -> None:
        self.busy += 1
        try:
            self._send(w, T.EXEC_STARTED, ch, wire.tlv(Tag.PID, 4242) + wire.tlv(Tag.WINDOW, wire.WINDOW))
            out, code = b"", 0
            if argv[0] == "echo":
                out = (" ".join(argv[1:]) + "\n").encode()
            elif argv[0] == "false":
                code = 1
            elif argv[0] == "exit":
                code = int(argv[1])
            elif argv[0] == "sleep":
                await asyncio.sleep(float(argv[1]))
            elif argv[0] == "hostname":
                out = (str(self.memory.get("hostname", "fake")) + "\n").encode()
            elif argv[0] == "true":  # counted in the VM's memory: a saved state tells how many ran
                self.memory["true_runs"] = int(self.memory.get("true_runs", 0)) + 1
            elif argv[0] == "remember":  # remember KEY VALUE: state that lives in the VM's memory
                self.memory[argv[1]] = argv[2]
            elif argv[0] == "recall":
                out = (str(self.memory.get(argv[1], "")) + "\n").encode()
            if out:
                self._send(w, T.DATA, ch, wire.data_payload(wire.STREAM_STDOUT, 0, out))
            self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDOUT, len(out)))
            self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDERR, 0))
            self._send(w, T.EXIT, ch, wire.tlv(Tag.EXIT_CODE, code))
        finally:
            self.busy -= 1
            self.last_request = asyncio.get_running_loop().time()


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, home: Path) -> None:
        self.home = home
        self.vms: dict[int, FakeVM] = {}
        self.fail: set[str] = set()  # VM operations that raise: "pause", "resume", "save"
        self.fail_boot = False
        self.fail_restore = False
        self.never_answer = False
        self.launches = 0

    @classmethod
    def of(cls, home: Path | str) -> FakeEngine:
        """The fake engine the runtime of ``home`` uses (made now if no box used it yet)."""
        from sandlot.core.runtime import Runtime

        engine = Runtime.for_home(home).engine("fake")
        assert isinstance(engine, cls)
        return engine

    def prepare(self, request: BootRequest) -> Boot:
        return Boot(
            engine="fake", accel="fake", accel_reason="fake", record={"accel": "fake"}, identity=("fake",)
        )

    async def launch(self, spec: LaunchSpec) -> FakeVM:
        self.launches += 1
        if self.fail_boot:
            raise BootError("fake: the VM would not start", "fake console")
        vm = FakeVM(self, spec.where, spec)
        await vm.start()
        self.vms[vm.ref.pid] = vm
        return vm

    def attach(self, ref: VMRef, where: Placement, boot: dict[str, Any]) -> VM:
        vm = self.vms.get(ref.pid)
        if vm is not None:
            return vm
        gone = FakeVM(self, where, None)
        gone.ref = ref
        gone.dead = True
        gone._exited = asyncio.get_running_loop().create_future()
        gone._exited.set_result(None)
        return gone

    def alive(self, ref: VMRef | None, box_id: str) -> bool:
        return ref is not None and ref.pid in self.vms and self.vms[ref.pid].running

    def probe(self, ref: VMRef | None, where: Placement) -> VMStatus:
        if ref is None or not self.alive(ref, where.box_id):
            return VMStatus.GONE
        return self.vms[ref.pid].status_now

    def kill_now(self, ref: VMRef | None, box_id: str) -> None:
        if ref is not None and ref.pid in self.vms:
            self.vms[ref.pid].die(None)

    def abort_save(self, ref: VMRef, where: Placement, *, resume: bool) -> None:
        vm = self.vms.get(ref.pid)
        if vm is not None and resume:
            vm.status_now = VMStatus.RUNNING

    async def share_memory(self, state: SavedState, disk: Path) -> None:
        (state.directory / "shared").write_text("1")

    def memory_shared(self, directory: Path) -> bool:
        return (directory / "shared").is_file()

    def state_files(self, directory: Path) -> dict[str, Path]:
        return {"devices": directory / "state", "memory": directory / "shared"}

    def check_compatible(self, facts: dict[str, Any], boot: Boot) -> None:
        if facts.get("engine") != "fake":
            raise IncompatibleSnapshot(f"saved by the {facts.get('engine')} engine, not fake")

    def facts_for_import(self, facts: dict[str, Any], boot: Boot) -> dict[str, Any]:
        return facts

    def usage(self, ref: VMRef | None) -> dict[str, Any]:
        return {"cpu_seconds": 0.0, "rss_bytes": 0}

    def host_limits(self, ref: VMRef | None) -> dict[str, Any] | None:
        return None

    def doctor(self) -> dict[str, Any]:
        return {"engine": "fake"}


def register() -> None:
    engines.register("fake", FakeEngine)


def fake_rootfs(where: Path) -> Path:
    """A root filesystem directory of one file: its base disk is made in milliseconds."""
    root = where / "fake-root"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "hostname").write_text("fake\n")
    return root


def pid_of_dead_process() -> tuple[int, str]:
    """A (pid, start time) that names no living process: an owner that died."""
    return os.getpid(), "0"
