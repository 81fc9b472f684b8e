"""E2B's face of the server in the fast tier: E2B's own Python SDK against the server's
application served in this process over the fake engine (its agent speaks the real
wire protocol), and the Connect protocol's edges with a plain HTTP client. The same
SDK against a real ``sandlot serve`` and real VMs is tests/vm/test_e2b.py."""

from __future__ import annotations

import gzip
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import ALL_TRAFFIC, CommandExitException, FileType, NotFoundException, Sandbox, SandboxQuery

import sandlot
from sandlot.api import access
from sandlot.server.e2b import messages as pb
from sandlot.server.e2b import protobuf

from tests.support.fake_engine import fake_rootfs, register
from tests.support.inproc import InProcess, serving


@pytest.fixture(scope="module")
def face(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The in-process server, an E2B-form key, a template of the fake engine, and the
    SDK's options that point it at the server (given to each call: the tests of other
    modules share this process, so its environment is left alone)."""
    register()
    tmp = tmp_path_factory.mktemp("e2b")
    home = tmp / "home"
    root = fake_rootfs(tmp)
    with serving(home) as srv:
        key = srv.key("e2b", admin=True, e2b=True)
        sandlot.template(rootfs=str(root), name="fake-tpl", memory_mib=256, engine="fake", home=home)
        opts = {"api_key": key, "api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b"}
        yield {"srv": srv, "key": key, "home": home, "opts": opts}


@pytest.fixture
def sbx(face: dict[str, Any]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create("fake-tpl", **face["opts"])
    yield sandbox
    sandbox.kill()


def test_a_key_in_e2b_form_works_on_both_faces(face: dict[str, Any]) -> None:
    srv: InProcess = face["srv"]
    key: str = face["key"]
    assert key.startswith("e2b_") and len(key) == 76
    assert httpx.get(f"{srv.url}/v1/boxes", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    bad = key[:-1] + ("0" if key[-1] != "0" else "1")
    r = httpx.get(f"{srv.url}/e2b/sandboxes", headers={"X-API-Key": bad})
    assert r.status_code == 401 and r.json()["code"] == 401


def test_create_get_list_and_kill(face: dict[str, Any]) -> None:
    opts = face["opts"]
    sandbox = Sandbox.create("fake-tpl", metadata={"who": "unit"}, envs={"A": "1"}, timeout=120, **opts)
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id and info.metadata == {"who": "unit"}
    assert info.template_id == "fake-tpl" and info.state.value == "running"
    assert 100 < info.end_at.timestamp() - info.started_at.timestamp() < 200
    found = Sandbox.list(query=SandboxQuery(metadata={"who": "unit"}), **opts).next_items()
    assert [s.sandbox_id for s in found] == [sandbox.sandbox_id]
    assert sandbox.is_running()
    assert sandbox.kill() is True
    assert not sandbox.is_running()
    assert Sandbox.kill(sandbox.sandbox_id, **opts) is False
    with pytest.raises(NotFoundException):
        Sandbox.connect(sandbox.sandbox_id, **opts)


def test_a_paused_sandbox_has_no_timeout_and_a_resume_gives_it_back(face: dict[str, Any]) -> None:
    from sandlot.api import leases

    home, opts = face["home"], face["opts"]
    plain = Sandbox.create("fake-tpl", timeout=120, **opts)
    waking = Sandbox.create("fake-tpl", timeout=90, lifecycle={"on_timeout": "pause", "auto_resume": True},
                            **opts)  # fmt: skip
    try:
        for sandbox in (plain, waking):
            sandbox.pause()
            assert leases.of(sandbox.sandbox_id, home=home) is None  # paused: kept until resumed or killed
        with pytest.raises(Exception, match="paused"):  # no auto-resume: E2B's proxy's answer
            plain.commands.run("echo hi")
        assert waking.commands.run("echo awake").stdout == "awake\n"  # auto-resume: the call wakes it
        lease = leases.of(waking.sandbox_id, home=home)
        assert lease is not None and lease.seconds == 90  # and it runs out again, as it was made to
        Sandbox.connect(plain.sandbox_id, **opts)
        lease = leases.of(plain.sandbox_id, home=home)
        assert lease is not None and lease.seconds == 120
    finally:
        plain.kill()
        waking.kill()


def test_commands(sbx: Sandbox) -> None:
    assert sbx.commands.run("echo hello").stdout == "hello\n"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("exit 3")
    assert failed.value.exit_code == 3
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sleeper = sbx.commands.run("sleep 60", background=True)
    assert {p.pid for p in sbx.commands.list()} >= {cat.pid, sleeper.pid}
    sbx.commands.send_stdin(cat.pid, "in\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "in\n"
    assert sbx.commands.kill(sleeper.pid) is True  # (the fake agent lets it sleep on: real VMs end it)


def test_files(sbx: Sandbox) -> None:
    sbx.files.write("/data/a.txt", "alpha")
    assert sbx.files.read("/data/a.txt") == "alpha"
    assert sbx.files.exists("/data/a.txt") and not sbx.files.exists("/data/none")
    assert [e.name for e in sbx.files.list("/data")] == ["a.txt"]
    assert sbx.files.get_info("/data").type == FileType.DIR
    sbx.files.rename("/data/a.txt", "/data/b.txt")
    assert sbx.files.read("/data/b.txt") == "alpha"
    sbx.files.remove("/data/b.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("/data/b.txt")
    # write_files: one upload of several files, all of them or none
    got = sbx.files.write_files(
        [{"path": "/data/x.txt", "data": "x"}, {"path": "/data/y.txt", "data": "why"}]
    )
    assert [w.path for w in got] == ["/data/x.txt", "/data/y.txt"] and sbx.files.read("/data/y.txt") == "why"
    sbx.files.make_dir("/data/dir")
    with pytest.raises(Exception, match="directory"):
        sbx.files.write_files([{"path": "/data/z.txt", "data": "z"}, {"path": "/data/dir", "data": "no"}])
    assert sorted(e.name for e in sbx.files.list("/data")) == [
        "dir",
        "x.txt",
        "y.txt",
    ]  # no z.txt, no temporary


def test_file_metadata_is_kept_as_extended_attributes_and_shown_where_envd_shows_it(
    face: dict[str, Any], sbx: Sandbox
) -> None:
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    tags = {"owner": "agent-7", "stage": "draft v2"}
    assert sbx.files.write("/tmp/m/a.txt", "a", metadata=tags).metadata == tags
    assert sbx.files.get_info("/tmp/m/a.txt").metadata == tags
    assert sbx.files.write("/tmp/m/b.txt", "b", metadata={"Kind": "raw"}, use_octet_stream=True).metadata == {
        "kind": "raw"  # keys lowercased, as envd keeps them
    }
    many = sbx.files.write_files([WriteEntry(path="/tmp/m/c.txt", data="c"), WriteEntry(path="/tmp/m/d.txt",
                                                                                       data="d")],
                                 metadata={"batch": "1"})  # fmt: skip
    assert [w.metadata for w in many] == [{"batch": "1"}] * 2
    listed = {e.name: e.metadata for e in sbx.files.list("/tmp/m")}
    assert listed == {
        "a.txt": tags,
        "b.txt": {"kind": "raw"},
        "c.txt": {"batch": "1"},
        "d.txt": {"batch": "1"},
    }
    assert sbx.files.rename("/tmp/m/a.txt", "/tmp/m/e.txt").metadata == tags  # it goes with the file
    assert sbx.files.write("/tmp/m/e.txt", "again").metadata is None  # a new file: none of the old
    assert sbx.files.get_info("/tmp/m/e.txt").metadata is None
    # sandlot's own API sees the same attributes, and sets them
    box = sandlot.Box.get(sbx.sandbox_id, home=face["home"])
    assert box.files.stat("/tmp/m/b.txt", xattrs="user.e2b.").xattrs == {"user.e2b.kind": "raw"}
    box.files.set_xattrs("/tmp/m/b.txt", {"user.e2b.kind": "clean", "user.e2b.by": "me"}, prefix="user.e2b.")
    assert sbx.files.get_info("/tmp/m/b.txt").metadata == {"kind": "clean", "by": "me"}
    assert box.files.stat("/tmp/m/b.txt").xattrs is None  # none asked for
    with pytest.raises(sandlot.InvalidArgument, match=r"user\.e2b\."):
        box.files.set_xattrs("/tmp/m/b.txt", {"user.other": "x"}, prefix="user.e2b.")
    for name, value in (("user.e2b." + "n" * 250, "v"), ("user.e2b.big", "v" * 65537)):  # past Linux's limits
        with pytest.raises(sandlot.InvalidArgument, match="at most"):
            box.files.set_xattrs("/tmp/m/b.txt", {name: value}, prefix="user.e2b.")
    # what the SDK checks before it sends, the face checks too
    token = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": str(sbx._envd_access_token)}
    for bad in ({"X-Metadata-ok": "caf\u00e9".encode()}, {"X-Metadata-": b"no key"}):
        r = httpx.post(f"{face['srv'].url}/e2b/files", params={"path": "/tmp/m/bad.txt"}, content=b"x",
                       headers={**token, "Content-Type": "application/octet-stream", **bad})  # fmt: skip
        assert r.status_code == 400, r.text
    assert not sbx.files.exists("/tmp/m/bad.txt")


def test_signed_file_urls_work_with_one_sandbox_url_for_every_sandbox(
    face: dict[str, Any], sbx: Sandbox
) -> None:
    """With ``E2B_SANDBOX_URL`` a signed URL names no sandbox: its signature, made with one
    sandbox's token, says which (another sandbox running beside it changes nothing)."""
    other = Sandbox.create("fake-tpl", **face["opts"])
    try:
        sbx.files.write("/tmp/signed.txt", "for a browser")
        url = sbx.download_url("/tmp/signed.txt")
        assert "E2b-Sandbox-Id" not in url and sbx.sandbox_id not in url
        r = httpx.get(url)
        assert r.status_code == 200 and r.text == "for a browser"
        up = sbx.upload_url("/tmp/up.txt", use_signature_expiration=60)
        assert httpx.post(up, files={"file": ("up.txt", b"uploaded")}).status_code == 200
        assert sbx.files.read("/tmp/up.txt") == "uploaded" and not other.files.exists("/tmp/up.txt")
        # a part named "file" with no filename (a text field, as the JS SDK's tests send it
        # with FormData): its text is the file, as envd takes it
        up = sbx.upload_url("/tmp/field.txt")
        r = httpx.post(up, files={"file": (None, b"from a form field")})
        assert r.status_code == 200 and r.json()[0]["path"] == "/tmp/field.txt", r.text
        assert sbx.files.read("/tmp/field.txt") == "from a form field"
        assert httpx.post(up, files={"other": (None, b"x")}).status_code == 400  # no part named file
        expired = sbx.download_url("/tmp/signed.txt", use_signature_expiration=-10)
        r = httpx.get(expired)
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
        r = httpx.get(url.replace("signature=v1_", "signature=v1_x"))
        assert r.status_code == 401 and "signature is wrong" in r.json()["message"]
        r = httpx.get(url.replace("path=%2Ftmp%2Fsigned.txt", "path=%2Fetc%2Fpasswd"))  # signed for another
        assert r.status_code == 401
    finally:
        other.kill()


def test_calls_that_name_no_user_run_as_e2bs_user_where_the_image_has_it(face: dict[str, Any]) -> None:
    """E2B's templates run every call as ``user`` (home /home/user), and its SDKs name no
    user: the face does the same where the box's image has that user (``--e2b-user``),
    and otherwise runs as the image's own user. A user the call names wins."""
    home, opts = face["home"], face["opts"]
    plain = Sandbox.create("fake-tpl", **opts)  # an image without E2B's user: root's home
    try:
        assert plain.files.write("plain.txt", "p").path == "/root/plain.txt"
    finally:
        plain.kill()
    box = sandlot.Box(rootfs=str(fake_rootfs(home.parent)), engine="fake", home=home).start()
    try:
        box.files.write(
            "/etc/passwd", b"root:x:0:0:root:/root:/bin/bash\nuser:x:1001:1001::/home/user:/bin/bash\n"
        )
        box.snapshot("with-e2b-user")
    finally:
        box.remove(force=True)
    sandbox = Sandbox.create("with-e2b-user", **opts)
    try:
        assert sandbox.files.write("notes.txt", "n").path == "/home/user/notes.txt"
        assert sandbox.files.read("/home/user/notes.txt") == "n"
        assert sandbox.files.get_info("notes.txt").path == "/home/user/notes.txt"
        assert sandbox.files.write("mine.txt", "r", user="root").path == "/root/mine.txt"
    finally:
        sandbox.kill()


def test_e2bs_default_internet_access_fits_the_templates_network_card(face: dict[str, Any]) -> None:
    """E2B's SDKs ask for the internet unless told not to. A template made without a network
    card gives sandboxes without one (as its maker chose) rather than refusing E2B's
    default; one made with a card and asked for no internet gets an allow list of nothing;
    destinations named for a template without a card are refused, saying why."""
    home, opts = face["home"], face["opts"]
    sandlot.template(rootfs=str(fake_rootfs(home.parent)), name="fake-net", memory_mib=256, engine="fake",
                     network="public", home=home)  # fmt: skip
    made = [
        Sandbox.create("fake-tpl", **opts),
        Sandbox.create("fake-tpl", allow_internet_access=False, **opts),
        Sandbox.create("fake-net", allow_internet_access=False, **opts),
        Sandbox.create("fake-net", **opts),
    ]
    try:
        networks = [sandlot.Box.get(s.sandbox_id, home=home).info["network"] for s in made]
        assert networks == ["none", "none", "allowlist", "public"]
        made[3].update_network({"deny_out": [ALL_TRAFFIC]})  # no way out, its card kept
        assert sandlot.Box.get(made[3].sandbox_id, home=home).info["network"] == "allowlist"
        with pytest.raises(Exception, match="no network card"):
            Sandbox.create("fake-tpl", network={"allow_out": ["pypi.org"], "deny_out": [ALL_TRAFFIC]}, **opts)
    finally:
        for s in made:
            s.kill()


def test_listings_removals_filters_and_timeouts_as_envd_and_e2b_give_them(face: dict[str, Any]) -> None:
    """A listing deeper than one level in envd's order (by name, each folder's entries
    right after it); removing what is not there is no error (envd's os.RemoveAll); the
    list's startedAfter and template filters; a connect to a running sandbox that never
    shortens its timeout, and a set_timeout that may (down to a second)."""
    from datetime import timedelta

    from sandlot.api import leases

    home, opts = face["home"], face["opts"]
    sbx = Sandbox.create("fake-tpl", metadata={"case": "filters"}, timeout=300, **opts)
    try:
        for d in ("/t/b", "/t/a/y", "/t/a/x", "/t/b/z"):
            sbx.files.make_dir(d)
        sbx.files.write("/t/0.txt", "0")
        assert [e.path for e in sbx.files.list("/t", depth=2)] == [
            "/t/0.txt", "/t/a", "/t/a/x", "/t/a/y", "/t/b", "/t/b/z"]  # fmt: skip
        assert [e.path for e in sbx.files.list("/t")] == ["/t/0.txt", "/t/a", "/t/b"]
        sbx.files.remove("/t/not-there")
        info = sbx.get_info()
        query = {"metadata": {"case": "filters"}}

        def listed(**more: Any) -> list[str]:
            return [
                s.sandbox_id for s in Sandbox.list(query=SandboxQuery(**query, **more), **opts).next_items()
            ]

        assert listed(started_after=info.started_at) == [sbx.sandbox_id]
        assert listed(started_after=info.started_at + timedelta(seconds=1)) == []
        assert listed(template="fake-tpl") == [sbx.sandbox_id] and listed(template="other") == []
        Sandbox.connect(sbx.sandbox_id, timeout=10, **opts)
        assert sbx.get_info().end_at == info.end_at  # not shortened
        sbx.set_timeout(2)
        lease = leases.of(sbx.sandbox_id, home=home)
        assert lease is not None and lease.seconds == 2
    finally:
        sbx.kill()
    brief = Sandbox.create("fake-tpl", timeout=3, **opts)  # a timer as short as that from the start
    try:
        lease = leases.of(brief.sandbox_id, home=home)
        assert lease is not None and lease.seconds == 3
    finally:
        brief.kill()


def test_fork_and_snapshots(face: dict[str, Any], sbx: Sandbox) -> None:
    sbx.commands.run("remember color blue")
    kids = sbx.fork(count=2)
    try:
        assert [k.commands.run("recall color").stdout for k in kids] == ["blue\n", "blue\n"]  # type: ignore[union-attr]
    finally:
        for k in kids:
            k.kill()  # type: ignore[union-attr]
    snap = sbx.create_snapshot(name="unit-snap")
    started = Sandbox.create(snap.snapshot_id, **face["opts"])
    assert started.commands.run("recall color").stdout == "blue\n"
    started.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id, **face["opts"]) is True


def _envd(face: dict[str, Any], sbx: Sandbox) -> httpx.Client:
    srv: InProcess = face["srv"]
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": str(sbx._envd_access_token)}
    return httpx.Client(base_url=f"{srv.url}/e2b", headers=headers, timeout=30)


def _envelopes(body: bytes) -> list[tuple[int, bytes]]:
    out = []
    while body:
        flags, length = struct.unpack(">BI", body[:5])
        out.append((flags, body[5 : 5 + length]))
        body = body[5 + length :]
    return out


def test_connect_streams_in_both_codecs_and_unary_in_json(face: dict[str, Any], sbx: Sandbox) -> None:
    envd = _envd(face, sbx)
    start = {"process": {"cmd": "echo", "args": ["hi"]}, "stdin": False}
    for codec in ("proto", "json"):
        if codec == "proto":
            data = protobuf.encode(pb.StartRequest, start)
        else:
            data = json.dumps(protobuf.to_json(pb.StartRequest, start)).encode()
        r = envd.post("/process.Process/Start", content=struct.pack(">BI", 0, len(data)) + data,
                      headers={"Content-Type": f"application/connect+{codec}"})  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"] == f"application/connect+{codec}"
        frames = _envelopes(r.content)
        assert frames[-1] == (2, b"{}")  # the end of the stream, with no error
        events = [
            protobuf.decode(pb.StartResponse, d)
            if codec == "proto"
            else protobuf.from_json(pb.StartResponse, json.loads(d))
            for _, d in frames[:-1]
        ]
        assert "start" in events[0]["event"]
        assert events[1]["event"]["data"]["stdout"] == b"hi\n"
        assert events[-1]["event"]["end"]["exited"] is True
    sbx.files.write("/etc/motd", "hi")
    r = envd.post("/filesystem.Filesystem/Stat", json={"path": "/etc/motd"})
    assert r.status_code == 200 and r.json()["entry"]["name"] == "motd"
    gz = gzip.compress(protobuf.encode(pb.StatRequest, {"path": "/etc"}))
    r = envd.post("/filesystem.Filesystem/Stat", content=gz,
                  headers={"Content-Type": "application/proto", "Content-Encoding": "gzip"})  # fmt: skip
    assert r.status_code == 200 and protobuf.decode(pb.StatResponse, r.content)["entry"]["type"] == 2


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"\xff\xff", {"Content-Type": "application/proto"}, 400, "invalid_argument"),
        (b"{oops", {"Content-Type": "application/json"}, 400, "invalid_argument"),
        (b"{}", {"Content-Type": "text/plain"}, 415, "invalid_argument"),
        (b'{"path": "/nope"}', {"Content-Type": "application/json"}, 404, "not_found"),
        (b'{"path": ""}', {"Content-Type": "application/json"}, 400, "invalid_argument"),
        (b'{"nope": 1}', {"Content-Type": "application/json"}, 400, "invalid_argument"),
        (gzip.compress(b"\0" * (20 << 20)), {"Content-Type": "application/proto", "Content-Encoding": "gzip"},
         429, "resource_exhausted"),
        (b"x", {"Content-Type": "application/proto", "Content-Encoding": "br"}, 501, "unimplemented"),
    ],
    ids=["bad-proto", "bad-json", "content-type", "missing", "empty-path", "unknown-field", "gzip-bomb",
         "encoding"],
)  # fmt: skip
def test_bad_unary_calls_get_connect_errors(
    face: dict[str, Any], sbx: Sandbox, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    r = _envd(face, sbx).post("/filesystem.Filesystem/Stat", content=body, headers=headers)
    assert (r.status_code, r.json()["code"]) == (status, code), r.text


@pytest.mark.parametrize(
    "body",
    [b"\x00\x00\x00\x00\x09abc", b"\x00\xff\xff\xff\xff", b"\x00\x00\x00\x00\x03\xff\xff\xff", b"",
     b"\x01\x00\x00\x00\x01x"],
    ids=["truncated", "huge", "malformed", "empty", "compressed-without-encoding"],
)  # fmt: skip
def test_bad_streams_end_with_a_connect_error(face: dict[str, Any], sbx: Sandbox, body: bytes) -> None:
    r = _envd(face, sbx).post("/process.Process/Start", content=body,
                              headers={"Content-Type": "application/connect+proto"})  # fmt: skip
    assert r.status_code == 200
    flags, data = _envelopes(r.content)[-1]
    assert flags == 2 and json.loads(data)["error"]["code"] in ("invalid_argument", "resource_exhausted")


def test_sandbox_requests_need_the_sandboxs_token(face: dict[str, Any], sbx: Sandbox) -> None:
    srv: InProcess = face["srv"]
    url = f"{srv.url}/e2b/filesystem.Filesystem/Stat"
    r = httpx.post(url, json={"path": "/"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    other = Sandbox.create("fake-tpl", **face["opts"])
    try:  # one sandbox's token opens no other
        theirs = {"E2b-Sandbox-Id": other.sandbox_id, "X-Access-Token": str(sbx._envd_access_token)}
        assert httpx.post(url, json={"path": "/"}, headers=theirs).status_code == 401
    finally:
        other.kill()
    # an id without its token learns nothing, not even whether the box is there
    r = httpx.post(url, json={"path": "/"}, headers={"E2b-Sandbox-Id": "nope", "X-Access-Token": "x"})
    assert r.status_code == 401
    gone = {"E2b-Sandbox-Id": "nope", "X-Access-Token": access.sandbox_token("nope", "envd", face["home"])}
    r = httpx.post(url, json={"path": "/"}, headers=gone)
    assert r.status_code == 503 and "was not found" in r.json()["message"]
    assert httpx.get(f"{srv.url}/e2b/health", headers=gone).status_code == 502
    odd = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "é".encode("latin-1")}
    r = httpx.post(url, json={"path": "/"}, headers=odd)
    assert r.status_code == 401  # any byte in the header: refused, never a 500


def test_revoking_the_key_that_made_a_sandbox_ends_its_token(face: dict[str, Any]) -> None:
    srv: InProcess = face["srv"]
    record, key = access.create_key("short-lived", e2b=True, home=face["home"])
    opts = {**face["opts"], "api_key": key}
    sandbox = Sandbox.create("fake-tpl", **opts)
    try:
        assert sandbox.commands.run("echo ok").stdout == "ok\n"
        access.revoke_key(record.name, face["home"])
        time.sleep(1.1)  # the server reads a key's row again once it is a second old
        token = access.sandbox_token(sandbox.sandbox_id, "envd", face["home"])
        headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token}
        r = httpx.post(f"{srv.url}/e2b/filesystem.Filesystem/Stat", json={"path": "/"}, headers=headers)
        assert r.status_code == 401 and "revoked" in r.json()["message"]
    finally:
        sandlot.get(sandbox.sandbox_id, home=face["home"]).remove(force=True)


def test_unserved_paths_answer_in_e2b_shape(face: dict[str, Any]) -> None:
    srv: InProcess = face["srv"]
    r = httpx.get(f"{srv.url}/e2b/templates", headers={"X-API-Key": face["key"]})
    assert r.status_code == 404 and "not served by sandlot" in r.json()["message"]


def test_bad_control_calls_get_e2b_errors(face: dict[str, Any]) -> None:
    srv: InProcess = face["srv"]
    api = httpx.Client(base_url=f"{srv.url}/e2b", headers={"X-API-Key": face["key"]})
    for method, path, body, status in (
        ("POST", "/v2/sandboxes", b"{not json", 400),
        ("POST", "/v2/sandboxes", b"[]", 400),
        ("POST", "/v2/sandboxes", json.dumps({"templateID": ""}).encode(), 400),
        ("POST", "/v2/sandboxes", json.dumps({"templateID": "fake-tpl", "timeout": "x"}).encode(), 400),
        ("POST", "/v2/sandboxes", json.dumps({"templateID": "fake-tpl", "volumeMounts": [{}]}).encode(), 501),
        ("GET", "/sandboxes/none", b"", 404),
        ("POST", "/sandboxes/none/pause", b"", 404),
        ("GET", "/v2/sandboxes?state=sleeping", b"", 400),
        ("GET", "/v2/sandboxes?nextToken=zzz", b"", 400),
        ("POST", "/v2/sandboxes", b"x" * (2 << 20), 413),
        ("POST", "/v2/sandboxes", json.dumps({"templateID": "fake-tpl", "iam": {"a": {}}}).encode(), 501),
        ("PUT", "/sandboxes/none/network", json.dumps({"denyOut": ["10.0.0.1"]}).encode(), 501),
    ):
        r = api.request(method, path, content=body)
        assert r.status_code == status, (path, r.text)
        assert set(r.json()) >= {"code", "message"}
    assert not [b for b in sandlot.list(home=face["home"]) if "e2b.template" in b.info["labels"]]


def test_a_streams_connect_timeout_ends_it_as_deadline_exceeded(face: dict[str, Any], sbx: Sandbox) -> None:
    """A command's ``timeout`` is the stream's Connect-Timeout-Ms, which the face holds it to
    (the async SDK leaves it to the server, as envd does it); the command goes on."""
    import asyncio

    from e2b import AsyncSandbox, TimeoutException

    async def run() -> float:
        sandbox = await AsyncSandbox.connect(sbx.sandbox_id, **face["opts"])
        t0 = time.monotonic()
        with pytest.raises(TimeoutException):
            await sandbox.commands.run("sleep 5", timeout=1)
        return time.monotonic() - t0

    assert asyncio.run(run()) < 4
    assert sbx.commands.run("echo still", timeout=30).stdout == "still\n"


def test_an_mcp_gateway_is_the_sdks_to_start_and_a_failed_start_leaves_no_sandbox(
    face: dict[str, Any],
) -> None:
    """E2B's SDKs start the MCP gateway themselves, a command in the new sandbox: an image
    without ``mcp-gateway`` fails it, and the SDK then kills the sandbox it made."""
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create("fake-tpl", mcp={"github": {}}, metadata={"mcp": "gateway"}, **face["opts"])  # type: ignore[arg-type]
    found = Sandbox.list(query=SandboxQuery(metadata={"mcp": "gateway"}), **face["opts"]).next_items()
    assert found == []


def _harness(name: str) -> tuple[Any, Any]:
    """One of scripts/'s harnesses of E2B's own tests, loaded as a module: its path, and it."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return script, harness


def test_the_harness_of_e2bs_own_tests_counts_what_they_did(tmp_path: Any) -> None:
    """scripts/e2b_sdk_tests.py (run by hand: CI cannot reach E2B's repository) reads the
    SDK tests' JUnit report into passed, failed with their reasons, skipped and the rate;
    and refuses a folder that is not E2B's SDK before it sets anything up."""
    import subprocess
    import sys

    script, harness = _harness("e2b_sdk_tests")
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.sync.a" name="test_ok"/>'
        '<testcase classname="tests.sync.a" name="test_bad">'
        '<failure message="AssertionError: 1 == 2&#10;more"/></testcase>'
        '<testcase classname="tests.sync.b" name="test_err"><error message="boom"/></testcase>'
        '<testcase classname="tests.sync.b" name="test_skip"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert harness.summary(report) == {
        "passed": 1, "failed": 2, "skipped": 1, "rate": 0.333,
        "failures": {"tests.sync.a::test_bad": "AssertionError: 1 == 2", "tests.sync.b::test_err": "boom"},
    }  # fmt: skip
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and "is not E2B's packages/python-sdk folder" in r.stderr


def test_a_recording_sandbox_s_commands_and_file_writes_are_steps(face: dict[str, Any], sbx: Sandbox) -> None:
    """The flight recorder sees what E2B's SDK does, as it sees any other transport's calls."""
    box = sandlot.Box.get(sbx.sandbox_id, home=face["home"])
    box.record()
    assert sbx.commands.run("echo hello").stdout == "hello\n"
    sbx.files.write("/data/rec.txt", "recorded")
    # each step is in the timeline once the server's task has taken its checkpoint
    deadline = time.monotonic() + 10
    while len(box.timeline()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    kinds = [(s.kind, s.what.get("argv") or s.what.get("path")) for s in box.timeline()]
    assert kinds[0][0] == "record" and ("files", "/data/rec.txt") in kinds[1:], kinds
    ran = [s for s in box.timeline() if s.kind in ("exec", "process")]
    assert ran and "echo hello" in " ".join(ran[0].what["argv"]) and ran[0].result["exit_code"] == 0
    assert all(s.kept for s in box.timeline())


def test_a_new_sandbox_lists_e2bs_default_contexts_of_python_and_javascript(face: dict[str, Any]) -> None:
    """E2B's sandboxes have a default context of each from their start; sandlot's start on
    their first cell, and are listed before it, in the home of the user cells start in."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sandbox = CodeSandbox.create("fake-tpl", **face["opts"])
    try:
        listed = {c.id: (c.language, c.cwd) for c in sandbox.list_code_contexts()}
        assert listed == {"default-python": ("python", "/root"),
                          "default-javascript": ("javascript", "/root")}  # fmt: skip
    finally:
        sandbox.kill()


def test_the_harness_of_e2bs_own_js_tests_counts_what_they_did(tmp_path: Any) -> None:
    """scripts/e2b_js_sdk_tests.py (run by hand: CI cannot reach E2B's repository) reads
    vitest's JSON report of the JavaScript SDK's tests into passed, failed with their
    reasons (a file that did not load fails under its own name), skipped and the rate;
    and refuses a folder that is not E2B's SDK before it sets anything up."""
    import subprocess
    import sys

    script, harness = _harness("e2b_js_sdk_tests")
    sdk = tmp_path / "js-sdk"

    def case(name: str, status: str, *reasons: str) -> dict[str, Any]:
        return {"fullName": name, "title": name.split(" > ")[-1], "status": status,
                "failureMessages": list(reasons)}  # fmt: skip

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"numTotalTests": 5, "testResults": [
        {"name": f"{sdk}/tests/sandbox/a.test.ts", "status": "failed", "message": "", "assertionResults": [
            case("run", "passed"), case("files > read", "failed", "AssertionError: 1 == 2\n  at a.ts:3"),
            case("skipped one", "skipped"), case("todo one", "todo")]},
        {"name": f"{sdk}/tests/api/b.test.ts", "status": "failed", "assertionResults": [],
         "message": "Failed to load url msw\nmore"},
    ]}))  # fmt: skip
    assert harness.summary(report, sdk) == {
        "passed": 1, "failed": 2, "skipped": 2, "rate": 0.333,
        "failures": {"tests/sandbox/a.test.ts::files > read": "AssertionError: 1 == 2",
                     "tests/api/b.test.ts": "Failed to load url msw"},
    }  # fmt: skip
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and "is not E2B's packages/js-sdk folder" in r.stderr
