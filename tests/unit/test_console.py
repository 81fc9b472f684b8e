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
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from sandlot.errors import NotFound
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
        assert httpx.get(f"{srv.url}/console/nope.js").status_code == 404
        assert httpx.get(f"{srv.url}/consoleX").status_code == 401  # only /console and under it are open
        assert httpx.get(f"{srv.url}/v1/boxes").status_code == 401  # the page is open, the API is not


OUTSIDE = ["../app.py", "../../errors.py", "%2e%2e/app.py", ".hidden", "vendor/../../app.py", "a\\b.js",
           "console.css/", "vendor//xterm.css", "vendor", "nope.js"]  # fmt: skip


@pytest.mark.parametrize("path", OUTSIDE)
def test_nothing_but_the_console_s_own_files_is_served(path: str) -> None:
    with pytest.raises(NotFound):
        body, _ = console._asset(path)
        assert b"import" not in body  # a file outside the console's folder


def test_a_page_of_another_origin_is_refused(tmp_path: Path) -> None:
    with serving(tmp_path / "home", auth=False, allow_hosts=("x.test",)) as srv:
        host = srv.url.removeprefix("http://")
        assert httpx.get(f"{srv.url}/v1/boxes", headers={"Origin": srv.url}).status_code == 200
        for origin in ("http://evil.example", "http://127.0.0.1:1", "null"):
            r = httpx.post(f"{srv.url}/v1/boxes/any/stop", headers={"Origin": origin})
            assert r.status_code == 403 and origin in r.json()["error"]["message"], r.text
        assert httpx.get(
            f"{srv.url}/v1/info", headers={"Origin": "https://x.test", "Host": "x.test"}
        ).is_success
        with pytest.raises(InvalidStatus) as refused:
            connect(f"ws://{host}/v1/exec", origin="http://evil.example")  # type: ignore[arg-type]
        assert refused.value.response.status_code == 403
        with connect(f"ws://{host}/v1/exec", origin=srv.url) as ws:  # type: ignore[arg-type]
            ws.send(json.dumps({"id": 1, "box": "nope", "argv": ["true"]}))
            assert json.loads(ws.recv(timeout=10))["error"]["code"] == "box_not_found"


def test_the_key_subprotocol_counts_on_a_websocket_only(tmp_path: Path) -> None:
    with serving(tmp_path / "home") as srv:
        assert srv.api_key is not None
        as_header = {"Sec-WebSocket-Protocol": ", ".join(offered(srv.api_key))}
        assert httpx.get(f"{srv.url}/v1/boxes", headers=as_header).status_code == 401


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


def test_pools_and_latest_samples_show_only_the_key_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandlot
    from sandlot.server.state import NAMESPACE_LABEL

    monkeypatch.setenv("SANDLOT_POOL_REFILL", "0")  # the detached refiller knows no fake engine
    home = tmp_path / "home"
    root = fake_rootfs(tmp_path)
    with serving(home) as srv:
        own = srv.key("team-a", namespace="a", admin=True)
        other = srv.key("team-b", namespace="b", admin=True)
        made = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": str(root)},
                          headers={"Authorization": f"Bearer {own}"}, timeout=60)  # fmt: skip
        assert made.status_code == 201, made.text
        t = sandlot.template(rootfs=root, engine="fake", home=home, memory_mib=256, name="t-a",
                             labels={NAMESPACE_LABEL: "a"}, pool=1)  # fmt: skip
        for key, seen, pooled in ((own, [made.json()["id"]], [t.id]), (other, [], [])):
            latest = httpx.get(f"{srv.url}/v1/metrics/latest", headers={"Authorization": f"Bearer {key}"})
            assert latest.status_code == 200
            assert [b["id"] for b in latest.json()["boxes"]] == seen
            pools = httpx.get(f"{srv.url}/v1/pools", headers={"Authorization": f"Bearer {key}"})
            assert pools.status_code == 200
            assert [p["template_id"] for p in pools.json()["pools"]] == pooled
            assert all(p["size"] == 1 for p in pools.json()["pools"])


@pytest.mark.parametrize("path", ["/console/index.html", "/console/console.css", "/console/vendor/xterm.css"])
def test_every_file_is_served_with_its_type(tmp_path: Path, path: str) -> None:
    with serving(tmp_path / "home", auth=False) as srv:
        r = httpx.get(f"{srv.url}{path}")
        assert r.status_code == 200
        kind = {"html": "text/html", "css": "text/css"}[path.rsplit(".", 1)[1]]
        assert r.headers["content-type"].startswith(kind)
