"""E2B's API, served by ``sandlot serve``: the control API, envd and the code
interpreter's endpoint (docs/e2b.md).

Everything is under ``/e2b`` of the server. A request that names a sandbox in the
``E2b-Sandbox-Id`` header (as E2B's SDKs send to ``E2B_SANDBOX_URL``) is for the
sandbox itself: envd's services, ``/files``, or port 49999's code interpreter. It
carries no API key but the sandbox's access token (``X-Access-Token``), which the
control API hands out with each sandbox. Any other request is for the control API,
authenticated by an API key like the rest of the server.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route

from ...api import access
from ...api.box import AsyncBox
from ...errors import RequestError, SandlotError, Unauthorized
from ..state import KEY_LABEL, Caller, ServerState
from . import control, interpreter
from .connect import REQUEST_KEY
from .envd import ENVD_PORT, Envd

PREFIX = "/e2b"
SANDBOX_HEADER, PORT_HEADER = "e2b-sandbox-id", "e2b-sandbox-port"
INTERPRETER_PORT = 49999
E2B_PORTS = (ENVD_PORT, INTERPRETER_PORT)  # a sandbox's ports that sandlot serves itself
# Calls that read are not audited, nor a process's stdin and terminal size (a keystroke
# each, and never what was typed); every other call to a sandbox is, as the server's own
# routes audit every request that is not a GET
NOT_AUDITED = frozenset({
    "/health", "/process.Process/List", "/process.Process/Connect", "/process.Process/SendInput",
    "/process.Process/StreamInput", "/process.Process/Update", "/filesystem.Filesystem/Stat",
    "/filesystem.Filesystem/ListDir", "/filesystem.Filesystem/WatchDir",
    "/filesystem.Filesystem/GetWatcherEvents",
})  # fmt: skip

Scope = MutableMapping[str, Any]


def error_response(err: SandlotError) -> JSONResponse:
    """E2B's error shape (``{"code": STATUS, "message": ...}``), for the server's guard."""
    return control.error_response(err)


def is_sandbox_request(path: str, headers: dict[str, str], query: bytes = b"") -> bool:
    """A request for a sandbox itself, which its access token authenticates, not an API key:
    one naming its sandbox, or a signed ``/files`` URL (whose signature names it). The SDKs
    make that URL at the root of ``E2B_SANDBOX_URL``'s host (``/files``: a URL joined with
    an absolute path), so it is taken there too."""
    if path in ("/files", PREFIX + "/files") and b"signature=" in query:
        return True
    return path.startswith(PREFIX + "/") and SANDBOX_HEADER in headers


class E2bFace:
    """The ASGI app mounted at ``/e2b``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.control = FastAPI(title="sandlot: E2B's control API", openapi_url=None, docs_url=None,
                               redoc_url=None)  # fmt: skip
        self.control.state.server = state
        self.control.include_router(control.router)
        self.control.add_exception_handler(SandlotError, _control_error)  # type: ignore[arg-type]
        self.control.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
        self.control.add_exception_handler(StarletteHTTPException, _not_served)  # type: ignore[arg-type]
        self.envd = Envd(state, self.box_of)
        self.interpreter = interpreter.Interpreter(self.box_of, self.envd.runs_as)
        every = ["GET", "POST", "PUT", "DELETE", "HEAD"]
        self.sandbox = Starlette(routes=[Route("/{path:path}", self.serve_sandbox, methods=every)])

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if scope["type"] == "http" and SANDBOX_HEADER not in headers and _route_path(scope) == "/files":
            # a signed URL made where one E2B_SANDBOX_URL serves every sandbox names none:
            # its signature, made with one sandbox's token, says which
            try:
                box_id = await self._signer(scope)
            except SandlotError as e:
                await error_response(e)(scope, receive, send)
                return
            named = (SANDBOX_HEADER.encode(), box_id.encode())
            scope = {**scope, "headers": [*scope.get("headers", ()), named]}
            headers[SANDBOX_HEADER] = box_id
        if scope["type"] == "http" and SANDBOX_HEADER in headers:
            await self.sandbox(scope, receive, send)
        else:
            await self.control(scope, receive, send)

    async def _signer(self, scope: Scope) -> str:
        """The sandbox whose envd token signed a bare signed ``/files`` URL: each E2B sandbox
        of the home is tried (a hash each); none, and the URL's signature is wrong."""
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        if "signature" not in query:
            raise Unauthorized("a /files URL without a sandbox's id needs a signature")
        home, method = self.state.home, scope.get("method", "GET")
        for box in await AsyncBox.list(home=home):
            if control.TEMPLATE_LABEL in box.info["labels"]:
                token = access.sandbox_token(box.id, "envd", home)
                if hmac.compare_digest(_given(query), file_signature(query, method, token)):
                    return box.id
        raise Unauthorized("this URL's signature is wrong")

    async def box_of(self, request: Request) -> AsyncBox:
        """The box a sandbox request names, once its access token is checked: first, so an
        id without its token learns nothing of the box (not even whether it exists); then
        that the key which made the box still lives (revoking a key ends its sandboxes'
        tokens, as it ends its previews)."""
        cached = request.scope.get("e2b.box")
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        box_id = request.headers.get(SANDBOX_HEADER, "")
        self._check_token(request, box_id)
        handles = self.state.handles
        box = handles.get(box_id)
        if box is None or box.state == "removed":
            try:
                box = await AsyncBox.get(box_id, home=self.state.home)
            except SandlotError:
                raise _gone(box_id) from None
            if box.id != box_id:
                raise _gone(box_id)  # a prefix or a name is not a sandbox id
            handles[box_id] = box
        labels = box.info["labels"]
        key_id = labels.get(KEY_LABEL)
        verifier = self.state.verifier
        if verifier is not None and key_id is not None and not await verifier.live_async(key_id):
            raise Unauthorized(f"the API key that made sandbox {box_id} was revoked")
        if control.is_paused(box):
            # a filesystem-only pause (stopped) is resumed by a connect only, as E2B's
            if box.state == "stopped" or labels.get(control.AUTO_RESUME_LABEL) != "1":
                # as E2B's proxy answers for a paused sandbox; with auto-resume, a call resumes it
                raise _Gone(
                    f"The sandbox {box_id} is paused, and was not found running: connect to resume it"
                )
            await control.resume_with_timeout(self.state, box)
        request.scope["e2b.box"] = box
        return box

    def _check_token(self, request: Request, box_id: str) -> None:
        home = self.state.home
        presented = request.headers.get("x-access-token") or request.headers.get("e2b-traffic-access-token")
        envd_token = access.sandbox_token(box_id, "envd", home)
        if presented is None and "signature" in request.query_params:
            check_file_signature(request, envd_token)
            request.scope["e2b.signed"] = True
            return
        wanted = [envd_token]
        if request.headers.get(PORT_HEADER) == str(INTERPRETER_PORT):
            wanted.append(access.sandbox_token(box_id, "traffic", home))
        # compared as bytes: a header may hold any byte, which compare_digest's str form refuses
        given = (presented or "").encode("utf-8", "surrogateescape")
        if not presented or not any(hmac.compare_digest(given, w.encode()) for w in wanted):
            raise Unauthorized(f"the access token of sandbox {box_id} is missing or wrong")

    async def _health(self, request: Request) -> Response:
        """204 while the sandbox runs; E2B's proxy's 502 once it is gone or paused (the
        SDKs' ``is_running``). Read anew: another process may have ended the box."""
        box = await self.box_of(request)
        try:
            state = await box.refresh()
        except SandlotError:
            state = "removed"
        if state == "removed":
            self.state.handles.pop(box.id, None)
            raise _gone(box.id)
        if state != "running":
            raise _Gone(f"The sandbox {box.id} is {state}, and was not found running")
        return Response(status_code=204)

    async def serve_sandbox(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        t0 = time.monotonic()
        response = await self._sandbox_call(path, request)
        if request.method not in ("GET", "HEAD") and path not in NOT_AUDITED:
            self._audit(request, path, response.status_code, time.monotonic() - t0)
        return response

    def _audit(self, request: Request, path: str, status: int, seconds: float) -> None:
        """A mutating call to a sandbox, in the audit trail under the key that made its box
        (the call itself carries the sandbox's token, no key)."""
        box: AsyncBox | None = request.scope.get("e2b.box")
        if box is None:
            return
        labels = box.info["labels"]
        caller = Caller.owner_of(labels)
        detail: dict[str, Any] = {"e2b": True}
        called = request.scope.get(REQUEST_KEY) or {}
        if path == "/process.Process/Start":  # what it ran, never its stdin or output
            config = called.get("process") or {}
            detail["argv"] = [config.get("cmd", ""), *config.get("args", [])]
        error = None if status < 400 else str(status)
        self.state.record(caller, f"{request.method} {PREFIX}{path}", box.id, status, error, seconds, detail)

    async def _sandbox_call(self, path: str, request: Request) -> Response:
        port = request.headers.get(PORT_HEADER, str(ENVD_PORT))
        try:
            await self.box_of(request)
            if port == str(INTERPRETER_PORT):
                return await self.interpreter.serve(path, request)
            if port != str(ENVD_PORT):
                raise RequestError(f"port {port}: over E2B's API this server serves envd ({ENVD_PORT}) and "
                                   f"the code interpreter ({INTERPRETER_PORT}); reach other ports of a "
                                   "sandbox with sandlot's port bridge")  # fmt: skip
            if path == "/health":
                return await self._health(request)
            if path == "/files" and request.method in ("GET", "POST"):
                return await self.envd.files(request)
            if request.method == "POST" and path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
                return await self.envd.rpc(path, request)
            return JSONResponse(
                {"code": 404, "message": f"no envd route {request.method} {path}"}, status_code=404
            )
        except SandlotError as e:
            return _sandbox_error(e, path)


def check_file_signature(request: Request, envd_token: str) -> None:
    """A signed ``/files`` URL (the SDKs' ``upload_url``/``download_url``, for a client
    with no token, a browser): ``v1_`` and the base64 of the SHA-256 of path, operation,
    user and the sandbox's envd token (and the expiry, if it has one), as E2B signs it.
    The call then runs as the user the URL was signed for, whatever else it says."""
    q = request.query_params
    if "/" + request.path_params.get("path", "") != "/files" or request.headers.get(
        PORT_HEADER, str(ENVD_PORT)
    ) != str(ENVD_PORT):
        raise Unauthorized("only envd's /files takes a signature in place of the access token")
    if not hmac.compare_digest(_given(q), file_signature(q, request.method, envd_token)):
        raise Unauthorized("this URL's signature is wrong")


def file_signature(query: Mapping[str, str], method: str, envd_token: str) -> bytes:
    """The signature a ``/files`` URL of this query and method has when ``envd_token``
    signed it: ``v1_`` and the base64 of the SHA-256 of path, operation, user and the
    token (and the expiry, if it has one: past it, no signature is right)."""
    operation = "read" if method in ("GET", "HEAD") else "write"
    expiry = query.get("signature_expiration")
    raw = f"{query.get('path', '')}:{operation}:{query.get('username', '')}:{envd_token}"
    if expiry is not None:
        if not (expiry.isascii() and expiry.isdigit()) or int(expiry) < time.time():
            raise Unauthorized("signature is already expired")  # envd's words, which the SDKs show
        raw += f":{expiry}"
    digest = base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
    return f"v1_{digest}".encode()


def _route_path(scope: Scope) -> str:
    """The request's path under this face's mount (``/files``)."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    return path[len(root) :] if root and path.startswith(root) else path


def _given(query: Mapping[str, str]) -> bytes:
    # compared as bytes: a query may hold any byte, which compare_digest's str form refuses
    return query.get("signature", "").encode("utf-8", "surrogateescape")


class _Gone(SandlotError):
    status = 502


def _gone(box_id: str) -> SandlotError:
    """The proxy's answer for a sandbox that is not there, in the words the SDKs look for."""
    return _Gone(f"The sandbox {box_id} was not found")


def _sandbox_error(err: SandlotError, path: str) -> Response:
    if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
        from .connect import HTTP_STATUS, code_of

        code = "unavailable" if isinstance(err, _Gone) else code_of(err)
        return JSONResponse(
            {"code": code, "message": str(err)},
            status_code=HTTP_STATUS.get(code, 500),
            headers=err.http_headers(),
        )
    return control.error_response(err)


async def _control_error(request: Request, exc: SandlotError) -> JSONResponse:
    request.state.error = exc.code
    return control.error_response(exc)


async def _not_served(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """A path or method of E2B's API this server does not answer, said in E2B's shape."""
    why = "is not served by sandlot (docs/e2b.md)" if exc.status_code in (404, 405) else str(exc.detail)
    status = 404 if exc.status_code == 405 else exc.status_code
    return JSONResponse({"code": status, "message": f"{request.method} {request.url.path} {why}"},
                        status_code=status)  # fmt: skip


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return control.error_response(RequestError(f"malformed request: {exc.errors()[:3]}"))
