"""Named volumes without a VM: the spec's mounts, the volume files (real mkfs.ext4 and
qemu-img), who writes a volume back, what a removal keeps, the wire form, and the
refusals, through the real API and core on the fake engine. Real mounts, forks and
rollbacks of volumes run in ``tests/vm/test_volumes.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.core import layers, volumes
from sandlot.core.option_values import Mount, Volume, parse_mount
from sandlot.core.options import volumes_json
from sandlot.core.runtime import Runtime
from sandlot.core.spec import BoxSpec
from sandlot.errors import from_dict

from tests.support.fake_engine import register

register()


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


def box(home: Path, root: Path, **kw: Any) -> sandlot.AsyncBox:
    return sandlot.AsyncBox(rootfs=root, engine="fake", home=home, template=False, memory_mib=256, **kw)


def test_a_mount_names_a_volume_unless_it_is_a_path(tmp_path: Path) -> None:
    assert parse_mount("data:/data") == Mount("data", "/data", "")  # the volume's own mode
    assert parse_mount("data:/data:ro") == Mount("data", "/data", "ro")
    assert parse_mount(("data", "/data", "rw")) == Mount("data", "/data", "")
    assert parse_mount("data:/data:copy") == Mount("data", "/data", "copy")
    assert parse_mount("data:/data:shared") == Mount("data", "/data", "shared")
    assert parse_mount(f"{tmp_path}:/host") == Volume(str(tmp_path), "/host", False)
    assert parse_mount(f"{tmp_path}:/host:shared") == Volume(str(tmp_path), "/host", False)
    with pytest.raises(sandlot.InvalidArgument, match="not an existing directory"):
        parse_mount("./missing:/x")  # a relative path is a host directory, which must exist
    with pytest.raises(sandlot.InvalidArgument, match="mode must be 'copy', 'ro' or 'shared'"):
        parse_mount("data:/data:rx")
    for bad in ("data", "data:", ":/x", "data:/", "data:/proc", "data:relative"):
        with pytest.raises(sandlot.InvalidArgument):
            parse_mount(bad)
    spec = BoxSpec.build("alpine", volumes={"data": "/data", str(tmp_path): "/host"})
    assert spec.mounts == [Mount("data", "/data")] and [v.guest for v in spec.volumes] == ["/host"]
    assert BoxSpec.from_options(spec.to_options()).mounts == spec.mounts
    with pytest.raises(sandlot.InvalidArgument, match="share one guest path"):
        BoxSpec.build("alpine", volumes=["a:/d", "b:/d"])
    with pytest.raises(sandlot.InvalidArgument, match="mounts a named volume once"):
        BoxSpec.build("alpine", volumes=["a:/d", "a:/e"])
    with pytest.raises(sandlot.InvalidArgument, match="at most 4 volumes"):
        BoxSpec.build("alpine", volumes=[f"v{i}:/d{i}" for i in range(5)])
    with pytest.raises(sandlot.InvalidArgument, match="a list or a mapping"):
        BoxSpec.build("alpine", volumes="data:/data")  # type: ignore[arg-type]


def test_a_volume_is_an_empty_ext4_filesystem_in_a_chain_of_layers(home: Path) -> None:
    rt = Runtime.for_home(home)
    rec = volumes.create(rt.home, rt.store, "data", size_gb=0.5, labels={"team": "evals"})
    head = Path(rec.layer)
    chain = layers.chain(head)
    assert len(chain) == 2 and chain[1].suffix == layers.RAW_SUFFIX
    assert rec.size == 512 << 20 and chain[1].stat().st_size == rec.size
    assert chain[1].stat().st_blocks * 512 < 32 << 20  # sparse: the host holds what mkfs wrote
    info = subprocess.run(["dumpe2fs", "-h", str(chain[1])], capture_output=True, text=True).stdout
    assert "Filesystem volume name:   data" in info and "clean" in info
    got = run(lambda: sandlot.AsyncVolumes(home).get("data"))
    assert (got.name, got.size_gb, got.labels, got.holder, got.boxes) == (
        "data",
        0.5,
        {"team": "evals"},
        None,
        [],
    )
    with pytest.raises(sandlot.InvalidArgument, match="already exists"):
        volumes.create(rt.home, rt.store, "data")
    for bad in ({"name": "a/b"}, {"name": ".x"}, {"name": ""}, {"name": "x" * 64}):
        with pytest.raises(sandlot.InvalidArgument, match="volume name"):
            volumes.create(rt.home, rt.store, **bad)
    for size in (0, -1, 10**9, True, "5", 0.001):
        with pytest.raises(sandlot.InvalidArgument):
            volumes.create(rt.home, rt.store, "sized", size_gb=size)  # type: ignore[arg-type]
    with pytest.raises(sandlot.InvalidArgument, match="invalid label"):
        volumes.create(rt.home, rt.store, "labelled", labels={"k": 1})  # type: ignore[dict-item]
    assert [v.name for v in volumes.volume_rows(rt.store)] == ["data"]  # the refused ones left nothing
    assert sorted(p.name for p in layers.layers_dir(rt.home).iterdir()) == sorted(p.name for p in chain)
    with pytest.raises(sandlot.VolumeNotFound, match="no volume 'nope'"):
        run(lambda: sandlot.AsyncVolumes(home).remove("nope"))
    run(lambda: sandlot.AsyncVolumes(home).remove("data"))
    assert list(layers.layers_dir(rt.home).iterdir()) == []


def test_one_box_writes_a_volume_back_and_removal_waits_for_its_boxes(home: Path, root: Path) -> None:
    vols = sandlot.AsyncVolumes(home)

    async def main() -> None:
        await vols.create("data", size_gb=0.1)
        first_head = Path(volumes.get_volume(Runtime.for_home(home).store, "data").layer)
        writer = box(home, root, volumes={"data": "/data"})
        await writer.start()
        rec = Runtime.for_home(home).store.get(writer.id)
        [drive] = rec.drives
        assert drive["holds"] and drive["serial"] == "sandlot-vol0"
        assert layers.chain(Path(drive["top"]))[1] == first_head  # its own top over the head
        got = await vols.get("data")
        assert got.holder == writer.name and [b["mode"] for b in got.boxes] == ["copy"]
        with pytest.raises(sandlot.VolumeInUse, match=writer.name) as busy:
            await box(home, root, volumes=["data:/d"]).start()
        assert busy.value.boxes == [writer.name]
        reader = box(home, root, volumes=["data:/data:ro"])
        await reader.start()  # read-only mounts: any number, beside the writer
        assert not Runtime.for_home(home).store.get(reader.id).drives[0]["holds"]
        with pytest.raises(sandlot.VolumeInUse) as mounted:
            await vols.remove("data")
        assert sorted(mounted.value.boxes) == sorted([writer.name, reader.name])
        await writer.remove(force=True)
        store = Runtime.for_home(home).store
        assert volumes.get_volume(store, "data").layer == drive["top"]  # what it wrote is the volume's now
        assert volumes.get_volume(store, "data").holder is None and Path(drive["top"]).exists()
        await box(home, root, volumes=["data:/d"]).start()  # the next writer
        assert (await vols.get("data")).holder is not None
        for b in await sandlot.AsyncBox.list(home=home):
            await b.remove(force=True)
        await vols.remove("data")
        assert list(layers.layers_dir(home).iterdir()) == []  # nothing of it is left

    run(main)


def test_a_box_from_a_snapshot_mounts_private_copies(home: Path, root: Path) -> None:
    vols = sandlot.AsyncVolumes(home)

    async def main() -> None:
        await vols.create("data", size_gb=0.1)
        parent = box(home, root, volumes={"data": "/data"})
        await parent.start()
        snap = await parent.snapshot(name="s")
        store = Runtime.for_home(home).store
        frozen = store.find_snapshot(snap.id)
        assert frozen is not None and frozen.options["drive_volumes"] == [
            volumes.get_volume(store, "data").id
        ]
        [child] = await snap.start(1)
        [cd] = store.get(child.id).drives
        assert not cd["holds"] and layers.chain(Path(cd["top"]))[1] == Path(frozen.options["drives"][0])
        assert (await vols.get("data")).holder == parent.name
        with pytest.raises(sandlot.InvalidArgument, match="its own named volumes"):
            await snap.start(1, volumes=["other:/o"])
        await child.remove(force=True)
        await snap.remove()
        await parent.remove(force=True)
        await vols.remove("data")
        assert list(layers.layers_dir(home).iterdir()) == []

    run(main)


def test_a_shared_volume_is_one_directory_its_boxes_and_their_forks_share(home: Path, root: Path) -> None:
    vols = sandlot.AsyncVolumes(home)
    store = Runtime.for_home(home).store

    async def main() -> None:
        made = await vols.create("scratch", shared=True, labels={"team": "evals"})
        where = Path(volumes.get_volume(store, "scratch").layer)
        assert (made.kind, made.size_gb, made.boxes) == ("shared", 0, []) and where.is_dir()
        assert where.parent == volumes.shared_dir(home) and not layers.layers_dir(home).exists()
        with pytest.raises(sandlot.InvalidArgument, match="no size of its own"):
            await vols.create("sized", shared=True, size_gb=1)
        with pytest.raises(sandlot.InvalidArgument, match="shared must be True or False"):
            await vols.create("odd", shared="yes")  # type: ignore[arg-type]
        await vols.create("disk", size_gb=0.1)
        # the mode a volume allows: refused before any box or file is made
        with pytest.raises(sandlot.InvalidArgument, match="'scratch' is shared: mount it 'shared'"):
            await box(home, root, volumes=["scratch:/s:copy"]).start()
        with pytest.raises(sandlot.InvalidArgument, match=r"create\(name, shared=True\)"):
            await box(home, root, volumes=["disk:/d:shared"]).start()
        assert await sandlot.AsyncBox.list(home=home) == []
        # its boxes are given its directory; no drive, no layer, nobody holds it
        one = box(home, root, volumes={"scratch": "/s", "disk": "/d"})
        two = box(home, root, volumes=["scratch:/s:ro"])
        await one.start()
        await two.start()
        rec = store.get(one.id)
        assert rec.options["volumes"] == [[str(where), "/s", False, "scratch"]]
        assert [d["serial"] for d in rec.drives] == ["sandlot-vol0"]  # the disk volume's only
        assert store.get(two.id).options["volumes"] == [[str(where), "/s", True, "scratch"]]
        got = await vols.get("scratch")
        assert got.holder is None and sorted((b["name"], b["mode"]) for b in got.boxes) == sorted(
            [(one.name, "shared"), (two.name, "ro")]
        )
        (where / "note").write_text("x" * 5000)
        assert (await vols.get("scratch")).host_bytes >= 5000
        # a fork keeps the mount: the same directory, never a copy
        [child] = await one.fork(1)
        assert store.get(child.id).options["volumes"] == [[str(where), "/s", False, "scratch"]]
        assert len(store.get(child.id).drives) == 1  # the disk volume's private copy
        with pytest.raises(sandlot.VolumeInUse) as mounted:
            await vols.remove("scratch")
        assert sorted(mounted.value.boxes) == sorted([one.name, two.name, child.name])
        for b in await sandlot.AsyncBox.list(home=home):
            await b.remove(force=True)
        await vols.remove("scratch")
        assert not where.exists() and [v.name for v in volumes.volume_rows(store)] == ["disk"]

    run(main)


def test_the_wire_carries_named_volumes_only() -> None:
    assert volumes_json({"data": "/data"}, "http") == ["data:/data"]
    assert volumes_json(["data:/data:ro", ("c", "/c", "copy")], "http") == ["data:/data:ro", "c:/c:copy"]
    with pytest.raises(sandlot.Unsupported, match="host directory as a volume") as refused:
        volumes_json(["/srv/data:/data"], "http")
    assert refused.value.transport == "http"
    with pytest.raises(sandlot.InvalidArgument):
        volumes_json("data:/data", "http")


def test_volume_errors_cross_the_wire_as_themselves() -> None:
    err = sandlot.VolumeInUse("volume 'd' is mounted by a, b", boxes=["a", "b"])
    back = from_dict(json.loads(json.dumps({**err.to_dict(), "type": "VolumeInUse"})))
    assert isinstance(back, sandlot.VolumeInUse) and back.boxes == ["a", "b"] and back.code == "volume_in_use"
    missing = from_dict({**sandlot.VolumeNotFound("no volume 'x'").to_dict(), "type": "VolumeNotFound"})
    assert isinstance(missing, sandlot.VolumeNotFound) and isinstance(missing, LookupError)
    assert sandlot.VolumeInUse.status == 409 and sandlot.VolumeNotFound.status == 404
