"""What a gVisor checkpoint image holds, readable: the image is a header ("gVisorSF",
the length of a JSON metadata block, the block), then the state in chunks, each a
raw deflate stream after a few bytes of framing (gVisor's ``compressio``; runsc
0.0~20221219 has no option to write it uncompressed). Tests that look for a string
in a saved state (a secret's value must be nowhere in one) read it through here."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

MAGIC = b"gVisorSF"
MAX_FRAMING = 64  # bytes between two chunks' deflate streams


def plain_state(image: Path) -> bytes:
    """The state a gVisor checkpoint image holds, its chunks decompressed and joined."""
    data = image.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{image} is not a gVisor checkpoint image")
    pos = 16 + struct.unpack(">Q", data[8:16])[0]
    out = []
    while pos < len(data):
        for start in range(pos, min(pos + MAX_FRAMING, len(data))):
            d = zlib.decompressobj(-15)
            try:
                chunk = d.decompress(data[start:])
            except zlib.error:
                continue
            if chunk:
                out.append(chunk)
                pos = len(data) - len(d.unused_data)
                break
        else:
            break  # the rest is framing
    return b"".join(out)
