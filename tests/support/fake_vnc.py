"""A VNC server in memory, for the host side of ``box.desktop`` without a VM: it speaks
RFB 3.8 with VNC authentication as Xvnc does, keeps a framebuffer of one colour (or
what a test paints), answers every update request with Raw rectangles, and records
the pointer and key events it gets. It sits behind a fake relay process, the way
Xvnc's socket sits behind the box's relay (``bridge.open_relay``)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

from sandlot.api.rfb import vnc_auth_response

CHALLENGE = bytes(range(16))


class FakeVncServer:
    """The screen, and what its clients sent."""

    def __init__(
        self, size: tuple[int, int], password: str, colour: tuple[int, int, int] = (40, 80, 120)
    ) -> None:
        self.width, self.height = size
        self.password = password
        self.pixels = bytearray(bytes([*colour, 0]) * (self.width * self.height))
        self.events: list[tuple[Any, ...]] = []  # ("pointer", x, y, mask) / ("key", keysym, down)
        self.requests: list[tuple[int, int, int, int, int]] = []
        self.key_pressed = asyncio.Event()  # set at the first key event
        self.encodings: list[int] = []
        self.new_pointer = False  # the next request is answered with the pointer's shape alone
        # (sx, sy, x, y, w, h): CopyRect rectangles to send in the next update
        self.copies: list[tuple[int, int, int, int, int, int]] = []


class FakeVncConnection:
    """One client's connection to the server: RFB 3.8 from its first byte."""

    def __init__(self, server: FakeVncServer) -> None:
        self.server = server
        self.out: asyncio.Queue[bytes] = asyncio.Queue()
        self._in = bytearray()
        self._phase = "version"
        self.out.put_nowait(b"RFB 003.008\n")

    def feed(self, data: bytes) -> None:
        self._in += data
        while self._step():
            pass

    def _take(self, n: int) -> bytes | None:
        if len(self._in) < n:
            return None
        out = bytes(self._in[:n])
        del self._in[:n]
        return out

    def _step(self) -> bool:
        if self._phase == "version":
            if self._take(12) is None:
                return False
            self.out.put_nowait(b"\x01\x02")  # one security type: VNC authentication
            self._phase = "security"
        elif self._phase == "security":
            if self._take(1) is None:
                return False
            self.out.put_nowait(CHALLENGE)
            self._phase = "auth"
        elif self._phase == "auth":
            answer = self._take(16)
            if answer is None:
                return False
            if answer != vnc_auth_response(self.server.password, CHALLENGE):
                reason = b"Authentication failed"
                self.out.put_nowait(struct.pack(">II", 1, len(reason)) + reason)
                self.out.put_nowait(b"")
                self._phase = "closed"
                return False
            self.out.put_nowait(struct.pack(">I", 0))
            self._phase = "init"
        elif self._phase == "init":
            if self._take(1) is None:
                return False
            name = b"sandlot"
            self.out.put_nowait(
                struct.pack(">HH16sI", self.server.width, self.server.height, b"\0" * 16, len(name)) + name
            )
            self._phase = "normal"
        elif self._phase == "normal":
            return self._message()
        else:
            return False
        return True

    def _message(self) -> bool:
        if not self._in:
            return False
        kind = self._in[0]
        sizes = {0: 20, 3: 10, 4: 8, 5: 6}
        if kind == 2:
            if len(self._in) < 4:
                return False
            (n,) = struct.unpack_from(">H", self._in, 2)
            size = 4 + 4 * n
        else:
            size = sizes[kind]
        msg = self._take(size)
        if msg is None:
            return False
        if kind == 2:
            self.server.encodings = list(struct.unpack(f">{(size - 4) // 4}i", msg[4:]))
        elif kind == 3:
            incremental, x, y, w, h = struct.unpack(">xBHHHH", msg)
            self.server.requests.append((incremental, x, y, w, h))
            self._update(x, y, w, h)
        elif kind == 4:
            down, sym = struct.unpack(">xBxxI", msg)
            self.server.events.append(("key", sym, bool(down)))
            self.server.key_pressed.set()
        elif kind == 5:
            mask, x, y = struct.unpack(">xBHH", msg)
            self.server.events.append(("pointer", x, y, mask))
        return True

    def _update(self, x: int, y: int, w: int, h: int) -> None:
        if self.server.new_pointer:  # as TigerVNC does: the shape instead of the pixels asked for
            self.server.new_pointer = False
            shape = struct.pack(">HHHHi", 0, 0, 9, 2, -239) + b"\1" * (9 * 2 * 4 + 2 * 2)
            self.out.put_nowait(b"\x00\x00" + struct.pack(">H", 1) + shape)
            return
        copies, self.server.copies = self.server.copies, []
        rects = [struct.pack(">HHHHi", dx, dy, cw, ch, 1) + struct.pack(">HH", sx, sy)
                 for sx, sy, dx, dy, cw, ch in copies]  # fmt: skip
        stride = self.server.width * 4
        rows = b"".join(
            bytes(self.server.pixels[(y + i) * stride + x * 4 : (y + i) * stride + (x + w) * 4])
            for i in range(h)
        )
        rects.append(struct.pack(">HHHHi", x, y, w, h, 0) + rows)
        # a bell first, which the client passes over
        self.out.put_nowait(b"\x02" + b"\x00" + struct.pack(">xH", len(rects)) + b"".join(rects))


class FakeRelay:
    """The relay command of a box, with a new connection to a FakeVncServer."""

    def __init__(self, server: FakeVncServer) -> None:
        self.server = FakeVncConnection(server)
        self.returncode: int | None = None
        self.stdout = self._stdout()
        self.stderr = self._stderr()

    async def _stdout(self) -> AsyncIterator[bytes]:
        while self.returncode is None:
            chunk = await self.server.out.get()
            if not chunk:
                return
            yield chunk

    async def _stderr(self) -> AsyncIterator[bytes]:
        yield b"connected\n"

    async def write_stdin(self, data: bytes) -> None:
        if self.returncode is not None:
            raise BrokenPipeError("the relay has ended")
        self.server.feed(data)

    async def close_stdin(self) -> None:
        pass

    async def kill(self) -> None:
        self.returncode = -9
        self.server.out.put_nowait(b"")

    async def wait(self) -> int:
        return self.returncode or 0
