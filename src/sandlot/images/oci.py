"""OCI and Docker image documents: media types, descriptors, manifests,
indexes and image configs, parsed strictly.

Everything here comes from outside (a registry, a tarball, a directory), so
parsing validates shapes, digests and sizes and raises ImageError naming the
problem rather than trusting the document.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import ImageError
from .reference import valid_digest

# manifests and indexes
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

# configs
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

# layers, and how each is compressed
LAYER_COMPRESSION = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar": "none",
}
FOREIGN_LAYERS = ("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",)

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 32 << 20

HOST_PLATFORM = ("linux", "amd64")  # boxes are x86_64 VMs whatever the host


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def new_hasher(digest: str) -> Any:
    algo = digest.split(":", 1)[0]
    if algo not in ("sha256", "sha512"):
        raise ImageError(f"unsupported digest algorithm in {digest!r}")
    return hashlib.new(algo)


def verify(data: bytes, digest: str, what: str) -> None:
    h = new_hasher(digest)
    h.update(data)
    if f"{digest.split(':', 1)[0]}:{h.hexdigest()}" != digest:
        raise ImageError(f"{what} does not match its digest {digest}")


def _load_json(data: bytes, what: str, limit: int) -> dict[str, Any]:
    if len(data) > limit:
        raise ImageError(f"{what} is {len(data)} bytes, more than the {limit} allowed")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ImageError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ImageError(f"{what} is not a JSON object")
    return doc


@dataclass(frozen=True, slots=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: tuple[str, str, str] | None = None  # os, architecture, variant
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, d: Any, what: str) -> Descriptor:
        if not isinstance(d, dict):
            raise ImageError(f"{what}: descriptor is not an object")
        media_type, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
        if not isinstance(media_type, str) or not media_type:
            raise ImageError(f"{what}: descriptor has no mediaType")
        if not isinstance(digest, str) or not valid_digest(digest):
            raise ImageError(f"{what}: invalid digest {digest!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ImageError(f"{what}: invalid size {size!r}")
        platform = None
        p = d.get("platform")
        if isinstance(p, dict):
            platform = (str(p.get("os", "")), str(p.get("architecture", "")), str(p.get("variant", "") or ""))
        ann = d.get("annotations") if isinstance(d.get("annotations"), dict) else {}
        return cls(media_type, digest, size, platform, {str(k): str(v) for k, v in (ann or {}).items()})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.platform:
            out["platform"] = {"os": self.platform[0], "architecture": self.platform[1]}
            if self.platform[2]:
                out["platform"]["variant"] = self.platform[2]
        if self.annotations:
            out["annotations"] = self.annotations
        return out


@dataclass(frozen=True, slots=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]

    @classmethod
    def parse(cls, data: bytes, media_type_hint: str | None = None) -> Manifest:
        doc = _load_json(data, "image manifest", MAX_MANIFEST_BYTES)
        media_type = doc.get("mediaType") or media_type_hint or OCI_MANIFEST
        if doc.get("schemaVersion") != 2:
            raise ImageError(f"unsupported manifest schemaVersion {doc.get('schemaVersion')!r} (need 2)")
        if media_type not in MANIFEST_TYPES:
            raise ImageError(f"not an image manifest: mediaType {media_type!r}")
        config = Descriptor.parse(doc.get("config"), "manifest config")
        if config.media_type not in (OCI_CONFIG, DOCKER_CONFIG):
            raise ImageError(f"unsupported config mediaType {config.media_type!r} (is this an image?)")
        raw_layers = doc.get("layers")
        if not isinstance(raw_layers, list):
            raise ImageError("manifest has no layers list")
        if len(raw_layers) > 500:
            raise ImageError(f"manifest has {len(raw_layers)} layers; at most 500 are accepted")
        layers = tuple(Descriptor.parse(layer, f"layer {i}") for i, layer in enumerate(raw_layers))
        for i, layer in enumerate(layers):
            if layer.media_type in FOREIGN_LAYERS:
                raise ImageError(f"layer {i} is a foreign (non-distributable) Windows layer")
            if layer.media_type not in LAYER_COMPRESSION:
                raise ImageError(f"layer {i} has unsupported mediaType {layer.media_type!r}")
        return cls(media_type, config, layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "schemaVersion": 2,
            "mediaType": self.media_type,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }


@dataclass(frozen=True, slots=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]

    @classmethod
    def parse(cls, data: bytes, media_type_hint: str | None = None) -> Index:
        doc = _load_json(data, "image index", MAX_MANIFEST_BYTES)
        media_type = doc.get("mediaType") or media_type_hint or OCI_INDEX
        if doc.get("schemaVersion") != 2:
            raise ImageError(f"unsupported index schemaVersion {doc.get('schemaVersion')!r}")
        raw = doc.get("manifests")
        if not isinstance(raw, list):
            raise ImageError("image index has no manifests list")
        return cls(media_type, tuple(Descriptor.parse(m, f"index entry {i}") for i, m in enumerate(raw)))

    def select(self, platform: tuple[str, str] = HOST_PLATFORM) -> Descriptor:
        """The manifest for ``platform`` (attestations and other platforms skipped)."""
        candidates = [
            m
            for m in self.manifests
            if m.platform and (m.platform[0], m.platform[1]) == platform and m.media_type in MANIFEST_TYPES
        ]
        if not candidates:
            have = sorted({f"{m.platform[0]}/{m.platform[1]}" for m in self.manifests if m.platform})
            raise ImageError(
                f"no {platform[0]}/{platform[1]} image in the index (it has: {', '.join(have) or 'none'})"
            )
        return candidates[0]


def is_index(media_type: str | None, data: bytes) -> bool:
    if media_type in INDEX_TYPES:
        return True
    if media_type in MANIFEST_TYPES:
        return False
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    return isinstance(doc, dict) and ("manifests" in doc or doc.get("mediaType") in INDEX_TYPES)


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """What an image says about how to run it."""

    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    exposed_ports: tuple[str, ...] = ()
    stop_signal: str = ""
    architecture: str = ""
    os: str = ""
    created: str = ""
    diff_ids: tuple[str, ...] = ()

    @classmethod
    def parse(cls, data: bytes) -> ImageConfig:
        doc = _load_json(data, "image config", MAX_CONFIG_BYTES)
        c = doc.get("config")
        if c is None:
            c = {}
        if not isinstance(c, dict):
            raise ImageError("image config 'config' is not an object")

        def strings(v: Any, what: str) -> tuple[str, ...]:
            if v is None:
                return ()
            if isinstance(v, str):  # some builders write a shell string
                return (v,)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ImageError(f"image config {what} must be a list of strings")
            return tuple(v)

        env = strings(c.get("Env"), "Env")
        for e in env:
            if "=" not in e or e.startswith("=") or "\0" in e:
                raise ImageError(f"image config Env entry {e!r} is not NAME=VALUE")
        rootfs = doc.get("rootfs") or {}
        diff_ids = strings(rootfs.get("diff_ids") if isinstance(rootfs, dict) else None, "rootfs.diff_ids")
        for d in diff_ids:
            if not valid_digest(d):
                raise ImageError(f"invalid diff_id {d!r}")
        labels = c.get("Labels") or {}
        if not isinstance(labels, dict):
            raise ImageError("image config Labels must be an object")
        ports = c.get("ExposedPorts") or {}
        workdir = c.get("WorkingDir") or ""
        user = c.get("User") or ""
        if not isinstance(workdir, str) or not isinstance(user, str):
            raise ImageError("image config WorkingDir and User must be strings")
        return cls(
            env=env,
            workdir=workdir,
            user=user,
            entrypoint=strings(c.get("Entrypoint"), "Entrypoint"),
            cmd=strings(c.get("Cmd"), "Cmd"),
            labels={str(k): str(v) for k, v in labels.items()},
            exposed_ports=tuple(sorted(str(p) for p in ports)) if isinstance(ports, dict) else (),
            stop_signal=str(c.get("StopSignal") or ""),
            architecture=str(doc.get("architecture") or ""),
            os=str(doc.get("os") or ""),
            created=str(doc.get("created") or ""),
            diff_ids=diff_ids,
        )

    def env_dict(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in self.env:
            k, _, v = e.partition("=")
            out[k] = v
        return out

    def argv(self, command: list[str] | tuple[str, ...] | None = None) -> list[str]:
        """The command to run, as Docker builds it: Entrypoint + (command or Cmd)."""
        return [*self.entrypoint, *(command if command else self.cmd)]
