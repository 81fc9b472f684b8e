"""The object-storage tier under a home's chunk store: any S3-compatible bucket
(docs/storage.md).

It holds, under its prefix:

    chunks/<hex>        a chunk, as the home keeps it (zstd), named by its BLAKE3 hash
    states/<id>         a saved state's manifest (``core.manifest``)
    files/<hex>         a file of the disk (a qcow2 layer, a base; a layer directory
                        or image root as a tar file) as a manifest of its chunks,
                        named by the hash of that manifest
    boxes/<id>.json     a box that moved through the tier: its row, its saved state's
                        row and its disk's files, for another home to resume it
    leases/<id>.json    which home owns a box that went through the tier

Written with boto3, through the standard AWS configuration (its environment,
``~/.aws/config`` and ``credentials``, profiles, SSO and instance roles), which is why
boto3 and not obstore (faster, but with profiles and SSO only through boto3 itself).
Every call has a deadline (botocore's connect and read timeouts) and is retried by
botocore's standard retry mode (throttling, 5xx, broken connections); what still fails
is a ``TierError`` naming the object and the store's answer. A lease is taken with a
conditional write (``If-None-Match``, ``If-Match``): of two homes taking one box at
once, one wins, and the other is told which home holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import atomic_write
from ..errors import BoxElsewhere, CorruptSnapshot, HostSetupError, InvalidArgument, TierError

if TYPE_CHECKING:
    from botocore.client import BaseClient

T = TypeVar("T")
R = TypeVar("R")

CONFIG_FILE = "storage.json"  # in the home: what ``sandlot.storage.configure`` set
URL_RE = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>[^\s]*))?")
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
WORKERS = 16  # requests in flight to the tier at once: each is mostly waiting on the network
ATTEMPTS = 5  # botocore's standard retry mode: throttling, 5xx and broken connections, with backoff


def attempts() -> int:
    """Tries of each call (``$SANDLOT_STORAGE_ATTEMPTS``, default 5)."""
    raw = os.environ.get("SANDLOT_STORAGE_ATTEMPTS", str(ATTEMPTS))
    if not raw.isdigit() or not 1 <= int(raw) <= 20:
        raise InvalidArgument(f"SANDLOT_STORAGE_ATTEMPTS must be 1 to 20 tries, not {raw!r}")
    return int(raw)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Where a home's tier is: ``url`` (``s3://bucket/prefix``), and what the standard AWS
    configuration does not say: an ``endpoint_url`` (an S3-compatible store other than
    AWS), a ``region``, a ``profile``. ``evict_after``: seconds after which the state of
    a box suspended that long, and of a snapshot that old, keeps only its manifest on
    this host (None: never)."""

    url: str
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    evict_after: float | None = None

    def __post_init__(self) -> None:
        if not URL_RE.fullmatch(self.url or ""):
            raise InvalidArgument(f"a storage tier is an s3://BUCKET[/PREFIX] URL, not {self.url!r}")
        url = self.endpoint_url
        if url is not None and not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", url):
            raise InvalidArgument(f"endpoint_url must be an http(s):// URL, not {self.endpoint_url!r}")
        if self.evict_after is not None and not self.evict_after >= 0:
            raise InvalidArgument(f"evict_after must be 0 or more seconds, not {self.evict_after}")

    @property
    def bucket(self) -> str:
        m = URL_RE.fullmatch(self.url)
        assert m is not None
        return m["bucket"]

    @property
    def prefix(self) -> str:
        m = URL_RE.fullmatch(self.url)
        assert m is not None
        return (m["prefix"] or "").strip("/")


def configured(home: Path) -> TierConfig | None:
    """The home's tier: ``$SANDLOT_STORAGE`` (with ``$SANDLOT_STORAGE_ENDPOINT``,
    ``$SANDLOT_STORAGE_EVICT_AFTER``), else what ``configure`` wrote; None where none."""
    url = os.environ.get("SANDLOT_STORAGE")
    if url:
        evict = os.environ.get("SANDLOT_STORAGE_EVICT_AFTER")
        try:
            after = float(evict) if evict else None
        except ValueError:
            raise InvalidArgument(f"SANDLOT_STORAGE_EVICT_AFTER must be seconds, not {evict!r}") from None
        endpoint = os.environ.get("SANDLOT_STORAGE_ENDPOINT") or None
        return TierConfig(url, endpoint_url=endpoint, evict_after=after)
    try:
        data = json.loads((home / CONFIG_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{home / CONFIG_FILE} is not a storage configuration: {exc}") from None
    return TierConfig(**data)


def configured_quickly(home: Path) -> bool:
    """Whether the home may have a tier (no parsing): what a save asks after each save."""
    return bool(os.environ.get("SANDLOT_STORAGE")) or (home / CONFIG_FILE).exists()


def configure(home: Path, config: TierConfig | None) -> None:
    """Write (or, None, remove) the home's tier for every process of the home."""
    path = home / CONFIG_FILE
    if config is None:
        path.unlink(missing_ok=True)
        return
    atomic_write(path, json.dumps(asdict(config), indent=1).encode(), mode=0o600)


def home_id(home: Path) -> str:
    """Who a home is, to the tier's leases: a name made once, kept in the home."""
    path = home / "home-id"
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    atomic_write(path, f"{socket.gethostname()}-{os.urandom(6).hex()}\n".encode())
    return path.read_text().strip()


_clients: dict[tuple[Any, ...], BaseClient] = {}
_clients_lock = threading.Lock()


class Tier:
    """One home's client of its tier. Thread-safe (boto3's clients are)."""

    def __init__(
        self, config: TierConfig, *, tries: int | None = None, timeout: float = READ_TIMEOUT
    ) -> None:
        self.config = config
        self.tries = tries if tries is not None else attempts()
        self.timeout = timeout
        self._client: BaseClient | None = None
        self._traffic = {"tier_sent_bytes": 0, "tier_received_bytes": 0}
        self._traffic_lock = threading.Lock()

    def _counted(self, what: str, n: int) -> None:
        with self._traffic_lock:
            self._traffic[what] += n

    def traffic(self) -> dict[str, int]:
        """The bytes of objects sent to and read from the tier since the last call."""
        with self._traffic_lock:
            taken, self._traffic = self._traffic, dict.fromkeys(self._traffic, 0)
        return taken

    @property
    def client(self) -> BaseClient:
        """The S3 client, one per process for each tier, its settings and the AWS
        environment: making one reads botocore's service model (about half a second),
        and every call of ``sandlot.storage`` makes a ``Tier``. (A client refreshes the
        credentials it can, an instance role's; those read from files are read once.)"""
        if self._client is None:
            aws = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
            key = (
                self.config.endpoint_url,
                self.config.region,
                self.config.profile,
                self.tries,
                self.timeout,
                aws,
            )
            with _clients_lock:
                client = _clients.get(key)
                if client is None:
                    client = _clients[key] = self._new_client()
            self._client = client
        return self._client

    def _new_client(self) -> BaseClient:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise HostSetupError("a storage tier needs boto3: pip install 'sandlot[storage]'") from None
        session = boto3.session.Session(profile_name=self.config.profile, region_name=self.config.region)
        retries = {"mode": "standard", "max_attempts": self.tries}
        config = Config(connect_timeout=min(CONNECT_TIMEOUT, self.timeout), read_timeout=self.timeout,
                        max_pool_connections=32, retries=retries)  # fmt: skip
        return session.client("s3", endpoint_url=self.config.endpoint_url, config=config)

    def each(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``fn`` of each item, ``WORKERS`` at once (each mostly waits on the network)."""
        if not items:
            return []
        with ThreadPoolExecutor(min(WORKERS, len(items)), thread_name_prefix="sandlot-tier") as pool:
            return list(pool.map(fn, items))

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.config.prefix, *parts) if p)

    def _call(self, what: str, key: str, fn: Any, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.config.bucket, Key=key, **kw)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(key) from None
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise Conflict(key) from None
            if code in ("InvalidRange", "416"):  # a ranged read past its end: what placed it is wrong
                raise CorruptSnapshot(f"{key} in the storage tier {self.config.url} is shorter than "
                                      "a read of it expects (cut short or damaged)") from None  # fmt: skip
            raise TierError(f"the storage tier {self.config.url} refused to {what} {key}: {exc}") from None
        except BotoCoreError as exc:
            raise TierError(f"the storage tier {self.config.url} could not {what} {key}: {exc}") from None

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write an object; its ETag. ``if_none_match``/``if_match``: only if it does not
        exist / still has that ETag (``Conflict`` otherwise)."""
        kw: dict[str, Any] = {"Body": data}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        if if_match is not None:
            kw["IfMatch"] = if_match
        reply = self._call("write", key, self.client.put_object, **kw)
        self._counted("tier_sent_bytes", len(data))
        return str(reply.get("ETag", ""))

    def get(self, key: str) -> tuple[bytes, str] | None:
        """An object's bytes and ETag; None where there is none."""
        try:
            reply = self._call("read", key, self.client.get_object)
        except FileNotFoundError:
            return None
        try:
            data: bytes = reply["Body"].read()
            self._counted("tier_received_bytes", len(data))
            return data, str(reply.get("ETag", ""))
        except OSError as exc:
            raise TierError(f"the storage tier {self.config.url} broke off reading {key}: {exc}") from None

    def get_range(self, key: str, start: int, end: int, *, short: bool = False) -> bytes:
        """Bytes ``start`` to ``end`` (not included) of an object; ``short``: an object that
        ends sooner gives what it has, else that is a ``CorruptSnapshot``. One that is
        not there is a ``CorruptSnapshot`` too: what a read names, something lists."""
        try:
            reply = self._call("read", key, self.client.get_object, Range=f"bytes={start}-{end - 1}")
        except FileNotFoundError:
            raise ObjectMissing(f"{key} is missing from the storage tier {self.config.url}") from None
        try:
            data: bytes = reply["Body"].read()
        except OSError as exc:
            raise TierError(f"the storage tier {self.config.url} broke off reading {key}: {exc}") from None
        self._counted("tier_received_bytes", len(data))
        if len(data) != end - start and not (short and len(data) < end - start):
            raise CorruptSnapshot(f"{key} in the storage tier {self.config.url} gave {len(data)} bytes "
                                  f"where {end - start} were asked for (cut short or damaged)")  # fmt: skip
        return data

    def exists(self, key: str) -> bool:
        try:
            self._call("look up", key, self.client.head_object)
            return True
        except FileNotFoundError:
            return False

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", key, self.client.delete_object)

    def names(self, under: str) -> list[str]:
        """The names of the objects under ``under/`` (without it)."""
        return list(self.listing(under))

    def listing(self, under: str) -> dict[str, int]:
        """The objects under ``under/``: each name (without it) and its size."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self.key(under) + "/"
        out: dict[str, int] = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=prefix
            ):
                out.update((o["Key"][len(prefix) :], int(o.get("Size", 0))) for o in page.get("Contents", []))
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"the storage tier {self.config.url} could not list {prefix}: {exc}") from None
        return out

    def delete_many(self, keys: list[str]) -> None:
        """Delete objects, a thousand a request (S3's most); one that is not there is no error."""
        from botocore.exceptions import BotoCoreError, ClientError

        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            try:
                reply = self.client.delete_objects(
                    Bucket=self.config.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                raise TierError(
                    f"the storage tier {self.config.url} could not delete {batch[0]}...: {exc}"
                ) from None
            failed = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                e = failed[0]
                raise TierError(f"the storage tier {self.config.url} refused to delete {e.get('Key')}: "
                                f"{e.get('Code')} {e.get('Message', '')}")  # fmt: skip

    def check(self) -> dict[str, Any]:
        """What ``sandlot doctor`` says of the tier; never raises."""
        report: dict[str, Any] = {"url": self.config.url, "endpoint_url": self.config.endpoint_url}
        try:
            t = time.monotonic()
            quick = Tier(self.config, tries=1, timeout=5.0)  # a doctor says what it finds now
            quick.client.head_bucket(Bucket=self.config.bucket)
            report.update(reachable=True, round_trip_ms=round((time.monotonic() - t) * 1000, 1))
        except Exception as exc:  # a doctor reports every failure, whatever it is
            report.update(reachable=False, why=str(exc))
        return report

    # -- leases ----------------------------------------------------------------------------

    def take(self, box_id: str, me: str, *, force: bool = False) -> None:
        """Make ``me`` the owner of ``box_id``: where no home owns it, where ``me`` does, or
        where its owner let it go (or ``force``: its owner is known to be dead); else
        ``BoxElsewhere`` naming the owner. One conditional write: of two homes taking
        it at once, one wins."""
        key = self.key("leases", f"{box_id}.json")
        mine = json.dumps({"holder": me, "host": socket.gethostname(), "since": time.time()}).encode()
        for _ in range(5):
            found = self.get(key)
            try:
                if found is None:
                    self.put(key, mine, if_none_match=True)
                    return
                lease = _lease(found[0], key)
                if lease.get("holder") == me:
                    return
                if lease.get("holder") is not None and not force:
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("since", 0)))
                    raise BoxElsewhere(
                        f"box {box_id} is held by home {lease['holder']} (host {lease.get('host', '?')}, "
                        f"since {since}): "
                        "it is suspended and moved there, or runs there; pull it once that home lets it go",
                        box=box_id, holder=str(lease["holder"]),
                    )  # fmt: skip
                self.put(key, mine, if_match=found[1])
                return
            except Conflict:
                continue  # another home wrote it between our read and our write: look again
        raise TierError(f"the lease of box {box_id} kept changing under this home: try again")

    def release(self, box_id: str, me: str) -> None:
        """Let ``box_id`` go, if ``me`` holds it (another home may then take it)."""
        key = self.key("leases", f"{box_id}.json")
        found = self.get(key)
        if found is None or _lease(found[0], key).get("holder") != me:
            return
        released = json.dumps({"holder": None, "released_by": me, "since": time.time()}).encode()
        with contextlib.suppress(Conflict):
            self.put(key, released, if_match=found[1])

    def holder(self, box_id: str) -> str | None:
        found = self.get(self.key("leases", f"{box_id}.json"))
        return None if found is None else _lease(found[0], box_id).get("holder")


class Conflict(Exception):
    """A conditional write found the object other than it expected."""


class ObjectMissing(CorruptSnapshot):
    """A ranged read of an object the tier does not have (a pack a collection wrote again
    since, perhaps: ``core.packs``)."""


def _lease(data: bytes, key: str) -> dict[str, Any]:
    try:
        lease = json.loads(data)
        if not isinstance(lease, dict):
            raise ValueError("not an object")
        return lease
    except ValueError as exc:
        raise TierError(f"the lease {key} in the storage tier is malformed: {exc}") from None


__all__ = ["Conflict", "ObjectMissing", "Tier", "TierConfig", "configure", "configured", "home_id"]
