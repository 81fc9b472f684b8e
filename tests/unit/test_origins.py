"""Boxes' content on an origin of its own, and what every listener checks before any route
(``server/origins.py``): the server's application in this process on its two real
sockets, over the fake engine, whose agent relays a box's port to a small HTTP app of
this test. The attacks a box's page makes in Chromium against a real ``sandlot serve``
and real VMs are tests/vm/test_origins.py."""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.errors import InvalidArgument
from sandlot.server import origins
from sandlot.server.bridge import app_cookie
from sandlot.server.origins import Names, browser_refusal, same_origin, split_host

from tests.support.fake_engine import FakeEngine, fake_rootfs, register
from tests.support.inproc import InProcess, serving

PORT_DOMAIN = "apps.sandlot.test"  # only ever sent as a Host header to 127.0.0.1
BOX_PORT = 8080


# -- names, origins and browsers' requests ----------------------------------------------------


@pytest.mark.parametrize(("host", "parsed"), [
    ("127.0.0.1:7070", ("127.0.0.1", 7070)), ("LocalHost", ("localhost", None)), ("[::1]:80", ("::1", 80)),
    ("a.example:443", ("a.example", 443)), ("::1", None), ("[::1", None), ("x:0", None), ("x:99999", None),
    ("x:port", None), (":80", None), ("", None), ("[::1]x", None),
])  # fmt: skip
def test_a_host_header_is_split_into_its_name_and_port(host: str, parsed: Any) -> None:
    assert split_host(host) == parsed


def test_names_and_origins_given_to_the_server_are_checked_and_put_in_one_form() -> None:
    assert origins.check_host_name("Sandlot.Example.COM") == "sandlot.example.com"
    assert origins.check_host_name("[::1]") == "::1" and origins.check_host_name("10.0.0.5") == "10.0.0.5"
    for bad in ("*.example.com", "*", "example.com:8080", "http://example.com", "-x.example", "a..b", "", 7):
        with pytest.raises(InvalidArgument, match="--allow-host"):
            origins.check_host_name(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="an address"):
        origins.check_host_name("127.0.0.1", "--port-domain", addresses=False)
    assert origins.check_origin("HTTPS://App.Example.com:443") == "https://app.example.com"
    assert origins.check_origin("http://localhost:3000/") == "http://localhost:3000"
    assert origins.check_origin("http://[::1]:8080") == "http://[::1]:8080"
    for bad in ("*", "null", "app.example.com", "ftp://x.test", "https://x.test/path", "https://u@x.test",
                "https://x.test?q=1", "https://x.test:99999", "https://", None):  # fmt: skip
        with pytest.raises(InvalidArgument, match="--allow-origin"):
            origins.check_origin(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="--content-url"):
        origins.check_content_url("https://content.example.com/boxes")


def test_an_origin_is_the_request_s_own_only_at_the_same_name_and_port() -> None:
    assert same_origin("http://127.0.0.1:7070", "127.0.0.1:7070")
    assert not same_origin("http://127.0.0.1:7071", "127.0.0.1:7070")  # the content listener's page
    assert same_origin("https://x.test", "x.test") and same_origin("http://x.test:80", "x.test")
    assert not same_origin("https://x.test:8443", "x.test")  # a Host without a port was for the default one
    assert not same_origin("http://evil.test:7070", "127.0.0.1:7070")
    assert not same_origin("null", "127.0.0.1:7070") and not same_origin("http://x.test", None)


def test_a_listener_answers_loopback_s_names_and_addresses_and_those_it_is_given() -> None:
    loop = Names(frozenset({"localhost", "api.example.com"}), any_address=False)
    for host in ("localhost:7070", "127.0.0.1:7070", "127.5.6.7", "[::1]:7070", "[::ffff:127.0.0.1]:1",
                 "API.example.com", None):  # fmt: skip
        assert loop.serves(host), host
    for host in ("evil.test:7070", "10.0.0.5:7070", "localhost.:7070", "sub.localhost", "", "[::1",
                 "8080-abc.apps.sandlot.test"):  # fmt: skip
        assert not loop.serves(host), host
    hosts = origins.port_host_pattern(PORT_DOMAIN)
    wide = Names(frozenset({"localhost"}), any_address=True, port_hosts=hosts)
    assert wide.serves("10.0.0.5:7070") and wide.serves("[2001:db8::1]:7070")
    assert wide.serves(f"8080-abc.{PORT_DOMAIN}:7071") and not wide.serves("evil.test")


NAVIGATION = {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate", "sec-fetch-dest": "document"}


@pytest.mark.parametrize(("headers", "method", "refused"), [
    ({}, "POST", False),  # not a browser
    ({"origin": "http://127.0.0.1:7070", "sec-fetch-site": "same-origin"}, "POST", False),  # the console
    ({"sec-fetch-site": "none"}, "GET", False),  # an address typed, a bookmark
    ({"origin": "http://127.0.0.1:7071", "sec-fetch-site": "same-site"}, "POST", True),  # a box's page
    ({"origin": "http://evil.test"}, "GET", True),  # an old browser: Origin alone
    ({"origin": "null"}, "POST", True),  # a sandboxed frame
    ({"sec-fetch-site": "same-site", "sec-fetch-mode": "no-cors", "sec-fetch-dest": "script"}, "GET", True),
    ({"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate", "sec-fetch-dest": "iframe"}, "GET", True),
    (NAVIGATION, "GET", False),  # a link followed at the top: the page that had it reads nothing
    ({**NAVIGATION, "origin": "http://evil.test"}, "POST", True),  # a form posted at the top
    ({"origin": "https://app.example.com", "sec-fetch-site": "cross-site"}, "POST", False),  # allowed
])  # fmt: skip
def test_the_api_takes_no_request_a_browser_made_for_a_page_of_another_origin(
    headers: dict[str, str], method: str, refused: bool
) -> None:
    allowed = frozenset({"https://app.example.com"})
    why = browser_refusal({"host": "127.0.0.1:7070", **headers}, method, allowed, api=True)
    assert (why is not None) == refused, why


def test_the_content_listener_checks_the_origin_alone() -> None:
    """Apps in boxes are loaded by other sites' pages as any web app is (a link, an
    image); a page of another origin still posts nothing to them."""
    content = {"host": "127.0.0.1:7071"}
    assert browser_refusal({**content, "sec-fetch-site": "cross-site"}, "GET", frozenset(), api=False) is None
    assert browser_refusal({**content, "origin": "http://evil.test"}, "POST", frozenset(), api=False)


@pytest.mark.parametrize(("cookie", "prefix", "kept"), [
    ("a=1", "/p/TOKEN", "a=1; Path=/p/TOKEN/"),
    ("a=1; Path=/", "/v1/boxes/dev/ports/80", "a=1; Path=/v1/boxes/dev/ports/80/"),
    ("a=1; Path=/app; HttpOnly", "/p/T", "a=1; HttpOnly; Path=/p/T/app"),
    ("a=1; Path=/p/T/app", "/p/T", "a=1; Path=/p/T/app"),  # an app that knows its prefix
    ("a=1; Domain=127.0.0.1; Path=/; Secure", "/p/T", "a=1; Secure; Path=/p/T/"),
    ("a=1; domain=.sandlot.test", "", "a=1; Path=/"),  # on a host of its own: that host alone
    ("a=1; Path=/x; SameSite=Strict", "", "a=1; SameSite=Strict; Path=/x"),
    ("sandlot_preview=forged; Path=/", "", None),  # the server's own cookie
    ("Sandlot_other=1", "/p/T", None),
])  # fmt: skip
def test_an_app_s_cookie_is_kept_to_its_own_path_or_host(cookie: str, prefix: str, kept: str | None) -> None:
    out = app_cookie(cookie.encode(), prefix)
    assert (out.decode() if out is not None else None) == kept


# -- the two listeners, in process ------------------------------------------------------------


class _App(BaseHTTPRequestHandler):
    """The app a box serves: a page, and what an app may try to set beyond itself."""

    def do_GET(self) -> None:
        body = f"hello from the box: {self.path} host={self.headers['Host']}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        for cookie in ("a=1", "b=2; Domain=127.0.0.1; Path=/", "sandlot_preview=forged"):
            self.send_header("Set-Cookie", cookie)
        self.send_header("Clear-Site-Data", '"*"')
        self.send_header("Service-Worker-Allowed", "/")
        self.send_header("X-App", "kept")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def box_app() -> Iterator[tuple[str, int]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _App)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def open_server(
    tmp_path_factory: pytest.TempPathFactory, box_app: tuple[str, int]
) -> Iterator[dict[str, Any]]:
    """A --no-auth server with --port-domain and a box whose port 8080 is ``box_app``."""
    register()
    tmp = tmp_path_factory.mktemp("origins")
    before = os.environ.get("SANDLOT_ENGINE")
    os.environ["SANDLOT_ENGINE"] = "fake"
    try:
        with serving(tmp / "home", auth=False, port_domain=PORT_DOMAIN) as srv:
            FakeEngine.of(srv.home).ports[BOX_PORT] = box_app
            r = httpx.post(f"{srv.url}/v1/boxes", json={"rootfs": str(fake_rootfs(tmp)), "name": "web"},
                           timeout=60)  # fmt: skip
            assert r.status_code == 201, r.text
            yield {"srv": srv, "box": r.json()["id"]}
    finally:
        if before is None:
            os.environ.pop("SANDLOT_ENGINE", None)
        else:
            os.environ["SANDLOT_ENGINE"] = before


def _error(r: httpx.Response, status: int, code: str) -> str:
    """The message of an error answer, in sandlot's shape (or E2B's, under /e2b)."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    if r.url.path.startswith("/e2b/"):
        assert body["code"] == status, body
        return str(body["message"])
    assert body["error"]["code"] == code, body
    return str(body["error"]["message"])


def _upgrade(url: str, **headers: str) -> httpx.Response:
    """A WebSocket handshake that the server refuses: its HTTP answer."""
    key = base64.b64encode(os.urandom(16)).decode()
    return httpx.get(url, headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Key": key,
                                   "Sec-WebSocket-Version": "13", **headers}, timeout=10)  # fmt: skip


def test_box_content_is_served_on_the_content_listener_alone(open_server: dict[str, Any]) -> None:
    srv: InProcess = open_server["srv"]
    box = open_server["box"]
    route = f"/v1/boxes/{box}/ports/{BOX_PORT}/page"
    r = httpx.get(srv.content_url + route)
    assert r.status_code == 200 and r.text.startswith("hello from the box: /page"), r.text
    moved = _error(httpx.get(srv.url + route), 421, "misdirected_request")
    assert "never served on the API's origin" in moved and srv.content_url + route in moved
    _error(httpx.post(srv.url + route), 421, "misdirected_request")
    assert _upgrade(srv.url.replace("http", "ws", 1) + route).status_code == 421
    preview = httpx.post(f"{srv.url}/v1/boxes/{box}/previews", json={"port": BOX_PORT}).json()
    assert preview["url"].startswith(srv.content_url + "/p/"), preview
    assert httpx.get(preview["url"] + "page").text.startswith("hello from the box: /page")
    # a preview link of the API's origin (made before the two were apart) moves a browser there
    old = srv.url + preview["url"].removeprefix(srv.content_url)
    r = httpx.get(old + "page?x=1")
    assert r.status_code == 307 and r.headers["location"] == preview["url"] + "page?x=1"
    _error(httpx.post(old + "page"), 421, "misdirected_request")
    assert httpx.get(f"{srv.url}/v1/info").json()["content_url"] == srv.content_url


API_PATHS = ["/", "/console/", "/v1/boxes", "/v1/info", "/mcp", "/e2b/sandboxes", "/docs", "/openapi.json",
             "/metrics", "/v1/boxes/web/exec"]  # fmt: skip


@pytest.mark.parametrize("path", API_PATHS)
def test_the_content_listener_serves_nothing_of_the_api_s(open_server: dict[str, Any], path: str) -> None:
    srv: InProcess = open_server["srv"]
    for method in ("GET", "POST"):
        why = _error(httpx.request(method, srv.content_url + path), 421, "misdirected_request")
        assert "listener of boxes' content" in why
    assert _upgrade(srv.content_url.replace("http", "ws", 1) + "/v1/exec").status_code == 421
    assert httpx.get(srv.content_url + "/health").json()["status"] == "ok"  # for a proxy's checks


def test_a_port_host_is_a_name_of_the_content_listener_alone(open_server: dict[str, Any]) -> None:
    srv: InProcess = open_server["srv"]
    box = open_server["box"]
    host = f"{BOX_PORT}-{box}.{PORT_DOMAIN}"
    r = httpx.get(srv.content_url + "/page", headers={"Host": host})
    assert r.status_code == 200 and r.text.startswith("hello from the box: /page"), r.text
    r = httpx.get(srv.url + "/v1/info", headers={"Host": host})
    assert "is not a name this server answers to for the API" in _error(r, 421, "misdirected_request")
    preview = httpx.post(f"{srv.url}/v1/boxes/{box}/previews", json={"port": BOX_PORT}).json()
    port = srv.content_url.rsplit(":", 1)[1]
    assert preview["host_url"].startswith(f"http://{host}:{port}/?sandlot_token="), preview


def test_a_rebound_name_reaches_nothing_on_either_listener(open_server: dict[str, Any]) -> None:
    """What a browser sends once a site's own name points here: its name in Host, and its
    page's origin (the same) in Origin; on a --no-auth server, where nothing else stops it."""
    srv: InProcess = open_server["srv"]
    box = open_server["box"]
    for base in (srv.url, srv.content_url):
        port = base.rsplit(":", 1)[1]
        rebound = {"Host": f"rebind.test:{port}", "Origin": f"http://rebind.test:{port}",
                   "Sec-Fetch-Site": "same-origin"}  # fmt: skip
        for method, path in (("POST", f"/v1/boxes/{box}/exec"), ("GET", "/v1/boxes"), ("GET", "/health"),
                             ("GET", f"/v1/boxes/{box}/ports/{BOX_PORT}/page")):  # fmt: skip
            r = httpx.request(method, base + path, headers=rebound, json={"argv": ["true"]})
            assert "not a name this server answers to" in _error(r, 421, "misdirected_request"), (base, path)
        assert _upgrade(base.replace("http", "ws", 1) + "/v1/exec", **rebound).status_code == 421
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert httpx.get(base + "/health", headers={"Host": host}).status_code == 200, host


def test_a_page_of_another_origin_is_refused_by_the_api_and_cors_stays_closed(
    open_server: dict[str, Any],
) -> None:
    srv: InProcess = open_server["srv"]
    box = open_server["box"]
    page = {"Origin": srv.content_url, "Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"}
    r = httpx.post(f"{srv.url}/v1/boxes/{box}/exec", headers=page, json={"argv": ["echo", "pwned"]})
    assert srv.content_url in _error(r, 403, "forbidden")
    assert "access-control-allow-origin" not in r.headers
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    preflight = httpx.options(f"{srv.url}/v1/boxes/{box}/exec", headers={**page, **asked})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    script = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "script"}
    _error(httpx.get(f"{srv.url}/v1/boxes/{box}/files/content?path=/etc/hostname", headers=script), 403,
           "forbidden")  # fmt: skip
    r = httpx.get(f"{srv.url}/v1/info", headers=NAVIGATION)  # a link to the API, followed
    assert r.status_code == 200
    own = {"Origin": srv.url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{srv.url}/v1/boxes/{box}/exec", headers=own, json={"argv": ["true"]}).is_success
    # the page of a box may still call its own app, on the content listener
    same = {"Origin": srv.content_url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{srv.content_url}/v1/boxes/{box}/ports/{BOX_PORT}/page", headers=same).is_success


def test_every_answer_of_the_api_forbids_framing_and_embedding(open_server: dict[str, Any]) -> None:
    srv: InProcess = open_server["srv"]
    asked: list[tuple[str, dict[str, str]]] = [
        ("/v1/info", {}), ("/console/", {}), ("/docs", {}), ("/v1/boxes/nope", {}),
        ("/v1/info", {"Host": "x.test"}), ("/v1/info", {"Origin": "http://x.test"}),
    ]  # fmt: skip
    answers = [httpx.get(srv.url + path, headers=headers) for path, headers in asked]
    for r in answers:
        assert r.headers["x-frame-options"] == "DENY", r.url
        assert r.headers["cross-origin-resource-policy"] == "same-origin"
        assert r.headers["x-content-type-options"] == "nosniff"
    console = answers[1]
    assert console.headers["cross-origin-opener-policy"] == "same-origin"  # no page keeps its window
    assert "frame-ancestors 'none'" in console.headers["content-security-policy"]


def test_an_app_sets_nothing_beyond_itself_through_the_server(open_server: dict[str, Any]) -> None:
    srv: InProcess = open_server["srv"]
    box = open_server["box"]
    preview = httpx.post(f"{srv.url}/v1/boxes/{box}/previews", json={"port": BOX_PORT}).json()
    prefix = preview["url"].removeprefix(srv.content_url).rstrip("/")
    route = f"/v1/boxes/{box}/ports/{BOX_PORT}/"
    for url, path in ((f"{srv.content_url}{route}page", route), (preview["url"] + "page", prefix + "/")):
        r = httpx.get(url)
        assert r.headers.get_list("set-cookie") == [f"a=1; Path={path}", f"b=2; Path={path}"], r.headers
        assert "clear-site-data" not in r.headers and "service-worker-allowed" not in r.headers
        assert r.headers["x-app"] == "kept"
    r = httpx.get(srv.content_url + "/page", headers={"Host": f"{BOX_PORT}-{box}.{PORT_DOMAIN}"})
    assert r.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]


def test_names_and_origins_the_server_is_given_are_served(tmp_path: Path) -> None:
    with serving(tmp_path / "home", auth=False, allow_hosts=("Sandlot.Example",),
                 allow_origins=("https://app.example:443",)) as srv:  # fmt: skip
        for base in (srv.url, srv.content_url):
            assert httpx.get(base + "/health", headers={"Host": "sandlot.example"}).status_code == 200
            _error(httpx.get(base + "/health", headers={"Host": "other.example"}), 421, "misdirected_request")
        asking = {"Origin": "https://app.example", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}
        r = httpx.get(f"{srv.url}/v1/info", headers=asking)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        preflight = httpx.options(f"{srv.url}/v1/boxes", headers={**asking, **asked})
        assert preflight.status_code == 200, preflight.text
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        assert "access-control-allow-credentials" not in preflight.headers
        other = {**asking, "Origin": "https://other.example"}
        _error(httpx.get(f"{srv.url}/v1/info", headers=other), 403, "forbidden")
    with (
        pytest.raises(InvalidArgument, match="--allow-origin"),
        serving(tmp_path / "h2", allow_origins=["*"]),
    ):
        pass


def test_a_server_bound_beyond_loopback_answers_any_address_but_no_other_name(tmp_path: Path) -> None:
    with serving(tmp_path / "home", listen_host="0.0.0.0") as srv:
        assert httpx.get(srv.url + "/health", headers={"Host": "192.0.2.7:7070"}).status_code == 200
        rebound = httpx.get(srv.url + "/health", headers={"Host": "rebind.test:7070"})
        _error(rebound, 421, "misdirected_request")


@pytest.mark.parametrize(("args", "says"), [
    (["--allow-host", "*.example.com"], "wildcard"),
    (["--allow-host", "example.com:8080"], "without a port"),
    (["--allow-origin", "*"], "one origin"),
    (["--allow-origin", "https://app.example.com/path"], "is not an origin"),
    (["--content-url", "content.example.com"], "--content-url"),
    (["--port", "7070", "--content-port", "7070"], "a port of its own"),
    (["--port-domain", "10.0.0.5"], "an address"),
])  # fmt: skip
def test_serve_refuses_names_and_origins_it_could_not_keep_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    import sandlot.cli.server  # noqa: F401 - the command it adds to the app

    from tests.support.cli import in_process

    monkeypatch.setenv("SANDLOT_HOME", str(tmp_path / "home"))
    r = in_process()("serve", "--no-auth", *args, code=2)
    assert says in r.output, r.output


def test_serve_says_where_a_port_it_needs_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import sandlot.cli.server  # noqa: F401 - the command it adds to the app

    from tests.support.cli import in_process

    monkeypatch.setenv("SANDLOT_HOME", str(tmp_path / "home"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = in_process()("serve", "--no-auth", "--port", "0", "--content-port", str(port), code=2)
    assert f"cannot listen on 127.0.0.1:{port} for boxes' content" in r.output, r.output
