"""Unit tests of the HTTP backend (``sandlot.connect``), without a server or a VM.

HTTP answers come from ``httpx.MockTransport``: these tests check only how error
bodies map to exception classes and how URLs, query parameters and bodies are
built. The WebSocket process protocol runs against a tiny real ``websockets``
server that plays the server's part (drops included). The same calls against a
real ``sandlot serve`` and real boxes are in ``tests/vm/test_contract.py``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import tarfile
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.server import ServerConnection, serve

import sandlot
from sandlot.api.client import AsyncClient
from sandlot.api.contract import control, decode_output, encode_output, encode_stdin, error_from_answer
from sandlot.api.follow import FollowedStream

Handler = Callable[[httpx.Request], httpx.Response]
URL = "http://sandlot.test:7070"
BOX = {"id": "b0x1d", "name": "dev", "state": "running", "image": "alpine", "labels": {}, "created_at": 1.0,
       "started_at": 2.0, "memory_mib": 512, "cpus": 1, "disk_size_gb": 4, "network": "public",
       "origin": None, "reason": None}  # fmt: skip
FILE = {"path": "/etc/hostname", "name": "hostname", "type": "file", "size": 4, "mode": 0o644, "uid": 0,
        "gid": 0, "mtime": "2024-05-01T12:30:00+00:00", "link_target": None}  # fmt: skip


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


def error(status: int, **body: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": body})


class Recorder:
    """A MockTransport handler that answers by (method, path) and keeps every request."""

    def __init__(self, routes: dict[tuple[str, str], Handler | httpx.Response]) -> None:
        self.routes = routes
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        answer = self.routes.get((request.method, request.url.path))
        if answer is None:
            return error(404, type="RequestError", code="not_found", message=f"no route {request.url.path}")
        return answer(request) if callable(answer) else answer

    def client(self, api_key: str | None = "sk-sl-test") -> AsyncClient:
        return AsyncClient(URL, api_key, transport=httpx.MockTransport(self))

    def body(self, i: int = -1) -> Any:
        return json.loads(self.requests[i].content)


# -- error bodies map to the exception classes a local box raises ------------------------


def test_unit_error_bodies_become_the_same_exception_classes() -> None:
    body: dict[str, Any] = {
        "type": "BoxNotFound",
        "code": "box_not_found",
        "message": "no box 'x'",
        "box": "x",
    }
    err = error_from_answer(404, json.dumps({"error": body}).encode(), URL)
    assert isinstance(err, sandlot.BoxNotFound) and isinstance(err, LookupError) and err.box == "x"

    body = {"type": "InvalidState", "code": "invalid_state", "message": "box dev is stopped: cannot pause",
            "box": "dev", "state": "stopped", "allowed": ["running"]}  # fmt: skip
    err = error_from_answer(409, json.dumps({"error": body}).encode(), URL)
    assert type(err) is sandlot.InvalidState and err.state == "stopped" and err.allowed == ("running",)

    body = {"type": "GuestFileNotFoundError", "code": "guest_os_error", "errno": "ENOENT",
            "message": "[guest ENOENT] /nope: No such file or directory"}  # fmt: skip
    err = error_from_answer(404, json.dumps({"error": body}).encode(), URL)
    assert isinstance(err, FileNotFoundError) and isinstance(err, sandlot.GuestOSError)
    assert err.errno == 2 and "/nope" in str(err)

    body = {"type": "ExecTimeout", "code": "exec_timeout", "message": "'sleep 9' ran past its 1s timeout",
            "stdout": "partial\n", "stderr": "", "box": "dev", "state": None}  # fmt: skip
    err = error_from_answer(504, json.dumps({"error": body}).encode(), URL)
    assert isinstance(err, sandlot.ExecTimeout) and isinstance(err, TimeoutError)
    assert err.stdout == b"partial\n" and err.stderr == b""

    body = {
        "type": "QuotaExceeded",
        "code": "quota_exceeded",
        "message": "over",
        "limit": "boxes",
        "value": 3,
    }
    err = error_from_answer(429, json.dumps({"error": body}).encode(), URL)
    assert isinstance(err, sandlot.QuotaExceeded) and err.limit == "boxes" and err.value == 3

    body = {"type": "BoxCrashed", "code": "box_crashed", "message": "box dev stopped unexpectedly",
            "console_tail": "kernel: oops", "box": "dev", "state": "crashed", "allowed": []}  # fmt: skip
    err = error_from_answer(409, json.dumps({"error": body}).encode(), URL)
    assert isinstance(err, sandlot.BoxCrashed) and err.console_tail == "kernel: oops"

    # an unknown type falls back to the class of its code
    body = {"type": "SomethingNew", "code": "snapshot_in_use", "message": "in use"}
    assert type(error_from_answer(409, json.dumps({"error": body}).encode(), URL)) is sandlot.SnapshotInUse


def test_unit_answers_without_an_error_body_map_by_status() -> None:
    assert type(error_from_answer(401, b"", URL)) is sandlot.Unauthorized
    assert type(error_from_answer(403, b"<html>nope</html>", URL)) is sandlot.Forbidden
    assert type(error_from_answer(404, b"", URL)) is sandlot.NotFound
    err = error_from_answer(502, b"<html>Bad Gateway</html>", URL)
    assert type(err) is sandlot.ProtocolError and "502" in str(err) and URL in str(err)


def test_unit_client_calls_raise_the_server_errors() -> None:
    guest_enoent = error(404, type="GuestFileNotFoundError", code="guest_os_error", errno="ENOENT",
                         message="[guest ENOENT] /nope: No such file or directory")  # fmt: skip
    rec = Recorder({
        ("GET", "/v1/boxes/ghost"): error(404, type="BoxNotFound", code="box_not_found",
                                          message="no box 'ghost'", box="ghost"),
        ("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX),
        ("POST", "/v1/boxes/b0x1d/pause"): error(409, type="InvalidState", code="invalid_state",
                                                 message="box dev is stopped: cannot pause", box="dev",
                                                 state="stopped", allowed=["running"]),
        ("GET", "/v1/boxes/b0x1d/files/stat"): guest_enoent,
        ("GET", "/v1/boxes/b0x1d/files/content"): guest_enoent,
        ("DELETE", "/v1/boxes/b0x1d/files"): guest_enoent,
    })  # fmt: skip

    async def main() -> None:
        async with rec.client() as client:
            with pytest.raises(sandlot.BoxNotFound):
                await client.get("ghost")
            box = await client.get("dev")
            with pytest.raises(sandlot.InvalidState) as info:
                await box.pause()
            assert info.value.state == "stopped" and info.value.allowed == ("running",)
            with pytest.raises(FileNotFoundError):
                await box.files.stat("/nope")
            with pytest.raises(FileNotFoundError):
                await box.files.read("/nope")
            assert not await box.files.exists("/nope")
            with pytest.raises(FileNotFoundError):
                await box.files.remove("/nope")

    run(main)


def test_unit_transport_failures_raise_connection_lost_with_the_url() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}", "k") as client:
            with pytest.raises(sandlot.ConnectionLost, match=f"127.0.0.1:{port}"):
                await client.info()

        def reset(request: httpx.Request) -> httpx.Response:
            raise httpx.ReadError("connection reset by peer", request=request)

        def slow(request: httpx.Request) -> httpx.Response:
            raise httpx.ReadTimeout("timed out", request=request)

        async with AsyncClient(URL, transport=httpx.MockTransport(reset)) as client:
            with pytest.raises(sandlot.ConnectionLost, match=r"sandlot\.test:7070"):
                await client.info()
        async with AsyncClient(URL, transport=httpx.MockTransport(slow)) as client:
            with pytest.raises(sandlot.AgentTimeout, match=r"sandlot\.test:7070"):
                await client.info()

    run(main)
    with (
        sandlot.connect(f"http://127.0.0.1:{port}", api_key="k") as client,
        pytest.raises(sandlot.ConnectionLost),
    ):
        client.list()  # the sync twin too


# -- URLs, parameters and bodies ------------------------------------------------------------


def test_unit_requests_carry_the_key_and_go_under_v1() -> None:
    rec = Recorder({("GET", "/v1/info"): httpx.Response(200, json={"version": "x", "namespace": None})})

    async def main() -> None:
        async with rec.client("sk-sl-secret") as client:
            assert (await client.info())["version"] == "x"
        async with rec.client(None) as client:
            await client.info()

    run(main)
    assert rec.requests[0].headers["authorization"] == "Bearer sk-sl-secret"
    assert "authorization" not in rec.requests[1].headers
    assert str(rec.requests[0].url) == f"{URL}/v1/info"


def test_unit_connect_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_URL", "https://sandlot.example/v1/")
    monkeypatch.setenv("SANDLOT_API_KEY", "sk-sl-env")
    client = sandlot.connect_async()
    assert client.url == "https://sandlot.example"
    monkeypatch.delenv("SANDLOT_URL")
    with pytest.raises(sandlot.InvalidArgument, match="SANDLOT_URL"):
        sandlot.connect()
    with pytest.raises(sandlot.InvalidArgument):
        sandlot.connect("ftp://example")


def test_unit_list_follows_pages_and_filters() -> None:
    def page(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("page_token") is None:
            return httpx.Response(200, json={"boxes": [BOX], "next_page_token": "t2"})
        return httpx.Response(200, json={"boxes": [{**BOX, "id": "b2", "state": "stopped"}],
                                         "next_page_token": None})  # fmt: skip

    rec = Recorder({("GET", "/v1/boxes"): page})

    async def main() -> None:
        async with rec.client() as client:
            boxes = await client.list(state="running", labels={"team": "a", "env": "dev"})
            assert [b.id for b in boxes] == ["b0x1d", "b2"] and boxes[1].state == "stopped"
            running = await client.list(all=False)
            assert [b.id for b in running] == ["b0x1d"]

    run(main)
    first = rec.requests[0].url.params
    assert first.get_list("label") == ["team=a", "env=dev"] and first["state"] == "running"
    assert first["limit"] == "100" and "page_token" not in first
    assert rec.requests[1].url.params["page_token"] == "t2"


def test_unit_create_start_and_with_block() -> None:
    created: list[dict[str, Any]] = []
    fail_start = [False]

    def create(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        created.append(body)
        state = "running" if body["start"] else "created"
        return httpx.Response(201, json={**BOX, "name": body.get("name") or "dev", "state": state})

    def start(request: httpx.Request) -> httpx.Response:
        if fail_start[0]:
            return error(504, type="BootTimeout", code="boot_timeout", message="no agent", box="b0x1d",
                         console_tail="kernel: panic")  # fmt: skip
        return httpx.Response(200, json=BOX)

    rec = Recorder({
        ("POST", "/v1/boxes"): create,
        ("POST", "/v1/boxes/b0x1d/start"): start,
        ("DELETE", "/v1/boxes/b0x1d"): httpx.Response(204),
    })  # fmt: skip

    def calls() -> list[str]:
        return [f"{r.method} {r.url.path}" for r in rec.requests]

    async def main() -> None:
        async with rec.client() as client:
            box = await client.create("alpine", name="dev", env={"A": "1"}, ports=[80, "8080:81", (0, 82)],
                                      allow="pypi.org", rootfs=Path("/srv/root"), memory_mib=512)  # fmt: skip
            assert box.state == "created" and box.id == "b0x1d"
            await box.start()
            assert box.state == "running"
            assert calls() == ["POST /v1/boxes", "POST /v1/boxes/b0x1d/start"]

            fresh = client.Box("alpine", labels={"x": "y"})
            assert fresh.state == "new" and fresh.name == ""
            with pytest.raises(sandlot.InvalidState):
                _ = fresh.id
            await fresh.start()  # one request: created and started
            assert fresh.state == "running" and calls()[-1] == "POST /v1/boxes"

            rec.requests.clear()
            async with client.Box("alpine") as b:  # created, started, removed at the end
                assert b.state == "running"
            assert b.state == "removed"
            assert calls() == ["POST /v1/boxes", "POST /v1/boxes/b0x1d/start", "DELETE /v1/boxes/b0x1d"]
            assert rec.requests[-1].url.params["force"] == "true"

            rec.requests.clear()
            async with client.Box("alpine", keep=True):
                pass
            assert "DELETE /v1/boxes/b0x1d" not in calls()  # keep=True leaves it

            rec.requests.clear()
            fail_start[0] = True
            with pytest.raises(sandlot.BootTimeout) as info:
                async with client.Box("alpine"):
                    pytest.fail("the block must not run")
            assert info.value.console_tail == "kernel: panic"
            assert calls()[-1] == "DELETE /v1/boxes/b0x1d"  # a box that failed to start is not left behind

    run(main)
    assert created[0] == {"image": "alpine", "name": "dev", "env": {"A": "1"}, "memory_mib": 512,
                          "rootfs": "/srv/root", "allow": ["pypi.org"], "start": False,
                          "ports": [{"guest": 80, "host": 0}, {"guest": 81, "host": 8080},
                                    {"guest": 82, "host": 0}]}  # fmt: skip
    assert created[1] == {"image": "alpine", "labels": {"x": "y"}, "start": True}
    assert created[2] == {"image": "alpine", "start": False, "ephemeral": True}  # a with block's: leased


def test_unit_exec_posts_the_command_and_rebuilds_the_result() -> None:
    def exec_(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        code = 3 if body["argv"][-1] == "fail" else 0
        return httpx.Response(200, json={
            "argv": body["argv"], "exit_code": code, "signal": None, "oom_killed": False, "duration": 0.25,
            "pid": 42, "stdout": "\ufffd\n", "stderr": "oops" if code else "",
            "stdout_b64": base64.b64encode(b"\xff\n").decode(),
            "stderr_b64": base64.b64encode(b"oops" if code else b"").decode(),
        })  # fmt: skip

    rec = Recorder({("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX),
                    ("POST", "/v1/boxes/b0x1d/exec"): exec_})  # fmt: skip

    async def main() -> None:
        async with rec.client() as client:
            box = await client.get("dev")
            r = await box.exec("cat", env={"A": "1"}, cwd="/tmp", user="agent", stdin=b"\x00\xff", timeout=5)
            assert isinstance(r, sandlot.ExecResult)
            assert r.stdout_bytes == b"\xff\n" and r.exit_code == 0 and r.pid == 42 and r.duration == 0.25
            await box.sh("echo hi", stdin="text")
            with pytest.raises(sandlot.CommandFailed) as info:
                await box.exec("sh", "-c", "fail", check=True)
            assert info.value.result.exit_code == 3 and "oops" in str(info.value)
            with pytest.raises(sandlot.InvalidArgument):
                await box.exec()
            with pytest.raises(sandlot.InvalidArgument):
                await box.exec("true", timeout=-1)

    run(main)
    # the output asked in base64 alone: the text is made from the bytes here
    assert rec.body(1) == {"argv": ["cat"], "env": {"A": "1"}, "cwd": "/tmp", "user": "agent", "timeout": 5,
                           "stdin_b64": base64.b64encode(b"\x00\xff").decode(), "output": "b64"}  # fmt: skip
    assert rec.body(2) == {
        "argv": ["/bin/sh", "-c", "echo hi"],
        "stdin_b64": base64.b64encode(b"text").decode(),
        "output": "b64",
    }
    assert len(rec.requests) == 4  # the refused ones never left


def test_unit_files_requests_and_file_info() -> None:
    puts: list[httpx.Request] = []

    def put(request: httpx.Request) -> httpx.Response:
        puts.append(request)
        return httpx.Response(200, json={**FILE, "size": len(request.content)})

    naive = {**FILE, "name": "a", "path": "/d/a", "type": "dir", "mtime": "2024-05-01T12:30:00"}
    listing = {"entries": [{**FILE, "name": "b", "path": "/d/b"}, naive]}
    rec = Recorder({
        ("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX),
        ("GET", "/v1/boxes/b0x1d/files/stat"): httpx.Response(200, json=FILE),
        ("GET", "/v1/boxes/b0x1d/files"): httpx.Response(200, json=listing),
        ("GET", "/v1/boxes/b0x1d/files/content"): httpx.Response(200, content=b"dev\n"),
        ("PUT", "/v1/boxes/b0x1d/files/content"): put,
        ("POST", "/v1/boxes/b0x1d/files/mkdir"): httpx.Response(204),
        ("POST", "/v1/boxes/b0x1d/files/rename"): httpx.Response(204),
        ("POST", "/v1/boxes/b0x1d/files/chmod"): httpx.Response(204),
    })  # fmt: skip

    async def main() -> None:
        async with rec.client() as client:
            box = await client.get("dev")
            info = await box.files.stat("/etc/hostname", follow_symlinks=False)
            assert isinstance(info, sandlot.FileInfo) and info.is_file and info.mode == 0o644
            assert info.mtime == datetime(2024, 5, 1, 12, 30, tzinfo=UTC)
            entries = await box.files.list("/d")
            assert [e.name for e in entries] == ["a", "b"] and entries[0].is_dir
            assert entries[0].mtime.tzinfo is not None
            assert await box.files.read_text("/etc/hostname") == "dev\n"
            assert [c async for c in box.files.iter_read("/etc/hostname", offset=1, length=2)] == [b"dev\n"]
            assert await box.files.write("/tmp/x", "héllo", mode=0o600) == 6

            async def chunks() -> Any:
                yield b"ab"
                yield b"cd"

            assert await box.files.write("/tmp/y", chunks()) == 4
            await box.files.mkdir("/tmp/d", parents=False)
            await box.files.rename("/tmp/x", "/tmp/z")
            await box.files.chmod("/tmp/z", 0o700)

    run(main)
    paths = [(r.method, r.url.path, dict(r.url.params)) for r in rec.requests]
    assert (
        "GET",
        "/v1/boxes/b0x1d/files/stat",
        {"path": "/etc/hostname", "follow_symlinks": "false"},
    ) in paths
    assert (
        "GET",
        "/v1/boxes/b0x1d/files/content",
        {"path": "/etc/hostname", "offset": "1", "length": "2"},
    ) in paths
    assert (
        dict(puts[0].url.params)
        == {"path": "/tmp/x", "mode": "384", "append": "false", "parents": "true", "exclusive": "false"}
        and puts[0].content == "héllo".encode()
    )
    assert puts[1].content == b"abcd" and "mode" not in puts[1].url.params
    bodies = [json.loads(r.content) for r in rec.requests if r.method == "POST"]
    assert bodies == [{"path": "/tmp/d", "parents": False, "mode": 0o755}, {"src": "/tmp/x", "dst": "/tmp/z"},
                      {"path": "/tmp/z", "mode": 0o700}]  # fmt: skip


def test_unit_watch_reads_the_servers_ndjson_stream() -> None:
    def ndjson(*messages: dict[str, Any]) -> bytes:
        return b"".join(json.dumps(m).encode() + b"\n" for m in messages)

    def watch(request: httpx.Request) -> httpx.Response:
        if request.url.params["path"] == "/missing":
            return error(404, type="GuestFileNotFoundError", code="guest_os_error", errno="ENOENT",
                         message="[guest ENOENT] /missing: No such file or directory")  # fmt: skip
        if request.url.params["path"] == "/crash":
            crash = {"type": "BoxCrashed", "code": "box_crashed", "message": "box dev stopped unexpectedly",
                     "console_tail": "", "box": "dev", "state": "crashed", "allowed": []}  # fmt: skip
            return httpx.Response(
                200, content=ndjson({"type": "watching"}, {"type": "error", "error": crash})
            )
        return httpx.Response(200, content=ndjson(
            {"type": "watching", "path": "/w", "recursive": False},
            {"type": "created", "path": "/w/a", "is_dir": False, "old_path": None},
            {"type": "ping"},
            {"type": "moved", "path": "/w/d2", "is_dir": True, "old_path": "/w/d"},
            {"type": "end"},
        ))  # fmt: skip

    rec = Recorder({
        ("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX),
        ("GET", "/v1/boxes/b0x1d/files/watch"): watch,
    })  # fmt: skip

    async def main() -> None:
        async with rec.client() as client:
            box = await client.get("dev")
            async with box.files.watch("/w", recursive=False) as w:
                assert [e async for e in w] == [
                    sandlot.FileEvent("created", "/w/a"),
                    sandlot.FileEvent("moved", "/w/d2", True, "/w/d"),
                ]
            with pytest.raises(FileNotFoundError):
                await box.files.watch("/missing").start()
            with pytest.raises(sandlot.BoxCrashed):
                async for _ in box.files.watch("/crash"):
                    pass

    run(main)
    watches = [dict(r.url.params) for r in rec.requests if r.url.path.endswith("/watch")]
    assert watches[0] == {"path": "/w", "recursive": "false"}


def test_unit_directory_transfers_are_tar_streams(tmp_path: Path) -> None:
    """Links go as links (followed only when asked, and then only inside the tree); the
    server's report of what it left out comes back as warnings."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.bin").write_bytes(b"\x00" * 70_000)
    (src / "link").symlink_to("a.txt")
    received: list[dict[str, bytes]] = []

    def put_archive(request: httpx.Request) -> httpx.Response:
        import io

        got: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(request.content), mode="r:") as tar:
            for m in tar.getmembers():
                f = tar.extractfile(m) if m.isfile() else None
                got[m.name] = f.read() if f else (b"-> " + m.linkname.encode() if m.issym() else b"<dir>")
        received.append(got)
        skipped = [{"entry": "sub/dev", "reason": "a device node, which cannot be made here"}]
        return httpx.Response(200, json={"entries": len(got), "bytes": 70_005, "skipped": skipped})

    def get_archive(request: httpx.Request) -> httpx.Response:
        import io

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:") as tar:
            for name, data in (("x.txt", b"x" * 10), ("deep/y.txt", b"yy")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo("deep/z")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        return httpx.Response(200, content=buf.getvalue())

    rec = Recorder({
        ("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX),
        ("PUT", "/v1/boxes/b0x1d/files/archive"): put_archive,
        ("GET", "/v1/boxes/b0x1d/files/archive"): get_archive,
        ("GET", "/v1/boxes/b0x1d/files/stat"): httpx.Response(200, json={**FILE, "type": "dir"}),
    })  # fmt: skip

    async def main() -> None:
        async with rec.client() as client:
            box = await client.get("dev")
            with pytest.warns(sandlot.TransferWarning, match="sub/dev"):
                assert await box.files.upload(src, "/work") == 5 + 70_000
            with pytest.warns(sandlot.TransferWarning):
                assert await box.files.upload(src, "/work", follow_symlinks=True) == 5 + 70_000 + 5
            assert await box.files.download("/work", tmp_path / "out") == 12
            assert await box.files.download("/work", tmp_path / "out2", follow_symlinks=True) == 12

    run(main)
    kept = {
        ".": b"<dir>",
        "a.txt": b"alpha",
        "link": b"-> a.txt",
        "sub": b"<dir>",
        "sub/b.bin": b"\x00" * 70_000,
    }
    assert received == [kept, {**kept, "link": b"alpha"}]
    assert (tmp_path / "out" / "deep" / "y.txt").read_bytes() == b"yy"
    assert os.readlink(tmp_path / "out" / "deep" / "z") == "/etc/passwd"  # a link, never followed
    params = [dict(r.url.params) for r in rec.requests if "archive" in r.url.path]
    assert params == [{"path": "/work"}, {"path": "/work"}, {"path": "/work", "follow_symlinks": "false"},
                      {"path": "/work", "follow_symlinks": "true"}]  # fmt: skip


def test_unit_options_a_server_cannot_take_are_refused() -> None:
    rec = Recorder({("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX)})
    client = rec.client()
    for options in ({"volumes": {"/host": "/guest"}}, {"home": "/tmp/h"}, {"credentials": ("u", "p")},
                    {"engine": "firecracker"}, {"auto_remove": True}, {"template": False},
                    {"ports": ["0.0.0.0:8080:80"]}):  # fmt: skip
        with pytest.raises(sandlot.Unsupported, match="not offered over the http transport") as refused:
            client.Box("alpine", **options)
        assert refused.value.transport == "http"
    with pytest.raises(sandlot.InvalidArgument, match="unknown box option"):
        client.Box("alpine", colour="blue")
    client.Box("alpine", engine=None, accel="auto", volumes=None)  # the local defaults are fine
    client.Box("alpine", volumes={"data": "/data"})  # named volumes are the server's

    async def main() -> None:
        assert (await client.get("dev")).transport == "http"
        await client.aclose()

    run(main)
    assert len(rec.requests) == 1


# -- the WebSocket frame protocol -------------------------------------------------------------


def test_unit_frames_encode_and_decode() -> None:
    assert encode_stdin(b"hi") == b"\x00hi"
    frame = encode_output(2, 2**40 + 5, b"data")
    assert frame == b"\x02" + struct.pack(">Q", 2**40 + 5) + b"data"
    assert decode_output(frame) == (2, 2**40 + 5, b"data")
    assert decode_output(encode_output(1, 0, b"")) == (1, 0, b"")
    with pytest.raises(sandlot.ProtocolError):
        decode_output(b"\x01\x00")
    with pytest.raises(sandlot.ProtocolError):
        decode_output(encode_output(3, 0, b"x"))
    assert json.loads(control("signal", signal=15, group=True)) == {
        "type": "signal",
        "signal": 15,
        "group": True,
    }
    assert json.loads(control("stdin_eof")) == {"type": "stdin_eof"}


def test_unit_streams_drop_repeats_and_skip_gaps() -> None:
    async def main() -> None:
        s = FollowedStream(1)
        s.fresh(0, b"hello")
        s.fresh(3, b"lo world")  # resent after a reattach: only " world" is new
        s.fresh(0, b"hel")  # all old
        assert s.received == 11 and await s.read() == b"hello" and await s.read() == b" world"
        s.gap(11, 20)
        assert s.lost == 9 and s.received == 20
        with pytest.raises(sandlot.ProtocolError):
            s.fresh(25, b"x")  # bytes skipped without a gap
        assert s.offset == 11  # past the last byte read: the gap is not read yet
        s.fresh(20, b"!")
        s.end()
        assert await s.read_all() == b"!" and await s.read() == b""
        assert s.offset == 21  # where a reader that comes back asks from
        # followed from an offset (a reattach): offsets are the stream's, not this reader's
        t = FollowedStream(1)
        t.start_at(100)
        t.fresh(100, b"abc")
        t.gap(103, 110)
        t.fresh(110, b"de")
        assert await t.read() == b"abc" and t.offset == 103
        assert await t.read() == b"de" and t.offset == 112

    run(main)


class FakeServer:
    """Plays ``sandlot serve``'s process sockets: ``spawn`` streams part of the output and
    drops the connection; ``attach`` resends from a little before the client's offsets
    (the client must drop what it has), then the rest and the exit."""

    OUT = b"".join(b"line %d\n" % i for i in range(200))

    def __init__(self) -> None:
        self.stdin = b""
        self.controls: list[dict[str, Any]] = []
        self.attached: list[str] = []
        self.spawned: list[dict[str, Any]] = []
        self.eof = asyncio.Event()

    async def handler(self, ws: ServerConnection) -> None:
        path = ws.request.path if ws.request else ""
        if path.endswith("/spawn"):
            self.spawned.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "started", "id": "p1", "pid": 7}))
            half = len(self.OUT) // 2
            await ws.send(encode_output(1, 0, self.OUT[:half]))
            await ws.send(encode_output(2, 0, b"err"))
            while not self.eof.is_set():  # take stdin until its end, then drop without a close frame
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    self.stdin += msg[1:]
                else:
                    ctl = json.loads(msg)
                    self.controls.append(ctl)
                    if ctl["type"] == "stdin_eof":
                        self.eof.set()
            ws.transport.abort()
            return
        self.attached.append(path)
        offset = int(path.split("stdout=")[1].split("&")[0])
        back = max(0, offset - 10)
        await ws.send(encode_output(1, back, self.OUT[back:]))
        await ws.send(encode_output(2, 0, b"err+more"))
        await ws.send(json.dumps({"type": "exit", "exit_code": 0, "signal": None, "oom_killed": False}))
        await ws.close()


def test_unit_a_dropped_process_socket_reattaches_without_loss_or_repeat() -> None:
    fake = FakeServer()
    rec = Recorder({
        ("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX),
        ("GET", "/v1/boxes/b0x1d/processes"): httpx.Response(200, json={"processes": [
            {"id": "p1", "pid": 7, "argv": ["cat"], "tty": False, "exit_code": None, "clients": 0}]}),
    })  # fmt: skip

    async def main() -> None:
        async with serve(fake.handler, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            async with AsyncClient(url, "k", transport=httpx.MockTransport(rec)) as client:
                box = await client.get("dev")
                proc = await box.spawn("cat", env={"A": "1"}, cwd="/tmp")
                assert isinstance(proc, sandlot.AsyncProcess) and proc.pid == 7
                await proc.write_stdin(b"in" * 100_000)
                await proc.kill(15)
                await proc.close_stdin()
                result = await proc.result(timeout=10)
                assert isinstance(result, sandlot.ExecResult) and result.exit_code == 0
                assert result.stdout_bytes == FakeServer.OUT  # all of it, once
                assert result.stderr_bytes == b"err+more"

                # another client's view: attach by id, from offsets it chooses
                again = await box.attach("p1", stdout=len(FakeServer.OUT) - 8)
                assert again.argv == ("cat",) and again.pid == 7
                assert (await again.result(timeout=10)).stdout_bytes == FakeServer.OUT[-8:]

    run(main)
    assert fake.spawned == [
        {
            "type": "spawn",
            "argv": ["cat"],
            "env": {"A": "1"},
            "cwd": "/tmp",
            "tty": False,
            "stdin": True,
            "rows": 24,
            "cols": 80,
        }
    ]
    assert fake.stdin == b"in" * 100_000
    assert fake.controls == [{"type": "signal", "signal": 15, "group": True}, {"type": "stdin_eof"}]
    assert (
        fake.attached[0] == f"/v1/boxes/b0x1d/processes/p1/attach?stdout={len(FakeServer.OUT) // 2}&stderr=3"
    )


def test_unit_a_refused_spawn_raises_the_servers_error() -> None:
    async def refuse(ws: ServerConnection) -> None:
        err = {"type": "InvalidState", "code": "invalid_state", "message": "box dev is paused: cannot exec",
               "box": "dev", "state": "paused", "allowed": ["running"]}  # fmt: skip
        await ws.send(json.dumps({"type": "error", "error": err}))
        await ws.close(1008)

    rec = Recorder({("GET", "/v1/boxes/dev"): httpx.Response(200, json=BOX)})

    async def main() -> None:
        async with serve(refuse, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            async with AsyncClient(f"http://127.0.0.1:{port}", transport=httpx.MockTransport(rec)) as client:
                box = await client.get("dev")
                with pytest.raises(sandlot.InvalidState) as info:
                    await box.spawn("true")
                assert info.value.state == "paused"

    run(main)


def test_unit_a_followed_event_stream_that_ends_or_breaks_goes_on_after_the_last_event() -> None:
    """An SSE stream of events has no end while following: one that ended (a proxy's
    timeout, a server's restart) or broke is opened again after the last event id seen;
    without following, its end is the end."""

    def event(i: int) -> str:
        ev = {"id": i, "at": 1.0, "kind": "started", "box_id": "b0x1d", "box_name": "dev", "state": "running",
              "reason": None, "by": "key k", "detail": {}, "labels": {}}  # fmt: skip
        return f"id: {i}\nevent: started\ndata: {json.dumps(ev)}\n\n"

    calls: list[dict[str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(dict(request.url.params))
        if len(calls) == 2:
            raise httpx.ReadError("the connection broke")
        after = int(request.url.params.get("after", 0))
        return httpx.Response(
            200, text=": events\n\n" + event(after + 1), headers={"content-type": "text/event-stream"}
        )

    rec = Recorder({("GET", "/v1/events"): answer})

    async def main() -> tuple[list[int], list[int]]:
        async with rec.client() as client:
            followed = []
            async for ev in client.events():
                followed.append(ev.id)
                if len(followed) == 3:
                    break
            once = [ev.id async for ev in client.events(follow=False)]
        return followed, once

    followed, once = run(main)
    assert followed == [1, 2, 3]
    assert [c.get("after") for c in calls[:4]] == [None, "1", "1", "2"]  # the break retried after 1 s
    assert once == [1] and calls[-1]["follow"] == "false"
