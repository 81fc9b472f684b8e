"""A small RFB (VNC) client, enough to drive and read a box's desktop from the host.

``box.desktop`` speaks RFB 3.8 straight to the desktop's X server (Xvnc serves VNC on a
Unix socket of the box, reached through the box's relay: ``bridge.open_relay``), so a
pointer or key event is one message and a screenshot one framebuffer update. Under
emulation that is the difference between a round trip and the start of an emulated
``xdotool`` or ``xwd`` in the guest.

Written here rather than taken from a library: the Python VNC clients are built on
Twisted (vncdotool) or need the Zlib encoding and numpy (asyncvnc), and what the
desktop needs is small: VNC authentication, the Raw and CopyRect encodings, pointer
and key events, and one framebuffer update per request.

Every request this client makes is answered by exactly one framebuffer update (it
asks for no continuous updates, and a VNC server sends no update unasked), so after
an answer nothing more is in flight, and the next update read is the answer to the
next request. ``sync`` uses that as a round trip: a one-pixel update, answered once
the server has taken every event sent before it. One answer may carry no pixels: a
new pointer shape, which the server sends instead of the update asked for (TigerVNC
clears the request with it); the request is then made again.

The pointer's shape is asked for as its own pseudo-rectangle, so the server does not
draw the pointer into the framebuffer: a screenshot is the screen's pixels alone, as
``xwd`` and ``scrot`` take it, the same in a fork wherever the pointer is.
"""

from __future__ import annotations

import struct
from typing import Protocol

from .. import records
from ..errors import ProtocolError

VERSION = b"RFB 003.008\n"
SECURITY_NONE, SECURITY_VNC_AUTH = 1, 2
ENCODING_RAW, ENCODING_COPY_RECT = 0, 1
ENCODING_CURSOR = -239  # pseudo: the pointer's shape and mask, drawn by the client if at all
MAX_ASKS = 8  # requests in a row answered without pixels before the server is called broken
# 32 bits a pixel, depth 24, little-endian true colour with red in the lowest byte:
# each pixel arrives as the bytes R, G, B, X, which Pillow reads as "RGBX" as it is
PIXEL_FORMAT = struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 1, 255, 255, 255, 0, 8, 16)
MAX_NAME = 4096
MAX_CUT_TEXT = 16 << 20
MAX_SIDE = 16384
MAX_POINTER = 512  # a pointer's side (X's largest cursors are 256)

# the button mask of a pointer event: left, middle, right, wheel up/down/left/right, back
BUTTON_BITS = {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 6, 8: 7}


class Duplex(Protocol):
    """Both directions of the connection (``bridge.Duplex``)."""

    async def read(self) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def abort(self) -> None: ...


class RfbError(ProtocolError):
    """The VNC server refused us or broke the protocol."""


class ConnectionClosed(RfbError):
    """The VNC server (or the relay to it) ended the connection."""


def vnc_auth_response(password: str, challenge: bytes) -> bytes:
    """VNC authentication: the 16-byte challenge DES-encrypted with the password (its
    first 8 bytes, each byte's bits reversed, as VNC has always done) as the key."""
    try:  # moved in cryptography 43; the old place goes in 48
        from cryptography.hazmat.decrepit.ciphers.algorithms import TripleDES
    except ImportError:  # pragma: no cover - cryptography 42
        from cryptography.hazmat.primitives.ciphers.algorithms import TripleDES
    from cryptography.hazmat.primitives.ciphers import Cipher, modes

    raw = password.encode("latin-1", errors="replace")[:8].ljust(8, b"\0")
    key = bytes(int(f"{b:08b}"[::-1], 2) for b in raw)
    encryptor = Cipher(TripleDES(key * 3), modes.ECB()).encryptor()  # one key three times: DES
    return encryptor.update(challenge) + encryptor.finalize()


class Reader:
    """Exact reads over a duplex's chunks."""

    def __init__(self, duplex: Duplex) -> None:
        self._duplex = duplex
        self._buf = bytearray()

    async def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = await self._duplex.read()
            if not chunk:
                raise ConnectionClosed("the VNC server closed the connection")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        return fmt.unpack(await self.exactly(fmt.size))


U8, U32 = struct.Struct(">B"), struct.Struct(">I")
SERVER_INIT = struct.Struct(">HH16sI")
RECT = struct.Struct(">HHHHi")
UPDATE_HEADER = struct.Struct(">xH")
COLOUR_MAP = struct.Struct(">xHH")
CUT_TEXT = struct.Struct(">3xI")
COPY_RECT = struct.Struct(">HH")


class RfbClient:
    """One RFB session: the framebuffer as this side last saw it (R, G, B, X bytes, row
    by row), pointer and key events, and updates on request."""

    def __init__(self, duplex: Duplex, reader: Reader, width: int, height: int, name: str) -> None:
        self._duplex = duplex
        self._reader = reader
        self.width, self.height, self.name = width, height, name
        self.framebuffer = bytearray(width * height * 4)
        self.buttons = 0  # the buttons this session holds down
        self.pointer: tuple[int, int] | None = None  # where this session last put the pointer
        self.closed = False
        self.sent = 0  # messages sent: whether a call got as far as the server

    @classmethod
    async def connect(cls, duplex: Duplex, password: str | None) -> RfbClient:
        """The handshake, as a shared client; raises RfbError with the server's reason."""
        reader = Reader(duplex)
        version = await reader.exactly(12)
        if not version.startswith(b"RFB 003.") or version[-1:] != b"\n":
            raise RfbError(f"not a VNC server: it said {version!r}")
        if version < b"RFB 003.008\n":
            raise RfbError(f"the VNC server speaks {version.decode(errors='replace').strip()}, not 3.8")
        await duplex.write(VERSION)
        (count,) = await reader.unpack(U8)
        if count == 0:
            raise RfbError(f"the VNC server refused the connection: {await _reason(reader)}")
        offered = set(await reader.exactly(count))
        if password is not None and SECURITY_VNC_AUTH in offered:
            await duplex.write(bytes([SECURITY_VNC_AUTH]))
            challenge = await reader.exactly(16)
            await duplex.write(vnc_auth_response(password, challenge))
        elif SECURITY_NONE in offered:
            await duplex.write(bytes([SECURITY_NONE]))
        else:
            raise RfbError(f"the VNC server offers no security type this client speaks ({sorted(offered)})")
        (result,) = await reader.unpack(U32)
        if result != 0:
            raise RfbError(f"the VNC server refused the password: {await _reason(reader)}")
        await duplex.write(b"\x01")  # shared: the viewers of people watching stay connected
        width, height, _format, name_len = await reader.unpack(SERVER_INIT)
        if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE) or name_len > MAX_NAME:
            raise RfbError(
                f"the VNC server's init is out of range ({width}x{height}, name of {name_len} bytes)"
            )
        # the screen is held here, 4 bytes a pixel: the box's server says how large it is
        if width * height > (most := records.bounds().desktop_pixels):
            records.TALLY.add("desktop", "refused")
            raise RfbError(
                f"the VNC server's screen is {width}x{height}, more than the {most:,} pixels a desktop may "
                "have on this host (SANDLOT_DESKTOP_MAX_PIXELS)"
            )
        name = (await reader.exactly(name_len)).decode(errors="replace")
        client = cls(duplex, reader, width, height, name)
        encodings = (ENCODING_COPY_RECT, ENCODING_RAW, ENCODING_CURSOR)
        await duplex.write(
            b"\x00\x00\x00\x00" + PIXEL_FORMAT
            + struct.pack(f">BxH{len(encodings)}i", 2, len(encodings), *encodings)
        )  # fmt: skip
        return client

    # -- events ------------------------------------------------------------------------------

    def pointer_event(self, x: int, y: int, buttons: int) -> bytes:
        """The message that puts the pointer at (x, y) (kept on the screen) with ``buttons``
        (a mask: ``1 << BUTTON_BITS[n]``) held."""
        self.buttons = buttons
        self.pointer = min(x, self.width - 1), min(y, self.height - 1)
        return struct.pack(">BBHH", 5, buttons, *self.pointer)

    def click_events(self, x: int, y: int, mask: int) -> list[bytes]:
        """A press and a release of the button of ``mask`` at (x, y)."""
        return [self.pointer_event(x, y, self.buttons | mask), self.pointer_event(x, y, self.buttons & ~mask)]

    @staticmethod
    def key_event(keysym: int, down: bool) -> bytes:
        """The message that presses or releases the key of ``keysym`` (the server finds
        the key, and the shift it needs)."""
        return struct.pack(">BBxxI", 4, int(down), keysym)

    async def send(self, *messages: bytes) -> None:
        await self._duplex.write(b"".join(messages))
        self.sent += len(messages)

    # -- updates -----------------------------------------------------------------------------

    def _request(self, incremental: bool, x: int, y: int, w: int, h: int) -> bytes:
        return struct.pack(">BBHHHH", 3, int(incremental), x, y, w, h)

    async def sync(self) -> None:
        """Return once the server has handled every message sent before: a one-pixel
        update, asked for and read."""
        await self._update(self._request(False, 0, 0, 1, 1))

    async def refresh(self) -> bytearray:
        """The whole framebuffer, as the server has it now."""
        await self._update(self._request(False, 0, 0, self.width, self.height))
        return self.framebuffer

    async def _update(self, request: bytes) -> None:
        for _ in range(MAX_ASKS):
            await self.send(request)
            if await self._read_update():
                return
        raise RfbError(f"the VNC server answered {MAX_ASKS} requests in a row without pixels")

    async def _read_update(self) -> int:
        """Read server messages up to and including the next framebuffer update, and
        apply it; the number of its rectangles with pixels."""
        reader = self._reader
        while True:
            (kind,) = await reader.unpack(U8)
            if kind == 0:
                break
            if kind == 1:  # colour map entries: not used with true colour, skipped
                _first, n = await reader.unpack(COLOUR_MAP)
                await reader.exactly(6 * n)
            elif kind == 2:  # bell
                continue
            elif kind == 3:  # the server's clipboard
                (length,) = await reader.unpack(CUT_TEXT)
                if length > MAX_CUT_TEXT:
                    raise RfbError(f"the VNC server sent {length} bytes of clipboard text")
                await reader.exactly(length)
            else:
                raise RfbError(f"the VNC server sent message type {kind}, which this client did not ask for")
        (count,) = await reader.unpack(UPDATE_HEADER)
        with_pixels = 0
        for _ in range(count):
            x, y, w, h, encoding = await reader.unpack(RECT)
            if encoding == ENCODING_CURSOR:  # not drawn here: skipped
                if w > MAX_POINTER or h > MAX_POINTER:
                    raise RfbError(f"the VNC server sent a pointer of {w}x{h}")
                await reader.exactly(w * h * 4 + (w + 7) // 8 * h)
                continue
            with_pixels += 1
            if x + w > self.width or y + h > self.height:
                raise RfbError(
                    f"an update of {w}x{h} at ({x}, {y}) is outside the {self.width}x{self.height} screen"
                )
            if encoding == ENCODING_RAW:
                self._put(x, y, w, h, await reader.exactly(w * h * 4))
            elif encoding == ENCODING_COPY_RECT:
                sx, sy = await reader.unpack(COPY_RECT)
                if sx + w > self.width or sy + h > self.height:
                    raise RfbError(f"a copy from ({sx}, {sy}) of {w}x{h} is outside the screen")
                self._copy(sx, sy, x, y, w, h)
            else:
                raise RfbError(f"the VNC server used encoding {encoding}, which this client did not offer")
        return with_pixels

    def _put(self, x: int, y: int, w: int, h: int, pixels: bytes) -> None:
        stride, row = self.width * 4, w * 4
        if x == 0 and w == self.width:
            self.framebuffer[y * stride : (y + h) * stride] = pixels
            return
        for i in range(h):
            start = (y + i) * stride + x * 4
            self.framebuffer[start : start + row] = pixels[i * row : (i + 1) * row]

    def _copy(self, sx: int, sy: int, x: int, y: int, w: int, h: int) -> None:
        stride, row = self.width * 4, w * 4
        # every source row read before any is written: the two areas may overlap
        rows = [
            self.framebuffer[(sy + i) * stride + sx * 4 : (sy + i) * stride + sx * 4 + row] for i in range(h)
        ]
        for i, data in enumerate(rows):
            start = (y + i) * stride + x * 4
            self.framebuffer[start : start + row] = data

    async def aclose(self) -> None:
        self.closed = True
        await self._duplex.abort()


async def _reason(reader: Reader) -> str:
    (length,) = await reader.unpack(U32)
    if length > MAX_NAME:
        raise RfbError(f"the VNC server's reason is {length} bytes long")
    return (await reader.exactly(length)).decode(errors="replace")
