"""Protocol Buffers, driven by a schema: the binary wire format and proto3's canonical JSON mapping.

Only what envd's services use: the scalar kinds below, enums, nested messages, repeated
fields, ``map<string, V>``, oneofs, proto3 ``optional`` and ``google.protobuf.Timestamp``.
Written by hand, with the standard library only, because the E2B SDKs pin 0.x releases of
``protobuf-py`` and ``connectrpc``; a server installed beside them must not fight them over
versions (see ``connect.py``).

A message value is a plain ``dict`` keyed by the fields' proto (snake_case) names. A
missing key, or ``None``, is the field's default; ``decode`` and ``from_json`` return only
the fields that were given. A oneof's member is one key of the dict. A Timestamp field's
value is a timezone-aware ``datetime``: it holds microseconds, so the nanoseconds of a
Timestamp are truncated to them on the way in.

    >>> from sandlot.server.e2b.protobuf import Field, Message, decode, encode, to_json
    >>> Point = Message("demo.Point", (Field(1, "x", "sint32"), Field(2, "label_text", "string")))
    >>> encode(Point, {"x": -2, "label_text": "a"})
    b'\\x08\\x03\\x12\\x01a'
    >>> decode(Point, b"\\x08\\x03\\x12\\x01a")
    {'x': -2, 'label_text': 'a'}
    >>> to_json(Point, {"x": -2, "label_text": "a"})
    {'x': -2, 'labelText': 'a'}
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

from ...errors import InvalidArgument

MAX_DEPTH = 64
"""Messages nested deeper than this are refused (protobuf's own parsers have such a limit too):
the codec recurses once per level, and a few bytes of input must not exhaust the stack."""

KINDS = frozenset(
    {"string", "bytes", "bool", "int32", "sint32", "uint32", "int64", "uint64", "enum", "message", "map"}
)
TIMESTAMP = "google.protobuf.Timestamp"

_VARINT_KINDS = frozenset({"bool", "int32", "sint32", "uint32", "int64", "uint64", "enum"})
_RANGES = {
    "int32": (-(2**31), 2**31 - 1),
    "sint32": (-(2**31), 2**31 - 1),
    "enum": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint64": (0, 2**64 - 1),
}
_MASK32 = 2**32 - 1
_MASK64 = 2**64 - 1
_MAX_FIELD_NUMBER = 2**29 - 1
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(?:[Zz]|([+-])([0-9]{2}):([0-9]{2}))"
)
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


class ProtobufError(InvalidArgument):
    """A message that cannot be encoded or decoded: malformed bytes or JSON, or a value
    that does not fit its schema. The message names the message type and the field or offset."""


@dataclass(frozen=True)
class Enum:
    """An enum type. JSON carries its values' names; a number the schema does not know
    passes through as a plain int, as proto3's open enums require."""

    full_name: str
    values: Mapping[str, int]

    def name_of(self, number: int) -> str | None:
        """The name of ``number`` (the first, where aliases share it), or None if it has none."""
        return next((name for name, n in self.values.items() if n == number), None)


@dataclass(frozen=True)
class Field:
    """One field of a message. ``kind`` is a scalar kind, ``"enum"`` (with ``enum``),
    ``"message"`` (with ``message``) or ``"map"`` (with ``map_value``, the value's field;
    keys are strings). ``optional`` is proto3's explicit presence: the field is sent even
    at its default."""

    number: int
    name: str
    kind: str
    message: Message | None = None
    enum: Enum | None = None
    repeated: bool = False
    map_value: Field | None = None
    oneof: str | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        problem = None
        if self.kind not in KINDS:
            problem = f"unknown kind {self.kind!r}"
        elif not 1 <= self.number <= _MAX_FIELD_NUMBER:
            problem = f"field number {self.number} out of range"
        elif (self.kind == "message") != (self.message is not None):
            problem = "a message field, and only one, names its message"
        elif (self.kind == "enum") != (self.enum is not None):
            problem = "an enum field, and only one, names its enum"
        elif (self.kind == "map") != (self.map_value is not None):
            problem = "a map field, and only one, has a map_value"
        elif (self.kind == "map" or self.repeated) and (self.oneof is not None or self.optional):
            problem = "a repeated or map field can be neither in a oneof nor optional"
        elif self.kind == "map" and self.repeated:
            problem = "a map field is not also repeated"
        elif self.map_value is not None and (self.map_value.kind == "map" or self.map_value.repeated):
            problem = "a map's value is a single value"
        elif self.oneof is not None and self.optional:
            problem = "a oneof member is not also optional"
        if problem:
            raise ValueError(f"field {self.name} = {self.number}: {problem}")

    @property
    def json_name(self) -> str:
        """The field's key in JSON: its name in lowerCamelCase, as protoc derives it."""
        head, *rest = self.name.split("_")
        return head + "".join(part[:1].upper() + part[1:] for part in rest)


@dataclass(frozen=True)
class _Index:
    fields: tuple[Field, ...]
    by_number: dict[int, Field]
    by_name: dict[str, Field]
    by_json_key: dict[str, Field]
    oneofs: dict[str, tuple[Field, ...]]
    entries: dict[str, Message]


class Message:
    """A message type: its full name (``package.Outer.Inner``) and its fields.

    The fields may be a callable, or be given later with ``define``, so that messages can
    refer to each other (or to themselves) whatever order they are written in; they are
    read, and checked, the first time the message is used.
    """

    def __init__(self, full_name: str, fields: Iterable[Field] | Callable[[], Iterable[Field]] = ()) -> None:
        self.full_name = full_name
        self._source = fields
        self._resolved: _Index | None = None

    def __repr__(self) -> str:
        return f"Message({self.full_name!r})"

    def define(self, fields: Iterable[Field]) -> None:
        """Give the message its fields, once, before it is first used."""
        if self._resolved is not None:
            raise ValueError(f"{self.full_name} is already in use: its fields are fixed")
        self._source = tuple(fields)

    @property
    def fields(self) -> tuple[Field, ...]:
        """The fields, in field-number order (the order they are encoded in)."""
        return self._index().fields

    def by_number(self, number: int) -> Field | None:
        return self._index().by_number.get(number)

    def by_name(self, name: str) -> Field | None:
        """The field of that proto (snake_case) name."""
        return self._index().by_name.get(name)

    def oneof(self, name: str) -> tuple[Field, ...]:
        """The members of the oneof of that name (none if there is no such oneof)."""
        return self._index().oneofs.get(name, ())

    def _index(self) -> _Index:
        if self._resolved is None:
            self._resolved = self._build()
        return self._resolved

    def _build(self) -> _Index:
        fields = tuple(
            sorted(self._source() if callable(self._source) else self._source, key=lambda f: f.number)
        )
        by_number: dict[int, Field] = {}
        by_name: dict[str, Field] = {}
        by_json_key: dict[str, Field] = {}
        oneofs: dict[str, tuple[Field, ...]] = {}
        entries: dict[str, Message] = {}
        for field in fields:
            if by_number.setdefault(field.number, field) is not field:
                raise ValueError(f"{self.full_name}: two fields are number {field.number}")
            if by_name.setdefault(field.name, field) is not field:
                raise ValueError(f"{self.full_name}: two fields are named {field.name}")
            for key in {field.name, field.json_name}:
                if by_json_key.setdefault(key, field) is not field:
                    raise ValueError(f"{self.full_name}: two fields are {key!r} in JSON")
            if field.oneof is not None:
                oneofs[field.oneof] = (*oneofs.get(field.oneof, ()), field)
            if field.map_value is not None:
                # A map is a repeated entry message {1: key, 2: value}; both are written even
                # at their defaults, as protobuf's encoders do, hence ``optional``.
                value = dataclasses.replace(field.map_value, number=2, name="value", optional=True)
                entry_name = field.json_name[:1].upper() + field.json_name[1:] + "Entry"
                entries[field.name] = Message(
                    f"{self.full_name}.{entry_name}", (Field(1, "key", "string", optional=True), value)
                )
        return _Index(fields, by_number, by_name, by_json_key, oneofs, entries)


def _fail(message: Message, field: Field | None, problem: str) -> ProtobufError:
    where = message.full_name if field is None else f"{message.full_name}.{field.name}"
    return ProtobufError(f"{where}: {problem}")


def _type_name(value: Any) -> str:
    return type(value).__name__


# --- values, checked --------------------------------------------------------------------------------


def _scalar(message: Message, field: Field, value: Any) -> Any:
    """``value`` checked against the field's scalar kind (bytes-like values become bytes)."""
    kind = field.kind
    if kind == "string":
        ok = isinstance(value, str)
    elif kind == "bytes":
        if isinstance(value, bytearray | memoryview):
            value = bytes(value)
        ok = isinstance(value, bytes)
    elif kind == "bool":
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok:
            low, high = _RANGES[kind]
            if not low <= value <= high:
                raise _fail(message, field, f"{value} is out of range for {kind}")
    if not ok:
        raise _fail(message, field, f"expected {kind}, got {_type_name(value)}")
    return value


def _check_fields(message: Message, value: Any) -> _Index:
    """The message's index, once ``value`` is a mapping of its fields with one member per oneof."""
    if not isinstance(value, Mapping):
        raise _fail(message, None, f"expected a mapping of fields, got {_type_name(value)}")
    index = message._index()
    for key in value:
        if key not in index.by_name:
            raise _fail(message, None, f"no field named {key!r}")
    for name, members in index.oneofs.items():
        given = [f.name for f in members if value.get(f.name) is not None]
        if len(given) > 1:
            raise _fail(message, None, f"oneof {name} has more than one member: {', '.join(given)}")
    return index


def _sequence(message: Message, field: Field, value: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise _fail(message, field, f"expected a list, got {_type_name(value)}")
    return value


def _entries(message: Message, field: Field, value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise _fail(message, field, f"expected a mapping, got {_type_name(value)}")
    return value


def _explicit(field: Field) -> bool:
    """Whether the field is sent at its default: proto3 sends a scalar only when it is not,
    unless the field has presence (``optional``, or a oneof member)."""
    return field.optional or field.oneof is not None


def _timestamp_parts(message: Message, field: Field, value: Any) -> dict[str, int]:
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise _fail(message, field, f"expected a timezone-aware datetime, got {value!r}")
    delta = value - _EPOCH
    return {"seconds": delta.days * 86400 + delta.seconds, "nanos": delta.microseconds * 1000}


def _timestamp_value(message: Message, field: Field, parts: Mapping[str, int]) -> datetime:
    seconds, nanos = parts.get("seconds", 0), parts.get("nanos", 0)
    if not 0 <= nanos <= 999_999_999:
        raise _fail(message, field, f"Timestamp nanos {nanos} out of range")
    try:
        return _EPOCH + timedelta(seconds=seconds, microseconds=nanos // 1000)
    except OverflowError:
        raise _fail(message, field, f"Timestamp of {seconds} seconds is out of range") from None


def _format_timestamp(message: Message, field: Field, value: Any) -> str:
    parts = _timestamp_parts(message, field, value)
    moment = _timestamp_value(message, field, parts)  # in UTC, and in Timestamp's range
    text = f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment:%H:%M:%S}"
    micros = moment.microsecond
    if micros:
        # as protobuf prints it: 3 digits when they suffice, else 6 (a datetime has no more)
        text += f".{micros // 1000:03d}" if micros % 1000 == 0 else f".{micros:06d}"
    return text + "Z"


def _parse_timestamp(message: Message, field: Field, text: Any) -> datetime:
    match = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise _fail(message, field, f"expected an RFC 3339 timestamp, got {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    micros = int((match[7] or "0").ljust(6, "0")[:6])
    offset = timedelta()
    if match[8]:
        offset = timedelta(hours=int(match[9]), minutes=int(match[10])) * (-1 if match[8] == "-" else 1)
    try:
        local = datetime(year, month, day, hour, minute, second, micros, tzinfo=timezone(offset))
        return local.astimezone(UTC)
    except (ValueError, OverflowError):
        raise _fail(message, field, f"timestamp {text!r} is not a valid time in range") from None


# --- binary: encoding -------------------------------------------------------------------------------


def encode(message: Message, value: Mapping[str, Any]) -> bytes:
    """The binary encoding of ``value``, fields in number order; raises ProtobufError if it does
    not fit the schema (an unknown key, a wrong type, two members of a oneof)."""
    return bytes(_encode_body(message, value, 0))


def _put_varint(out: bytearray, value: int) -> None:
    value &= _MASK64  # a negative int32 or int64 is its 64-bit two's complement: 10 bytes
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def _put_bytes(out: bytearray, number: int, data: bytes | bytearray) -> None:
    _put_varint(out, number << 3 | _LEN)
    _put_varint(out, len(data))
    out += data


def _varint_of(kind: str, value: int) -> int:
    if kind == "sint32":
        return (value << 1) ^ (value >> 31)
    return value


def _encode_body(message: Message, value: Any, depth: int) -> bytearray:
    if depth > MAX_DEPTH:
        raise _fail(message, None, f"nested deeper than {MAX_DEPTH} messages")
    index = _check_fields(message, value)
    out = bytearray()
    for field in index.fields:
        item = value.get(field.name)
        if item is None:
            continue
        if field.kind == "map":
            entry = index.entries[field.name]
            for key, entry_value in _entries(message, field, item).items():
                if entry_value is None:
                    raise _fail(message, field, f"the value of key {key!r} is null")
                _put_bytes(
                    out, field.number, _encode_body(entry, {"key": key, "value": entry_value}, depth + 1)
                )
        elif field.repeated and field.kind in _VARINT_KINDS:
            items = _sequence(message, field, item)
            if items:  # packed, as proto3 encodes repeated numbers
                packed = bytearray()
                for element in items:
                    _put_varint(packed, _varint_of(field.kind, _scalar(message, field, element)))
                _put_bytes(out, field.number, packed)
        elif field.repeated:
            for element in _sequence(message, field, item):
                _encode_one(message, field, element, out, depth, explicit=True)
        else:
            _encode_one(message, field, item, out, depth, explicit=_explicit(field))
    return out


def _encode_one(
    message: Message, field: Field, value: Any, out: bytearray, depth: int, *, explicit: bool
) -> None:
    if field.message is not None:
        if field.message.full_name == TIMESTAMP:
            value = _timestamp_parts(message, field, value)
        _put_bytes(out, field.number, _encode_body(field.message, value, depth + 1))
        return
    value = _scalar(message, field, value)
    if not value and not explicit:
        return
    if field.kind == "string":
        try:
            _put_bytes(out, field.number, value.encode())
        except UnicodeEncodeError:
            raise _fail(message, field, "the string is not valid Unicode (a lone surrogate)") from None
    elif field.kind == "bytes":
        _put_bytes(out, field.number, value)
    else:
        _put_varint(out, field.number << 3 | _VARINT)
        _put_varint(out, _varint_of(field.kind, value))


# --- binary: decoding -------------------------------------------------------------------------------


def decode(message: Message, data: bytes) -> dict[str, Any]:
    """The fields present in ``data``. Unknown fields are skipped; a field given twice keeps
    the last value (a message merges, a list grows); a oneof keeps its last member. Raises
    ProtobufError, and nothing else, on malformed input."""
    return _decode_body(message, bytes(data), 0)


def _read_varint(message: Message, data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        byte = data[i]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, i + 1
        shift += 7
    if pos + 10 <= len(data):
        raise _fail(message, None, f"varint at offset {pos} is longer than 10 bytes")
    raise _fail(message, None, f"truncated varint at offset {pos}")


def _read_bytes(message: Message, data: bytes, pos: int) -> tuple[bytes, int]:
    length, start = _read_varint(message, data, pos)
    if length > len(data) - start:
        raise _fail(message, None, f"length {length} at offset {pos} runs past the end ({len(data)} bytes)")
    return data[start : start + length], start + length


def _skip(message: Message, data: bytes, pos: int, wire: int, at: int) -> int:
    if wire == _VARINT:
        return _read_varint(message, data, pos)[1]
    if wire == _LEN:
        return _read_bytes(message, data, pos)[1]
    if wire not in (_I64, _I32):
        raise _fail(message, None, f"unsupported wire type {wire} at offset {at}")
    end = pos + (8 if wire == _I64 else 4)
    if end > len(data):
        raise _fail(message, None, f"truncated fixed-width field at offset {at}")
    return end


def _from_varint(kind: str, raw: int) -> int | bool:
    """A varint's value as the kind reads it: 32-bit kinds truncate, as protobuf's parsers do."""
    if kind == "bool":
        return raw != 0
    if kind in ("int32", "enum"):
        raw &= _MASK32
        return raw - (1 << 32) if raw >> 31 else raw
    if kind == "sint32":
        raw &= _MASK32
        return (raw >> 1) ^ -(raw & 1)
    if kind == "uint32":
        return raw & _MASK32
    if kind == "int64":
        return raw - (1 << 64) if raw >> 63 else raw
    return raw


def _decode_body(message: Message, data: bytes, depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise _fail(message, None, f"nested deeper than {MAX_DEPTH} messages")
    index = message._index()
    out: dict[str, Any] = {}
    # A singular message given more than once is merged, which is the same as parsing
    # its pieces joined: collect them, and parse each field once at the end.
    pieces: dict[str, list[bytes]] = {}
    pos = 0
    while pos < len(data):
        at = pos
        tag, pos = _read_varint(message, data, pos)
        number, wire = tag >> 3, tag & 7
        if not 1 <= number <= _MAX_FIELD_NUMBER:
            raise _fail(message, None, f"invalid field number {number} at offset {at}")
        field = index.by_number.get(number)
        if field is None:
            pos = _skip(message, data, pos, wire, at)
            continue
        if field.oneof is not None:
            for other in index.oneofs[field.oneof]:
                if other is not field:
                    out.pop(other.name, None)
                    pieces.pop(other.name, None)
        value: Any
        if field.kind in _VARINT_KINDS and wire == _VARINT:
            raw, pos = _read_varint(message, data, pos)
            value = _from_varint(field.kind, raw)
        elif field.kind in _VARINT_KINDS and wire == _LEN and field.repeated:
            packed, pos = _read_bytes(message, data, pos)
            values, inner = [], 0
            while inner < len(packed):
                raw, inner = _read_varint(message, packed, inner)
                values.append(_from_varint(field.kind, raw))
            out.setdefault(field.name, []).extend(values)
            continue
        elif wire == _LEN and field.kind not in _VARINT_KINDS:
            chunk, pos = _read_bytes(message, data, pos)
            if field.kind == "map":
                entry = _decode_body(index.entries[field.name], chunk, depth + 1)
                out.setdefault(field.name, {})[entry.get("key", "")] = (
                    entry["value"] if "value" in entry else _map_default(field, depth)
                )
                continue
            if field.kind == "message" and not field.repeated:
                pieces.setdefault(field.name, []).append(chunk)
                continue
            value = _from_chunk(message, field, chunk, depth)
        else:
            raise _fail(message, field, f"wrong wire type {wire} at offset {at}")
        if field.repeated:
            out.setdefault(field.name, []).append(value)
        else:
            out[field.name] = value
    for name, chunks in pieces.items():
        out[name] = _from_chunk(message, index.by_name[name], b"".join(chunks), depth)
    return out


def _from_chunk(message: Message, field: Field, chunk: bytes, depth: int) -> Any:
    """A length-delimited value of a string, bytes or message field."""
    if field.message is not None:
        value = _decode_body(field.message, chunk, depth + 1)
        return _timestamp_value(message, field, value) if field.message.full_name == TIMESTAMP else value
    if field.kind == "bytes":
        return chunk
    try:
        return chunk.decode()
    except UnicodeDecodeError:
        raise _fail(message, field, "the string is not valid UTF-8") from None


def _map_default(field: Field, depth: int) -> Any:
    """The value of a map entry whose value was left out: the default of the map's value."""
    assert field.map_value is not None  # a map field has one (Field.__post_init__)
    value = field.map_value
    if value.message is not None:
        return _from_chunk(value.message, value, b"", depth + 1)
    return {"string": "", "bytes": b"", "bool": False}.get(value.kind, 0)


# --- JSON -------------------------------------------------------------------------------------------


def to_json(message: Message, value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` in proto3's canonical JSON, as ``json.dumps`` takes it: lowerCamelCase keys,
    fields at their default left out (unless they have presence), 64-bit integers as strings,
    bytes in padded standard base64, enums by name, Timestamps in RFC 3339."""
    return _json_body(message, value, 0)


def _json_body(message: Message, value: Any, depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise _fail(message, None, f"nested deeper than {MAX_DEPTH} messages")
    index = _check_fields(message, value)
    out: dict[str, Any] = {}
    for field in index.fields:
        item = value.get(field.name)
        if item is None:
            continue
        if field.kind == "map":
            entry = index.entries[field.name]
            value_field = entry._index().by_number[2]
            mapping = {
                _scalar(entry, entry._index().by_number[1], key): _json_one(entry, value_field, v, depth)
                for key, v in _entries(message, field, item).items()
            }
            if mapping:
                out[field.json_name] = mapping
        elif field.repeated:
            elements = _sequence(message, field, item)
            if elements:
                out[field.json_name] = [_json_one(message, field, element, depth) for element in elements]
        else:
            converted = _json_one(message, field, item, depth)
            if field.kind == "message" or item or _explicit(field):
                out[field.json_name] = converted
    return out


def _json_one(message: Message, field: Field, value: Any, depth: int) -> Any:
    if field.message is not None:
        if field.message.full_name == TIMESTAMP:
            return _format_timestamp(message, field, value)
        return _json_body(field.message, value, depth + 1)
    value = _scalar(message, field, value)
    if field.kind == "bytes":
        return base64.b64encode(value).decode("ascii")
    if field.kind in ("int64", "uint64"):
        return str(value)
    if field.enum is not None:
        name = field.enum.name_of(value)
        return value if name is None else name
    return value


def from_json(message: Message, obj: Any, *, discard_unknown: bool = False) -> dict[str, Any]:
    """The fields of a parsed JSON object (``json.loads``'s output). Keys may be lowerCamelCase
    or the proto names; ``null`` is a field left out; integers may be numbers or strings; bytes
    standard or URL-safe base64, padded or not; enums names or numbers. An unknown key is an
    error, as proto3's JSON parsers make it by default, unless ``discard_unknown`` (what a
    server does, as connect-go's does: a newer client's new fields are skipped, as the binary
    codec skips unknown fields)."""
    return _parse_body(message, obj, 0, discard_unknown)


def _parse_body(message: Message, obj: Any, depth: int, discard_unknown: bool = False) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise _fail(message, None, f"nested deeper than {MAX_DEPTH} messages")
    if not isinstance(obj, dict):
        raise _fail(message, None, f"expected a JSON object, got {_type_name(obj)}")
    index = message._index()
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for key, item in obj.items():
        field = index.by_json_key.get(key)
        if field is None:
            if discard_unknown:
                continue
            raise _fail(message, None, f"unknown field {key!r}")
        if field.name in seen:
            raise _fail(message, field, "given twice (by its JSON name and by its proto name)")
        seen.add(field.name)
        if item is None:
            continue
        if field.oneof is not None:
            other = next((f.name for f in index.oneofs[field.oneof] if f.name in out), None)
            if other is not None:
                raise _fail(
                    message, None, f"oneof {field.oneof} has more than one member: {other}, {field.name}"
                )
        if field.kind == "map":
            if not isinstance(item, dict):
                raise _fail(message, field, f"expected a JSON object, got {_type_name(item)}")
            entry = index.entries[field.name]
            value_field = entry._index().by_number[2]
            out[field.name] = {
                _scalar(entry, entry._index().by_number[1], k): _parse_one(
                    entry, value_field, v, depth, discard_unknown
                )
                for k, v in item.items()
            }
        elif field.repeated:
            if not isinstance(item, list):
                raise _fail(message, field, f"expected a JSON array, got {_type_name(item)}")
            out[field.name] = [_parse_one(message, field, e, depth, discard_unknown) for e in item]
        else:
            out[field.name] = _parse_one(message, field, item, depth, discard_unknown)
    return out


def _parse_one(message: Message, field: Field, value: Any, depth: int, discard_unknown: bool = False) -> Any:
    if value is None:
        raise _fail(message, field, "null in a list or map")
    if field.message is not None:
        if field.message.full_name == TIMESTAMP:
            return _parse_timestamp(message, field, value)
        return _parse_body(field.message, value, depth + 1, discard_unknown)
    kind = field.kind
    if kind == "bytes":
        return _parse_base64(message, field, value)
    if field.enum is not None and isinstance(value, str):
        number = field.enum.values.get(value)
        if number is None:
            raise _fail(message, field, f"{value!r} is not a value of {field.enum.full_name}")
        return number
    if kind in _RANGES:
        value = _parse_integer(message, field, value)
    return _scalar(message, field, value)


def _parse_integer(message: Message, field: Field, value: Any) -> Any:
    """An integer given as a JSON number or string; ``1.0`` and ``"1e3"`` are integers too.
    Anything else is returned as it is, for ``_scalar`` to refuse by its type."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        if not _JSON_NUMBER.fullmatch(value):
            raise _fail(message, field, f"{value!r} is not a number")
        try:
            number = Decimal(value)
            # bounds the exponent before int() expands it: "1e999999999" must not cost a gigabyte
            if number.adjusted() > 20 or number != number.to_integral_value():
                raise InvalidOperation
        except InvalidOperation:
            raise _fail(message, field, f"{value!r} is not a {field.kind}") from None
        return int(number)
    if isinstance(value, float):
        raise _fail(message, field, f"{value!r} is not an integer")
    return value


def _parse_base64(message: Message, field: Field, value: Any) -> bytes:
    if not isinstance(value, str):
        raise _fail(message, field, f"expected base64 text, got {_type_name(value)}")
    standard = value.replace("-", "+").replace("_", "/").rstrip("=")
    try:
        return base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _fail(message, field, "not valid base64") from None
