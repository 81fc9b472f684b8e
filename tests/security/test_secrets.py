"""Secrets from inside real boxes: a program uses the placeholder it was given, the
HTTPS API (on the host's 127.0.0.1, with a test CA standing in for a public
one) gets the value, and the value is nowhere sandlot keeps a box's state but
the box's secrets file: not in a memory snapshot, a disk layer, the state store,
the egress log or an export."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

import sandlot

from tests.conftest import TEST_ENGINE
from tests.support.checkpoint import plain_state
from tests.support.chunks import state_bytes
from tests.support.egress import logged
from tests.unit.test_secrets import VALUE, EchoAPI

pytestmark = pytest.mark.vm
NO_PROXY_EXEMPTIONS = {"NO_PROXY": "", "no_proxy": ""}

# urllib through HTTPS_PROXY (set in every command's environment); the boxes clear
# NO_PROXY so that 'localhost' is asked of the proxy too
CALL_API = r"""
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1], data=json.dumps({"key": os.environ["API_KEY"]}).encode(),
                             headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
print(urllib.request.urlopen(req, timeout=60).read().decode())
"""


@pytest.fixture(scope="module")
def api(test_ca: Path) -> Iterator[EchoAPI]:
    s = EchoAPI(test_ca)
    yield s
    s.close()


def archived_chunks(archive: Path) -> bytes:
    """The chunks an archive (version 4) carries, uncompressed, one after another."""
    import tarfile

    out = bytearray()
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            if member.name.startswith("chunks/"):
                f = tar.extractfile(member)
                assert f is not None
                out += zstandard.ZstdDecompressor().decompress(f.read())
    return bytes(out)


def files_holding(needle: bytes, *roots: Path, skip: str = "") -> list[str]:
    """The files under ``roots`` that contain ``needle``. Searched by grep in its own
    process: closing any descriptor of sandlot.db in this one would drop this
    process's SQLite locks on it (POSIX locks are per process), and its store would
    go on reading a stale snapshot."""
    args = [
        "grep",
        "-rlaF",
        *([f"--exclude={skip}"] if skip else []),
        "--",
        needle.decode(),
        *map(str, roots),
    ]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr  # 1: found nowhere
    return r.stdout.split()


def test_the_box_sees_a_placeholder_and_the_api_gets_the_value(
    debian_root: Path, api: EchoAPI, test_ca: Path, tmp_path: Path
) -> None:
    url = f"https://localhost:{api.port}/v1/chat"
    secret = sandlot.Secret("API_KEY", VALUE, hosts=[f"localhost:{api.port}"], ca=test_ca / "ca.pem")
    box = sandlot.Box(rootfs=debian_root, engine=TEST_ENGINE, memory_mib=256, network="allowlist",
                      allow=["127.0.0.1"], secrets=[secret], env=NO_PROXY_EXEMPTIONS)  # fmt: skip
    with box:
        placeholder = box.exec("sh", "-c", "echo $API_KEY").stdout.strip()
        assert placeholder.startswith("sandlot-secret-API_KEY-")
        assert box.inspect()["options"]["secrets"][0]["placeholder"] == placeholder
        r = box.exec("python3", "-c", CALL_API, url, timeout=120)
        assert r.returncode == 0, r.stderr
        echoed = json.loads(r.stdout)
        assert api.seen[-1]["authorization"] == f"Bearer {VALUE}"  # swapped in on the way out
        assert json.loads(api.seen[-1]["body"])["key"] == VALUE
        assert echoed["authorization"] == "Bearer " + "*" * len(VALUE)  # masked on the way back
        ca = box.files.read("/etc/sandlot/ca.pem")
        assert ca.startswith(b"-----BEGIN CERTIFICATE-----")
        # a program that ignores HTTPS_PROXY: sandlot's DNS gives it the proxy's address
        # for the API's name, and the proxy routes the connection by its server name
        box.sh("sed -i '/localhost/d' /etc/hosts")  # so that the name goes to DNS
        straight = box.exec(
            "sh", "-c", 'unset HTTPS_PROXY https_proxy; exec python3 -c "$0" "$1"', CALL_API, url
        )
        assert straight.returncode == 0, straight.stderr
        assert json.loads(straight.stdout)["authorization"] == "Bearer " + "*" * len(VALUE)
        assert api.seen[-1]["authorization"] == f"Bearer {VALUE}"
        log = logged(box, lambda log: bool(log) and log[-1].get("transparent") is True)
        assert log[-1].get("transparent") is True and log[-1]["secrets"] == ["API_KEY"], log[-1]
        # a fork can use it: its values come from this box
        box.spawn("sleep", "600")  # a live process whose environment holds the placeholder
        snap = box.snapshot("with-secret")
        kid = box.fork()[0]
        try:
            assert kid.exec("python3", "-c", CALL_API, url, timeout=120).returncode == 0
            assert api.seen[-1]["authorization"] == f"Bearer {VALUE}"
        finally:
            kid.remove(force=True)
        # an image with a system CA bundle (ca-certificates) gets the box's CA appended to it
        system_ca = (test_ca / "ca.pem").read_bytes()
        box.files.write("/etc/ssl/certs/ca-certificates.crt", system_ca)
        box.files.remove("/etc/sandlot/ca.pem")  # as on a disk that never had it
        box.restart()
        bundle = box.files.read("/etc/ssl/certs/ca-certificates.crt")
        assert bundle.startswith(system_ca) and bundle.endswith(ca) and bundle.count(ca) == 1
        assert box.files.read("/etc/sandlot/ca-bundle.pem") == bundle
        exported = snap.export(tmp_path / "snap.tar.zst")
        home = Path(box.inspect()["paths"]["dir"]).parents[1]
        snap_dir = Path(snap.inspect()["path"])
        # nowhere but the secrets file
        plain = tmp_path / "snap.tar"
        with open(exported, "rb") as src, open(plain, "wb") as dst:
            zstandard.ZstdDecompressor().copy_stream(src, dst)
        where = files_holding(
            VALUE.encode(), home / "boxes", home / "layers", snap_dir, plain,
            *home.glob("sandlot.db*"), skip="secrets.json",
        )  # fmt: skip
        assert where == []
        # the saved state does hold what the guest had: the placeholder (the search works),
        # in its chunks, searched uncompressed (a gVisor checkpoint's state is kept inflated)
        state = state_bytes(snap.id)
        assert VALUE.encode() not in state
        assert placeholder.encode() in state
        if TEST_ENGINE == "gvisor":  # its export (whole) carries the checkpoint, as runsc reads it
            carried = plain_state(snap_dir / "checkpoint.img")
        else:  # its export carries its chunks
            carried = archived_chunks(plain)
        assert VALUE.encode() not in carried and placeholder.encode() in carried
        box_id = box.id
    # a new box from the snapshot, its box gone: the values must be given again
    with pytest.raises(sandlot.InvalidArgument, match="API_KEY"):
        snap.start()
    assert all(b.id != box_id for b in sandlot.Box.list())
    kid = sandlot.Box(template=snap, secrets=[secret], env=NO_PROXY_EXEMPTIONS)
    with kid:
        assert kid.exec("sh", "-c", "echo $API_KEY").stdout.strip() == placeholder  # the state's own
        assert kid.exec("python3", "-c", CALL_API, url, timeout=120).returncode == 0
    snap.remove()
