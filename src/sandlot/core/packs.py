"""Packs: chunks sent to the storage tier many to an object (docs/storage.md, "Packs").

One object per chunk made every push and every pull a request per 64 KiB: a Debian base
took about 10,000 requests, and a box woken lazily from the tier waited on one request
for each chunk it touched, one after another. A push now writes its new chunks into
packs of about ``PACK_BYTES``, in the order its states and files list them (a memory
image's chunks in address order), and a read asks for a run of neighbouring chunks in
one ranged GET: what a guest touches on waking lies in runs (its kernel's and its
processes' pages), and a whole state streams in a few large reads.

    packs/<hex>                 a pack, named by the BLAKE3 hash of its bytes
    places/states/<id>          where each chunk of a state's manifest is (its "places")
    places/files/<hex>          the same for a disk file's manifest

A pack is its header (``MAGIC``, the count, each chunk's hash and length), then the
chunks as the home keeps them (zstd), one after another. A home learns where a chunk is
when it sends the pack, or when it reads the places of a state or file it pulls
(``tier_places``); a chunk of no known place is read as ``chunks/<hex>``, the
one-object form older homes wrote. Every chunk is still checked against its hash when
read, so a damaged pack or places object is a ``CorruptSnapshot`` naming the chunk.

A collection (``core.tiergc``) deletes a pack once none of its chunks is listed by a state
or a file the tier keeps. A pack some of whose chunks are still listed stays whole while
its dead chunks are few (``TierGcReport.dead_bytes`` counts them); once they are half of
its bytes and more than ``REPACK_DEAD_BYTES`` (a state removed whose pack later states
share), the collection writes the pack again without them (``rewrite``):

    moved/<old hex>             where the old pack's live chunks are now (places)

and the places of every state and file that pointed into it. A home that learned the
old places (a pack it sent, a state it pulled) finds the new ones in ``moved/``: when it
catches up with the collection's record before a push, or when a read finds the old
pack gone.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CorruptSnapshot
from .store import BoxStore
from .tier import ObjectMissing, Tier

MAGIC = b"SLPACK1\n"
PLACES_MAGIC = b"SLPLACE1"
PACK_BYTES = 8 << 20  # a pack's chunks, compressed: a few requests a state, little held at once
SPAN_BYTES = 4 << 20  # the most one ranged read asks for
SPAN_GAP = 256 << 10  # bytes of chunks not wanted that a read takes to join two runs in one
SENDING = 4  # packs sent at once
PLACES_MAX = 256 << 20  # bytes of one state's or file's places: a disk of 380 GiB (44 bytes a chunk)
REPACK_DEAD_SHARE = 0.5  # a pack whose dead chunks are this share of its bytes is written again...
REPACK_DEAD_BYTES = 1 << 20  # ...if they are this many bytes at least (a few requests must win something)
REWRITE_HELD = 64 << 20  # bytes of live chunks a rewrite reads before it writes them out
_HEAD = struct.Struct("<8sI")
_ENTRY = struct.Struct("<32sI")
_PLACE = struct.Struct("<32sIII")
_COUNTS = struct.Struct("<II")


@dataclass(frozen=True, slots=True)
class Place:
    """Where a chunk is in the tier: its pack's hash, and its bytes' offset and length."""

    pack: bytes
    offset: int
    length: int


def pack_key(tier: Tier, pack: bytes) -> str:
    return tier.key("packs", pack.hex())


def build(items: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes, dict[bytes, Place]]:
    """A pack of ``items`` (each a chunk's hash and its bytes as kept): its hash, its
    bytes, and where each chunk is in it."""
    import blake3  # (the hash ``core.chunks`` names chunks by)

    header = _HEAD.pack(MAGIC, len(items)) + b"".join(_ENTRY.pack(d, len(p)) for d, p in items)
    body = header + b"".join(p for _, p in items)
    pack = blake3.blake3(body).digest()
    places, at = {}, len(header)
    for d, p in items:
        places[d] = Place(pack, at, len(p))
        at += len(p)
    return pack, body, places


def moved_key(tier: Tier, pack: bytes) -> str:
    return tier.key("moved", pack.hex())


def moved(tier: Tier, pack: bytes) -> dict[bytes, Place] | None:
    """Where the live chunks of a pack a collection wrote again went (``moved/``); None
    where the tier has no such object (its record was dropped, or the pack never moved)."""
    found = tier.get(moved_key(tier, pack))
    return None if found is None else decode_places(found[0], f"the moved pack {pack.hex()}")


def members(tier: Tier, pack: str) -> set[bytes]:
    """The chunks a pack in the tier holds, read from its header (two ranged reads at most)."""
    return {d for d, _, _ in header(tier, pack)}


def header(tier: Tier, pack: str) -> list[tuple[bytes, int, int]]:
    """Each chunk of a pack in the tier, its offset and its length, from the pack's header."""
    key = tier.key("packs", pack)
    first = tier.get_range(key, 0, 64 << 10, short=True)
    if len(first) < _HEAD.size or first[:8] != MAGIC:
        raise CorruptSnapshot(f"the pack {key} in the storage tier is damaged: no pack header")
    (_, count) = _HEAD.unpack_from(first)
    end = _HEAD.size + count * _ENTRY.size
    head = first if end <= len(first) else first + tier.get_range(key, len(first), end)
    if len(head) < end:
        raise CorruptSnapshot(f"the pack {key} in the storage tier is damaged: its header is cut short")
    out, at = [], end
    for d, length in _ENTRY.iter_unpack(head[_HEAD.size : end]):
        out.append((d, at, length))
        at += length
    return out


def encode_places(places: dict[bytes, Place]) -> bytes:
    """A state's or file's places, as ``places/...`` holds them."""
    import zstandard

    packs = sorted({p.pack for p in places.values()})
    index = {p: i for i, p in enumerate(packs)}
    body = _COUNTS.pack(len(packs), len(places)) + b"".join(packs)
    body += b"".join(_PLACE.pack(d, index[p.pack], p.offset, p.length) for d, p in places.items())
    return PLACES_MAGIC + zstandard.ZstdCompressor(level=3, write_content_size=True).compress(body)


def decode_places(data: bytes, whose: str) -> dict[bytes, Place]:
    """The places ``encode_places`` wrote; ``CorruptSnapshot`` naming ``whose`` if not."""
    import zstandard

    try:
        if data[:8] != PLACES_MAGIC:
            raise ValueError("not a places object")
        size = zstandard.get_frame_parameters(data[8:]).content_size
        if not 0 <= size <= PLACES_MAX:  # (said before it is made: a damaged size is no allocation)
            raise ValueError(f"a frame of {size} bytes, where places are at most {PLACES_MAX}")
        body = zstandard.ZstdDecompressor().decompress(data[8:], max_output_size=PLACES_MAX)
        npacks, count = _COUNTS.unpack_from(body)
        at = _COUNTS.size + 32 * npacks
        if len(body) != at + count * _PLACE.size:
            raise ValueError(f"{len(body)} bytes, not what {npacks} packs and {count} places take")
        packs = [body[_COUNTS.size + 32 * i : _COUNTS.size + 32 * (i + 1)] for i in range(npacks)]
        out = {}
        for d, i, offset, length in _PLACE.iter_unpack(body[at:]):
            if i >= npacks or not length:
                raise ValueError(f"chunk {d.hex()} is placed in no pack")
            out[d] = Place(packs[i], offset, length)
        return out
    except (ValueError, struct.error, zstandard.ZstdError) as exc:
        raise CorruptSnapshot(f"the places of {whose} in the storage tier are damaged: {exc}") from None


def spans(wanted: Iterable[tuple[bytes, Place]]) -> list[tuple[bytes, int, int, list[tuple[bytes, Place]]]]:
    """The ranged reads that bring ``wanted``: each a pack, a start, an end and the chunks
    it holds; chunks near each other in one pack share a read."""
    out: list[tuple[bytes, int, int, list[tuple[bytes, Place]]]] = []
    for d, p in sorted(wanted, key=lambda item: (item[1].pack, item[1].offset)):
        last = out[-1] if out else None
        end = p.offset + p.length
        if (last is not None and last[0] == p.pack and p.offset - last[2] <= SPAN_GAP
                and end - last[1] <= SPAN_BYTES):  # fmt: skip
            last[3].append((d, p))
            out[-1] = (last[0], last[1], max(last[2], end), last[3])
        else:
            out.append((p.pack, p.offset, end, [(d, p)]))
    return out


def read(tier: Tier, wanted: dict[bytes, Place], gone: set[bytes] | None = None) -> dict[bytes, bytes]:
    """The bytes (as kept) of each wanted chunk, its neighbours in a pack read at once. A
    pack the tier no longer has is added to ``gone`` (its chunks are not in the answer),
    where it is given; else that is a ``CorruptSnapshot``."""
    found: dict[bytes, bytes] = {}

    def one(span: tuple[bytes, int, int, list[tuple[bytes, Place]]]) -> None:
        pack, start, end, held = span
        try:
            data = tier.get_range(pack_key(tier, pack), start, end)
        except ObjectMissing:
            if gone is None:
                raise
            gone.add(pack)
            return
        for d, p in held:
            found[d] = data[p.offset - start : p.offset - start + p.length]

    tier.each(one, spans(wanted.items()))
    return found


def worth_rewriting(entries: list[tuple[bytes, int, int]], live: set[bytes]) -> bool:
    """Whether a pack's dead chunks (not in ``live``) are enough of it to write it again."""
    dead = sum(length for d, _, length in entries if d not in live)
    return dead >= REPACK_DEAD_BYTES and dead >= REPACK_DEAD_SHARE * sum(n for _, _, n in entries)


def rewrite(
    tier: Tier,
    old: dict[bytes, list[tuple[bytes, int, int]]],
    live: set[bytes],
    sound: Callable[[bytes, bytes], bool],
) -> tuple[dict[bytes, dict[bytes, Place]], int]:
    """Write the ``live`` chunks of the ``old`` packs (each pack's entries, ``header``) into
    new packs, then ``moved/<old>`` for each: where its live chunks are now. Each chunk is
    checked as it is read (``sound``: its hash and bytes as kept); a pack with a damaged
    chunk is left as it is. The places of each pack written again, and the bytes of the
    new packs."""
    placed: dict[bytes, Place] = {}
    whole: list[bytes] = []
    with PackWriter(tier, placed.update) as writer:
        for batch in _batches(old, live):  # (what is read is held: a bounded amount at once)
            wanted = {d: Place(pack, at, n) for pack in batch for d, at, n in old[pack] if d in live}
            found = read(tier, wanted)
            for pack in batch:
                mine = [d for d, _, _ in old[pack] if d in live]
                if all(d in found and sound(d, found[d]) for d in mine):
                    whole.append(pack)
                    for d in mine:
                        writer.add(d, found[d])
    moved = {pack: {d: placed[d] for d, _, _ in old[pack] if d in live} for pack in whole}
    tier.each(lambda pack: tier.put(moved_key(tier, pack), encode_places(moved[pack])), whole)
    return moved, writer.bytes


def _batches(old: dict[bytes, list[tuple[bytes, int, int]]], live: set[bytes]) -> Iterator[list[bytes]]:
    """The packs of ``old`` in groups whose live chunks are about ``REWRITE_HELD`` bytes."""
    batch: list[bytes] = []
    size = 0
    for pack in sorted(old):
        batch.append(pack)
        size += sum(n for d, _, n in old[pack] if d in live)
        if size >= REWRITE_HELD:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class PackWriter:
    """Chunks sent to the tier in packs as they are added: ``sent`` is told the places of
    each pack once the tier holds it (from a sending thread)."""

    def __init__(self, tier: Tier, sent: Callable[[dict[bytes, Place]], None]) -> None:
        self.tier = tier
        self.sent = sent
        self.items: list[tuple[bytes, bytes]] = []
        self.size = 0
        self.seen: set[bytes] = set()
        self.chunks = self.bytes = 0
        self._counting = threading.Lock()
        self._pool = ThreadPoolExecutor(SENDING, thread_name_prefix="sandlot-pack")
        self._pending: list[Future[None]] = []

    def add(self, d: bytes, packed: bytes) -> None:
        if d in self.seen:
            return
        self.seen.add(d)
        self.items.append((d, packed))
        self.size += len(packed)
        if self.size >= PACK_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.items:
            return
        items, self.items, self.size = self.items, [], 0
        while len(self._pending) >= SENDING:  # bounded: at most SENDING packs held in memory
            self._pending.pop(0).result()
        self._pending.append(self._pool.submit(self._send, items))

    def _send(self, items: list[tuple[bytes, bytes]]) -> None:
        pack, body, places = build(items)
        self.tier.put(pack_key(self.tier, pack), body)
        self.sent(places)
        with self._counting:
            self.chunks += len(items)
            self.bytes += len(body)

    def close(self) -> None:
        """Send what is left and wait for every pack; the first failure is raised."""
        try:
            self.flush()
            for f in self._pending:
                f.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._pool.shutdown(wait=True, cancel_futures=True)


# -- the ``tier_places`` table: where the tier keeps the chunks this home knows of; functions
# that take the store first, as ``BoxStore``'s methods do, so that ``AsyncStore.call`` runs them


def add_places(store: BoxStore, places: Mapping[bytes, Place]) -> None:
    """Where the tier keeps these chunks, as a pack sent or a state's
    places read told: their rows say the tier holds them too."""
    rows = [(d, p.pack, p.offset, p.length) for d, p in places.items()]
    with store.transaction() as db:
        db.executemany("INSERT OR REPLACE INTO tier_places (digest, pack, offset, length) "
                       "VALUES (?, ?, ?, ?)", rows)  # fmt: skip
        db.executemany("UPDATE chunks SET remote = 1 WHERE digest = ?", [(r[0],) for r in rows])


def tier_places(store: BoxStore, digests: Iterable[bytes]) -> dict[bytes, Place]:
    """Where the tier keeps those of ``digests`` this home knows of in a pack."""
    out: dict[bytes, Place] = {}
    batch = list(dict.fromkeys(digests))
    with store.reading() as db:
        for i in range(0, len(batch), 500):
            part = batch[i : i + 500]
            marks = ",".join("?" * len(part))
            for r in db.execute(
                f"SELECT digest, pack, offset, length FROM tier_places WHERE digest IN ({marks})", part
            ):
                out[bytes(r[0])] = Place(bytes(r[1]), int(r[2]), int(r[3]))
    return out


__all__ = [
    "PACK_BYTES", "PackWriter", "Place", "add_places", "build", "decode_places", "encode_places", "header",
    "members", "moved", "moved_key", "read", "rewrite", "tier_places", "worth_rewriting",
]  # fmt: skip
