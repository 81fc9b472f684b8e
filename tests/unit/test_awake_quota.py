"""A namespace's quota of awake boxes (``core/awake.py``): boxes a key made come up at
most ``max_awake`` at a time, however they come up (a start, a resume, a wake on a
call); past it, the namespace's idle box that sleeps anyway is put to sleep first, and
where none can go the box stays as it was (429 for a start, 503 with Retry-After for a
wake). The server's real application in this process, over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sandlot
from sandlot.core import idle, pressure
from sandlot.core.access import KEY_LABEL, NAMESPACE_LABEL

from tests.support.fake_engine import fake_rootfs, register
from tests.support.inproc import InProcess, serving


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcess]:
    register()
    monkeypatch.setattr(idle, "spawn", lambda home, box_id: None)  # no idle watchdog: boxes sleep only so
    monkeypatch.setattr(pressure, "MIN_IDLE", 0.3)
    home = tmp_path / "home"
    root = fake_rootfs(tmp_path)
    with serving(home) as served:
        for scope in ({NAMESPACE_LABEL: "team"}, {NAMESPACE_LABEL: "open"}):  # a template each may see
            sandlot.template(rootfs=str(root), name=f"tpl-{scope[NAMESPACE_LABEL]}", memory_mib=256,
                             engine="fake", labels=scope, home=home)  # fmt: skip
        yield served


def client(srv: InProcess, key: str) -> Any:
    return sandlot.connect(srv.url, api_key=key)


def test_unit_a_box_past_the_quota_puts_the_least_recently_used_idle_one_to_sleep(srv: InProcess) -> None:
    import time

    key = srv.key("team-a", namespace="team", max_awake=2)
    with client(srv, key) as c:
        a, b, newest = (c.Box(template="tpl-team", idle_timeout=3600) for _ in range(3))
        a.start()
        b.start()
        time.sleep(0.5)
        b.exec("true")  # a is idle the longest
        time.sleep(0.4)
        newest.start()
        assert [x.refresh() for x in (a, b, newest)] == ["suspended", "running", "running"]
        (slept,) = [e for e in a.events(follow=False) if e.kind == "suspended"]
        assert slept.by == "quota"
        assert "namespace team is at its quota of 2 awake boxes" in (slept.reason or "")
        # a call wakes a: the idle one of the others goes
        time.sleep(0.4)
        assert a.exec("echo", "awake").stdout == "awake\n"
        assert sorted(x.refresh() for x in (a, b, newest)).count("running") == 2
        for x in (a, b, newest):
            x.remove(force=True)


def test_unit_with_none_able_to_sleep_a_start_is_refused_and_a_wake_answers_503(srv: InProcess) -> None:
    key = srv.key("solo", max_awake=1)  # no namespace: the key's own boxes
    key_id = key.split("-")[2]
    sandlot.template(rootfs=str(fake_rootfs(srv.home.parent)), name="tpl-solo", memory_mib=256, engine="fake",
                     labels={KEY_LABEL: key_id}, home=srv.home)  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    with client(srv, key) as c:
        sleeper = c.Box(template="tpl-solo", idle_timeout=3600).start()
        sleeper.suspend()
        never = c.Box(template="tpl-solo").start()  # never sleeps: it holds the one place
        other = c.Box(template="tpl-solo")
        with pytest.raises(sandlot.QuotaExceeded) as refused:
            other.start()
        assert refused.value.limit == "awake" and refused.value.value == 1
        assert other.refresh() == "new"  # not made: nothing of it is left
        assert sorted(b.id for b in c.list()) == sorted([sleeper.id, never.id])
        r = httpx.post(f"{srv.url}/v1/boxes/{sleeper.id}/exec", json={"argv": ["true"]}, headers=headers,
                       timeout=60)  # fmt: skip
        err = r.json()["error"]
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert (
            err["code"] == "quota_exceeded"
            and err["waking"]
            and "none is idle and able to sleep" in err["message"]
        )
        assert sleeper.refresh() == "suspended"  # as it was
        never.stop()  # a place: the wake goes through
        assert sleeper.exec("echo", "up").stdout == "up\n"
        for x in (sleeper, never, other):
            x.remove(force=True)


def test_unit_boxes_of_keys_without_the_quota_are_not_counted_or_touched(srv: InProcess) -> None:
    free = srv.key("free", namespace="open")
    with client(srv, free) as c:
        boxes = [c.Box(template="tpl-open", idle_timeout=3600).start() for _ in range(3)]
        assert [b.refresh() for b in boxes] == ["running"] * 3
        for b in boxes:
            b.remove(force=True)
