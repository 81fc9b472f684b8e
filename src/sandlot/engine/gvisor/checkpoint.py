"""runsc's checkpoint image, taken apart for the chunk store and put back together.

The image (runsc 0.0~20221219) is a header ("gVisorSF", the length of a JSON metadata
block as 8 bytes big-endian, the block, the block's 32-byte HMAC), then the state as
one stream of gVisor's ``compressio``: the chunk size (4 bytes, big-endian), then
chunks, each its compressed length (4 bytes) and that many bytes of raw deflate, every
chunk but the last holding exactly the chunk size. runsc has no option to write it
uncompressed, and compressed bytes share nothing from one checkpoint to the next.

So a save keeps the head (all up to and with the chunk size) as it is and the state
inflated, cut at content-defined boundaries (FastCDC). Measured on a gVisor box whose
Python process held 60 MiB, two checkpoints with 4 MiB written to a file between them:
the second's inflated state (67.8 MB) shares all but 0.76 MB with the first when cut
by content, and nothing when cut at fixed offsets (the kernel's objects, saved first,
change length and shift the memory after them). A restore writes the image back with
stored deflate blocks (level 0): runsc reads any deflate, and storing is a copy, not a
compression. An image framed otherwise (a keyed stream, another runsc) is kept whole,
as runsc wrote it.
"""

from __future__ import annotations

import functools
import mmap
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import fastcdc

MAGIC = b"gVisorSF"
HEADER_HASH = 32  # the metadata block's HMAC-SHA256
_LEN = struct.Struct(">I")
_META_LEN = struct.Struct(">Q")
_STORED = struct.Struct("<BHH")  # a stored block's header: final bit and type 00, length, its complement
STORED_MAX = 0xFFFF  # bytes in one stored block
# content-defined pieces, each at most a chunk of the store (64 KiB, what it takes)
MIN_CUT, AVG_CUT, MAX_CUT = 8 << 10, 32 << 10, 64 << 10
MAX_CHUNK_SIZE = 64 << 20  # a compressio chunk size past this is no image runsc wrote


class NotFramed(ValueError):
    """The image is not framed as this module reads it: it is kept whole."""


def split(image: BinaryIO, state: BinaryIO) -> bytes:
    """The image's head; its state, inflated, written to ``state``. ``NotFramed`` where
    any part of the framing is not as above (nothing of the image is trusted: a chunk
    must inflate to exactly one deflate stream of the chunk size)."""
    first = image.read(16)
    if len(first) < 16 or not first.startswith(MAGIC):
        raise NotFramed("no gVisor checkpoint header")
    (meta_len,) = _META_LEN.unpack(first[8:16])
    if meta_len > 1 << 20:
        raise NotFramed(f"a metadata block of {meta_len} bytes")
    rest = image.read(meta_len + HEADER_HASH + _LEN.size)
    if len(rest) != meta_len + HEADER_HASH + _LEN.size:
        raise NotFramed("the header ends early")
    head = first + rest
    (chunk_size,) = _LEN.unpack(head[-_LEN.size :])
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise NotFramed(f"a chunk size of {chunk_size} bytes")
    short = False  # a chunk shorter than the chunk size was read: only the last may be
    while sized := image.read(_LEN.size):
        if len(sized) != _LEN.size or short:
            raise NotFramed("a chunk after a short one, or a cut length")
        (length,) = _LEN.unpack(sized)
        packed = image.read(length)
        if length == 0 or len(packed) != length:
            raise NotFramed(f"a chunk of {length} bytes, {len(packed)} there")
        inflate = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            data = inflate.decompress(packed, chunk_size + 1)
        except zlib.error as exc:
            raise NotFramed(f"a chunk that is not deflate: {exc}") from exc
        if not inflate.eof or inflate.unused_data or inflate.unconsumed_tail or len(data) > chunk_size:
            raise NotFramed("a chunk that is not one deflate stream of at most the chunk size")
        short = len(data) < chunk_size
        state.write(data)
    return head


def cut(state: Path) -> Iterator[bytes]:
    """The inflated state's pieces, cut where its content says (FastCDC)."""
    size = state.stat().st_size
    if size == 0:
        return
    with open(state, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        for piece in fastcdc.fastcdc(view, MIN_CUT, AVG_CUT, MAX_CUT, fat=False):
            yield view[piece.offset : piece.offset + piece.length]


def join(head: bytes, state: Iterable[bytes], out: BinaryIO, *, level: int = 0) -> None:
    """An image runsc restores: the head, then the state in chunks of the head's chunk
    size, each one deflate stream: of stored blocks written straight from the pieces
    (``level`` 0: an image read once, at once), or compressed at ``level`` (an image
    kept, which many restores read: a fork's or a template's)."""
    (chunk_size,) = _LEN.unpack(head[-_LEN.size :])
    out.write(head)
    write = _stored if level == 0 else functools.partial(_compressed, level=level)
    parts: list[memoryview] = []
    filled = 0
    for piece in state:
        view = memoryview(piece)
        while view:
            take = min(len(view), chunk_size - filled)
            parts.append(view[:take])
            filled, view = filled + take, view[take:]
            if filled == chunk_size:
                write(out, parts, filled)
                parts, filled = [], 0
    if filled:
        write(out, parts, filled)


def _stored(out: BinaryIO, parts: list[memoryview], size: int) -> None:
    """One compressio chunk: its length, then ``parts`` as deflate's stored blocks (a
    byte of header, bit 0 set on the last, then the length and its complement)."""
    blocks = [part[at : at + STORED_MAX] for part in parts for at in range(0, len(part), STORED_MAX)]
    pieces: list[bytes | memoryview] = [_LEN.pack(size + _STORED.size * len(blocks))]
    for i, block in enumerate(blocks):
        pieces += (_STORED.pack(i == len(blocks) - 1, len(block), len(block) ^ 0xFFFF), block)
    out.write(b"".join(pieces))  # one write a chunk: a copy costs less than a call a block


def _compressed(out: BinaryIO, parts: list[memoryview], size: int, *, level: int) -> None:
    """One compressio chunk: its length, then ``parts`` as one deflate stream at ``level``."""
    deflate = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    packed = b"".join([*(deflate.compress(part) for part in parts), deflate.flush()])
    out.write(_LEN.pack(len(packed)) + packed)
