"""Images for one sandlot home: pull, load, import, list, remove, prune, and
the ext4 base disk each image boots from.

A pull downloads the layers concurrently and applies each one as soon as it
and those before it are in: unpacking overlaps downloading. The base disk is
made at pull time, so the first box from an image starts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import fsync_dir, meminfo
from ..errors import ImageError, InvalidArgument, NoSpace, space_for
from . import auth as auth_mod
from .local import import_dir, load_archive, load_oci_layout, read_manifest
from .oci import LAYER_COMPRESSION, MAX_CONFIG_BYTES, ImageConfig, Index, Manifest, is_index
from .reference import Reference
from .rootfs import base_size, make_ext4, qcow2_backing_file
from .store import Image, ImageStore, Layer, PruneReport
from .unpack import LayerApplier, open_layer, run_debugfs

if TYPE_CHECKING:
    from .registry import ProgressFn

MAX_CONCURRENT_DOWNLOADS = 4


def _mem_available() -> int:
    try:
        return meminfo().get("MemAvailable", 0)
    except (OSError, ValueError):
        return 0


def staging_dir(estimate: int) -> Path | None:
    """Where to unpack layers before mkfs: RAM (/dev/shm) when the tree fits easily,
    since creating thousands of files is what a disk does slowest; else None (disk).
    ``$SANDLOT_STAGING_DIR`` decides instead when set."""
    env = os.environ.get("SANDLOT_STAGING_DIR")
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if os.access(shm, os.W_OK) and estimate * 2 < free and estimate * 4 < _mem_available():
        return shm
    return None


def _sweep_stale_builds(parent: Path) -> None:
    """Remove staging trees of builds whose process died (they may hold RAM in /dev/shm)."""
    for d in parent.glob(".sandlot-build-*"):
        parts = d.name.split("-")
        pid = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
        if pid and pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _estimate(layers: tuple[Layer, ...] | list[Layer]) -> int:
    """Unpacked size guess: compressed layers inflate about 4x."""
    return sum(
        layer.size * (1 if LAYER_COMPRESSION.get(layer.media_type) == "none" else 4) for layer in layers
    )


class _BaseBuilder:
    """Applies an image's layers in order into a staging tree, then makes the disk."""

    def __init__(self, store: ImageStore, image_hex: str, estimate: int) -> None:
        store.bases.mkdir(parents=True, exist_ok=True)
        parent = staging_dir(estimate) or store.bases
        _sweep_stale_builds(parent)
        prefix = f".sandlot-build-{image_hex[:12]}-{os.getpid()}-"
        self.work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        (self.work / "root").mkdir()
        self.applier = LayerApplier(self.work / "root")
        self.store = store

    def apply(self, layer: Layer, diff_id: str | None) -> None:
        with open_layer(self.store.blob_path(layer.digest), LAYER_COMPRESSION[layer.media_type]) as stream:
            self.applier.apply(stream)
            stream.drain()
            got = f"sha256:{stream.hasher.hexdigest()}"
        if diff_id and diff_id.startswith("sha256:") and got != diff_id:
            raise ImageError(f"layer {layer.digest} does not unpack to its diff_id {diff_id}")

    def apply_all(self, image: Image) -> None:
        """Every layer of ``image`` in order, each checked against its diff_id."""
        for i, layer in enumerate(image.layers):
            diff_ids = image.config.diff_ids
            self.apply(layer, diff_ids[i] if i < len(diff_ids) else None)

    def finish(self, final: Path, workdir: str = "") -> Path:
        if workdir.startswith("/"):
            self.applier.ensure_dir(workdir)  # Docker creates a missing WorkingDir too
        self.applier.finish()
        root = self.work / "root"
        image = final.with_name(f".{final.name}.{os.getpid()}.tmp")  # beside it: renamed, not copied
        try:
            make_ext4(root, image, base_size(root))
            run_debugfs(image, self.applier.fixups(self.work))
            os.chmod(image, 0o444)
            with open(image, "rb") as f:
                os.fsync(f.fileno())
            os.replace(image, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                image.unlink()
        fsync_dir(final.parent)
        return final

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _move_tree(src: Path, dest: Path) -> None:
    """Rename, or copy with owners and modes kept where the staging tree is on another file system."""
    try:
        os.rename(src, dest)
        return
    except OSError:
        pass
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(["cp", "-a", str(src), str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImageError(f"copying the unpacked image failed: {proc.stderr.strip()}")
    os.rename(tmp, dest)


class ImageManager:
    def __init__(self, home: Path) -> None:
        self.store = ImageStore(home)

    # -- queries ---------------------------------------------------------------------------

    def list_images(self) -> list[Image]:
        return self.store.list_images()

    def get(self, name: str) -> Image | None:
        return self.store.get(name)

    def require(self, name: str) -> Image:
        img = self.store.get(name)
        if img is None:
            raise InvalidArgument(f"no image {name!r} here; pull, load or import it first")
        return img

    # -- records -----------------------------------------------------------------------------

    def _record(self, manifest_digest: str, names: list[str], source: str) -> Image:
        manifest = read_manifest(self.store, manifest_digest)
        if is_index(None, self.store.read_blob(manifest_digest)):
            manifest_digest = Index.parse(self.store.read_blob(manifest_digest)).select().digest
        config_bytes = self.store.read_blob(manifest.config.digest)
        if len(config_bytes) > MAX_CONFIG_BYTES:
            raise ImageError("image config is too large")
        config = ImageConfig.parse(config_bytes)
        if config.diff_ids and len(config.diff_ids) != len(manifest.layers):
            raise ImageError(
                f"image config lists {len(config.diff_ids)} diff_ids for {len(manifest.layers)} layers"
            )
        if config.architecture and config.architecture not in ("amd64", "x86_64"):
            raise ImageError(f"image is for {config.architecture}; sandlot boxes are x86_64")
        layers = tuple(Layer(d.digest, d.media_type, d.size) for d in manifest.layers)
        for layer in layers:
            if not self.store.has_blob(layer.digest):
                raise ImageError(f"layer {layer.digest} is missing")
        image = Image(
            manifest_digest,
            manifest.config.digest,
            layers,
            config,
            (),
            source,
            time.time(),
            manifest.media_type,
        )
        return self.store.save(image, names)

    # -- pull ------------------------------------------------------------------------------------

    async def pull(
        self,
        ref: str | Reference,
        *,
        credentials: auth_mod.Credentials | tuple[str, str] | None = None,
        insecure: bool = False,
        ca_cert: Path | None = None,
        progress: ProgressFn | None = None,
        prepare: bool = True,
    ) -> Image:
        """Pull an image (x86_64) into the store and, with ``prepare``, make its disk."""
        from .registry import RegistryClient  # httpx is imported only by those who pull

        with space_for(self.store.home, f"image {ref} could not be pulled"):
            r = ref if isinstance(ref, Reference) else Reference.parse(ref)
            creds = auth_mod.Credentials(*credentials) if isinstance(credentials, tuple) else credentials
            async with RegistryClient(r, credentials=creds, insecure=insecure, ca_cert=ca_cert) as client:
                data, media_type, digest = await client.manifest(r.digest or r.tag or "latest")
                if is_index(media_type, data):
                    self.store.put_blob(data, digest)
                    chosen = Index.parse(data, media_type).select()
                    data, media_type, digest = await client.manifest(chosen.digest)
                manifest = Manifest.parse(data, media_type)
                self.store.put_blob(data, digest)
                config_bytes = await client.blob_bytes(manifest.config, MAX_CONFIG_BYTES)
                self.store.put_blob(config_bytes, manifest.config.digest)
                config = ImageConfig.parse(config_bytes)
                existing = self.store.get(digest)
                base_ready = existing is not None and self.store.base_path(existing).exists()
                builder = None
                if prepare and not base_ready:
                    layers = [Layer(d.digest, d.media_type, d.size) for d in manifest.layers]
                    builder = _BaseBuilder(self.store, digest.split(":")[1], _estimate(layers))
                try:
                    sem = asyncio.Semaphore(MAX_CONCURRENT_DOWNLOADS)

                    async def fetch(desc: Any) -> None:
                        async with sem:
                            await client.fetch_blob(desc, self.store, progress)

                    tasks = [asyncio.ensure_future(fetch(d)) for d in manifest.layers]
                    try:
                        for i, (task, desc) in enumerate(zip(tasks, manifest.layers, strict=True)):
                            await task
                            if builder is not None:
                                layer = Layer(desc.digest, desc.media_type, desc.size)
                                diff_id = config.diff_ids[i] if i < len(config.diff_ids) else None
                                await asyncio.to_thread(builder.apply, layer, diff_id)
                    finally:
                        for task in tasks:
                            task.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
                    tagged = not r.digest or r.tag
                    names = [str(Reference(r.registry, r.repository, r.tag))] if tagged else []
                    image = self._record(digest, names, f"registry:{r.name}")
                    if builder is not None:
                        try:
                            await asyncio.to_thread(self._publish_base, builder, image)
                        except NoSpace:
                            if existing is None:  # an image this pull recorded goes again
                                with contextlib.suppress(Exception):
                                    self.store.remove(image.digest)
                            raise
                finally:
                    if builder is not None:
                        builder.cleanup()
            return image

    # -- local sources ----------------------------------------------------------------------------

    def load(self, path: Path, name: str | None = None) -> list[Image]:
        """Load a ``docker save``/OCI tarball or an OCI layout directory."""
        path = Path(path)
        if not path.exists():
            raise InvalidArgument(f"{path} does not exist")
        with space_for(self.store.home, f"images of {path} could not be loaded"):
            loaded = load_oci_layout(self.store, path) if path.is_dir() else load_archive(self.store, path)
        if not loaded:
            raise ImageError(f"{path} holds no image")
        images = []
        before = {img.digest for img in self.list_images()}
        for item in loaded:
            names = [name] if name else item.names
            refs = []
            for n in names:
                with contextlib.suppress(InvalidArgument):
                    refs.append(str(Reference.parse(n)))
            image = self._record(item.manifest_digest, refs, f"file:{path}")
            try:
                # its layers are checked (unpacked, into its base disk) now, as a pull checks
                # them, not only when a box is first made of it
                self.ensure_base(image)
            except (ImageError, NoSpace):
                if image.digest not in before:  # an image this load made goes again
                    with contextlib.suppress(Exception):
                        self.store.remove(image.digest)
                raise
            images.append(image)
        return images

    def import_dir(self, src: Path, name: str, **config: Any) -> Image:
        ref = str(Reference.parse(name))
        digest = import_dir(self.store, Path(src), **config)
        return self._record(digest, [ref], f"dir:{src}")

    def remove(self, name: str) -> list[str]:
        return self.store.remove(name)

    def prune(self, boxes_dir: Path, unused_for: float = 0.0) -> PruneReport:
        in_use: set[Path] = set()
        layer_dirs = (boxes_dir.parent / "layers").glob("*.dir")
        for layer in layer_dirs:  # an overlay's lower layer is named in its "base" file
            with contextlib.suppress(OSError):
                in_use.add(Path((layer / "base").read_text().strip()))
        disks = list(boxes_dir.glob("*/*.qcow2")) + list((boxes_dir.parent / "layers").glob("*.qcow2"))
        if disks:
            for disk in disks:
                backing = qcow2_backing_file(disk)
                if backing:
                    in_use.add(Path(backing))
                    with contextlib.suppress(OSError):
                        in_use.add(Path(backing).resolve())
        return self.store.prune(in_use, unused_for)

    # -- base disks ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _build_lock(self, image: Image) -> Iterator[None]:
        self.store.bases.mkdir(parents=True, exist_ok=True)
        with open(self.store.bases / f".lock-{image.digest.split(':')[1][:16]}", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _publish_base(self, builder: _BaseBuilder, image: Image) -> Path:
        with self._build_lock(image):
            final = self.store.base_path(image)
            if final.exists():
                return final
            return builder.finish(final, image.config.workdir)

    def ensure_rootfs(self, image: Image) -> Path:
        """The image unpacked as a directory, made from its layers if not there yet:
        the read-only lower layer that boxes of overlay engines (gvisor) share."""
        final = self.store.rootfs_path(image)
        if final.is_dir():
            return final
        with self._build_lock(image):
            if final.is_dir():
                return final
            with space_for(self.store.home, f"image {image.digest[:19]} could not be unpacked"):
                builder = _BaseBuilder(self.store, image.digest.split(":")[1], _estimate(image.layers))
                try:
                    builder.apply_all(image)
                    workdir = image.config.workdir
                    if workdir.startswith("/"):
                        builder.applier.ensure_dir(workdir)
                    builder.applier.finish()
                    _move_tree(builder.work / "root", final)
                    fsync_dir(final.parent)
                    return final
                finally:
                    builder.cleanup()

    def ensure_base(self, image: Image) -> Path:
        """The ext4 base disk of an image, made from its layers if not there yet."""
        final = self.store.base_path(image)
        if final.exists():
            return final
        with self._build_lock(image):
            if final.exists():
                return final
            with space_for(self.store.home, f"the disk of image {image.digest[:19]} could not be made"):
                builder = _BaseBuilder(self.store, image.digest.split(":")[1], _estimate(image.layers))
                try:
                    builder.apply_all(image)
                    return builder.finish(final, image.config.workdir)
                finally:
                    builder.cleanup()
