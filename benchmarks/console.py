"""The web console in headless Chromium (the distro's, through Playwright) against a
real ``sandlot serve``, measured as its users feel it:

* the boxes page with N boxes (200; made, not started): from the page opening to
  every row in the DOM (the list fetched from the server, and drawn), by the page's
  own performance marks; and the list request alone, from Python;
* a state change made by another client (a pause, then an unpause, through the REST
  API) until the box's row shows it: the clock runs from the API's answer;
* a keystroke in the terminal until its echo arrives over the page's WebSocket
  (timestamped in the page), against the same keystroke over the same route from a
  plain WebSocket client (the raw exec channel, the baseline), interleaved.

    .venv/bin/python benchmarks/console.py [--boxes 200] [--runs 30] [--quick]
"""

from __future__ import annotations

import json
import time
from typing import Any

from websockets.sync.client import connect

import _common  # noqa: F401 - puts the repository on the path
from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary
from tests.support.browser import CHROMIUM, launch
from tests.support.serve import serving

# Timestamps in the page, set before its own scripts run: when a key went down, and
# when each WebSocket message arrived (an init script is not the page's: CSP allows it).
PROBE = """
window.__keyAt = 0; window.__echoAt = 0;
document.addEventListener("keydown", () => { window.__keyAt = performance.now(); }, true);
const Native = window.WebSocket;
window.WebSocket = class extends Native {
  constructor(...a) {
    super(...a);
    this.addEventListener("message", () => { window.__echoAt = performance.now(); });
  }
};
"""
SHELL = ["/bin/sh"]


def render_times(page: Any, n: int, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        page.goto("/console/#/templates")
        page.wait_for_selector("#templates")
        page.evaluate("() => performance.clearMarks()")
        page.click("#nav a[data-page=boxes]")
        page.locator("#boxes tr").nth(n - 1).wait_for()
        took = page.evaluate(
            "() => performance.getEntriesByName('sandlot:boxes-rendered')[0].startTime"
            " - performance.getEntriesByName('sandlot:boxes-open')[0].startTime"
        )
        assert page.locator("#boxes tr").count() == n
        out.append(took / 1000)
    return out


def state_change_times(page: Any, api: Any, box: dict[str, Any], runs: int) -> list[float]:
    page.goto("/console/#/boxes")
    page.locator("#live.on").wait_for()
    out = []
    for i in range(runs):
        action, state = ("pause", "paused") if i % 2 == 0 else ("unpause", "running")
        api.post(f"/v1/boxes/{box['id']}/{action}").raise_for_status()
        t0 = time.perf_counter()
        page.locator(f'tr[data-name="{box["name"]}"][data-state="{state}"]').wait_for(timeout=10_000)
        out.append(time.perf_counter() - t0)
    if runs % 2:
        api.post(f"/v1/boxes/{box['id']}/unpause").raise_for_status()
    return out


def echo_in_page(page: Any) -> float:
    page.evaluate("() => { window.__echoAt = 0; }")
    page.keyboard.press("x")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        key_at, echo_at = page.evaluate("() => [window.__keyAt, window.__echoAt]")
        if echo_at > key_at > 0:
            return float(echo_at - key_at) / 1000
        time.sleep(0.002)
    raise TimeoutError("no echo in the page")


def echo_raw(ws: Any) -> float:
    """One key over the plain socket until its echo. The echo may share its frame with
    output the shell had not sent yet (a late prompt): any output holding the key is it,
    since nothing else in the shell's answer to one key does."""
    t0 = time.perf_counter()
    ws.send(b"\x00x")
    while True:
        msg = ws.recv(timeout=10)
        if isinstance(msg, bytes) and b"x" in msg[9:]:
            return time.perf_counter() - t0


def wait_for_prompt(ws: Any) -> None:
    """Read the shell's output until its prompt (busybox's ends with a cursor position
    query, which this client leaves unanswered): a drain alone can end before a shell
    slow to start (TCG, a busy host) has said it."""
    said = b""
    while not said.replace(b"\x1b[6n", b"").endswith((b"# ", b"$ ")):
        msg = ws.recv(timeout=30)
        if isinstance(msg, bytes):
            said += msg[9:]


def drain(ws: Any) -> None:
    """Read what the shell says until it is quiet (its prompt, a line it redrew)."""
    while True:
        try:
            ws.recv(timeout=0.3)
        except TimeoutError:
            return


def keystroke_times(page: Any, url: str, box: dict[str, Any], runs: int) -> tuple[list[float], list[float]]:
    page.goto(f"/console/#/box/{box['name']}/terminal")
    page.locator("#terminal-status", has_text="shell ").wait_for(timeout=60_000)
    page.click("#terminal")
    with connect(url.replace("http", "ws") + f"/v1/boxes/{box['id']}/spawn",
                 subprotocols=["sandlot"]) as raw:  # type: ignore[list-item]  # fmt: skip
        raw.send(json.dumps({"type": "spawn", "argv": SHELL, "tty": True, "stdin": True}))
        while not (isinstance(m := raw.recv(timeout=30), str) and json.loads(m)["type"] == "started"):
            pass
        wait_for_prompt(raw)
        drain(raw)  # anything else the shell says first
        browser, plain = [], []
        for i in range(runs + 3):  # the first ones warm up
            b, p = echo_in_page(page), echo_raw(raw)
            if i >= 3:
                browser.append(b)
                plain.append(p)
            if i % 40 == 39:  # erase the line of x's (the shell redraws it), then let both settle
                page.keyboard.press("Control+u")
                raw.send(b"\x00\x15")
                drain(raw)
    return browser, plain


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--boxes", type=int, default=200)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    n, runs = (20, 5) if args.quick else (args.boxes, args.runs)
    from playwright.sync_api import sync_playwright

    home = scratch_home("bench-console-")
    try:
        with serving(home, no_auth=True) as srv, srv.client() as api:
            root = str(busybox_root())
            t0 = time.perf_counter()
            for i in range(n - 1):
                api.post(
                    "/v1/boxes", json={"rootfs": root, "name": f"idle-{i:03d}", "start": False}
                ).raise_for_status()
            made_s = time.perf_counter() - t0
            live = api.post("/v1/boxes", json={"rootfs": root, "name": "live", "memory_mib": 256})
            live.raise_for_status()
            box = live.json()
            listing = []
            for _ in range(runs):
                t1 = time.perf_counter()
                assert len(api.get("/v1/boxes", params={"limit": 1000}).json()["boxes"]) == n
                listing.append(time.perf_counter() - t1)
            with sync_playwright() as p:
                browser = launch(p)
                context = browser.new_context(base_url=srv.url, viewport={"width": 1280, "height": 900})
                context.add_init_script(PROBE)
                page = context.new_page()
                render = render_times(page, n, runs)
                changes = state_change_times(page, api, box, runs * 2)
                typed, raw = keystroke_times(page, srv.url, box, runs * 4)
                browser.close()
            version = api.get("/health").json()["version"]
            typed_ms, raw_ms = summary(typed, 1e3), summary(raw, 1e3)
            emit({
                "benchmark": "console",
                "quick": args.quick,
                "host": {**host_facts(box.get("accel")), "chromium": CHROMIUM, "sandlot": version},
                "boxes": n,
                "create_unstarted_box_ms": round(made_s / max(1, n - 1) * 1e3, 1),
                "boxes_page_render_ms": summary(render, 1e3, 1),
                "of_which_the_list_request_ms": summary(listing, 1e3, 1),  # GET /v1/boxes, from Python
                "state_change_to_screen_ms": summary(changes, 1e3, 1),
                "keystroke_echo_ms": {"console": typed_ms, "raw_websocket": raw_ms,
                                      "added_p50": round(typed_ms["median"] - raw_ms["median"], 2)},
                "targets": {"render_200_ms": 300, "state_change_ms": 1000, "echo_added_ms": 20},
            })  # fmt: skip
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
