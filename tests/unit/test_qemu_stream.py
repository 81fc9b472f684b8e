"""QEMU's migration stream taken apart into memory images and put together again
(``engine/qemu/stream.py``), on streams written here the way QEMU 7.2 writes them: its
pages in any order across parts, a part continuing the block of the part before,
zero pages, footers, the devices' sections and the description after the end. A real
QEMU's streams go through the same code in every snapshot, suspend and restore of the
VM tier (tests/vm/test_livestate.py, tests/vm/test_chunks.py)."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator

import pytest

from sandlot.engine.base import ImageSink, StateSink, StateSource
from sandlot.engine.qemu import stream
from sandlot.errors import SavedStateError

PAGE = 4096
BLOCKS = {"microvm.ram": 64 * PAGE, "pc.bios": 4 * PAGE}


def u32(v: int) -> bytes:
    return struct.pack(">I", v)


def u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def name(s: str) -> bytes:
    return bytes([len(s)]) + s.encode()


class MemorySink(StateSink):
    def __init__(self, calls: list[tuple[str, int, int]] | None = None) -> None:
        self.images: dict[str, bytearray] = {}
        self.seen: dict[str, set[int]] = {}
        self.streams: dict[str, bytes] = {}
        self.calls = calls if calls is not None else []  # (image, offset, length) of each call

    @classmethod
    def holding(cls, memory: dict[str, bytes]) -> MemorySink:
        """A sink as a split of a stream of ``memory`` leaves it (with a head and a tail)."""
        sink = split(qemu_stream({k: bytes(len(v)) for k, v in memory.items()}))
        sink.images = {k: bytearray(v) for k, v in memory.items()}
        return sink

    def image(self, name: str, size: int) -> ImageSink:
        self.images[name] = bytearray(b"\xee" * size)  # never-written bytes show
        self.seen[name] = set()
        sink = self

        class Img(ImageSink):
            def pages(self, offset: int, data: bytes | memoryview) -> None:
                sink.calls.append((name, offset, len(data)))
                sink.images[name][offset : offset + len(data)] = data
                sink.seen[name].update(range(offset, offset + len(data), PAGE))

            def zeros(self, offset: int, length: int) -> None:
                self.pages(offset, bytes(length))

        return Img()

    def stream(self, name: str, data: bytes) -> None:
        self.streams[name] = data


class MemorySource(StateSource):
    def __init__(self, sink: MemorySink) -> None:
        self.sink = sink

    def images(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.sink.images.items()}

    def extents(self, name: str) -> Iterator[tuple[int, bytes]]:
        img = self.sink.images[name]
        for at in range(0, len(img), 4 * PAGE):  # extents of four pages, zero ones left out
            piece = bytes(img[at : at + 4 * PAGE])
            if piece != bytes(len(piece)):
                yield at, piece

    def stream(self, name: str) -> bytes:
        return self.sink.streams[name]

    def streams(self) -> list[str]:
        return list(self.sink.streams)


def qemu_stream(memory: dict[str, bytes], seed: int = 1, *, footers: bool = True, parts: int = 3) -> bytes:
    """A stream as QEMU 7.2 writes it: every page once, in a shuffled order, over
    ``parts`` parts (a part's first page continuing the block of the last part's)."""
    rng = random.Random(seed)
    footer = (lambda sid: bytes([0x7E]) + u32(sid)) if footers else (lambda sid: b"")
    out = bytearray(u32(0x5145564D) + u32(3))
    out += bytes([0x07]) + u32(7) + b"microvm"
    out += bytes([0x01]) + u32(2) + name("ram") + u32(0) + u32(4)
    out += u64(sum(len(v) for v in memory.values()) | 0x04)
    for block, data in memory.items():
        out += name(block) + u64(len(data))
    out += u64(0x10) + footer(2)
    pages = [(b, at) for b, data in memory.items() for at in range(0, len(data), PAGE)]
    rng.shuffle(pages)
    last = None
    for i in range(parts):
        out += bytes([0x02 if i < parts - 1 else 0x03]) + u32(2)
        for block, at in pages[i * len(pages) // parts : (i + 1) * len(pages) // parts]:
            page = memory[block][at : at + PAGE]
            zero = page == bytes(PAGE)
            flags = (0x02 if zero else 0x08) | (0x20 if block == last else 0)
            out += u64(at | flags) + (b"" if block == last else name(block))
            out += b"\0" if zero else page
            last = block
        out += u64(0x10) + footer(2)
    # the devices: sections sandlot never reads into, kept byte for byte
    out += bytes([0x04]) + u32(3) + name("timer") + u32(0) + u32(2) + bytes(range(40)) + footer(3)
    out += (
        bytes([0x04]) + u32(4) + name("cpu") + u32(0) + u32(12) + random.Random(0).randbytes(300) + footer(4)
    )
    out += bytes([0x00]) + bytes([0x06]) + u32(12) + b'{"vmdesc":1}'
    return bytes(out)


def memory(seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    out = {}
    for block, size in BLOCKS.items():
        data = bytearray(size)
        for at in range(0, size, PAGE):
            if rng.random() < 0.6:
                data[at : at + PAGE] = rng.randbytes(PAGE)
        out[block] = bytes(data)
    return out


def split(data: bytes, calls: list[tuple[str, int, int]] | None = None) -> MemorySink:
    pieces = [data[i : i + 777] for i in range(0, len(data), 777)]  # a pipe gives it in pieces
    pieces.reverse()
    sink = MemorySink(calls)
    stream.split(lambda n: pieces.pop() if pieces else b"", sink)
    return sink


def join(sink: MemorySink) -> bytes:
    out = bytearray()
    stream.join(MemorySource(sink), out.extend)
    return bytes(out)


@pytest.mark.parametrize("footers", [True, False])
def test_a_stream_taken_apart_holds_every_page_and_goes_back_together(footers: bool) -> None:
    mem = memory()
    sink = split(qemu_stream(mem, footers=footers))
    assert {k: bytes(v) for k, v in sink.images.items()} == mem
    assert all(len(sink.seen[b]) == len(mem[b]) // PAGE for b in mem)  # every page was said
    assert sink.streams[stream.TAIL].startswith(b"\x04") and sink.streams[stream.TAIL].endswith(
        b'{"vmdesc":1}'
    )
    again = split(join(sink))
    assert {k: bytes(v) for k, v in again.images.items()} == mem
    assert again.streams == sink.streams  # the head and the devices' state, byte for byte


def test_the_joined_stream_is_one_part_in_address_order_with_zero_pages_said() -> None:
    mem = memory(3)
    joined = join(split(qemu_stream(mem, seed=9)))
    # the same memory saved in another order joins to the same bytes
    assert joined == join(split(qemu_stream(mem, seed=10, parts=5)))
    assert joined.count(b"microvm.ram") == 2  # named in the setup, then once before its first page


def test_runs_of_pages_in_address_order_reach_the_image_a_run_at_a_time() -> None:
    # as QEMU writes a box's memory: long runs of zero pages (one record of 9 bytes each)
    # between runs of data, a run ending at its block's end, the next block's after it
    mem = {"microvm.ram": bytearray(64 * PAGE), "pc.bios": bytearray(4 * PAGE)}
    for at in (5, 6, 7, 40, 63):
        mem["microvm.ram"][at * PAGE : (at + 1) * PAGE] = random.Random(at).randbytes(PAGE)
    mem["pc.bios"][:PAGE] = b"\x01" * PAGE
    ordered = {k: bytes(v) for k, v in mem.items()}
    calls: list[tuple[str, int, int]] = []
    sink = split(join(MemorySink.holding(ordered)), calls)
    assert {k: bytes(v) for k, v in sink.images.items()} == ordered
    assert all(len(sink.seen[b]) == len(ordered[b]) // PAGE for b in ordered)
    # zeros 0-4, data 5-7, zeros 8-39, data 40, zeros 41-62, data 63; then the BIOS's
    # (even where a run is cut by the pieces the stream is read in, a run is a few calls)
    assert len([c for c in calls if c[0] == "microvm.ram"]) <= 6 + 4, calls


@pytest.mark.parametrize(
    ("cut", "why"),
    [
        (lambda s: b"XXXX" + s[4:], "no QEMU_VM_FILE_MAGIC"),
        (lambda s: s[:4] + u32(2) + s[8:], "file version 2"),
        (lambda s: s[: len(s) // 2], "ended early"),
        (lambda s: s.replace(name("ram"), name("rom"), 1), "iterative section 'rom'"),
        (
            lambda s: s.replace(u64(0x10) + bytes([0x7E]), u64(0x10 | 0x40) + bytes([0x7E]), 1),
            "page flags 0x50",
        ),
    ],
)
def test_a_stream_sandlot_does_not_read_is_refused_naming_what(cut: object, why: str) -> None:
    data = cut(qemu_stream(memory()))  # type: ignore[operator]
    with pytest.raises(SavedStateError, match=why):
        split(data)


def test_a_page_past_its_block_or_of_an_unknown_block_is_refused() -> None:
    mem = memory()
    good = qemu_stream(mem)
    past = good.replace(name("pc.bios") + u64(4 * PAGE), name("pc.bios") + u64(PAGE), 1)
    past = past.replace(u64(sum(len(v) for v in mem.values()) | 0x04), u64((64 + 1) * PAGE | 0x04), 1)
    with pytest.raises(SavedStateError, match=r"past the end of 'pc\.bios'"):
        split(past)
    unknown = good.replace(name("pc.bios") + u64(4 * PAGE), name("pc.biox") + u64(4 * PAGE), 1)
    with pytest.raises(SavedStateError, match=r"unknown RAM block 'pc\.bios'"):
        split(unknown)


def test_an_extent_out_of_order_is_refused_when_joining() -> None:
    sink = split(qemu_stream(memory()))

    class Backwards(MemorySource):
        def extents(self, name: str) -> Iterator[tuple[int, bytes]]:
            return reversed(list(super().extents(name)))

    with pytest.raises(SavedStateError, match="out of order"):
        stream.join(Backwards(sink), lambda b: None)
