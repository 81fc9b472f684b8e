#!/usr/bin/env python3
"""Desktop boxes (docs/desktop.md), on each engine this host has, in one run:

* ``image_MiB``: the desktop image's tree (``sandlot rootfs desktop``);
* ``start_s``: a new desktop box to its first screenshot (boot, then the X server,
  the VNC server and the window manager started);
* ``screenshot_ms``: a full 1024x768 screenshot (PNG), and one scaled to half;
* ``action_ms``: an action's round trip: move, click, a key, a word typed;
* ``first_screenshot_from_template_s``: a box of a template saved with its desktop
  running, from ``Box(template=...)`` to its first screenshot;
* ``idle_pss_MiB``: the box's whole process tree (QEMU; gVisor's sandbox, gofer and
  stubs) with the desktop idle and a small window open, then with Chromium showing a page
  (left out of TCG's quick mode: Chromium takes a minute and a half or more to load
  there, and a page not shown in 300 s is reported as such), and how long that page
  took to show.

    python benchmarks/desktop.py [--quick] [--engines qemu,gvisor]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import sandlot
from sandlot import AsyncBox, template_async

from _common import box_pss_mib, desktop_root, emit, gvisor_unusable, host_facts, parser, summary

PAGE = "<!doctype html><title>bench page</title><div style='height:200px;background:red'></div>"
MEMORY_MIB = {"qemu": 1024, "gvisor": 2048}
TARGETS = {"screenshot_p50_ms": 300, "action_p50_ms": 100, "first_screenshot_from_template_s": 2}


async def timed_ms(n: int, call: Any) -> dict[str, float | int]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await call(i)
        times.append(time.perf_counter() - t0)
    return summary(times, 1000, digits=1)


async def on_engine(engine: str, root: Path, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = 3 if quick else 30
    memory = MEMORY_MIB[engine]
    t0 = time.perf_counter()
    async with AsyncBox(rootfs=root, memory_mib=memory, engine=engine) as box:
        desk = box.desktop
        await desk.screenshot()
        out["start_s"] = round(time.perf_counter() - t0, 2)
        accel = box.accel
        # a small window to click and type into (xmessage: xterm's child cannot open its
        # terminal on Debian's gVisor of 2022-12, docs/desktop.md)
        await desk.launch("xmessage", "sandlot benchmark")
        await desk.wait_for_window("xmessage", timeout=120)  # (it gives no pid)
        out["screenshot_ms"] = {
            "full": await timed_ms(n, lambda _: desk.screenshot()),
            "half": await timed_ms(n, lambda _: desk.screenshot(scale=0.5)),
        }
        out["action_ms"] = {
            "move": await timed_ms(n, lambda i: desk.move(100 + 7 * i, 100 + 5 * i)),
            "click": await timed_ms(n, lambda i: desk.click(5 + i, 700)),  # on the desktop's background
            "key": await timed_ms(n, lambda _: desk.key("shift")),
            "type_word": await timed_ms(n, lambda _: desk.type("hello")),
        }
        await asyncio.sleep(3)  # idle
        out["idle_pss_MiB"] = {"desktop": box_pss_mib(await box.inspect())}
        if not (quick and accel == "tcg"):
            await box.files.write("/srv/bench/page.html", PAGE)
            t1 = time.perf_counter()
            try:
                await desk.wait_for_window("bench page", pid=await desk.open("file:///srv/bench/page.html"),
                                           timeout=300)  # fmt: skip
            except TimeoutError as e:  # a figure missing, and why, rather than none of the others
                out["browser_page_window_s"] = {"error": str(e)}
            else:
                out["browser_page_window_s"] = round(time.perf_counter() - t1, 2)
                await asyncio.sleep(5 if quick else 15)  # the browser settles
                out["idle_pss_MiB"]["with_chromium_page"] = box_pss_mib(await box.inspect())
    out["accel"] = accel

    # the template's desktop started by its setup command (run as root, it becomes the
    # desktop's user), as an image's author would save one
    setup = ["sandlot-desktop start"]
    tmpl = await template_async(rootfs=root, memory_mib=memory, engine=engine, setup=setup)
    try:
        firsts = []
        for _ in range(1 if quick else 8):
            t0 = time.perf_counter()
            async with AsyncBox(template=tmpl) as box:
                await box.desktop.screenshot()
                firsts.append(time.perf_counter() - t0)
        out["first_screenshot_from_template_s"] = summary(firsts, digits=2)
    finally:
        await tmpl.remove()
    actions = [v["median"] for v in out["action_ms"].values()]
    out["targets_met"] = {
        "screenshot_p50_ms": out["screenshot_ms"]["full"]["median"] <= TARGETS["screenshot_p50_ms"],
        "action_p50_ms": max(actions) <= TARGETS["action_p50_ms"],
        "first_screenshot_from_template_s": out["first_screenshot_from_template_s"]["median"]
        <= TARGETS["first_screenshot_from_template_s"],
    }
    return out


def engines_here(asked: list[str]) -> dict[str, str | None]:
    """Each engine asked for: None where it runs here, else why not."""
    doctor = sandlot.Runtime.for_home().doctor()
    return {engine: gvisor_unusable(doctor) if engine == "gvisor" else None for engine in asked}


def tree_mib(root: Path) -> float:
    """The bytes of a tree's files (hard links once), in MiB."""
    seen, total = set(), 0
    for path in root.rglob("*"):
        st = path.lstat()
        if path.is_file() and not path.is_symlink() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return round(total / (1 << 20), 1)


async def main(quick: bool, engines: list[str]) -> dict[str, Any]:
    root = desktop_root()
    out: dict[str, Any] = {"benchmark": "desktop", "quick": quick, "targets": TARGETS, "engines": {}}
    out["image_MiB"] = tree_mib(root)  # `sandlot rootfs desktop`'s tree
    accel = None
    for engine, why_not in engines_here(engines).items():
        if why_not is not None:
            out["engines"][engine] = {"available": False, "reason": why_not}
            continue
        figures = await on_engine(engine, root, quick)
        accel = figures["accel"] if engine == "qemu" else accel
        out["engines"][engine] = {"available": True, **figures}
    out["host"] = host_facts(accel)
    return out


if __name__ == "__main__":
    ap = parser(__doc__)
    ap.add_argument("--engines", default="qemu,gvisor", help="comma-separated: qemu, gvisor")
    args = ap.parse_args()
    asked = [e for e in args.engines.split(",") if e]
    if not asked or set(asked) - set(MEMORY_MIB):
        ap.error(f"--engines names qemu and/or gvisor, not {args.engines!r}")
    emit(asyncio.run(main(args.quick, asked)))
