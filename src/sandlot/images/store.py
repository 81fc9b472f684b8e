"""The image store: a content-addressed blob cache and image records.

Layout under ``$SANDLOT_HOME``::

    blobs/sha256/<hex>           every manifest, config and layer, read-only, verified
    blobs/incoming/<hex>.partial downloads in progress (resumable, never trusted)
    images/<hex>.json            one record per image (its manifest digest)
    images/refs.json             name -> image digest
    bases/img-<hex>.ext4         the ext4 base disk of an image

A blob enters ``blobs/`` only by rename after its digest was checked, so a
reader never sees a partial or wrong blob. Records and refs are replaced
atomically; refs are changed under a lock so concurrent processes do not lose
each other's tags. Everything is shared by all images: a second image with the
same layers downloads nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import atomic_write, fsync_dir, tree_bytes
from ..errors import ImageError, InvalidArgument
from .oci import ImageConfig, new_hasher
from .reference import Reference, valid_digest


@dataclass(frozen=True, slots=True)
class Layer:
    digest: str
    media_type: str
    size: int


@dataclass(frozen=True, slots=True)
class Image:
    """An image in the store.

    ``digest`` is its manifest digest (for the x86_64 platform sandlot runs),
    ``names`` the references that point at it, ``config`` how to run it.
    """

    digest: str
    config_digest: str
    layers: tuple[Layer, ...]
    config: ImageConfig
    names: tuple[str, ...] = ()
    source: str = ""
    pulled_at: float = 0.0
    manifest_media_type: str = ""

    @property
    def id(self) -> str:
        return self.digest.split(":", 1)[1][:12]

    @property
    def size(self) -> int:
        """Bytes of its (compressed) layers."""
        return sum(layer.size for layer in self.layers)

    @property
    def name(self) -> str:
        return self.names[0] if self.names else self.digest

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"]["labels"] = dict(self.config.labels)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Image:
        c = d["config"]
        config = ImageConfig(
            env=tuple(c["env"]),
            workdir=c["workdir"],
            user=c["user"],
            entrypoint=tuple(c["entrypoint"]),
            cmd=tuple(c["cmd"]),
            labels=dict(c["labels"]),
            exposed_ports=tuple(c["exposed_ports"]),
            stop_signal=c["stop_signal"],
            architecture=c["architecture"],
            os=c["os"],
            created=c["created"],
            diff_ids=tuple(c["diff_ids"]),
        )
        return cls(
            digest=d["digest"],
            config_digest=d["config_digest"],
            layers=tuple(Layer(**layer) for layer in d["layers"]),
            config=config,
            names=tuple(d.get("names", ())),
            source=d.get("source", ""),
            pulled_at=d.get("pulled_at", 0.0),
            manifest_media_type=d.get("manifest_media_type", ""),
        )


@dataclass
class PruneReport:
    blobs_removed: int = 0
    bases_removed: int = 0
    bytes_freed: int = 0
    kept_bases: list[str] = field(default_factory=list)


def _hex(digest: str) -> str:
    if not valid_digest(digest):
        raise InvalidArgument(f"invalid digest {digest!r}")
    return digest.split(":", 1)[1]


class ImageStore:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.blobs = home / "blobs"
        self.incoming = home / "blobs" / "incoming"
        self.images_dir = home / "images"
        self.bases = home / "bases"

    # -- blobs ---------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        algo = digest.split(":", 1)[0]
        return self.blobs / algo / _hex(digest)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def read_blob(self, digest: str) -> bytes:
        try:
            return self.blob_path(digest).read_bytes()
        except FileNotFoundError:
            raise ImageError(f"blob {digest} is missing from the store") from None

    def put_blob(self, data: bytes, digest: str) -> Path:
        """Store bytes whose digest is ``digest`` (checked)."""
        h = new_hasher(digest)
        h.update(data)
        if f"{digest.split(':')[0]}:{h.hexdigest()}" != digest:
            raise ImageError(f"content does not match its digest {digest}")
        final = self.blob_path(digest)
        if final.exists():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return self._publish(tmp, final)

    def ingest(self, path: Path, digest: str, *, size: int | None = None) -> Path:
        """Move a finished file into the store after checking its digest (and size)."""
        h = new_hasher(digest)
        n = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                n += len(chunk)
        if size is not None and n != size:
            raise ImageError(f"blob {digest} is {n} bytes, the descriptor says {size}")
        if f"{digest.split(':')[0]}:{h.hexdigest()}" != digest:
            raise ImageError(f"blob does not match its digest {digest}")
        final = self.blob_path(digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        return self._publish(path, final)

    def _publish(self, tmp: Path, final: Path) -> Path:
        os.chmod(tmp, 0o444)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return final

    @contextlib.contextmanager
    def partial(self, digest: str) -> Iterator[tuple[Path, Any]]:
        """The resumable download file for a blob, locked against other processes.

        Yields (path, file opened for append). A process that waits for the
        lock may find the blob already complete: check ``has_blob`` after entering.
        """
        self.incoming.mkdir(parents=True, exist_ok=True)
        path = self.incoming / f"{_hex(digest)}.partial"
        with open(path, "ab+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield path, f
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    # -- images ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.images_dir.mkdir(parents=True, exist_ok=True)
        with open(self.images_dir / ".lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _refs(self) -> dict[str, str]:
        try:
            data = json.loads((self.images_dir / "refs.json").read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ImageError(f"the image index {self.images_dir / 'refs.json'} is corrupt: {exc}") from exc
        return {str(k): str(v) for k, v in data.items()}

    def _write_refs(self, refs: dict[str, str]) -> None:
        atomic_write(self.images_dir / "refs.json", json.dumps(refs, indent=1, sort_keys=True).encode())

    def _record_path(self, digest: str) -> Path:
        return self.images_dir / f"{_hex(digest)}.json"

    def _load_record(self, digest: str) -> Image | None:
        try:
            return Image.from_json(json.loads(self._record_path(digest).read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise ImageError(f"image record {digest} is corrupt: {exc}") from exc

    def save(self, image: Image, names: list[str]) -> Image:
        """Record an image (its blobs must be stored already) and point ``names`` at it."""
        for blob in (image.digest, image.config_digest, *(layer.digest for layer in image.layers)):
            if not self.has_blob(blob):
                raise ImageError(f"cannot record image {image.digest}: blob {blob} is not stored")
        with self._locked():
            refs = self._refs()
            for name in names:
                old = refs.get(name)
                refs[name] = image.digest
                if old and old != image.digest:
                    self._rewrite_names(old, refs)
            stored = dataclasses.replace(
                image,
                names=tuple(sorted(n for n, d in refs.items() if d == image.digest)),
                pulled_at=image.pulled_at or time.time(),
            )
            atomic_write(self._record_path(image.digest), json.dumps(stored.to_json(), indent=1).encode())
            self._write_refs(refs)
        return stored

    def _rewrite_names(self, digest: str, refs: dict[str, str]) -> None:
        rec = self._load_record(digest)
        if rec is not None:
            names = tuple(sorted(n for n, d in refs.items() if d == digest))
            rec = dataclasses.replace(rec, names=names)
            atomic_write(self._record_path(digest), json.dumps(rec.to_json(), indent=1).encode())

    def resolve_name(self, text: str) -> str | None:
        """Image digest for a name, a full digest or a digest prefix (id)."""
        refs = self._refs()
        if text.startswith(("sha256:", "sha512:")):
            return text if self._record_path(text).exists() else None
        try:
            ref = Reference.parse(text)
        except InvalidArgument:
            ref = None
        if ref is not None:
            if ref.digest:
                return ref.digest if self._record_path(ref.digest).exists() else None
            hit = refs.get(str(ref))
            if hit:
                return hit
        if len(text) >= 6 and all(c in "0123456789abcdef" for c in text):
            matches = [p.stem for p in self.images_dir.glob(f"{text}*.json")]
            if len(matches) == 1:
                return f"sha256:{matches[0]}"
            if len(matches) > 1:
                raise InvalidArgument(f"image id {text!r} is ambiguous")
        return None

    def get(self, text: str) -> Image | None:
        digest = self.resolve_name(text)
        return self._load_record(digest) if digest else None

    def list_images(self) -> list[Image]:
        if not self.images_dir.is_dir():
            return []
        out = []
        for p in sorted(self.images_dir.glob("*.json")):
            if p.name == "refs.json":
                continue
            rec = self._load_record(f"sha256:{p.stem}")
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda i: -i.pulled_at)

    def remove(self, text: str) -> list[str]:
        """Untag a name (the image goes when no name is left), or remove an image by
        digest/id with all its names. Blobs stay until ``prune``. Returns what was removed."""
        with self._locked():
            refs = self._refs()
            digest = self.resolve_name(text)
            if digest is None:
                raise InvalidArgument(f"no image {text!r}")
            by_name = None
            with contextlib.suppress(InvalidArgument):
                by_name = str(Reference.parse(text))
            removed = []
            if by_name in refs and not text.startswith(("sha256:", "sha512:")):
                del refs[by_name]
                removed.append(by_name)
            else:
                for name in [n for n, d in refs.items() if d == digest]:
                    del refs[name]
                    removed.append(name)
            if not any(d == digest for d in refs.values()):
                with contextlib.suppress(FileNotFoundError):
                    self._record_path(digest).unlink()
                removed.append(digest)
            else:
                self._rewrite_names(digest, refs)
            self._write_refs(refs)
            return removed

    def base_path(self, image: Image) -> Path:
        return self.bases / f"img-{_hex(image.digest)}.ext4"

    def rootfs_path(self, image: Image) -> Path:
        """The image unpacked as a directory (the shared lower layer of gvisor boxes)."""
        return self.bases / f"img-{_hex(image.digest)}.rootfs"

    def prune(self, bases_in_use: set[Path], unused_for: float = 0.0) -> PruneReport:
        """Remove blobs no image references, partial downloads, and base disks that
        belong to no image, back no box and were last used over ``unused_for`` seconds ago."""
        report = PruneReport()
        used_since = time.time() - unused_for
        with self._locked():
            images = self.list_images()
            keep = set()
            for img in images:
                keep.update({img.digest, img.config_digest, *(layer.digest for layer in img.layers)})
            for algo_dir in (self.blobs / "sha256", self.blobs / "sha512"):
                if not algo_dir.is_dir():
                    continue
                for blob in algo_dir.iterdir():
                    if f"{algo_dir.name}:{blob.name}" not in keep:
                        report.bytes_freed += blob.stat().st_size
                        blob.unlink()
                        report.blobs_removed += 1
            if self.incoming.is_dir():
                for part in self.incoming.iterdir():
                    with open(part, "ab") as f:
                        try:
                            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                        except BlockingIOError:
                            continue  # a pull is using it
                        report.bytes_freed += part.stat().st_size
                        part.unlink()
            image_bases = {self.base_path(img) for img in images} | {self.rootfs_path(img) for img in images}
            if self.bases.is_dir():
                for base in self.bases.iterdir():
                    if base.name.startswith("."):
                        continue
                    resolved = base.resolve()
                    if base in bases_in_use or resolved in bases_in_use:
                        report.kept_bases.append(base.name)
                        continue
                    if base in image_bases:
                        continue
                    try:
                        info = base.stat()
                    except FileNotFoundError:
                        continue
                    if info.st_mtime > used_since:  # its last use (rootfs._reused)
                        report.kept_bases.append(base.name)
                        continue
                    if stat.S_ISDIR(info.st_mode):  # an unpacked root
                        report.bytes_freed += tree_bytes(base)
                        shutil.rmtree(base, ignore_errors=True)
                    else:
                        report.bytes_freed += info.st_blocks * 512
                        base.unlink()
                    report.bases_removed += 1
        return report
