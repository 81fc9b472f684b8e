"""A fake engine for fast unit tests: VMs are objects in this process, and their
agent is a few dozen lines of Python speaking the real wire protocol on the
real unix sockets. Lifecycle, recovery, locking and error paths run through the
real core (controller, transitions, store, sessions) in milliseconds.

``register()`` makes ``engine="fake"`` available; ``FakeEngine.of(home)`` is the
instance a home uses, to inspect or rig (``fail_boot``, ``fail_restore``, ``restore_seconds``,
``save_seconds``, ``hello_seconds``, ``never_answer``, ``vms``).

What its agent understands: HELLO, PING, CONTROL (STATUS, SHUTDOWN, SET_TIME,
MOUNT, FREEZE and THAW: ``frozen``), files (FILE_READ, FILE_WRITE, FS: a small file system held in the VM's
memory; ARCHIVE, its trees as tar streams, with the real agent's main refusals), and EXEC of ``true``,
``false``, ``echo ...``, ``exit N``, ``sleep S``,
``cat`` (its stdin back), ``lines N``, ``hostname``, ``remember K V``, ``recall K``, ``below K N``
``chmod`` and ``chgrp`` (they change nothing),
and ``/bin/sh -c "one of those"`` (or ``-lc``) or ``/bin/bash -l -c ...`` (nothing runs: the
output is made up), and the agent's relay (``box.connect(port)``) to the address of
this host that ``FakeEngine.ports`` gives that port, for every fake box. Watches
answer ENOENT. Saved states are a JSON file holding the VM's ``memory`` dict
(its files too), so a test can tell which state a VM came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import itertools
import json
import os
import posixpath
import shlex
import stat
import struct
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandlot import engine as engines
from sandlot import pids
from sandlot.engine.base import (
    VM,
    Boot,
    BootRequest,
    Connector,
    Drive,
    Engine,
    LaunchSpec,
    Placement,
    SavedState,
    StateSink,
    StateSource,
    VMRef,
    VMStatus,
    Volume,
)
from sandlot.errors import BootError, IncompatibleSnapshot, SavedStateError
from sandlot.protocol import wire
from sandlot.protocol.wire import ControlOp, ExecFlag, Fields, FsFlag, FsOp, T, Tag, WriteFlag

_pids = itertools.count(3_000_000_000)  # never a real pid
# The command line of a host process that stands for a fake VM (``FakeEngine.vm_of``), for
# the tests that hand the core the processes it looks at (``process_of``): fake VMs are
# objects here.
FAKE_VM_PROCESS = "sandlot-fake-vm"


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
        self.frozen = False  # its commands are frozen for a save (CONTROL FREEZE, until THAW)
        self._tasks: set[asyncio.Future[None]] = set()
        self._stdin: dict[int, asyncio.Queue[bytes | None]] = {}  # channel -> what the host sends on it
        self.dead = False
        self.hung = False

    # -- the process -----------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        self.where.run_dir.mkdir(parents=True, exist_ok=True)
        self.where.state_dir.mkdir(parents=True, exist_ok=True)
        (self.where.state_dir / "console.log").write_text("fake console\nsandlot-agent: ready\n")
        self.hung = self.engine.hangs > 0
        if self.hung:  # a guest that hangs before its init: the agent never opens its port
            self.engine.hangs -= 1
            return
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

    async def agent_opened(self) -> bool | None:
        return not self.hung

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
        await asyncio.sleep(self.engine.restore_seconds)
        if self.engine.fail_restore:
            self.die(1)
            raise BootError("fake: the saved state cannot be loaded")
        assert self.spec is not None and self.spec.saved is not None
        source = self.spec.saved.source
        if source is not None:
            state = await asyncio.to_thread(read_from_source, source)
        else:
            state = json.loads((self.spec.saved.directory / "state").read_text())
        self.memory = dict(state["memory"])
        self.status_now = VMStatus.RUNNING

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
        self._maybe_fail("save")
        await asyncio.sleep(self.engine.save_seconds)
        state = json.dumps({"memory": self.memory}).encode()
        if sink is None:
            (directory / "state").write_bytes(state)
        else:
            await asyncio.to_thread(write_to_sink, sink, state, self.memory)
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
        if frame.type in (T.DATA, T.EOF) and frame.channel in self._stdin:
            _stream, offset, data = wire.parse_data(frame.payload)
            queue = self._stdin[frame.channel]
            if frame.type == T.DATA:
                self._send(w, T.ACK, frame.channel, wire.data_payload(wire.STREAM_STDIN, offset + len(data)))
                queue.put_nowait(bytes(data))
            else:
                queue.put_nowait(None)
            return
        if frame.type in (T.FILE_READ, T.FILE_WRITE, T.FS):
            self.last_request = asyncio.get_running_loop().time()
            try:
                self._files(frame, w)
            except OSError as e:
                err = wire.tlv(Tag.ERRNO, e.errno or errno.EIO) + wire.tlv(Tag.MESSAGE, f"{e.strerror}")
                self._send(w, T.ERROR, frame.channel, err)
            return
        if frame.type == T.WATCH:  # no watches here: answered at once, as for a missing path
            err = wire.tlv(Tag.ERRNO, errno.ENOENT) + wire.tlv(Tag.MESSAGE, "the fake agent watches nothing")
            self._send(w, T.ERROR, frame.channel, err)
            return
        if frame.type == T.ARCHIVE:
            self.last_request = loop.time()
            f = Fields(frame.payload)
            op, path = f.u32(Tag.OP, 0) or 0, posixpath.normpath(f.str(Tag.PATH, "") or "/")
            if op == wire.ArchiveOp.WRITE:
                self._stdin[frame.channel] = asyncio.Queue()
            self._tasks.add(task := asyncio.ensure_future(self._archive(frame.channel, w, op, path)))
            task.add_done_callback(self._tasks.discard)
            return
        if frame.type not in (T.HELLO, T.PING, T.CONTROL, T.EXEC):
            return  # acknowledgements, closes: nothing to keep track of here
        f = Fields(frame.payload) if frame.type != T.PING else Fields(b"")
        ch = frame.channel
        if frame.type == T.HELLO:
            await asyncio.sleep(self.engine.hello_seconds)
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
            if op in (ControlOp.FREEZE, ControlOp.THAW):
                self.frozen = op == ControlOp.FREEZE
            self._send(w, T.CONTROL_OK, ch)
            if op == ControlOp.SHUTDOWN:
                await w.drain()
                loop.call_later(0.01, self.die, 0)
            return
        if frame.type == T.EXEC:
            self.last_request = loop.time()
            argv = tuple(v.decode() for v in f.all(Tag.ARG))
            if (f.u32(Tag.FLAGS, 0) or 0) & ExecFlag.STDIN:
                self._stdin[ch] = asyncio.Queue()
            self._tasks.add(task := asyncio.ensure_future(self._exec(argv, ch, w)))
            task.add_done_callback(self._tasks.discard)

    async def _exec(self, argv: tuple[str, ...], ch: int, w: asyncio.StreamWriter) -> None:
        self.busy += 1
        try:
            pid = 4242 + ch  # one per channel: processes running at once have pids of their own
            self._send(w, T.EXEC_STARTED, ch, wire.tlv(Tag.PID, pid) + wire.tlv(Tag.WINDOW, wire.WINDOW))
            if argv[:2] == ("/bin/bash", "-l"):  # what E2B's SDKs send: bash -l -c "..."
                argv = ("/bin/sh", *argv[2:])
            if len(argv) == 3 and argv[0] in ("sh", "/bin/sh") and argv[1] in ("-c", "-lc"):
                argv = tuple(shlex.split(argv[2])) or ("true",)
            out, err, code = b"", b"", 0
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
            elif argv[0] in ("chmod", "chgrp"):  # what the OpenAI Agents SDK runs on each file it makes
                pass
            elif argv[0] == "true":  # counted in the VM's memory: a saved state tells how many ran
                self.memory["true_runs"] = int(self.memory.get("true_runs", 0)) + 1
            elif argv[0] == "remember":  # remember KEY VALUE: state that lives in the VM's memory
                self.memory[argv[1]] = argv[2]
            elif argv[0] == "recall":
                out = (str(self.memory.get(argv[1], "")) + "\n").encode()
            elif argv[0] == "below":  # below KEY N: exit 0 while the remembered number is under N
                value = int(self.memory.get(argv[1], 0))
                if value >= int(argv[2]):
                    err, code = f"{argv[1]} is {value}, not below {argv[2]}\n".encode(), 1
            elif argv[0] == "lines":  # lines N: N numbered lines on stdout
                out = b"".join(b"line %d\n" % i for i in range(int(argv[1])))
            elif argv[:2] == ("/proc/1/exe", "--relay"):
                await self._relay(argv[2], ch, w)
                return
            elif argv[0] == "cat":
                queue = self._stdin.get(ch)
                while queue is not None and (chunk := await queue.get()) is not None:
                    self._send(w, T.DATA, ch, wire.data_payload(wire.STREAM_STDOUT, len(out), chunk))
                    out += chunk
                self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDOUT, len(out)))
                self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDERR, 0))
                self._send(w, T.EXIT, ch, wire.tlv(Tag.EXIT_CODE, 0))
                return
            else:
                err, code = f"fake: {argv[0]}: not found\n".encode(), 127
            for stream, data in ((wire.STREAM_STDOUT, out), (wire.STREAM_STDERR, err)):
                if data:
                    self._send(w, T.DATA, ch, wire.data_payload(stream, 0, data))
                self._send(w, T.EOF, ch, wire.data_payload(stream, len(data)))
            self._send(w, T.EXIT, ch, wire.tlv(Tag.EXIT_CODE, code))
        finally:
            self._stdin.pop(ch, None)
            self.busy -= 1
            self.last_request = asyncio.get_running_loop().time()

    async def _relay(self, target_arg: str, ch: int, w: asyncio.StreamWriter) -> None:
        """The agent's relay (guest/agent/relay.c): "connected" on stderr, then stdin to the
        port and the port's bytes to stdout; exit 111 with the errno where it is refused. A
        Unix socket's path (a code context's kernel) is refused as in a guest where nothing
        listens there: it never answered at all, and its caller waited out its deadline."""

        def finish(code: int, out: int, err: int) -> None:
            self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDOUT, out))
            self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDERR, err))
            self._send(w, T.EXIT, ch, wire.tlv(Tag.EXIT_CODE, code))

        target = None if target_arg.startswith("/") else self.engine.ports.get(int(target_arg))
        try:
            if target_arg.startswith("/"):
                raise FileNotFoundError(errno.ENOENT, f"nothing answers on {target_arg} in the box")
            if target is None:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
            reader, writer = await asyncio.open_connection(*target)
        except OSError as e:
            said = f"errno {e.errno or errno.ECONNREFUSED}: {e.strerror or e}\n".encode()
            self._send(w, T.DATA, ch, wire.data_payload(wire.STREAM_STDERR, 0, said))
            finish(111, 0, len(said))
            return
        said = b"connected\n"
        self._send(w, T.DATA, ch, wire.data_payload(wire.STREAM_STDERR, 0, said))
        sent = 0

        async def inward() -> None:
            queue = self._stdin.get(ch)
            while queue is not None and (chunk := await queue.get()) is not None:
                writer.write(chunk)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        feeding = asyncio.ensure_future(inward())
        try:
            while data := await reader.read(65536):
                self._send(w, T.DATA, ch, wire.data_payload(wire.STREAM_STDOUT, sent, data))
                sent += len(data)
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(asyncio.shield(feeding), 1.0)
        finally:
            feeding.cancel()
            writer.close()
        finish(0, sent, len(said))

    async def _archive(self, ch: int, w: asyncio.StreamWriter, op: int, path: str) -> None:
        """ARCHIVE as the agent answers it: an exec whose stdout is the tar (READ) or whose
        stdin is (WRITE), its records on the other stream."""
        self.busy += 1
        try:
            self._send(
                w, T.EXEC_STARTED, ch, wire.tlv(Tag.PID, 5252 + ch) + wire.tlv(Tag.WINDOW, wire.WINDOW)
            )
            out, records, code = b"", b"", 0
            if op == wire.ArchiveOp.READ:
                try:
                    out, count, size = self._tar_of(path)
                    records = _record(wire.ArchiveRecord.DONE, count=count, size=size)
                except OSError as e:
                    records, code = _record(wire.ArchiveRecord.FAILED, None, e.errno or errno.EIO, str(e)), 1
            else:
                queue = self._stdin[ch]
                data = b""
                while (chunk := await queue.get()) is not None:
                    data += chunk
                try:
                    count, size = self._untar(path, data)
                    records = _record(wire.ArchiveRecord.DONE, count=count, size=size)
                except _Refused as e:
                    records, code = _record(wire.ArchiveRecord.FAILED, e.entry, e.number, e.message), 1
            streams = {
                wire.STREAM_STDOUT: out if op == wire.ArchiveOp.READ else records,
                wire.STREAM_STDERR: records if op == wire.ArchiveOp.READ else b"",
            }
            for stream, payload in streams.items():
                for i in range(0, len(payload), wire.DATA_CHUNK):
                    self._send(w, T.DATA, ch, wire.data_payload(stream, i, payload[i : i + wire.DATA_CHUNK]))
                self._send(w, T.EOF, ch, wire.data_payload(stream, len(payload)))
            self._send(w, T.EXIT, ch, wire.tlv(Tag.EXIT_CODE, code))
        finally:
            self._stdin.pop(ch, None)
            self.busy -= 1

    def _tar_of(self, root: str) -> tuple[bytes, int, int]:
        fs = self._fs()
        if _node(fs, root)["type"] != "dir":
            raise OSError(errno.ENOTDIR, f"{root}: Not a directory")
        buf = io.BytesIO()
        count = size = 0
        prefix = root.rstrip("/") + "/"
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for p in sorted(p for p in fs if p.startswith(prefix)):
                node = fs[p]
                info = tarfile.TarInfo(p[len(prefix) :])
                info.mode, info.mtime = node["mode"] & 0o7777, node["mtime"] // 1_000_000_000
                data = b""
                if node["type"] == "dir":
                    info.type = tarfile.DIRTYPE
                elif node["type"] == "symlink":
                    info.type, info.linkname = tarfile.SYMTYPE, node["target"]
                elif node["type"] == "fifo":
                    info.type = tarfile.FIFOTYPE
                else:
                    data = node["data"].encode("latin-1")
                    info.size = len(data)
                    size += len(data)
                tar.addfile(info, io.BytesIO(data))
                count += 1
        return buf.getvalue(), count, size

    def _untar(self, dest: str, data: bytes) -> tuple[int, int]:
        """The archive merged into ``dest`` once it is all read and checked (the agent's
        refusals: names that lead out, members under a link, hard links to what is not
        there before them, a directory against a non-directory)."""
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as whole:
                members = whole.getmembers()
        except tarfile.TarError as e:
            raise _Refused("", errno.EIO, f"not a whole tar archive: {e}") from None
        staged: dict[str, dict[str, Any]] = {}
        size = 0
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for m in members:
                parts = [x for x in m.name.split("/") if x not in ("", ".")]
                if m.name.startswith("/") or ".." in parts:
                    raise _Refused(m.name, errno.EXDEV, "a name that leads out of the destination: refused")
                rel = "/".join(parts)
                for i in range(1, len(parts)):
                    above = staged.get("/".join(parts[:i]))
                    if above is not None and above["type"] != "dir":
                        raise _Refused(
                            m.name, errno.ELOOP, f"{'/'.join(parts[:i])} is a symbolic link: not followed"
                        )
                    staged.setdefault(
                        "/".join(parts[:i]), {"type": "dir", "mode": 0o755, "mtime": time.time_ns()}
                    )
                if not rel:
                    continue
                node: dict[str, Any] = {"mode": m.mode & 0o7777, "mtime": int(m.mtime) * 1_000_000_000}
                if m.isdir():
                    node["type"] = "dir"
                elif m.issym():
                    node |= {"type": "symlink", "target": m.linkname}
                elif m.islnk():
                    if m.linkname not in staged:
                        raise _Refused(
                            m.name,
                            errno.ENOENT,
                            f"a hard link to {m.linkname}, which the archive "
                            "does not hold before it: refused",
                        )
                    node = dict(staged[m.linkname])
                elif m.isfifo():
                    node["type"] = "fifo"
                elif m.isfile():
                    src = tar.extractfile(m)
                    content = src.read() if src is not None else b""
                    node |= {"type": "file", "data": content.decode("latin-1")}
                    size += len(content)
                else:
                    raise _Refused(m.name, errno.EINVAL, "an entry that is not copied: refused")
                staged[rel] = node
        fs = self._fs()
        parent = posixpath.dirname(dest)
        if dest not in fs:
            _mkdirs(fs, parent)
        elif fs[dest]["type"] != "dir":
            raise _Refused(None, errno.ENOTDIR, f"{dest} is not a directory")
        for rel, node in staged.items():
            there = fs.get(posixpath.join(dest, rel))
            if there is not None and (there["type"] == "dir") != (node["type"] == "dir"):
                raise _Refused(
                    rel,
                    errno.EEXIST,
                    "cannot overwrite a directory with a non-directory, or the other way round",
                )
        fs.setdefault(dest, {"type": "dir", "mode": 0o755, "mtime": time.time_ns()})
        for rel, node in sorted(staged.items()):
            fs[posixpath.join(dest, rel)] = node
        return len(members), size

    # -- files: a dict of path -> node in the VM's memory ------------------------------------

    def _fs(self) -> dict[str, dict[str, Any]]:
        fs: dict[str, dict[str, Any]] = self.memory.setdefault("fs", {})
        if "/" not in fs:
            for d in ("/", "/tmp", "/root", "/home", "/etc"):
                fs[d] = {"type": "dir", "mode": 0o755 if d != "/tmp" else 0o1777, "mtime": time.time_ns()}
        return fs

    def _files(self, frame: wire.Frame, w: asyncio.StreamWriter) -> None:
        f = Fields(frame.payload)
        ch = frame.channel
        fs = self._fs()
        path = posixpath.normpath(f.str(Tag.PATH, "") or "/")
        flags = f.u32(Tag.FLAGS, 0) or 0
        if frame.type == T.FILE_READ:
            node = _node(fs, path)
            if node["type"] == "dir":
                raise OSError(errno.EISDIR, f"{path}: Is a directory")
            data = node["data"].encode("latin-1")
            offset = f.u64(Tag.OFFSET, 0) or 0
            length = f.u64(Tag.LENGTH, len(data))
            part = data[offset : offset + (length if length is not None else len(data))]
            self._send(
                w, T.FILE_INFO, ch, wire.tlv_u64(Tag.SIZE, len(data)) + wire.tlv(Tag.MODE, node["mode"])
            )
            if part:
                self._send(w, T.DATA, ch, wire.data_payload(wire.STREAM_STDOUT, 0, part))
            self._send(w, T.EOF, ch, wire.data_payload(wire.STREAM_STDOUT, len(part)))
            return
        if frame.type == T.FILE_WRITE:
            parent = posixpath.dirname(path)
            if parent not in fs:
                if not flags & WriteFlag.PARENTS:
                    raise OSError(errno.ENOENT, f"{parent}: No such file or directory")
                _mkdirs(fs, parent)
            if fs.get(path, {}).get("type") == "dir":
                raise OSError(errno.EISDIR, f"{path}: Is a directory")
            if flags & WriteFlag.EXCLUSIVE and path in fs:
                raise OSError(errno.EEXIST, f"{path}: File exists")
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()
            self._stdin[ch] = queue
            mode = f.u32(Tag.MODE, None)
            self._send(w, T.FILE_READY, ch, wire.tlv(Tag.WINDOW, wire.WINDOW))
            self._tasks.add(task := asyncio.ensure_future(self._write(ch, w, path, queue, flags, mode)))
            task.add_done_callback(self._tasks.discard)
            return
        op = f.u32(Tag.OP, 0)
        entries: list[bytes] = []
        xprefix = f.str(Tag.PREFIX) if flags & FsFlag.XATTRS else None
        if op == FsOp.STAT:
            node = _node(fs, path)
            entries.append(_entry(posixpath.basename(path) or "/", node, xprefix))
        elif op == FsOp.LIST:
            if _node(fs, path)["type"] != "dir":
                raise OSError(errno.ENOTDIR, f"{path}: Not a directory")
            for name in sorted(_children(fs, path)):
                entries.append(_entry(name, fs[posixpath.join(path, name)], xprefix))
        elif op == FsOp.SETXATTRS:  # a file's attributes of the prefix become those sent
            node, start = _node(fs, path), f.str(Tag.PREFIX, "") or ""
            sent = {}
            for raw in f.all(Tag.XATTR):
                (n,) = struct.unpack_from("<H", raw)
                sent[raw[2 : 2 + n].decode()] = raw[2 + n :]
            if not start or any(not k.startswith(start) or k == start for k in sent):
                raise OSError(errno.EINVAL, "an attribute's name is the prefix and more")
            kept = {k: v for k, v in node.get("xattrs", {}).items() if not k.startswith(start)}
            node["xattrs"] = {**kept, **sent}
        elif op == FsOp.MKDIR:
            if path in fs:
                if not flags & FsFlag.PARENTS:
                    raise OSError(errno.EEXIST, f"{path}: File exists")
            elif flags & FsFlag.PARENTS:
                _mkdirs(fs, path)
            else:
                _node(fs, posixpath.dirname(path))
                fs[path] = {"type": "dir", "mode": f.u32(Tag.MODE, 0o755), "mtime": time.time_ns()}
        elif op == FsOp.REMOVE:
            if path not in fs:
                if not flags & FsFlag.MISSING_OK:
                    raise OSError(errno.ENOENT, f"{path}: No such file or directory")
            elif _children(fs, path) and not flags & FsFlag.RECURSIVE:
                raise OSError(errno.ENOTEMPTY, f"{path}: Directory not empty")
            else:
                for p in [p for p in fs if p == path or p.startswith(path.rstrip("/") + "/")]:
                    del fs[p]
        elif op == FsOp.RENAME:
            dst = posixpath.normpath(f.str(Tag.PATH2, "") or "/")
            _node(fs, path)
            for p in [p for p in fs if p == path or p.startswith(path + "/")]:
                fs[dst + p[len(path) :]] = fs.pop(p)
        elif op == FsOp.CHMOD:
            _node(fs, path)["mode"] = f.u32(Tag.MODE, 0o644)
        elif op == FsOp.CHOWN:
            _node(fs, path)
        elif op == FsOp.TREE:  # the root first as "", then every path under it
            node = _node(fs, path)
            if not flags & FsFlag.SELF and node["type"] != "dir":
                raise OSError(errno.ENOTDIR, f"{path}: Not a directory")
            prefix = path.rstrip("/") + "/"
            under = [] if flags & FsFlag.SELF else sorted(p for p in fs if p.startswith(prefix) and p != path)
            found = [_tree_entry("", node), *(_tree_entry(p[len(prefix) :], fs[p]) for p in under)]
            self._send(w, T.FS_RESULT, ch, b"".join(wire.tlv(Tag.TREE_ENTRY, e) for e in found))
            return
        elif op in (FsOp.SYMLINK, FsOp.MKNOD):
            if path in fs:
                raise OSError(errno.EEXIST, f"{path}: File exists")
            _node(fs, posixpath.dirname(path))
            fs[path] = (
                {"type": "symlink", "mode": 0o777, "mtime": time.time_ns(), "target": f.str(Tag.TARGET, "")}
                if op == FsOp.SYMLINK
                else {"type": "fifo", "mode": (f.u32(Tag.MODE, 0) or 0) & 0o7777, "mtime": time.time_ns()}
            )
        self._send(w, T.FS_RESULT, ch, b"".join(wire.tlv(Tag.ENTRY, e) for e in entries))

    async def _write(self, ch: int, w: asyncio.StreamWriter, path: str, queue: asyncio.Queue[bytes | None],
                     flags: int, mode: int | None) -> None:  # fmt: skip
        data = b""
        try:
            while (chunk := await queue.get()) is not None:
                data += chunk
        finally:
            self._stdin.pop(ch, None)
        fs = self._fs()
        old = fs.get(path)
        if flags & WriteFlag.APPEND and old is not None:
            data = old["data"].encode("latin-1") + data
        keep = old["mode"] if old is not None else 0o644
        fs[path] = {"type": "file", "data": data.decode("latin-1"), "mtime": time.time_ns(),
                    "mode": mode if mode is not None else keep}  # fmt: skip
        self._send(w, T.FILE_DONE, ch, wire.tlv_u64(Tag.SIZE, len(data)))


class _Refused(Exception):
    def __init__(self, entry: str | None, number: int, message: str) -> None:
        super().__init__(message)
        self.entry, self.number, self.message = entry, number, message


def _record(
    kind: int, entry: str | None = None, number: int = 0, message: str = "", *, count: int = 0, size: int = 0
) -> bytes:
    """One record of an archive's report, as the agent's child writes it."""
    body = wire.tlv(Tag.OP, kind)
    if entry is not None:
        body += wire.tlv(Tag.PATH, entry)
    if number:
        body += wire.tlv(Tag.ERRNO, number)
    if message:
        body += wire.tlv(Tag.MESSAGE, message)
    if kind == wire.ArchiveRecord.DONE:
        body += wire.tlv(Tag.COUNT, count) + wire.tlv_u64(Tag.SIZE, size)
    return struct.pack("<I", len(body)) + body


def _node(fs: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    node = fs.get(path)
    if node is None:
        raise OSError(errno.ENOENT, f"{path}: No such file or directory")
    return node


def _children(fs: dict[str, dict[str, Any]], path: str) -> list[str]:
    prefix = path.rstrip("/") + "/"
    return [
        p[len(prefix) :] for p in fs if p.startswith(prefix) and "/" not in p[len(prefix) :] and p != path
    ]


def _mkdirs(fs: dict[str, dict[str, Any]], path: str) -> None:
    parts = [p for p in path.split("/") if p]
    for i in range(1, len(parts) + 1):
        p = "/" + "/".join(parts[:i])
        node = fs.setdefault(p, {"type": "dir", "mode": 0o755, "mtime": time.time_ns()})
        if node["type"] != "dir":
            raise OSError(errno.ENOTDIR, f"{p}: Not a directory")


_ENTRY = struct.Struct("<IIIIQqHH")


def _entry(name: str, node: dict[str, Any], xprefix: str | None = None) -> bytes:
    kind = stat.S_IFDIR if node["type"] == "dir" else stat.S_IFREG
    size = len(node.get("data", ""))
    raw = name.encode()
    out = _ENTRY.pack(kind | node["mode"], 0, 0, 1, size, node["mtime"], len(raw), 0) + raw
    if xprefix is not None:  # the attributes asked for, after the entry, as the agent puts them
        found = [(k.encode(), v) for k, v in node.get("xattrs", {}).items() if k.startswith(xprefix)]
        out += struct.pack("<H", len(found))
        out += b"".join(struct.pack("<HI", len(k), len(v)) + k + v for k, v in found)
    return out


_TREE_ENTRY = struct.Struct("<IIIIQqqQQHH")
_KINDS = {"dir": stat.S_IFDIR, "symlink": stat.S_IFLNK, "fifo": stat.S_IFIFO}
_inodes = iter(range(1000, 1 << 40))


def _tree_entry(rel: str, node: dict[str, Any]) -> bytes:
    """A TREE_ENTRY of a node, which gets an inode number the first time it is listed
    (kept in the VM's memory, so a snapshot's boxes see the same numbers)."""
    ino = node.setdefault("ino", next(_inodes))
    raw, target = rel.encode(), node.get("target", "").encode()
    size = len(node.get("data", "")) if node["type"] == "file" else len(target)
    return _TREE_ENTRY.pack(
        _KINDS.get(node["type"], stat.S_IFREG) | node["mode"], 0, 0, 1, size, node["mtime"], node["mtime"],
        ino, 0, len(raw), len(target),
    ) + raw + target  # fmt: skip


# A fake VM's memory image, as its saves give it to a ``StateSink``: one page per remembered
# key (where the key hashes to), filled from its value, the rest zeros. Two states that
# remember the same share every chunk but the ones whose pages differ.
FAKE_RAM = "fake.ram"
FAKE_RAM_BYTES = 1 << 20
FAKE_STATE = "fake.state"
PAGE = 4096


def fake_ram(memory: Mapping[str, Any]) -> bytearray:
    ram = bytearray(FAKE_RAM_BYTES)
    for key, value in memory.items():
        where = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")
        at = (where % (FAKE_RAM_BYTES // PAGE)) * PAGE
        fill = hashlib.sha256(json.dumps(value).encode()).digest()
        ram[at : at + PAGE] = (fill * (PAGE // len(fill)))[:PAGE]
    return ram


def write_to_sink(sink: StateSink, state: bytes, memory: Mapping[str, Any]) -> None:
    """A save as an engine that writes chunks makes it: its pages out of order, zero pages
    said as zeros, and a stream for the rest."""
    image = sink.image(FAKE_RAM, FAKE_RAM_BYTES)
    ram = fake_ram(memory)
    order = list(range(0, FAKE_RAM_BYTES, PAGE))
    order = order[1::2] + order[::2]
    for at in order:
        page = ram[at : at + PAGE]
        if page == bytes(PAGE):
            image.zeros(at, PAGE)
        else:
            image.pages(at, bytes(page))
    sink.stream(FAKE_STATE, state)


def read_from_source(source: StateSource) -> dict[str, Any]:
    """The state back, its memory image checked against the memory it says it held."""
    state: dict[str, Any] = json.loads(source.stream(FAKE_STATE))
    ram = bytearray(source.images()[FAKE_RAM])
    for at, data in source.extents(FAKE_RAM):
        ram[at : at + len(data)] = data
    if ram != fake_ram(state["memory"]):
        raise SavedStateError("fake: the memory image is not the memory the state says")
    return state


class FakeEngine(Engine):
    name = "fake"
    chunked_state = True

    def __init__(self, home: Path) -> None:
        self.home = home
        self.vms: dict[int, FakeVM] = {}
        self.fail: set[str] = set()  # VM operations that raise: "pause", "resume", "save"
        self.fail_boot = False
        self.fail_restore = False
        self.restore_seconds = 0.0  # how long each restore takes (a loaded host's)
        self.save_seconds = 0.0  # ... and each save
        self.hello_seconds = 0.0  # ... and each agent's answer to a HELLO (a VM still waking)
        self.never_answer = False
        self.hangs = 0  # the next this many boots hang before their init
        self.launches = 0
        self.ports: dict[int, tuple[str, int]] = {}  # a box's port -> the host address its relay reaches

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

    def vm_of(self, process: pids.Process) -> tuple[VMRef, Path] | None:
        argv = process.argv
        if len(argv) != 2 or argv[0] != FAKE_VM_PROCESS:
            return None
        return VMRef(process.pid, process.start), Path(argv[1])

    def abort_save(self, ref: VMRef, where: Placement, *, resume: bool) -> None:
        vm = self.vms.get(ref.pid)
        if vm is not None and resume:
            vm.status_now = VMStatus.RUNNING

    async def share_memory(
        self, state: SavedState, disk: Path, drives: tuple[Drive, ...] = (), shares: tuple[Volume, ...] = ()
    ) -> None:
        if state.source is not None:  # the form forks and exports read is files, from the chunks
            saved = await asyncio.to_thread(read_from_source, state.source)
            (state.directory / "state").write_text(json.dumps(saved))
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


def process_of(vm: VM) -> pids.Process:
    """The host process a fake VM would be (``FakeEngine.vm_of`` knows it)."""
    assert isinstance(vm, FakeVM)
    return pids.Process(vm.ref.pid, vm.ref.start, [FAKE_VM_PROCESS, str(vm.where.state_dir)])


def fake_rootfs(where: Path) -> Path:
    """A root filesystem directory of one file: its base disk is made in milliseconds."""
    root = where / "fake-root"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "hostname").write_text("fake\n")
    return root


def pid_of_dead_process() -> tuple[int, str]:
    """A (pid, start time) that names no living process: an owner that died."""
    return os.getpid(), "0"
