"""The files API against a real guest: streamed read/write, metadata, typed errors."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot import Box
from sandlot.api import loop, tarstream

from tests.conftest import TEST_ENGINE

pytestmark = pytest.mark.vm


def test_write_read_roundtrip(bb_box: Box) -> None:
    assert bb_box.files.write("/home/agent/notes.txt", "hello") == 5
    assert bb_box.files.read("/home/agent/notes.txt") == b"hello"
    assert bb_box.files.read_text("/home/agent/notes.txt") == "hello"
    assert bb_box.exec("cat", "/home/agent/notes.txt").stdout == "hello"
    # parents are created; binary content survives
    blob = bytes(range(256)) * 1000
    bb_box.files.write("/srv/a/b/c.bin", blob, mode=0o600)
    assert bb_box.files.read("/srv/a/b/c.bin") == blob
    info = bb_box.files.stat("/srv/a/b/c.bin")
    assert (info.type, info.size, info.mode, info.uid) == ("file", len(blob), 0o600, 0)
    # append, and ranges
    bb_box.files.write("/srv/log", "a")
    bb_box.files.write("/srv/log", "bc", append=True)
    assert bb_box.files.read("/srv/log") == b"abc"
    assert b"".join(bb_box.files.iter_read("/srv/a/b/c.bin", offset=256, length=4)) == bytes(range(4))
    bb_box.files.remove("/srv", recursive=True)


def test_write_keeps_mode_and_owner_and_sets_user(bb_box: Box) -> None:
    bb_box.files.write("/home/agent/own.txt", "x", user="agent", mode=0o640)
    info = bb_box.files.stat("/home/agent/own.txt")
    assert (info.uid, info.gid, info.mode) == (1000, 1000, 0o640)
    bb_box.files.write("/home/agent/own.txt", "replaced")  # an overwrite keeps mode and owner
    info = bb_box.files.stat("/home/agent/own.txt")
    assert (info.uid, info.gid, info.mode, info.size) == (1000, 1000, 0o640, 8)
    assert bb_box.exec("sh", "-c", "echo more >> /home/agent/own.txt", user="agent").ok
    with pytest.raises(FileExistsError):
        bb_box.files.write("/home/agent/own.txt", "no", exclusive=True)
    bb_box.files.remove("/home/agent/own.txt")


def test_list_stat_mkdir_rename_chmod_chown(bb_box: Box) -> None:
    f = bb_box.files
    f.mkdir("/work/x/y")
    f.write("/work/x/file", "1")
    bb_box.exec("ln", "-s", "/work/x/file", "/work/x/link")
    names = {e.name: e for e in f.list("/work/x")}
    assert set(names) == {"y", "file", "link"}
    assert names["y"].is_dir and names["file"].is_file and names["link"].is_symlink
    assert names["link"].link_target == "/work/x/file"
    assert f.stat("/work/x/link").is_file  # follows
    assert f.stat("/work/x/link", follow_symlinks=False).is_symlink
    f.rename("/work/x/file", "/work/x/renamed")
    assert f.exists("/work/x/renamed") and not f.exists("/work/x/file")
    f.chmod("/work/x/renamed", 0o751)
    assert f.stat("/work/x/renamed").mode == 0o751
    f.chown("/work/x/renamed", "agent:users")
    info = f.stat("/work/x/renamed")
    assert (info.uid, info.gid) == (1000, 100)
    f.mkdir("/work/x/y", parents=True)  # exists: fine with parents
    with pytest.raises(FileExistsError):
        f.mkdir("/work/x/y", parents=False)
    with pytest.raises(sandlot.GuestDirectoryNotEmpty):
        f.remove("/work/x")
    f.remove("/work", recursive=True)
    assert not f.exists("/work")
    f.remove("/work", missing_ok=True)


def test_extended_attributes_of_a_prefix_are_read_with_stat_and_list_and_replaced_whole(bb_box: Box) -> None:
    f = bb_box.files
    if TEST_ENGINE == "gvisor":  # its root (a gofer's mount) keeps none; its tmpfs ones do
        f.write("/xattr-root.txt", "a")
        with pytest.raises(sandlot.InvalidArgument, match="keeps no extended attributes"):
            f.set_xattrs("/xattr-root.txt", {"user.app.a": "1"}, prefix="user.app.")
        f.remove("/xattr-root.txt")
    top = "/tmp/xattr-test" if TEST_ENGINE == "gvisor" else "/xattr-test"
    f.write(f"{top}/a.txt", "a")
    f.write(f"{top}/b.txt", "b")
    f.set_xattrs(f"{top}/a.txt", {"user.app.owner": "me", "user.app.note": "caf\u00e9"}, prefix="user.app.")
    f.set_xattrs(f"{top}/a.txt", {"user.other.keep": "yes"}, prefix="user.other.")
    assert f.stat(f"{top}/a.txt", xattrs="user.app.").xattrs == {
        "user.app.owner": "me",
        "user.app.note": "caf\u00e9",
    }
    assert f.stat(f"{top}/a.txt", xattrs="user.").xattrs == {
        "user.app.owner": "me", "user.app.note": "caf\u00e9", "user.other.keep": "yes"}  # fmt: skip
    f.set_xattrs(f"{top}/a.txt", {"user.app.owner": "you"}, prefix="user.app.")  # the note goes
    listed = {e.name: e.xattrs for e in f.list(top, xattrs="user.app.")}
    assert listed == {"a.txt": {"user.app.owner": "you"}, "b.txt": {}}
    assert f.stat(f"{top}/a.txt", xattrs="user.other.").xattrs == {"user.other.keep": "yes"}
    f.rename(f"{top}/a.txt", f"{top}/c.txt")  # they go with the file
    assert f.stat(f"{top}/c.txt", xattrs="user.app.").xattrs == {"user.app.owner": "you"}
    f.write(f"{top}/c.txt", "new")  # written whole: a new file, none of the old's
    assert f.stat(f"{top}/c.txt", xattrs="user.").xattrs == {}
    with pytest.raises(sandlot.InvalidArgument):
        f.set_xattrs(f"{top}/c.txt", {"user.x": "1"}, prefix="user.app.")
    with pytest.raises(FileNotFoundError):
        f.set_xattrs(f"{top}/nope", {}, prefix="user.app.")
    f.remove(top, recursive=True)


def test_large_directory_listing(bb_box: Box) -> None:
    bb_box.exec("sh", "-c", "mkdir -p /tmp/many && cd /tmp/many && for i in $(seq 1 3000); do : > f$i; done")
    entries = bb_box.files.list("/tmp/many")
    assert len(entries) == 3000
    bb_box.files.remove("/tmp/many", recursive=True)


def test_errors_are_typed(bb_box: Box) -> None:
    f = bb_box.files
    with pytest.raises(FileNotFoundError):
        f.read("/nope")
    with pytest.raises(sandlot.GuestFileNotFoundError):
        f.stat("/nope/deeper")
    with pytest.raises(IsADirectoryError):
        f.read("/etc")
    with pytest.raises(IsADirectoryError):
        f.write("/etc", "x")
    with pytest.raises(NotADirectoryError):
        f.list("/etc/passwd")
    with pytest.raises(NotADirectoryError):
        f.write("/etc/passwd/child", "x")
    with pytest.raises(sandlot.InvalidArgument):
        f.read("relative/path")
    with pytest.raises(sandlot.InvalidArgument):
        f.write("/bad\0path", "x")
    with pytest.raises(sandlot.InvalidArgument):
        f.chmod("/etc/passwd", 0o17777)
    with pytest.raises(sandlot.GuestError, match="unknown user"):
        f.chown("/etc/passwd", "nobody-here")
    with pytest.raises(PermissionError):  # EPERM inside the guest, as a guest error
        f.chmod("/proc/1/status", 0o777)
    # Linux's procfs says ENOENT to a new file beside /proc/version, gVisor's EPERM:
    # either way a typed error naming the temporary file
    with pytest.raises((FileNotFoundError, PermissionError), match="temporary file beside"):
        f.write("/proc/version", "x")
    assert f.read("/etc/hostname")  # the box is fine


def test_100mb_roundtrip_with_checksum(bb_box: Box, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    block = os.urandom(1 << 20)
    with open(src, "wb") as out:
        for i in range(100):
            out.write(hashlib.sha256(block + bytes([i])).digest() * (1 << 15))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    assert bb_box.files.upload(src, "/var/big.bin") == 100 << 20
    assert bb_box.exec("sha256sum", "/var/big.bin").stdout.split()[0] == digest
    back = tmp_path / "back.bin"
    assert bb_box.files.download("/var/big.bin", back) == 100 << 20
    assert hashlib.sha256(back.read_bytes()).hexdigest() == digest
    bb_box.files.remove("/var/big.bin")


def test_upload_download_tree_and_modes(bb_box: Box, tmp_path: Path) -> None:
    tree = tmp_path / "proj"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "main.py").write_text("print('hi')\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    bb_box.files.upload(tree, "/opt/proj", user="agent")
    assert bb_box.exec("/opt/proj/run.sh").stdout == "ran\n"
    assert bb_box.files.stat("/opt/proj/src/main.py").uid == 1000
    out = tmp_path / "main.py"
    bb_box.files.download("/opt/proj/src/main.py", out)
    assert out.read_text() == "print('hi')\n"
    bb_box.files.remove("/opt/proj", recursive=True)


def test_new_files_get_0644_and_root(bb_box: Box) -> None:
    bb_box.files.write("/tmp/new.txt", "x")
    info = bb_box.files.stat("/tmp/new.txt")
    assert (info.mode, info.uid, info.gid) == (0o644, 0, 0)
    bb_box.files.remove("/tmp/new.txt")


# -- trees, as docker cp moves them: hostile ones both ways ------------------------------------------

SECRET = "host-secret-never-in-a-box"


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 1 << 16):
        yield data[i : i + (1 << 16)]


def _put_tar(box: Box, path: str, data: bytes) -> dict[str, Any]:
    """A raw tar stream into the box, as the archive route and the fleet hand one over."""
    a = box.files._a
    return loop.run(a._backend.put_archive(a._ref, path, _chunks(data), user=None))


def _tar(*members: tuple[str, str, Any]) -> bytes:
    """Members (kind, name, data or link target): kind "f", "d", "l" (symbolic), "h" (hard)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for kind, name, arg in members:
            info = tarfile.TarInfo(name)
            if kind == "f":
                info.size = len(arg)
                t.addfile(info, io.BytesIO(arg))
                continue
            info.type = {"d": tarfile.DIRTYPE, "l": tarfile.SYMTYPE, "h": tarfile.LNKTYPE}[kind]
            info.linkname = arg or ""
            t.addfile(info)
    return buf.getvalue()


def _box_state(box: Box, *roots: str) -> str:
    """Every path under ``roots`` in the box, with its type, target or content's sum."""
    script = (
        "for r in " + " ".join(roots) + "; do [ -e $r ] || [ -L $r ] || continue; find $r | sort | "
        'while read p; do if [ -L "$p" ]; then echo "$p -> $(readlink "$p")"; elif [ -f "$p" ]; '
        'then echo "$p $(md5sum < "$p")"; else echo "$p"; fi; done; done'
    )
    return box.exec("sh", "-c", script).stdout


def _host_tree(tmp: Path) -> Path:
    secret = tmp / "secret.txt"
    secret.write_text(SECRET)
    src = tmp / "proj"
    (src / "venv" / "bin").mkdir(parents=True)
    (src / "main.py").write_text("print('main')\n")
    (src / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    (src / "venv" / "m").symlink_to("../main.py")
    (src / "key").symlink_to(secret)
    (src / "escape").symlink_to("../secret.txt")
    (src / "etc").symlink_to("/etc")
    os.link(src / "main.py", src / "hard.py")
    os.mkfifo(src / "fifo")
    return src


def test_upload_keeps_links_as_links_and_reads_nothing_outside_the_tree(bb_box: Box, tmp_path: Path) -> None:
    """The issue's venv: a link to the host's python must not bring the host's python in,
    nor a link to a key the key (upload once followed links)."""
    src = _host_tree(tmp_path)
    f = bb_box.files
    try:
        f.upload(src, "/up")
        out = bb_box.exec(
            "sh",
            "-c",
            "cd /up && for l in venv/bin/python venv/m key escape etc; do readlink $l; done && "
            "[ -p fifo ] && echo fifo && [ $(stat -c %i main.py) = $(stat -c %i hard.py) ] && echo linked && "
            "find / -xdev -type f -newer /up/main.py 2>/dev/null | xargs cat 2>/dev/null; "
            "find /up -type f | xargs cat",
        ).stdout
        lines = out.split("\n")
        assert lines[:7] == [
            "/usr/bin/python3",
            "../main.py",
            str(tmp_path / "secret.txt"),
            "../secret.txt",
            "/etc",
            "fifo",
            "linked",
        ]
        assert SECRET not in out
        with pytest.raises(sandlot.TransferError) as caught:  # follows only inside the tree when asked
            f.upload(src, "/up2", follow_symlinks=True)
        assert caught.value.entry in ("escape", "etc") and caught.value.side == "host"
        assert not f.exists("/up2")
        (src / "escape").unlink()
        (src / "etc").unlink()
        (src / "venv" / "bin" / "python").unlink()
        f.upload(src, "/up2", follow_symlinks=True, follow_outside=[tmp_path / "secret.txt"])
        assert f.read_text("/up2/key") == SECRET and f.read_text("/up2/venv/m") == "print('main')\n"
    finally:
        f.remove("/up", recursive=True, missing_ok=True)
        f.remove("/up2", recursive=True, missing_ok=True)


def test_download_keeps_links_as_links_and_writes_nothing_outside(bb_box: Box, tmp_path: Path) -> None:
    """The issue's other half: a box's virtualenv (an absolute link) and a link out of the
    tree download as links; a fifo with a writer waiting on it is never opened."""
    bb_box.exec(
        "sh",
        "-c",
        "mkdir -p /tree/venv/bin /outside && echo box-secret > /outside/secret && cd /tree && "
        "echo hi > main.py && ln -s /usr/bin/python3 venv/bin/python && ln -s ../main.py venv/m && "
        "ln -s /etc/passwd pw && ln -s ../outside/secret esc && ln main.py hard.py && mkfifo fifo && "
        "ln -s " + str(tmp_path / "host-file") + " to-host",
    )
    (tmp_path / "host-file").write_text("the host's, untouched")
    bb_box.exec("sh", "-c", "(echo x > /tree/fifo; touch /tmp/fifo-opened) >/dev/null 2>&1 &")
    out = tmp_path / "down"
    try:
        bb_box.files.download("/tree", out)
        assert os.readlink(out / "venv" / "bin" / "python") == "/usr/bin/python3"
        assert os.readlink(out / "venv" / "m") == "../main.py" and os.readlink(out / "pw") == "/etc/passwd"
        assert os.readlink(out / "esc") == "../outside/secret"
        assert os.readlink(out / "to-host") == str(tmp_path / "host-file")
        assert (out / "main.py").stat().st_ino == (out / "hard.py").stat().st_ino
        assert stat.S_ISFIFO((out / "fifo").lstat().st_mode)
        assert not bb_box.files.exists("/tmp/fifo-opened"), "the fifo was opened"
        assert (tmp_path / "host-file").read_text() == "the host's, untouched"
        assert all(
            b"box-secret" not in p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.is_symlink()
        )
        # into a destination that is there: merged as docker cp merges, never through a link
        (tmp_path / "merge").mkdir()
        (tmp_path / "merge" / "venv").symlink_to(tmp_path / "elsewhere")
        with pytest.raises(sandlot.TransferError) as caught:
            bb_box.files.download("/tree", tmp_path / "merge")
        assert caught.value.entry == "venv" and not (tmp_path / "elsewhere").exists()
        assert sorted(os.listdir(tmp_path / "merge")) == ["venv"]
    finally:
        bb_box.exec("sh", "-c", "cat /tree/fifo >/dev/null; rm -rf /tree /outside /tmp/fifo-opened")


def test_hostile_archives_are_refused_by_name_in_the_box(bb_box: Box) -> None:
    """What a raw tar (the archive route, a fleet node) may hold that would write through
    a link, or out of the destination: refused by name, nothing written anywhere."""
    cases = {
        "link-then-file": (_tar(("l", "a", "/outside"), ("f", "a/passwd", b"pwned")), "a/passwd"),
        "relative-link-then-file": (
            _tar(("l", "a", "../../outside"), ("f", "a/passwd", b"pwned")),
            "a/passwd",
        ),
        "link-to-itself": (_tar(("l", "a", "."), ("f", "a/a/x", b"pwned")), "a/a/x"),
        "hardlink-absolute": (_tar(("h", "h", "/outside/passwd")), "h"),
        "hardlink-escaping": (_tar(("h", "h", "../../outside/passwd")), "h"),
        "hardlink-through-a-link": (_tar(("l", "a", "/outside"), ("h", "h", "a/passwd")), "h"),
        "dotdot": (_tar(("f", "../../outside/evil", b"pwned")), "../../outside/evil"),
        "absolute": (_tar(("f", "/outside/evil", b"pwned")), "/outside/evil"),
        "too-long": (_tar(("f", "ok", b"x"), ("f", "n" * 300, b"x")), "n" * 300),
    }
    bb_box.exec(
        "sh",
        "-c",
        "mkdir -p /outside /hostile/there/a && echo root:x:0:0 > /outside/passwd && "
        "echo kept > /hostile/there/kept",
    )
    before = _box_state(bb_box, "/outside", "/hostile")
    try:
        for name, (data, entry) in cases.items():
            for dest in (f"/hostile/new-{name}", "/hostile/there"):
                with pytest.raises(sandlot.TransferError) as caught:
                    _put_tar(bb_box, dest, data)
                    print(name, dest, "was not refused")
                assert (caught.value.entry, caught.value.side) == (entry, "box"), name
                assert _box_state(bb_box, "/outside", "/hostile") == before, name
    finally:
        bb_box.exec("rm", "-rf", "/outside", "/hostile")


def _many(root: Path) -> str:
    for i in range(100):
        (root / "wide" / f"{i:03}").mkdir(parents=True)
        for j in range(100):
            (root / "wide" / f"{i:03}" / f"f{j}").write_bytes(b"%d.%d" % (i, j))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # a path longer than PATH_MAX, by descriptor
    part = "d" * 250
    for _ in range(20):
        os.mkdir(part, dir_fd=fd)
        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    leaf = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(leaf, b"deep")
    os.close(leaf)
    os.close(fd)
    return "/".join([part] * 20 + ["leaf.txt"])


def test_ten_thousand_files_and_names_longer_than_path_max_both_ways(bb_box: Box, tmp_path: Path) -> None:
    src = tmp_path / "src"
    deep = _many(src)
    size = sum(len(b"%d.%d" % (i, j)) for i in range(100) for j in range(100)) + 4
    try:
        assert bb_box.files.upload(src, "/many") == size
        assert bb_box.exec("sh", "-c", "find /many/wide -type f | wc -l").stdout.strip() == "10000"
        # the deep leaf (busybox's find and sh stop at PATH_MAX): read back by the download below
        assert bb_box.exec("sh", "-c", "cat /many/wide/042/f7").stdout == "42.7"
        back = tmp_path / "back"
        assert bb_box.files.download("/many", back) == size
        assert sum(len(files) for _, _, files in os.walk(back / "wide")) == 10_000
        fd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)
        for part in deep.split("/")[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open("leaf.txt", os.O_RDONLY, dir_fd=fd)
        assert os.read(leaf, 10) == b"deep"
        os.close(leaf)
        os.close(fd)
    finally:
        bb_box.files.remove("/many", recursive=True, missing_ok=True)


def test_a_tree_changing_as_it_is_read_is_whole_or_refused_by_name(bb_box: Box, tmp_path: Path) -> None:
    """In the box a directory is swapped for a link to outside and back while downloads
    run, and a file shrinks as it is read: each copy is whole or refused by name, the
    secret outside is never read, and a refused copy leaves nothing."""
    a = bb_box._a
    bb_box.exec(
        "sh",
        "-c",
        "mkdir -p /chg/d /outside && echo box-secret > /outside/secret && echo in > /chg/d/f && "
        "dd if=/dev/zero of=/chg/zz-big.bin bs=1 count=0 seek=1073741824 2>/dev/null",
    )

    async def cut(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        first = True
        async for chunk in chunks:
            yield chunk
            if first:
                await a.exec("sh", "-c", ": > /chg/zz-big.bin")
                first = False

    async def shrinking() -> None:
        await tarstream.unpack(cut(a.files._backend.get_archive(a.files._ref, "/chg")), tmp_path / "shrunk")

    try:
        with pytest.raises(sandlot.TransferError) as caught:
            loop.run(shrinking())
        assert (caught.value.entry, caught.value.side) == ("zz-big.bin", "box") and "changed" in str(
            caught.value
        )
        assert not (tmp_path / "shrunk").exists()
        assert [p for p in tmp_path.iterdir() if "sandlot-incoming" in p.name] == []
        bb_box.exec("rm", "/chg/zz-big.bin")
        churn = bb_box.spawn(
            "sh",
            "-c",
            "while :; do mv /chg/d /chg/d.dir; ln -s /outside /chg/d; rm /chg/d; mv /chg/d.dir /chg/d; "
            "usleep 2000; done",
        )
        outcomes = []
        try:
            for k in range(6):
                dest = tmp_path / "dl" / str(k)
                try:
                    bb_box.files.download("/chg", dest)
                    outcomes.append("whole")
                except (sandlot.TransferError, FileNotFoundError) as e:
                    outcomes.append(f"refused {getattr(e, 'entry', '')}")
                    assert not dest.exists()
        finally:
            churn.kill()
        for dest in (tmp_path / "dl").iterdir():
            for p in dest.rglob("*"):
                assert p.is_symlink() or not p.is_file() or b"box-secret" not in p.read_bytes()
                if p.name == "d":
                    assert p.is_dir() or os.readlink(p) == "/outside"
        assert "whole" in outcomes
    finally:
        bb_box.exec("rm", "-rf", "/chg", "/chg/d.dir", "/outside")


@pytest.mark.skipif(os.geteuid() != 0, reason="a device node on this host is made by root")
def test_fifos_and_device_nodes_are_made_where_the_box_allows_them(bb_box: Box, tmp_path: Path) -> None:
    """A microVM makes both; gVisor makes the fifo and leaves the device out, said in a
    TransferWarning. Neither is opened on the way."""
    src = tmp_path / "devs"
    src.mkdir()
    os.mknod(src / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(src / "fifo")
    (src / "after.txt").write_text("after")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            bb_box.files.upload(src, "/devs")
        out = bb_box.exec(
            "sh", "-c", "[ -p /devs/fifo ] && echo fifo; [ -c /devs/null ] && echo null; cat /devs/after.txt"
        ).stdout
        skipped = [str(w.message) for w in said if issubclass(w.category, sandlot.TransferWarning)]
        if "null" in out.split():
            assert out == "fifo\nnull\nafter" and not skipped
        else:  # gVisor: no device nodes in a sandbox
            assert out == "fifo\nafter" and len(skipped) == 1 and "'null'" in skipped[0], (out, skipped)
    finally:
        bb_box.files.remove("/devs", recursive=True, missing_ok=True)
