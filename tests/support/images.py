"""Build test images (as OCI layouts) from crafted layers and test root filesystems."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.images.local import BuiltImage, build_image, layer_from_dir, write_oci_layout


@dataclass
class E:
    """One crafted tar entry."""

    name: str
    type: bytes = tarfile.REGTYPE
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    linkname: str = ""
    xattrs: dict[str, str] = field(default_factory=dict)
    dev: tuple[int, int] = (0, 0)


def layer_tar(entries: list[E]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = e.type
            info.mode = e.mode
            info.uid, info.gid = e.uid, e.gid
            info.mtime = 1_700_000_000
            info.linkname = e.linkname
            info.devmajor, info.devminor = e.dev
            if e.xattrs:
                info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            if e.type == tarfile.REGTYPE:
                info.size = len(e.data)
                tf.addfile(info, io.BytesIO(e.data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def dir_layer(src: Path) -> bytes:
    buf = io.BytesIO()
    layer_from_dir(src, buf)
    return buf.getvalue()


def layout(dest: Path, images: list[tuple[BuiltImage, str | None, str]], *, as_index: bool = False) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    return write_oci_layout(dest, images, as_index=as_index)


MULTI_LAYER_2 = [
    E("etc/a", data=b"lower\n"),
    E("data/", tarfile.DIRTYPE, mode=0o755),
    E("data/old/", tarfile.DIRTYPE, mode=0o755),
    E("data/old/x", data=b"x"),
    E("data/old/y", data=b"y"),
    E("usr/local/bin/", tarfile.DIRTYPE, mode=0o755),
    E("usr/local/bin/suid-tool", data=b"#!/bin/sh\nid -u\n", mode=0o4755),
    E("srv/", tarfile.DIRTYPE, mode=0o755),
    E("srv/owned.txt", data=b"owned by agent\n", mode=0o640, uid=1000, gid=1000),
    E("srv/hard1", data=b"same inode\n"),
    E("srv/hard2", tarfile.LNKTYPE, linkname="srv/hard1"),
    E("srv/link", tarfile.SYMTYPE, linkname="/srv/owned.txt"),
    E("srv/xattr.txt", data=b"x", xattrs={"user.sandlot": "yes"}),
    E("srv/shared/", tarfile.DIRTYPE, mode=0o2775, gid=100),
    E("opt/", tarfile.DIRTYPE, mode=0o755),
    E("opt/devnull", tarfile.CHRTYPE, mode=0o666, dev=(1, 3)),
]
MULTI_LAYER_3 = [
    E("etc/.wh.a"),
    E("data/old/z", data=b"z from layer 3"),  # before the opaque marker: must survive it
    E("data/old/.wh..wh..opq"),
    E("data/new.txt", data=b"new"),
]


def build_layouts(cache: Path, busybox_root: Path) -> dict[str, Path]:
    """OCI layouts for the registry tests, cached by content stamp."""
    stamp = hashlib.sha256(repr((MULTI_LAYER_2, MULTI_LAYER_3, "v4")).encode()).hexdigest()[:10]
    base = cache / f"layouts-{stamp}"
    out = {k: base / k for k in ("busybox", "multilayer", "multiarch", "busybox-zstd")}
    if all((p / "index.json").exists() for p in out.values()):
        return out
    bb = dir_layer(busybox_root)
    busybox = build_image(
        [bb],
        env=[
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "GREETING=hello from the image",
        ],
        cmd=["sh", "-c", 'echo "$GREETING"; pwd; id -u'],
        workdir="/work/dir",
        labels={"org.example.purpose": "sandlot tests"},
    )
    layout(out["busybox"], [(busybox, "test/busybox:1", "amd64")])
    zstd = build_image(
        [bb],
        compression="zstd",
        env=[
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "GREETING=hello from the image",
        ],
        cmd=["sh", "-c", 'echo "$GREETING"; pwd; id -u'],
        workdir="/work/dir",
    )
    layout(out["busybox-zstd"], [(zstd, "test/busybox-zstd:1", "amd64")])
    multi = build_image([bb, layer_tar(MULTI_LAYER_2), layer_tar(MULTI_LAYER_3)], cmd=["sh"])
    layout(out["multilayer"], [(multi, "test/multi:1", "amd64")])
    amd = build_image([bb, layer_tar([E("platform", data=b"amd64\n")])], cmd=["cat", "/platform"])
    arm = build_image(
        [layer_tar([E("platform", data=b"arm64\n")])], cmd=["cat", "/platform"], architecture="arm64"
    )
    layout(
        out["multiarch"],
        [(amd, "test/multiarch:1", "amd64"), (arm, "test/multiarch:1", "arm64")],
        as_index=True,
    )
    return out


def python_layout(cache: Path, debian_root: Path) -> Path:
    """The Debian + python3 root filesystem as a one-layer gzip OCI image (streamed to disk)."""
    dest = cache / "layout-python-v1"
    if (dest / "index.json").exists():
        return dest
    tmp = Path(tempfile.mkdtemp(dir=cache))
    blobs = tmp / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    raw_hash, gz_hash = hashlib.sha256(), hashlib.sha256()
    gz_path = tmp / "layer.tar.gz"

    class Tee(io.RawIOBase):
        def __init__(self, gz: gzip.GzipFile) -> None:
            self.gz = gz

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            raw_hash.update(b)
            self.gz.write(b)
            return len(b)

    class HashingFile(io.RawIOBase):
        def __init__(self, f: io.BufferedWriter) -> None:
            self.f = f

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            gz_hash.update(b)
            return self.f.write(b)

    with open(gz_path, "wb") as raw_out:
        hf = HashingFile(raw_out)
        with gzip.GzipFile(fileobj=hf, mode="wb", compresslevel=1, mtime=0) as gz:  # type: ignore[arg-type]
            layer_from_dir(debian_root, Tee(gz))  # type: ignore[arg-type]
    diff_id = f"sha256:{raw_hash.hexdigest()}"
    layer_digest = f"sha256:{gz_hash.hexdigest()}"
    os.rename(gz_path, blobs / gz_hash.hexdigest())
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": ["python3"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    cfg_digest = hashlib.sha256(config).hexdigest()
    (blobs / cfg_digest).write_bytes(config)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": f"sha256:{cfg_digest}",
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest,
                    "size": (blobs / gz_hash.hexdigest()).stat().st_size,
                }
            ],
        }
    ).encode()
    m_digest = hashlib.sha256(manifest).hexdigest()
    (blobs / m_digest).write_bytes(manifest)
    (tmp / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": f"sha256:{m_digest}",
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": "test/python:3"},
            }
        ],
    }
    (tmp / "index.json").write_text(json.dumps(index))
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return dest


def base_disk_bytes(home: Path, image: object) -> int:
    """Bytes on the host of the ext4 base disk made for a pulled image."""
    from sandlot.core.runtime import Runtime

    base = Runtime.for_home(home).images.store.base_path(image)  # type: ignore[arg-type]
    return base.stat().st_blocks * 512
