"""The console's screenshots in docs/console/ (the README shows them), made again from
the code as it is: a real ``sandlot serve`` on a scratch home, real boxes, the
distro's Chromium through Playwright. Run it from a checkout after ./scripts/setup,
whenever the console changes:

    .venv/bin/python scripts/console_screenshots.py [--out docs/console]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.browser import launch  # noqa: E402
from tests.support.roots import busybox_root  # noqa: E402
from tests.support.serve import serving, shared_home  # noqa: E402

SIZE = {"width": 1280, "height": 760}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "console")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    import sandlot

    work = Path(tempfile.mkdtemp(prefix="console-shots-"))
    home = shared_home(work)
    try:
        with serving(home, no_auth=True) as srv, srv.client() as api:
            root = str(busybox_root())

            def make(name: str, **options: object) -> dict:
                r = api.post("/v1/boxes", json={"rootfs": root, "name": name, "memory_mib": 256, **options})
                r.raise_for_status()
                return dict(r.json())

            def sh(box: dict, cmd: str) -> None:
                api.post(f"/v1/boxes/{box['id']}/exec", json={"argv": ["sh", "-c", cmd]}).raise_for_status()

            agent = make("agent-main", labels={"team": "evals", "task": "refactor-42"})
            sh(agent, "mkdir -p /work/src && echo 'print(6 * 7)' > /work/src/main.py && date > /work/started")
            api.post(f"/v1/boxes/{agent['id']}/snapshots", json={"name": "cloned-repo"}).raise_for_status()
            sh(agent, "echo 'tests pass' > /work/status")
            api.post(f"/v1/boxes/{agent['id']}/snapshots", json={"name": "tests-pass"}).raise_for_status()
            api.post(f"/v1/boxes/{agent['id']}/fork", json={"n": 2, "name": "attempt"}).raise_for_status()
            make("scratch", labels={"team": "evals"}, start=False)
            make("nightly-build", labels={"team": "ci"})
            time.sleep(25)  # a few metrics samples (one every 10 s)
            with sync_playwright() as p:
                browser = launch(p)
                page = browser.new_page(base_url=srv.url, viewport=SIZE)

                def shot(name: str) -> None:
                    time.sleep(0.5)  # transitions and fonts settle
                    page.screenshot(path=str(args.out / f"{name}.png"))
                    print(args.out / f"{name}.png")

                page.goto("/console/#/boxes")
                page.locator('tr[data-name^="attempt"]').nth(1).wait_for()
                time.sleep(10)  # CPU and memory: the second sample round of the page
                shot("boxes")
                page.goto("/console/#/box/agent-main/terminal")
                page.locator("#terminal-status", has_text="shell ").wait_for(timeout=60_000)
                page.click("#terminal")
                page.keyboard.type("cat /work/src/main.py; uname -sr; ls /work\n")
                page.locator("#terminal .xterm-rows", has_text="started").wait_for()
                shot("terminal")
                page.goto("/console/#/box/agent-main/files")
                page.fill("#files-path", "/work")
                page.press("#files-path", "Enter")
                page.locator('#files tr[data-name="status"]').wait_for()
                page.click('#files tr[data-name="status"] button[data-action=edit]')
                page.wait_for_selector("#editor-text")
                shot("files")
                page.goto("/console/#/box/agent-main/tree")
                page.locator('g.node[data-name="tests-pass"]').click()
                shot("tree")
                page.goto("/console/#/box/agent-main/stats")
                page.wait_for_selector("#stats svg")
                shot("stats")
                browser.close()
    finally:
        for b in sandlot.list(home=home):
            b.remove(force=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
