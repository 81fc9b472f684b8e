"""The console's server side, on the fake engine: its files and their headers, a key
offered as a WebSocket subprotocol, and the two routes a table of boxes reads. The
console in a real browser against a real server and real VMs is tests/vm/test_console.py."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from sandlot.server import console

from tests.support.fake_engine import fake_rootfs
from tests.support.inproc import serving

CONSOLE = Path(console.__file__).with_name("console")


def offered(key: str) -> list[str]:
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return ["sandlot", f"sandlot.key.{encoded}"]


def test_the_files_need_no_key_and_carry_a_strict_policy(tmp_path: Path) -> None:
    with serving(tmp_path / "home") as srv:
        root = httpx.get(f"{srv.url}/")
        assert root.status_code == 307 and root.headers["location"] == "/console/"
        page = httpx.get(f"{srv.url}/console/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self';" in csp and "unsafe-eval" not in csp
        assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
        assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assert "set-cookie" not in page.headers
        js = httpx.get(f"{srv.url}/console/app.js")
        assert js.headers["content-type"].startswith("text/javascript")
        assert httpx.get(f"{srv.url}/console/vendor/xterm.mjs").status_code == 200
        for bad in ("/console/../app.py", "/console/%2e%2e/app.py", "/console/.hidden", "/console/nope.js"):
            r = httpx.get(f"{srv.url}{bad}")
            assert r.status_code in (401, 404), bad  # a client may fold ".." away first: then no console path
            assert "import" not in r.text
        assert httpx.get(f"{srv.url}/v1/boxes").status_code == 401  # the page is open, the API is not


def test_no_file_has_inline_script_or_markup_from_data() -> None:
    html = (CONSOLE / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script type="module" src="app.js">']
    assert re.findall(r"<script[^>]*>(.*?)</script>", html, re.S) == [""]  # its body is empty
    assert not re.search(r"\son\w+=", html)  # no inline handlers
    for js in CONSOLE.glob("*.js"):
        text = js.read_text()
        sinks = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function")
        for sink in sinks:
            assert sink not in text, f"{js.name} uses {sink}"
        assert "localStorage" not in text and "document.cookie" not in text, js.name  # the key: this tab only


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")


def test_a_websocket_takes_the_key_as_a_subprotocol(tmp_path: Path) -> None:
    with serving(tmp_path / "home") as srv:
        assert srv.api_key is not None
        r = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": str(fake_rootfs(tmp_path))},
                       headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        box = r.json()["id"]
        ws_url = srv.url.replace("http", "ws") + f"/v1/boxes/{box}/spawn"
        with connect(ws_url, subprotocols=offered(srv.api_key)) as ws:  # type: ignore[arg-type]
            assert ws.subprotocol == "sandlot"
            ws.send(json.dumps({"type": "spawn", "argv": ["cat"]}))
            first = json.loads(ws.recv(timeout=10))
            assert first["type"] == "started", first
        with connect(ws_url, subprotocols=offered("sk-wrong")) as ws:  # type: ignore[arg-type]
            refused = json.loads(ws.recv(timeout=10))
            assert refused["type"] == "error" and refused["error"]["code"] == "unauthorized"
        with connect(ws_url, subprotocols=["sandlot", "sandlot.key.%%%"]) as ws:  # type: ignore[arg-type]
            assert "base64url" in json.loads(ws.recv(timeout=10))["error"]["message"]


def test_the_key_subprotocol_never_reaches_an_app_in_a_box() -> None:
    from sandlot.server.state import app_subprotocols, key_from_subprotocols

    assert app_subprotocols(["graphql-ws", *offered("sk-secret")]) == ["graphql-ws"]
    assert key_from_subprotocols(", ".join(offered("sk-ünïcode"))) == "sk-ünïcode"
    assert key_from_subprotocols("graphql-ws") is None


def test_pools_and_latest_samples_show_only_the_key_s_own(tmp_path: Path) -> None:
    with serving(tmp_path / "home") as srv:
        own = srv.key("team-a", namespace="a", admin=True)
        other = srv.key("team-b", namespace="b", admin=True)
        root = str(fake_rootfs(tmp_path))
        made = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": root},
                          headers={"Authorization": f"Bearer {own}"}, timeout=60)  # fmt: skip
        assert made.status_code == 201, made.text
        for key, seen in ((own, [made.json()["id"]]), (other, [])):
            latest = httpx.get(f"{srv.url}/v1/metrics/latest", headers={"Authorization": f"Bearer {key}"})
            assert latest.status_code == 200
            assert [b["id"] for b in latest.json()["boxes"]] == seen
            pools = httpx.get(f"{srv.url}/v1/pools", headers={"Authorization": f"Bearer {key}"})
            assert pools.status_code == 200 and pools.json() == {"pools": []}


@pytest.mark.parametrize("path", ["/console/index.html", "/console/console.css", "/console/vendor/xterm.css"])
def test_every_file_is_served_with_its_type(tmp_path: Path, path: str) -> None:
    with serving(tmp_path / "home", auth=False) as srv:
        r = httpx.get(f"{srv.url}{path}")
        assert r.status_code == 200
        kind = {"html": "text/html", "css": "text/css"}[path.rsplit(".", 1)[1]]
        assert r.headers["content-type"].startswith(kind)
