"""``box.desktop``'s host side without a VM: key names as models write them become
xdotool's, the window manager's list is read, a screen dump (XWD) becomes an image
in the right colours, bad input is refused before anything runs, and the computer
tool maps Anthropic's and OpenAI's action shapes and a model's display size. The
desktop itself is driven for real in tests/vm/test_desktop.py."""

from __future__ import annotations

import asyncio
import io
import struct
from typing import Any

import pytest
from PIL import Image

from sandlot.api.desktop import AsyncDesktop, normalize_key, parse_windows, xwd_image
from sandlot.errors import CommandFailed, InvalidArgument
from sandlot.tools import ToolInputError, Toolkit
from sandlot.tools.toolkit import scroll_notches


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("ctrl+l", "ctrl+l"), ("CTRL+L", "ctrl+l"), ("Return", "Return"), ("Enter", "Return"),
        ("ctrl+shift+T", "ctrl+shift+t"), ("cmd+c", "super+c"), ("PageDown", "Next"), ("esc", "Escape"),
        ("A", "A"), ("F5", "F5"), ("f12", "F12"), ("alt+Tab", "alt+Tab"), ("KP_Enter", "KP_Enter"),
        ("ArrowLeft", "Left"), ("+", "plus"), ("é", "é"),
    ],
)  # fmt: skip
def test_key_names_become_xdotools(given: str, expected: str) -> None:
    assert normalize_key(given) == expected


@pytest.mark.parametrize("bad", ["", "  ", "ctrl++", "ctrl+", "rm -rf", "a;b", "ctrl+\x00", 5])
def test_bad_key_names_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgument):
        normalize_key(bad)


WINDOWS = (
    "0x00600003  0 212    0 0    1024 740  sandlot Page · Chromium\n"
    "0x00800006  0 -1     10 20  484 316  sandlot xterm  with  spaces\n"
    "garbage\n"
)


def test_the_window_list_is_read() -> None:
    first, second = parse_windows(WINDOWS)
    assert (first.id, first.pid, first.width, first.title) == ("0x00600003", 212, 1024, "Page · Chromium")
    assert (second.pid, second.x, second.y, second.title) == (0, 10, 20, "xterm  with  spaces")


def xwd(width: int, height: int, pixels: bytes, *, pad: int = 0, name: bytes = b"root\0") -> bytes:
    """An XWD dump as ``xwd -root`` writes it from a 24-bit TrueColor screen."""
    bytes_per_line = width * 4 + pad
    header_size = 100 + len(name)
    fields = [header_size, 7, 2, 24, width, height, 0, 0, 32, 0, 32, 32, bytes_per_line, 4,
              0xFF0000, 0xFF00, 0xFF, 8, 256, 0, width, height, 0, 0, 0]  # fmt: skip
    rows = b"".join(pixels[y * width * 4 : (y + 1) * width * 4] + b"\0" * pad for y in range(height))
    return struct.pack(">25I", *fields) + name + rows


def test_a_screen_dump_becomes_an_image_in_its_colours() -> None:
    # BGRX in memory (little-endian 0x00RRGGBB): red, green / blue, white
    pixels = bytes([0, 0, 255, 0, 0, 255, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0])
    image = xwd_image(xwd(2, 2, pixels, pad=8))
    assert image.size == (2, 2)
    assert [image.getpixel(p) for p in ((0, 0), (1, 0), (0, 1), (1, 1))] == [
        (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]  # fmt: skip


@pytest.mark.parametrize("cut", [10, 120])
def test_a_short_or_foreign_dump_is_refused(cut: int) -> None:
    data = xwd(4, 4, b"\1" * 64)
    with pytest.raises(CommandFailed):
        xwd_image(data[:cut])
    with pytest.raises(CommandFailed):
        xwd_image(data[:4] + struct.pack(">I", 6) + data[8:])  # XWD version 6


class Recorder:
    """What AsyncDesktop runs in the box, answered as the desktop's tools answer."""

    def __init__(self, screen: tuple[int, int] = (1024, 768)) -> None:
        self.screen = screen
        self.calls: list[tuple[str, ...]] = []
        self.name = "desk"

    async def exec(self, *argv: str, **kw: Any) -> Any:
        from sandlot.api.process import ExecResult

        self.calls.append(argv)
        out = b""
        if argv[:2] == ("xdotool", "getdisplaygeometry"):
            out = f"{self.screen[0]} {self.screen[1]}\n".encode()
        elif argv[:2] == ("xmodmap", "-pk"):  # a, and keycodes 250..255 with no keysym
            out = b"    38    \t0x0061 (a)\t0x0041 (A)\t\n" + b"".join(
                f"    {code}    \t\n".encode() for code in range(250, 256)
            )
        elif argv[0] == "xwd":
            w, h = self.screen
            out = xwd(w, h, bytes([40, 80, 120, 0]) * (w * h))
        elif argv[0] == "wmctrl":
            out = WINDOWS.encode()
        return ExecResult(argv=argv, exit_code=0, stdout_bytes=out)


def desktop(screen: tuple[int, int] = (1024, 768)) -> tuple[AsyncDesktop, Recorder]:
    rec = Recorder(screen)
    return AsyncDesktop(rec), rec  # type: ignore[arg-type]


def test_actions_are_one_command_each_and_bad_ones_run_nothing() -> None:
    desk, rec = desktop()

    async def go() -> None:
        await desk.click(10, 20)
        await desk.double_click(5, 6)
        await desk.scroll(100, 100, dy=-2)
        await desk.drag((1, 1), (50, 60), (70, 80))
        await desk.type("héllo\nworld")
        await desk.key("ctrl+L", "Enter")
        bad_calls = (
            lambda: desk.click(-1, 3), lambda: desk.click(3), lambda: desk.scroll(1, 1),
            lambda: desk.type("a\x07"), lambda: desk.drag((1, 1)), lambda: desk.key(),
            lambda: desk.click(1, 1, button="thumb"), lambda: desk.screenshot(region=(0, 0, 0, 5)),
            lambda: desk.screenshot(scale=0), lambda: desk.launch(""), lambda: desk.open("-x"),
        )  # fmt: skip
        for bad in bad_calls:
            before = len(rec.calls)
            with pytest.raises(InvalidArgument):
                await bad()  # type: ignore[no-untyped-call]
            assert len(rec.calls) == before

    asyncio.run(go())
    start, *actions = rec.calls
    assert start == ("/usr/local/bin/sandlot-desktop", "start", "1024x768")
    assert actions == [
        ("xdotool", "mousemove", "10", "20", "click", "--delay", "0", "1"),
        ("xdotool", "mousemove", "5", "6", "click", "--delay", "0", "1", "sleep", "0.08", "click", "--delay",
         "0", "1"),
        ("xdotool", "mousemove", "100", "100", "click", "--repeat", "2", "--delay", "20", "4"),
        ("xdotool", "mousemove", "1", "1", "mousedown", "1", "sleep", "0.03", "mousemove", "50", "60",
         "sleep", "0.03", "mousemove", "70", "80", "sleep", "0.03", "mouseup", "1"),
        ("xmodmap", "-pk"),  # é is on no key: it gets one of its own before it is typed
        ("xmodmap", "-e", "keycode 255 = 0xe9 0xe9"),
        ("xdotool", "type", "--delay", "12", "--", "héllo\nworld"),
        ("xdotool", "key", "--clearmodifiers", "--", "ctrl+l", "Return"),
    ]  # fmt: skip


def test_a_window_is_waited_for_by_title_by_process_or_both() -> None:
    desk, _ = desktop()

    async def go() -> None:
        assert (await desk.wait_for_window("chromium")).id == "0x00600003"
        assert (await desk.wait_for_window(pid=212)).title == "Page · Chromium"
        assert (await desk.wait_for_window("page", pid=212)).pid == 212
        with pytest.raises(TimeoutError, match="titled 'xterm' and of process 212"):
            await desk.wait_for_window("xterm", pid=212, timeout=0)
        for bad in ({}, {"pid": 0}, {"pid": True}, {"title": 5}):
            with pytest.raises(InvalidArgument):
                await desk.wait_for_window(**bad)

    asyncio.run(go())


def test_text_is_typed_in_pieces_each_with_few_new_keys() -> None:
    from sandlot.api.desktop import TYPE_CHUNK, keysym_of, parse_keymap, type_chunks

    assert (keysym_of("a"), keysym_of("é"), keysym_of("✓")) == (0x61, 0xE9, 0x1002713)
    many = "".join(chr(0x4E00 + i) for i in range(40))
    chunks = type_chunks("ab" + many + "x" * 500)
    assert "".join(chunks) == "ab" + many + "x" * 500
    assert all(len(c) <= TYPE_CHUNK and len({ch for ch in c if ord(ch) > 126}) <= 16 for c in chunks)
    listing = "KeyCodes from 8\n      8    \t\n     38    \t0x0061 (a)\t0x0000 (NoSymbol)\t0x0041 (A)"
    keymap = parse_keymap(listing)
    assert keymap == {8: [], 38: [0x61, 0x41]}


def test_a_box_without_a_desktop_is_told_so() -> None:
    from sandlot.errors import Unsupported, guest_os_error

    class Plain(Recorder):
        async def exec(self, *argv: str, **kw: Any) -> Any:
            self.calls.append(argv)
            raise guest_os_error(2, f"{argv[0]}: not found")

    box = Plain()
    with pytest.raises(Unsupported, match="has no desktop"):
        asyncio.run(AsyncDesktop(box).screenshot())  # type: ignore[arg-type]
    assert box.calls == [("/usr/local/bin/sandlot-desktop", "start", "1024x768")]


def test_screenshots_are_cropped_and_scaled_pngs() -> None:
    desk, _ = desktop((200, 100))
    png = asyncio.run(desk.screenshot())
    image = Image.open(io.BytesIO(png))
    assert (image.format, image.size, image.getpixel((5, 5))) == ("PNG", (200, 100), (120, 80, 40))
    assert Image.open(io.BytesIO(asyncio.run(desk.screenshot(region=(10, 10, 50, 20))))).size == (50, 20)
    assert Image.open(io.BytesIO(asyncio.run(desk.screenshot(scale=0.5)))).size == (100, 50)
    assert Image.open(io.BytesIO(asyncio.run(desk.screenshot(scale=(64, 64))))).size == (64, 64)
    with pytest.raises(InvalidArgument):
        asyncio.run(desk.screenshot(region=(150, 0, 100, 10)))  # off the screen


class FakeBox(Recorder):
    id = "b-1"
    ref = None

    def __init__(self, screen: tuple[int, int]) -> None:
        super().__init__(screen)
        self.desktop = AsyncDesktop(self)  # type: ignore[arg-type]


def run_tool(
    screen: tuple[int, int], display: tuple[int, int] | None, args: dict[str, Any]
) -> tuple[Any, list[tuple[str, ...]]]:
    box = FakeBox(screen)
    kit = Toolkit.__new__(Toolkit)  # the computer handler alone, on the fake box
    kit.display_size, kit.settle, kit.screens, kit.default_box = display, 0.0, {}, box  # type: ignore[assignment]
    from sandlot.tools import specs

    async def go() -> Any:
        async def the_box(key: str | None) -> Any:
            return box

        kit.box = the_box  # type: ignore[method-assign]
        return await kit.computer(specs.BY_NAME["computer"].validate(args))  # type: ignore[arg-type]

    result = asyncio.run(go())
    return result, [c for c in box.calls if c[0] == "xdotool" and c[1] != "getdisplaygeometry"]


def test_the_computer_tool_takes_both_vendors_shapes_in_the_models_display() -> None:
    # Anthropic's: coordinates of a 1024x640 display on a 2048x1280 screen
    result, calls = run_tool((2048, 1280), (1024, 640), {"action": "left_click", "coordinate": [100, 50]})
    assert calls == [("xdotool", "mousemove", "200", "100", "click", "--delay", "0", "1")]
    assert result.data == {"action": "left_click", "width": 1024, "height": 640}
    shot = Image.open(io.BytesIO(__import__("base64").b64decode(result.images[0].data)))
    assert shot.size == (1024, 640)  # scaled to what the model was told
    # OpenAI's: the action named by "type", pixels of scroll, keys pressed together
    scroll = {"type": "scroll", "x": 10, "y": 20, "scroll_x": 0, "scroll_y": 250}
    _, calls = run_tool((1024, 768), None, scroll)
    assert calls == [("xdotool", "mousemove", "10", "20", "click", "--repeat", "2", "--delay", "20", "5")]
    _, calls = run_tool((1024, 768), None, {"type": "keypress", "keys": ["CTRL", "L"]})
    assert calls == [("xdotool", "key", "--clearmodifiers", "--", "ctrl+l")]
    _, calls = run_tool((1024, 768), None, {"type": "drag", "path": [{"x": 1, "y": 2}, {"x": 3, "y": 4}]})
    assert calls[0][:6] == ("xdotool", "mousemove", "1", "2", "mousedown", "1")
    _, calls = run_tool((1024, 768), None, {"type": "click", "x": 5, "y": 6, "button": "right"})
    assert calls == [("xdotool", "mousemove", "5", "6", "click", "--delay", "0", "3")]
    for bad in ({"action": "left_click", "coordinate": [1024, 10]}, {"action": "mouse_move"},
                {"action": "type"}, {"action": "left_click_drag", "coordinate": [1, 1]}):  # fmt: skip
        with pytest.raises(ToolInputError):
            run_tool((1024, 768), None, bad)
    assert [scroll_notches(p) for p in (0, 1, -40, 250, -1000)] == [0, 1, -1, 2, -10]
