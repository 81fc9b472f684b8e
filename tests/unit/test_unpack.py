"""Layer unpacking: OCI semantics (whiteouts, opaque dirs, links, modes, xattrs,
devices) and hostile layers, one crafted tarball per attack. No VM needed:
the result is checked in the staging tree and in the ext4 image with debugfs."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

import sandlot
from sandlot.images.rootfs import make_ext4
from sandlot.images.unpack import LayerApplier, run_debugfs

from tests.support.images import MULTI_LAYER_2, MULTI_LAYER_3, E, layer_tar


def apply(root: Path, *layers: bytes) -> LayerApplier:
    applier = LayerApplier(root)
    for layer in layers:
        applier.apply(io.BytesIO(layer))
    applier.finish()
    return applier


@pytest.fixture
def box(tmp_path: Path) -> tuple[Path, Path]:
    """(root, outside): the unpack root and a sibling directory nothing may touch."""
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("original")
    return root, outside


def untouched(outside: Path) -> bool:
    return sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_text() == "original"


def test_oci_semantics(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    base = layer_tar([E("bin/", tarfile.DIRTYPE, mode=0o755), E("bin/sh", data=b"sh", mode=0o755)])
    applier = apply(root, base, layer_tar(MULTI_LAYER_2), layer_tar(MULTI_LAYER_3))
    assert not (root / "etc/a").exists()  # whiteout
    assert sorted(os.listdir(root / "data/old")) == ["z"]  # opaque hid x and y, kept z of the same layer
    assert (root / "data/new.txt").read_bytes() == b"new"
    assert os.stat(root / "srv/hard1").st_ino == os.stat(root / "srv/hard2").st_ino
    assert os.readlink(root / "srv/link") == "/srv/owned.txt"
    assert stat.S_IMODE(os.stat(root / "usr/local/bin/suid-tool").st_mode) == 0o4755
    assert not (root / "opt/devnull").exists()  # never a device node on the host
    assert "opt/devnull" in applier.devices
    assert applier.meta["srv/owned.txt"].uid == 1000 and applier.meta["srv/shared"].mode & 0o2000


def test_whiteout_only_hides_lower_layers(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    lower = layer_tar([E("keep", data=b"lower")])
    same_layer = layer_tar([E("new", data=b"mine"), E(".wh.new"), E(".wh.keep")])
    apply(root, lower, same_layer)
    assert (root / "new").read_bytes() == b"mine" and not (root / "keep").exists()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([E("/etc/evil", data=b"x")], "absolute path"),
        ([E("../../outside/evil", data=b"x")], r"contains '\.\.'"),
        ([E("a/../../evil", data=b"x")], r"contains '\.\.'"),
        ([E("hl", tarfile.LNKTYPE, linkname="../outside/victim")], r"contains '\.\.'"),
        ([E("hl", tarfile.LNKTYPE, linkname="etc/missing")], "not in the image"),
        ([E("x/.wh...")], r"'\.\.'|invalid whiteout"),
        ([E("bad\nname", data=b"x")], "control characters"),
    ],
)
def test_hostile_names_are_refused(box: tuple[Path, Path], entries: list[E], message: str) -> None:
    root, outside = box
    with pytest.raises(sandlot.ImageError, match=message):
        apply(root, layer_tar(entries))
    assert untouched(outside)


def test_writes_through_symlinks_stay_inside(box: tuple[Path, Path]) -> None:
    root, outside = box
    evil = layer_tar(
        [
            E("abs", tarfile.SYMTYPE, linkname=str(outside)),  # absolute, to the host's directory
            E("rel", tarfile.SYMTYPE, linkname="../../../../" + str(outside).lstrip("/")),
            E("abs/pwned", data=b"x"),
            E("rel/pwned2", data=b"x"),
            E("abs/victim", data=b"overwritten?"),
        ]
    )
    apply(root, evil)
    assert untouched(outside)
    # followed as the guest would: inside the image
    inside = root / str(outside).lstrip("/")
    assert (inside / "pwned").read_bytes() == b"x" and (inside / "pwned2").read_bytes() == b"x"


def test_symlink_replacing_a_file_is_not_followed(box: tuple[Path, Path]) -> None:
    root, outside = box
    layer = layer_tar([E("f", tarfile.SYMTYPE, linkname=str(outside / "victim")), E("f", data=b"replaced")])
    apply(root, layer)
    assert untouched(outside) and (root / "f").read_bytes() == b"replaced"


def test_hardlink_through_symlink_to_outside(box: tuple[Path, Path]) -> None:
    root, outside = box
    layer = layer_tar(
        [E("out", tarfile.SYMTYPE, linkname=str(outside)), E("hl", tarfile.LNKTYPE, linkname="out/victim")]
    )
    with pytest.raises(sandlot.ImageError, match="not in the image"):
        apply(root, layer)
    assert untouched(outside)


def test_devices_and_owners_land_in_the_disk_image(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    applier = apply(root, layer_tar(MULTI_LAYER_2))
    image = tmp_path / "disk.ext4"
    make_ext4(root, image, 64 << 20)
    run_debugfs(image, applier.fixups(tmp_path))
    dev = _debugfs_stat(image, "/opt/devnull")
    assert "Type: character special" in dev and "Device major/minor number: 01:03" in dev
    owned = _debugfs_stat(image, "/srv/owned.txt")
    assert "User:  1000   Group:  1000" in owned and "Mode:  0640" in owned
    assert "Mode:  04755" in _debugfs_stat(image, "/usr/local/bin/suid-tool")
    assert "Mode:  02775" in _debugfs_stat(image, "/srv/shared")
    ea = subprocess.run(
        ["debugfs", "-R", "ea_list /srv/xattr.txt", str(image)], capture_output=True, text=True
    )
    assert "user.sandlot" in ea.stdout and "yes" in ea.stdout


def _debugfs_stat(image: Path, path: str) -> str:
    return subprocess.run(
        ["debugfs", "-R", f"stat {path}", str(image)], capture_output=True, text=True
    ).stdout


def test_unprivileged_unpack_keeps_owners(request: pytest.FixtureRequest) -> None:
    """As an ordinary user (here: nobody), owners, modes and devices still come out exact.
    nobody runs a copy of sandlot's package in a directory of its own, with the base
    interpreter: the checkout and its .venv may be where nobody cannot enter (a clone in
    /root, mode 0700 on Debian, or under a mktemp -d folder)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    python = os.path.realpath(sys.executable)  # the venv's python is a link inside the checkout
    probe = subprocess.run([*nobody, python, "-c", "pass"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot run {python} (it lies where nobody cannot enter): {probe.stderr.strip()}")
    work = Path(tempfile.mkdtemp(prefix="sandlot-unpriv-"))  # pytest's tmp is private to root
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    (work / "layer.tar").write_bytes(layer_tar(MULTI_LAYER_2))
    # what the script imports is sandlot's own code and the standard library (sandlot's
    # package loads its parts lazily)
    shutil.copytree(Path(sandlot.__file__).parent, work / "lib" / "sandlot",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    os.chown(work, 65534, 65534)
    os.chown(work / "layer.tar", 65534, 65534)
    script = (
        "import io, sys\n"
        "from pathlib import Path\n"
        "from sandlot.images.unpack import LayerApplier, run_debugfs\n"
        "from sandlot.images.rootfs import make_ext4\n"
        "w = Path(sys.argv[1]); root = w / 'root'; root.mkdir()\n"
        "a = LayerApplier(root); a.apply(io.BytesIO((w / 'layer.tar').read_bytes())); a.finish()\n"
        "assert not a.privileged\n"
        "make_ext4(root, w / 'disk.ext4', 64 << 20)\n"
        "run_debugfs(w / 'disk.ext4', a.fixups(w))\n"
    )
    env = {**os.environ, "HOME": str(work), "PYTHONPATH": str(work / "lib")}
    proc = subprocess.run([*nobody, python, "-c", script, str(work)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    image = work / "disk.ext4"
    owned = _debugfs_stat(image, "/srv/owned.txt")
    assert "User:  1000   Group:  1000" in owned and "Mode:  0640" in owned
    assert "User:     0   Group:     0" in _debugfs_stat(image, "/usr/local/bin/suid-tool")
    assert "Mode:  04755" in _debugfs_stat(image, "/usr/local/bin/suid-tool")
    assert "Device major/minor number: 01:03" in _debugfs_stat(image, "/opt/devnull")


def test_prune_keeps_the_bases_of_roots_a_box_used_lately(tmp_path: Path) -> None:
    """A base made from a root directory is the cache of its next box: `prune_images`
    with ``unused_for`` keeps the ones a box started from in that time, and takes the rest."""
    from sandlot.images.rootfs import base_for, rootfs_dir_for

    home = tmp_path / "home"
    bases = home / "bases"
    roots = {}
    for name in ("recent", "stale", "stale-dir"):
        roots[name] = tmp_path / name
        (roots[name] / "etc").mkdir(parents=True)
        (roots[name] / "etc" / "hostname").write_text(name)
    recent = base_for(bases, roots["recent"])
    stale = base_for(bases, roots["stale"])
    stale_dir = rootfs_dir_for(bases, roots["stale-dir"])
    two_days_ago = time.time() - 2 * 86400
    for made in (recent, stale, stale_dir):
        os.utime(made, (two_days_ago, two_days_ago))
    assert base_for(bases, roots["recent"]) == recent  # a box starts from it: its last use is now

    report = sandlot.prune_images(home=home, unused_for=86400)
    assert report.bases_removed == 2 and recent.name in report.kept_bases and report.bytes_freed > 0
    assert recent.exists() and not stale.exists() and not stale_dir.exists()
    assert sandlot.prune_images(home=home).bases_removed == 1 and not recent.exists()
    with pytest.raises(sandlot.InvalidArgument, match="unused_for"):
        sandlot.prune_images(home=home, unused_for=-1)
