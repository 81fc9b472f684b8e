"""Events on real boxes: a real OOM kill and a command timeout with their reasons, and a
real ``sandlot serve``'s event stream (SSE, through the remote client) and webhook,
delivered once each across a restart of the server, to a receiver on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.server.webhooks import verify

from tests.conftest import TEST_ENGINE
from tests.support.serve import create_key, serving, shared_home
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm

MEMORY_HOG = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"
SECRET = "a-webhook-secret-of-the-tests"
NS = "sandlot.namespace"  # the label of a key's namespace


def test_an_oom_kill_and_a_timeout_are_events_with_their_reasons(debian_root: Path) -> None:
    with sandlot.Box(rootfs=debian_root, memory_mib=256, engine=TEST_ENGINE) as box:
        hog = box.exec("python3", "-c", MEMORY_HOG, timeout=120)
        assert hog.oom_killed and hog.exit_code == 137, hog
        with pytest.raises(sandlot.ExecTimeout):
            box.exec("sleep", "30", timeout=1)
        assert box.exec("echo", "alive").stdout == "alive\n"
        got = {e.kind: e for e in box.events(follow=False)}
    oom, late = got["command_oom"], got["command_timeout"]
    assert oom.detail["argv"] == ["python3", "-c", MEMORY_HOG] and oom.detail["exit_code"] == 137
    assert "OOM killer" in (oom.reason or "") and oom.state == "running" and oom.box_id == box.id
    assert late.detail["argv"] == ["sleep", "30"] and late.detail["timeout"] == 1
    assert "timeout" in (late.reason or "")
    # the box's whole story, in order, ending with its removal (running) by the with block
    story = list(sandlot.events(box=box.id, follow=False))
    kinds = [e.kind for e in story]
    if kinds[2] == "snapshot":  # the tree's first boot in this home: saved as its automatic template
        assert (story[2].detail["snapshot_kind"], story[2].detail["name"]) == ("template", None)
        del kinds[2]
    assert kinds == ["created", "started", "command_oom", "command_timeout", "removed"]
    assert story[-1].detail["was"] == "running" and story[-1].state is None


class Receiver:
    """A webhook receiver on 127.0.0.1: it keeps each delivery (headers, body), answers
    503 to the first ``fail_first`` ones, and checks every signature."""

    def __init__(self, fail_first: int = 0) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.refused = fail_first
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer.lock:
                    refuse = outer.refused > 0
                    outer.refused -= refuse
                    if not refuse:
                        outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(503 if refuse else 204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def ids(self) -> list[int]:
        with self.lock:
            return [int(h["x-sandlot-event-id"]) for h, _ in self.got]

    def wait_for(self, event_id: int, timeout: float = 60) -> None:
        deadline = deadline_in(timeout)
        while event_id not in self.ids():
            assert time.monotonic() < deadline, f"event {event_id} never arrived; got {self.ids()}"
            time.sleep(0.1)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(fail_first=2)
    yield r
    r.server.shutdown()


def test_the_server_streams_events_and_its_webhook_gets_each_once_across_a_restart(
    tmp_path: Path, busybox_root: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = shared_home(tmp_path)
    monkeypatch.setenv("SANDLOT_WEBHOOK_SECRET", SECRET)
    team = create_key(home, "team-a", "--namespace", "a", "--max-boxes", "1")
    with serving(home, args=("--webhook", receiver.url)) as served:
        client = sandlot.connect(served.url, api_key=served.api_key)
        streamed: list[sandlot.Event] = []

        def follow() -> None:  # a remote client's stream, from before the first event on
            for ev in client.events():
                streamed.append(ev)
                if ev.kind == "removed" and ev.box_name == "hooked":
                    return

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        time.sleep(1.0)
        box = client.create(rootfs=str(busybox_root), name="hooked", memory_mib=256)
        box.start()
        box.stop()
        made_here = [e.id for e in sandlot.events(home=home, follow=False)]
        receiver.wait_for(made_here[-1])  # after two refusals (503), retried

        # a refusal by a key's quota is an event its own namespace sees
        ours = client.create(rootfs=str(busybox_root), name="teamed", memory_mib=256, labels={NS: "a"})
        teamed = sandlot.connect(served.url, api_key=team)
        with pytest.raises(sandlot.QuotaExceeded):
            teamed.get("teamed").fork(1)
        theirs = list(teamed.events(follow=False))
        assert [e.kind for e in theirs] == ["created", "quota_refused"], theirs
        assert theirs[1].by == "key team-a" and "quota of boxes is 1" in (theirs[1].reason or "")
        ours.remove()

        served.stop()  # what happens while no server runs is delivered by the next one
        local = sandlot.Box.get("hooked", home=home)
        local.start()
        local.remove(force=True)
        served.restart()
        every = list(sandlot.events(home=home, follow=False))
        receiver.wait_for(every[-1].id)
        follower.join(60)
        assert not follower.is_alive(), [(e.id, e.kind) for e in streamed]

    # each event once, in order, signed; the last ones made by this process, not the server
    assert receiver.ids() == [e.id for e in every], (receiver.ids(), [e.id for e in every])
    for (headers, body), ev in zip(receiver.got, every, strict=True):
        assert verify(SECRET.encode(), headers, body)
        assert not verify(b"another secret of 16+ bytes", headers, body)
        assert json.loads(body) == ev.to_json() and headers["x-sandlot-event"] == ev.kind
    by = {e.kind: e.by for e in every if e.box_name == "hooked"}
    assert by["created"].startswith("key admin-") and by["removed"].startswith("process ")
    # the stream went on through the restart (its client reconnected after the last id
    # it saw), and showed the admin key every event of the home, the team's included
    assert [e.id for e in streamed] == [e.id for e in every if e.id <= streamed[-1].id]
    hooked = [e for e in streamed if e.box_name == "hooked"]
    assert [e.kind for e in hooked] in (
        ["created", "started", "stopped", "started", "removed"],
        # the first boot of its root filesystem in this home: saved as the automatic template
        ["created", "started", "snapshot", "stopped", "started", "removed"],
    ), hooked
    for e in hooked:
        assert e.kind != "snapshot" or (e.detail["snapshot_kind"], e.detail["name"]) == ("template", None)


def test_a_stream_shows_a_key_only_its_namespace_and_refuses_bad_queries(
    tmp_path: Path, busybox_root: Path
) -> None:
    home = shared_home(tmp_path)
    a, b = create_key(home, "ns-a", "--namespace", "a"), create_key(home, "ns-b", "--namespace", "b")
    with serving(home) as served:
        admin = sandlot.connect(served.url, api_key=served.api_key)
        admin.create(rootfs=str(busybox_root), name="of-a", memory_mib=256, labels={NS: "a"}).remove()
        seen_by_a = [e.box_name for e in sandlot.connect(served.url, api_key=a).events(follow=False)]
        assert seen_by_a == ["of-a", "of-a"]
        assert list(sandlot.connect(served.url, api_key=b).events(follow=False)) == []
        with served.client(a) as c:
            for query in ({"after": "-1"}, {"since": "soon"}, {"box": ""}):
                r = c.get("/v1/events", params={**query, "follow": "false"})
                assert r.status_code == 400, (query, r.status_code, r.text)
            r = c.get("/v1/events", params={"follow": "false"}, headers={"Last-Event-ID": "x"})
            assert r.status_code == 400 and "Last-Event-ID" in r.text
            first = sandlot.connect(served.url, api_key=a).events(follow=False).__next__()
            r = c.get("/v1/events", params={"follow": "false"}, headers={"Last-Event-ID": str(first.id)})
            assert r.status_code == 200 and f"id: {first.id}\n" not in r.text and "event: removed" in r.text
