"""Desktop boxes for computer use, for real (docs/desktop.md): sandlot's desktop image
(``builders.desktop_rootfs``: Xvnc, openbox, Chromium, xterm), driven by ``box.desktop``.

- On gVisor through a real ``sandlot serve`` (the remote transport), where Chromium runs
  at the host's speed: a page served inside the box is opened in the box's Chromium,
  found in a screenshot, clicked and typed into; the noVNC viewer is opened through the
  server's preview URL in the host's headless Chromium. (Not forked here: Debian's runsc
  of 2022-12 fails some checkpoints of a running Chromium, "encoding error at object
  gofer.dentry", and the box crashes.)
- In a microVM (QEMU; TCG here), locally: the desktop forked with its screen, each copy
  with a display of its own, and its viewer's page through a port of this process.
  (Chromium takes a minute and a half to load a page under TCG.)
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageChops

import sandlot
from sandlot.errors import Unsupported

from tests.support import roots
from tests.support.browser import launch
from tests.support.names import unique
from tests.support.serve import Served, create_key, serving
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vm

playwright_api = pytest.importorskip("playwright.sync_api")
needs_gvisor = pytest.mark.skipif(shutil.which("runsc") is None, reason="gVisor (runsc) is not installed")

RED, GREEN, BLUE = (255, 0, 0), (0, 160, 0), (0, 0, 255)
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>sandlot test page</title>
<style>
  body { margin: 0; background: #ffffff; }
  #block { width: 200px; height: 100px; background: #ff0000; }
  #go { display: block; width: 200px; height: 60px; border: 0; background: #00a000; }
  #field { display: block; width: 300px; height: 40px; font-size: 20px; }
</style></head>
<body>
<div id="block"></div>
<button id="go" onclick="document.getElementById('block').style.background = '#0000ff'">go</button>
<input id="field" oninput="document.title = 'typed: ' + this.value">
</body></html>
"""


def image(png: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(png))
    assert im.format == "PNG"
    return im.convert("RGB")


def box_of(shot: bytes | Image.Image, rgb: tuple[int, int, int]) -> tuple[int, int, int, int] | None:
    """The bounding box (left, top, right, bottom; inclusive) of the pixels of colour ``rgb``
    in a screenshot (PNG bytes or an image)."""
    im = image(shot) if isinstance(shot, bytes) else shot
    r, g, b = im.split()
    mask = ImageChops.multiply(
        ImageChops.multiply(
            r.point(lambda v: 255 if v == rgb[0] else 0), g.point(lambda v: 255 if v == rgb[1] else 0)
        ),
        b.point(lambda v: 255 if v == rgb[2] else 0),
    )
    found = mask.getbbox()
    return None if found is None else (found[0], found[1], found[2] - 1, found[3] - 1)


def differing(a: bytes, b: bytes) -> float:
    """The share of pixels that differ between two screenshots of the same size."""
    ia, ib = image(a), image(b)
    assert ia.size == ib.size
    diff = ImageChops.difference(ia, ib).convert("L").point(lambda v: 255 if v else 0)
    return sum(diff.histogram()[255:]) / (ia.width * ia.height)


@pytest.fixture(scope="module")
def desktop_root() -> Path:
    return roots.desktop_root()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """A server whose boxes run on gVisor (a box's engine is the server's to choose)."""
    home = Path(sandlot.Runtime.for_home().home)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SANDLOT_ENGINE", "gvisor")
        with serving(home) as s:
            yield s


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[Any]:
    tag = unique("desk")
    key = create_key(served.home, tag, "--namespace", tag, "--admin")  # admin: it boots a host rootfs
    with sandlot.connect(served.url, key) as c:
        yield c


@pytest.fixture(scope="module")
def page_box(client: Any, desktop_root: Path) -> Iterator[Any]:
    if shutil.which("runsc") is None:
        pytest.skip("gVisor (runsc) is not installed")
    """A gVisor desktop box of the server, its Chromium showing the test page, which a
    server inside the box serves."""
    box = client.create(rootfs=str(desktop_root), memory_mib=2048, cpus=2, name=unique("desk"))
    try:
        box.start()
        box.files.write("/srv/page/index.html", PAGE)
        box.spawn("python3", "-m", "http.server", "8000", "-b", "127.0.0.1", "-d", "/srv/page", user="agent")
        box.desktop.start()
        box.desktop.open("http://127.0.0.1:8000/")
        box.desktop.wait_for_window("sandlot test page", timeout=120)
        wait_for("the page painted", lambda: box_of(box.desktop.screenshot(), RED), timeout=60)
        yield box
    finally:
        box.remove(force=True)


@needs_gvisor
def test_the_page_is_seen_where_the_browser_shows_it(page_box: Any) -> None:
    desk = page_box.desktop
    assert desk.size() == (1024, 768)
    [window] = [w for w in desk.windows() if "sandlot test page" in w.title]
    shot = desk.screenshot()
    assert image(shot).size == (1024, 768)
    left, top, right, bottom = box_of(shot, RED)  # type: ignore[misc]
    # the block is 200x100 CSS pixels at the page's top left: the window's left edge,
    # below the browser's own bar
    assert (right - left + 1, bottom - top + 1) == (200, 100)
    assert window.x <= left <= window.x + 8 and window.y < top < window.y + 200
    green = box_of(shot, GREEN)
    assert green is not None and green[:3] == (left, bottom + 1, right)  # the button just under it
    # a region and a scale: the same block, half the size
    half = desk.screenshot(region=(left, top, 400, 200), scale=0.5)
    assert image(half).size == (200, 100)
    scaled = box_of(half, RED)
    assert scaled is not None and scaled[:2] == (0, 0) and 98 <= scaled[2] <= 99 and 48 <= scaled[3] <= 49


@needs_gvisor
def test_click_the_button_and_type_into_the_field(page_box: Any) -> None:
    desk = page_box.desktop
    block = box_of(desk.screenshot(), RED)
    assert block is not None
    left, _, _, bottom = block
    desk.click(left + 100, bottom + 30)  # the green button
    assert wait_for("the block turned blue", lambda: box_of(desk.screenshot(), BLUE)) == block
    desk.click(left + 150, bottom + 60 + 20)  # the field under the button
    text = "héllo wörld ✓ 1+1=2"
    desk.type(text)
    window = desk.wait_for_window(f"typed: {text}", timeout=30)  # the page put what it got in its title
    assert window.title.startswith(f"typed: {text}")
    desk.key("ctrl+a", "BackSpace")
    wait_for("the field emptied", lambda: all("wörld" not in w.title for w in desk.windows()), timeout=30)


@needs_gvisor
def test_the_stream_shows_the_desktop_through_the_servers_preview_url(page_box: Any) -> None:
    url = page_box.desktop.stream_url(view_only=True, ttl=600)
    assert "/p/" in url and "view_only=1" in url and "5900" not in url
    seen = viewer_shot(url, lambda shot: box_of(shot, RED) is not None or box_of(shot, BLUE) is not None)
    assert seen.width > 500
    colours = seen.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 10  # not blank: the desktop, the browser, the page
    assert box_of(seen, RED) is not None or box_of(seen, BLUE) is not None


def viewer_shot(url: str, shows: Callable[[Image.Image], object]) -> Image.Image:
    """The desktop as the noVNC page at ``url`` shows it, opened in the host's headless
    Chromium: its canvas, once it ``shows`` what is expected (its first frames take
    a while to come and paint)."""
    with playwright_api.sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 860})
            page.goto(url)
            page.wait_for_function("document.getElementById('status').dataset.state === 'connected'",
                                   timeout=60_000)  # fmt: skip

            def shot() -> Image.Image | None:
                seen = image(page.locator("#screen canvas").screenshot())
                return seen if shows(seen) else None

            return wait_for("the viewer showed the desktop", shot, timeout=60, every=0.5)
        finally:
            browser.close()


@needs_gvisor
def test_a_desktop_with_its_browser_open_forks_onto_the_same_screen_and_rolls_back(
    client: Any, desktop_root: Path
) -> None:
    """Snapshot a desktop whose Chromium shows a page, fork it into three: each copy
    starts on the parent's screen, pixel for pixel, and goes on alone, its own viewer
    showing its own screen; the parent rolls back to the page as it was. (The page is a
    file: a box holding a listening TCP socket, or one in TIME_WAIT, waits at a save.)"""
    box = client.create(rootfs=str(desktop_root), memory_mib=2048, cpus=2, name=unique("deskfork"))
    kids: list[Any] = []
    try:
        box.start()
        box.files.write("/srv/page/fork.html", PAGE.replace("sandlot test page", "fork page"))
        desk = box.desktop
        desk.start()
        desk.open("file:///srv/page/fork.html")
        desk.wait_for_window("fork page", timeout=120)
        wait_for("the page painted", lambda: box_of(desk.screenshot(), RED), timeout=60)
        screen = desk.screenshot()
        block = box_of(screen, RED)
        assert block is not None
        button = (block[0] + 100, block[3] + 30)
        snap = box.snapshot("page-open")
        kids = box.fork(3)
        assert [differing(screen, kid.desktop.screenshot()) for kid in kids] == [0, 0, 0]
        kids[0].desktop.click(*button)
        first = kids[0].desktop
        wait_for("the first copy's block turned blue", lambda: box_of(first.screenshot(), BLUE))
        assert differing(screen, kids[1].desktop.screenshot()) == 0  # its siblings and parent did not move
        assert differing(screen, desk.screenshot()) == 0
        # each copy a VNC session of its own: the first one's viewer shows its blue block
        seen = viewer_shot(kids[0].desktop.stream_url(view_only=True, ttl=600), lambda s: box_of(s, BLUE))
        assert box_of(seen, BLUE) is not None and box_of(seen, RED) is None
        desk.click(*button)
        wait_for("the parent's block turned blue", lambda: box_of(desk.screenshot(), BLUE))
        box.rollback(snap)
        assert differing(screen, desk.screenshot()) == 0
        desk.move(5, 5)
        assert desk.cursor() == (5, 5)
    finally:
        for kid in kids:
            kid.remove(force=True)
        box.remove(force=True)


def test_a_microvm_desktop_forks_with_its_screen_and_streams(desktop_root: Path) -> None:
    """Locally, in a microVM: the desktop starts, its screen is forked with it (each copy
    a display of its own), and its viewer comes through a port of this process."""
    with sandlot.Box(rootfs=desktop_root, memory_mib=1024, engine="qemu") as box:
        desk = box.desktop
        desk.start()
        assert desk.size() == (1024, 768)
        blank = desk.screenshot()
        assert len(image(blank).getcolors() or []) == 1  # the background alone
        desk.move(300, 200)
        [kid] = box.fork(1)
        try:
            assert differing(blank, kid.desktop.screenshot()) == 0
            assert kid.desktop.cursor() == (300, 200)  # the copy's pointer is where it was
            kid.desktop.move(10, 20)
            assert (kid.desktop.cursor(), desk.cursor()) == ((10, 20), (300, 200))
        finally:
            kid.remove(force=True)
        with pytest.raises(Unsupported):
            box.preview_url(6080)  # a local box has no server: the viewer comes through this process
        url = desk.stream_url(view_only=False)
        assert url.startswith("http://127.0.0.1:") and "view_only" not in url
        # the viewer's page through the port this process forwards (the page connecting to
        # the desktop in a browser: the tests on gVisor above)
        page = httpx.get(url.split("#")[0], timeout=60)
        assert page.status_code == 200 and "<title>sandlot desktop</title>" in page.text
        desk.close_stream()
        with pytest.raises(httpx.TransportError):
            httpx.get(url.split("#")[0], timeout=10)
