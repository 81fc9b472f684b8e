"""Saved state in pieces: an exported snapshot cut into checksummed chunks that travel
through Ray's object store one by one, and put together again on the node that
imports it. Functions on files and bytes (the caller passes ``ray.put``; Ray's object
references are awaited as they are), so a damaged or missing chunk is caught here,
before the archive's own checks."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptSnapshot

CHUNK = 8 << 20  # large enough that per-object overhead vanishes, small against a node's object store


@dataclass(frozen=True, slots=True)
class Piece:
    """One chunk as it is described to the node that fetches it: where it stands in the
    archive, how long it is and its sha256."""

    index: int
    size: int
    sha256: str


def pieces(path: Path, chunk: int = CHUNK) -> Iterator[tuple[Piece, bytes]]:
    """The archive at ``path`` in chunks of ``chunk`` bytes (the last one shorter)."""
    with open(path, "rb") as f:
        index = 0
        while data := f.read(chunk):
            yield Piece(index, len(data), hashlib.sha256(data).hexdigest()), data
            index += 1


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            h.update(data)
    return h.hexdigest()


def check(piece: Piece, data: bytes) -> bytes:
    """The chunk if it is what its description says; CorruptSnapshot otherwise."""
    if len(data) != piece.size or hashlib.sha256(data).hexdigest() != piece.sha256:
        raise CorruptSnapshot(
            f"chunk {piece.index} of the moved state does not match its sha256 (damaged on the way)"
        )
    return data


class Assembly:
    """Verified chunks written, in order, to ``dest`` under a temporary name, renamed
    by ``finish`` when the whole file matches its sha256; ``abort`` leaves nothing."""

    def __init__(self, dest: Path, total_sha256: str) -> None:
        self.dest = dest
        self.tmp = dest.with_name(f".{dest.name}.part")
        self.total = total_sha256
        self.hash = hashlib.sha256()
        self.expected = 0
        self.out = open(self.tmp, "wb")  # noqa: SIM115 (closed by finish or abort)

    def add(self, piece: Piece, data: bytes) -> None:
        if piece.index != self.expected:
            raise CorruptSnapshot(f"chunk {self.expected} of the moved state is missing")
        self.out.write(check(piece, data))
        self.hash.update(data)
        self.expected += 1

    def finish(self) -> Path:
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        if self.hash.hexdigest() != self.total:
            raise CorruptSnapshot("the moved state does not match its sha256 (a chunk is missing or extra)")
        os.rename(self.tmp, self.dest)
        return self.dest

    def abort(self) -> None:
        self.out.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


def assemble(chunks: Iterable[tuple[Piece, bytes]], dest: Path, total_sha256: str) -> Path:
    """Write verified chunks, in order, to ``dest``; nothing is left behind on failure."""
    work = Assembly(dest, total_sha256)
    try:
        for piece, data in chunks:
            work.add(piece, data)
        return work.finish()
    except BaseException:
        work.abort()
        raise


async def offer(path: Path, put: Callable[[bytes], Any]) -> dict[str, Any]:
    """A file as it moves (``receive`` takes it): its pieces, read one at a time and each
    kept by ``put`` (``ray.put``), with the file's size and checksum."""
    reader = pieces(path)
    chunks = []
    while (item := await asyncio.to_thread(next, reader, None)) is not None:
        chunks.append((item[0], put(item[1])))
    return {"chunks": chunks, "size": path.stat().st_size, "sha256": await asyncio.to_thread(digest, path)}


async def receive(moved: Mapping[str, Any], dest: Path) -> Path:
    """A moved file (``offer``) put together at ``dest``: its pieces fetched (awaited) one
    at a time, each checked, then the whole; nothing is left behind on failure."""
    work = Assembly(dest, moved["sha256"])
    try:
        for piece, ref in moved["chunks"]:
            await asyncio.to_thread(work.add, piece, await ref)
        return await asyncio.to_thread(work.finish)
    except BaseException:
        work.abort()
        raise
