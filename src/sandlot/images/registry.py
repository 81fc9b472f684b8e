"""A client for the OCI distribution API (registry v2), on httpx.

Anonymous, bearer-token (``WWW-Authenticate: Bearer``) and basic auth; TLS with
the system trust store plus per-registry CAs (``ca_cert``, or Docker's
``certs.d`` directories); plain HTTP only for registries on the loopback or
ones marked insecure; mirrors by ``$SANDLOT_REGISTRY_MIRRORS``. Every answer is
checked: manifests against their digest, blobs against digest and size, while they
stream to disk. Interrupted blob downloads resume with a Range request; the bytes
already on disk are hashed again rather than trusted.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..errors import ImageError
from . import auth as auth_mod
from .oci import ACCEPT, Descriptor, sha256_digest, verify
from .reference import DOCKER_HUB, Reference, is_loopback
from .store import ImageStore

USER_AGENT = "sandlot/0.1"
RETRIES = 3
MIRRORS = "SANDLOT_REGISTRY_MIRRORS"
_HOST = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?$")


def mirrors() -> dict[str, tuple[str | None, str]]:
    """``$SANDLOT_REGISTRY_MIRRORS``: ``registry=[scheme://]host[:port]`` pairs, comma
    separated (``docker.io=127.0.0.1:5000,ghcr.io=https://mirror.example``). A pull
    from a registry with a mirror goes to the mirror only, with no fallback: an
    air-gapped host must never reach past it. Images keep their own names, so a box
    made through a mirror is the same box as one made without."""
    out: dict[str, tuple[str | None, str]] = {}
    for item in filter(None, (p.strip() for p in os.environ.get(MIRRORS, "").split(","))):
        registry, sep, target = item.partition("=")
        scheme, has_scheme, host = target.strip().rstrip("/").rpartition("://")
        registry = registry.strip().lower()
        if registry in ("index.docker.io", "registry-1.docker.io"):
            registry = DOCKER_HUB
        bad_scheme = bool(has_scheme) and scheme not in ("http", "https")
        if not sep or not registry or bad_scheme or not _HOST.match(host):
            raise ImageError(f"{MIRRORS}: {item!r} is not registry=[http(s)://]host[:port]")
        out[registry] = (scheme or None, host)
    return out


@dataclass(slots=True)
class Progress:
    """One step of a pull, for progress displays."""

    digest: str
    total: int
    done: int
    status: str  # "cached", "downloading", "resuming", "done"


ProgressFn = Callable[[Progress], None]


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


def _ssl_context(registry: str, ca_cert: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    extra = os.environ.get("SSL_CERT_FILE")
    cas = [Path(extra)] if extra else []
    if ca_cert:
        cas.append(Path(ca_cert))
    for d in (
        Path("/etc/docker/certs.d"),
        Path.home() / ".docker" / "certs.d",
        Path("/etc/containers/certs.d"),
    ):
        cas += sorted((d / registry).glob("*.crt")) if (d / registry).is_dir() else []
    for ca in cas:
        try:
            ctx.load_verify_locations(cafile=str(ca))
        except (OSError, ssl.SSLError) as exc:
            raise ImageError(f"cannot load CA certificate {ca}: {exc}") from exc
    return ctx


class RegistryClient:
    """Talks to one registry for one repository."""

    def __init__(
        self,
        ref: Reference,
        *,
        credentials: auth_mod.Credentials | None = None,
        insecure: bool = False,
        ca_cert: Path | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.ref = ref
        mirror = mirrors().get(ref.registry)
        scheme, self.host = mirror if mirror else (None, ref.api_host)
        where = mirror[1] if mirror else ref.registry  # whose credentials count
        self.label = f"{ref.registry} (through its mirror {self.host})" if mirror else ref.registry
        self._creds = credentials if credentials is not None else auth_mod.lookup(where)
        self._plain_http_ok = insecure or is_loopback(where) or scheme == "http"
        self._scheme: str | None = scheme
        self._token: str | None = None
        self._basic = False
        self._client = httpx.AsyncClient(
            verify=_ssl_context(self.host, ca_cert),
            timeout=httpx.Timeout(timeout, connect=15.0),
            headers={"User-Agent": USER_AGENT},
            follow_redirects=True,
            trust_env=False,
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=8),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport -----------------------------------------------------------------------

    async def _base(self) -> str:
        if self._scheme is None:
            try:
                await self._client.get(f"https://{self.host}/v2/")
                self._scheme = "https"
            except (httpx.ConnectError, httpx.ReadError, ssl.SSLError) as exc:
                if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
                    # it speaks TLS with a certificate we do not trust: never downgrade that
                    raise ImageError(
                        f"the TLS certificate of {self.host} is not trusted ({exc}); "
                        "pass ca_cert= or put the CA in /etc/docker/certs.d/<host>/ca.crt"
                    ) from exc
                if not self._plain_http_ok:
                    raise ImageError(f"cannot reach https://{self.host}: {exc}") from exc
                self._scheme = "http"  # no TLS there: a loopback or explicitly insecure registry
            except httpx.HTTPError as exc:
                raise ImageError(f"cannot reach registry {self.label}: {exc}") from exc
        return f"{self._scheme}://{self.host}/v2/{self.ref.repository}"

    def _auth_headers(self) -> dict[str, str]:
        if self._token:
            return {"Authorization": f"Bearer {self._token}"}
        if self._basic and self._creds:
            pair = f"{self._creds.username}:{self._creds.password}".encode()
            return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
        return {}

    async def _authenticate(self, challenge: str) -> None:
        scheme, params = _parse_challenge(challenge)
        if scheme == "basic":
            if not self._creds:
                raise ImageError(f"registry {self.label} requires a login (no credentials found)")
            self._basic = True
            return
        if scheme != "bearer" or "realm" not in params:
            raise ImageError(f"registry {self.label} asks for unsupported authentication {challenge!r}")
        query = {"service": params.get("service", ""), "scope": f"repository:{self.ref.repository}:pull"}
        auth = None
        if self._creds and self._creds.identity_token:
            form = {
                "grant_type": "refresh_token",
                "refresh_token": self._creds.identity_token,
                "client_id": "sandlot",
            }
            resp = await self._client.post(params["realm"], data={**form, **query})
        else:
            if self._creds:
                auth = httpx.BasicAuth(self._creds.username, self._creds.password)
            resp = await self._client.get(params["realm"], params=query, auth=auth)
        if resp.status_code in (401, 403):
            raise ImageError(f"registry {self.label} refused the credentials for {self.ref.repository}")
        if resp.status_code != 200:
            raise ImageError(f"token request to {params['realm']} failed with HTTP {resp.status_code}")
        try:
            doc = resp.json()
            token = doc.get("token") or doc.get("access_token")
        except ValueError as exc:
            raise ImageError(f"token server {params['realm']} sent a malformed answer") from exc
        if not isinstance(token, str) or not token:
            raise ImageError(f"token server {params['realm']} sent no token")
        self._token = token

    async def _send(self, path: str, headers: dict[str, str], *, stream: bool) -> httpx.Response:
        """GET with authentication and retries of transient failures."""
        base = await self._base()
        delay = 0.5
        for attempt in range(RETRIES + 1):
            req = self._client.build_request("GET", base + path, headers={**headers, **self._auth_headers()})
            try:
                resp = await self._client.send(req, stream=stream)
            except httpx.TransportError as exc:
                if attempt == RETRIES:
                    raise ImageError(f"registry {self.label}: {exc}") from exc
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if resp.status_code == 401 and attempt == 0:
                challenge = resp.headers.get("www-authenticate", "")
                await resp.aclose()
                await self._authenticate(challenge)
                continue
            if resp.status_code in (429, 502, 503, 504) and attempt < RETRIES:
                await resp.aclose()
                await asyncio.sleep(delay)
                delay *= 2
                continue
            return resp
        raise ImageError(f"registry {self.label} kept failing")

    async def _check(self, resp: httpx.Response, what: str) -> None:
        if resp.status_code in (200, 206):
            return
        body = b""
        with contextlib.suppress(Exception):
            body = await resp.aread()
        await resp.aclose()
        if resp.status_code == 404:
            raise ImageError(f"{what} not found in {self.ref.name}")
        if resp.status_code in (401, 403):
            raise ImageError(
                f"not allowed to pull {self.ref.name} (HTTP {resp.status_code}): check credentials"
            )
        raise ImageError(f"{what}: HTTP {resp.status_code} from {self.label}: {body[:200]!r}")

    # -- API ---------------------------------------------------------------------------------

    async def manifest(self, reference: str) -> tuple[bytes, str | None, str]:
        """Fetch a manifest or index by tag or digest: (bytes, media type, digest).
        By digest, the bytes must match it; by tag, the digest is computed."""
        resp = await self._send(f"/manifests/{reference}", {"Accept": ACCEPT}, stream=True)
        await self._check(resp, f"manifest {reference}")
        data = b""
        async for chunk in resp.aiter_bytes():
            data += chunk
            if len(data) > 4 << 20:
                await resp.aclose()
                raise ImageError(f"manifest {reference} is larger than 4 MiB")
        media_type = resp.headers.get("content-type", "").split(";")[0].strip() or None
        if reference.startswith(("sha256:", "sha512:")):
            digest = reference
        else:
            digest = sha256_digest(data)
            header = resp.headers.get("docker-content-digest")
            if header and header.startswith("sha256:") and header != digest:
                raise ImageError(
                    f"manifest {reference}: Docker-Content-Digest {header} does not match its bytes"
                )
        verify(data, digest, f"manifest {reference}")
        return data, media_type, digest

    async def blob_bytes(self, desc: Descriptor, limit: int) -> bytes:
        """A small blob (a config) in memory, checked against digest and size."""
        if desc.size > limit:
            raise ImageError(f"blob {desc.digest} is {desc.size} bytes, more than {limit}")
        resp = await self._send(f"/blobs/{desc.digest}", {}, stream=True)
        await self._check(resp, f"blob {desc.digest}")
        data = b""
        async for chunk in resp.aiter_bytes():
            data += chunk
            if len(data) > desc.size:
                await resp.aclose()
                raise ImageError(f"blob {desc.digest} is longer than its descriptor says")
        if len(data) != desc.size:
            raise ImageError(f"blob {desc.digest} is {len(data)} bytes, its descriptor says {desc.size}")
        verify(data, desc.digest, f"blob {desc.digest}")
        return data

    async def fetch_blob(
        self, desc: Descriptor, store: ImageStore, progress: ProgressFn | None = None
    ) -> int:
        """Download a blob into the store (resuming a partial download). Returns bytes fetched."""
        if store.has_blob(desc.digest):
            if progress:
                progress(Progress(desc.digest, desc.size, desc.size, "cached"))
            return 0
        async with _locked_partial(store, desc.digest) as (path, f):
            if store.has_blob(desc.digest):  # another process finished it while we waited
                return 0
            for attempt in range(2):
                fetched = await self._download(desc, path, f, progress, resume=attempt == 0)
                try:
                    # hashes every byte on disk, the resumed prefix included
                    store.ingest(path, desc.digest, size=desc.size)
                except ImageError:
                    f.truncate(0)
                    if attempt == 0:
                        continue  # a resumed file may have been bad on disk: once more from zero
                    raise
                if progress:
                    progress(Progress(desc.digest, desc.size, desc.size, "done"))
                return fetched
        return 0

    async def _download(
        self, desc: Descriptor, path: Path, f: Any, progress: ProgressFn | None, *, resume: bool
    ) -> int:
        f.seek(0, os.SEEK_END)
        have = f.tell() if resume else 0
        if have > desc.size:
            have = 0
        if not resume or have == 0:
            f.truncate(0)
        headers = {"Range": f"bytes={have}-"} if have else {}
        resp = await self._send(f"/blobs/{desc.digest}", headers, stream=True)
        await self._check(resp, f"blob {desc.digest}")
        if have and resp.status_code != 206:
            have = 0  # the server ignored the range: start over
            f.truncate(0)
        f.seek(have)
        if progress:
            progress(Progress(desc.digest, desc.size, have, "resuming" if have else "downloading"))
        fetched = 0
        try:
            async for chunk in resp.aiter_bytes(256 * 1024):
                if have + fetched + len(chunk) > desc.size:
                    raise ImageError(
                        f"blob {desc.digest} is longer than its descriptor says ({desc.size} bytes)"
                    )
                f.write(chunk)
                fetched += len(chunk)
                if progress:
                    progress(Progress(desc.digest, desc.size, have + fetched, "downloading"))
        finally:
            await resp.aclose()
        f.flush()
        os.fsync(f.fileno())
        return fetched


@contextlib.asynccontextmanager
async def _locked_partial(store: ImageStore, digest: str) -> Any:
    """store.partial() takes a blocking file lock: wait for it off the event loop."""
    cm = store.partial(digest)
    entered = await asyncio.to_thread(cm.__enter__)
    try:
        yield entered
    finally:
        cm.__exit__(None, None, None)
