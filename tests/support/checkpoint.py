"""What a gVisor checkpoint image holds, readable. The image is a header ("gVisorSF",
the length of a JSON metadata block, the block, the block's 32-byte HMAC), then the
state as one stream of gVisor's ``compressio`` (runsc 0.0~20221219 has no option to
write it uncompressed): the chunk size (4 bytes, big-endian), then chunks, each its
compressed length (4 bytes) and that many bytes of raw deflate. (A keyed stream, which
runsc does not write here, has an HMAC after the chunk size and after each chunk; read
too, as is a header without the HMAC.) Tests that look for a string in a saved state (a secret's
value must be nowhere in one; the placeholder the box holds must be found, so that
the search is known to work) read it through here."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

MAGIC = b"gVisorSF"
HASH = 32  # an HMAC-SHA256, where the stream is keyed


def plain_state(image: Path) -> bytes:
    """The state a gVisor checkpoint image holds, every chunk decompressed and joined.
    ValueError where the image is not one, or its framing is not as above."""
    data = image.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{image} is not a gVisor checkpoint image")
    start = 16 + struct.unpack(">Q", data[8:16])[0]
    failures = []
    for header_hash, keyed in ((HASH, False), (0, False), (HASH, True), (0, True)):
        try:
            return b"".join(_chunks(data, start + header_hash, keyed))
        except ValueError as exc:
            failures.append(f"{'keyed' if keyed else 'unkeyed'} at {start + header_hash}: {exc}")
    raise ValueError(f"{image}: not a compressio stream ({'; '.join(failures)})")


def _chunks(data: bytes, pos: int, keyed: bool) -> list[bytes]:
    chunk_size = int.from_bytes(data[pos : pos + 4], "big")
    pos += 4 + (HASH if keyed else 0)
    out = []
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
        if not 0 < length <= len(data) - pos:
            raise ValueError(f"a chunk of {length} bytes at {pos - 4} of {len(data)}")
        inflate = zlib.decompressobj(-15)
        chunk = inflate.decompress(data[pos : pos + length])
        if not inflate.eof or len(chunk) > chunk_size:
            raise ValueError(f"the chunk at {pos - 4} is not one deflate stream of <= {chunk_size} bytes")
        out.append(chunk)
        pos += length + (HASH if keyed else 0)
    if not out:
        raise ValueError("no chunk")
    return out
