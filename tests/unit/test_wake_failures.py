"""A wake that fails, on every face: the caller that woke a sleeping box (a command, a
file, a port route of ``sandlot serve``) gets the reason as the error of its kind,
which a server answers 503 Service Unavailable, with ``Retry-After`` where the cause
passes by itself (a host saturated with wakes: the line's bounded wait). The fake
engine's boxes, through the real core and the server's real application; the wake
itself on real VMs is tests/vm/test_wake.py."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sandlot
from sandlot.core import admission
from sandlot.errors import BootError, BoxBusy, InvalidState, SandlotError, StoreBusy, from_dict

from tests.support.fake_engine import FakeEngine, fake_rootfs, register
from tests.support.inproc import InProcess, serving


def test_unit_a_failed_wake_keeps_its_kind_and_says_503_with_retry_after_where_it_passes() -> None:
    busy = BoxBusy("no VM could start within 120s: the host is saturated", box="dev").while_waking()
    assert isinstance(busy, InvalidState) and busy.code == "box_busy"
    assert busy.status == 503 and busy.http_headers() == {"Retry-After": "5"}
    assert busy.to_dict()["waking"] is True and busy.to_dict()["retry_after"] == 5
    again = from_dict({**busy.to_dict(), "type": "BoxBusy"})  # a remote caller's
    assert isinstance(again, BoxBusy) and again.waking and again.status == 503

    lost = BootError("the saved state cannot be loaded", "console", box="dev").while_waking()
    assert lost.status == 503 and lost.http_headers() == {}  # it will not pass by waiting
    assert BoxBusy("held").status == 423 and BoxBusy("held").http_headers() == {}  # no wake: its own
    assert "waking" not in BoxBusy("held").to_dict()
    assert StoreBusy("locked").http_headers() == {"Retry-After": "5"}  # a 503 of its own kind


def test_unit_the_line_s_wait_is_bounded_by_the_caller_s_wake_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = admission.Admission(tmp_path / "slots", 1)

    async def main() -> tuple[float, str]:
        async with line.turn():  # the one slot, held
            t0 = time.monotonic()
            with admission.waiting_at_most(0.3), pytest.raises(BoxBusy) as refused:
                async with line.turn():
                    pass
            return time.monotonic() - t0, str(refused.value)

    waited, why = asyncio.run(main())
    assert 0.25 < waited < 5 and "within 0s: the host is saturated (1 start at once" in why
    monkeypatch.setenv("SANDLOT_WAKE_WAIT", "7.5")
    assert admission.wake_wait() == 7.5
    for bad in ("soon", "-3"):
        monkeypatch.setenv("SANDLOT_WAKE_WAIT", bad)
        assert admission.wake_wait() in (admission.WAKE_WAIT, 1.0)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[InProcess, sandlot.Snapshot]]:
    register()
    home = tmp_path / "home"
    root = fake_rootfs(tmp_path)
    with serving(home) as srv:
        tmpl = sandlot.template(rootfs=str(root), name="fake-tpl", memory_mib=256, engine="fake", home=home)
        yield srv, tmpl


def _sleeping(srv: InProcess, tmpl: sandlot.Snapshot) -> str:
    with sandlot.connect(srv.url, api_key=srv.api_key) as client:
        box = client.Box(template=tmpl.id).start()
        assert box.exec("echo", "up").stdout == "up\n"
        box.suspend()
        return box.id


def test_unit_a_wake_that_cannot_load_the_state_answers_503_with_the_reason(
    served: tuple[InProcess, sandlot.Snapshot],
) -> None:
    srv, tmpl = served
    box_id = _sleeping(srv, tmpl)
    FakeEngine.of(srv.home).fail_restore = True
    headers = {"Authorization": f"Bearer {srv.api_key}"}
    r = httpx.post(f"{srv.url}/v1/boxes/{box_id}/exec", json={"argv": ["echo", "hi"]}, headers=headers,
                   timeout=60)  # fmt: skip
    err = r.json()["error"]
    assert r.status_code == 503 and "Retry-After" not in r.headers, r.text
    assert err["waking"] is True and "the saved state cannot be loaded" in err["message"]
    # a port of the box on the content listener: the same answer
    r = httpx.get(f"{srv.content_url}/v1/boxes/{box_id}/ports/8000/", headers=headers, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["waking"] is True, r.text
    # through the HTTP backend: the error of its kind, marked
    with sandlot.connect(srv.url, api_key=srv.api_key) as client:
        box = client.get(box_id)
        with pytest.raises(SandlotError) as failed:
            box.exec("echo", "hi")
        assert failed.value.waking and failed.value.status == 503
        FakeEngine.of(srv.home).fail_restore = False
        box.remove(force=True)


@pytest.fixture
def own_runtime_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sl-"))  # short: a unix socket's path holds 107 bytes at most
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_unit_wakes_past_the_host_s_line_wait_answer_503_with_retry_after(
    served: tuple[InProcess, sandlot.Snapshot], own_runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, tmpl = served
    slow, waiting = _sleeping(srv, tmpl), _sleeping(srv, tmpl)
    monkeypatch.setenv("SANDLOT_MAX_STARTING", "1")  # one wake at a time, host-wide
    monkeypatch.setenv("SANDLOT_WAKE_WAIT", "1")
    # the host's slots of this test's own: other processes' VMs hold those of the host
    monkeypatch.setenv("SANDLOT_RUNTIME_DIR", str(own_runtime_dir))
    engine = FakeEngine.of(srv.home)
    engine.restore_seconds = 4.0
    headers = {"Authorization": f"Bearer {srv.api_key}"}
    answers: dict[str, Any] = {}

    def call(box_id: str) -> None:
        answers[box_id] = httpx.post(f"{srv.url}/v1/boxes/{box_id}/exec", json={"argv": ["echo", "hi"]},
                                     headers=headers, timeout=60)  # fmt: skip

    first = threading.Thread(target=call, args=(slow,))
    first.start()
    time.sleep(1.0)  # the first wake holds the one slot
    call(waiting)
    first.join()
    engine.restore_seconds = 0.0
    turned_away = answers[waiting]
    assert turned_away.status_code == 503 and turned_away.headers["Retry-After"] == "5", turned_away.text
    err = turned_away.json()["error"]
    assert err["code"] == "box_busy" and err["waking"] and "the host is saturated" in err["message"]
    assert answers[slow].status_code == 200 and answers[slow].json()["stdout"] == "hi\n"
    # nothing was lost: the box turned away is asleep as it was, and wakes on the next try
    with sandlot.connect(srv.url, api_key=srv.api_key) as client:
        box = client.get(waiting)
        assert box.refresh() == "suspended"
        assert box.exec("echo", "later").stdout == "later\n"
