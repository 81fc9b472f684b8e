"""The HTTP backend: the boxes of a ``sandlot serve``, over its REST routes and
WebSockets (docs/server.md).

Every operation of ``api/contract.py``'s table is one request to the route the
table names, its arguments in the operation's model and its answer read back by
the operation's codec: this module knows no operation by name. Commands run on
the exec channel (one WebSocket, ``api/exec_channel.py``); processes are followed
over a WebSocket each (``api/follow.py``), made again by themselves if they drop;
files, archives, watches and saved state stream both ways.

Requests go over one HTTP/1.1 keep-alive connection pool (``httpx``). A failure to
reach the server raises ``ConnectionLost`` (``AgentTimeout`` when it does not
answer in time), with the server's address in the message; an error the server
answers is raised as the sandlot exception it stands for (``errors.from_dict``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, urlencode

import httpx
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus

from ..core.events import Event
from ..core.validate import positive
from ..errors import AgentTimeout, ConnectionLost, InvalidArgument, NotFound, ProtocolError, SandlotError
from ..version import __version__
from .backend import (
    BoxRef,
    Command,
    DescribedBoxRef,
    SnapshotRef,
    answered,
    narrowed,
)
from .contract import (
    BOX,
    CHUNK,
    SNAPSHOT,
    SpawnIn,
    Stream,
    Strict,
    box_create,
    decode_control,
    exec_result,
    operation,
    raise_if_error,
    validated,
)
from .contract import error_from_answer as answer_error
from .exec_channel import ChannelUnavailable, ExecChannel
from .follow import Link, LinkClosed
from .lease_keeper import LeaseKeeper
from .process import ExecResult
from .remote import StreamingBackend

WS_MAX_MESSAGE = 16 << 20
EXEC_STDIN_INLINE = 256 * 1024  # stdin up to this size goes in the exec request (JSON bodies stop at 1 MiB)
WATCH_READ_TIMEOUT = 60.0  # the server says something at least every 15 s: beyond this it is gone
EVENTS_RECONNECT_FOR = 30.0  # seconds a followed event stream is tried again after it broke


def transport_error(url: str, exc: Exception) -> SandlotError:
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return AgentTimeout(f"{url} did not answer in time ({type(exc).__name__})")
    detail = str(exc) or type(exc).__name__
    return ConnectionLost(f"lost the connection to {url}: {detail}")


def seg(key: str) -> str:
    """A path segment: a box's or snapshot's id or name."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"an id or a name is needed, not {key!r}")
    return quote(key, safe="")


def query(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Query parameters without the unset ones; booleans as the server spells them."""
    if params is None:
        return None
    out: dict[str, Any] = {}
    for k, v in params.items():
        if v is None or v == []:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else v
    return out


class HttpBoxRef(DescribedBoxRef):
    backend: HttpBackend

    def path(self, suffix: str = "") -> str:
        return f"/boxes/{seg(self.id)}{suffix}"


class HttpSnapshotRef(SnapshotRef):
    def __init__(self, backend: HttpBackend, rec: dict[str, Any]) -> None:
        self.backend = backend
        self.rec = rec

    @property
    def info(self) -> dict[str, Any]:
        return self.rec


class WsLink:
    """A process's WebSocket as a ``follow.Link``."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    async def recv(self) -> str | bytes:
        try:
            return await self.ws.recv()
        except ConnectionClosed:
            raise LinkClosed from None

    async def send(self, message: str | bytes) -> None:
        try:
            await self.ws.send(message)
        except ConnectionClosed:
            raise LinkClosed from None

    async def close(self) -> None:
        await self.ws.close()


class HttpBackend(StreamingBackend):
    """A connection to a ``sandlot serve`` server. See ``AsyncClient`` for the arguments."""

    transport: ClassVar[str] = "http"
    inline_stdin: ClassVar[int] = EXEC_STDIN_INLINE

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        verify: bool | str = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        url = url or os.environ.get("SANDLOT_URL")
        if not url:
            raise InvalidArgument("a server URL is needed: connect(url) or $SANDLOT_URL")
        url = url.rstrip("/").removesuffix("/v1")
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"the server URL must start with http:// or https://, not {url!r}")
        positive("timeout", timeout)
        self.url = url
        key = api_key if api_key is not None else os.environ.get("SANDLOT_API_KEY")
        self._headers = {"User-Agent": f"sandlot/{__version__}"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self._timeout = timeout
        self._ssl: ssl.SSLContext | None = None
        if url.startswith("https://"):
            self._ssl = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if verify is False:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        # execs go over one WebSocket (api/exec_channel.py); with a transport of the
        # caller's, everything goes through it, over HTTP
        self._channel = ExecChannel(lambda: self.websocket("/exec"), url) if transport is None else None
        self._transport = transport
        self._leases: LeaseKeeper | None = None  # made with the first box that holds a lease
        self._http = httpx.AsyncClient(
            base_url=url + "/v1",
            headers=self._headers,
            timeout=httpx.Timeout(timeout),
            verify=self._ssl if self._ssl is not None else True,
            http1=True,
            http2=False,
            follow_redirects=False,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"<HttpBackend {self.url}>"

    # -- requests ---------------------------------------------------------------------------

    def long(self) -> httpx.Timeout:
        """For requests that take as long as they take (a boot, a command, an upload): no
        read deadline."""
        return httpx.Timeout(self._timeout, read=None, write=None)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json_body: Any = None,
        content: AsyncIterable[bytes] | bytes | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        """One request; a non-2xx answer raises the error it carries."""
        kwargs: dict[str, Any] = {"params": query(params)}
        if json_body is not None:
            kwargs["json"] = json_body
        if content is not None:
            kwargs["content"] = content
        if timeout is not None:
            kwargs["timeout"] = timeout
        for attempt in (0, 1):
            try:
                r = await self._http.request(method, path, **kwargs)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                # a kept-alive connection the server closed meanwhile: a read is safe to send again
                if attempt or method != "GET":
                    raise transport_error(self.url, e) from None
            except (httpx.TransportError, OSError) as e:
                raise transport_error(self.url, e) from None
        if r.status_code >= 300:
            raise answer_error(r.status_code, r.content, self.url)
        return r

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        r = await self.request(method, path, **kwargs)
        if r.status_code == 204 or not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise ProtocolError(f"{self.url}{r.url.path}: the answer is not JSON") from None

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        content: AsyncIterable[bytes] | bytes | None = None,
        timeout: httpx.Timeout | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """A request whose answer is read as it comes (``chunks``)."""
        req = self._http.build_request(
            method,
            path,
            params=query(params),
            content=content,
            headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
        try:
            r = await self._http.send(req, stream=True)
        except (httpx.TransportError, OSError) as e:
            raise transport_error(self.url, e) from None
        try:
            if r.status_code >= 300:
                try:
                    body = await r.aread()
                except (httpx.TransportError, OSError) as e:
                    raise transport_error(self.url, e) from None
                raise answer_error(r.status_code, body, self.url)
            yield r
        finally:
            await r.aclose()

    async def chunks(self, r: httpx.Response, *, live: bool = False) -> AsyncIterator[bytes]:
        """The answer's bytes in chunks of ``CHUNK``; ``live``: each as it comes."""
        try:
            async for chunk in r.aiter_bytes(None if live else CHUNK):
                yield chunk
        except (httpx.TransportError, OSError) as e:
            raise transport_error(self.url, e) from None

    async def websocket(self, path: str, params: Mapping[str, Any] | None = None) -> ClientConnection:
        """A WebSocket to ``path``; a refused handshake raises the error the server gave."""
        base = "wss://" + self.url[8:] if self.url.startswith("https://") else "ws://" + self.url[7:]
        q = urlencode(query(params) or {})
        url = f"{base}/v1{path}" + (f"?{q}" if q else "")
        try:
            return await ws_connect(
                url,
                additional_headers=self._headers,
                user_agent_header=None,
                ssl=self._ssl,
                open_timeout=self._timeout,
                max_size=WS_MAX_MESSAGE,
                compression=None,
            )
        except InvalidStatus as e:
            raise answer_error(e.response.status_code, bytes(e.response.body or b""), self.url) from None
        except InvalidMessage as e:  # the server went away before it answered (a restart, say)
            raise ConnectionLost(f"{self.url}: no answer to the WebSocket handshake: {e}") from None
        except InvalidHandshake as e:
            raise ProtocolError(f"{self.url}: the WebSocket handshake failed: {e}") from None
        except (OSError, TimeoutError) as e:
            raise transport_error(self.url, e) from None

    async def first_message(self, ws: ClientConnection) -> dict[str, Any]:
        """The server's first JSON message on a socket; an ``error`` one is raised."""
        msg = await ws.recv()
        if not isinstance(msg, str):
            raise ProtocolError(f"{self.url}: a socket began with a binary frame")
        data = decode_control(msg, self.url)
        raise_if_error(data)
        return data

    # -- boxes ------------------------------------------------------------------------------

    def ref_of(self, rec: Any) -> HttpBoxRef:
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise ProtocolError(f"{self.url}: a box's description lacks its id")
        return HttpBoxRef(self, None, BOX.decode(rec))

    def describe(self, image: Any, options: Mapping[str, Any], *, keep: bool) -> HttpBoxRef:
        if "home" in options:
            raise self.unsupported("home=", hint="a server's boxes live in its home")
        return HttpBoxRef(self, box_create(image, options, self.transport), None)

    async def make(self, ref: BoxRef, *, start: bool, ephemeral: bool = False) -> dict[str, Any]:
        body = {**(http(ref).wanted or {}), "start": start}
        if ephemeral:  # a with block's: the box holds a lease this client renews
            body["ephemeral"] = True
        answer = await self.json("POST", "/boxes", json_body=body, timeout=self.long())
        info = self.ref_of(answer).info
        lease = answer.get("lease") if isinstance(answer, dict) else None
        if isinstance(lease, dict) and isinstance(lease.get("seconds"), int | float):
            self._lease_keeper().hold(info["id"], float(lease["seconds"]))
        return info

    def _let_go(self, box_id: str) -> None:
        if self._leases is not None:
            self._leases.let_go(box_id)

    def _lease_keeper(self) -> LeaseKeeper:
        if self._leases is None:
            if self._transport is None:
                self._leases = LeaseKeeper.over_http(self.url + "/v1", self._headers,
                                                     self._ssl if self._ssl is not None else True,
                                                     self._timeout)  # fmt: skip
            else:  # an in-process transport: renewals go through it, on this loop
                self._leases = LeaseKeeper.on_loop(
                    lambda ids: self.json("POST", "/leases/renew", json_body={"boxes": ids}),
                    asyncio.get_running_loop(), self._timeout)  # fmt: skip
        return self._leases

    async def find(self, key: str) -> HttpBoxRef:
        return self.ref_of(await self.json("GET", f"/boxes/{seg(key)}"))

    async def boxes(self, *, state: str | None, labels: Mapping[str, str] | None) -> list[BoxRef]:
        out: list[BoxRef] = []
        label_params = [f"{k}={v}" for k, v in (labels or {}).items()]
        token: str | None = None
        while True:
            page = await self.json(
                "GET",
                "/boxes",
                params={"state": state, "label": label_params, "limit": 100, "page_token": token},
            )
            out += [self.ref_of(rec) for rec in page.get("boxes", [])]
            token = page.get("next_page_token")
            if not token:
                return out

    async def call(self, scope: str, name: str, target: Any, args: dict[str, Any]) -> Any:
        op = operation(scope, name)  # type: ignore[arg-type]
        params = op.arguments(args).model_dump(exclude_none=True)
        path = op.url(target.id, params)
        for arg in op.in_path:
            del params[arg]
        slow = op.method != "GET"
        kwargs: dict[str, Any] = {"timeout": self.long()} if slow else {}
        if params or not op.in_path:
            kwargs["params" if op.in_query else "json_body"] = params
        kind = op.result.kind
        value: Any
        try:
            if kind == "text":
                value = (await self.request(op.method, path, **kwargs)).text
            else:
                value = op.result.decode(await self.json(op.method, path, **kwargs))
        except NotFound:
            if op.removes or op.describes:  # gone: as a local box is
                target.removed = True
                self._let_go(target.id)
                return None
            raise
        if op.removes:
            target.removed = True
            self._let_go(target.id)
        return answered(kind, value, target, self.ref_of, self.snapshot_of)

    # -- commands ---------------------------------------------------------------------------

    async def exec(self, ref: BoxRef, cmd: Command, stdin: bytes | None, timeout: float | None) -> ExecResult:
        return exec_result(await self._exec(ref.id, cmd.exec_fields(stdin, timeout)), cmd.argv)

    async def _exec(self, box_id: str, body: dict[str, Any]) -> Any:
        """The answer of a one-shot exec: on the exec channel, or over HTTP where the
        server has none."""
        if self._channel is not None:
            try:
                return await self._channel.call(box_id, body)
            except ChannelUnavailable:
                pass
        return await self.json("POST", f"/boxes/{seg(box_id)}/exec", json_body=body, timeout=self.long())

    async def process_link(self, ref: BoxRef, process_id: str, offsets: tuple[int, int]) -> Link:
        params = {"stdout": offsets[0], "stderr": offsets[1]}
        return WsLink(await self.websocket(http(ref).path(f"/processes/{seg(process_id)}/attach"), params))

    async def start_process(self, ref: BoxRef, cmd: Command) -> tuple[str, int, Link]:
        request = validated(SpawnIn, cmd.fields())
        ws = await self.websocket(http(ref).path("/spawn"))
        try:
            with contextlib.suppress(ConnectionClosed):  # a refusal may come first: read it below
                await ws.send(json.dumps(request.model_dump(exclude_none=True)))
            first = await self.first_message(ws)
            if first.get("type") != "started" or not isinstance(first.get("id"), str):
                raise ProtocolError(f"{self.url}: the server answered a spawn with {first!r}")
        except ConnectionClosed as e:
            raise ConnectionLost(
                f"lost the connection to {self.url} while starting {cmd.argv[0]}: {e}"
            ) from None
        except BaseException:
            with contextlib.suppress(Exception):
                await ws.close()
            raise
        return first["id"], int(first.get("pid") or 0), WsLink(ws)

    # -- files ------------------------------------------------------------------------------

    async def frames(self, stream: Stream, ref: BoxRef, params: Strict) -> AsyncGenerator[Any, None]:
        """A request to the stream's route; its answer's bytes as they come, or its lines'
        messages. Between two frames it waits the client's timeout; a lasting stream (a
        watch) a minute, which its pings keep off; a quiet one as long as the box takes."""
        fields = stream.fields(params)
        json_body = {"content": json.dumps(fields).encode(), "headers": {"content-type": "application/json"}}
        sent: dict[str, Any] = {"params": fields} if stream.in_query else json_body
        read = WATCH_READ_TIMEOUT if stream.lasting else None if stream.quiet else self._timeout
        timeout = httpx.Timeout(self._timeout, read=read, write=None)
        async with self.stream(stream.method, stream.url(ref.id), timeout=timeout, **sent) as r:
            if stream.frames == "bytes":
                async for chunk in self.chunks(r, live=stream.live):
                    yield chunk
                return
            try:
                async for text in r.aiter_lines():
                    if text.strip():
                        yield decode_control(text, f"{self.url} ({stream.key})")
            except (httpx.TransportError, OSError) as e:
                raise transport_error(self.url, e) from None

    async def send(
        self, stream: Stream, ref: BoxRef, params: Strict, data: bytes | AsyncIterable[bytes]
    ) -> Any:
        r = await self.request(stream.method, stream.url(ref.id), params=stream.fields(params),
                               content=data, timeout=self.long())  # fmt: skip
        return r.json() if r.content else None

    def where(self, ref: BoxRef) -> str:
        return self.url

    # -- events ---------------------------------------------------------------------------

    async def events(
        self, *, box: str | None, since: float | None, after: int | None, follow: bool
    ) -> AsyncIterator[Event]:
        """The server's ``GET /v1/events`` (Server-Sent Events). A stream cut while
        following is opened again after the last event seen (as an SSE client's
        ``Last-Event-ID``), for ``EVENTS_RECONNECT_FOR`` seconds after it broke."""
        cursor = after
        broke: float | None = None
        while True:
            params = {"box": box, "since": since, "after": cursor, "follow": follow}
            timeout = httpx.Timeout(self._timeout, read=WATCH_READ_TIMEOUT)
            err: SandlotError
            try:
                async with self.stream("GET", "/events", params=params, timeout=timeout) as r:
                    async for ev in sse_events(r.aiter_lines(), f"{self.url}/v1/events"):
                        broke = None
                        cursor = ev.id
                        yield ev
                if not follow:
                    return
                # a followed stream has no end: one that ended was cut (a proxy, a restart)
                err = ConnectionLost(f"{self.url}/v1/events ended")
            except (ConnectionLost, httpx.TransportError, OSError) as e:
                err = e if isinstance(e, ConnectionLost) else transport_error(self.url, e)
            now = asyncio.get_running_loop().time()
            broke = broke or now
            if not (follow and isinstance(err, ConnectionLost)) or now - broke > EVENTS_RECONNECT_FOR:
                raise err from None
            await asyncio.sleep(1.0)

    # -- snapshots --------------------------------------------------------------------------

    def snapshot_of(self, rec: Any) -> HttpSnapshotRef:
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise ProtocolError(f"{self.url}: a snapshot's description lacks its id")
        return HttpSnapshotRef(self, SNAPSHOT.decode(rec))

    async def find_snapshot(self, key: str) -> HttpSnapshotRef:
        return self.snapshot_of(await self.json("GET", f"/snapshots/{seg(key)}"))

    async def snapshot_list(self, *, box: str | None, kind: str | None) -> list[SnapshotRef]:
        data = await self.json("GET", "/snapshots", params={"kind": kind, "box": box})
        return [self.snapshot_of(rec) for rec in data.get("snapshots", [])]

    async def export(self, snap: SnapshotRef, path: Path, since: SnapshotRef | None = None) -> Path:
        from .tarstream import to_host_file

        params = {"since": since.id} if since is not None else None
        async with self.stream("GET", f"/snapshots/{seg(snap.id)}/export", params=params,
                               timeout=self.long()) as r:  # fmt: skip
            await to_host_file(path, self.chunks(r), 0o600)  # a box's memory: its secrets too
        return path

    async def import_snapshot(
        self, path: Path, *, name: str | None, start: bool, options: Mapping[str, Any]
    ) -> BoxRef | SnapshotRef:
        from .tarstream import host_file

        self.refuse_start_options(options)
        data = await self.json(
            "POST",
            "/snapshots/import",
            params={"name": name, "start": start},
            content=host_file(path),
            timeout=self.long(),
        )
        return self.ref_of(data) if start else self.snapshot_of(data)

    # -- named volumes ----------------------------------------------------------------------

    async def volume_create(
        self, name: str, size_gb: float | None, labels: Mapping[str, str] | None, shared: bool = False
    ) -> dict[str, Any]:
        body = {"name": name, "size_gb": size_gb, "labels": dict(labels or {}), "shared": shared}
        made: dict[str, Any] = await self.json("POST", "/volumes", json_body=body)
        return made

    async def volume_list(self) -> list[dict[str, Any]]:
        data = await self.json("GET", "/volumes")
        return list(data.get("volumes", []))

    async def volume_get(self, key: str) -> dict[str, Any]:
        found: dict[str, Any] = await self.json("GET", f"/volumes/{seg(key)}")
        return found

    async def volume_remove(self, key: str) -> None:
        await self.json("DELETE", f"/volumes/{seg(key)}")

    # -- the server -------------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        data: dict[str, Any] = await self.json("GET", "/info")
        return {"transport": self.transport, "url": self.url, **data}

    async def aclose(self) -> None:
        if self._leases is not None:  # the with blocks' boxes go once their leases lapse
            await asyncio.to_thread(self._leases.close)
        if self._channel is not None:
            await self._channel.aclose()
        await self._http.aclose()


async def sse_events(lines: AsyncIterator[str], where: str) -> AsyncIterator[Event]:
    """Events from the lines of a Server-Sent Events stream: each ``data:`` block an
    event's JSON (comments and other fields skipped)."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif not line and data:
            try:
                yield Event.from_json(json.loads("\n".join(data)))
            except (ValueError, InvalidArgument) as exc:
                raise ProtocolError(f"{where}: an event that is not one: {exc}") from None
            data = []


def http(ref: BoxRef) -> HttpBoxRef:
    return narrowed(ref, HttpBoxRef, "a box of a server")
