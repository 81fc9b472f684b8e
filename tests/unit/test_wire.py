"""Wire format: the Python mirror agrees with the C header, and decoding is strict."""

from __future__ import annotations

import re
import struct

import pytest

from sandlot.errors import ProtocolError
from sandlot.guest.agent import source_dir
from sandlot.protocol import wire
from sandlot.protocol.wire import Fields, FrameDecoder, T, Tag


def _c_constants() -> dict[str, int]:
    text = (source_dir() / "proto.h").read_text()
    consts: dict[str, int] = {}
    for name, value in re.findall(r"\b(SL_[A-Z0-9_]+) = (0x[0-9a-fA-F]+|\d+)", text):
        consts[name] = int(value, 0)
    for name, expr in re.findall(r"#define (SL_[A-Z0-9_]+) \(?([^/\n]+?)\)?\s*(?:/\*.*)?$", text, re.M):
        expr = expr.replace("u", "").strip()
        if re.fullmatch(r"[0-9xa-fA-F<>* ()]+", expr):
            consts[name] = int(eval(expr))  # constant arithmetic from our own header
    return consts


def test_python_mirror_matches_c_header() -> None:
    c = _c_constants()
    for t in T:
        assert c[f"SL_{t.name}"] == t.value, t.name
    for tag in Tag:
        assert c[f"SL_T_{tag.name}"] == tag.value, tag.name
    assert c["SL_MAGIC"] == wire.MAGIC
    assert c["SL_HEADER_SIZE"] == wire.HEADER_SIZE
    assert c["SL_MAX_PAYLOAD"] == wire.MAX_PAYLOAD
    assert c["SL_DATA_PREFIX"] == wire.DATA_PREFIX_SIZE
    assert c["SL_WINDOW"] == wire.WINDOW
    assert c["SL_PROTOCOL_VERSION"] == wire.PROTOCOL_VERSION
    assert c["SL_EXEC_TTY"] == wire.ExecFlag.TTY
    assert c["SL_WRITE_PARENTS"] == wire.WriteFlag.PARENTS
    assert c["SL_FS_RECURSIVE"] == wire.FsFlag.RECURSIVE
    for op in wire.FsOp:
        assert c[f"SL_FS_{op.name}"] == op.value
    assert c["SL_WATCH_RECURSIVE"] == wire.WatchFlag.RECURSIVE
    assert c["SL_WATCH_RECORD"] == wire.WATCH_RECORD.size
    assert c["SL_WATCH_IS_DIR"] == wire.WATCH_IS_DIR
    for event in wire.WatchEvent:
        assert c[f"SL_WE_{event.name}"] == event.value
    for flag in wire.MountFlag:
        assert c[f"SL_MOUNT_{flag.name}"] == flag.value
    for op in wire.ArchiveOp:
        assert c[f"SL_ARCHIVE_{op.name}"] == op.value
    assert c["SL_ARCHIVE_FOLLOW"] == wire.ArchiveFlag.FOLLOW
    for kind in wire.ArchiveRecord:
        assert c[f"SL_AR_{kind.name}"] == kind.value


def test_frame_roundtrip_in_pieces() -> None:
    frames = [wire.encode_frame(T.PING, 7, b"x" * n) for n in (0, 1, 1000, 70000)]
    blob = b"".join(frames)
    dec = FrameDecoder()
    got = []
    for i in range(0, len(blob), 333):
        got.extend(dec.feed(blob[i : i + 333]))
    assert [len(f.payload) for f in got] == [0, 1, 1000, 70000]
    assert all(f.channel == 7 and f.type == T.PING for f in got)


def test_decoder_rejects_bad_magic_and_oversize() -> None:
    with pytest.raises(ProtocolError, match="magic"):
        list(FrameDecoder().feed(b"\x00\x00" + bytes(10)))
    big = struct.pack("<HBBII", wire.MAGIC, T.DATA, 0, 1, wire.MAX_PAYLOAD + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        list(FrameDecoder().feed(big))
    with pytest.raises(ProtocolError):
        wire.encode_frame(T.DATA, 1, bytes(wire.MAX_PAYLOAD + 1))


def test_a_synchronising_decoder_skips_what_an_earlier_connection_left() -> None:
    """A VM saved mid-frame hands the rest of that frame to the next connection, ahead
    of the answer to HELLO: the new connection's decoder starts at that answer, fed in
    any pieces, and decodes strictly from there on."""
    stale = wire.encode_frame(T.DATA, 3, b"stdout of a command " * 50)[37:]  # a frame's tail
    stale += wire.encode_frame(T.PONG, 9)  # and a whole frame of the old session
    ack = wire.encode_frame(T.HELLO_ACK, 0, wire.tlv(Tag.VERSION, 1))
    after = wire.encode_frame(T.PONG, 4)
    blob = stale + ack + after
    for piece in (1, 5, 7, 64, len(blob)):
        dec = FrameDecoder(sync=wire.session_start_headers())
        got = [f for i in range(0, len(blob), piece) for f in dec.feed(blob[i : i + piece])]
        assert [(f.type, f.channel) for f in got] == [(T.HELLO_ACK, 0), (T.PONG, 4)]
        assert dec.skipped == len(stale)
        with pytest.raises(ProtocolError, match="magic"):  # synchronised once, strict after
            list(dec.feed(b"st" + bytes(10)))
    refused = wire.encode_frame(T.ERROR, 0, wire.tlv(Tag.FRAME_TYPE, T.HELLO))
    [frame] = FrameDecoder(sync=wire.session_start_headers()).feed(b"junk" + refused)
    assert frame.type == T.ERROR


def test_tlv_roundtrip_and_strictness() -> None:
    payload = (
        wire.tlv(Tag.ARG, "a")
        + wire.tlv(Tag.ARG, "b")
        + wire.tlv(Tag.FLAGS, 5)
        + wire.tlv_u64(Tag.SIZE, 2**40)
    )
    f = Fields(payload)
    assert f.all(Tag.ARG) == [b"a", b"b"]
    assert f.u32(Tag.FLAGS) == 5
    assert f.u64(Tag.SIZE) == 2**40
    assert f.u32(Tag.MODE) is None
    with pytest.raises(ProtocolError):
        Fields(payload[:-1])  # truncated value
    with pytest.raises(ProtocolError):
        Fields(b"\x01")  # truncated header
    with pytest.raises(ProtocolError):
        Fields(wire.tlv(Tag.FLAGS, b"abc")).u32(Tag.FLAGS)  # wrong width


def test_entry_parse() -> None:
    raw = struct.pack("<IIIIQqHH", 0o100644, 1, 2, 1, 42, 10**18, 3, 4) + b"abc" + b"/tgt"
    e = wire.parse_entry(raw)
    assert (e.name, e.size, e.uid, e.gid, e.link_target) == ("abc", 42, 1, 2, "/tgt")
    with pytest.raises(ProtocolError):
        wire.parse_entry(raw[:-1])


def test_watch_records_parse_across_frames() -> None:
    records = [(1, 0, "a", ""), (4, 1, "d/new", "d/old"), (5, 1, "", ""), (2, 0, "sp\u00e9cial", "")]
    blob = b"".join(
        wire.WATCH_RECORD.pack(k, f, len(p.encode()), len(o.encode())) + p.encode() + o.encode()
        for k, f, p, o in records
    )
    buf = bytearray()
    got = []
    for i in range(0, len(blob), 5):  # records cut anywhere by the ends of DATA frames
        buf += blob[i : i + 5]
        got += wire.parse_watch_records(buf)
    assert not buf
    assert [(r.kind, r.is_dir, r.path, r.old_path) for r in got] == [
        (wire.WatchEvent.CREATED, False, "a", None),
        (wire.WatchEvent.MOVED, True, "d/new", "d/old"),
        (wire.WatchEvent.OVERFLOW, True, "", None),
        (wire.WatchEvent.MODIFIED, False, "sp\u00e9cial", None),
    ]
    with pytest.raises(ProtocolError, match="kind"):
        wire.parse_watch_records(bytearray(wire.WATCH_RECORD.pack(9, 0, 0, 0)))
