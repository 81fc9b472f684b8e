"""A box's page attacks the server from a real browser: the distro's Chromium, driven by
Playwright, against two real ``sandlot serve`` processes of one home (one ``--no-auth``,
one with keys) and real VMs (docs/server.md, "Origins").

The box "attacker" serves a page whose own script tries to reach the box "victim"
through the API: by fetch, by a form's POST, by a WebSocket to the exec channel, by the
console in a frame and in a window it opens, and as a site whose own name was rebound
to 127.0.0.1. The page is opened each way a box's page reaches a browser: a preview
link, a port route and a port host. Every attempt fails, and each test shows why from
what the server answered (on Chromium's wire, seen through CDP, and in its console),
not from the page's failure alone; the victim's secret never reaches the page, and the
audit trail shows no request of the page ran. Chromium's own Local Network Access
checks are off: they stop a public page's requests to loopback (the rebinding site's),
but other browsers have no such rule, and what is tested here is the server's."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.browser import launch
from tests.support.names import unique
from tests.support.serve import Served, serving
from tests.support.waiting import deadline_in, scaled

pytestmark = pytest.mark.vm

playwright_api = pytest.importorskip("playwright.sync_api")  # in the dev extras: there under scripts/test
DOMAIN = "boxes.sandlot.test"  # the keyed server's --port-domain; the other's is localhost
REBOUND = "rebind.test"  # a site whose own name now points at 127.0.0.1
SITE_PORT = 8000  # where the attacker's box serves its page
SECRET = f"TOPSECRET-{os.urandom(6).hex()}"
BOOT_S = 120  # a boot under TCG on a busy 2-core host
# Chromium's rules for a public page's requests to loopback, over the versions (see above)
LOCAL_NETWORK_CHECKS = (
    "LocalNetworkAccessChecks",
    "BlockInsecurePrivateNetworkRequests",
    "PrivateNetworkAccessSendPreflights",
    "PrivateNetworkAccessRespectPreflightResults",
)

# The attacker's page: its script, served from its box, tries each way at the victim.
ATTACKS = r"""
window.attack = (() => {
  const q = new URLSearchParams(location.hash.slice(1));
  const API = q.get("api"), VICTIM = q.get("victim");
  const STEAL = ["sh", "-c", "cat /root/secret"];
  const within = (ms, p) => Promise.race([p, new Promise((r) => setTimeout(() => r({ timeout: ms }), ms))]);
  const tried = async (f) => {
    try { return await f(); } catch (e) { return { error: `${e.name}: ${e.message}` }; }
  };
  const answer = async (r) => ({ status: r.status, body: await r.text() });
  return {
    async fetch() {
      return {
        exec: await tried(async () => answer(await fetch(`${API}/v1/boxes/${VICTIM}/exec`, {
          method: "POST", headers: { "content-type": "application/json" },
          body: JSON.stringify({ argv: STEAL }) }))),
        read: await tried(async () => answer(
          await fetch(`${API}/v1/boxes/${VICTIM}/files/content?path=/root/secret`))),
      };
    },
    blind() {  // a request whose answer the page never means to read: no CORS rule stops its sending
      return tried(async () => ({ type: (await fetch(`${API}/v1/boxes/${VICTIM}/stop`,
        { method: "POST", mode: "no-cors" })).type }));
    },
    form() {  // the answer shows in a window of its own, which the page cannot read
      const f = document.createElement("form");
      f.method = "POST"; f.action = `${API}/v1/boxes/${VICTIM}/stop`; f.target = "_blank";
      document.body.append(f);
      f.submit();
    },
    websocket() {
      return within(20000, new Promise((resolve) => {
        const ws = new WebSocket(`${API.replace(/^http/, "ws")}/v1/exec`);
        ws.onopen = () => ws.send(JSON.stringify({ id: 1, box: VICTIM, argv: STEAL }));
        ws.onmessage = (m) => resolve({ message: String(m.data) });
        ws.onclose = (e) => resolve({ closed: e.code });
      }));
    },
    frame() {
      return within(20000, new Promise((resolve) => {
        const f = document.createElement("iframe");
        f.src = `${API}/console/`;
        f.onload = () => resolve(tried(async () => ({ read: f.contentWindow.document.body.innerText })));
        document.body.append(f);
      }));
    },
    async window() {
      const w = window.open(`${API}/console/`);
      await new Promise((r) => setTimeout(r, 3000));
      return {
        handle: w === null ? null : { closed: w.closed },
        read: await tried(async () => ({
          key: w.sessionStorage.getItem("sandlot.key"), text: w.document.body.innerText })),
      };
    },
  };
})();
"""
PAGE = f"<!doctype html><title>a box's page</title><script>{ATTACKS}</script>"


@dataclass
class Boxes:
    attacker: dict[str, Any]
    victim: dict[str, Any]
    page: bytes = b""  # the attacker's page as its box serves it


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Served]]:
    home = Path(os.environ["SANDLOT_HOME"])
    with (
        serving(home, no_auth=True, args=("--port-domain", "localhost")) as open_,
        serving(home, args=("--port-domain", DOMAIN)) as keyed,
    ):
        yield {"open": open_, "keyed": keyed}


@pytest.fixture(scope="module")
def admin(servers: dict[str, Served]) -> Iterator[httpx.Client]:
    with servers["keyed"].client() as c:
        yield c


@pytest.fixture(scope="module")
def boxes(admin: httpx.Client, servers: dict[str, Served], busybox_root: Path) -> Iterator[Boxes]:
    made: list[dict[str, Any]] = []
    try:
        for name in ("attacker", "victim"):
            spec = {"rootfs": str(busybox_root), "memory_mib": 256, "name": unique(name)}
            r = admin.post("/v1/boxes", json=spec, timeout=BOOT_S)
            assert r.status_code == 201, r.text
            made.append(r.json())
        attacker, victim = made
        admin.put(f"/v1/boxes/{victim['id']}/files/content", params={"path": "/root/secret"},
                  content=SECRET.encode()).raise_for_status()  # fmt: skip
        admin.put(f"/v1/boxes/{attacker['id']}/files/content", params={"path": "/www/index.html"},
                  content=PAGE.encode()).raise_for_status()  # fmt: skip
        serve = ["httpd", "-p", f"127.0.0.1:{SITE_PORT}", "-h", "/www"]
        assert admin.post(f"/v1/boxes/{attacker['id']}/exec", json={"argv": serve}).json()["exit_code"] == 0
        preview = admin.post(f"/v1/boxes/{attacker['id']}/previews", json={"port": SITE_PORT}).json()["url"]
        deadline = deadline_in(60)
        while (r := httpx.get(preview)).status_code != 200:  # httpd binds a moment after its start
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
        yield Boxes(attacker, victim, r.content)
    finally:
        for box in made:
            admin.delete(f"/v1/boxes/{box['id']}", params={"force": True})


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    resolve = f"MAP *.{DOMAIN} 127.0.0.1, MAP {REBOUND} 127.0.0.1"  # never real DNS
    with playwright_api.sync_playwright() as p:
        off = ",".join(LOCAL_NETWORK_CHECKS)
        b = launch(p, f"--host-resolver-rules={resolve}", f"--disable-features={off}")
        try:
            yield b
        finally:
            b.close()


class Seen:
    """What a page's requests met: the server's answers as they came (CDP, so preflights and
    answers the page may not read are there too; a frame's navigation, such as a form's
    POST, through Playwright's context), and the lines of Chromium's console."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.console: list[str] = []
        self._sent: dict[str, tuple[str, str]] = {}  # request id -> method, URL
        self._status: dict[str, int] = {}  # request id -> the answer's status (either may come first)
        self._navigations: list[tuple[str, str, int]] = []
        cdp = page.context.new_cdp_session(page)
        cdp.send("Network.enable")

        def request(e: dict[str, Any]) -> None:
            self._sent[e["requestId"]] = (e["request"]["method"], e["request"]["url"])

        def answer(e: dict[str, Any]) -> None:
            self._status[e["requestId"]] = e["statusCode"]

        cdp.on("Network.requestWillBeSent", request)
        cdp.on("Network.responseReceivedExtraInfo", answer)
        page.context.on("response", lambda r: self._navigations.append((r.request.method, r.url, r.status)))
        page.on("console", lambda m: self.console.append(m.text))

    @property
    def answers(self) -> list[tuple[str, str, int]]:
        seen = [(*self._sent[i], status) for i, status in self._status.items() if i in self._sent]
        return seen + self._navigations

    def clear(self) -> None:
        self._status.clear()
        self._navigations.clear()
        self.console.clear()

    def answered(self, methods: str, path: str, status: int) -> None:
        """Wait for the server's answer ``status`` to one of ``methods`` ("OPTIONS POST")
        of a URL holding ``path``."""
        deadline = deadline_in(20)
        while not any(m in methods.split() and path in u and s == status for m, u, s in self.answers):
            why = f"no {status} to {methods} {path}: {self.answers}, {self.console}"
            assert time.monotonic() < deadline, why
            self.page.wait_for_timeout(100)  # (Playwright's: its events come in meanwhile)

    def said(self, *parts: str) -> None:
        """Wait for a line of the console holding each of ``parts``."""
        deadline = deadline_in(20)
        while not any(all(p in line for p in parts) for line in self.console):
            assert time.monotonic() < deadline, f"the console never said {parts}: {self.console}"
            self.page.wait_for_timeout(100)  # (Playwright's: its events come in meanwhile)


def _page_url(which: str, served_by: str, server: Served, boxes: Boxes) -> str:
    box_id = boxes.attacker["id"]
    if served_by == "port route":
        return f"{server.content_url}/v1/boxes/{box_id}/ports/{SITE_PORT}/"
    if served_by == "port host" and which == "open":  # --port-domain localhost: no DNS for a browser
        return f"http://{SITE_PORT}-{box_id}.localhost:{server.content_port}/"
    with server.client() as c:  # a preview link (of the box's own host: its token, then a cookie there)
        made = c.post(f"/v1/boxes/{box_id}/previews", json={"port": SITE_PORT}).json()
    return str(made["url"] if served_by == "preview" else made["host_url"])


def _audited(admin: httpx.Client, box: dict[str, Any]) -> list[str]:
    entries = admin.get("/v1/audit", params={"box": box["id"]}).json()["entries"]
    return [f"{e['action']} {e['status']}" for e in entries]


@pytest.mark.parametrize("served_by", ["preview", "port route", "port host"])
@pytest.mark.parametrize("which", ["open", "keyed"])
def test_a_box_s_page_reaches_no_other_box_through_the_api(
    which: str, served_by: str, servers: dict[str, Served], boxes: Boxes, admin: httpx.Client, browser: Any
) -> None:
    server = servers[which]
    victim = boxes.victim["id"]
    audited = _audited(admin, boxes.victim)
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(scaled(30) * 1000)
    seen = Seen(page)
    url = _page_url(which, served_by, server, boxes)
    if which == "keyed" and served_by == "port route":
        # a tool that adds the key to what its user opens: the page's own requests carry none
        page.route(lambda u: u.startswith(url), lambda route: route.continue_(
            headers={**route.request.headers, "authorization": f"Bearer {server.api_key}"}))  # fmt: skip
    results: list[Any] = []
    try:
        page.goto(f"{url}#api={server.url}&victim={victim}")
        page.wait_for_function("() => window.attack !== undefined")
        origin = page.evaluate("() => location.origin")
        assert urlsplit(origin).port == server.content_port, origin  # the content port's, never the API's
        # fetch: the page reads nothing, because the server refused each request as one of a
        # page of another origin (403, before any key is looked for: no 401 on the keyed server)
        got = page.evaluate("() => attack.fetch()")
        results.append(got)
        assert "TypeError" in got["exec"]["error"] and "TypeError" in got["read"]["error"], got
        # the JSON POST's preflight (the POST itself where Playwright routes requests: it
        # answers preflights itself then)
        seen.answered("OPTIONS POST", f"/v1/boxes/{victim}/exec", 403)
        seen.answered("GET", f"/v1/boxes/{victim}/files/content", 403)
        seen.said("blocked by CORS policy", "No 'Access-Control-Allow-Origin' header")  # CORS: closed
        seen.clear()
        got = page.evaluate("() => attack.blind()")
        assert "TypeError" in got["error"], got  # nor may it embed the answer (CORP)
        seen.answered("POST", f"/v1/boxes/{victim}/stop", 403)  # sent, and refused all the same

        # a form's POST, which no CORS rule stops: the server does, and says why
        with context.expect_page() as posted:
            page.evaluate("() => attack.form()")
        answer = posted.value
        answer.wait_for_load_state()
        refused = json.loads(answer.inner_text("body"))["error"]
        assert refused["code"] == "forbidden" and f"a page of {origin}" in refused["message"], refused
        answer.close()

        # a WebSocket to the exec channel, which no CORS rule stops either: its handshake is refused
        seen.clear()
        got = page.evaluate("() => attack.websocket()")
        results.append(got)
        assert got == {"closed": 1006}, got
        seen.said(f"{server.url.replace('http', 'ws', 1)}/v1/exec", "Unexpected response code: 403")

        # the console in a frame: refused (a page of another origin, framing), and never framed
        seen.clear()
        got = page.evaluate("() => attack.frame()")
        results.append(got)
        assert "SecurityError" in got["error"], got
        seen.said("the server responded with a status of 403")
        seen.said("Refused to display", "in a frame", "X-Frame-Options")

        # the console in a window of its own: the page keeps no handle on it
        with context.expect_page() as opened:
            got = page.evaluate("() => attack.window()")
        results.append(got)
        assert got["handle"] == {"closed": True} and "SecurityError" in got["read"]["error"], got
        console = opened.value
        console.wait_for_load_state()
        assert console.url == f"{server.url}/console/" and console.evaluate("() => window.opener") is None

        # a site whose own name points here now: the browser sends its page's requests as the
        # site's own (its name in Host, its origin in Origin), which the page may read: each is
        # the refusal of a name this server does not answer to, on either of its ports
        for port in (server.port, server.content_port):
            site = f"http://{REBOUND}:{port}"
            page.route(f"{site}/", lambda route: route.fulfill(status=200, content_type="text/html",
                                                              body=boxes.page))  # fmt: skip
            page.goto(f"{site}/#api={site}&victim={victim}")
            got = page.evaluate("() => attack.fetch()")
            results.append(got)
            for tried in ("exec", "read"):
                assert got[tried]["status"] == 421, got
                assert "is not a name this server answers to" in got[tried]["body"], got
            got = page.evaluate("() => attack.websocket()")
            assert got == {"closed": 1006}, got
            seen.said(f"ws://{REBOUND}:{port}/v1/exec", "Unexpected response code: 421")
    finally:
        context.close()
    assert SECRET not in repr(results)
    # nothing the page sent ran: the victim runs on, and the trail holds nothing new of it
    assert admin.get(f"/v1/boxes/{victim}").json()["state"] == "running"
    assert _audited(admin, boxes.victim) == audited


def test_the_same_script_on_the_api_s_own_origin_reads_the_secret(
    servers: dict[str, Served], boxes: Boxes, browser: Any
) -> None:
    """The control: what stops the attacks above is the origin the page runs on, nothing
    in its script. On the API's own origin (where a box's page ran before it had one of
    its own), the same script runs a command in the victim and reads its secret."""
    api = servers["open"].url
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{api}/health#api={api}&victim={boxes.victim['id']}")
        page.evaluate(f"() => {{ {ATTACKS} }}")
        got = page.evaluate("() => attack.fetch()")
    finally:
        context.close()
    assert got["exec"]["status"] == 200 and SECRET in got["exec"]["body"], got
    assert got["read"]["status"] == 200 and got["read"]["body"] == SECRET, got


def test_a_preview_opened_from_the_signed_in_console_gets_nothing_of_its_key(
    servers: dict[str, Served], boxes: Boxes, browser: Any
) -> None:
    keyed = servers["keyed"]
    assert keyed.api_key is not None
    context = browser.new_context(base_url=keyed.url)
    try:
        page = context.new_page()
        page.set_default_timeout(scaled(30) * 1000)
        page.goto("/")
        page.fill("#sign-in input[name=key]", keyed.api_key)
        page.press("#sign-in input[name=key]", "Enter")
        page.wait_for_selector("#box-count")
        page.goto(f"/console/#/box/{boxes.attacker['name']}/network")
        page.fill("#preview-port", str(SITE_PORT))
        page.click("text=Make a signed link")
        with context.expect_page() as opened:
            page.locator("#previews a").first.click()
        box_page = opened.value
        box_page.wait_for_function("() => window.attack !== undefined")
        host = f"{SITE_PORT}-{boxes.attacker['id']}.{DOMAIN}:{keyed.content_port}"
        assert box_page.url.startswith(f"http://{host}/"), box_page.url
        got = box_page.evaluate("""() => ({opener: window.opener, key: sessionStorage.getItem("sandlot.key"),
            stored: sessionStorage.length + localStorage.length, cookie: document.cookie,
            referrer: document.referrer})""")
        assert got == {"opener": None, "key": None, "stored": 0, "cookie": "", "referrer": ""}, got
        mine = page.evaluate("() => sessionStorage.getItem('sandlot.key')")
        assert mine == keyed.api_key  # the console's tab kept it
    finally:
        context.close()
