"""A saved state as a manifest: the list of content-addressed chunks it is made of.

A state saved through the engine's ``StateSink`` is memory images (a VM's RAM blocks)
cut at fixed ``CHUNK`` offsets, and byte streams (the rest of the state) cut into
``CHUNK`` pieces. Each piece is named by the BLAKE3 hash of its bytes; the manifest
lists, for each image, which of its chunks are not all zeros (a bitmap) and their
hashes, and for each stream its hashes in order. The chunks themselves are in the
home's chunk store (``core.chunks``); the manifest is a row of the store's ``states``
table, written in the transaction that adds its snapshot's row, so that the chunks
it references are counted there too.

Encoding: ``MAGIC``, the length of a JSON header, the header, then the digests (32
bytes each) of every image's non-zero chunks and every stream's chunks, in the
header's order. The digests are what a reference count is kept of; nothing else in
the manifest repeats per chunk, so a 512 MiB image whose memory is mostly zeros costs
a kilobyte of bitmap, and one whose every chunk holds data 256 KiB of digests.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptSnapshot

# Memory is cut into chunks of this size at fixed guest-physical offsets. Measured on a
# 512 MiB box with 200 MiB live, four saves one second apart, 4 MiB written between each:
# 3.5k-7.3k pages changed (14-29 MiB); counted in chunks of 4 KiB they are those bytes, of
# 64 KiB 1.2-1.5 times them, of 256 KiB 1.5-2.2 times, of 2 MiB 2.5-5 times (the guest
# kernel's own writes land all over its memory). 64 KiB keeps what a save adds within
# half as much again as what changed, with a sixteenth of the chunks (and of their
# files, rows and reads) that pages would cost.
CHUNK = 64 << 10
DIGEST_SIZE = 32
MAGIC = b"SLSTATE1"
_LEN = struct.Struct(">I")


@dataclass(slots=True)
class Image:
    """A memory image: ``digests[i]`` names chunk ``i`` (bytes ``i*CHUNK`` on), None if all zeros."""

    name: str
    size: int
    digests: list[bytes | None]

    def nonzero(self) -> int:
        return sum(1 for d in self.digests if d is not None)

    def chunk_size(self, index: int) -> int:
        return min(CHUNK, self.size - index * CHUNK)


@dataclass(slots=True)
class Stream:
    """A byte stream: its chunks in order (the last one shorter)."""

    name: str
    size: int
    digests: list[bytes]


@dataclass(slots=True)
class Manifest:
    engine: str
    images: list[Image] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    logical: int = 0  # bytes of content the state holds (its non-zero memory and its streams)
    added: int = 0  # bytes its save added to the chunk store (compressed; what it did not find there)

    def digests(self) -> set[bytes]:
        """Every chunk the state is made of (each once)."""
        out: set[bytes] = set()
        for img in self.images:
            out.update(d for d in img.digests if d is not None)
        for s in self.streams:
            out.update(s.digests)
        return out

    def image(self, name: str) -> Image:
        for img in self.images:
            if img.name == name:
                return img
        raise CorruptSnapshot(f"the saved state has no memory image {name!r}")

    def stream(self, name: str) -> Stream:
        for s in self.streams:
            if s.name == name:
                return s
        raise CorruptSnapshot(f"the saved state has no stream {name!r}")

    def encode(self) -> bytes:
        header: dict[str, Any] = {
            "engine": self.engine, "chunk": CHUNK, "logical": self.logical, "added": self.added,
            "images": [{"name": i.name, "size": i.size, "map": _bitmap(i.digests)} for i in self.images],
            "streams": [{"name": s.name, "size": s.size, "n": len(s.digests)} for s in self.streams],
        }  # fmt: skip
        head = json.dumps(header, separators=(",", ":")).encode()
        body = bytearray(MAGIC + _LEN.pack(len(head)) + head)
        for img in self.images:
            for d in img.digests:
                if d is not None:
                    body += d
        for s in self.streams:
            for d in s.digests:
                body += d
        return bytes(body)

    @classmethod
    def decode(cls, data: bytes, whose: str = "") -> Manifest:
        """A manifest from ``encode``'s bytes; ``CorruptSnapshot`` (naming ``whose``) if they are not one."""
        what = f"the manifest of saved state {whose}" if whose else "a saved state's manifest"
        try:
            if data[: len(MAGIC)] != MAGIC:
                raise ValueError("not a sandlot state manifest")
            (hlen,) = _LEN.unpack_from(data, len(MAGIC))
            at = len(MAGIC) + _LEN.size
            header = json.loads(data[at : at + hlen])
            at += hlen
            if header.get("chunk") != CHUNK:
                raise ValueError(f"chunks of {header.get('chunk')} bytes (this sandlot cuts {CHUNK})")
            digests = memoryview(data)[at:]

            def take(n: int) -> list[bytes]:
                nonlocal digests
                if len(digests) < n * DIGEST_SIZE:
                    raise ValueError("fewer digests than its header lists")
                out = [bytes(digests[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]) for i in range(n)]
                digests = digests[n * DIGEST_SIZE :]
                return out

            m = cls(engine=str(header["engine"]), logical=int(header["logical"]), added=int(header["added"]))
            for h in header["images"]:
                size = int(h["size"])
                present = _unbitmap(h["map"], -(-size // CHUNK))
                found = iter(take(sum(present)))
                m.images.append(Image(str(h["name"]), size, [next(found) if p else None for p in present]))
            for h in header["streams"]:
                m.streams.append(Stream(str(h["name"]), int(h["size"]), take(int(h["n"]))))
            if len(digests):
                raise ValueError("more digests than its header lists")
            return m
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise CorruptSnapshot(f"{what} is damaged: {exc}") from None


def _bitmap(digests: list[bytes | None]) -> str:
    bits = bytearray(-(-len(digests) // 8))
    for i, d in enumerate(digests):
        if d is not None:
            bits[i >> 3] |= 1 << (i & 7)
    return base64.b64encode(bytes(bits)).decode()


def _unbitmap(text: str, n: int) -> list[bool]:
    bits = base64.b64decode(text, validate=True)
    if len(bits) != -(-n // 8):
        raise ValueError("a chunk map of the wrong length")
    return [bool(bits[i >> 3] & (1 << (i & 7))) for i in range(n)]


def digests_of(data: bytes) -> list[bytes]:
    """Every digest an encoded manifest lists, without decoding it (a reference count's view)."""
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptSnapshot("a saved state's manifest is damaged: not a sandlot state manifest")
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    at = len(MAGIC) + _LEN.size + hlen
    body = memoryview(data)[at:]
    return [bytes(body[i : i + DIGEST_SIZE]) for i in range(0, len(body) - DIGEST_SIZE + 1, DIGEST_SIZE)]
