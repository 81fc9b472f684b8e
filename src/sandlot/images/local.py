"""Images that do not come from a registry: OCI layout directories, ``docker
save`` and OCI archive tarballs, and images built from a directory. Also the
OCI layout writer that ``import`` and the tests use.

Archives are hostile input like registry answers: member names, sizes and every
blob's digest are checked before anything enters the store.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import ImageError, InvalidArgument
from .oci import (
    DOCKER_CONFIG,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    Index,
    Manifest,
    is_index,
    sha256_digest,
)
from .reference import valid_digest
from .store import ImageStore

MAX_METADATA = 16 << 20  # manifest.json, index.json, configs inside archives


@dataclass(slots=True)
class Loaded:
    """A manifest found in a local source, with the names the source gives it."""

    manifest_digest: str
    names: list[str] = field(default_factory=list)


def _blob_name(name: str) -> str | None:
    """'blobs/sha256/<hex>' -> 'sha256:<hex>'."""
    parts = name.strip("./").split("/")
    if len(parts) == 3 and parts[0] == "blobs":
        digest = f"{parts[1]}:{parts[2]}"
        if valid_digest(digest):
            return digest
    return None


def _select_from_index(store: ImageStore, index_bytes: bytes) -> list[Loaded]:
    """Manifests named by an OCI index.json (nested indexes resolved to x86_64)."""
    doc = json.loads(index_bytes)
    out = []
    for d in Index.parse(index_bytes).manifests:
        digest = d.digest
        if d.media_type in (OCI_INDEX, "application/vnd.docker.distribution.manifest.list.v2+json"):
            digest = Index.parse(store.read_blob(digest)).select().digest
        elif d.platform and (d.platform[0], d.platform[1]) != ("linux", "amd64"):
            continue
        names = []
        for key in ("io.containerd.image.name", "org.opencontainers.image.ref.name"):
            if key in d.annotations:
                names.append(d.annotations[key])
        out.append(Loaded(digest, names))
    if not out and isinstance(doc, dict):
        raise ImageError("the archive has no linux/amd64 image")
    return out


def load_oci_layout(store: ImageStore, layout: Path) -> list[Loaded]:
    """Copy an OCI image layout directory's blobs into the store (verified)."""
    if not (layout / "index.json").is_file():
        raise ImageError(f"{layout} is not an OCI image layout (no index.json)")
    store.blobs.mkdir(parents=True, exist_ok=True)
    blob_root = layout / "blobs"
    for algo_dir in sorted(p for p in blob_root.iterdir() if p.is_dir()) if blob_root.is_dir() else []:
        for blob in algo_dir.iterdir():
            digest = f"{algo_dir.name}:{blob.name}"
            if not valid_digest(digest) or blob.is_symlink() or not blob.is_file():
                raise ImageError(f"unexpected entry {blob} in the layout's blobs")
            if store.has_blob(digest):
                continue
            fd, tmp = tempfile.mkstemp(prefix=".load-", dir=store.blobs)
            with os.fdopen(fd, "wb") as out, open(blob, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
            store.ingest(Path(tmp), digest)
    index_bytes = (layout / "index.json").read_bytes()
    if len(index_bytes) > MAX_METADATA:
        raise ImageError("index.json is too large")
    return _select_from_index(store, index_bytes)


def load_archive(store: ImageStore, path: Path) -> list[Loaded]:
    """Load a ``docker save`` tarball (legacy or OCI) or an OCI archive, optionally compressed."""
    store.blobs.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}  # member name -> digest of its content (stored as a blob)
    links: dict[str, str] = {}  # member name -> the member it links to
    small: dict[str, bytes] = {}  # manifest.json, index.json, oci-layout, legacy json
    try:
        with tarfile.open(path, mode="r|*") as tf:
            for m in tf:
                name = m.name
                parts = [p for p in name.split("/") if p not in ("", ".")]
                if name.startswith("/") or ".." in parts:
                    raise ImageError(f"archive member {name!r} has an unsafe path")
                norm = "/".join(parts)
                if m.issym() or m.islnk():
                    # docker save links duplicate layers: resolved to the target's content below
                    target = "/".join(p for p in m.linkname.split("/") if p not in ("", "."))
                    if m.issym():
                        target = os.path.normpath(os.path.join(os.path.dirname(norm), m.linkname))
                    links[norm] = target
                    continue
                if not m.isreg():
                    continue
                src = tf.extractfile(m)
                assert src is not None
                if norm in ("manifest.json", "index.json", "oci-layout", "repositories") or (
                    norm.endswith(".json") and m.size <= MAX_METADATA
                ):
                    if m.size > MAX_METADATA:
                        raise ImageError(f"archive member {name!r} is too large")
                    data = src.read()
                    small[norm] = data
                    digest = sha256_digest(data)
                    if not store.has_blob(digest):
                        store.put_blob(data, digest)
                    files[norm] = digest
                    continue
                files[norm] = _stream_into_store(store, src, _blob_name(norm))
    except (tarfile.TarError, EOFError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ImageError(f"cannot read archive {path}: {exc}") from exc
    for name, target in links.items():
        for _ in range(8):  # links to links
            target = links.get(target, target)
        if target in files:
            files[name] = files[target]
    if "index.json" in small and "oci-layout" in small:
        return _select_from_index(store, small["index.json"])
    if "manifest.json" in small:
        return _load_docker_legacy(store, small, files)
    raise ImageError(f"{path} is neither a docker save archive nor an OCI archive")


def _stream_into_store(store: ImageStore, src: IO[bytes], expected: str | None) -> str:
    """Copy a stream into the store, computing its digest; if the archive names the
    blob by digest (blobs/sha256/<hex>), the content must match it."""
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".load-", dir=store.blobs)
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
        digest = f"sha256:{h.hexdigest()}"
        if expected and expected.startswith("sha256:") and expected != digest:
            raise ImageError(f"archive blob {expected} does not match its digest")
        if store.has_blob(digest):
            os.unlink(tmp)
        else:
            store.ingest(Path(tmp), digest)
        return digest
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _load_docker_legacy(store: ImageStore, small: dict[str, bytes], files: dict[str, str]) -> list[Loaded]:
    """``docker save`` before Docker 25: manifest.json lists config and layer files."""
    try:
        entries = json.loads(small["manifest.json"])
        assert isinstance(entries, list)
    except (ValueError, AssertionError) as exc:
        raise ImageError("docker save manifest.json is malformed") from exc
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str):
            raise ImageError("docker save manifest.json entry has no Config")
        config_name = entry["Config"].strip("./")
        if config_name not in files:
            raise ImageError(f"docker save archive lacks its config {config_name}")
        config_digest = files[config_name]
        layers = []
        for layer_name in entry.get("Layers") or []:
            key = str(layer_name).strip("./")
            if key not in files:
                raise ImageError(f"docker save archive lacks layer {key}")
            digest = files[key]
            size = store.blob_path(digest).stat().st_size
            layers.append(Descriptor("application/vnd.docker.image.rootfs.diff.tar", digest, size))
        config_size = store.blob_path(config_digest).stat().st_size
        manifest = Manifest(
            DOCKER_MANIFEST, Descriptor(DOCKER_CONFIG, config_digest, config_size), tuple(layers)
        )
        data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
        digest = sha256_digest(data)
        store.put_blob(data, digest)
        out.append(Loaded(digest, [str(t) for t in entry.get("RepoTags") or []]))
    return out


# ---- writing images --------------------------------------------------------------------------


def layer_from_dir(src: Path, out: IO[bytes]) -> None:
    """Write ``src`` as an uncompressed layer tar (owners, modes, links, xattrs kept)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, src)
            for name in [*sorted(filenames), *dirnames]:
                full = os.path.join(dirpath, name)
                arc = name if rel_dir == "." else f"{rel_dir}/{name}"
                info = tf.gettarinfo(full, arcname=arc)
                info.uname = info.gname = ""
                if os.path.islink(full) or not os.path.isfile(full):
                    tf.addfile(info)
                    continue
                if info.type == tarfile.LNKTYPE:
                    tf.addfile(info)
                    continue
                with open(full, "rb") as f:
                    tf.addfile(info, f)


def image_config_json(
    diff_ids: list[str],
    *,
    env: list[str] | None = None,
    cmd: list[str] | None = None,
    entrypoint: list[str] | None = None,
    workdir: str = "",
    user: str = "",
    labels: dict[str, str] | None = None,
    architecture: str = "amd64",
) -> bytes:
    config: dict[str, Any] = {
        "Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "Cmd": cmd if cmd is not None else ["/bin/sh"],
    }
    if entrypoint:
        config["Entrypoint"] = entrypoint
    if workdir:
        config["WorkingDir"] = workdir
    if user:
        config["User"] = user
    if labels:
        config["Labels"] = labels
    doc = {
        "architecture": architecture,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class BuiltImage:
    manifest: bytes
    manifest_digest: str
    config: bytes
    layers: list[tuple[str, bytes]]  # (digest, blob)


def build_image(
    layers: list[bytes], *, compression: str = "gzip", architecture: str = "amd64", **config: Any
) -> BuiltImage:
    """An OCI image from uncompressed layer tars, in memory (small images, tests).
    ``compression``: "gzip", "zstd" or "none"."""
    diff_ids = [sha256_digest(layer) for layer in layers]
    if compression == "gzip":
        blobs = [gzip.compress(layer, compresslevel=1, mtime=0) for layer in layers]
    elif compression == "zstd":
        import zstandard

        blobs = [zstandard.ZstdCompressor(level=3).compress(layer) for layer in layers]
    elif compression == "none":
        blobs = list(layers)
    else:
        raise InvalidArgument(f"compression must be gzip, zstd or none, not {compression!r}")
    media = "application/vnd.oci.image.layer.v1.tar" + ("" if compression == "none" else f"+{compression}")
    cfg = image_config_json(diff_ids, architecture=architecture, **config)
    manifest = Manifest(
        OCI_MANIFEST,
        Descriptor(OCI_CONFIG, sha256_digest(cfg), len(cfg)),
        tuple(Descriptor(media, sha256_digest(b), len(b)) for b in blobs),
    )
    data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
    return BuiltImage(data, sha256_digest(data), cfg, [(sha256_digest(b), b) for b in blobs])


def write_oci_layout(
    dest: Path, images: list[tuple[BuiltImage, str | None, str]], *, as_index: bool = False
) -> Path:
    """Write an OCI image layout. ``images``: (image, ref name, architecture).
    ``as_index`` nests them in one multi-platform index (as registries serve them)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = sha256_digest(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    descs = []
    for img, name, arch in images:
        put(img.manifest)
        put(img.config)
        for _digest, blob in img.layers:
            put(blob)
        annotations = {"org.opencontainers.image.ref.name": name} if name and not as_index else {}
        d = Descriptor(OCI_MANIFEST, img.manifest_digest, len(img.manifest), ("linux", arch, ""), annotations)
        descs.append(d.to_json())
    if as_index:
        nested = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descs}).encode()
        digest = put(nested)
        name = images[0][1]
        top = [
            {
                "mediaType": OCI_INDEX,
                "digest": digest,
                "size": len(nested),
                **({"annotations": {"org.opencontainers.image.ref.name": name}} if name else {}),
            }
        ]
    else:
        top = descs
    (dest / "index.json").write_text(
        json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": top})
    )
    return dest


@contextlib.contextmanager
def _spool() -> Iterator[IO[bytes]]:
    with tempfile.TemporaryFile() as f:
        yield f


def import_dir(store: ImageStore, src: Path, **config: Any) -> str:
    """Make a single-layer image from a directory; returns its manifest digest."""
    if not src.is_dir():
        raise InvalidArgument(f"{src} is not a directory")
    store.blobs.mkdir(parents=True, exist_ok=True)
    with _spool() as spool:
        layer_from_dir(src, spool)
        spool.seek(0)
        layer_digest = _stream_into_store(store, spool, None)
    size = store.blob_path(layer_digest).stat().st_size
    cfg = image_config_json([layer_digest], **config)
    cfg_digest = sha256_digest(cfg)
    store.put_blob(cfg, cfg_digest)
    manifest = Manifest(
        OCI_MANIFEST,
        Descriptor(OCI_CONFIG, cfg_digest, len(cfg)),
        (Descriptor("application/vnd.oci.image.layer.v1.tar", layer_digest, size),),
    )
    data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
    digest = sha256_digest(data)
    store.put_blob(data, digest)
    return digest


def read_manifest(store: ImageStore, digest: str) -> Manifest:
    data = store.read_blob(digest)
    if is_index(None, data):
        return read_manifest(store, Index.parse(data).select().digest)
    return Manifest.parse(data)


__all__ = [
    "BuiltImage",
    "Loaded",
    "build_image",
    "import_dir",
    "layer_from_dir",
    "load_archive",
    "load_oci_layout",
    "read_manifest",
    "write_oci_layout",
]
