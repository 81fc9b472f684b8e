"""The Connect protocol's server side, for envd's services (connectrpc.com/docs/protocol).

A Connect call is a POST to ``/{package}.{Service}/{Method}``. A unary call's body
is the message itself (``application/proto`` or ``application/json``); a streaming
call's bodies, both ways, are envelopes (``application/connect+proto`` or
``+json``): a flags byte, a 4-byte big-endian length, the message. A stream ends
with an envelope flagged ``END_STREAM`` holding JSON: ``{"error": {...}}`` or ``{}``.
A unary error is an HTTP status with ``{"code": ..., "message": ...}``.

Written here rather than taken from ``connectrpc``: the E2B SDKs pin its 0.x
releases (and ``protobuf-py``'s), and a server that people install beside those SDKs
must not fight them over versions. What envd needs of the protocol is this page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...api.loop import with_beats
from ...errors import InvalidArgument, SandlotError
from . import protobuf
from .protobuf import Message, ProtobufError

Kind = Literal["unary", "server_stream", "client_stream"]

FLAG_COMPRESSED, FLAG_END_STREAM = 0x01, 0x02
MESSAGE_LIMIT = 16 << 20  # bytes of one message, compressed or not: envd's own default read limit
KEEPALIVE_HEADER = "keepalive-ping-interval"  # seconds between keepalives the client asks for
DEFAULT_KEEPALIVE = 50.0
REQUEST_KEY = "connect.request"  # where a call's decoded request is kept in its scope (for the audit)

# Connect's codes, and the HTTP status a unary error answers with
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429,
    "failed_precondition": 400, "aborted": 409, "out_of_range": 400, "unimplemented": 501,
    "internal": 500, "unavailable": 503, "data_loss": 500, "unauthenticated": 401,
}  # fmt: skip


class ConnectError(SandlotError):
    """An error answered in Connect's shape, with one of its codes (its HTTP status is
    the code's: ``HTTP_STATUS``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.connect_code = code


def code_of(err: BaseException) -> str:
    """The Connect code of an error: sandlot's errors by their HTTP status (a guest's
    missing file is ``not_found``, a box's invalid state ``failed_precondition``)."""
    if isinstance(err, ConnectError):
        return err.connect_code
    if isinstance(err, TimeoutError):
        return "deadline_exceeded"
    if not isinstance(err, SandlotError):
        return "internal"
    return {
        400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
        408: "deadline_exceeded", 409: "failed_precondition", 413: "resource_exhausted",
        423: "unavailable", 429: "resource_exhausted", 501: "unimplemented", 502: "unavailable",
        503: "unavailable", 504: "deadline_exceeded", 507: "resource_exhausted",
    }.get(err.status, "internal")  # fmt: skip


def error_json(err: BaseException) -> dict[str, Any]:
    message = str(err) if isinstance(err, SandlotError) else f"internal error: {type(err).__name__}"
    return {"code": code_of(err), "message": message}


@dataclass(frozen=True)
class Codec:
    name: Literal["proto", "json"]

    def decode(self, message: Message, data: bytes) -> dict[str, Any]:
        if self.name == "proto":
            return protobuf.decode(message, data)
        try:
            obj = json.loads(data) if data.strip() else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtobufError(f"{message.full_name}: the body is not JSON ({e})") from None
        return protobuf.from_json(message, obj, discard_unknown=True)

    def encode(self, message: Message, value: Mapping[str, Any]) -> bytes:
        if self.name == "proto":
            return protobuf.encode(message, value)
        return json.dumps(protobuf.to_json(message, value), separators=(",", ":")).encode()


Unary = Callable[[dict[str, Any], Request], Awaitable[Mapping[str, Any]]]
ServerStream = Callable[[dict[str, Any], Request], AsyncIterator[Mapping[str, Any]]]
ClientStream = Callable[[AsyncIterator[dict[str, Any]], Request], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True)
class Method:
    """One RPC: its messages, its kind, and what answers it."""

    request: Message
    response: Message
    kind: Kind
    handler: Callable[..., Any]
    keepalive: Callable[[], Mapping[str, Any]] | None = None  # a server stream's idle message


async def serve(method: Method, request: Request) -> Response:
    """Answer one Connect call (the caller has authenticated it)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    streaming = method.kind != "unary"
    codec = _codec(content_type, streaming)
    if codec is None:
        want = "application/connect+proto or +json" if streaming else "application/proto or application/json"
        return _unary_error(ConnectError("unimplemented" if streaming else "invalid_argument",
                                         f"content type {content_type or 'none'!r}: this call takes {want}"),
                            415)  # fmt: skip
    if not streaming:
        return await _serve_unary(method, request, codec)
    out_type = f"application/connect+{codec.name}"
    encoding = request.headers.get("connect-content-encoding", "identity").lower()
    if encoding not in ("identity", "gzip"):
        return _unary_error(ConnectError("unimplemented", f"compression {encoding!r} is not supported"))
    envelopes = _envelopes(request.stream(), encoding)
    if method.kind == "client_stream":
        return await _serve_client_stream(method, request, codec, envelopes, out_type)
    try:
        first = await anext(envelopes, None)
        if first is None:
            raise ConnectError("invalid_argument", "the request stream holds no message")
        req = codec.decode(method.request, first)
    except (SandlotError, ProtobufError) as e:
        return _end_only(out_type, e)
    request.scope[REQUEST_KEY] = req
    return StreamingResponse(_stream_out(method, request, codec, req), media_type=out_type)


def _codec(content_type: str, streaming: bool) -> Codec | None:
    if streaming:
        return {"application/connect+proto": Codec("proto"), "application/connect+json": Codec("json")}.get(
            content_type
        )
    return {"application/proto": Codec("proto"), "application/json": Codec("json")}.get(content_type)


async def _serve_unary(method: Method, request: Request, codec: Codec) -> Response:
    try:
        body = await _read_body(request)
        if request.headers.get("content-encoding", "identity").lower() == "gzip":
            body = _gunzip(body)
        elif request.headers.get("content-encoding", "identity").lower() != "identity":
            raise ConnectError("unimplemented", f"compression {request.headers['content-encoding']!r}")
        req = codec.decode(method.request, body)
        request.scope[REQUEST_KEY] = req
        answer = await method.handler(req, request)
        return Response(codec.encode(method.response, answer), media_type=f"application/{codec.name}")
    except Exception as e:
        return _unary_error(e)


async def _read_body(request: Request) -> bytes:
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MESSAGE_LIMIT:
            raise ConnectError(
                "resource_exhausted", f"the message is over the limit of {MESSAGE_LIMIT} bytes"
            )
        parts.append(chunk)
    return b"".join(parts)


def _gunzip(data: bytes) -> bytes:
    """Inflate, refusing to grow past the message limit (a small bomb stays small)."""
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(data, MESSAGE_LIMIT + 1)
    except zlib.error as e:
        raise ConnectError("invalid_argument", f"the gzip body is malformed: {e}") from None
    if len(out) > MESSAGE_LIMIT or inflater.unconsumed_tail:
        raise ConnectError("resource_exhausted", f"the message inflates past {MESSAGE_LIMIT} bytes")
    return out


def _unary_error(err: BaseException, status: int | None = None) -> Response:
    body = error_json(err)
    return Response(json.dumps(body), status_code=status or HTTP_STATUS.get(body["code"], 500),
                    media_type="application/json")  # fmt: skip


async def _envelopes(chunks: AsyncIterator[bytes], encoding: str) -> AsyncIterator[bytes]:
    """The messages of an enveloped request body, inflated where flagged so."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= 5:
            flags, length = struct.unpack_from(">BI", buffer)
            if length > MESSAGE_LIMIT:
                raise ConnectError("resource_exhausted", f"an envelope of {length} bytes is over the limit")
            if len(buffer) < 5 + length:
                break
            data = bytes(buffer[5 : 5 + length])
            del buffer[: 5 + length]
            if flags & FLAG_END_STREAM:
                continue  # a client's end-of-stream carries nothing of use
            if flags & FLAG_COMPRESSED:
                if encoding != "gzip":
                    raise ConnectError(
                        "invalid_argument", "a compressed envelope without Connect-Content-Encoding"
                    )
                data = _gunzip(data)
            yield data
    if buffer:
        raise ConnectError(
            "invalid_argument", f"the request stream ends inside an envelope ({len(buffer)} bytes)"
        )


def envelope(data: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(data)) + data


def _end(err: BaseException | None) -> bytes:
    body: dict[str, Any] = {} if err is None else {"error": error_json(err)}
    return envelope(json.dumps(body).encode(), FLAG_END_STREAM)


def _end_only(media_type: str, err: BaseException) -> Response:
    return Response(_end(err), media_type=media_type)


class Dropped(Exception):
    """Ends a server stream by dropping its connection, as envd's end with its sandbox:
    the SDKs then ask whether the sandbox still runs, and say it was killed."""


async def _stream_out(
    method: Method, request: Request, codec: Codec, req: dict[str, Any]
) -> AsyncIterator[bytes]:
    """A server stream's envelopes: each message, keepalives while the handler is
    quiet, then the end (with the error that ended it, if one did). Past the call's
    deadline (``Connect-Timeout-Ms``) it ends with ``deadline_exceeded``, as a Connect
    server ends it (a process it was following goes on: the call is what timed out)."""
    deadline = _deadline(request)
    messages = with_beats(method.handler(req, request).__aiter__(), _keepalive_interval(request))
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await anext(messages)
            except StopAsyncIteration:
                break
            except TimeoutError:
                if deadline is None or asyncio.get_running_loop().time() < deadline:
                    raise
                raise ConnectError("deadline_exceeded", "the call's Connect-Timeout-Ms passed") from None
            if message is not None:
                yield envelope(codec.encode(method.response, message))
            elif method.keepalive is not None:
                yield envelope(codec.encode(method.response, method.keepalive()))
    except Dropped:
        raise
    except Exception as e:
        yield _end(e)
        return
    finally:
        with contextlib.suppress(Exception):
            await messages.aclose()  # type: ignore[attr-defined]
    yield _end(None)


def _deadline(request: Request) -> float | None:
    """When the call must end, on this loop's clock: its ``Connect-Timeout-Ms`` (at most
    ten digits, as the protocol has it), or None."""
    raw = request.headers.get("connect-timeout-ms", "")
    if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 10):
        return None
    return asyncio.get_running_loop().time() + int(raw) / 1000


def _keepalive_interval(request: Request) -> float:
    raw = request.headers.get(KEEPALIVE_HEADER)
    try:
        value = float(raw) if raw is not None else DEFAULT_KEEPALIVE
    except ValueError:
        value = DEFAULT_KEEPALIVE
    return min(max(value, 1.0), 3600.0)


async def _serve_client_stream(
    method: Method, request: Request, codec: Codec, envelopes: AsyncIterator[bytes], out_type: str
) -> Response:
    async def messages() -> AsyncIterator[dict[str, Any]]:
        async for data in envelopes:
            yield codec.decode(method.request, data)

    try:
        answer = await method.handler(messages(), request)
    except Exception as e:
        return _end_only(out_type, e)
    return Response(envelope(codec.encode(method.response, answer)) + _end(None), media_type=out_type)


def check(condition: bool, message: str) -> None:
    """Refuse a request whose fields do not say what the call needs."""
    if not condition:
        raise InvalidArgument(message)
