"""The agent's protocol engine on the host: exec and files semantics without a
VM, and fuzzing with random and mutated frames under ASan/UBSan."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import socket
import stat
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sandlot.errors import (
    ConnectionLost,
    GuestFileNotFoundError,
    GuestOSError,
    GuestPermissionError,
    ProtocolError,
    Unsupported,
)
from sandlot.protocol import files as pfiles
from sandlot.protocol import wire
from sandlot.protocol.connection import AgentConnection
from sandlot.protocol.exec import ExecRequest, RemoteProcess
from sandlot.protocol.wire import FrameDecoder, FsOp, T, Tag

from tests.support import faults
from tests.support.hostagent import connected, spawn


def run(coro):
    return asyncio.run(coro)


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted_agent(serve: Serve, **hello: Any) -> AsyncIterator[AgentConnection]:
    """A connection, handshaken, to an agent played by ``serve`` on a socket pair;
    ``hello``: the connection's (``AgentConnection``'s keywords)."""
    host_sock, agent_sock = socket.socketpair()

    async def agent() -> None:
        await serve(*await asyncio.open_unix_connection(sock=agent_sock))

    async def connector() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(sock=host_sock)

    task = asyncio.create_task(agent())
    conn = AgentConnection(connector, request_timeout=10, **hello)
    try:
        await conn.connect(10)
        yield conn
    finally:
        await conn.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _exec(conn, argv, **kw):
    proc = await RemoteProcess.start(conn, ExecRequest(argv=argv, **kw))
    status = await proc.wait()
    return status, proc.stdout.take_buffered(), proc.stderr.take_buffered()


def test_exec_and_output_streams(tmp_path: Path) -> None:
    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            st, out, err = await _exec(conn, ["sh", "-c", "echo out; echo err >&2; exit 7"])
            assert (st.exit_code, out, err) == (7, b"out\n", b"err\n")
            st, out, _ = await _exec(conn, ["sh", "-c", "head -c 5000000 /dev/zero"])
            assert st.exit_code == 0 and out == bytes(5000000)
            with pytest.raises(GuestFileNotFoundError, match="no-such-program"):
                await _exec(conn, ["no-such-program"])

    run(go())


def test_stdin_roundtrip_and_window(tmp_path: Path) -> None:
    data = os.urandom(3 * wire.WINDOW + 12345)

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            proc = await RemoteProcess.start(conn, ExecRequest(argv=["cat"], stdin=True))
            proc.stdout.drain()  # keep cat's output flowing while we feed it, as exec() does
            await proc.write_stdin(data)
            await proc.close_stdin()
            st = await proc.wait()
            assert st.exit_code == 0
            assert proc.stdout.take_buffered() == data

    run(go())


def test_file_ops_on_host_tmp(tmp_path: Path) -> None:
    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            target = str(tmp_path / "sub" / "f.bin")
            blob = os.urandom(2_500_000)
            assert await pfiles.write_stream(conn, target, blob, mode=0o640) == len(blob)
            assert os.stat(target).st_mode & 0o777 == 0o640
            size, _mode, chunks = await pfiles.read_stream(conn, target)
            assert size == len(blob)
            assert b"".join([c async for c in chunks]) == blob
            entries = await pfiles.fs_request(conn, FsOp.LIST, str(tmp_path / "sub"))
            assert [e.name for e in entries] == ["f.bin"]
            with pytest.raises(GuestFileNotFoundError):
                await pfiles.fs_request(conn, FsOp.STAT, str(tmp_path / "missing"))
            # no temporary file is left beside the target
            assert os.listdir(tmp_path / "sub") == ["f.bin"]

    run(go())


def test_safe_mode_refuses_side_effects(tmp_path: Path) -> None:
    async def go() -> None:
        async with connected(tmp_path, safe=True) as (conn, _):
            with pytest.raises(GuestPermissionError):
                await _exec(conn, ["true"])
            with pytest.raises(GuestPermissionError):
                await pfiles.write_stream(conn, str(tmp_path / "x"), b"x")
            with pytest.raises(GuestPermissionError):
                await pfiles.fs_request(conn, FsOp.REMOVE, str(tmp_path))
            assert tmp_path.exists()

    run(go())


# ---- raw frames ------------------------------------------------------------------------


class Raw:
    """Speak raw bytes to a host agent and read back frames (which must always be valid)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.dec = FrameDecoder()
        self.pending: list[wire.Frame] = []
        sock.settimeout(10)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, ftype: int, ch: int = 0, payload: bytes = b"") -> None:
        self.send(wire.encode_frame(ftype, ch, payload))

    def hello(self) -> None:
        self.frame(
            T.HELLO,
            0,
            wire.tlv(Tag.VERSION_MIN, 1) + wire.tlv(Tag.VERSION_MAX, 1) + wire.tlv(Tag.SESSION, bytes(16)),
        )
        assert self.until(lambda f: f.type == T.HELLO_ACK)

    def until(self, pred, timeout: float = 10.0):
        """Read frames until one matches; returns it (ProtocolError if the agent's framing breaks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self.pending:
                f = self.pending.pop(0)
                if pred(f):
                    return f
            try:
                self.sock.settimeout(max(0.05, deadline - time.monotonic()))
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                break
            if not data:
                raise AssertionError("agent closed the connection")
            self.pending.extend(self.dec.feed(data))
        raise AssertionError("no matching frame from the agent")

    def ping_ok(self, tag: bytes) -> None:
        # A frame in progress may still be waiting for up to MAX_PAYLOAD bytes:
        # zeros complete it, then the agent resynchronises on our PING's magic.
        # The header of a frame over the limit (junk can forge one) has the agent
        # skip its whole claimed length, our PING included, until the input has
        # been stale for 2 s (docs/protocol.md): then a PING sent again is heard.
        for attempt in range(4):
            self.send(bytes(wire.MAX_PAYLOAD + wire.HEADER_SIZE + 16))
            self.frame(T.PING, 0, tag)
            try:
                self.until(lambda f: f.type == T.PONG and f.payload == tag, timeout=3 if attempt < 3 else 30)
                return
            except AssertionError:
                if attempt == 3:
                    raise


def _errors(raw: Raw, n: int) -> list[int]:
    got = []
    for _ in range(n):
        f = raw.until(lambda f: f.type == T.ERROR)
        got.append(wire.Fields(f.payload).u32(Tag.ERRNO))
    return got


def test_bad_frames_get_error_replies(tmp_path: Path) -> None:
    agent = spawn(tmp_path, kind="sanitize", safe=True)
    raw = Raw(agent.sock)
    try:
        raw.frame(T.EXEC, 1, b"")  # before HELLO: skipped, as leftovers of an old connection would be
        raw.send(wire.encode_frame(T.FS, 2, bytes(100))[:20])  # even half a frame
        raw.hello()
        raw.frame(0x7F, 5, b"whatever")  # unknown type
        assert _errors(raw, 1) == [errno.ENOSYS]
        raw.frame(T.EXEC, 6, b"\x01\x00\xff\xff\xff\xff")  # TLV longer than the payload
        assert _errors(raw, 1) == [errno.EINVAL]
        raw.send(struct.pack("<HBBII", wire.MAGIC, T.PING, 0, 0, wire.MAX_PAYLOAD + 1))  # oversized
        assert _errors(raw, 1) == [errno.E2BIG]
        raw.send(bytes(wire.MAX_PAYLOAD + 1))  # its payload is skipped, not buffered
        raw.send(b"garbage!")  # bad magic, then resync
        assert _errors(raw, 1) == [errno.EPROTO]
        raw.ping_ok(b"alive")
        assert agent.proc.poll() is None
    finally:
        agent.proc.kill()
        agent.proc.wait()
    assert "Sanitizer" not in agent.stderr() and "runtime error" not in agent.stderr()


def _valid_frames(tmp: Path) -> list[tuple[int, bytes]]:
    p = str(tmp)
    tl = wire.tlv
    return [
        (T.EXEC, tl(Tag.ARG, "true") + tl(Tag.ENV, "A=B") + tl(Tag.CWD, "/") + tl(Tag.FLAGS, 3)),
        (T.FS, tl(Tag.OP, FsOp.LIST) + tl(Tag.PATH, p) + tl(Tag.FLAGS, 0)),
        (T.FS, tl(Tag.OP, FsOp.STAT) + tl(Tag.PATH, p)),
        (T.FS, tl(Tag.OP, FsOp.MKDIR) + tl(Tag.PATH, p + "/d") + tl(Tag.MODE, 0o755) + tl(Tag.USER, "0:0")),
        (
            T.FILE_READ,
            tl(Tag.PATH, "/etc/hostname") + wire.tlv_u64(Tag.OFFSET, 1) + wire.tlv_u64(Tag.LENGTH, 3),
        ),
        (T.FILE_WRITE, tl(Tag.PATH, p + "/w") + tl(Tag.FLAGS, 2)),
        (T.WATCH, tl(Tag.PATH, p) + tl(Tag.FLAGS, 1)),
        (T.DATA, wire.data_payload(0, 0, b"abc")),
        (T.ACK, wire.data_payload(1, 10)),
        (T.EOF, wire.data_payload(0, 3)),
        (T.SIGNAL, tl(Tag.SIGNAL, 9) + tl(Tag.FLAGS, 1)),
        (T.RESIZE, tl(Tag.ROWS, 10) + tl(Tag.COLS, 10)),
        (T.RESUME, tl(Tag.STREAM_OFFSET, bytes(12))),
        (T.CONTROL, tl(Tag.OP, 2)),
        (T.CLOSE, b""),
        (T.HELLO, tl(Tag.VERSION_MIN, 1) + tl(Tag.VERSION_MAX, 1) + tl(Tag.SESSION, bytes(16))),
    ]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        if op < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.6 and b:
            del b[rng.randrange(len(b)) :]
        elif op < 0.8:
            b[rng.randrange(len(b) + 1) : rng.randrange(len(b) + 1)] = rng.randbytes(rng.randint(1, 16))
        elif len(b) >= 6:  # corrupt a TLV length field
            i = rng.randrange(len(b) - 5)
            b[i + 2 : i + 6] = struct.pack("<I", rng.choice([0, 1, 0xFFFF, 0xFFFFFFFF, len(b)]))
    return bytes(b)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzz_random_and_mutated_frames(tmp_path: Path, seed: int) -> None:
    """Thousands of hostile frames: the agent (ASan+UBSan build, side effects
    off) never crashes, never emits a malformed frame, and still answers."""
    rng = random.Random(seed)
    agent = spawn(tmp_path, kind="sanitize", safe=True)
    raw = Raw(agent.sock)
    valid = _valid_frames(tmp_path)
    try:
        raw.hello()
        for i in range(3000):
            r = rng.random()
            if r < 0.15:
                raw.send(rng.randbytes(rng.randint(1, 300)))
            elif r < 0.35:
                ftype = rng.choice([*list(T), rng.randrange(256)])
                payload = rng.randbytes(rng.randint(0, 200))
                raw.send(
                    struct.pack(
                        "<HBBII", wire.MAGIC, ftype, rng.choice([0, 0, 1]), rng.randrange(8), len(payload)
                    )
                )
                raw.send(payload)
            else:
                ftype, payload = rng.choice(valid)
                payload = _mutate(rng, payload)
                raw.send(
                    struct.pack("<HBBII", wire.MAGIC, ftype, 0, rng.randrange(1, 8), len(payload)) + payload
                )
            if i % 500 == 0:
                raw.ping_ok(f"p{i}".encode())
        raw.ping_ok(b"end")
        assert agent.proc.poll() is None, "agent died"
    finally:
        agent.sock.close()
        try:
            agent.proc.wait(timeout=10)  # closing the socket makes it exit, running LeakSanitizer
        except Exception:
            agent.proc.kill()
            agent.proc.wait()
    log = agent.stderr()
    assert "Sanitizer" not in log and "runtime error" not in log, log[-3000:]


def test_memory_stays_bounded_when_the_host_never_reads(tmp_path: Path) -> None:
    """A host that floods PINGs without reading replies cannot grow the agent without bound."""
    agent = spawn(tmp_path, kind="host", safe=True)
    raw = Raw(agent.sock)
    raw.hello()
    agent.sock.setblocking(False)
    ping = wire.encode_frame(T.PING, 0, bytes(60000))
    sent = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sent < 400 * len(ping):
        try:
            sent += agent.sock.send(ping)
        except BlockingIOError:
            time.sleep(0.05)
            if time.monotonic() > deadline - 15:
                break
    status = Path(f"/proc/{agent.proc.pid}/status").read_text().splitlines()
    rss_kb = int(next(line for line in status if line.startswith("VmRSS")).split()[1])
    agent.proc.kill()
    agent.proc.wait()
    assert sent < 400 * len(ping), "the agent kept reading while its replies piled up"
    assert rss_kb < 64 * 1024, f"agent RSS {rss_kb} KiB"


def test_a_lost_connection_follows_a_socket_that_appears_late(tmp_path: Path, monkeypatch) -> None:
    """A VM replaced by another process (a rollback) closes its socket before its process
    exits, and the new VM's socket appears only once it runs: the connection asks its owner
    again and retries while the socket is missing, then works on the new agent; past its
    patience it fails with the reason."""
    import sandlot.protocol.connection as connection_mod
    from sandlot.errors import ConnectionLost
    from sandlot.protocol.connection import AgentConnection

    monkeypatch.setattr(connection_mod, "RECONNECT_PAUSE", 0.01)

    async def go(missing: int, patience: float) -> tuple[int, BaseException | None]:
        monkeypatch.setattr(connection_mod, "RECONNECT_PATIENCE", patience)
        first, second = spawn(tmp_path), spawn(tmp_path)
        targets = [first.sock]
        asked = 0
        asked_enough = asyncio.Event()

        async def connector() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            if not targets:
                raise FileNotFoundError(2, "No such file or directory")
            return await asyncio.open_unix_connection(sock=targets.pop(0), limit=1 << 22)

        async def on_lost() -> BaseException | None:
            nonlocal asked
            asked += 1
            if asked > missing:  # the new VM's socket is there now
                targets.append(second.sock)
                asked_enough.set()
            return None  # the owner says: follow the box

        conn = AgentConnection(connector, request_timeout=10, on_lost=on_lost)
        try:
            await conn.connect(5)
            first.proc.kill()
            first.proc.wait()
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asked_enough.wait(), 5)
                await conn.wait_ready()
                st, out, _ = await _exec(conn, ["echo", "again"])
                assert (st.exit_code, out) == (0, b"again\n")
                return asked, None
            except ConnectionLost as exc:
                return asked, exc
        finally:
            await conn.close()
            for agent in (first, second):
                agent.proc.kill()
                agent.proc.wait()

    asked, failure = run(go(missing=3, patience=30.0))
    assert failure is None and asked == 4
    asked, failure = run(go(missing=1000, patience=0.2))
    assert isinstance(failure, ConnectionLost) and "No such file" in str(failure)


def test_a_listing_that_fails_part_way_is_an_error_not_a_short_list(tmp_path: Path) -> None:
    """readdir() failing after two entries (a failing disk, a vanished /proc
    directory) ends the listing with the error, never a list that looks complete."""
    faulty = tmp_path / "faulty-dir"
    faulty.mkdir()
    for i in range(10):
        (faulty / f"f{i}").write_text("x")
    fine = tmp_path / "fine-dir"
    fine.mkdir()
    (fine / "a").write_text("x")

    async def go() -> None:
        async with connected(tmp_path, env=faults.readdir_fails("faulty-dir")) as (conn, agent):
            with pytest.raises(GuestOSError) as failed:
                await pfiles.fs_request(conn, FsOp.LIST, str(faulty))
            assert failed.value.errno == errno.EIO and "listing cut short" in str(failed.value)
            entries = await pfiles.fs_request(conn, FsOp.LIST, str(fine))  # the session goes on
            assert [e.name for e in entries] == ["a"]
            assert agent.proc.poll() is None

    run(go())


def test_running_out_of_memory_mid_frame_never_breaks_the_framing(tmp_path: Path) -> None:
    """A command writes a byte, then 3 MB while the host reads nothing, so the socket
    fills and, once the host reads, whole 256 KB frames go out in part; every
    allocation of 64 KB or more fails meanwhile, so the rest of such a frame cannot be
    queued. The frame begun on the wire
    is finished, one not begun is sent again later: the host reads every byte, in
    order, in well-formed frames (before, the rest of a half-written frame was dropped,
    and with it the framing of the connection)."""
    armed = tmp_path / "armed"
    agent = spawn(tmp_path, kind="host", env=faults.allocations_fail(65536, armed), sndbuf=16384)
    raw = Raw(agent.sock)
    try:
        raw.hello()
        total = 3_000_000
        script = f"printf x; sleep 1; head -c {total - 1} /dev/zero | tr '\\0' x"
        raw.frame(T.EXEC, 1, ExecRequest(argv=["sh", "-c", script]).encode())
        first = raw.until(lambda f: f.channel == 1 and f.type == T.DATA)  # the stream's buffer is in place
        armed.touch()
        time.sleep(2.5)  # nothing read: the socket fills and the stream's buffer too
        got = len(wire.parse_data(first.payload)[2])
        exited = None
        while exited is None:
            f = raw.until(lambda f: f.channel == 1 and f.type in (T.DATA, T.EOF, T.EXIT, T.ERROR), timeout=30)
            assert f.type != T.ERROR, f
            if f.type == T.DATA:
                stream, offset, data = wire.parse_data(f.payload)
                if stream == 1:
                    assert offset == got, (offset, got)  # no gap, no repeat
                    assert bytes(data) == b"x" * len(data)
                    got += len(data)
                    raw.frame(T.ACK, 1, wire.data_payload(1, got))
                    if got > total // 2:  # memory comes back
                        armed.unlink(missing_ok=True)
            elif f.type == T.EXIT:
                exited = f
        assert got == total
        assert "writing them through" in agent.stderr()  # the path under test was taken
    finally:
        agent.proc.kill()
        agent.proc.wait()


def test_a_file_read_the_host_leaves_untouched_is_closed(tmp_path: Path) -> None:
    """A read whose host neither acknowledges nor closes it (its client died while the
    session lived on) is closed after the idle time, with ETIMEDOUT, and its descriptor
    freed; a read the host keeps acknowledging, however slowly, is not."""
    big = tmp_path / "big"
    with big.open("wb") as f:  # more than the slow reader reads in its time (sparse: no cost)
        f.truncate(1 << 30)
    agent = spawn(tmp_path, kind="host", args=("--read-idle-ms", "2000"))
    raw = Raw(agent.sock)

    def fds() -> int:
        return len(os.listdir(f"/proc/{agent.proc.pid}/fd"))

    try:
        raw.hello()
        before = fds()
        request = wire.tlv(Tag.PATH, str(big)) + wire.tlv_u64(Tag.OFFSET, 0)
        raw.frame(T.FILE_READ, 1, request)  # read, then never acknowledged
        raw.frame(T.FILE_READ, 3, request)  # read slowly, acknowledged all along
        acked = 0
        deadline = time.monotonic() + 30  # the idle time is 2 s: a slow host's slack
        while time.monotonic() < deadline:
            f = raw.until(lambda f: f.channel in (1, 3) and f.type in (T.DATA, T.ERROR), timeout=5)
            assert f.channel == 1 or f.type == T.DATA, f  # the slow reader's read is never closed
            if f.channel == 3:
                acked = wire.parse_data(f.payload)[1] + len(wire.parse_data(f.payload)[2])
                time.sleep(0.2)  # slow, but well inside the idle time
                raw.frame(T.ACK, 3, wire.data_payload(1, acked))
            elif f.type == T.ERROR:
                break
        else:
            pytest.fail("the untouched read was not closed")
        fields = wire.Fields(f.payload)
        assert fields.u32(Tag.ERRNO) == errno.ETIMEDOUT and "untouched" in (fields.str(Tag.MESSAGE) or "")
        assert fds() == before + 1  # the slow read's descriptor only
        raw.frame(T.CLOSE, 3)
    finally:
        agent.proc.kill()
        agent.proc.wait()


def test_a_frame_sent_as_the_transport_breaks_waits_for_the_reconnection(tmp_path: Path) -> None:
    """Between a transport's break and its reader seeing it, a frame (a stream's ACK)
    is dropped for RESUME to cover, not an error: the reconnection has not begun yet.
    (Under load, test_reconnect_resumes_streams_without_loss met that moment.)"""

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            conn.break_transport()
            conn.send_frame(T.ACK, 1, wire.data_payload(1, 10))  # the reader has not seen the break
            for _ in range(100):  # no reconnection in this harness: the reader ends the connection
                await asyncio.sleep(0.05)
                if conn.failed is not None:
                    break
            assert isinstance(conn.failed, ConnectionLost)

    run(go())


def test_a_late_hello_answer_sets_the_guest_clock_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM still restoring its memory on a loaded host answers HELLO seconds late, and
    would keep the time the first HELLO carried: each HELLO carries the time it is sent,
    and a late answer is followed by a SET_TIME with the time then, itself sent again
    while its answers come late. (The slack is a second here, not a quarter: this
    process's own round trips, on a busy host, must stay inside it.)"""
    from sandlot.protocol import connection
    from sandlot.protocol.connection import HELLO_RETRY

    monkeypatch.setattr(connection, "CLOCK_SLACK", 1.0)
    CLOCK_SLACK = connection.CLOCK_SLACK
    assert HELLO_RETRY * 1.5 > CLOCK_SLACK  # the late answer below is late by that slack

    async def go(late: float, late_sets: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
        hellos: list[int] = []
        clock_sets: list[tuple[int, int]] = []  # (time set, host time when it was set)

        async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            decoder = FrameDecoder()
            first = None
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    f = wire.Fields(frame.payload)
                    if frame.type == T.HELLO:
                        hellos.append(f.u64(Tag.TIME_NS))
                        first = first or time.monotonic()
                        if time.monotonic() - first >= late:
                            ack = wire.tlv(Tag.VERSION, wire.PROTOCOL_VERSION)
                            writer.write(wire.encode_frame(T.HELLO_ACK, 0, ack))
                    elif frame.type == T.CONTROL and f.u32(Tag.OP) == wire.ControlOp.SET_TIME:
                        if len(clock_sets) < late_sets:  # a starved guest, slow to set and answer
                            await asyncio.sleep(CLOCK_SLACK * 2)
                        clock_sets.append((f.u64(Tag.TIME_NS), time.time_ns()))
                        writer.write(wire.encode_frame(T.CONTROL_OK, frame.channel))
                await writer.drain()

        async with scripted_agent(agent):
            pass
        return hellos, clock_sets

    hellos, clock_sets = run(go(late=0))
    assert len(hellos) == 1 and clock_sets == []  # a prompt answer: the HELLO's time stands
    hellos, clock_sets = run(go(late=HELLO_RETRY * 1.5))
    assert len(hellos) >= 2 and hellos == sorted(hellos) and hellos[-1] - hellos[0] >= HELLO_RETRY * 1e9 * 0.9
    [(set_to, arrived)] = clock_sets
    assert abs(arrived - set_to) < CLOCK_SLACK * 1e9
    # a clock set answered late is set again, until one is answered in time
    hellos, clock_sets = run(go(late=HELLO_RETRY * 1.5, late_sets=2))
    assert len(clock_sets) == 3
    assert [arrived - set_to > CLOCK_SLACK * 1e9 for set_to, arrived in clock_sets] == [True, True, False]


def test_a_connection_starts_at_the_hello_answer_after_bytes_a_saved_vm_left() -> None:
    """The tail of a frame the agent was writing when its VM was saved arrives first on
    the restored VM's new connection: the handshake skips it instead of failing with
    "bad frame magic" (a mixed storm of forks and snapshots met this once)."""

    async def go() -> int:
        async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(wire.encode_frame(T.DATA, 5, b"stdout " * 300)[100:])
            decoder = FrameDecoder()
            ack = wire.encode_frame(T.HELLO_ACK, 0, wire.tlv(Tag.VERSION, wire.PROTOCOL_VERSION))
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    if frame.type == T.HELLO:
                        writer.write(ack)
                    elif frame.type == T.PING:
                        writer.write(wire.encode_frame(T.PONG, frame.channel))
                await writer.drain()

        async with scripted_agent(agent) as conn:
            await conn.ping(5)
            assert conn.info is not None
            return conn.info.protocol_version

    assert run(go()) == wire.PROTOCOL_VERSION


def test_a_tree_manifest_lists_every_path_with_what_a_diff_compares(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "f.txt").write_text("hello\n")
    (root / "a" / "b" / "c" / "deep").write_bytes(b"\0" * 3000)
    os.link(root / "a" / "f.txt", root / "hard")
    os.symlink("a/f.txt", root / "link")
    os.mkfifo(root / "fifo")
    os.chmod(root / "a" / "f.txt", 0o640)
    for i in range(3000):  # more than one batch of entries
        (root / "many").mkdir(exist_ok=True)
        (root / "many" / f"file-{i:05d}-{'x' * 60}").write_text(str(i))

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            entries = await pfiles.tree(conn, str(root))
            by_path = {e.path: e for e in entries}
            assert len(by_path) == len(entries), "each path once"
            expected = {""} | {str(p.relative_to(root)) for p in root.rglob("*")}
            assert set(by_path) == expected
            for path, e in by_path.items():
                st = os.lstat(root / path) if path else os.lstat(root)
                assert (e.mode, e.uid, e.gid, e.size, e.ino, e.nlink) == (
                    st.st_mode,
                    st.st_uid,
                    st.st_gid,
                    st.st_size,
                    st.st_ino,
                    st.st_nlink,
                ), path
                assert (e.mtime_ns, e.ctime_ns) == (st.st_mtime_ns, st.st_ctime_ns), path
            assert by_path["link"].link_target == "a/f.txt"
            assert by_path["hard"].ino == by_path["a/f.txt"].ino
            with pytest.raises(GuestOSError):  # a file is no tree
                await pfiles.tree(conn, str(root / "a" / "f.txt"))
            with pytest.raises(GuestFileNotFoundError):
                await pfiles.tree(conn, str(root / "missing"))

    run(go())


def test_a_tree_entry_with_a_path_that_climbs_out_is_a_protocol_error() -> None:
    fixed = struct.pack("<IIIIQqqQQHH", 0o100644, 0, 0, 1, 1, 0, 0, 5, 0, 5, 0)
    assert wire.parse_tree_entry(fixed + b"a/b/c"[:5]).path == "a/b/c"
    for bad in (b"../x", b"a/../", b"/etc", b"a//b", b"a\0b"):
        raw = struct.pack("<IIIIQqqQQHH", 0o100644, 0, 0, 1, 1, 0, 0, 5, 0, len(bad), 0) + bad
        with pytest.raises(ProtocolError):
            wire.parse_tree_entry(raw)
    with pytest.raises(ProtocolError):
        wire.parse_tree_entry(fixed[:20])


def test_symlink_and_mknod_make_what_a_restore_brings_back(tmp_path: Path) -> None:
    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            link = str(tmp_path / "link")
            await pfiles.fs_request(conn, FsOp.SYMLINK, link, target="../relative/target")
            assert os.readlink(link) == "../relative/target"
            with pytest.raises(GuestOSError):  # it exists now
                await pfiles.fs_request(conn, FsOp.SYMLINK, link, target="x")
            with pytest.raises(GuestOSError, match="target"):
                await pfiles.fs_request(conn, FsOp.SYMLINK, str(tmp_path / "l2"))
            fifo = str(tmp_path / "fifo")
            await pfiles.fs_request(conn, FsOp.MKNOD, fifo, mode=0o010600, rdev=0)
            assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_IMODE(os.lstat(fifo).st_mode) == 0o600
            with pytest.raises(GuestOSError):  # a regular file's mode is no special file
                await pfiles.fs_request(conn, FsOp.MKNOD, str(tmp_path / "f"), mode=0o100644, rdev=0)
            (own,) = await pfiles.tree(conn, link, self_only=True)
            assert own.path == "" and own.link_target == "../relative/target"

    run(go())


def test_the_hello_asks_for_address_space_randomization_and_hears_what_is_in_force(tmp_path: Path) -> None:
    """The real agent, on the host (where it is not pid 1, so it changes nothing): it
    answers the setting in force. A box that asked for it off and does not have it off
    is refused, naming the value, rather than running as if it had."""
    now = int(Path("/proc/sys/kernel/randomize_va_space").read_text())

    async def go(aslr: bool | None) -> int | None:
        async with connected(tmp_path, aslr=aslr) as (conn, _):
            assert conn.info is not None
            return conn.info.aslr

    assert run(go(None)) is None  # not asked: not told
    assert run(go(True)) == now
    if now != 0:
        with pytest.raises(Unsupported, match=f"left kernel.randomize_va_space at {now}"):
            run(go(False))


def test_an_agent_that_does_not_know_the_setting_cannot_turn_it_off() -> None:
    """A box restored from a state an earlier sandlot saved has that release's agent,
    which ignores the HELLO's setting: asked off, the connection is refused saying so;
    asked on (as every such box was), it goes ahead."""

    async def go(aslr: bool) -> None:
        async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            decoder = FrameDecoder()
            ack = wire.tlv(Tag.VERSION, wire.PROTOCOL_VERSION) + wire.tlv(Tag.AGENT_VERSION, "0.9")
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    if frame.type == T.HELLO:
                        writer.write(wire.encode_frame(T.HELLO_ACK, 0, ack))
                await writer.drain()

        async with scripted_agent(agent, aslr=aslr):
            pass

    run(go(True))
    with pytest.raises(Unsupported, match=r"its agent 0\.9 does not know the setting"):
        run(go(False))


@pytest.mark.parametrize("name", ["notes.txt", "n" * 220])  # the usual temporary name, and a long name's
def test_a_whole_writes_temporary_file_is_one_the_e2b_face_hides(tmp_path: Path, name: str) -> None:
    """The agent writes a whole file to a temporary one beside it (files.c), which the E2B
    face hides from a directory's watchers (server/e2b/envd.py's WRITE_TEMP): this holds
    both to one naming, by looking at the directory mid-write."""
    from sandlot.server.e2b.envd import WRITE_TEMP

    folder = tmp_path / "dir"
    folder.mkdir()
    names_mid_write: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first part"
        for _ in range(500):  # 10 s at most for the agent to open its temporary file
            if names := os.listdir(folder):
                break
            await asyncio.sleep(0.02)
        names_mid_write.extend(names)
        yield b", second part"

    async def go() -> None:
        async with connected(tmp_path) as (conn, _):
            await pfiles.write_stream(conn, str(folder / name), chunks())

    run(go())
    assert len(names_mid_write) == 1 and names_mid_write[0] != name, names_mid_write
    assert WRITE_TEMP.search(names_mid_write[0]), names_mid_write[0]  # hidden by the E2B face
    assert not WRITE_TEMP.search(name)  # the file itself is not
    assert os.listdir(folder) == [name] and (folder / name).read_bytes() == b"first part, second part"
