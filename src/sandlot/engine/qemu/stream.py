"""QEMU's migration stream, taken apart into memory pages and the rest, and put together again.

A saved QEMU state is one migration stream: a header, the machine's configuration,
then the ``ram`` section (its setup names the RAM blocks and their sizes; its parts
carry every page, each once, as a page or as a zero page), then the devices' sections.
``split`` reads such a stream and hands each RAM block's pages to a ``StateSink``
as a memory image, and everything else as two byte streams: ``qemu.head`` (up to the
end of the ``ram`` setup) and ``qemu.tail`` (from the first device's section to the
end). Keeping memory as images is what lets the core store it as content-addressed
chunks, so that a state costs what changed since the last one. ``join`` writes the
stream back from a ``StateSource``: the head, every page of every block in address
order in one ``ram`` part, an empty ``ram`` end, the tail. QEMU loads that as it
loads its own stream: a ``ram`` section's parts may carry any pages in any order.

The format (QEMU 7.2, ``migration/savevm.c`` and ``migration/ram.c``) is read
strictly: anything the VMs sandlot runs never write (compressed or XBZRLE pages,
postcopy, a second iterative section) is refused with ``SavedStateError`` naming
it, never guessed at. Written by hand because no library reads QEMU's stream (QEMU's
own ``scripts/analyze-migration.py`` reads a file whole and keeps every page).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

from ...engine.base import ImageSink, StateSink, StateSource
from ...errors import SavedStateError

PAGE = 4096  # TARGET_PAGE_SIZE on x86
MAGIC = 0x5145564D  # "QEVM"
VERSION = 3

HEAD = "qemu.head"
TAIL = "qemu.tail"

# section types (savevm.c)
EOF_ = 0x00
SECTION_START = 0x01
SECTION_PART = 0x02
SECTION_END = 0x03
SECTION_FULL = 0x04
SUBSECTION = 0x05
CONFIGURATION = 0x07
SECTION_FOOTER = 0x7E

# flags in the low bits of a page record's address (ram.c)
F_ZERO = 0x02
F_MEM_SIZE = 0x04
F_PAGE = 0x08
F_EOS = 0x10
F_CONTINUE = 0x20
F_MULTIFD_FLUSH = 0x200  # QEMU 8.0 and newer: no data, nothing for a loader to do
KNOWN_FLAGS = F_ZERO | F_MEM_SIZE | F_PAGE | F_EOS | F_CONTINUE | F_MULTIFD_FLUSH
FLAG_MASK = PAGE - 1

# the configuration section's subsections (savevm.c), by name: how many bytes follow
# their version (capabilities: a count, then that many length-prefixed names)
CONFIG_SUBSECTIONS = ("configuration/target-page-bits", "configuration/capabilities", "configuration/uuid")

ZERO_PAGE = bytes(PAGE)
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
READ_SIZE = 1 << 20


ENDED_EARLY = "QEMU's migration stream ended early"  # what a save cut short by QEMU's end says


class _Reader:
    """Exact reads from a byte source, with what was read kept while ``recording``."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self._buf = b""
        self._pos = 0
        self.offset = 0  # bytes consumed so far: where an error was met
        self.recording: bytearray | None = None

    def _fill(self, n: int) -> None:
        pieces = [self._buf[self._pos :]]
        have = len(pieces[0])
        while have < n:
            data = self._read(max(READ_SIZE, n - have))
            if not data:
                raise SavedStateError(f"{ENDED_EARLY}, at byte {self.offset + have}")
            pieces.append(data)
            have += len(data)
        self._buf, self._pos = b"".join(pieces), 0

    def take(self, n: int) -> bytes:
        if len(self._buf) - self._pos < n:
            self._fill(n)
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        self.offset += n
        if self.recording is not None:
            self.recording += out
        return out

    def page_run(self, addr: int, end: int) -> list[bytes]:
        """The pages of the records that follow, already read, while each is the next page
        of the same block (``addr``, ``addr + PAGE``... before ``end``): QEMU writes most
        pages so, and taking them at once spares a turn of the record loop per page."""
        buf, pos, out = self._buf, self._pos, []
        while (
            addr < end
            and pos + PAGE + 8 <= len(buf)
            and buf[pos : pos + 8] == _U64.pack(addr | F_PAGE | F_CONTINUE)
        ):
            out.append(buf[pos + 8 : pos + 8 + PAGE])
            pos += PAGE + 8
            addr += PAGE
        self.offset += pos - self._pos
        self._pos = pos
        return out

    def zero_run(self, addr: int, end: int) -> int:
        """How many zero-page records follow, already read, while each is of the next page
        of the same block: a box's memory is mostly zero pages, a record of 9 bytes each,
        and a run taken at once is one call to the image where a call per page made the
        parse of a 512 MiB box's state three times slower."""
        buf, pos, start = self._buf, self._pos, addr
        pack, flags, last = _U64.pack, F_ZERO | F_CONTINUE, len(self._buf) - 9
        while addr < end and pos <= last and buf[pos + 8] == 0 and buf[pos : pos + 8] == pack(addr | flags):
            pos += 9
            addr += PAGE
        self.offset += pos - self._pos
        self._pos = pos
        return (addr - start) // PAGE

    def peek(self) -> int:
        if len(self._buf) - self._pos < 1:
            self._fill(1)
        return self._buf[self._pos]

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def u64(self) -> int:
        value: int = _U64.unpack(self.take(8))[0]
        return value

    def name(self) -> str:
        return self.take(self.u8()).decode("latin-1")

    def rest(self) -> bytes:
        """Everything left, to the end of the source."""
        out = bytearray(self._buf[self._pos :])
        self._buf, self._pos = b"", 0
        while data := self._read(READ_SIZE):
            out += data
        self.offset += len(out)
        return bytes(out)


def _bad(r: _Reader, what: str) -> SavedStateError:
    return SavedStateError(f"QEMU's migration stream is not one sandlot reads: {what} (at byte {r.offset})")


def _configuration(r: _Reader) -> None:
    """The machine's configuration: its name, then the subsections QEMU adds."""
    length = r.u32()
    if length > 256:
        raise _bad(r, f"a machine name of {length} bytes")
    r.take(length)
    while r.peek() == SUBSECTION:
        r.u8()
        name = r.name()
        if name not in CONFIG_SUBSECTIONS:
            raise _bad(r, f"configuration subsection {name!r}")
        r.u32()  # its version
        if name == "configuration/target-page-bits":
            r.u32()
        elif name == "configuration/capabilities":
            for _ in range(r.u32()):
                r.name()
        else:
            r.take(16)


def split(read: Callable[[int], bytes], sink: StateSink) -> None:
    """Read a whole migration stream from ``read`` (``os.read``-like: b'' at its end)
    into ``sink``: each RAM block an image, the rest ``qemu.head`` and ``qemu.tail``."""
    r = _Reader(read)
    r.recording = bytearray()
    if r.u32() != MAGIC:
        raise _bad(r, "no QEMU_VM_FILE_MAGIC")
    if (version := r.u32()) != VERSION:
        raise _bad(r, f"file version {version}")
    if r.peek() == CONFIGURATION:
        r.u8()
        _configuration(r)
    ram = _Ram(r, sink)
    ram_id: int | None = None
    while True:
        kind = r.peek()
        if ram_id is not None and kind in (SECTION_FULL, EOF_):
            break  # the first device's section (or the end): the tail begins
        if kind == SECTION_START:
            r.u8()
            section = r.u32()
            idstr = r.name()
            r.u32()  # instance
            r.u32()  # version
            if idstr != "ram" or ram_id is not None:
                raise _bad(r, f"an iterative section {idstr!r} beside the RAM's")
            ram_id = section
        elif kind in (SECTION_PART, SECTION_END) and ram_id is not None:
            r.u8()
            section = r.u32()
            if section != ram_id:
                raise _bad(r, f"an iterative section {section} that is not the RAM's")
        else:
            raise _bad(r, f"section type {kind:#x} where the RAM's section was due")
        pages_seen = ram.section(setup=r.recording is not None)
        if r.peek() == SECTION_FOOTER:
            r.u8()
            if r.u32() != ram_id:
                raise _bad(r, "a footer that closes another section")
        if r.recording is not None:  # the setup: the head ends with it
            if pages_seen:
                raise _bad(r, "pages in the RAM's setup")
            sink.stream(HEAD, bytes(r.recording))
            r.recording = None
    if r.recording is not None:
        raise _bad(r, "no RAM section")
    tail = r.rest()
    if not tail:
        raise _bad(r, "no device state after the RAM")
    sink.stream(TAIL, tail)


class _Ram:
    """The RAM section's records, across its parts: a page may continue the block of
    the page before it in an earlier part (QEMU's ``last_sent_block`` outlives a part)."""

    def __init__(self, r: _Reader, sink: StateSink) -> None:
        self.r = r
        self.sink = sink
        self.images: dict[str, ImageSink] = {}
        self.sizes: dict[str, int] = {}
        self.block: str | None = None

    def section(self, *, setup: bool) -> int:
        """One part's records, to its end-of-section mark; the pages it carried."""
        r = self.r
        pages = 0
        while True:
            word = r.u64()
            flags, addr = word & FLAG_MASK, word & ~FLAG_MASK
            if flags & ~KNOWN_FLAGS:
                raise _bad(r, f"page flags {flags:#x}")
            if flags & F_EOS:
                return pages
            if flags & F_MEM_SIZE:
                if not setup:
                    raise _bad(r, "RAM sizes outside the RAM's setup")
                self._blocks(addr)
                continue
            if flags & F_MULTIFD_FLUSH:
                continue
            if not flags & F_CONTINUE:
                self.block = r.name()
                if self.block not in self.images:
                    raise _bad(r, f"a page of an unknown RAM block {self.block!r}")
            if self.block is None:
                raise _bad(r, "a page continuing no block")
            image = self.images[self.block]
            if addr + PAGE > self.sizes[self.block]:
                raise _bad(r, f"a page at {addr:#x}, past the end of {self.block!r}")
            if flags & F_ZERO:
                fill = r.u8()
                if fill:
                    image.pages(addr, bytes([fill]) * PAGE)
                else:
                    zeros = 1 + r.zero_run(addr + PAGE, self.sizes[self.block])
                    image.zeros(addr, zeros * PAGE)
                    pages += zeros - 1
            elif flags & F_PAGE:
                run = [r.take(PAGE), *r.page_run(addr + PAGE, self.sizes[self.block])]
                image.pages(addr, run[0] if len(run) == 1 else b"".join(run))
                pages += len(run) - 1
            else:
                raise _bad(r, f"a record with flags {flags:#x}")
            pages += 1

    def _blocks(self, total: int) -> None:
        r = self.r
        while total > 0:
            name = r.name()
            size = r.u64()
            if size % PAGE or size <= 0 or name in self.sizes:
                raise _bad(r, f"RAM block {name!r} of {size} bytes")
            self.sizes[name] = size
            self.images[name] = self.sink.image(name, size)
            total -= size
        if total != 0:
            raise _bad(r, "RAM block sizes that do not add up to the RAM's")


def _head_facts(head: bytes) -> tuple[int, bool]:
    """The RAM section's id and whether sections end with a footer, from the head."""
    pieces = [b"", head]
    r = _Reader(lambda _n: pieces.pop())
    r.u32(), r.u32()
    if r.peek() == CONFIGURATION:
        r.u8()
        _configuration(r)
    if r.u8() != SECTION_START:
        raise _bad(r, "a head that does not open the RAM's section")
    section = r.u32()
    r.name(), r.u32(), r.u32()
    while not (word := r.u64()) & F_EOS:
        if word & F_MEM_SIZE:
            total = word & ~FLAG_MASK
            while total > 0:
                r.name()
                total -= r.u64()
    footer = r.offset < len(head) and r.peek() == SECTION_FOOTER
    return section, footer


class _Pages:
    """The page records of one RAM block, in address order, into ``out``: the block's
    name once, then each page as data or as a zero page (a loader leaves a zero page
    that is zero already as it is, and clears one that is not: a ROM's)."""

    def __init__(self, out: bytearray, name: str, size: int) -> None:
        self.out = out
        self.label = bytes([len(name)]) + name.encode("latin-1")
        self.size = size
        self.at = 0
        self.first = True

    def _first(self, flags: int, body: bytes | memoryview) -> None:
        """The block's first record, which alone carries its name (the rest say
        ``F_CONTINUE``: the same block as the record before)."""
        self.first = False
        self.out += _U64.pack(self.at | flags) + self.label
        self.out += body
        self.at += PAGE

    # Both below write a record per page, and a state's memory is tens of thousands of
    # pages: its records are gathered in one list and joined once, where appending them
    # one by one made a resume of a box with 200 MiB live spend 0.58 s here (0.19 s now).

    def zeros_until(self, end: int) -> None:
        if self.first and self.at < end:
            self._first(F_ZERO, b"\0")
        if self.at < end:
            pack, flags = _U64.pack, F_ZERO | F_CONTINUE
            self.out += b"".join([pack(at | flags) + b"\0" for at in range(self.at, end, PAGE)])
            self.at += -(-(end - self.at) // PAGE) * PAGE

    def data(self, offset: int, data: bytes) -> None:
        if offset < self.at or offset % PAGE or len(data) % PAGE or offset + len(data) > self.size:
            raise SavedStateError(f"a memory image's extent at {offset:#x} is out of order or bounds")
        self.zeros_until(offset)
        view = memoryview(data)
        pages = [view[i : i + PAGE] for i in range(0, len(data), PAGE)]
        if self.first and pages:
            page = pages.pop(0)
            if page == ZERO_PAGE:
                self._first(F_ZERO, b"\0")
            else:
                self._first(F_PAGE, page)
        pack, at = _U64.pack, self.at
        zero, full = F_ZERO | F_CONTINUE, F_PAGE | F_CONTINUE
        records: list[bytes | memoryview] = []
        for k, page in enumerate(pages):
            if page == ZERO_PAGE:
                records += (pack((at + k * PAGE) | zero), b"\0")
            else:
                records += (pack((at + k * PAGE) | full), page)
        self.out += b"".join(records)
        self.at = at + len(pages) * PAGE


def join(source: StateSource, write: Callable[[bytes], object]) -> None:
    """Write ``source`` as a migration stream QEMU loads, through ``write``."""
    head = source.stream(HEAD)
    section, footer = _head_facts(head)
    end_mark = _U64.pack(F_EOS) + ((bytes([SECTION_FOOTER]) + _U32.pack(section)) if footer else b"")
    write(head)
    write(bytes([SECTION_PART]) + _U32.pack(section))
    out = bytearray()
    for name, size in source.images().items():
        pages = _Pages(out, name, size)
        for offset, data in source.extents(name):
            pages.data(offset, data)
            if len(out) >= READ_SIZE:
                write(bytes(out))
                out.clear()
        pages.zeros_until(size)
    out += end_mark
    out += bytes([SECTION_END]) + _U32.pack(section) + end_mark
    write(bytes(out))
    write(source.stream(TAIL))


def write_all(fd: int) -> Callable[[bytes], None]:
    """A ``write`` for ``join`` onto a descriptor (a pipe QEMU reads)."""

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return write
