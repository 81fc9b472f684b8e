"""Snapshot archives: one file that moves a running box to another machine.

An archive is a zstd-compressed tar with exactly these members, in this order::

    manifest.json   format, version, the snapshot's facts, and for every part its
                    size and sha256; the compatibility facts: the engine, the VM's
                    shape (memory, CPUs, agent ports, network card), the
                    accelerator, and the engine's own facts under ``engine_facts``
                    (for QEMU: its version, machine type, CPU model), and the
                    kernel's hash
    devices         the engine's device state without RAM
    memory          guest RAM, raw
    disk.qcow2      the disk, every layer and the image base flattened into one

or, version 4, a state saved as chunks (``core.chunks``, docs/storage.md)::

    manifest.json   as above, with ``chunks`` (the chunks the archive carries) and,
                    for an incremental archive, ``since`` (the snapshot it carries
                    only what changed from)
    state           the state's manifest: its memory images and streams, by chunk
    chunks/<hash>   each chunk it carries, as the chunk store keeps it (zstd), named
                    by the BLAKE3 hash of its bytes (checked against it on import)
    disk.qcow2      the disk, flattened as above; or, ``since`` a base,
    layer<i>.qcow2  the disk's layers above the base's, bottom first, each on the one
                    below (on the base's own layer for the first)
    volume<i>.qcow2 each named volume, flattened

An incremental archive (``Snapshot.export(path, since=base)``) carries only the chunks
and disk layers its state has that the base's has not; the home that imports it must
hold the base (exported from there, or imported from the same archive chain).

or, for an engine whose disk is a layer directory (gvisor)::

    manifest.json
    checkpoint.img  runsc's checkpoint image (memory, processes, kernel state)
    root.tar        the box's whole root as it saw it: every layer and the image's
                    root merged (tar, with owners, modes and xattrs); imported as a
                    read-only image root of its own, unpacked as image layers are

Version 1 archives (before engines were named; their compatibility facts were
QEMU's, at the top level) are read too.

Importing treats the file as hostile: the manifest is checked before anything
large is read, members must be exactly those, regular, of the declared sizes
and hashes; the disk must be a standalone qcow2 (no backing or data file that
could point at the host's files). Nothing is visible until every part is
verified: parts go to a temporary directory renamed into place, then the row
is committed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import zstandard

from ..config import fsync_dir
from ..crashpoints import crash_point
from ..engine.base import Boot, Engine
from ..errors import CorruptSnapshot, HostSetupError, InvalidArgument, VolumeNotFound, no_space
from . import exports, layers, snapshots, volumes
from .access import NAMESPACE_LABEL
from .chunks import ChunkStore
from .manifest import Manifest
from .option_values import MAX_MOUNTS, Mount, is_volume_name, parse_mount
from .spec import BoxSpec
from .store import NAME_RE, BoxStore, SnapshotRecord
from .validate import check_env, check_user, guest_path

FORMAT = "sandlot-snapshot"
VERSION = 3  # 3: the named volumes' layers, ``volume<i>.qcow2`` after the parts
CHUNKED = 4  # 4: a state saved as chunks, its chunks as members; a base it builds on
READABLE = (1, 2, 3, 4)
MAX_CHUNK_MEMBER = 1 << 20  # a chunk of 64 KiB, compressed: far less; more is no chunk
PARTS = ("devices", "memory", "disk.qcow2")
# the members after the manifest, by the engine that saved the state
PARTS_BY_ENGINE = {"qemu": PARTS, "gvisor": ("checkpoint.img", "root.tar")}
MAX_MANIFEST = 1 << 20
MAX_DEVICES = 256 << 20
MAX_DISK = 16 << 40
CHUNK = 1 << 20


def volume_member(index: int) -> str:
    return f"volume{index}.qcow2"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _qemu_img() -> str:
    path = shutil.which("qemu-img")
    if not path:
        raise HostSetupError("qemu-img not found: install qemu-utils")
    return path


def export_snapshot(home: Path, engine: Engine, rec: SnapshotRecord, dest: Path) -> Path:
    """Write ``rec`` (its memory shared, see ``Engine.share_memory``) to ``dest``;
    readers never see a partial file."""
    src = snapshots.snapshot_dir(home, rec.id)
    if not engine.memory_shared(src):
        raise CorruptSnapshot(f"snapshot {rec.id} has no memory image to export")

    def parts(work: Path) -> dict[str, Path]:
        if Path(rec.layer).suffix == layers.DIR_SUFFIX:
            disk_member = "root.tar"
            engine.flatten_root(Path(rec.layer), work / disk_member)
        else:
            disk_member = "disk.qcow2"
            _flatten(Path(rec.layer), work / disk_member, rec, dest)
        paths = {**engine.state_files(src), disk_member: work / disk_member}
        return {name: paths[name] for name in PARTS_BY_ENGINE[rec.facts.get("engine", "qemu")]}

    return _write_archive(home, rec, dest, VERSION, parts)


def export_chunked(
    home: Path, store: BoxStore, rec: SnapshotRecord, dest: Path, since: SnapshotRecord | None = None
) -> Path:
    """Write ``rec``, a state saved as chunks, to ``dest`` as a version 4 archive: its
    manifest and chunks, and its disk flattened; or (``since``) only the chunks and the
    disk layers that ``since`` (a snapshot below it in its disk's chain) has not."""
    data = store.state_manifest(rec.id)
    if data is None:
        raise InvalidArgument(f"snapshot {rec.name or rec.id} was saved before chunks: it exports whole")
    state = Manifest.decode(data, rec.id)
    wanted = sorted(state.digests())
    layer_files: list[Path] = []
    extra: dict[str, Any] = {}
    if since is not None:
        base_data = store.state_manifest(since.id)
        if since.id == rec.id or base_data is None:
            raise InvalidArgument(f"snapshot {since.name or since.id} is no base of {rec.name or rec.id}: "
                                  "a base is another snapshot saved as chunks")  # fmt: skip
        chain = layers.chain(Path(rec.layer))
        if Path(since.layer) not in chain or rec.options.get("drives"):
            raise InvalidArgument(f"snapshot {since.name or since.id} is no base of {rec.name or rec.id}: "
                                  "a base is a snapshot of the same box, taken before it (and a box "
                                  "with named volumes exports whole)")  # fmt: skip
        base = Manifest.decode(base_data, since.id).digests()
        wanted = [d for d in wanted if d not in base]
        layer_files = list(reversed(chain[: chain.index(Path(since.layer))]))
        origin = (since.options.get("imported_from") or {}).get("id")
        extra = {
            "since": {"id": since.id, **({"origin": origin} if origin else {})},
            "layers": len(layer_files),
        }
    cstore = ChunkStore(home)

    def parts(work: Path) -> dict[str, Path]:
        (work / "state").write_bytes(data)
        out = {"state": work / "state"}
        if since is None:
            _flatten(Path(rec.layer), work / "disk.qcow2", rec, dest)
            out["disk.qcow2"] = work / "disk.qcow2"
        else:
            out.update({f"layer{i}.qcow2": p for i, p in enumerate(layer_files)})
        return out

    with cstore.using():
        chunk_members: dict[str, Callable[[], bytes]] = {
            f"chunks/{d.hex()}": functools.partial(cstore.packed, d, rec.id) for d in wanted
        }
        return _write_archive(home, rec, dest, CHUNKED, parts, chunk_members,
                              {**extra, "chunks": [d.hex() for d in wanted]})  # fmt: skip


def _write_archive(
    home: Path,
    rec: SnapshotRecord,
    dest: Path,
    version: int,
    parts: Callable[[Path], dict[str, Path]],
    chunk_members: dict[str, Callable[[], bytes]] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """The archive of ``rec``: its manifest, the chunks (version 4), the files ``parts``
    makes in a work directory beside ``dest``, then its named volumes, flattened.
    Written under a temporary name and renamed: readers never see a partial file."""
    dest = dest.expanduser().absolute()
    if dest.is_dir():
        raise InvalidArgument(f"{dest} is a directory; give a file name")
    dest.parent.mkdir(parents=True, exist_ok=True)
    exports.sweep(home)  # what killed exports left (a new process's first store use does it too)
    work = Path(dest.parent / f".{dest.name}.parts-{secrets.token_hex(4)}")
    tmp = dest.parent / f".{dest.name}.tmp-{secrets.token_hex(4)}"
    record = exports.note(home, work, tmp)  # before either exists: a kill leaves them named
    work.mkdir()
    try:
        paths = parts(work)
        if version != CHUNKED or "disk.qcow2" in paths:  # (an incremental archive: no volumes)
            for i, layer in enumerate(rec.options.get("drives") or []):  # each named volume, as it was
                _flatten(Path(layer), work / volume_member(i), rec, dest)
                paths[volume_member(i)] = work / volume_member(i)
        facts = rec.facts
        engine_facts = dict(facts.get("engine_facts") or {})
        kernel_sha = None
        with contextlib.suppress(OSError, KeyError):
            kernel_sha = _sha256(Path(engine_facts.pop("kernel")))
        engine_facts.pop("initrd", None)  # this host's paths mean nothing elsewhere
        manifest = {
            "format": FORMAT,
            "version": version,
            "snapshot": {
                "id": rec.id,
                "name": rec.name,
                "kind": rec.kind,
                "box_name": rec.box_name,
                "created_at": rec.created_at,
                "box": _portable_box_options(rec.options.get("box", {})),
                "image_ref": rec.options.get("image_ref"),
                "image_digest": rec.options.get("image_digest"),
            },
            "compat": {
                **{k: facts[k] for k in ("engine", "accel", "memory_mib", "cpus", "agent_ports")},
                "network": bool(facts.get("network")),
                "engine_facts": engine_facts,
                "kernel_sha256": kernel_sha,
            },
            "files": {name: {"size": p.stat().st_size, "sha256": _sha256(p)} for name, p in paths.items()},
            **(extra or {}),
        }
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        now = int(time.time())
        with open(tmp, "wb") as out:
            cctx = zstandard.ZstdCompressor(level=3, threads=-1)
            with cctx.stream_writer(out, closefd=False) as zw, tarfile.open(fileobj=zw, mode="w|") as tar:
                info = tarfile.TarInfo("manifest.json")
                info.size, info.mtime, info.mode = len(raw), now, 0o644
                tar.addfile(info, io.BytesIO(raw))
                order = list(paths)
                if "state" in paths:  # the state's manifest, then its chunks, then the disk
                    order.remove("state")
                    _add(tar, "state", paths["state"], now)
                for name, packed in (chunk_members or {}).items():
                    blob = packed()
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(blob), now, 0o644
                    tar.addfile(info, io.BytesIO(blob))
                for name in order:
                    _add(tar, name, paths[name], now)
                    crash_point("export.mid-write")
            out.flush()
            os.fsync(out.fileno())
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
        return dest
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(dest.parent, f"snapshot {rec.id} could not be exported to {dest}") from None
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        record.unlink(missing_ok=True)


def _add(tar: tarfile.TarFile, name: str, path: Path, mtime: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = path.stat().st_size, mtime, 0o644
    with open(path, "rb") as f:
        tar.addfile(info, f)


def _flatten(layer: Path, out: Path, rec: SnapshotRecord, dest: Path) -> None:
    """A disk's chain as one qcow2 file of its own (no backing file)."""
    proc = subprocess.run([_qemu_img(), "convert", "-O", "qcow2", "-U", str(layer), str(out)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0 and "No space left" in proc.stderr:
        raise no_space(dest.parent, f"snapshot {rec.id} could not be exported to {dest}")
    if proc.returncode != 0:
        raise CorruptSnapshot(f"a disk of snapshot {rec.id} cannot be read: {proc.stderr.strip()}")


# -- import -----------------------------------------------------------------------------------


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptSnapshot(f"not a valid sandlot snapshot archive: {what}")


_V1_GENERAL = ("accel", "memory_mib", "cpus", "ports", "kernel_sha256")


def _v1_compat(compat: dict[str, Any]) -> dict[str, Any]:
    """A version 1 archive's compatibility facts (QEMU's, at the top level) in today's shape:
    every fact but the general ones is the engine's."""
    engine_facts = {k: compat.get(k) for k in ("machine", "qemu_version", "cpu_model")}
    engine_facts |= {k: v for k, v in compat.items() if k not in _V1_GENERAL}
    return {
        "engine": "qemu",
        "accel": compat.get("accel"),
        "memory_mib": compat.get("memory_mib"),
        "cpus": compat.get("cpus"),
        "agent_ports": compat.get("ports"),
        "network": False,  # version 1 wrote no network facts: it exported boxes without a card only
        "engine_facts": engine_facts,
        "kernel_sha256": compat.get("kernel_sha256"),
    }


def _check_manifest(m: Any) -> dict[str, Any]:
    _need(isinstance(m, dict), "the manifest is not an object")
    _need(m.get("format") == FORMAT, f"format is {m.get('format')!r}")
    _need(m.get("version") in READABLE, f"version {m.get('version')!r} is not one of {READABLE}")
    if m["version"] == CHUNKED:
        return _check_chunked_manifest(m)
    files, compat, snap = m.get("files"), m.get("compat"), m.get("snapshot")
    _need(isinstance(compat, dict), "no compatibility facts")
    if m["version"] == 1:
        compat = m["compat"] = _v1_compat(compat)
    parts = PARTS_BY_ENGINE.get(compat.get("engine"))
    _need(parts is not None, f"compat.engine {compat.get('engine')!r} is not one this host knows")
    assert parts is not None
    _need(isinstance(snap, dict) and isinstance(snap.get("box", {}), dict), "no snapshot facts")
    mounts = snap["box"].get("mounts") or []
    _need(isinstance(mounts, list) and len(mounts) <= MAX_MOUNTS, "snapshot.box.mounts is not a short list")
    engine_parts = len(parts)
    parts = (*parts, *(volume_member(i) for i in range(len(mounts))))
    _need(
        isinstance(files, dict) and set(files) == set(parts),
        f"the manifest must list {', '.join(parts)}",
    )
    for name, f in files.items():
        _need(isinstance(f, dict), f"entry {name} is not an object")
        size, digest = f.get("size"), f.get("sha256")
        _need(isinstance(size, int) and not isinstance(size, bool) and size >= 0, f"{name}: bad size")
        _need(
            isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None,
            f"{name}: bad sha256",
        )
    _check_compat(compat)
    if parts[: len(PARTS)] == PARTS:
        _need(
            files["memory"]["size"] == compat["memory_mib"] << 20,
            "the memory image does not match memory_mib",
        )
        _need(files["devices"]["size"] <= MAX_DEVICES, "the device state is too large")
        for name in parts[len(PARTS) - 1 :]:
            _need(files[name]["size"] <= MAX_DISK, f"{name} is too large")
    else:
        _need(files["checkpoint.img"]["size"] <= (compat["memory_mib"] << 20) + MAX_DEVICES,
              "the checkpoint is larger than the memory it was saved with")  # fmt: skip
        _need(files["root.tar"]["size"] <= MAX_DISK, "the root is too large")
        for name in parts[engine_parts:]:
            _need(files[name]["size"] <= MAX_DISK, f"{name} is too large")
    checked: dict[str, Any] = m
    checked["parts"] = parts
    return checked


def _check_compat(compat: Any) -> None:
    _need(isinstance(compat, dict), "no compatibility facts")
    for key in ("engine", "accel"):
        _need(isinstance(compat.get(key), str), f"compat.{key} missing")
    _need(isinstance(compat.get("engine_facts"), dict), "compat.engine_facts missing")
    _need(
        all(isinstance(v, str) for v in compat["engine_facts"].values()), "compat.engine_facts are not text"
    )
    for key, hi in (("memory_mib", 1 << 20), ("cpus", 1024), ("agent_ports", 64)):
        v = compat.get(key)
        _need(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= hi, f"compat.{key} out of range")
    _need(isinstance(compat.get("network", False), bool), "compat.network is not true or false")


def _check_chunked_manifest(m: dict[str, Any]) -> dict[str, Any]:
    """Version 4: ``state``, the chunks it lists, then the disk (flattened, or the layers
    above its ``since`` base) and the named volumes."""
    files, compat, snap = m.get("files"), m.get("compat"), m.get("snapshot")
    _check_compat(compat)
    assert isinstance(compat, dict)
    _need(isinstance(snap, dict) and isinstance(snap.get("box", {}), dict), "no snapshot facts")
    assert isinstance(snap, dict)
    chunks, since, n_layers = m.get("chunks"), m.get("since"), m.get("layers", 0)
    hashes = chunks if isinstance(chunks, list) else None
    _need(hashes is not None and all(isinstance(c, str) and re.fullmatch(r"[0-9a-f]{64}", c) for c in hashes),
          "chunks is not a list of BLAKE3 hashes")  # fmt: skip
    assert hashes is not None
    _need(len(set(hashes)) == len(hashes), "a chunk is listed twice")
    _need(
        since is None or (isinstance(since, dict) and isinstance(since.get("id"), str)), "since is malformed"
    )
    _need(isinstance(n_layers, int) and not isinstance(n_layers, bool) and 0 <= n_layers <= 4096,
          "layers is not a count")  # fmt: skip
    _need((since is None) == (n_layers == 0), "an archive with a base carries layers, and only it")
    mounts = snap["box"].get("mounts") or []
    _need(isinstance(mounts, list) and len(mounts) <= MAX_MOUNTS, "snapshot.box.mounts is not a short list")
    _need(since is None or not mounts, "an archive with a base carries no named volumes")
    disk = [f"layer{i}.qcow2" for i in range(n_layers)] if since is not None else ["disk.qcow2"]
    named = ("state", *disk, *(volume_member(i) for i in range(len(mounts))))
    _need(isinstance(files, dict) and set(files) == set(named), f"the manifest must list {', '.join(named)}")
    assert isinstance(files, dict)
    for name, f in files.items():
        _need(isinstance(f, dict), f"entry {name} is not an object")
        size, digest = f.get("size"), f.get("sha256")
        _need(
            isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_DISK,
            f"{name}: bad size",
        )
        _need(
            isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None,
            f"{name}: bad sha256",
        )
    _need(files["state"]["size"] <= MAX_MANIFEST * 64, "the state's manifest is too large")
    checked: dict[str, Any] = m
    checked["parts"] = ("state", *(f"chunks/{c}" for c in hashes), *disk, *named[1 + len(disk) :])
    return checked


def _portable_box_options(box: dict[str, Any]) -> dict[str, Any]:
    """A box's options as an archive carries them: its shares without this host's paths,
    each a requirement of the home that imports it (a shared volume of that name, or a
    directory given when a box is started from it)."""
    shares = [["", v[1], bool(v[2]), *v[3:4]] for v in box.get("volumes") or []]
    return {**box, "volumes": shares}


def _clean_box_options(box: dict[str, Any]) -> dict[str, Any]:
    """What a box started from an imported snapshot takes from it, validated."""
    out: dict[str, Any] = {}
    try:
        if box.get("env"):
            out["env"] = check_env(box["env"])
        if box.get("workdir"):
            out["workdir"] = guest_path(box["workdir"])
        if box.get("user"):
            out["user"] = check_user(box["user"])
        if isinstance(box.get("disk_size_gb"), int):
            out["disk_size_gb"] = box["disk_size_gb"]
        given = box.get("mounts") or []
        if not isinstance(given, list) or not all(
            isinstance(m, list) and len(m) == 3 and all(isinstance(x, str) for x in m) for m in given
        ):
            raise InvalidArgument("its named volumes are malformed")
        mounts = [parse_mount(tuple(m)) for m in given]
        if any(not isinstance(m, Mount) for m in mounts) or len({m.guest for m in mounts}) != len(mounts):
            raise InvalidArgument("its named volumes are malformed")
        out["mounts"] = [[m.volume, m.guest, m.mode] for m in mounts if isinstance(m, Mount)]
        shares = box.get("volumes") or []
        if not isinstance(shares, list) or len(shares) + len(mounts) > MAX_MOUNTS:
            raise InvalidArgument("its shares are malformed")
        for v in shares:
            named = isinstance(v, list) and (len(v) == 3 or (len(v) == 4 and isinstance(v[3], str)))
            if not named or v[0] != "" or not isinstance(v[1], str) or not isinstance(v[2], bool):
                raise InvalidArgument("its shares are malformed")
            if len(v) == 4 and not is_volume_name(v[3]):
                raise InvalidArgument(f"its shares are malformed: {v[3]!r} is not a volume name")
        out["volumes"] = [["", guest_path(v[1]), v[2], *v[3:4]] for v in shares]
        if len({v[1] for v in out["volumes"]} | {m[1] for m in out["mounts"]}) != len(shares) + len(mounts):
            raise InvalidArgument("its shares are malformed: two share one guest path")
        cfg = box.get("image_config")
        if isinstance(cfg, dict):
            clean: dict[str, Any] = {}
            for k in ("env", "entrypoint", "cmd"):
                v = cfg.get(k, [])
                if isinstance(v, list) and all(isinstance(x, str) and "\0" not in x for x in v):
                    clean[k] = v
            for k in ("workdir", "user"):
                if isinstance(cfg.get(k), str) and "\0" not in cfg[k]:
                    clean[k] = cfg[k]
            out["image_config"] = clean
    except InvalidArgument as exc:
        raise CorruptSnapshot(f"not a valid sandlot snapshot archive: {exc}") from None
    return out


def _shared_here(store: BoxStore, share: list[Any]) -> list[Any]:
    """An archive's share of a shared volume, bound to this home's volume of that name
    (what the volume held is not in the archive); a host directory's stays a requirement."""
    if len(share) < 4:
        return share
    name = share[3]
    try:
        vol = volumes.get_volume(store, name)
    except VolumeNotFound:
        vol = None
    if vol is None or vol.kind != "shared":
        raise InvalidArgument(
            f"the snapshot shares volume {name!r} at {share[1]}: a shared volume of that name must be here "
            f"first (sandlot.volume.create({name!r}, shared=True)); what it held is not in the archive"
        )
    return [vol.layer, *share[1:]]


def _copy_member(src: IO[bytes], dest: Path, size: int, digest: str, name: str) -> None:
    h = hashlib.sha256()
    left = size
    with open(dest, "wb") as out:
        while left:
            chunk = src.read(min(CHUNK, left))
            _need(bool(chunk), f"{name} is truncated")
            if name == "memory" and chunk.count(0) == len(chunk):
                out.seek(len(chunk), os.SEEK_CUR)  # keep the RAM image sparse
            else:
                out.write(chunk)
            h.update(chunk)
            left -= len(chunk)
        out.truncate(size)
        out.flush()
        os.fsync(out.fileno())
    _need(h.hexdigest() == digest, f"{name} does not match its sha256 (damaged or altered)")


def _check_disk(path: Path) -> None:
    proc = subprocess.run([_qemu_img(), "info", "--output=json", "-f", "qcow2", str(path)],
                          capture_output=True, text=True)  # fmt: skip
    _need(proc.returncode == 0, f"the disk is not a qcow2 image: {proc.stderr.strip()[:200]}")
    info = json.loads(proc.stdout)
    _need("backing-filename" not in info and "full-backing-filename" not in info,
          "the disk names a backing file (it would read the host's files)")  # fmt: skip
    data = info.get("format-specific", {}).get("data", {})
    _need("data-file" not in data, "the disk names an external data file")


def import_snapshot(
    home: Path,
    store: BoxStore,
    engines: Callable[[str], tuple[Engine, Boot]],
    path: Path,
    namespace: str | None = None,
) -> SnapshotRecord:
    """Verify and add an exported snapshot to this home; the new row is returned.
    ``engines``: the engine the archive names, and how this host boots its VMs (the
    archive must match it). ``namespace``: whose the snapshot is here (its box's
    namespace label, whatever the archive's was): the importer's."""
    path = path.expanduser()
    if not path.is_file():
        raise InvalidArgument(f"{path} is not a file")
    snap_id = snapshots.new_id()
    final = snapshots.snapshot_dir(home, snap_id)
    tmp = final.parent / f".tmp-{snap_id}"
    tmp.mkdir(parents=True)
    layer = layers.new_path(home)
    volume_layers: list[Path] = []  # its named volumes' layers, in their order
    root: Path | None = None  # an imported layer directory's own image root
    engine: Engine | None = None
    state_names: dict[str, str] = {}
    parts: tuple[str, ...] = PARTS
    try:
        with open(path, "rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            try:
                tar = tarfile.open(fileobj=reader, mode="r|")  # noqa: SIM115 (closed with the file)
            except (tarfile.TarError, zstandard.ZstdError) as exc:
                raise CorruptSnapshot(f"{path} is not a zstd-compressed tar: {exc}") from None
            try:
                manifest: dict[str, Any] | None = None
                seen: list[str] = []
                for member in tar:
                    _need(member.isreg(), f"member {member.name!r} is not a regular file")
                    if manifest is None:
                        _need(member.name == "manifest.json", "the manifest must come first")
                        _need(member.size <= MAX_MANIFEST, "the manifest is too large")
                        f = tar.extractfile(member)
                        assert f is not None
                        try:
                            manifest = _check_manifest(json.loads(f.read()))
                        except ValueError:
                            raise CorruptSnapshot("the manifest is not JSON") from None
                        engine, boot = engines(manifest["compat"]["engine"])
                        engine.check_compatible(manifest["compat"], boot)
                        if manifest["version"] == CHUNKED:
                            shutil.rmtree(tmp, ignore_errors=True)
                            return _import_chunked(home, store, tar, manifest, engine, boot, path, namespace)
                        state_names = {member: p.name for member, p in engine.state_files(final).items()}
                        parts = manifest["parts"]
                        if engine.disk_format == "dir":
                            layer = layers.new_path(home, layers.DIR_SUFFIX)
                        continue
                    want = parts[len(seen)] if len(seen) < len(parts) else None
                    _need(member.name == want, f"unexpected member {member.name!r}")
                    entry = manifest["files"][member.name]
                    _need(member.size == entry["size"], f"{member.name} is not the size the manifest says")
                    f = tar.extractfile(member)
                    assert f is not None
                    if member.name == "disk.qcow2":
                        dest = layer
                    elif member.name.startswith("volume"):
                        volume_layers.append(layers.new_path(home))
                        dest = volume_layers[-1]
                    elif member.name == "root.tar":
                        dest = tmp / "root.tar"
                    else:
                        dest = tmp / state_names[member.name]
                    _copy_member(f, dest, member.size, entry["sha256"], member.name)
                    seen.append(member.name)
            except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
                raise CorruptSnapshot(f"{path} is damaged: {exc}") from None
        _need(manifest is not None, "no manifest")
        assert manifest is not None
        _need(seen == list(parts), f"parts missing: {', '.join(p for p in parts if p not in seen)}")
        assert engine is not None
        if engine.disk_format == "dir":
            # unpacked as image layers are (the same checks against hostile tars), into a
            # read-only root of its own that the snapshot's empty layer lies over
            root = home / "bases" / f"imported-{snap_id}.rootfs"
            _unpack_root(tmp / "root.tar", root)
            (tmp / "root.tar").unlink()
            layers.make_dir_layer(layer, root)
        for disk in (layer, *volume_layers) if engine.disk_format != "dir" else volume_layers:
            _check_disk(disk)
        rec = _imported_record(store, manifest, engine, boot, snap_id, layer, volume_layers, namespace)
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_layer(layer, root)
        for made in volume_layers:
            made.unlink(missing_ok=True)
        raise
    rec = replace(rec, size=snapshots.dir_size(final))
    try:
        store.insert_snapshot(rec)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        _remove_layer(layer, root)
        for made in volume_layers:
            made.unlink(missing_ok=True)
        raise
    return rec


def _import_chunked(
    home: Path,
    store: BoxStore,
    tar: tarfile.TarFile,
    manifest: dict[str, Any],
    engine: Engine,
    boot: Boot,
    path: Path,
    namespace: str | None,
) -> SnapshotRecord:
    """The rest of a version 4 archive: its state's manifest, its chunks (each checked
    against its hash as it is kept), its disk (flattened, or layers over the base this
    home holds), its volumes; the snapshot's row last, with its chunks counted."""
    snap_id = snapshots.new_id()
    parts: tuple[str, ...] = manifest["parts"]
    files = manifest["files"]
    cstore = ChunkStore(home)
    made: list[Path] = []  # disk files, removed if the import fails
    base: SnapshotRecord | None = None
    if manifest.get("since") is not None:
        base = _find_base(store, manifest["since"])
    state_data = b""
    volumes: list[Path] = []
    disk: list[Path] = []
    try:
        with cstore.using():
            seen = 0
            try:
                # (``next``, not iteration: iterating a tar read as a stream starts again with
                # the members read already, the manifest)
                while (member := tar.next()) is not None:
                    _need(member.isreg(), f"member {member.name!r} is not a regular file")
                    _need(
                        seen < len(parts) and member.name == parts[seen], f"unexpected member {member.name!r}"
                    )
                    seen += 1
                    f = tar.extractfile(member)
                    assert f is not None
                    if member.name.startswith("chunks/"):
                        _need(member.size <= MAX_CHUNK_MEMBER, f"{member.name} is too large for a chunk")
                        name = member.name.removeprefix("chunks/")
                        cstore.put_packed(bytes.fromhex(name), f.read(), f"the archive {path.name}")
                        continue
                    entry = files[member.name]
                    _need(member.size == entry["size"], f"{member.name} is not the size the manifest says")
                    if member.name == "state":
                        state_data = f.read()
                        _need(hashlib.sha256(state_data).hexdigest() == entry["sha256"],
                              "state does not match its sha256 (damaged or altered)")  # fmt: skip
                        Manifest.decode(state_data, f"in {path.name}")
                        continue
                    dest = layers.new_path(home)
                    made.append(dest)
                    _copy_member(f, dest, member.size, entry["sha256"], member.name)
                    (volumes if member.name.startswith("volume") else disk).append(dest)
            except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise no_space(home, f"the archive {path} could not be imported") from None
                raise CorruptSnapshot(f"{path} is damaged: {exc}") from None
            _need(seen == len(parts), f"parts missing: {', '.join(parts[seen:])}")
            state = Manifest.decode(state_data, f"in {path.name}")
            lacking = [d for d in state.digests() if cstore.size(d) is None]
            if lacking:
                first = lacking[0].hex()
                raise CorruptSnapshot(
                    f"{path.name} holds what changed since snapshot {manifest['since']['id']}, and this home "
                    f"lacks {len(lacking)} of its chunks (the first {first}): import the base's archive first"
                    if base is not None
                    else f"not a valid sandlot snapshot archive: it lacks chunk {first} of its state"
                )
            if base is None:
                _check_disk(disk[0])
            else:
                _stack(disk, Path(base.layer))
            for v in volumes:
                _check_disk(v)
            stored = {d: cstore.size(d) or 0 for d in state.digests()}
            rec = _imported_record(store, manifest, engine, boot, snap_id, disk[-1], volumes, namespace)
            disk_bytes = sum(p.stat().st_blocks * 512 for p in disk)
            sizes = {"stored_bytes": sum(p.stat().st_blocks * 512 for p in made) + len(state_data),
                     "logical_bytes": state.logical, "disk_bytes": disk_bytes}  # fmt: skip
            rec = replace(rec, size=sizes["stored_bytes"], options={**rec.options, **sizes})
            store.insert_snapshot(rec, manifest=state_data, stored=stored)
    except BaseException:
        for p in made:
            p.unlink(missing_ok=True)
        raise
    return rec


def _imported_record(
    store: BoxStore,
    manifest: dict[str, Any],
    engine: Engine,
    boot: Boot,
    snap_id: str,
    layer: Path,
    volume_layers: list[Path],
    namespace: str | None,
) -> SnapshotRecord:
    """The row of an imported snapshot: this host's facts, the archive's box options as
    far as they are valid, its names where they are names, its namespace the importer's."""
    compat, info = manifest["compat"], manifest["snapshot"]
    facts = engine.facts_for_import(
        {
            k: compat[k]
            for k in ("engine", "accel", "memory_mib", "cpus", "agent_ports", "network", "engine_facts")
        },
        boot,
    )
    box = {**BoxSpec(image="imported").to_options(), **_clean_box_options(info.get("box") or {})}
    box["image"] = None
    box["volumes"] = [_shared_here(store, v) for v in box["volumes"]]
    if namespace is not None:
        box["labels"] = {**(box.get("labels") or {}), NAMESPACE_LABEL: namespace}
    name = info.get("name") if isinstance(info.get("name"), str) else None
    box_name = info.get("box_name") if isinstance(info.get("box_name"), str) else None
    name = name if name and NAME_RE.match(name) else None
    box_name = box_name if box_name and NAME_RE.match(box_name) else "imported"
    digest = info.get("image_digest")
    # a box started from it mounts private copies of its volumes (none of this home's)
    drives = {"drives": [str(p) for p in volume_layers], "drive_volumes": [""] * len(volume_layers)}
    return SnapshotRecord(
        id=snap_id, kind="snapshot", layer=str(layer), name=name, box_id=None, box_name=box_name,
        created_at=time.time(), size=0,
        options={"box": box, "image_ref": None, "image_digest": digest if isinstance(digest, str) else None,
                 "rootfs": None, "vm": facts, **(drives if volume_layers else {}),
                 "imported_from": {"kernel_sha256": compat.get("kernel_sha256"), "id": info.get("id")}},
    )  # fmt: skip


def _find_base(store: BoxStore, since: dict[str, Any]) -> SnapshotRecord:
    """The snapshot of this home that an incremental archive builds on: the one it was
    exported from here, or imported here from an archive of it."""
    wanted = {since["id"], since.get("origin")} - {None}
    for s in store.snapshots():
        if s.id in wanted or (s.options.get("imported_from") or {}).get("id") in wanted:
            return s
    raise InvalidArgument(
        f"the archive holds what changed since snapshot {since['id']}, which this home does not have: "
        "import the base's archive first"
    )


def _stack(disk: list[Path], below: Path) -> None:
    """An incremental archive's layers, bottom first, each pointed at the one below it
    (the first at the base's layer): nothing but those, no data file of another."""
    for layer, lower in zip(disk, [below, *disk[:-1]], strict=True):
        proc = subprocess.run([_qemu_img(), "info", "--output=json", "-f", "qcow2", str(layer)],
                              capture_output=True, text=True)  # fmt: skip
        _need(proc.returncode == 0, f"a layer is not a qcow2 image: {proc.stderr.strip()[:200]}")
        data = json.loads(proc.stdout).get("format-specific", {}).get("data", {})
        _need("data-file" not in data, "a layer names an external data file")
        fmt = "qcow2" if lower.suffix == ".qcow2" else "raw"
        done = subprocess.run([_qemu_img(), "rebase", "-u", "-F", fmt, "-b", str(lower), str(layer)],
                              capture_output=True, text=True)  # fmt: skip
        _need(done.returncode == 0, f"a layer cannot be put on its base: {done.stderr.strip()[:200]}")
        from ..images.rootfs import qcow2_backing_file

        _need(qcow2_backing_file(layer) == str(lower), "a layer names another backing file than its base")


def _unpack_root(tar: Path, root: Path) -> None:
    from ..images.unpack import apply_layers

    staging = root.with_name(f".{root.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        apply_layers(staging, [(tar, "none")], whiteouts=False)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CorruptSnapshot(
            f"not a valid sandlot snapshot archive: its root cannot be unpacked: {exc}"
        ) from None
    os.rename(staging, root)
    fsync_dir(root.parent)


def _remove_layer(layer: Path, root: Path | None) -> None:
    if layer.is_dir():
        shutil.rmtree(layer, ignore_errors=True)
    else:
        layer.unlink(missing_ok=True)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
