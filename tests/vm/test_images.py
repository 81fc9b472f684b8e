"""OCI images end to end: a real registry on 127.0.0.1 (plain, and TLS with
htpasswd auth), images pushed with skopeo, pulled by sandlot, booted, and
checked from inside the box."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandlot
from sandlot.images.local import build_image
from sandlot.images.registry import Progress

from tests.support.images import E, build_layouts, layer_tar, layout, python_layout
from tests.support.registry import Registry, run_registry
from tests.support.roots import CACHE

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def layouts(busybox_root: Path) -> dict[str, Path]:
    return build_layouts(CACHE, busybox_root)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, layouts: dict[str, Path]) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as reg:
        reg.push(layouts["busybox"], "test/busybox:1")
        reg.push(layouts["multilayer"], "test/multi:1")
        reg.push(layouts["multiarch"], "test/multiarch:1", all_platforms=True)
        # the same image as a Docker v2 schema 2 manifest, and with zstd layers
        reg.push(layouts["busybox"], "test/busybox:1", "test/busybox-v2s2:1", extra=("--format", "v2s2"))
        reg.push(layouts["busybox-zstd"], "test/busybox-zstd:1")
        yield reg


@pytest.fixture(scope="module")
def secure_registry(tmp_path_factory: pytest.TempPathFactory, layouts: dict[str, Path]) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("secure"), tls=True, auth=("alice", "s3cret")) as reg:
        reg.push(layouts["busybox"], "test/busybox:1")
        yield reg


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A fresh sandlot home per test, sharing the kernel and agent caches."""
    h = tmp_path / "home"
    shared = Path(os.environ["SANDLOT_HOME"])
    sandlot.Runtime.for_home(shared).prepare()
    h.mkdir()
    for d in ("kernels", "agent", "initramfs"):  # pure caches: shared
        (h / d).symlink_to(shared / d)
    return h


def pulled(events: list[Progress]) -> set[str]:
    return {e.digest for e in events if e.status in ("downloading", "resuming")}


def test_pull_boot_and_config_honoured(registry: Registry, home: Path) -> None:
    events: list[Progress] = []
    img = sandlot.pull(registry.ref("test/busybox:1"), home=home, progress=events.append)
    assert img.config.workdir == "/work/dir"
    assert img.config.labels == {"org.example.purpose": "sandlot tests"}
    assert pulled(events) == {layer.digest for layer in img.layers}
    with sandlot.Box(registry.ref("test/busybox:1"), home=home, memory_mib=256) as box:
        r = box.exec(*box.default_command())
        assert r.stdout == "hello from the image\n/work/dir\n0\n"
        assert box.exec("sh", "-c", "echo $GREETING", env={"GREETING": "overridden"}).stdout == "overridden\n"
        assert box.exec("pwd", cwd="/").stdout == "/\n"
    # a second pull downloads no blob
    events.clear()
    again = sandlot.pull(registry.ref("test/busybox:1"), home=home, progress=events.append)
    assert again.digest == img.digest and pulled(events) == set()
    assert {e.status for e in events} == {"cached"}
    # by digest too
    by_digest = sandlot.pull(f"{registry.host}/test/busybox@{img.digest}", home=home)
    assert by_digest.digest == img.digest


def test_multilayer_contents_owners_and_modes(registry: Registry, home: Path) -> None:
    with sandlot.Box(registry.ref("test/multi:1"), home=home, memory_mib=256) as box:
        sh = box.sh
        assert sh("test -e /etc/a && echo present || echo gone").stdout == "gone\n"  # whiteout
        assert sh("ls /data/old").stdout == "z\n"  # opaque dir, same-layer file kept
        assert box.files.read("/data/new.txt") == b"new"
        assert sh("stat -c '%u %g %a' /srv/owned.txt").stdout == "1000 1000 640\n"
        assert sh("stat -c '%a' /usr/local/bin/suid-tool").stdout == "4755\n"
        assert sh("stat -c '%a %g' /srv/shared").stdout == "2775 100\n"
        assert sh("stat -c %i /srv/hard1 /srv/hard2 | uniq | wc -l").stdout.strip() == "1"
        assert box.files.stat("/srv/link", follow_symlinks=False).link_target == "/srv/owned.txt"
        assert sh("stat -c '%t %T' /opt/devnull").stdout == "1 3\n"  # a device node, made in the guest disk
        assert box.exec("cat", "/srv/owned.txt", user="agent").stdout == "owned by agent\n"
        assert box.exec("cat", "/srv/owned.txt", user="nobody").exit_code != 0


@pytest.mark.parametrize("name", ["test/busybox-v2s2:1", "test/busybox-zstd:1"])
def test_docker_v2s2_and_zstd_images(registry: Registry, home: Path, name: str) -> None:
    img = sandlot.pull(registry.ref(name), home=home)
    kinds = {layer.media_type for layer in img.layers}
    if "v2s2" in name:
        assert img.manifest_media_type == "application/vnd.docker.distribution.manifest.v2+json"
        assert kinds == {"application/vnd.docker.image.rootfs.diff.tar.gzip"}
    else:
        assert kinds == {"application/vnd.oci.image.layer.v1.tar+zstd"}
    with sandlot.Box(img, home=home, memory_mib=256) as box:
        assert box.exec(*box.default_command()).stdout == "hello from the image\n/work/dir\n0\n"


def test_killed_pull_leaves_nothing_half_done(registry: Registry, home: Path) -> None:
    code = (
        "import os, sys, sandlot\n"
        "def stop(p):\n"
        "    if p.status == 'downloading' and p.done > 0: os.kill(os.getpid(), 9)\n"
        f"sandlot.pull({registry.ref('test/multi:1')!r}, home={str(home)!r}, progress=stop)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    assert sandlot.list_images(home=home) == []  # no record of a half-pulled image
    store = sandlot.Runtime.for_home(home).images.store
    assert not list(store.bases.glob("img-*"))  # and no visible base disk
    img = sandlot.pull(registry.ref("test/multi:1"), home=home)
    assert sandlot.get_image(registry.ref("test/multi:1"), home=home) == img
    assert not [
        p
        for p in Path("/dev/shm").glob(".sandlot-build-*")
        if not Path(f"/proc/{p.name.split('-')[3]}").exists()
    ]


def test_index_selects_x86_64(registry: Registry, home: Path) -> None:
    img = sandlot.pull(registry.ref("test/multiarch:1"), home=home)
    with sandlot.Box(img, home=home, memory_mib=256) as box:
        assert box.exec(*box.default_command()).stdout == "amd64\n"


def test_tls_registry_with_basic_auth(
    secure_registry: Registry, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = secure_registry.ref("test/busybox:1")
    with pytest.raises(sandlot.ImageError, match=r"credentials|login|not allowed"):
        sandlot.pull(ref, home=home, ca_cert=secure_registry.ca)
    with pytest.raises(sandlot.ImageError, match=r"credentials|not allowed|refused"):
        sandlot.pull(ref, home=home, ca_cert=secure_registry.ca, credentials=("alice", "wrong"))
    with pytest.raises(sandlot.ImageError, match=r"certificate|reach"):
        sandlot.pull(ref, home=home, credentials=("alice", "s3cret"), insecure=False)  # CA not trusted
    img = sandlot.pull(ref, home=home, ca_cert=secure_registry.ca, credentials=("alice", "s3cret"))
    assert img.config.workdir == "/work/dir"
    # credentials from a Docker config file, as `docker login` leaves them
    docker_cfg = tmp_path / "docker"
    docker_cfg.mkdir()
    token = base64.b64encode(b"alice:s3cret").decode()
    (docker_cfg / "config.json").write_text(json.dumps({"auths": {secure_registry.host: {"auth": token}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_cfg))
    sandlot.remove_image(ref, home=home)
    assert sandlot.pull(ref, home=home, ca_cert=secure_registry.ca).digest == img.digest


def test_wrong_digest_is_refused(registry: Registry, home: Path, tmp_path: Path) -> None:
    # an image of its own: the registry shares blobs between repositories
    unique = build_image([layer_tar([E("unique", data=os.urandom(4096))])], cmd=["true"])
    layout(tmp_path / "tampered", [(unique, "test/tampered:1", "amd64")])
    registry.push(tmp_path / "tampered", "test/tampered:1")
    img_manifest = json.loads(unique.manifest)
    layer = img_manifest["layers"][0]["digest"]
    data = registry.blob_data_path(layer)
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size, one byte flipped, served under the old digest
    data.write_bytes(bytes(blob))
    with pytest.raises(sandlot.ImageError, match="does not match its digest"):
        sandlot.pull(registry.ref("test/tampered:1"), home=home)
    store = sandlot.Runtime.for_home(home).images.store
    assert not store.has_blob(layer)
    assert sandlot.get_image(registry.ref("test/tampered:1"), home=home) is None


def test_interrupted_pull_resumes(registry: Registry, home: Path) -> None:
    class Interrupt(Exception):
        pass

    def stop_midway(p: Progress) -> None:
        if p.status == "downloading" and 0 < p.done < p.total:
            raise Interrupt

    with pytest.raises(Interrupt):
        sandlot.pull(registry.ref("test/multi:1"), home=home, progress=stop_midway)
    partials = list((home / "blobs" / "incoming").glob("*.partial"))
    assert partials and any(p.stat().st_size > 0 for p in partials)
    events: list[Progress] = []
    img = sandlot.pull(registry.ref("test/multi:1"), home=home, progress=events.append)
    assert any(e.status == "resuming" for e in events)
    store = sandlot.Runtime.for_home(home).images.store
    assert all(store.has_blob(layer.digest) for layer in img.layers)


def test_load_import_list_remove_prune(layouts: dict[str, Path], busybox_root: Path, home: Path,
                                       tmp_path: Path) -> None:  # fmt: skip
    # an OCI layout directory, and the same as an OCI archive tarball
    [from_dir] = sandlot.load_image(layouts["busybox"], home=home)
    assert from_dir.names == ("docker.io/test/busybox:1",)
    archive = tmp_path / "busybox.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(layouts["busybox"], arcname=".")
    [from_tar] = sandlot.load_image(archive, name="local/bb:tar", home=home)
    assert from_tar.digest == from_dir.digest
    # docker save (legacy) format
    legacy = tmp_path / "legacy.tar"
    _docker_save_legacy(layouts["busybox"], legacy)
    [from_legacy] = sandlot.load_image(legacy, home=home)
    assert from_legacy.names == ("docker.io/legacy/busybox:1",)
    # a directory as an image
    imported = sandlot.import_image(busybox_root, "local/imported:1", cmd=["echo", "imported"], home=home)
    with sandlot.Box("local/imported:1", home=home, pull="never", memory_mib=256) as box:
        assert box.exec(*box.default_command()).stdout == "imported\n"
        assert box.exec("stat", "-c", "%a", "/bin/busybox").stdout == "755\n"
    names = {n for i in sandlot.list_images(home=home) for n in i.names}
    assert {"docker.io/test/busybox:1", "docker.io/local/bb:tar", "docker.io/local/imported:1"} <= names
    assert sandlot.remove_image("local/bb:tar", home=home) == ["docker.io/local/bb:tar"]  # untag only
    assert sandlot.get_image("test/busybox:1", home=home) is not None
    sandlot.remove_image(imported.id, home=home)
    report = sandlot.prune_images(home=home)
    assert report.blobs_removed >= 2 and report.bytes_freed > 0
    store = sandlot.Runtime.for_home(home).images.store
    assert not store.has_blob(imported.config_digest)  # its own blobs went
    assert store.has_blob(imported.layers[0].digest)  # a layer the legacy image shares stays
    with pytest.raises(sandlot.InvalidArgument):
        sandlot.Box("local/imported:1", home=home, pull="never").start()


def _docker_save_legacy(layout: Path, dest: Path) -> None:
    """Write an image the way `docker save` did before Docker 25."""
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads(
        (layout / "blobs/sha256" / index["manifests"][0]["digest"].split(":")[1]).read_bytes()
    )
    import gzip

    with tarfile.open(dest, "w") as tf:
        cfg = manifest["config"]["digest"].split(":")[1]
        tf.add(layout / "blobs/sha256" / cfg, arcname=f"{cfg}.json")
        layers = []
        for i, layer in enumerate(manifest["layers"]):
            raw = gzip.decompress((layout / "blobs/sha256" / layer["digest"].split(":")[1]).read_bytes())
            p = dest.parent / f"l{i}.tar"
            p.write_bytes(raw)
            tf.add(p, arcname=f"l{i}/layer.tar")
            layers.append(f"l{i}/layer.tar")
        m = json.dumps(
            [{"Config": f"{cfg}.json", "RepoTags": ["legacy/busybox:1"], "Layers": layers}]
        ).encode()
        p = dest.parent / "manifest.json"
        p.write_bytes(m)
        tf.add(p, arcname="manifest.json")


def test_disk_grows_to_disk_size(registry: Registry, home: Path) -> None:
    with sandlot.Box(registry.ref("test/busybox:1"), home=home, disk_size_gb=20, memory_mib=256) as box:
        size_kib = int(box.exec("df", "-k", "/").stdout.splitlines()[1].split()[1])
        assert size_kib > 19 * 1024 * 1024
    base = sandlot.Runtime.for_home(home).images.store.base_path(
        sandlot.get_image(registry.ref("test/busybox:1"), home=home)
    )  # type: ignore[arg-type]
    assert base.stat().st_size < 2 << 30  # one small base per image; boxes grow it


def test_bad_references_and_missing_images(registry: Registry, home: Path) -> None:
    for bad in ("UPPER/case", "a b", "x@sha256:123", "repo:bad tag", "", "-leading"):
        with pytest.raises(sandlot.InvalidArgument):
            sandlot.Box(bad, home=home)
    with pytest.raises(sandlot.ImageError, match="not found"):
        sandlot.pull(registry.ref("test/nope:1"), home=home)
    with pytest.raises(sandlot.InvalidArgument):
        sandlot.Box(home=home)  # neither image nor rootfs


def test_cli_pull_images_run_rmi(registry: Registry, home: Path) -> None:
    env = {**os.environ, "SANDLOT_HOME": str(home)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "sandlot.cli", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    ref = registry.ref("test/busybox:1")
    r = cli("pull", ref)
    assert r.returncode == 0, r.stderr
    r = cli("images")
    assert "test/busybox" in r.stdout and r.returncode == 0
    r = cli("run", ref)  # the image's own command
    assert r.returncode == 0 and r.stdout == "hello from the image\n/work/dir\n0\n"
    r = cli("run", ref, "sh", "-c", "exit 4")
    assert r.returncode == 4
    r = cli("inspect-image", ref)
    assert json.loads(r.stdout)["config"]["labels"] == {"org.example.purpose": "sandlot tests"}
    assert cli("rmi", ref).returncode == 0
    assert "test/busybox" not in cli("images").stdout
    r = cli("run", "--pull", "never", ref)
    assert r.returncode == 125 and "pull" in r.stderr


def test_python_image_from_registry(registry: Registry, debian_root: Path, home: Path) -> None:
    registry.push(python_layout(CACHE, debian_root), "test/python:3")
    with sandlot.Box(registry.ref("test/python:3"), home=home) as box:
        r = box.exec("python3", "-c", "import sys; print(sys.version_info[0] * 14)")
        assert r.stdout == "42\n"
        assert box.exec("stat", "-c", "%U", "/home/agent").stdout == "agent\n"


def test_registry_mirror_serves_docker_hub_names(
    registry: Registry, debian_root: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a mirror for docker.io, ``python:3.12-slim`` comes from the mirror and keeps
    its Docker Hub name (the docs' examples run this way against a local registry)."""
    registry.push(python_layout(CACHE, debian_root), "test/python:3", "library/python:3.12-slim")
    monkeypatch.setenv("SANDLOT_REGISTRY_MIRRORS", f"index.docker.io={registry.host}")
    img = sandlot.pull("python:3.12-slim", home=home)
    assert img.names == ("docker.io/library/python:3.12-slim",)
    assert img.config.cmd == ("python3",)
    assert [i.names for i in sandlot.list_images(home=home)] == [img.names]
    monkeypatch.setenv("SANDLOT_REGISTRY_MIRRORS", "docker.io=127.0.0.1:1")  # a mirror that is down
    with pytest.raises(sandlot.ImageError, match=r"mirror 127\.0\.0\.1:1"):
        sandlot.pull("python:3.11-slim", home=home)


def test_load_checks_layers_at_once_as_pull_does(
    layouts: dict[str, Path], home: Path, tmp_path: Path
) -> None:
    """A hostile layer is refused when the image is loaded (not first when a box is
    made of it), and the image is not listed; a known image loaded under a new name
    is reported under that name."""
    hostile = build_image([layer_tar([E("../../outside/evil", data=b"x")])], cmd=["sh"])
    path = layout(tmp_path / "hostile", [(hostile, "test/hostile:1", "amd64")])
    with pytest.raises(sandlot.ImageError, match=r"contains '\.\.'"):
        sandlot.load_image(path, home=home)
    assert not [i for i in sandlot.list_images(home=home) if "docker.io/test/hostile:1" in i.names]
    env = {**os.environ, "SANDLOT_HOME": str(home)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandlot.cli", *args], capture_output=True, text=True,
                              env=env, timeout=300)  # fmt: skip

    r = cli("load", str(path))
    assert r.returncode != 0 and "contains '..'" in r.stderr
    r = cli("load", str(layouts["busybox"]))
    assert r.returncode == 0 and r.stdout.startswith("docker.io/test/busybox:1 sha256:"), r.stderr
    r = cli("load", str(layouts["busybox"]), "-n", "again/renamed:2")
    assert r.returncode == 0 and r.stdout.startswith("docker.io/again/renamed:2 sha256:"), r.stdout
