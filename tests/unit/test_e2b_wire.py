"""The protobuf codec of the E2B envd services: round trips, binary and JSON, of envd's own
messages; agreement with what E2B's SDK (``protobuf-py``) writes and reads; and malformed
input, which raises ProtobufError and nothing else."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from sandlot.errors import InvalidArgument
from sandlot.server.e2b import messages as m
from sandlot.server.e2b.protobuf import (
    MAX_DEPTH,
    Field,
    Message,
    ProtobufError,
    decode,
    encode,
    from_json,
    to_json,
)

WHEN = datetime(2026, 11, 27, 15, 4, 5, 123456, tzinfo=UTC)

START_REQUEST = {
    "process": {
        "cmd": "/bin/bash",
        "args": ["-l", "-c", "echo hi"],
        "envs": {"A": "1", "EMPTY": ""},
        "cwd": "",
    },
    "pty": {"size": {"cols": 80, "rows": 24}},
    "tag": "",
    "stdin": False,
}
ENTRY = {
    "name": "link",
    "type": m.FileType.values["FILE_TYPE_SYMLINK"],
    "path": "/home/user/link",
    "size": 2**40,
    "mode": 0o777,
    "permissions": "Lrwxrwxrwx",
    "owner": "user",
    "group": "user",
    "modified_time": WHEN,
    "symlink_target": "/home/user/target",
    "metadata": {"k": "v"},
    "is_symlink": True,
}

# Values that come back exactly as they went: no field of implicit presence at its default.
ROUND_TRIPS: list[tuple[Message, dict[str, Any]]] = [
    (m.StartRequest, START_REQUEST),
    (m.ProcessEvent, {"start": {"pid": 42}}),
    (m.ProcessEvent, {"data": {"stdout": b""}}),  # a oneof member at its default is still sent
    (m.ProcessEvent, {"data": {"stderr": b"\x00\xff"}}),
    (m.ProcessEvent, {"data": {"pty": bytes(range(256)) * 4096}}),
    (m.ProcessEvent, {"end": {"exit_code": -9, "exited": True, "status": "signal: killed", "error": ""}}),
    (m.ProcessEvent, {"end": {"exit_code": 2**31 - 1}}),
    (m.ProcessEvent, {"keepalive": {}}),
    (m.StartResponse, {"event": {"end": {"exit_code": -(2**31)}}}),
    (m.ListResponse, {"processes": [{"config": {"cmd": "sleep"}, "pid": 7, "tag": "t"}, {"pid": 2**32 - 1}]}),
    (m.ListRequest, {}),
    (m.SendInputRequest, {"process": {"tag": "web"}, "input": {"stdin": b"data\n"}}),
    (m.SendInputRequest, {"process": {"pid": 0}, "input": {"pty": b"\x03"}}),
    (m.StreamInputRequest, {"start": {"process": {"pid": 9}}}),
    (m.StreamInputRequest, {"data": {"input": {"stdin": b"x" * 100_000}}}),
    (m.SendSignalRequest, {"process": {"pid": 9}, "signal": m.Signal.values["SIGNAL_SIGKILL"]}),
    (m.SendSignalRequest, {"signal": 31}),  # an enum number the schema does not know
    (m.UpdateRequest, {"process": {"pid": 1}, "pty": {}}),
    (m.StatResponse, {"entry": ENTRY}),
    (m.StatResponse, {"entry": {"modified_time": datetime(1, 1, 1, tzinfo=UTC)}}),
    (m.StatResponse, {"entry": {"modified_time": datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)}}),
    (m.StatResponse, {"entry": {"modified_time": datetime(1969, 7, 20, 20, 17, 40, 5, tzinfo=UTC)}}),
    (m.ListDirResponse, {"entries": [ENTRY, {"name": "a", "type": 2, "size": -1}, {}]}),
    (m.WatchDirResponse, {"start": {}}),
    (m.WatchDirResponse, {"keepalive": {}}),
    (m.WatchDirResponse, {"filesystem": {"name": "x", "type": 4, "entry": {}}}),
    (m.GetWatcherEventsResponse, {"events": [{"name": "a", "type": 1}, {"name": "b", "entry": ENTRY}]}),
    (
        m.CreateWatcherRequest,
        {"path": "/", "recursive": True, "include_entry": True, "allow_network_mounts": True},
    ),
]


@pytest.mark.parametrize(("message", "value"), ROUND_TRIPS, ids=lambda x: getattr(x, "full_name", ""))
def test_round_trips(message: Message, value: dict[str, Any]) -> None:
    assert decode(message, encode(message, value)) == value
    assert from_json(message, json.loads(json.dumps(to_json(message, value)))) == value


def test_defaults_of_implicit_presence_are_left_out() -> None:
    end = {"exit_code": 0, "exited": False, "status": ""}
    assert encode(m.ProcessEvent_EndEvent, end) == b""
    assert to_json(m.ProcessEvent_EndEvent, end) == {}
    assert encode(m.ProcessEvent_EndEvent, {**end, "error": ""}) == b"\x22\x00"  # optional: sent
    assert to_json(m.ProcessEvent_EndEvent, {**end, "error": ""}) == {"error": ""}
    assert encode(m.ProcessConfig, {"args": [], "envs": {}}) == b""
    assert to_json(m.ProcessConfig, {"args": [], "envs": {}}) == {}
    assert encode(m.ProcessEvent, {"keepalive": {}}) == b"\x22\x00"  # a message is sent even empty
    assert encode(m.ProcessConfig, {"cmd": None}) == b""  # None is absent
    assert decode(m.ProcessEvent_EndEvent, b"") == {}


def test_known_encodings() -> None:
    assert encode(m.ProcessEvent_EndEvent, {"exit_code": -1}) == b"\x08\x01"  # zigzag
    assert encode(m.ProcessEvent_EndEvent, {"exit_code": 1}) == b"\x08\x02"
    int32 = Message("t.Int32", (Field(1, "v", "int32"), Field(2, "w", "int64"), Field(3, "u", "uint32")))
    minus_one = b"\x08" + b"\xff" * 9 + b"\x01"  # ten bytes: the 64-bit two's complement
    assert encode(int32, {"v": -1}) == minus_one
    assert decode(int32, minus_one) == {"v": -1}
    # 32-bit kinds truncate a wider varint, as protobuf does
    wide = b"\x08\x85\x80\x80\x80\x10" + b"\x18\x85\x80\x80\x80\x10"  # 2**32 + 5, twice
    assert decode(int32, wide) == {"v": 5, "u": 5}
    assert decode(int32, b"\x10" + b"\xff" * 9 + b"\x01") == {"w": -1}
    env = {"process": {"cmd": "a", "envs": {"K": ""}}}
    # a map entry carries its key and value even at their defaults, as protobuf writes them
    assert encode(m.StartRequest, env) == b"\x0a\x0a\x0a\x01a\x1a\x05\x0a\x01K\x12\x00"
    assert decode(m.StartRequest, b"\x0a\x05\x1a\x03\x0a\x01K") == {
        "process": {"envs": {"K": ""}}
    }  # no value


def test_repeated_numbers_are_packed_and_read_either_way() -> None:
    nums = Message(
        "t.Nums",
        (Field(1, "n", "sint32", repeated=True), Field(2, "e", "enum", enum=m.Signal, repeated=True)),
    )
    assert encode(nums, {"n": [1, -1, 300]}) == b"\x0a\x04\x02\x01\xd8\x04"
    assert decode(nums, b"\x0a\x04\x02\x01\xd8\x04") == {"n": [1, -1, 300]}
    assert decode(nums, b"\x08\x02\x08\x01\x0a\x02\xd8\x04") == {"n": [1, -1, 300]}  # unpacked, then packed
    assert to_json(nums, {"n": [1], "e": [9, 15, 4]}) == {
        "n": [1],
        "e": ["SIGNAL_SIGKILL", "SIGNAL_SIGTERM", 4],
    }
    assert from_json(nums, {"e": ["SIGNAL_SIGKILL", 4]}) == {"e": [9, 4]}


def test_json_is_canonical() -> None:
    assert to_json(m.StatResponse, {"entry": ENTRY}) == {
        "entry": {
            "name": "link",
            "type": "FILE_TYPE_SYMLINK",
            "path": "/home/user/link",
            "size": "1099511627776",
            "mode": 0o777,
            "permissions": "Lrwxrwxrwx",
            "owner": "user",
            "group": "user",
            "modifiedTime": "2026-11-27T15:04:05.123456Z",
            "symlinkTarget": "/home/user/target",
            "metadata": {"k": "v"},
            "isSymlink": True,
        }
    }
    data = {"data": {"stdout": b"\xfb\xff\xfe"}}
    assert to_json(m.ProcessEvent, data) == {"data": {"stdout": "+//+"}}  # standard, padded base64
    assert to_json(m.ProcessEvent, {"end": {"exit_code": -3}}) == {"end": {"exitCode": -3}}
    assert to_json(m.WatchDirRequest, {"include_entry": True}) == {"includeEntry": True}


@pytest.mark.parametrize(
    ("moment", "text"),
    [
        (datetime(2026, 11, 27, 15, 4, 5, tzinfo=UTC), "2026-11-27T15:04:05Z"),
        (datetime(2026, 11, 27, 15, 4, 5, 120000, tzinfo=UTC), "2026-11-27T15:04:05.120Z"),
        (datetime(2026, 11, 27, 15, 4, 5, 1, tzinfo=UTC), "2026-11-27T15:04:05.000001Z"),
        (datetime(2026, 11, 27, 16, 4, 5, tzinfo=timezone(timedelta(hours=1))), "2026-11-27T15:04:05Z"),
        (datetime(1, 1, 1, tzinfo=UTC), "0001-01-01T00:00:00Z"),
    ],
)
def test_timestamps_in_json(moment: datetime, text: str) -> None:
    assert to_json(m.EntryInfo, {"modified_time": moment}) == {"modifiedTime": text}


def test_timestamps_keep_microseconds_of_nanos() -> None:
    nanos = b"\x4a\x0b\x08\xe5\xd0\xa1\xc9\x06\x10\x95\x9a\xef\x3a"  # 1764255845 s, 123456789 ns
    moment = datetime(2025, 11, 27, 15, 4, 5, 123456, tzinfo=UTC)
    assert decode(m.EntryInfo, nanos) == {"modified_time": moment}
    for text in (
        "2025-11-27T15:04:05.123456789Z",
        "2025-11-27t16:04:05.1234567+01:00",
        "2025-11-27T13:04:05.123456-02:00",
    ):
        assert from_json(m.EntryInfo, {"modifiedTime": text}) == {"modified_time": moment}
    assert from_json(m.EntryInfo, {"modifiedTime": "2025-11-27T15:04:05Z"})["modified_time"].tzinfo == UTC


def test_json_input_is_lenient_where_proto3_allows() -> None:
    assert from_json(
        m.EntryInfo,
        {
            "modified_time": None,
            "size": 5,
            "mode": "420",
            "symlink_target": "t",
            "type": 2,
            "isSymlink": False,
        },
    ) == {"size": 5, "mode": 420, "symlink_target": "t", "type": 2, "is_symlink": False}
    assert from_json(m.EntryInfo, {"size": "-1e3", "mode": 7.0}) == {"size": -1000, "mode": 7}
    for text in ("-_8", "-_8=", "+/8", "+/8="):
        assert from_json(m.ProcessInput, {"stdin": text}) == {"stdin": b"\xfb\xff"}
    assert from_json(m.ProcessInput, {"stdin": ""}) == {"stdin": b""}
    assert from_json(m.SendSignalRequest, {"signal": "SIGNAL_SIGTERM"}) == {"signal": 15}
    assert from_json(m.ProcessEvent, {"start": None, "end": {}}) == {"end": {}}


def test_decode_merges_and_keeps_the_last_oneof_member() -> None:
    start, end = b"\x0a\x02\x08\x07", b"\x1a\x02\x08\x03"
    assert decode(m.ProcessEvent, start + end) == {"end": {"exit_code": -2}}
    assert decode(m.ProcessEvent, end + start) == {"start": {"pid": 7}}
    assert decode(m.ProcessEvent_DataEvent, b"\x0a\x01a\x12\x01b") == {"stderr": b"b"}
    # a message given twice is merged: the pieces, parsed as one
    two = b"\x1a\x02\x08\x03" + b"\x1a\x02\x10\x01"
    assert decode(m.ProcessEvent, two) == {"end": {"exit_code": -2, "exited": True}}
    seconds_then_nanos = b"\x4a\x02\x08\x01" + b"\x4a\x03\x10\xe8\x07"
    assert decode(m.EntryInfo, seconds_then_nanos) == {
        "modified_time": datetime(1970, 1, 1, 0, 0, 1, 1, tzinfo=UTC)
    }
    assert decode(m.ProcessConfig, b"\x0a\x01a\x0a\x01b") == {"cmd": "b"}


def test_unknown_fields_are_skipped() -> None:
    unknown = (
        b"\x78\x96\x01" + b"\x79" + bytes(8) + b"\x7a\x03abc" + b"\x7d" + bytes(4)
    )  # fields 15, wire 0 1 2 5
    assert decode(m.ProcessSelector, unknown + b"\x08\x05" + unknown) == {"pid": 5}


Node = Message("t.Node")
Node.define([Field(1, "child", "message", message=Node), Field(2, "n", "int32")])
Tree: Message = Message("t.Tree", lambda: (Field(1, "kids", "message", message=Tree, repeated=True),))


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"n": 1}
    for _ in range(depth):
        value = {"child": value}
    return value


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _deep(levels: int) -> bytes:
    """A Node's encoding with ``levels`` messages nested in it."""
    data = b""
    for _ in range(levels):
        data = b"\x0a" + _varint(len(data)) + data
    return data


def test_recursive_messages_and_the_depth_limit() -> None:
    ok = nested(MAX_DEPTH)
    assert decode(Node, encode(Node, ok)) == ok
    assert from_json(Node, to_json(Node, ok)) == ok
    tree: dict[str, Any] = {"kids": [{"kids": [{}, {}]}, {}]}
    assert decode(Tree, encode(Tree, tree)) == tree
    deep = nested(MAX_DEPTH + 1)
    with pytest.raises(ProtobufError, match="deeper"):
        encode(Node, deep)
    with pytest.raises(ProtobufError, match="deeper"):
        to_json(Node, deep)
    with pytest.raises(ProtobufError, match="deeper"):
        from_json(Node, {"child": json.loads(json.dumps(to_json(Node, ok)))})
    with pytest.raises(ProtobufError, match="deeper"):
        decode(Node, _deep(MAX_DEPTH + 1))
    with pytest.raises(ProtobufError, match="deeper"):
        decode(Node, _deep(5000))  # past Python's recursion limit, were depth not checked
    with pytest.raises(ValueError, match="already in use"):
        Node.define([])


MALFORMED = {
    "truncated varint": (m.ProcessSelector, b"\x08\x80"),
    "truncated tag": (m.ProcessSelector, b"\x80"),
    "varint over 10 bytes": (m.ProcessSelector, b"\x08" + b"\x80" * 10 + b"\x01"),
    "length past the end": (m.ProcessSelector, b"\x12\x05ab"),
    "huge length": (m.ProcessSelector, b"\x12\xff\xff\xff\xff\x0f"),
    "wrong wire type for a message": (m.StartRequest, b"\x08\x01"),
    "wrong wire type for a scalar": (m.ProcessSelector, b"\x0a\x01\x01"),
    "packed into a singular field": (m.ProcessSelector, b"\x0a\x01\x01"),
    "fixed32 for a varint field": (m.ProcessSelector, b"\x0d\x01\x00\x00\x00"),
    "invalid UTF-8": (m.ProcessConfig, b"\x0a\x02\xff\xfe"),
    "invalid UTF-8 in a map key": (m.ProcessConfig, b"\x1a\x04\x0a\x02\xc3\x28"),
    "field number 0": (m.ProcessSelector, b"\x00\x01"),
    "field number too large": (m.ProcessSelector, b"\xf8\xff\xff\xff\x7f\x00"),
    "a group": (m.ProcessSelector, b"\x7b\x7c"),
    "wire type 7": (m.ProcessSelector, b"\x7f"),
    "truncated fixed64": (m.ProcessSelector, b"\x79\x00"),
    "truncated fixed32": (m.ProcessSelector, b"\x7d\x00\x00"),
    "truncated packed": (m.StartRequest, b"\x0a\x04\x12\x02\x0a"),
    "Timestamp nanos out of range": (m.EntryInfo, b"\x4a\x06\x10\x80\x94\xeb\xdc\x03"),
    "Timestamp seconds out of range": (m.EntryInfo, b"\x4a\x07\x08\x80\x80\x80\x80\x80\x20"),  # 2**40
    "nested too deep": (Node, _deep(MAX_DEPTH + 1)),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_input_raises_protobuf_error(case: str) -> None:
    message, data = MALFORMED[case]
    with pytest.raises(ProtobufError) as info:
        decode(message, data)
    assert isinstance(info.value, InvalidArgument)
    assert isinstance(info.value, ValueError)
    assert message.full_name in str(info.value)


@pytest.mark.parametrize(
    ("message", "value", "says"),
    [
        (m.ProcessConfig, {"command": "ls"}, "no field named 'command'"),
        (m.ProcessEvent, {"start": {}, "end": {}}, "more than one member"),
        (m.ProcessConfig, {"cmd": 1}, "ProcessConfig.cmd: expected string"),
        (m.ProcessConfig, {"args": "ls"}, "expected a list"),
        (m.ProcessConfig, {"args": [None]}, "expected string"),
        (m.ProcessConfig, {"envs": {"A": None}}, "null|NoneType"),
        (m.ProcessConfig, {"envs": {1: "a"}}, "EnvsEntry.key: expected string"),
        (m.PTY_Size, {"cols": -1}, "out of range"),
        (m.PTY_Size, {"cols": 2**32}, "out of range"),
        (m.PTY_Size, {"cols": True}, "expected uint32"),
        (m.ProcessEvent_EndEvent, {"exit_code": 2**31}, "out of range"),
        (m.EntryInfo, {"size": 2**63}, "out of range"),
        (m.EntryInfo, {"modified_time": datetime(2026, 1, 1)}, "timezone-aware"),
        (m.EntryInfo, {"modified_time": 5}, "timezone-aware"),
        (m.StartRequest, {"process": "ls"}, "expected a mapping"),
        (m.ProcessInput, {"stdin": "text"}, "expected bytes"),
        (m.WatchDirRequest, {"recursive": 1}, "expected bool"),
    ],
)
def test_values_that_do_not_fit_the_schema(message: Message, value: dict[str, Any], says: str) -> None:
    for call in (encode, to_json):
        with pytest.raises(ProtobufError, match=says):
            call(message, value)


@pytest.mark.parametrize(
    ("message", "obj", "says"),
    [
        (m.ProcessConfig, {"command": "ls"}, "unknown field 'command'"),
        (m.ProcessConfig, [], "expected a JSON object"),
        (m.EntryInfo, {"modifiedTime": "2026-01-01T00:00:00Z", "modified_time": None}, "given twice"),
        (m.ProcessEvent, {"start": {}, "end": {}}, "more than one member"),
        (m.ProcessInput, {"stdin": "not base64!"}, "base64"),
        (m.ProcessInput, {"stdin": "a"}, "base64"),
        (m.ProcessInput, {"stdin": 5}, "base64"),
        (m.SendSignalRequest, {"signal": "SIGHUP"}, "not a value of process.Signal"),
        (m.SendSignalRequest, {"signal": True}, "expected enum"),
        (m.EntryInfo, {"size": 1.5}, "not an integer"),
        (m.EntryInfo, {"size": "1.5"}, "not a int64"),
        (m.EntryInfo, {"size": "0x10"}, "not a number"),
        (m.EntryInfo, {"size": " 1"}, "not a number"),
        (m.EntryInfo, {"size": "1e999999999"}, "not a int64"),
        (m.EntryInfo, {"size": "9223372036854775808"}, "out of range"),
        (m.EntryInfo, {"mode": -1}, "out of range"),
        (m.EntryInfo, {"mode": float("nan")}, "not an integer"),
        (m.EntryInfo, {"modifiedTime": "2026-02-30T00:00:00Z"}, "not a valid time"),
        (m.EntryInfo, {"modifiedTime": "0001-01-01T00:00:00+01:00"}, "not a valid time"),
        (m.EntryInfo, {"modifiedTime": "2026-01-01 00:00:00Z"}, "RFC 3339"),
        (m.EntryInfo, {"modifiedTime": 0}, "RFC 3339"),
        (m.EntryInfo, {"name": 0}, "expected string"),
        (m.EntryInfo, {"isSymlink": "true"}, "expected bool"),
        (m.EntryInfo, {"metadata": {"a": None}}, "null"),
        (m.EntryInfo, {"metadata": []}, "expected a JSON object"),
        (m.ListDirResponse, {"entries": {}}, "expected a JSON array"),
        (m.ListDirResponse, {"entries": [None]}, "null"),
        (m.StartRequest, {"process": "ls"}, "expected a JSON object"),
    ],
)
def test_json_that_does_not_fit_the_schema(message: Message, obj: Any, says: str) -> None:
    with pytest.raises(ProtobufError, match=says):
        from_json(message, obj)


def test_a_string_that_utf8_cannot_carry() -> None:
    with pytest.raises(ProtobufError, match="surrogate"):
        encode(m.ProcessConfig, {"cmd": "\ud800"})


def test_schema_mistakes_are_caught() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        Field(1, "a", "float")
    with pytest.raises(ValueError, match="names its message"):
        Field(1, "a", "message")
    with pytest.raises(ValueError, match="out of range"):
        Field(0, "a", "string")
    with pytest.raises(ValueError, match="neither in a oneof nor optional"):
        Field(1, "a", "string", repeated=True, optional=True)
    with pytest.raises(ValueError, match="two fields are number 1"):
        encode(Message("t.Twice", (Field(1, "a", "string"), Field(1, "b", "string"))), {})
    with pytest.raises(ValueError, match="in JSON"):
        encode(Message("t.Json", (Field(1, "a_b", "string"), Field(2, "aB", "string"))), {})


def test_random_and_damaged_input_raises_only_protobuf_error() -> None:
    rng = random.Random(20261127)
    valid = [
        (m.StartRequest, encode(m.StartRequest, START_REQUEST)),
        (m.ListDirResponse, encode(m.ListDirResponse, {"entries": [ENTRY, ENTRY]})),
        (m.ProcessEvent, encode(m.ProcessEvent, {"end": {"exit_code": -1, "status": "x", "error": "e"}})),
        (
            m.GetWatcherEventsResponse,
            encode(m.GetWatcherEventsResponse, {"events": [{"name": "a", "entry": ENTRY}]}),
        ),
        (Node, encode(Node, nested(40))),
    ]
    for i in range(4000):
        message, data = valid[i % len(valid)]
        choice = i % 4
        if choice == 0:
            data = rng.randbytes(rng.randrange(64))
        elif choice == 1:
            data = data[: rng.randrange(len(data) + 1)]
        else:
            damaged = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            data = bytes(damaged)
        try:
            decoded = decode(message, data)
        except ProtobufError:
            continue
        # what decodes, encodes again, and reads back the same
        assert decode(message, encode(message, decoded)) == decoded


# --- the SDK of E2B, which generates its classes with protobuf-py ----------------------------------


def _theirs() -> list[tuple[Message, dict[str, Any], Any]]:
    """Pairs of values: ours, and the same message built with E2B's SDK classes."""
    p = pytest.importorskip("e2b.envd.process.process_pb")
    f = pytest.importorskip("e2b.envd.filesystem.filesystem_pb")
    from protobuf import Oneof
    from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

    def event(member: str, value: Any) -> Any:
        return p.ProcessEvent(event=Oneof(member, value))

    def output(member: str, data: bytes) -> Any:
        return event("data", p.ProcessEvent.DataEvent(output=Oneof(member, data)))

    def watch(member: str, value: Any) -> Any:
        return f.WatchDirResponse(event=Oneof(member, value))

    entry = f.EntryInfo(
        name="link",
        type=f.FileType.SYMLINK,
        path="/home/user/link",
        size=2**40,
        mode=0o777,
        permissions="Lrwxrwxrwx",
        owner="user",
        group="user",
        modified_time=Timestamp(seconds=int(WHEN.timestamp()), nanos=WHEN.microsecond * 1000),
        symlink_target="/home/user/target",
        metadata={"k": "v"},
        is_symlink=True,
    )
    config = p.ProcessConfig(
        cmd="/bin/bash", args=["-l", "-c", "echo hi"], envs={"A": "1", "EMPTY": ""}, cwd=""
    )
    start = p.StartRequest(process=config, pty=p.PTY(size=p.PTY.Size(cols=80, rows=24)), tag="", stdin=False)
    end = {"exit_code": -15, "exited": True, "status": "signal: terminated", "error": "e"}
    stdin = p.ProcessInput(input=Oneof("stdin", b"hi"))
    return [
        (m.StartRequest, START_REQUEST, start),
        (
            m.StartRequest,
            {"process": {"cmd": "ls", "cwd": "/tmp"}, "tag": "t", "stdin": True},
            p.StartRequest(process=p.ProcessConfig(cmd="ls", cwd="/tmp"), tag="t", stdin=True),
        ),
        (m.ProcessEvent, {"start": {"pid": 42}}, event("start", p.ProcessEvent.StartEvent(pid=42))),
        (m.ProcessEvent, {"data": {"stdout": b"out\xff"}}, output("stdout", b"out\xff")),
        (m.ProcessEvent, {"data": {"stderr": b""}}, output("stderr", b"")),
        (m.ProcessEvent, {"data": {"pty": b"\x1b[0m"}}, output("pty", b"\x1b[0m")),
        (m.ProcessEvent, {"end": end}, event("end", p.ProcessEvent.EndEvent(**end))),
        (m.ProcessEvent, {"end": {"exit_code": 1}}, event("end", p.ProcessEvent.EndEvent(exit_code=1))),
        (m.ProcessEvent, {"keepalive": {}}, event("keepalive", p.ProcessEvent.KeepAlive())),
        (
            m.StartResponse,
            {"event": {"start": {"pid": 1}}},
            p.StartResponse(event=event("start", p.ProcessEvent.StartEvent(pid=1))),
        ),
        (
            m.SendSignalRequest,
            {"process": {"tag": "x"}, "signal": 9},
            p.SendSignalRequest(
                process=p.ProcessSelector(selector=Oneof("tag", "x")), signal=p.Signal.SIGKILL
            ),
        ),
        (
            m.StreamInputRequest,
            {"data": {"input": {"stdin": b"hi"}}},
            p.StreamInputRequest(event=Oneof("data", p.StreamInputRequest.DataEvent(input=stdin))),
        ),
        (
            m.ListResponse,
            {"processes": [{"config": {"cmd": "a", "args": ["b"]}, "pid": 3, "tag": "t"}]},
            p.ListResponse(
                processes=[p.ProcessInfo(config=p.ProcessConfig(cmd="a", args=["b"]), pid=3, tag="t")]
            ),
        ),
        (m.EntryInfo, ENTRY, entry),
        (
            m.ListDirResponse,
            {"entries": [ENTRY, {"name": "d", "type": 2}]},
            f.ListDirResponse(entries=[entry, f.EntryInfo(name="d", type=f.FileType.DIRECTORY)]),
        ),
        (m.WatchDirResponse, {"start": {}}, watch("start", f.WatchDirResponse.StartEvent())),
        (m.WatchDirResponse, {"keepalive": {}}, watch("keepalive", f.WatchDirResponse.KeepAlive())),
        (
            m.WatchDirResponse,
            {"filesystem": {"name": "x", "type": 2, "entry": ENTRY}},
            watch("filesystem", f.FilesystemEvent(name="x", type=f.EventType.WRITE, entry=entry)),
        ),
    ]


def test_the_sdk_reads_what_we_write_and_we_read_what_it_writes() -> None:
    for message, ours, theirs in _theirs():
        their_class = type(theirs)
        assert their_class.from_binary(encode(message, ours)) == theirs, message.full_name
        assert decode(message, theirs.to_binary()) == ours, message.full_name


def test_the_sdk_reads_our_json_and_we_read_its_json() -> None:
    for message, ours, theirs in _theirs():
        their_json = json.loads(theirs.to_json())
        assert to_json(message, ours) == their_json, message.full_name
        assert from_json(message, their_json) == ours, message.full_name
        assert type(theirs).from_json(json.dumps(to_json(message, ours))) == theirs, message.full_name
        proto_names = json.loads(theirs.to_json(use_proto_field_name=True, print_enums_as_ints=True))
        assert from_json(message, proto_names) == ours, message.full_name


def test_the_sdk_agrees_on_timestamps_and_their_nanos() -> None:
    filesystem_pb = pytest.importorskip("e2b.envd.filesystem.filesystem_pb")
    from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

    theirs = filesystem_pb.EntryInfo(modified_time=Timestamp(seconds=-1, nanos=123456789))
    moment = datetime(1969, 12, 31, 23, 59, 59, 123456, tzinfo=UTC)  # to the microsecond
    assert decode(m.EntryInfo, theirs.to_binary()) == {"modified_time": moment}
    assert json.loads(theirs.to_json()) == {"modifiedTime": "1969-12-31T23:59:59.123456789Z"}
    assert from_json(m.EntryInfo, json.loads(theirs.to_json())) == {"modified_time": moment}
    back = filesystem_pb.EntryInfo.from_binary(encode(m.EntryInfo, {"modified_time": moment}))
    assert back.modified_time == Timestamp(seconds=-1, nanos=123456000)


def test_the_schemas_match_the_sdk_descriptors() -> None:
    """Every message and field of the SDK's envd files, with our numbers, kinds and presence."""
    process_pb = pytest.importorskip("e2b.envd.process.process_pb")
    filesystem_pb = pytest.importorskip("e2b.envd.filesystem.filesystem_pb")
    kinds = {
        9: "string",
        12: "bytes",
        8: "bool",
        5: "int32",
        17: "sint32",
        13: "uint32",
        3: "int64",
        4: "uint64",
        14: "enum",
        11: "message",
    }
    ours = {v.full_name: v for v in vars(m).values() if isinstance(v, Message)}
    seen = set()

    def check(desc: Any) -> None:
        if desc.proto.options is not None and desc.proto.options.map_entry:
            return
        message = ours[desc.type_name]
        seen.add(desc.type_name)
        names = [o.name for o in desc.proto.oneof_decl]
        assert {f.name for f in message.fields} == {f.name for f in desc.proto.field}, desc.type_name
        for fd in desc.proto.field:
            field = message.by_name(fd.name)
            assert field is not None and field.number == fd.number, fd.name
            is_map = fd.type_name.endswith("Entry") and fd.label == 3
            assert field.kind == ("map" if is_map else kinds[fd.type]), fd.name
            assert field.repeated == (fd.label == 3 and not is_map), fd.name
            assert field.optional == fd.proto3_optional, fd.name
            real_oneof = (
                names[fd.oneof_index] if fd.has_field("oneof_index") and not fd.proto3_optional else None
            )
            assert field.oneof == real_oneof, fd.name
            if field.message is not None:
                assert field.message.full_name == fd.type_name.lstrip("."), fd.name
        for nested_desc in desc.nested_messages:
            check(nested_desc)

    for module in (process_pb, filesystem_pb):
        for desc in module.desc().messages:
            check(desc)
        for enum in module.desc().enums:
            assert dict(vars(m)[enum.name].values) == {v.name: v.number for v in enum.proto.value}
        for service in module.desc().services:
            table = m.PROCESS_METHODS if service.name == "Process" else m.FILESYSTEM_METHODS
            assert set(table) == {x.name for x in service.proto.method}
            for x in service.proto.method:
                request, response, kind = table[x.name]
                assert (request.full_name, response.full_name) == (x.input_type[1:], x.output_type[1:])
                assert (
                    kind
                    == {
                        (False, False): "unary",
                        (False, True): "server_stream",
                        (True, False): "client_stream",
                    }[(x.client_streaming, x.server_streaming)]
                )
    assert seen == set(ours) - {"google.protobuf.Timestamp"}
