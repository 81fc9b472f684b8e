"""Packs (``core/packs.py``): many chunks to an object of the storage tier, the places
that say where each is, and the ranged reads that bring runs of them; malformed places
and packs are refused by name. The tier's own use of them, against a real S3 server, is
in tests/unit/test_tier.py."""

from __future__ import annotations

import os

import pytest

from sandlot.core import packs
from sandlot.core.chunks import digest
from sandlot.errors import CorruptSnapshot


def chunk(n: int) -> tuple[bytes, bytes]:
    body = os.urandom(100 + n)
    return digest(body), body


def test_a_pack_places_each_chunk_and_its_places_read_back_as_written() -> None:
    items = [chunk(n) for n in range(5)]
    pack, body, places = packs.build(items)
    assert pack == digest(body) and body.startswith(packs.MAGIC)
    for d, b in items:
        p = places[d]
        assert p.pack == pack and body[p.offset : p.offset + p.length] == b
    again = packs.decode_places(packs.encode_places(places), "state s")
    assert again == places


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"NOTPLACE" + data[8:],
        lambda data: data[:-5],
        lambda data: data[:8] + b"\x28\xb5\x2f\xfd" + os.urandom(20),
    ],
)
def test_damaged_places_are_refused_naming_whose(damage: object) -> None:
    items = [chunk(n) for n in range(3)]
    _, _, places = packs.build(items)
    data = packs.encode_places(places)
    with pytest.raises(CorruptSnapshot, match="the places of state s"):
        packs.decode_places(damage(data), "state s")  # type: ignore[operator]


def test_neighbours_in_a_pack_share_a_read_and_far_ones_do_not() -> None:
    a, b = b"a" * 32, b"b" * 32
    wanted = [
        (b"1" * 32, packs.Place(a, 100, 50)),
        (b"2" * 32, packs.Place(a, 150, 50)),
        (b"3" * 32, packs.Place(a, 150 + packs.SPAN_GAP + 1000, 10)),  # too far from the run
        (b"4" * 32, packs.Place(b, 0, 10)),  # another pack
    ]
    got = packs.spans(reversed(wanted))
    assert [(s[0], s[1], s[2], len(s[3])) for s in got] == [
        (a, 100, 200, 2),
        (a, 150 + packs.SPAN_GAP + 1000, 160 + packs.SPAN_GAP + 1000, 1),
        (b, 0, 10, 1),
    ]
    # a run is cut at SPAN_BYTES
    long = [(bytes([i]) * 32, packs.Place(a, i * (1 << 20), 1 << 20)) for i in range(10)]
    assert all(s[2] - s[1] <= packs.SPAN_BYTES for s in packs.spans(long))


class MemoryTier:
    """What ``packs`` asks of a tier, in memory: keys, objects, ranged reads."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def key(self, *parts: str) -> str:
        return "/".join(parts)

    def put(self, key: str, data: bytes, **_: object) -> None:
        self.objects[key] = data

    def get_range(self, key: str, start: int, end: int, *, short: bool = False) -> bytes:
        return self.objects[key][start:end]

    def each(self, fn, items):  # type: ignore[no-untyped-def]
        return [fn(i) for i in items]


@pytest.mark.parametrize("held", [packs.REWRITE_HELD, 1])  # all packs read at once, or one at a time
def test_a_pack_is_written_again_with_its_live_chunks_and_one_with_a_damaged_chunk_is_left(
    held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packs, "REWRITE_HELD", held)
    tier = MemoryTier()
    items = [chunk(i) for i in range(6)]
    good, body, _ = packs.build(items[:3])
    bad, bad_body, bad_places = packs.build(items[3:])
    tier.put(packs.pack_key(tier, good), body)  # type: ignore[arg-type]
    at = bad_places[items[3][0]].offset
    flipped = bytes([bad_body[at] ^ 0xFF])  # (a byte set to "X" was one already, one time in 256)
    tier.put(packs.pack_key(tier, bad), bad_body[:at] + flipped + bad_body[at + 1 :])  # type: ignore[arg-type]
    old = {p: packs.header(tier, p.hex()) for p in (good, bad)}  # type: ignore[arg-type]
    assert [(d, n) for d, _, n in old[good]] == [(d, len(b)) for d, b in items[:3]]
    live = {items[0][0], items[2][0], items[3][0]}
    moved, written = packs.rewrite(tier, old, live, lambda d, b: digest(b) == d)  # type: ignore[arg-type]
    assert set(moved) == {good} and set(moved[good]) == {items[0][0], items[2][0]}
    (new,) = {p.pack for p in moved[good].values()}
    assert len(tier.objects[packs.pack_key(tier, new)]) == written  # type: ignore[arg-type]
    for d, p in moved[good].items():
        assert tier.objects[packs.pack_key(tier, new)][p.offset : p.offset + p.length] == dict(items)[d]  # type: ignore[arg-type]
    assert packs.decode_places(tier.objects[f"moved/{good.hex()}"], "moved") == moved[good]
    assert f"moved/{bad.hex()}" not in tier.objects  # its damaged live chunk: left as it is
    assert packs.worth_rewriting(old[good], live) is False  # (a few hundred dead bytes: not worth it)
