"""The browser the console's tests, benchmark and screenshots drive: the distro's
Chromium (scripts/setup installs it), else Playwright's own build, which setup
fetches where the distro has none (Ubuntu)."""

from __future__ import annotations

import shutil
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # None: Playwright's own


def launch(playwright: Any, *args: str) -> Any:
    """Headless Chromium from a ``sync_playwright()`` context (no sandbox: tests run as root),
    with Chromium's command-line ``args`` besides."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", *args])
