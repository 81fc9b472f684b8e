"""The remote client: boxes of a ``sandlot serve`` server, with the local API.

``sandlot.connect_async(url, api_key=...)`` gives an :class:`AsyncClient`; its
boxes (:class:`RemoteAsyncBox`) have the methods, return types and exceptions of
a local ``AsyncBox``: ``exec`` returns the same ``ExecResult``, ``spawn`` the
same ``AsyncProcess``, ``files`` reports the same ``FileInfo``, and every error
the server answers is raised as the sandlot exception it stands for
(``BoxNotFound``, ``InvalidState`` with ``.state`` and ``.allowed``,
``FileNotFoundError`` for a guest ENOENT, ``ExecTimeout``...). The sync twins
(``sandlot.connect``, ``Client``, ``RemoteBox``...) are generated from these
classes into ``api/remote_sync.py`` by ``scripts/gen_sync.py``.

Requests go over one HTTP/1.1 keep-alive connection pool (``httpx``); processes
stream over a WebSocket each (``websockets``), following the frame protocol of
docs/server.md. A process whose socket drops is reattached from the offsets
received, so no byte is lost or repeated while the server's buffer holds it.
A failure to reach the server raises ``ConnectionLost`` (``AgentTimeout`` when
it does not answer in time), with the server's address in the message.

>>> import asyncio, sandlot
>>> async def main() -> None:                                   # doctest: +SKIP
...     async with sandlot.connect_async("http://127.0.0.1:7070", api_key="sk-sl-...") as client:
...         async with client.Box("python:3.12-slim") as box:
...             print((await box.exec("python3", "-c", "print(6*7)")).stdout)
...             await box.files.write("/tmp/hello.txt", "hi")
...             proc = await box.spawn("sh", "-c", "cat; echo done >&2")
...             await proc.write_stdin(b"streamed\\n")
...             await proc.close_stdin()
...             print((await proc.result()).stdout)
>>> asyncio.run(main())                                         # doctest: +SKIP
42
streamed
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import json
import math
import os
import posixpath
import socket
import ssl
import stat as _stat
import struct
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote, urlencode

import httpx
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus

from ..core.validate import argv as check_argv
from ..core.validate import check_env, check_user, guest_path, positive
from ..errors import (
    AgentTimeout,
    CodeTimeout,
    ConnectionLost,
    Forbidden,
    InvalidArgument,
    InvalidState,
    NotFound,
    ProtocolError,
    RequestError,
    SandlotError,
    Unauthorized,
    from_dict,
    output_bytes,
)
from ..protocol.exec import ExitStatus
from ..version import __version__
from .bridge import check_port, socket_bridge
from .code import (
    Callbacks,
    CodeContext,
    ContextArg,
    Execution,
    OutputCallback,
    Result,
    ResultCallback,
    check_language,
    context_id,
)
from .exec_channel import ChannelUnavailable, ExecChannel
from .files import FILE_EVENT_TYPES, AsyncWatch, FileEvent, FileInfo, WatchSource
from .process import AsyncProcess, ExecResult

StdinSource = bytes | str | IO[bytes] | AsyncIterable[bytes] | None
T = TypeVar("T")

CHUNK = 256 * 1024  # bytes per stdin frame and per read of a local file
STDOUT, STDERR = 1, 2
HEADER = struct.Struct(">BQ")  # an output frame: [stream u8][offset u64 big-endian][bytes]
WS_MAX_MESSAGE = 16 << 20
EXEC_STDIN_INLINE = 256 * 1024  # stdin up to this size goes in the exec request (JSON bodies stop at 1 MiB)
# Seconds between tries to reach the server again (about 30 s in all): a restarted
# server needs a few seconds to import and listen, more on a loaded host.
REATTACH_DELAYS = (0.1, 0.25, 0.5, 1.0, 2.0, *[3.0] * 8)
LOCAL_ONLY = "not over a remote connection"
# what a box started from a snapshot may have of its own over a server
SNAPSHOT_START_OPTIONS = frozenset({"env", "labels", "workdir", "user", "idle_timeout", "request_timeout",
                                    "network", "allow"})  # fmt: skip


# -- the WebSocket frame protocol (docs/server.md, "Processes, streamed over WebSocket") ------


def encode_stdin(data: bytes | bytearray | memoryview) -> bytes:
    """A client -> server binary frame carrying stdin bytes: ``[0][bytes]``."""
    return b"\x00" + bytes(data)


def decode_output(frame: bytes) -> tuple[int, int, bytes]:
    """A server -> client binary frame as (stream, offset, bytes); stream 1 is stdout, 2 stderr.
    ProtocolError if it is not one."""
    if len(frame) < HEADER.size:
        raise ProtocolError(f"an output frame of {len(frame)} bytes is shorter than its header")
    stream, offset = HEADER.unpack_from(frame)
    if stream not in (STDOUT, STDERR):
        raise ProtocolError(f"an output frame names stream {stream}; only 1 (stdout) and 2 (stderr) exist")
    return stream, offset, bytes(frame[HEADER.size :])


def encode_output(stream: int, offset: int, data: bytes) -> bytes:
    """A server -> client output frame (the inverse of ``decode_output``; for tests and tools)."""
    return HEADER.pack(stream, offset) + data


def control(kind: str, **fields: Any) -> str:
    """A JSON control message: ``control("signal", signal=15, group=True)``."""
    return json.dumps({"type": kind, **fields}, separators=(",", ":"))


# -- errors ------------------------------------------------------------------------------------

_STATUS_ERRORS: dict[int, type[SandlotError]] = {
    400: RequestError,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    413: RequestError,
}


def error_from_answer(status: int, body: bytes, url: str) -> SandlotError:
    """The exception a non-2xx answer stands for: the server's error body rebuilt as
    its own class (``errors.from_dict``); else one chosen by the HTTP status."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        data = None
    err_body = data.get("error") if isinstance(data, dict) else None
    if isinstance(err_body, dict):
        return from_dict(err_body)
    text = body[:300].decode("utf-8", "replace").strip()
    cls = _STATUS_ERRORS.get(status, ProtocolError)
    return cls(f"{url} answered HTTP {status}" + (f": {text}" if text else ""))


def _transport_error(url: str, exc: Exception) -> SandlotError:
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return AgentTimeout(f"{url} did not answer in time ({type(exc).__name__})")
    detail = str(exc) or type(exc).__name__
    return ConnectionLost(f"lost the connection to {url}: {detail}")


# -- the client ----------------------------------------------------------------------------


class AsyncClient:
    """A connection to a ``sandlot serve`` server (async API).

    ``url`` defaults to ``$SANDLOT_URL``, ``api_key`` to ``$SANDLOT_API_KEY`` (none
    for a server started with ``--no-auth``). ``timeout``: seconds to wait for a
    connection or an answer (a command runs as long as it runs). ``verify``: for
    HTTPS, False or the path of a CA bundle to trust instead of the system's.
    ``transport``: an ``httpx`` transport to send the HTTP requests through instead
    of the network (tests, proxies). ``async with client:`` closes its connections
    at the end; boxes keep running. A client's connections belong to the event loop
    that first uses them: use one client per loop.
    """

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
        url = url.rstrip("/")
        url = url.removesuffix("/v1")
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"the server URL must start with http:// or https://, not {url!r}")
        positive("timeout", timeout)
        self._url = url
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
        self._channel = ExecChannel(lambda: self._websocket("/exec"), url) if transport is None else None
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

    @property
    def url(self) -> str:
        """The server's address (without ``/v1``)."""
        return self._url

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._url}>"

    # -- transport (used by the boxes, files and snapshots of this client) --------------------

    async def _request(
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
        kwargs: dict[str, Any] = {"params": _params(params)}
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
                    raise _transport_error(self._url, e) from None
            except (httpx.TransportError, OSError) as e:
                raise _transport_error(self._url, e) from None
        if r.status_code >= 300:
            raise error_from_answer(r.status_code, r.content, self._url)
        return r

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        r = await self._request(method, path, **kwargs)
        if r.status_code == 204 or not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise ProtocolError(f"{self._url}{r.url.path}: the answer is not JSON") from None

    @contextlib.asynccontextmanager
    async def _stream(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        content: AsyncIterable[bytes] | None = None,
        json_body: Any = None,
        timeout: httpx.Timeout | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """A request whose answer is read as it comes (``_chunks``)."""
        req = self._http.build_request(
            method,
            path,
            params=_params(params),
            content=content,
            json=json_body,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
        try:
            r = await self._http.send(req, stream=True)
        except (httpx.TransportError, OSError) as e:
            raise _transport_error(self._url, e) from None
        try:
            if r.status_code >= 300:
                try:
                    body = await r.aread()
                except (httpx.TransportError, OSError) as e:
                    raise _transport_error(self._url, e) from None
                raise error_from_answer(r.status_code, body, self._url)
            yield r
        finally:
            await r.aclose()

    async def _chunks(self, r: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_bytes(CHUNK):
                yield chunk
        except (httpx.TransportError, OSError) as e:
            raise _transport_error(self._url, e) from None

    def _ws_url(self, path: str, params: Mapping[str, Any] | None = None) -> str:
        base = "wss://" + self._url[8:] if self._url.startswith("https://") else "ws://" + self._url[7:]
        query = urlencode(_params(params) or {})
        return f"{base}/v1{path}" + (f"?{query}" if query else "")

    async def _websocket(self, path: str, params: Mapping[str, Any] | None = None) -> ClientConnection:
        """A WebSocket to ``path``; a refused handshake raises the error the server gave."""
        url = self._ws_url(path, params)
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
            raise error_from_answer(
                e.response.status_code, bytes(e.response.body or b""), self._url
            ) from None
        except InvalidMessage as e:  # the server went away before it answered (a restart, say)
            raise ConnectionLost(f"{self._url}: no answer to the WebSocket handshake: {e}") from None
        except InvalidHandshake as e:
            raise ProtocolError(f"{self._url}: the WebSocket handshake failed: {e}") from None
        except (OSError, TimeoutError) as e:
            raise _transport_error(self._url, e) from None

    # -- boxes --------------------------------------------------------------------------------

    def Box(self, image: str | None = None, **options: Any) -> RemoteAsyncBox:
        """A box of this server that does not exist yet: ``start()`` creates and boots
        it, ``async with`` does the same and removes it at the end (``keep=True``:
        leaves it running). ``options`` as for ``sandlot.AsyncBox``; host paths
        (``rootfs``, ``kernel``, ``ca_cert``) need an admin key, and ``volumes`` or
        ``home`` have no meaning on a server (InvalidArgument)."""
        return RemoteAsyncBox(self, image, **options)

    async def create(self, image: str | None = None, **options: Any) -> RemoteAsyncBox:
        """Create a box (disk ready, image pulled) without starting it; ``options`` as for ``Box``."""
        box = RemoteAsyncBox(self, image, **options)
        await box.create()
        return box

    async def get(self, key: str) -> RemoteAsyncBox:
        """The box with this id, name or id prefix (``BoxNotFound`` if none)."""
        rec = await self._json("GET", f"/boxes/{_seg(key)}")
        return _box_of(self, rec)

    async def list(
        self, *, all: bool = True, state: str | None = None, labels: Mapping[str, str] | None = None
    ) -> builtins.list[RemoteAsyncBox]:
        """The server's boxes this key may see, oldest first. ``all=False``: only running
        or paused ones; ``state``: only that state; ``labels``: only boxes carrying all of them."""
        out: builtins.list[RemoteAsyncBox] = []
        label_params = [f"{k}={v}" for k, v in (labels or {}).items()]
        token: str | None = None
        while True:
            page = await self._json("GET", "/boxes", params={"state": state, "label": label_params,
                                                             "limit": 100, "page_token": token})  # fmt: skip
            out += [_box_of(self, rec) for rec in page.get("boxes", [])]
            token = page.get("next_page_token")
            if not token:
                break
        if not all:
            out = [b for b in out if b.state in ("running", "paused")]
        return out

    # -- snapshots ----------------------------------------------------------------------------

    async def snapshots(self, kind: str | None = None) -> builtins.list[RemoteAsyncSnapshot]:
        """Snapshots and templates this key may see (``kind``: "snapshot" or "template")."""
        data = await self._json("GET", "/snapshots", params={"kind": kind})
        return [RemoteAsyncSnapshot(self, rec) for rec in data.get("snapshots", [])]

    async def get_snapshot(self, key: str) -> RemoteAsyncSnapshot:
        """A snapshot or template by id or name (``SnapshotNotFound`` if none)."""
        return RemoteAsyncSnapshot(self, await self._json("GET", f"/snapshots/{_seg(key)}"))

    async def import_snapshot(
        self, path: str | os.PathLike[str], *, name: str | None = None, start: bool = True
    ) -> RemoteAsyncBox | RemoteAsyncSnapshot:
        """Upload an exported snapshot (streamed from disk); the server verifies it and adds
        it to its home; with ``start`` (the default) it starts a box from it (named
        ``name``) and this returns the box, else the snapshot."""
        src = Path(path)
        if not src.is_file():
            raise InvalidArgument(f"{src} is not a file")
        data = await self._json("POST", "/snapshots/import", params={"name": name, "start": start},
                                content=_file_chunks(src), timeout=self._long())  # fmt: skip
        if start:
            return _box_of(self, data)
        return RemoteAsyncSnapshot(self, data)

    # -- the server ---------------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """The server's version, its host's accelerator and this key's namespace."""
        data: dict[str, Any] = await self._json("GET", "/info")
        return data

    async def aclose(self) -> None:
        """Close the connections to the server (boxes and their processes keep running)."""
        if self._channel is not None:
            await self._channel.aclose()
        await self._http.aclose()

    async def _exec(self, box_id: str, body: dict[str, Any]) -> Any:
        """The answer of a one-shot exec: on the exec channel, or over HTTP where the
        server has none."""
        if self._channel is not None:
            try:
                return await self._channel.call(box_id, body)
            except ChannelUnavailable:
                pass
        return await self._json("POST", f"/boxes/{_seg(box_id)}/exec", json_body=body, timeout=self._long())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _long(self) -> httpx.Timeout:
        """For requests that take as long as they take (a command, an upload): no read deadline."""
        return httpx.Timeout(self._timeout, read=None, write=None)


def _params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Query parameters without the unset ones; booleans as the server spells them."""
    if params is None:
        return None
    out: dict[str, Any] = {}
    for k, v in params.items():
        if v is None or v == []:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else v
    return out


def _seg(key: str) -> str:
    """A path segment: a box's or snapshot's id or name."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"an id or a name is needed, not {key!r}")
    return quote(key, safe="")


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    """A local file, read in a thread chunk by chunk (never whole in memory)."""
    f = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            yield chunk
    finally:
        f.close()


# -- boxes ---------------------------------------------------------------------------------

# BoxCreate's fields (docs/server.md) besides ``image`` and ``start``
_REMOTE_OPTIONS = ("template", "snapshot", "rootfs", "kernel", "ca_cert", "name", "env", "workdir", "user",
                   "labels", "memory_mib", "cpus", "disk_size_gb", "network", "allow", "ports", "pids_limit",
                   "hostname", "boot_timeout", "request_timeout", "idle_timeout", "pull", "insecure",
                   "secrets")  # fmt: skip
# local options a server has no use for, with the value that means "not used"
_LOCAL_ONLY: dict[str, Any] = {"volumes": None, "home": None, "credentials": None, "auto_remove": False,
                               "engine": "qemu", "accel": "auto"}  # fmt: skip


def box_request(image: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of ``POST /boxes`` (``BoxCreate``) for ``AsyncBox``-style arguments;
    InvalidArgument for what a server cannot take (volumes, home...)."""
    body: dict[str, Any] = {}
    for name, value in options.items():
        if name in _LOCAL_ONLY:
            if value is not None and value != _LOCAL_ONLY[name]:
                raise InvalidArgument(f"{LOCAL_ONLY}: {name}")
            continue
        if name not in _REMOTE_OPTIONS:
            raise InvalidArgument(f"unknown box option(s): {name}")
        if value is None:
            continue
        body[name] = _option_json(name, value)
    if image is not None:
        if not isinstance(image, str):
            raise InvalidArgument(f"{LOCAL_ONLY}: an Image object; give its reference (a string)")
        body = {"image": image, **body}
    return body


def _option_json(name: str, value: Any) -> Any:
    if name in ("rootfs", "kernel", "ca_cert"):
        return os.fspath(value)
    if name in ("template", "snapshot"):
        if value is False and name == "template":
            raise InvalidArgument(f"{LOCAL_ONLY}: template=False")
        return _snapshot_key(value)
    if name == "allow":
        return [value] if isinstance(value, str) else [str(a) for a in value]
    if name == "ports":
        return [_port_json(p) for p in value]
    if name == "secrets":
        return [_secret_json(s) for s in value]
    if name in ("env", "labels"):
        return {str(k): str(v) for k, v in dict(value).items()}
    return value


def _port_json(spec: Any) -> dict[str, int]:
    """``80``, ``"8080:80"``, ``(8080, 80)`` or ``{"guest", "host"}`` as the server takes it
    (the server picks the address it binds)."""
    guest: Any
    host: Any = 0
    if isinstance(spec, Mapping):
        guest, host = spec.get("guest"), spec.get("host", 0)
    elif isinstance(spec, int) and not isinstance(spec, bool):
        guest = spec
    elif isinstance(spec, str) and spec.count(":") <= 1:
        h, _, g = spec.rpartition(":")
        if not g.isdigit() or (h and not h.isdigit()):
            raise InvalidArgument(f"port {spec!r} is not GUEST or HOST:GUEST")
        guest, host = int(g), int(h or 0)
    elif isinstance(spec, tuple) and len(spec) == 2:
        host, guest = spec[0] or 0, spec[1]
    elif isinstance(spec, str | tuple):
        raise InvalidArgument(f"{LOCAL_ONLY}: a port's address ({spec!r}); the server chooses it")
    else:
        raise InvalidArgument(f"invalid port {spec!r}")
    for what, n, low in (("guest port", guest, 1), ("host port", host, 0)):
        if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= 65535:
            raise InvalidArgument(f"{what} must be a number in {low}..65535, not {n!r}")
    return {"guest": guest, "host": host}


def _secret_json(secret: Any) -> dict[str, Any]:
    if isinstance(secret, Mapping):
        return {"name": secret["name"], "value": secret["value"], "hosts": list(secret.get("hosts", []))}
    if getattr(secret, "ca_pem", None):
        raise InvalidArgument(f"{LOCAL_ONLY}: a secret's ca= (secret {secret.name})")
    return {"name": secret.name, "value": secret.value, "hosts": list(secret.hosts)}


def _snapshot_key(snap: Any) -> str:
    """A snapshot's id from a snapshot object (async or sync), or an id or name as given."""
    if isinstance(snap, str):
        return snap
    key = getattr(snap, "id", None)
    if isinstance(key, str):
        return key
    raise InvalidArgument(f"a snapshot, or its id or name, is needed, not {type(snap).__name__}")


def _box_of(client: AsyncClient, rec: Any) -> RemoteAsyncBox:
    """The handle of a box the server answered with (kept when a ``with`` block ends, as
    a box found by ``get`` is locally)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
        raise ProtocolError(f"{client.url}: a box's description lacks its id")
    box = RemoteAsyncBox.__new__(RemoteAsyncBox)
    box._init(client, None, True)
    box._rec = rec
    return box


class RemoteAsyncBox:
    """A box of a ``sandlot serve`` server (async API), with the methods of ``AsyncBox``.

    Made by ``client.Box(image, ...)`` (not created yet: ``start()``, or
    ``async with box:``, creates it), ``client.create``, ``client.get`` or
    ``client.list``. The async ``state`` is the state the server last answered
    (``refresh()`` asks anew); the sync ``RemoteBox.state`` asks on each access.
    """

    def __init__(
        self,
        client: AsyncClient,
        image: str | None = None,
        *,
        rootfs: str | os.PathLike[str] | None = None,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        volumes: Any = None,
        labels: Mapping[str, str] | None = None,
        memory_mib: int | None = None,
        cpus: int | None = None,
        disk_size_gb: int | None = None,
        auto_remove: bool = False,
        keep: bool = False,
        pull: str | None = None,
        insecure: bool | None = None,
        ca_cert: str | os.PathLike[str] | None = None,
        credentials: tuple[str, str] | None = None,
        engine: str | None = None,
        accel: str | None = None,
        kernel: str | os.PathLike[str] | None = None,
        hostname: str | None = None,
        boot_timeout: float | None = None,
        request_timeout: float | None = None,
        idle_timeout: float | None = None,
        network: str | bool | None = None,
        allow: Sequence[str] | str | None = None,
        ports: Sequence[Any] | None = None,
        pids_limit: int | None = None,
        secrets: Sequence[Any] | None = None,
        template: Any = None,
        snapshot: Any = None,
        home: Any = None,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "client", "image", "keep")}
        body = box_request(image, options)
        self._init(client, body, keep)

    def _init(self, client: AsyncClient, body: dict[str, Any] | None, keep: bool) -> None:
        self._client = client
        self._body = body  # what creating it will ask for; None once it exists
        self._rec: dict[str, Any] | None = None
        self._removed = False
        self.keep = keep
        self._files = RemoteAsyncFiles(client, self._path)

    # -- what the server answered -----------------------------------------------------------

    @property
    def id(self) -> str:
        """The box's id (InvalidState before it was created)."""
        return str(self._need()["id"])

    @property
    def name(self) -> str:
        """The box's name; before it was created, the name asked for ("" if the server picks it)."""
        if self._rec is None:
            return str((self._body or {}).get("name") or "")
        return str(self._rec.get("name") or "")

    @property
    def client(self) -> AsyncClient:
        """The connection this box is reached through."""
        return self._client

    @property
    def files(self) -> RemoteAsyncFiles:
        """The guest's file system: ``await box.files.read(path)`` and so on."""
        return self._files

    @property
    def state(self) -> str:
        """The state the server last answered (created, running, paused, suspended,
        stopped or crashed; "new" before it was created, "removed" once it is gone)."""
        if self._removed:
            return "removed"
        if self._rec is None:
            return "new"
        return str(self._rec.get("state"))

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def info(self) -> dict[str, Any]:
        """The box as the server last described it (id, name, state, image, labels,
        created_at, started_at, memory_mib, cpus, disk_size_gb, network, origin, reason)."""
        return dict(self._need())

    @property
    def image(self) -> str | None:
        """The image reference the box was made from (None for a root filesystem)."""
        if self._rec is None:
            return (self._body or {}).get("image")
        return self._rec.get("image")

    def _need(self) -> dict[str, Any]:
        if self._rec is None:
            raise InvalidState(f"box {self.name or '(new)'} was not created; call start()", box=self.name,
                               state="new")  # fmt: skip
        return self._rec

    def _path(self, suffix: str = "") -> str:
        return f"/boxes/{_seg(self.id)}{suffix}"

    def _update(self, rec: Any) -> None:
        if isinstance(rec, dict) and isinstance(rec.get("id"), str):
            self._rec = rec

    async def refresh(self) -> str:
        """Ask the server for the box's state anew (another client may have changed it)."""
        if self._rec is None:
            return "removed" if self._removed else "new"
        try:
            self._update(await self._client._json("GET", self._path()))
        except NotFound:
            self._removed = True
        return self.state

    async def inspect(self) -> dict[str, Any]:
        """Everything about the box, JSON-ready."""
        data: dict[str, Any] = await self._client._json("GET", self._path("/inspect"))
        return data

    async def stats(self) -> dict[str, Any]:
        """Host CPU time and memory of the VM, and the disk it uses."""
        data: dict[str, Any] = await self._client._json("GET", self._path("/stats"))
        return data

    async def logs(self, lines: int | None = None) -> str:
        """The guest console (kernel and agent messages) of the last boot; ``lines``: its last lines."""
        r = await self._client._request("GET", self._path("/logs"), params={"lines": lines})
        return r.text

    async def port(self, guest_port: int) -> tuple[str, int]:
        """(host address, host port) where the box's published ``guest_port`` is reachable
        (an address of the server's host)."""
        data = await self._client._json("GET", self._path("/ports"))
        for p in data.get("ports", []):
            if p.get("guest") == guest_port and p.get("host"):
                return str(p.get("address")), int(p["host"])
        raise InvalidArgument(f"box {self.name} does not publish port {guest_port} (or is not running)")

    # -- lifecycle -----------------------------------------------------------------------------

    async def _create(self, *, start: bool) -> None:
        if self._body is None:
            return
        body = {**self._body, "start": start}
        self._update(await self._client._json("POST", "/boxes", json_body=body, timeout=self._client._long()))
        self._body = None

    async def create(self) -> RemoteAsyncBox:
        """Create the box without starting it (a box that exists is left as it is)."""
        await self._create(start=False)
        return self

    async def __aenter__(self) -> RemoteAsyncBox:
        await self._create(start=False)  # created first, so a box that fails to start is known here
        try:
            await self._op("start")
        except BaseException:
            if not self.keep:  # __aexit__ will not run: do its work
                with contextlib.suppress(Exception):
                    await self.remove(force=True)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.keep:
            await self.remove(force=True)

    async def _op(self, op: str, params: Mapping[str, Any] | None = None) -> None:
        rec = await self._client._json("POST", self._path(f"/{op}"), params=params,
                                       timeout=self._client._long())  # fmt: skip
        self._update(rec)

    async def start(self) -> RemoteAsyncBox:
        """Boot the box (creating it first if needed) and wait for its agent.
        A running box is left as it is; the disk is kept across stop/start."""
        if self._body is not None:
            await self._create(start=True)
        else:
            await self._op("start")
        return self

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully: every process gets SIGTERM, then SIGKILL after half of
        ``timeout``; the disk is synced and unmounted; the VM powers off. Forced
        once ``timeout`` has passed. The disk is kept."""
        await self._op("stop", {"timeout": timeout})

    async def restart(self, timeout: float = 10.0) -> None:
        await self._op("restart", {"timeout": timeout})

    async def kill(self) -> None:
        """Stop at once, like pulling the plug (the disk's journal recovers on next boot)."""
        await self._op("kill")

    async def pause(self) -> None:
        """Freeze the vCPUs; RAM and processes stay. Commands wait until unpause()."""
        await self._op("pause")

    async def unpause(self) -> None:
        await self._op("unpause")

    async def remove(self, *, force: bool = False) -> None:
        """Delete the box: its disk, logs and record. A running box needs ``force=True``
        (it is killed first). Removing a removed box does nothing."""
        if self._rec is None:
            return
        with contextlib.suppress(NotFound):
            await self._client._request("DELETE", self._path(), params={"force": force or None},
                                        timeout=self._client._long())  # fmt: skip
        self._removed = True

    # -- exec ----------------------------------------------------------------------------------

    async def spawn(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bool = True,
        keep: str | None = None,
    ) -> AsyncProcess:
        """Start a command and return at once with a handle to stream its output
        (a WebSocket to the server; a dropped one is reattached by itself, also
        across a restart of the server). ``keep`` names it (``AsyncProcess.key``)."""
        args = check_argv(argv)
        if tty and not (0 < rows <= 10000 and 0 < cols <= 10000):
            raise InvalidArgument("rows and cols must be in 1..10000")
        request: dict[str, Any] = {"argv": list(args), "tty": tty, "stdin": stdin}
        if env:
            request["env"] = check_env(env)
        if cwd is not None:
            request["cwd"] = guest_path(cwd)
        if user is not None:
            request["user"] = check_user(user)
        if tty:
            request |= {"rows": rows, "cols": cols}
        ws = await self._client._websocket(self._path("/spawn"))
        try:
            with contextlib.suppress(ConnectionClosed):  # a refusal may come first: read it below
                await ws.send(control("spawn", **request))
            first = await _first_message(ws, self._client.url)
            if first.get("type") != "started" or not isinstance(first.get("id"), str):
                raise ProtocolError(f"{self._client.url}: the server answered a spawn with {first!r}")
        except ConnectionClosed as e:
            raise ConnectionLost(
                f"lost the connection to {self._client.url} while starting {args[0]}: {e}"
            ) from None
        except BaseException:
            with contextlib.suppress(Exception):
                await ws.close()
            raise
        proc = WebSocketProcess(self._client, self._path(), first["id"], int(first.get("pid") or 0), tty, ws)
        return AsyncProcess(args, proc, key=keep)

    async def connect(self, port: int, *, timeout: float = 10.0) -> socket.socket:
        """A socket connected to TCP ``port`` on the box's loopback, through the server
        (a WebSocket to ``/tcp/{port}``) and the agent: the port needs no publishing.
        Use it as any socket; closing it ends the connection. A port nothing listens
        on raises GuestOSError (``ECONNREFUSED``), as locally."""
        check_port(port)
        positive("timeout", timeout)
        ws = await self._client._websocket(self._path(f"/tcp/{port}"))
        try:
            first = await asyncio.wait_for(_first_message(ws, self._client.url), timeout + 5)
            if first.get("type") != "connected":
                raise ProtocolError(f"{self._client.url}: the server answered a connection with {first!r}")
        except BaseException:
            with contextlib.suppress(Exception):
                await ws.close()
            raise
        return socket_bridge(WebSocketDuplex(ws))

    async def preview_url(self, port: int, ttl: float = 3600) -> str:
        """A URL to ``port`` in the box that works without an API key (for a browser,
        a webhook, a teammate) until ``ttl`` seconds from now; signed by the server."""
        check_port(port)
        positive("ttl", ttl)
        body = {"port": port, "ttl": math.ceil(ttl)}
        data = await self._client._json("POST", self._path("/previews"), json_body=body)
        url: str = data["url"]
        return url

    async def processes(self) -> builtins.list[dict[str, Any]]:
        """The processes the server holds for this box (started by ``spawn`` from any
        client): ``{"id", "pid", "argv", "tty", "exit_code", "clients"}`` each."""
        data = await self._client._json("GET", self._path("/processes"))
        found: builtins.list[dict[str, Any]] = data.get("processes", [])
        return found

    async def attach(self, process_id: str, *, stdout: int = 0, stderr: int = 0) -> AsyncProcess:
        """Follow a process the server holds (its id from ``processes()``), from these
        offsets of its output on (what its buffer no longer holds is skipped)."""
        if stdout < 0 or stderr < 0:
            raise InvalidArgument("offsets must not be negative")
        held = next((p for p in await self.processes() if p.get("id") == process_id), None)
        if held is None:
            raise NotFound(
                f"box {self.name} has no process {process_id} on {self._client.url}", box=self.name
            )
        proc = WebSocketProcess(self._client, self._path(), process_id, int(held.get("pid") or 0),
                                bool(held.get("tty")), None, offsets=(stdout, stderr))  # fmt: skip
        await proc.connect()
        return AsyncProcess(tuple(str(a) for a in held.get("argv", ())), proc)

    async def exec(
        self,
        *argv: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: StdinSource = None,
        timeout: float | None = None,
        tty: bool = False,
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion and return its exit code and output.

        ``stdin`` may be bytes, text, a binary file object or an async iterable of
        bytes; without it the command reads /dev/null. On ``timeout`` the command's
        process group is killed and ExecTimeout raised (the box stays usable).
        ``check=True`` raises CommandFailed on a nonzero exit.
        """
        positive("timeout", timeout)
        if isinstance(stdin, str):
            stdin = stdin.encode()
        inline = stdin is None or (isinstance(stdin, bytes | bytearray | memoryview)
                                   and len(stdin) <= EXEC_STDIN_INLINE)  # fmt: skip
        if tty or not inline:  # through a process: a terminal, or stdin streamed
            result = await self._exec_streamed(argv, env, cwd, user, stdin, timeout, tty)
        else:
            args = check_argv(argv)
            body: dict[str, Any] = {"argv": list(args)}
            if env:
                body["env"] = check_env(env)
            if cwd is not None:
                body["cwd"] = guest_path(cwd)
            if user is not None:
                body["user"] = check_user(user)
            if timeout is not None:
                body["timeout"] = timeout
            if isinstance(
                stdin, bytes | bytearray | memoryview
            ):  # base64: its size is known, whatever it holds
                body["stdin_b64"] = base64.b64encode(stdin).decode()
            result = exec_result(args, await self._client._exec(self.id, body))
        return result.check() if check else result

    async def _exec_streamed(
        self,
        argv: tuple[str | os.PathLike[str], ...],
        env: Mapping[str, str] | None,
        cwd: str | None,
        user: str | None,
        stdin: StdinSource,
        timeout: float | None,
        tty: bool,
    ) -> ExecResult:
        """exec through a spawned process: for a terminal, or stdin read as it comes."""
        proc = await self.spawn(*argv, env=env, cwd=cwd, user=user, tty=tty, stdin=stdin is not None)
        feeder = asyncio.ensure_future(_feed(proc, stdin)) if stdin is not None else None
        try:
            return await proc.result(timeout)
        finally:
            if feeder is not None:
                if not feeder.done():
                    feeder.cancel()
                with contextlib.suppress(BaseException):
                    await feeder

    async def sh(self, script: str, **kwargs: Any) -> ExecResult:
        """Run a shell command line with ``/bin/sh -c``; ``kwargs`` as for ``exec``."""
        return await self.exec("/bin/sh", "-c", script, **kwargs)

    # -- code interpreter -------------------------------------------------------------------

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        context: CodeContext | str | None = None,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        """Run a cell of code in the box's interpreter (``AsyncBox.run_code``): the server
        streams its output and results to the callbacks as they come."""
        if not isinstance(code, str):
            raise InvalidArgument(f"code must be a str, not {type(code).__name__}")
        positive("timeout", timeout)
        cid = None if context is None else context_id(context, language)
        body = {"code": code, "language": check_language(language), "context": cid, "timeout": timeout}
        callbacks = Callbacks(on_stdout, on_stderr, on_result)
        buf = b""
        async with self._client._stream("POST", self._path("/code"), json_body=body,
                                        timeout=self._client._long()) as r:  # fmt: skip
            async for chunk in self._client._chunks(r):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    done = await _code_event(json.loads(line), callbacks)
                    if done is not None:
                        return done
        raise ConnectionLost(f"{self._client.url}: the server ended the cell's answer before its end")

    async def create_code_context(
        self,
        *,
        language: str = "python",
        cwd: str | None = None,
        kernel: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> CodeContext:
        """Start a new interpreter in the box (``AsyncBox.create_code_context``)."""
        body = {"language": language, "cwd": cwd, "kernel": kernel, "env": env, "user": user}
        data = await self._client._json("POST", self._path("/code/contexts"), json_body=body,
                                        timeout=self._client._long())  # fmt: skip
        return CodeContext.from_info(data)

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        """The interpreters running in the box."""
        data = await self._client._json("GET", self._path("/code/contexts"))
        return [CodeContext.from_info(c) for c in data["contexts"]]

    async def interrupt_code_context(self, context: ContextArg) -> None:
        """Interrupt the cell the context is running; it keeps its variables."""
        path = self._path(f"/code/contexts/{context_id(context, 'python')}/interrupt")
        await self._client._json("POST", path)

    async def restart_code_context(self, context: ContextArg) -> CodeContext:
        """End the context's interpreter and start a fresh one with the same settings."""
        path = self._path(f"/code/contexts/{context_id(context, 'python')}/restart")
        return CodeContext.from_info(await self._client._json("POST", path, timeout=self._client._long()))

    async def remove_code_context(self, context: ContextArg) -> None:
        """End the context's interpreter and forget it."""
        await self._client._json("DELETE", self._path(f"/code/contexts/{context_id(context, 'python')}"))

    async def ping(self) -> float:
        """Round trip to the server, which reads the box, in seconds."""
        t0 = time.monotonic()
        self._update(await self._client._json("GET", self._path()))
        return time.monotonic() - t0

    async def set_network(
        self, network: str | bool | None = None, *, allow: Sequence[str] | str | None = None
    ) -> None:
        """Change the egress policy: ``network`` (the mode; unchanged if None) and
        ``allow`` (replaces the list; unchanged if None). Between 'public' and
        'allowlist', and for ``allow``, a running box applies it to its next
        connection. Adding or removing the network card, or going to or from
        'open', needs the VM to boot again: stop() the box first."""
        body = {"network": network, "allow": None if allow is None else _option_json("allow", allow)}
        await self._client._json("PUT", self._path("/network"), json_body=body)

    # -- live state -------------------------------------------------------------------------

    async def snapshot(self, name: str | None = None) -> RemoteAsyncSnapshot:
        """Save memory, processes and disk while the box runs (it pauses only for the
        save). Roll back to it, or start boxes from it."""
        rec = await self._client._json("POST", self._path("/snapshots"), json_body={"name": name},
                                       timeout=self._client._long())  # fmt: skip
        return RemoteAsyncSnapshot(self._client, rec)

    async def snapshots(self) -> builtins.list[RemoteAsyncSnapshot]:
        """This box's snapshots, oldest first."""
        data = await self._client._json("GET", self._path("/snapshots"))
        return [RemoteAsyncSnapshot(self._client, rec) for rec in data.get("snapshots", [])]

    async def rollback(self, snapshot: RemoteAsyncSnapshot | str | Any) -> None:
        """Take this box back to one of its snapshots: memory, processes and disk.
        Same id and name; commands running now end (their connection ends with ConnectionLost)."""
        await self._op_json("/rollback", {"snapshot": _snapshot_key(snapshot)})

    async def _op_json(self, suffix: str, body: dict[str, Any]) -> None:
        rec = await self._client._json("POST", self._path(suffix), json_body=body,
                                       timeout=self._client._long())  # fmt: skip
        self._update(rec)

    async def fork(self, n: int = 1, *, name: str | None = None) -> builtins.list[RemoteAsyncBox]:
        """``n`` running copies of this box, from a snapshot taken now; see ``RemoteAsyncSnapshot.start``."""
        data = await self._client._json("POST", self._path("/fork"), json_body={"n": n, "name": name},
                                        timeout=self._client._long())  # fmt: skip
        return [_box_of(self._client, rec) for rec in data.get("boxes", [])]

    async def suspend(self) -> None:
        """Write the running state to disk and end the VM: no CPU, no RAM. ``resume()``
        (from any client), ``start()``, or the next command brings it back."""
        await self._op("suspend")

    async def resume(self) -> None:
        """Bring a suspended box back with its processes."""
        await self._op("resume")

    def __repr__(self) -> str:
        ident = self._rec["id"] if self._rec is not None else "new"
        return f"<{type(self).__name__} {self.name} ({ident}) {self.state} at {self._client.url}>"


def exec_result(argv: tuple[str, ...], data: Mapping[str, Any]) -> ExecResult:
    """The ``ExecResult`` of a ``POST /exec`` answer (the exact bytes from its ``_b64`` fields)."""
    try:
        return ExecResult(
            argv=argv,
            exit_code=int(data["exit_code"]),
            stdout_bytes=output_bytes(data, "stdout"),
            stderr_bytes=output_bytes(data, "stderr"),
            signal=data.get("signal"),
            duration=float(data.get("duration") or 0.0),
            pid=int(data.get("pid") or 0),
            oom_killed=bool(data.get("oom_killed")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"an exec answer without {e}") from None


async def _feed(proc: AsyncProcess, stdin: StdinSource) -> None:
    """Send ``stdin`` to the process, then close it. A process that exits first is not an error."""
    with contextlib.suppress(ConnectionLost):
        if isinstance(stdin, str):
            await proc.write_stdin(stdin.encode())
        elif isinstance(stdin, bytes | bytearray | memoryview):
            await proc.write_stdin(bytes(stdin))
        elif isinstance(stdin, AsyncIterable):
            async for chunk in stdin:
                await proc.write_stdin(chunk)
        elif stdin is not None:  # a binary file object
            while chunk := await asyncio.to_thread(stdin.read, CHUNK):
                await proc.write_stdin(chunk)
        await proc.close_stdin()


async def _first_message(ws: ClientConnection, url: str) -> dict[str, Any]:
    """The server's first JSON message on a process socket; an ``error`` one is raised."""
    msg = await ws.recv()
    if not isinstance(msg, str):
        raise ProtocolError(f"{url}: a process socket began with a binary frame")
    try:
        data = json.loads(msg)
    except ValueError:
        raise ProtocolError(f"{url}: a process socket began with {msg[:100]!r}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{url}: a process socket began with {msg[:100]!r}")
    if data.get("type") == "error" and isinstance(data.get("error"), dict):
        raise from_dict(data["error"])
    return data


class WebSocketDuplex:
    """A raw connection to a box's port over the server's ``/tcp/{port}`` WebSocket."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws

    async def read(self) -> bytes:
        try:
            while True:
                msg = await self._ws.recv()
                if isinstance(msg, bytes):
                    if msg:
                        return msg
                    continue
                return b""  # {"type": "eof"} (or an error): the box's side has closed
        except ConnectionClosed:
            return b""

    async def write(self, data: bytes) -> None:
        await self._ws.send(data)

    async def close_write(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._ws.send(json.dumps({"type": "eof"}))

    async def abort(self) -> None:
        await self._ws.close()


# -- processes over WebSocket -------------------------------------------------------------


class WebSocketStream:
    """One output stream of a process followed over WebSocket: the bytes that came,
    by their offset in the stream, so a frame sent again after a reattach is
    dropped and nothing is repeated. ``lost`` counts bytes the server's buffer no
    longer held when they were asked for (a ``gap``)."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.received = 0  # the offset of the next byte expected
        self.lost = 0
        self.offset = 0  # just past the last byte read
        self._chunks: deque[tuple[int, bytes]] = deque()
        self._eof = False
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def feed(self, offset: int, data: bytes) -> None:
        if offset > self.received:
            raise ProtocolError(
                f"stream {self.stream} skipped from {self.received} to {offset} without a gap"
            )
        end = offset + len(data)
        if end <= self.received:
            return  # bytes already here
        self._chunks.append((self.received, data[self.received - offset :]))
        self.received = end
        self._event.set()

    def gap(self, start: int, end: int) -> None:
        """The server no longer held ``start``..``end``: carry on from ``end``."""
        if end > self.received:
            self.lost += end - max(start, self.received)
            self.received = end

    def end(self, error: BaseException | None = None) -> None:
        if error is not None and self._error is None:
            self._error = error
        self._eof = True
        self._event.set()

    async def read(self) -> bytes:
        """Next chunk, or b"" at the end of the stream (the process's error, if it failed)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._event.clear()
            await self._event.wait()
        at, chunk = self._chunks.popleft()
        self.offset = at + len(chunk)
        return chunk

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def take_buffered(self) -> bytes:
        if not self._chunks:
            return b""
        at, last = self._chunks[-1]
        data = b"".join(chunk for _, chunk in self._chunks)
        self._chunks.clear()
        self.offset = at + len(last)
        return data


class WebSocketProcess:
    """A process of a remote box, followed over a WebSocket: what ``AsyncProcess``
    drives (``process.ProcessHandle``), as the agent's ``RemoteProcess`` is locally.

    Output is read off the socket as it comes (the server buffers it whatever the
    client does, so there is nothing to hold back). If the socket drops before the
    exit, the process is reattached from the offsets received (the server is tried
    again for about 30 s if it cannot be reached); stdin written while it was down
    waits for the new socket. Bytes written just before a drop may be
    lost: stdin is not acknowledged by the protocol.
    """

    def __init__(
        self,
        client: AsyncClient,
        box_path: str,
        process_id: str,
        pid: int,
        tty: bool,
        ws: ClientConnection | None,
        *,
        offsets: tuple[int, int] = (0, 0),
    ) -> None:
        self._client = client
        self._box_path = box_path
        self.id = process_id
        self._pid = pid
        self.tty = tty
        self._stdout = WebSocketStream(STDOUT)
        self._stderr = WebSocketStream(STDERR)
        self._stdout.received, self._stderr.received = offsets
        self._ws = ws
        self._status: ExitStatus | None = None
        self._done: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self._done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        self._changed = asyncio.Event()  # set (and replaced) when the socket is replaced, and at the end
        self._stdin_closed = False
        self._detached = False
        self.reattached = 0
        self._reader: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        if ws is not None:
            self._reader = asyncio.ensure_future(self._read_loop())

    @property
    def pid(self) -> int:
        """The process id inside the guest."""
        return self._pid

    @property
    def stdout(self) -> WebSocketStream:
        return self._stdout

    @property
    def stderr(self) -> WebSocketStream:
        return self._stderr

    @property
    def status(self) -> ExitStatus | None:
        return self._status

    @property
    def finished(self) -> bool:
        return self._done.done()

    async def connect(self) -> None:
        """Open the socket (``attach``) from the offsets received so far and follow it."""
        self._replace(await self._attach())
        self._reader = asyncio.ensure_future(self._read_loop())

    def _replace(self, ws: ClientConnection) -> None:
        self._ws = ws
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _reattach(self) -> ClientConnection:
        """A new socket after a drop; the server may be restarting, so a failure to reach
        it is tried again for a few seconds (an answer that refuses is final)."""
        for delay in REATTACH_DELAYS:
            try:
                return await self._attach()
            except (ConnectionLost, AgentTimeout):
                await asyncio.sleep(delay)
        return await self._attach()

    async def _attach(self) -> ClientConnection:
        params = {"stdout": self._stdout.received, "stderr": self._stderr.received}
        return await self._client._websocket(f"{self._box_path}/processes/{_seg(self.id)}/attach", params)

    # -- reading ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                ws = self._ws
                assert ws is not None
                progressed = False
                try:
                    async for msg in ws:
                        progressed = True
                        if self._handle(msg):
                            await _close_quietly(ws)
                            return
                except ConnectionClosed:
                    pass
                if self._detached or self._done.done():
                    return
                # the socket dropped before the exit: reattach from what arrived
                if not progressed and self.reattached:
                    raise ConnectionLost(f"lost the connection to {self._client.url} and reattaching "
                                         f"process {self.id} brought nothing")  # fmt: skip
                self._replace(await self._reattach())
                self.reattached += 1
        except asyncio.CancelledError:
            self._finish(ConnectionLost(f"stopped following process {self.id}"))
            raise
        except SandlotError as e:
            self._finish(e)
        except Exception as e:  # whatever broke, the process's waiters hear of it
            self._finish(ConnectionLost(f"lost process {self.id} on {self._client.url}: {e}"))

    def _handle(self, msg: str | bytes) -> bool:
        """Take one message; True at the last one."""
        if isinstance(msg, bytes):
            stream, offset, data = decode_output(msg)
            (self._stdout if stream == STDOUT else self._stderr).feed(offset, data)
            return False
        try:
            ctl = json.loads(msg)
            kind = ctl["type"]
        except (ValueError, KeyError, TypeError):
            raise ProtocolError(f"{self._client.url}: a message out of protocol: {msg[:100]!r}") from None
        if kind == "exit":
            code = int(ctl.get("exit_code") or 0)
            sig = ctl.get("signal")
            self._status = ExitStatus(code, int(sig) if sig else None, oom_killed=bool(ctl.get("oom_killed")))
            self._finish(None)
            return True
        if kind == "gap":
            (self._stdout if int(ctl["stream"]) == STDOUT else self._stderr).gap(
                int(ctl["from"]), int(ctl["to"])
            )
        elif kind == "error":
            err = ctl.get("error")
            raise (
                from_dict(err) if isinstance(err, dict) else ProtocolError(f"{self._client.url}: {msg[:200]}")
            )
        return False  # "pong" and messages of later versions are ignored

    def _finish(self, error: BaseException | None) -> None:
        self._changed.set()  # writers waiting for a new socket see the end
        self._stdout.end(error)
        self._stderr.end(error)
        if not self._done.done():
            if error is None and self._status is not None:
                self._done.set_result(self._status)
            else:
                self._done.set_exception(error or ConnectionLost(f"process {self.id} ended without an exit"))
        ws = self._ws
        if ws is not None and error is not None:
            self._closing = asyncio.ensure_future(_close_quietly(ws))

    async def wait(self) -> ExitStatus:
        """The exit status; output keeps arriving meanwhile."""
        return await asyncio.shield(self._done)

    # -- writing ------------------------------------------------------------------------------

    async def _send(self, message: str | bytes) -> None:
        for _attempt in (0, 1):
            ws, changed = self._ws, self._changed
            if self._done.done() or ws is None:
                raise ConnectionLost(f"process {self.id} has ended")
            try:
                await ws.send(message)
                return
            except ConnectionClosed:
                await changed.wait()  # the reader reattaches, or gives up and ends the process
        raise ConnectionLost(f"lost the connection to {self._client.url} (process {self.id})")

    async def write_stdin(self, data: bytes) -> None:
        if self._stdin_closed:
            raise ValueError("stdin is already closed")
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            await self._send(encode_stdin(view[i : i + CHUNK]))

    async def close_stdin(self) -> None:
        if self._stdin_closed:
            return
        self._stdin_closed = True
        with contextlib.suppress(ConnectionLost):
            await self._send(control("stdin_eof"))

    async def signal(self, sig: int, *, group: bool = False) -> None:
        """Send a signal to the process (``group=True``: to its whole process group)."""
        if self._done.done():
            return
        with contextlib.suppress(ConnectionLost):
            await self._send(control("signal", signal=int(sig), group=group))

    async def resize(self, rows: int, cols: int) -> None:
        if not self.tty:
            raise ValueError("resize needs a process started with tty=True")
        await self._send(control("resize", rows=int(rows), cols=int(cols)))

    def detach(self) -> None:
        """Stop following the process; it keeps running in the box (the server holds it:
        ``box.attach(id)`` follows it again)."""
        self._detached = True
        if self._reader is not None:
            self._reader.cancel()
        self._finish(ConnectionLost(f"detached from process {self.id}"))


async def _close_quietly(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        await ws.close()


# -- files ---------------------------------------------------------------------------------


def file_info(data: Mapping[str, Any]) -> FileInfo:
    """A ``FileInfo`` from the server's JSON (``mtime`` in ISO 8601)."""
    try:
        mtime = datetime.fromisoformat(str(data["mtime"]))
        if mtime.tzinfo is None:
            mtime = mtime.replace(tzinfo=UTC)
        return FileInfo(
            path=str(data["path"]),
            name=str(data["name"]),
            type=str(data["type"]),
            size=int(data["size"]),
            mode=int(data["mode"]),
            uid=int(data["uid"]),
            gid=int(data["gid"]),
            mtime=mtime,
            link_target=data.get("link_target"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"a file's description is malformed ({e}): {dict(data)!r:.200}") from None


def _mode(mode: int | None) -> int | None:
    if mode is not None and not (isinstance(mode, int) and 0 <= mode <= 0o7777):
        raise InvalidArgument(f"mode must be an int in 0..0o7777, not {mode!r}")
    return mode


WATCH_READ_TIMEOUT = 60.0  # the server says something at least every 15 s: beyond this it is gone
WATCH_BUFFER = 1024  # events read ahead of the caller; beyond them the server (and the box) hold them


class HttpWatch:
    """A watch of a remote box's path: the server's NDJSON stream (``GET .../files/watch``)
    read by a task of its own, so that a caller's timeout never cuts a line in two."""

    def __init__(self, client: AsyncClient, url: str) -> None:
        self._client = client
        self._url = url
        self._stack = contextlib.AsyncExitStack()
        self._events: asyncio.Queue[FileEvent | BaseException | None] = asyncio.Queue(WATCH_BUFFER)
        self._reader: asyncio.Task[None] | None = None
        self._done = False

    @classmethod
    async def open(cls, client: AsyncClient, url: str, params: Mapping[str, Any]) -> HttpWatch:
        w = cls(client, url)
        timeout = httpx.Timeout(client._timeout, read=WATCH_READ_TIMEOUT)
        try:
            r = await w._stack.enter_async_context(client._stream("GET", url, params=params, timeout=timeout))
            lines = r.aiter_lines()
            first = await w._message(lines)
            if first is None or first.get("type") != "watching":
                raise ProtocolError(f"{client.url}{url}: a watch stream began with {first!r:.200}")
        except BaseException:
            await w._stack.aclose()
            raise
        w._reader = asyncio.ensure_future(w._read(lines))
        return w

    async def _message(self, lines: AsyncIterator[str]) -> dict[str, Any] | None:
        """The next message; None at the end of the stream."""
        try:
            async for text in lines:
                if not text.strip():
                    continue
                try:
                    msg = json.loads(text)
                except ValueError:
                    msg = None
                if not isinstance(msg, dict):
                    raise ProtocolError(f"{self._client.url}{self._url}: not a watch message: {text[:200]!r}")
                if msg.get("type") == "error" and isinstance(msg.get("error"), dict):
                    raise from_dict(msg["error"])
                return msg
        except (httpx.TransportError, OSError) as e:
            raise _transport_error(self._client.url, e) from None
        return None

    async def _read(self, lines: AsyncIterator[str]) -> None:
        item: FileEvent | BaseException | None
        try:
            while True:
                msg = await self._message(lines)
                if msg is None:
                    item = ConnectionLost(f"{self._client.url}: the watch stream ended without its end")
                    break
                kind = msg.get("type")
                if kind == "ping":
                    continue
                if kind == "end":
                    item = None
                    break
                if kind not in FILE_EVENT_TYPES or not isinstance(msg.get("path"), str):
                    raise ProtocolError(f"{self._client.url}: not a watch event: {msg!r:.200}")
                old = msg.get("old_path")
                event = FileEvent(
                    kind, msg["path"], bool(msg.get("is_dir")), old if isinstance(old, str) else None
                )
                await self._events.put(event)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            item = e
        await self._events.put(item)

    async def next(self) -> FileEvent | None:
        if self._done:
            return None
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is None:
            self._done = True
            await self.aclose()
        return item

    async def aclose(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        await self._stack.aclose()  # the server sees the client go and ends the watch


class RemoteAsyncFiles:
    """File operations on a remote box (``box.files``), with the methods of ``AsyncFiles``.
    Transfers stream both ways; a directory travels as one tar stream
    (``upload_dir``/``download_dir``)."""

    def __init__(self, client: AsyncClient, box_path: Callable[[str], str]) -> None:
        self._client = client
        self._box_path = box_path  # suffix -> "/boxes/<id><suffix>": the box may be created after this

    def _path(self, suffix: str) -> str:
        return self._box_path(suffix)

    async def read(self, path: str | os.PathLike[str]) -> bytes:
        """The whole file as bytes."""
        parts = [chunk async for chunk in self.iter_read(path)]
        return b"".join(parts)

    async def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def iter_read(
        self, path: str | os.PathLike[str], *, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes]:
        """Stream a file in chunks (``offset``/``length`` select a range)."""
        p = guest_path(path)
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument("offset and length must not be negative")
        params = {"path": p, "offset": offset or None, "length": length}
        async with self._client._stream("GET", self._path("/files/content"), params=params) as r:
            async for chunk in self._client._chunks(r):
                yield chunk

    async def write(
        self,
        path: str | os.PathLike[str],
        data: bytes | str | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        user: str | None = None,
        append: bool = False,
        parents: bool = True,
        exclusive: bool = False,
    ) -> int:
        """Write a whole file atomically, creating parent directories; keeps an existing
        file's mode and owner unless ``mode``/``user`` say otherwise. ``append`` adds to
        its end; ``exclusive`` fails if it exists (FileExistsError). ``data`` may be an
        async iterable of chunks, streamed as they come. Returns the bytes written."""
        p = guest_path(path)
        if isinstance(data, str):
            data = data.encode()
        options = {"user": check_user(user), "append": append or None, "parents": None if parents else False,
                   "exclusive": exclusive or None}  # fmt: skip
        if isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
            await self._put(p, payload, _mode(mode), **options)
            return len(payload)
        counted = _Counted(data)
        await self._put(p, counted, _mode(mode), **options)
        return counted.total

    async def _put(
        self, path: str, chunks: AsyncIterable[bytes] | bytes, mode: int | None, **options: Any
    ) -> FileInfo:
        params = {"path": path, "mode": mode, **options}
        data = await self._client._json("PUT", self._path("/files/content"), params=params, content=chunks,
                                        timeout=self._client._long())  # fmt: skip
        return file_info(data) if isinstance(data, dict) else await self.stat(path)

    async def upload(
        self,
        local: str | os.PathLike[str],
        remote: str | os.PathLike[str],
        *,
        mode: int | None = None,
        user: str | None = None,
    ) -> int:
        """Copy a host file (streamed) or directory (one tar stream) into the guest.
        A file keeps its permission bits unless ``mode`` is given. Returns bytes copied."""
        src = Path(local)
        dst = guest_path(remote)
        if src.is_dir():
            return await self._put_tree(src, dst, check_user(user))
        if not src.is_file():
            raise InvalidArgument(f"{src} is not a file or directory")
        file_mode = _mode(mode) if mode is not None else _stat.S_IMODE(src.stat().st_mode)
        counted = _Counted(_file_chunks(src))
        await self._put(dst, counted, file_mode, user=check_user(user))
        return counted.total

    async def download(self, remote: str | os.PathLike[str], local: str | os.PathLike[str]) -> int:
        """Copy a guest file to the host (streamed, written atomically). Returns bytes copied."""
        p = guest_path(remote)
        dst = Path(local)
        if dst.is_dir():
            dst = dst / posixpath.basename(p)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
        total = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in self.iter_read(p):
                    await asyncio.to_thread(f.write, chunk)
                    total += len(chunk)
            info = await self.stat(p)
            os.chmod(tmp, info.mode or 0o644)
            os.replace(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return total

    async def stat(self, path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> FileInfo:
        params = {"path": guest_path(path), "follow_symlinks": follow_symlinks}
        data = await self._client._json("GET", self._path("/files/stat"), params=params)
        return file_info(data)

    async def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            await self.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    async def list(self, path: str | os.PathLike[str]) -> builtins.list[FileInfo]:
        """Entries of a directory (without . and ..), sorted by name."""
        data = await self._client._json("GET", self._path("/files"), params={"path": guest_path(path)})
        return sorted((file_info(e) for e in data.get("entries", [])), key=lambda i: i.name)

    async def mkdir(
        self,
        path: str | os.PathLike[str],
        *,
        parents: bool = True,
        mode: int = 0o755,
        user: str | None = None,
    ) -> None:
        """Create a directory; with ``parents`` (default) like ``mkdir -p``."""
        body = {"path": guest_path(path), "parents": parents, "mode": _mode(mode)}
        if user is not None:
            body["user"] = check_user(user)
        await self._client._json("POST", self._path("/files/mkdir"), json_body=body)

    async def remove(
        self, path: str | os.PathLike[str], *, recursive: bool = False, missing_ok: bool = False
    ) -> None:
        """Remove a file, symlink or empty directory (``recursive`` for trees; links are not followed)."""
        params = {"path": guest_path(path), "recursive": recursive or None}
        try:
            await self._client._request("DELETE", self._path("/files"), params=params)
        except FileNotFoundError:
            if not missing_ok:
                raise

    async def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        body = {"src": guest_path(src), "dst": guest_path(dst)}
        await self._client._json("POST", self._path("/files/rename"), json_body=body)

    async def chmod(self, path: str | os.PathLike[str], mode: int) -> None:
        if mode is None:
            raise InvalidArgument("chmod needs a mode")
        body = {"path": guest_path(path), "mode": _mode(mode)}
        await self._client._json("POST", self._path("/files/chmod"), json_body=body)

    def watch(self, path: str | os.PathLike[str], *, recursive: bool = True) -> AsyncWatch:
        """Watch a directory (with everything below it, unless ``recursive=False``)
        or a file for changes: an iterator of ``FileEvent`` (see ``AsyncFiles.watch``),
        streamed from the server."""
        p = guest_path(path)
        client, url = self._client, self._path("/files/watch")

        async def opener() -> WatchSource:
            return await HttpWatch.open(client, url, {"path": p, "recursive": recursive})

        return AsyncWatch(p, recursive, opener)

    async def chown(self, path: str | os.PathLike[str], user: str, *, follow_symlinks: bool = True) -> None:
        """Change the owner; ``user`` is "name", "uid", "name:group" or "uid:gid"."""
        if not user:
            raise InvalidArgument("chown needs a user")
        body = {"path": guest_path(path), "user": check_user(user), "follow_symlinks": follow_symlinks}
        await self._client._json("POST", self._path("/files/chown"), json_body=body)

    async def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str | os.PathLike[str]) -> int:
        """Copy a host directory's tree into ``remote_dir`` (created if needed) as one
        tar stream, built as it is sent. Symbolic links are copied as what they point
        to; sockets and devices are left out. Returns the bytes of the files copied."""
        src = Path(local_dir)
        if not src.is_dir():
            raise InvalidArgument(f"{src} is not a directory")
        return await self._put_tree(src, guest_path(remote_dir), None)

    async def _put_tree(self, src: Path, dst: str, user: str | None) -> int:
        r, w = os.pipe()
        total = [0]
        writer = _in_thread(_tar_tree, src, w, total)
        try:
            params = {"path": dst, "user": user}
            await self._client._request("PUT", self._path("/files/archive"), params=params,
                                        content=_pipe_chunks(r), timeout=self._client._long())  # fmt: skip
        finally:
            os.close(r)  # a writer still busy gets EPIPE and ends
            with contextlib.suppress(BrokenPipeError):
                await writer
        return total[0]

    async def download_dir(
        self, remote_dir: str | os.PathLike[str], local_dir: str | os.PathLike[str]
    ) -> int:
        """Copy the tree under a guest directory into ``local_dir`` (created if needed),
        extracted as the tar stream arrives; members that would land outside it are
        refused (tarfile's ``data`` filter). Returns the bytes of the files copied."""
        src = guest_path(remote_dir)
        dst = Path(local_dir)
        dst.mkdir(parents=True, exist_ok=True)
        r, w = os.pipe()
        reader = _in_thread(_untar_tree, r, dst)
        try:
            async with self._client._stream(
                "GET", self._path("/files/archive"), params={"path": src}
            ) as resp:
                async for chunk in self._client._chunks(resp):
                    try:
                        await asyncio.to_thread(_write_all, w, chunk)
                    except BrokenPipeError:
                        break  # the reader stopped: its error says why
        except BaseException:
            os.close(w)
            w = -1
            with contextlib.suppress(Exception):
                await reader
            raise
        finally:
            if w >= 0:
                os.close(w)
        return await reader


class _Counted:
    """An async iterable of chunks that counts the bytes it passed on."""

    def __init__(self, source: AsyncIterable[bytes]) -> None:
        self._source = source
        self.total = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._source:
            self.total += len(chunk)
            yield bytes(chunk)


def _in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a thread of its own: a transfer's long-running side must not hold
    one of the default executor's few threads, which its short reads and writes need."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=run, name="sandlot-transfer", daemon=True).start()
    return fut


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


async def _pipe_chunks(fd: int) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(os.read, fd, CHUNK):
        yield chunk


def _tar_tree(root: Path, fd: int, total: builtins.list[int]) -> None:
    """Write the tree under ``root`` as a tar stream to ``fd`` (in a thread), then close it."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not (info.isfile() or info.isdir()):
            return None  # the server takes files and directories only
        total[0] += info.size if info.isfile() else 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w|", dereference=True) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, filter=keep)


def _untar_tree(fd: int, dest: Path) -> int:
    """Extract the tar stream read from ``fd`` under ``dest`` (in a thread); the bytes of its files."""
    total = 0
    with os.fdopen(fd, "rb") as src, tarfile.open(fileobj=src, mode="r|") as tar:
        for member in _members(tar):
            tar.extract(member, dest, filter="data")
            total += member.size if member.isfile() else 0
    return total


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := tar.next()) is not None:
        yield member


# -- snapshots -------------------------------------------------------------------------------


class RemoteAsyncSnapshot:
    """A saved running state on a server (async API), with the methods of ``AsyncSnapshot``."""

    def __init__(self, client: AsyncClient, record: Mapping[str, Any]) -> None:
        if not isinstance(record, Mapping) or not isinstance(record.get("id"), str):
            raise ProtocolError(f"{client.url}: a snapshot's description lacks its id")
        self._client = client
        self._rec = dict(record)

    @property
    def id(self) -> str:
        return str(self._rec["id"])

    @property
    def name(self) -> str | None:
        return self._rec.get("name")

    @property
    def kind(self) -> str:
        """ "snapshot" or "template"."""
        return str(self._rec.get("kind"))

    @property
    def box_id(self) -> str | None:
        return self._rec.get("box_id")

    @property
    def box_name(self) -> str | None:
        return self._rec.get("box_name")

    @property
    def created_at(self) -> float:
        return float(self._rec.get("created_at") or 0.0)

    @property
    def size(self) -> int:
        """Bytes of saved state on disk (the frozen disk layer aside)."""
        return int(self._rec.get("size") or 0)

    @property
    def info(self) -> dict[str, Any]:
        """The snapshot as the server described it."""
        return dict(self._rec)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<RemoteSnapshot {self.id}{label} of {self.box_name} at {self._client.url}>"

    def _path(self, suffix: str = "") -> str:
        return f"/snapshots/{_seg(self.id)}{suffix}"

    async def inspect(self) -> dict[str, Any]:
        """The snapshot as the server describes it now."""
        data = await self._client._json("GET", self._path())
        if isinstance(data, dict):
            self._rec = data
        return dict(self._rec)

    async def start(
        self, n: int = 1, *, name: str | None = None, **options: Any
    ) -> builtins.list[RemoteAsyncBox]:
        """Start ``n`` boxes from this state, processes running. ``name``: the box's name
        if ``n`` is 1, else the prefix of their names; ``options``: env, labels, workdir,
        user, idle_timeout, request_timeout, network and allow for each."""
        body: dict[str, Any] = {"n": n, "name": name}
        for option, value in options.items():
            if value is None:
                continue
            if option not in SNAPSHOT_START_OPTIONS:
                raise InvalidArgument(f"{LOCAL_ONLY}: {option} for boxes started from a snapshot")
            body[option] = dict(value) if isinstance(value, Mapping) else value
        if "env" in body:
            body["env"] = check_env(body["env"])
        if "allow" in body and isinstance(body["allow"], str):
            body["allow"] = [body["allow"]]
        data = await self._client._json("POST", self._path("/start"), json_body=body,
                                        timeout=self._client._long())  # fmt: skip
        return [_box_of(self._client, rec) for rec in data.get("boxes", [])]

    async def export(self, path: str | os.PathLike[str]) -> Path:
        """Write this snapshot to one file (streamed from the server) that
        ``import_snapshot`` starts elsewhere. Written under a temporary name and
        renamed when complete."""
        dst = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                async with self._client._stream(
                    "GET", self._path("/export"), timeout=self._client._long()
                ) as r:
                    async for chunk in self._client._chunks(r):
                        await asyncio.to_thread(f.write, chunk)
                await asyncio.to_thread(os.fsync, f.fileno())
            os.replace(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return dst

    async def remove(self) -> None:
        """Delete the snapshot; refused (SnapshotInUse) while boxes started from it exist."""
        await self._client._request("DELETE", self._path())


def connect_async(url: str | None = None, api_key: str | None = None, **kwargs: Any) -> AsyncClient:
    """A connection (``AsyncClient``) to the server at ``url`` (default ``$SANDLOT_URL``)
    with ``api_key`` (default ``$SANDLOT_API_KEY``); ``kwargs``: ``timeout``, ``verify``."""
    return AsyncClient(url, api_key, **kwargs)


async def _code_event(event: dict[str, Any], callbacks: Callbacks) -> Execution | None:
    """One line of a cell's answer: passed to its callback; the execution at the end
    (an error at the end is raised, a CodeTimeout with its execution so far)."""
    kind = event.get("type")
    if kind == "stdout":
        await callbacks.call(callbacks.on_stdout, str(event.get("text", "")))
    elif kind == "stderr":
        await callbacks.call(callbacks.on_stderr, str(event.get("text", "")))
    elif kind == "result":
        bundle = dict(event.get("result") or {})
        main = bool(bundle.pop("is_main_result", False))
        await callbacks.call(callbacks.on_result, Result.from_bundle(bundle, main))
    elif kind == "execution":
        return Execution.from_dict(event.get("execution") or {})
    elif kind == "error":
        err = from_dict(dict(event.get("error") or {}))
        if isinstance(err, CodeTimeout) and isinstance(err.execution, dict):
            err.execution = Execution.from_dict(err.execution)
        raise err
    return None
