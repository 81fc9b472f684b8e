"""The web console in a real browser: the distro's Chromium, driven by Playwright,
against a real ``sandlot serve`` with real boxes (docs/console.md).

Every page keeps the server's Content-Security-Policy on (no bypass), so what runs
here is what a user's browser runs. A page that raises, or an ``alert`` that fires,
fails the test that opened it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.browser import launch
from tests.support.names import unique
from tests.support.serve import Served, create_key, free_port, serving
from tests.support.waiting import deadline_in

pytestmark = pytest.mark.vm

playwright_api = pytest.importorskip("playwright.sync_api")  # in the dev extras: there under scripts/test
DEADLINE_MS = 120_000  # a boot under TCG on a busy 2-core host
GUEST_MS = 60_000  # a running guest's answer on that host, three test runs beside it
REPO = Path(__file__).resolve().parents[2]
HOSTILE_LABEL = '<img src=x onerror="window.pwned=4">'
ONE_BOX = re.compile(r"/v1/boxes/[^/?#]+(\?[^#]*)?$")  # the read of one box (GET): a removed one is a 404


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving(Path(os.environ["SANDLOT_HOME"])) as s:
        yield s


@pytest.fixture(scope="module")
def key(served: Served) -> str:
    """A key of a namespace of its own, admin in it (so it may boot a test rootfs)."""
    tag = unique("console")
    return create_key(served.home, tag, "--namespace", tag, "--admin")


@pytest.fixture(scope="module")
def api(served: Served, key: str) -> Iterator[httpx.Client]:
    with served.client(key) as c:
        yield c


@pytest.fixture(scope="module")
def box(api: httpx.Client, busybox_root: Path) -> Iterator[dict[str, Any]]:
    labels = {"note": HOSTILE_LABEL}
    r = api.post("/v1/boxes", json={"rootfs": str(busybox_root), "memory_mib": 256, "name": unique("con"),
                                    "labels": labels})  # fmt: skip
    assert r.status_code == 201, r.text
    made = r.json()
    try:
        yield made
    finally:
        api.delete(f"/v1/boxes/{made['id']}", params={"force": True})


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = launch(p)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, served: Served) -> Iterator[Any]:
    context = browser.new_context(base_url=served.url, viewport={"width": 1280, "height": 800},
                                  accept_downloads=True)  # fmt: skip
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    trouble: list[str] = []
    pg.on("pageerror", lambda e: trouble.append(f"page error: {e}"))
    pg.on("dialog", lambda d: (trouble.append(f"a dialog opened: {d.message}"), d.dismiss()))
    # the browser logs each refused request: a sign-in with a wrong key is one, and so is
    # the read of a box an event named that was removed meanwhile (the list drops it: other
    # tests' boxes come and go in the server's home); any other is trouble, named by its URL
    pg.on("console", lambda m: trouble.append(f"console: {m.text}")
          if m.type == "error" and "status of 401" not in m.text and "status of 404" not in m.text
          else None)  # fmt: skip

    def not_found(r: Any) -> None:
        if r.status == 404 and not (r.request.method == "GET" and ONE_BOX.search(r.url)):
            trouble.append(f"{r.request.method} {r.url}: 404")

    pg.on("response", not_found)
    try:
        yield pg
    finally:
        context.close()
    assert not trouble, trouble


def sign_in(page: Any, key: str) -> None:
    page.goto("/")
    page.fill("#sign-in input[name=key]", key)
    page.press("#sign-in input[name=key]", "Enter")
    page.wait_for_selector("#box-count")


def row(page: Any, name: str, state: str | None = None) -> Any:
    selector = f'tr[data-name="{name}"]' + (f'[data-state="{state}"]' if state else "")
    return page.locator(selector)


def confirm(page: Any, **fields: str) -> None:
    dialog = page.locator("dialog.ask")
    for name, value in fields.items():
        dialog.locator(f"[name={name}]").fill(value)
    dialog.locator("button[type=submit]").click()


def test_a_wrong_key_is_refused_and_the_right_one_stays_in_the_tab(
    page: Any, key: str, served: Served
) -> None:
    page.goto("/")
    page.fill("#sign-in input[name=key]", "sk-not-a-key")
    page.press("#sign-in input[name=key]", "Enter")
    page.get_by_text("The key was refused.").wait_for()
    assert page.locator("#box-count").count() == 0
    page.fill("#sign-in input[name=key]", key)
    page.press("#sign-in input[name=key]", "Enter")
    page.wait_for_selector("#box-count")
    assert key not in page.url and page.context.cookies() == []
    assert page.evaluate("() => sessionStorage.getItem('sandlot.key')") == key
    assert page.evaluate("() => localStorage.length") == 0
    assert "admin" in page.inner_text("#who") and page.is_visible("#nav-audit")
    plain = create_key(served.home, unique("plain"), "--namespace", unique("ns"))
    page.click("#sign-out")
    sign_in(page, plain)
    assert not page.is_visible("#nav-audit")  # what the key may not read is not offered


def test_create_a_box_then_remove_it(page: Any, key: str, api: httpx.Client, busybox_root: Path) -> None:
    name = unique("made")
    sign_in(page, key)
    page.click("#create-box")
    confirm(page, name=name, memory_mib="256", labels="made-by=console",
            options=f'{{"rootfs": "{busybox_root}"}}')  # fmt: skip
    row(page, name, "running").wait_for(timeout=DEADLINE_MS)
    assert api.get(f"/v1/boxes/{name}").json()["labels"]["made-by"] == "console"
    row(page, name).locator("button[data-action=remove]").click()
    confirm(page)
    row(page, name).wait_for(state="detached")
    assert api.get(f"/v1/boxes/{name}").status_code == 404


def terminal_shows(page: Any, text: str, api: httpx.Client, box: dict[str, Any]) -> None:
    """Wait for ``text`` on the terminal's screen; a failure says what the screen, the
    panel and the server's held processes showed (keys that never reached the guest,
    or a guest that did not answer)."""
    try:
        page.locator("#terminal .xterm-rows", has_text=text).wait_for(timeout=GUEST_MS)
    except playwright_api.TimeoutError:
        held = api.get(f"/v1/boxes/{box['id']}/processes").text
        screen = page.inner_text("#terminal .xterm-rows")
        status = page.inner_text("#terminal-status")
        why = f"{text!r} never showed; status {status!r}; held {held}; screen:\n{screen}"
        raise AssertionError(why) from None


def test_echo_in_the_terminal_and_reattach_after_a_reload(
    page: Any, key: str, box: dict[str, Any], api: httpx.Client
) -> None:
    sign_in(page, key)
    page.click(f'tr[data-name="{box["name"]}"] a.box-name')
    page.locator("#terminal-status", has_text="shell ").wait_for(timeout=DEADLINE_MS)
    page.click("#terminal")
    page.keyboard.type("echo console-$((6*7))\n")  # typed ahead of the prompt, as a user may
    terminal_shows(page, "console-42", api, box)
    shell = page.inner_text("#terminal-status")
    page.reload()
    page.locator("#terminal-status", has_text=shell).wait_for()  # the same shell, not a new one
    terminal_shows(page, "console-42", api, box)  # its output, held by the server
    page.click("#terminal")
    page.keyboard.type("echo again-$((2*3))\n")
    terminal_shows(page, "again-6", api, box)


def test_keys_typed_while_the_shell_starts_reach_it(
    page: Any, key: str, box: dict[str, Any], api: httpx.Client, served: Served
) -> None:
    sign_in(page, key)

    def pause_the_server_after(route: Any) -> None:
        answer = route.fetch()  # the box page's own read, from the real server
        served.process.send_signal(signal.SIGSTOP)  # then its terminal's socket waits in the connect
        route.fulfill(response=answer)

    page.route(f"**/v1/boxes/{box['name']}", pause_the_server_after)
    try:
        page.click(f'tr[data-name="{box["name"]}"] a.box-name')
        page.click("#terminal")
        assert page.inner_text("#terminal-status") == "starting a shell…"
        page.keyboard.type("echo early-$((3*3))\n")
    finally:
        served.process.send_signal(signal.SIGCONT)
    terminal_shows(page, "early-9", api, box)


def test_upload_by_button_and_by_drop_then_download(
    page: Any, key: str, box: dict[str, Any], api: httpx.Client, tmp_path: Path
) -> None:
    blob = bytes(range(256)) * 40 + b"\x00end"
    local = tmp_path / "up.bin"
    local.write_bytes(blob)
    sign_in(page, key)
    page.goto(f"/console/#/box/{box['name']}/files")
    page.fill("#files-path", "/tmp")
    page.press("#files-path", "Enter")
    page.set_input_files("#files-upload", str(local))
    page.locator('#files tr[data-name="up.bin"]').wait_for()
    got = api.get(f"/v1/boxes/{box['id']}/files/content", params={"path": "/tmp/up.bin"})
    assert got.content == blob
    dropped = page.evaluate_handle(
        "() => { const t = new DataTransfer(); "
        "t.items.add(new File(['dropped here\\n'], 'dropped.txt')); return t; }"
    )
    page.dispatch_event("#files-drop", "drop", {"dataTransfer": dropped})
    page.locator('#files tr[data-name="dropped.txt"]').wait_for()
    got = api.get(f"/v1/boxes/{box['id']}/files/content", params={"path": "/tmp/dropped.txt"})
    assert got.text == "dropped here\n"
    with page.expect_download() as download:
        page.click('#files tr[data-name="up.bin"] button[data-action=download]')
    assert Path(download.value.path()).read_bytes() == blob
    page.click('#files tr[data-name="dropped.txt"] button[data-action=edit]')
    page.fill("#editor-text", "edited in the console\n")
    page.click("#editor-save")
    page.get_by_text("Saved /tmp/dropped.txt").wait_for()
    got = api.get(f"/v1/boxes/{box['id']}/files/content", params={"path": "/tmp/dropped.txt"})
    assert got.text == "edited in the console\n"


def test_hostile_names_labels_and_contents_render_as_text(
    page: Any, key: str, box: dict[str, Any], api: httpx.Client
) -> None:
    refused = api.post("/v1/boxes", json={"name": "<script>alert(1)</script>", "start": False})
    assert refused.status_code == 400  # a box's name cannot hold markup at all
    hostile_name = '<img src=x onerror="window.pwned=1">.txt'
    hostile_text = '<script>window.pwned=2</script><img src=x onerror="window.pwned=3">\n'
    put = api.put(f"/v1/boxes/{box['id']}/files/content", params={"path": f"/tmp/{hostile_name}"},
                  content=hostile_text.encode())  # fmt: skip
    assert put.status_code == 200, put.text
    kmsg = f"echo '<2>{hostile_text.strip()}' > /dev/kmsg"  # a line on the guest's console
    api.post(f"/v1/boxes/{box['id']}/exec", json={"argv": ["sh", "-c", kmsg]})
    sign_in(page, key)
    assert row(page, box["name"]).locator(".label").inner_text() == f"note={HOSTILE_LABEL}"
    page.goto(f"/console/#/box/{box['name']}/files")
    page.fill("#files-path", "/tmp")
    page.press("#files-path", "Enter")
    entry = page.locator("#files tr", has_text=hostile_name)
    entry.wait_for()
    assert entry.locator(".file-name").inner_text() == hostile_name
    entry.locator("button[data-action=edit]").click()
    assert page.input_value("#editor-text") == hostile_text
    page.click("nav.tabs a[data-tab=logs]")
    page.locator("#logs", has_text="window.pwned=2").wait_for()
    assert page.evaluate("() => window.pwned") is None
    assert page.locator("#main img, #main script").count() == 0


def shell_of(api: httpx.Client, box: dict[str, Any]) -> Callable[[str], dict[str, Any]]:
    """A shell line run in the box through the API: its answer."""

    def sh(cmd: str) -> dict[str, Any]:
        r = api.post(f"/v1/boxes/{box['id']}/exec", json={"argv": ["sh", "-c", cmd]})
        assert r.status_code == 200, r.text
        return dict(r.json())

    return sh


def test_snapshot_then_roll_back_from_the_tree(
    page: Any, key: str, box: dict[str, Any], api: httpx.Client
) -> None:
    sh = shell_of(api, box)
    snap = unique("before")
    sh("echo kept > /root/kept.txt")
    sign_in(page, key)
    page.goto(f"/console/#/box/{box['name']}/tree")
    page.click(".box-head button[data-action=snapshot]")
    confirm(page, name=snap)
    page.get_by_text(f"Snapshot {snap} of {box['name']}").wait_for(timeout=DEADLINE_MS)
    sh("echo lost > /root/after.txt")
    page.click("nav.tabs a[data-tab=tree]")
    node = page.locator(f'g.node.snapshot[data-name="{snap}"]')
    node.wait_for()
    node.click()
    page.click("#node-rollback")
    confirm(page)
    page.get_by_text(f"Rolled {box['name']} back").wait_for(timeout=DEADLINE_MS)
    assert sh("cat /root/kept.txt; test -e /root/after.txt; echo $?")["stdout"] == "kept\n1\n"
    assert api.get(f"/v1/boxes/{box['id']}").json()["state"] == "running"


def test_the_timeline_records_shows_a_step_s_diff_and_rewinds(
    page: Any, key: str, box: dict[str, Any], api: httpx.Client
) -> None:
    sh = shell_of(api, box)
    sign_in(page, key)
    page.goto(f"/console/#/box/{box['name']}/timeline")
    page.click("#recording-toggle")
    page.get_by_text(f"{box['name']} records every step").wait_for(timeout=DEADLINE_MS)
    try:
        sh("echo one > /root/step.txt")
        sh("echo two > /root/step.txt")
        sh("sleep 600 </dev/null >/dev/null 2>&1 &")  # a step that leaves a process running
        steps = api.get(f"/v1/boxes/{box['id']}/timeline").json()["steps"]
        first = next(
            s["seq"] for s in steps if s["what"].get("argv", [""])[-1] == "echo one > /root/step.txt"
        )
        page.click("nav.tabs a[data-tab=files]")  # the tab draws the timeline as it is when it opens
        page.click("nav.tabs a[data-tab=timeline]")
        line = page.locator(f'#timeline tr[data-seq="{first}"]')
        line.wait_for()
        assert "echo one > /root/step.txt" in line.inner_text()
        started = page.locator(f'#timeline tr[data-seq="{steps[-1]["seq"]}"] .procs')
        assert started.inner_text() == "+1 \u22120" and "sleep 600" in (started.get_attribute("title") or "")
        line.locator("button[data-action=diff]").click()
        page.locator("#step-detail li", has_text="/root/step.txt").wait_for(timeout=DEADLINE_MS)
        line.locator("button[data-action=rewind]").click()
        confirm(page)
        page.get_by_text(f"Rewound {box['name']} to step {first}").wait_for(timeout=DEADLINE_MS)
        assert sh("cat /root/step.txt")["stdout"] == "one\n"
    finally:
        api.put(f"/v1/boxes/{box['id']}/recording", json={"on": False})


def by_another_process(served: Served, action: str, box: dict[str, Any]) -> None:
    """``sandlot ACTION BOX`` run by the CLI in a process of its own, on the server's home."""
    env = {**os.environ, "SANDLOT_HOME": str(served.home)}
    argv = [sys.executable, "-m", "sandlot.cli", action, box["id"]]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=120)


def test_a_state_change_by_another_process_arrives_live(
    page: Any, key: str, box: dict[str, Any], served: Served
) -> None:
    sign_in(page, key)
    row(page, box["name"], "running").wait_for()
    try:
        by_another_process(served, "pause", box)
        t = time.monotonic()
        row(page, box["name"], "paused").wait_for(timeout=10_000)
        print(f"a pause by another process shown in {time.monotonic() - t:.2f} s")
    finally:
        by_another_process(served, "unpause", box)
    row(page, box["name"], "running").wait_for(timeout=10_000)


def test_the_other_pages_render(page: Any, key: str, box: dict[str, Any]) -> None:
    sign_in(page, key)
    for tab, ready in (("logs", "#logs"), ("network", "#network-policy"), ("stats", "#stats svg"),
                       ("code", "#code-run")):  # fmt: skip
        page.goto(f"/console/#/box/{box['name']}/{tab}")
        page.wait_for_selector(ready)
    page.goto(f"/console/#/box/{box['name']}/stats")
    page.locator("#stats path.line").first.wait_for()  # the box has run for a few samples by now
    page.click("#nav a[data-page=templates]")
    page.wait_for_selector("#templates")
    page.click("#nav-audit")
    page.locator("#audit tr", has_text="POST /v1/boxes").first.wait_for()


@dataclass
class Proxied:
    api: str  # the API's and the console's host, as nginx serves it
    content: str  # boxes' content's


@pytest.fixture
def behind_nginx(served: Served, tmp_path: Path) -> Iterator[Proxied]:
    """nginx on free ports of 127.0.0.1 in front of the server, configured with the
    ``server`` blocks docs/server.md gives, as they are written there (each on a port of
    its own here, in place of its name)."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    doc = (REPO / "docs" / "server.md").read_text()
    found = re.search(r"```nginx\n(.*?)```", doc, re.S)
    assert found, "docs/server.md has no nginx block"
    ports = [free_port(), free_port()]
    listens = iter(ports)
    blocks = re.sub(r"listen 443 ssl;", lambda _: f"listen 127.0.0.1:{next(listens)};", found.group(1))
    blocks = blocks.replace("http://127.0.0.1:7070", f"http://127.0.0.1:{served.port}")
    blocks = blocks.replace("http://127.0.0.1:7071", f"http://127.0.0.1:{served.content_port}")
    assert next(listens, None) is None, "the docs give a server block for the API and one for boxes' content"
    temp = " ".join(
        f"{k}_temp_path {tmp_path}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (tmp_path / "nginx.conf").write_text(f"""
worker_processes 1;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
events {{}}
http {{
    access_log off;
    {temp}
    map $http_upgrade $connection_upgrade {{ default upgrade; "" close; }}
    {blocks}
}}
""")
    argv = [nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE)
    proxied = Proxied(*(f"http://127.0.0.1:{port}" for port in ports))
    try:
        deadline = deadline_in(20)
        while True:
            try:
                if all(
                    httpx.get(f"{url}/health", timeout=2).status_code == 200 for url in vars(proxied).values()
                ):
                    break
            except httpx.TransportError:
                pass
            alive = proc.poll() is None and time.monotonic() < deadline
            assert alive, proc.stderr.read() if proc.stderr else "nginx did not answer"
            time.sleep(0.1)
        yield proxied
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_console_behind_the_docs_reverse_proxy(
    browser: Any, behind_nginx: Proxied, key: str, box: dict[str, Any], served: Served, api: httpx.Client
) -> None:
    context = browser.new_context(base_url=behind_nginx.api, viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        sign_in(page, key)
        row(page, box["name"], "running").wait_for()
        by_another_process(served, "pause", box)
        try:
            row(page, box["name"], "paused").wait_for(timeout=10_000)  # events stream through the proxy
        finally:
            by_another_process(served, "unpause", box)
        page.click(f'tr[data-name="{box["name"]}"] a.box-name')
        page.locator("#terminal-status", has_text="shell ").wait_for(timeout=DEADLINE_MS)
        page.click("#terminal")
        page.keyboard.type("echo proxied-$((40+2))\n")  # a WebSocket upgraded through nginx
        terminal_shows(page, "proxied-42", api, box)
    finally:
        context.close()
    assert not errors, errors
    # a preview made through the API's host, opened through the content host's; each host
    # serves its own listener's paths alone, and a preview link of the API's moves there
    with httpx.Client(base_url=behind_nginx.api, headers={"Authorization": f"Bearer {key}"}) as proxied:
        made = proxied.post(f"/v1/boxes/{box['id']}/previews", json={"port": 8099}).json()
    path = urlsplit(made["url"]).path
    r = httpx.get(behind_nginx.content + path)  # the box's app: nothing listens on 8099
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_unreachable", r.text
    assert httpx.get(behind_nginx.content + "/v1/info").status_code == 421
    assert httpx.get(behind_nginx.api + path).status_code == 307


SEEN_CGI = """#!/bin/sh
printf 'Content-Type: text/plain\\r\\n\\r\\n'
echo "proto=[$HTTP_SEC_WEBSOCKET_PROTOCOL] auth=[$HTTP_AUTHORIZATION] other=[$HTTP_X_OTHER]"
"""
SW_CGI = """#!/bin/sh
printf 'Content-Type: text/javascript\\r\\nService-Worker-Allowed: /\\r\\nX-App: kept\\r\\n\\r\\n'
echo 'self.addEventListener("fetch", () => {});'
"""


def test_an_app_may_not_widen_a_service_worker_over_the_other_apps(
    api: httpx.Client, box: dict[str, Any], served: Served, key: str
) -> None:
    """Through a port route or a preview an app answers on the content port's origin,
    which every box's apps share: a worker it registers must keep to the app's own
    path. And what reaches the app carries no key, in whatever header it came."""
    bid = box["id"]
    with served.content_client(key) as content:
        for name, script in (("sw", SW_CGI), ("seen", SEEN_CGI)):
            where = {"path": f"/srv8091/cgi-bin/{name}", "mode": 0o755}
            api.put(
                f"/v1/boxes/{bid}/files/content", params=where, content=script.encode()
            ).raise_for_status()
        api.post(f"/v1/boxes/{bid}/exec", json={"argv": ["httpd", "-p", "127.0.0.1:8091", "-h", "/srv8091"]})
        deadline = deadline_in(60)
        while (r := content.get(f"/v1/boxes/{bid}/ports/8091/cgi-bin/sw")).status_code == 502:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
        assert r.status_code == 200 and r.headers["x-app"] == "kept", (r.status_code, r.headers)
        assert "service-worker-allowed" not in r.headers
        offered = "sandlot, sandlot.key.c2stc2wtc2VjcmV0"  # a key offered as the console offers it
        seen = content.get(f"/v1/boxes/{bid}/ports/8091/cgi-bin/seen",
                           headers={"Sec-WebSocket-Protocol": offered, "X-Other": "passed"})  # fmt: skip
        assert seen.text.strip() == "proto=[] auth=[] other=[passed]", seen.text


def test_a_console_opened_by_another_page_does_not_start(page: Any) -> None:
    page.goto("/console/")
    page.wait_for_selector("#sign-in")
    with page.context.expect_page() as opened:
        page.evaluate("() => { window.open('/console/'); }")  # a page of its origin: a console's own
    other = opened.value
    other.get_by_text("opened by another page").wait_for()
    assert other.locator("#sign-in").count() == 0
