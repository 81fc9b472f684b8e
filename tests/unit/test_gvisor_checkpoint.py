"""A gVisor checkpoint image taken apart (its head, its state inflated and cut by
content) and put back together as runsc reads it (``engine/gvisor/checkpoint.py``);
an image framed otherwise is refused, to be kept whole. The images here are framed as
runsc 0.0~20221219 writes them; tests/vm/test_gvisor.py restores real ones."""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import pytest

from sandlot.core.manifest import CHUNK
from sandlot.engine.gvisor import checkpoint

CHUNK_SIZE = 1 << 20  # runsc's compressio chunk


def image_of(state: bytes, chunk_size: int = CHUNK_SIZE, *, level: int = 1) -> bytes:
    """An image as runsc writes one: header, metadata, its HMAC, the chunk size, then
    each chunk compressed on its own."""
    meta = json.dumps({"timestamp": "2026-12-03 09:00:28"}).encode()
    out = [b"gVisorSF", struct.pack(">Q", len(meta)), meta, os.urandom(32), struct.pack(">I", chunk_size)]
    for at in range(0, len(state), chunk_size):
        deflate = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        packed = deflate.compress(state[at : at + chunk_size]) + deflate.flush()
        out += [struct.pack(">I", len(packed)), packed]
    return b"".join(out)


def data_at(image: bytes) -> int:
    """Where the first chunk's deflate data starts."""
    return 16 + struct.unpack(">Q", image[8:16])[0] + 32 + 4 + 4


def taken_apart(image: bytes) -> tuple[bytes, bytes]:
    state = io.BytesIO()
    head = checkpoint.split(io.BytesIO(image), state)
    return head, state.getvalue()


@pytest.mark.parametrize("level", [0, 1])  # stored (an image read once), compressed (one kept)
@pytest.mark.parametrize("size", [1, CHUNK_SIZE, 3 * CHUNK_SIZE + 12345])
def test_an_image_put_back_together_holds_the_same_state_and_head(size: int, level: int) -> None:
    state = (os.urandom(40_000) + b"\0" * 70_000) * (size // 110_000) + os.urandom(size % 110_000)
    image = image_of(state)
    head, inflated = taken_apart(image)
    assert inflated == state and image.startswith(head)
    out = io.BytesIO()
    checkpoint.join(
        head, [inflated[at : at + 5000] for at in range(0, len(inflated), 5000)], out, level=level
    )
    rejoined = out.getvalue()
    assert taken_apart(rejoined) == (head, state)  # the same head, the same chunks of state
    if level and size > CHUNK_SIZE:  # kept compressed: about what runsc's own image takes
        assert len(rejoined) < len(image) * 1.1
    # each chunk one deflate stream: what any inflate reads
    pos, chunks = len(head), 0
    while pos < len(rejoined):
        (length,) = struct.unpack(">I", rejoined[pos : pos + 4])
        inflate = zlib.decompressobj(-zlib.MAX_WBITS)
        data = inflate.decompress(rejoined[pos + 4 : pos + 4 + length])
        assert inflate.eof and not inflate.unused_data
        assert len(data) == CHUNK_SIZE or pos + 4 + length == len(rejoined)  # only the last is short
        pos, chunks = pos + 4 + length, chunks + 1
    assert chunks == -(-size // CHUNK_SIZE)


def test_the_state_is_cut_by_content_so_that_shifted_bytes_cut_alike(tmp_path: Path) -> None:
    """What checkpoints share survives a shift: the kernel's objects come first in the
    state and change length from one checkpoint to the next."""
    memory = os.urandom(4 << 20)
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(os.urandom(30_000) + memory)
    second.write_bytes(os.urandom(30_123) + memory)
    cuts = [list(checkpoint.cut(p)) for p in (first, second)]
    assert b"".join(cuts[0]) == first.read_bytes() and b"".join(cuts[1]) == second.read_bytes()
    assert all(len(piece) <= CHUNK for pieces in cuts for piece in pieces)  # each a chunk the store takes
    shared = set(cuts[0]) & set(cuts[1])
    assert sum(len(p) for p in shared) > 0.95 * len(memory)
    (tmp_path / "empty").touch()
    assert list(checkpoint.cut(tmp_path / "empty")) == []


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda img: b"notgVisr" + img[8:], "no gVisor checkpoint header"),
        (lambda img: img[:20], "the header ends early"),
        (lambda img: img[:-10], "a chunk of"),
        # the first chunk's first block of a reserved type (11)
        (lambda img: img[: data_at(img)] + b"\x07" + img[data_at(img) + 1 :], "not deflate"),
    ],
)
def test_an_image_framed_otherwise_is_refused(damage: object, why: str) -> None:
    image = image_of(os.urandom(CHUNK_SIZE + 5000))
    with pytest.raises(checkpoint.NotFramed, match=why):
        taken_apart(damage(image))  # type: ignore[operator]


def test_a_chunk_past_the_chunk_size_or_after_a_short_one_is_refused() -> None:
    state = os.urandom(CHUNK_SIZE // 2)
    big = image_of(state, chunk_size=CHUNK_SIZE // 4)  # each chunk a quarter: read as a half, refused
    head_end = big.index(struct.pack(">I", CHUNK_SIZE // 4)) + 4
    lying = big[: head_end - 4] + struct.pack(">I", CHUNK_SIZE // 8) + big[head_end:]
    with pytest.raises(checkpoint.NotFramed, match="at most the chunk size"):
        taken_apart(lying)
    short_then_more = image_of(os.urandom(1000), chunk_size=CHUNK_SIZE)
    tail = image_of(os.urandom(1000))[-(len(short_then_more) - head_end) :]
    with pytest.raises(checkpoint.NotFramed, match="after a short one"):
        taken_apart(short_then_more + tail)
