"""``box.desktop``'s host side without a VM, against a VNC server in memory
(tests/support/fake_vnc.py): key names as models write them become keysyms, actions
become VNC pointer and key events, the framebuffer becomes a PNG in the right colours,
the window manager's list is read, bad input is refused before anything runs, a lost
VNC session is opened again, and the computer tool maps Anthropic's and OpenAI's action
shapes and a model's display size. The desktop itself is driven for real in
tests/vm/test_desktop.py."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest
from PIL import Image

from sandlot import records
from sandlot.api.desktop import VNC_SECRETS, AsyncDesktop, keysyms_of, normalize_key, parse_windows
from sandlot.api.rfb import RfbClient, RfbError
from sandlot.errors import InvalidArgument
from sandlot.tools import ToolInputError, Toolkit
from sandlot.tools.toolkit import scroll_notches

from tests.support.fake_vnc import FakeRelay, FakeVncServer


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


PASSWORD = "s3cret"
LEFT, RIGHT, WHEEL_UP, WHEEL_DOWN = 1, 4, 8, 16


class Recorder:
    """A box with a desktop: its commands answered as the desktop's tools answer, its
    relay connected to a VNC server in memory."""

    def __init__(self, screen: tuple[int, int] = (1024, 768)) -> None:
        self.screen = screen
        self.calls: list[tuple[str, ...]] = []
        self.name = "desk"
        self.vnc = FakeVncServer(screen, PASSWORD)
        self.relays: list[FakeRelay] = []
        self.running = True  # the desktop: False until its start

    async def exec(self, *argv: str, **kw: Any) -> Any:
        from sandlot.api.process import ExecResult

        self.calls.append(argv)
        out = b""
        if argv[:2] == ("/usr/local/bin/sandlot-desktop", "start"):
            self.running = True
        elif argv == ("sh", "-c", VNC_SECRETS) and not self.running:
            return ExecResult(
                argv=argv, exit_code=1, stderr_bytes=b"cat: passwords: No such file or directory"
            )
        elif argv == ("sh", "-c", VNC_SECRETS):
            sock = "/home/agent/.cache/sandlot-desktop/vnc.sock"
            out = f"{PASSWORD}\nview0nly\n{sock}\nX=7\nY=9\nSCREEN=0\nWINDOW=1\n".encode()
        elif argv[:2] == ("xmodmap", "-pk"):  # a, and keycodes 250..255 with no keysym
            out = b"    38    \t0x0061 (a)\t0x0041 (A)\t\n" + b"".join(
                f"    {code}    \t\n".encode() for code in range(250, 256)
            )
        elif argv[0] == "wmctrl":
            out = WINDOWS.encode()
        return ExecResult(argv=argv, exit_code=0, stdout_bytes=out)

    async def spawn(self, *argv: str, **kw: Any) -> FakeRelay:
        assert argv == ("/proc/1/exe", "--relay", "/home/agent/.cache/sandlot-desktop/vnc.sock"), argv
        self.calls.append(("relay",))
        self.relays.append(FakeRelay(self.vnc))
        return self.relays[-1]

    def events(self) -> list[tuple[Any, ...]]:
        """The pointer and key events so far, forgotten once read."""
        out, self.vnc.events = self.vnc.events, []
        return out


def desktop(screen: tuple[int, int] = (1024, 768)) -> tuple[AsyncDesktop, Recorder]:
    rec = Recorder(screen)
    return AsyncDesktop(rec), rec  # type: ignore[arg-type]


def pointer(x: int, y: int, mask: int = 0) -> tuple[Any, ...]:
    return ("pointer", x, y, mask)


def keys(*syms: int) -> list[tuple[Any, ...]]:
    """Each keysym pressed and released, one after another."""
    return [e for s in syms for e in (("key", s, True), ("key", s, False))]


def test_actions_are_vnc_events_and_bad_ones_send_nothing() -> None:
    desk, rec = desktop()

    async def go() -> None:
        await desk.click(10, 20)  # the session puts the pointer where it is first
        assert rec.events() == [pointer(7, 9), pointer(10, 20), pointer(10, 20, LEFT), pointer(10, 20)]
        await desk.double_click(5, 6)
        assert rec.events() == [pointer(5, 6), *[pointer(5, 6, LEFT), pointer(5, 6)] * 2]
        await desk.right_click()  # where this session last put the pointer
        assert rec.events() == [pointer(5, 6), pointer(5, 6, RIGHT), pointer(5, 6)]
        await desk.scroll(100, 100, dy=-2)
        assert rec.events() == [pointer(100, 100), *[pointer(100, 100, WHEEL_UP), pointer(100, 100)] * 2]
        await desk.drag((1, 1), (50, 60), (70, 80))
        path = [pointer(1, 1, LEFT), pointer(50, 60, LEFT), pointer(70, 80, LEFT)]
        assert rec.events() == [pointer(1, 1), *path, pointer(70, 80)]
        await desk.mouse_down()
        await desk.move(3, 4)
        await desk.mouse_up()
        assert rec.events() == [pointer(70, 80, LEFT), pointer(3, 4, LEFT), pointer(3, 4)]
        await desk.type("héllo\nA")
        assert rec.events() == keys(0x68, 0xE9, 0x6C, 0x6C, 0x6F, 0xFF0D, 0x41)
        await desk.key("ctrl+L", "Enter")
        assert rec.events() == [("key", 0xFFE3, True), *keys(0x6C), ("key", 0xFFE3, False), *keys(0xFF0D)]
        await desk.key_down("shift")
        await desk.key_up("shift")
        assert rec.events() == keys(0xFFE1)
        assert await desk.size() == (1024, 768)
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
            assert len(rec.calls) == before and rec.events() == []

    asyncio.run(go())
    assert rec.calls == [
        ("sh", "-c", VNC_SECRETS),  # the desktop runs: reached without starting it
        ("relay",),  # one VNC session for every call
        ("/usr/local/bin/sandlot-desktop", "start", "1024x768"),  # the commands start it (or see it run)
        ("xmodmap", "-pk"),  # é is on no key: it gets one of its own before it is typed
        ("xmodmap", "-e", "keycode 255 = 0xe9 0xe9"),
    ]
    assert all(incremental == 0 for incremental, *_ in rec.vnc.requests)


def test_what_vnc_cannot_say_goes_to_xdotool() -> None:
    desk, rec = desktop()

    async def go() -> None:
        await desk.click(5, 6, button="forward")  # past a VNC pointer event's eight buttons
        await desk.key("XF86AudioMute")  # a keysym name this side does not know
        await desk.right_click()  # where the X server has the pointer (a session starts there)

    asyncio.run(go())
    assert [c for c in rec.calls if c[0] == "xdotool"] == [
        ("xdotool", "mousemove", "5", "6", "click", "--delay", "0", "9"),
        ("xdotool", "key", "--clearmodifiers", "--", "XF86AudioMute"),
    ]
    assert rec.events() == [pointer(7, 9), pointer(7, 9), pointer(7, 9, RIGHT), pointer(7, 9)]
    assert keysyms_of("ctrl+shift+t") == [0xFFE3, 0xFFE1, 0x74] and keysyms_of("F12") == [0xFFC9]
    assert keysyms_of("XF86AudioMute") is None


def test_a_desktop_is_started_where_it_does_not_run_and_a_lost_session_opened_again() -> None:
    desk, rec = desktop()
    rec.running = False

    async def go() -> None:
        await desk.move(1, 2)
        start = ("/usr/local/bin/sandlot-desktop", "start", "1024x768")
        assert rec.calls == [("sh", "-c", VNC_SECRETS), start, ("sh", "-c", VNC_SECRETS), ("relay",)]
        await rec.relays[0].kill()  # the box was rolled back: its relay is gone
        await desk.move(3, 4)
        assert len(rec.relays) == 2 and rec.events() == [
            pointer(7, 9),
            pointer(1, 2),
            pointer(7, 9),
            pointer(3, 4),
        ]

    asyncio.run(go())


def test_a_session_lost_in_the_middle_of_typing_is_not_typed_again() -> None:
    from sandlot.errors import ConnectionLost

    desk, rec = desktop()

    async def go() -> None:
        await desk.click(1, 1)
        await rec.relays[0].kill()  # lost between two calls: the click is made on a new session
        await desk.click(2, 2)
        assert len(rec.relays) == 2
        assert rec.events()[-3:] == [pointer(2, 2), pointer(2, 2, LEFT), pointer(2, 2)]

        async def lose_it() -> None:  # once the first key has arrived
            await rec.vnc.key_pressed.wait()
            await rec.relays[1].kill()

        loser = asyncio.ensure_future(lose_it())
        with pytest.raises(ConnectionLost, match="during typing, part of which had been sent"):
            await desk.type("abcdefgh", delay_ms=50)
        await loser
        typed = [e[1] for e in rec.events() if e[0] == "key" and e[2]]
        assert 0 < len(typed) < 8 and typed == sorted(set(typed))  # a part, each key once
        await desk.key("Return")  # and the next call opens another session
        assert len(rec.relays) == 3

    asyncio.run(go())


def test_the_vnc_handshake_refuses_a_wrong_password_and_a_stranger() -> None:
    async def go() -> None:
        relay = FakeRelay(FakeVncServer((64, 64), PASSWORD))
        from sandlot.api.bridge import RelayDuplex

        with pytest.raises(RfbError, match="refused the password: Authentication failed"):
            await RfbClient.connect(RelayDuplex(relay), "wrong")  # type: ignore[arg-type]
        stranger = FakeRelay(FakeVncServer((64, 64), PASSWORD))
        stranger.server.out = asyncio.Queue()
        stranger.server.out.put_nowait(b"SSH-2.0-Open")
        with pytest.raises(RfbError, match="not a VNC server"):
            await RfbClient.connect(RelayDuplex(stranger), PASSWORD)  # type: ignore[arg-type]

    asyncio.run(go())


def test_a_screen_larger_than_the_host_holds_is_refused_before_any_pixel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The box's VNC server says how large its screen is, and the host holds it, 4 bytes a
    pixel: past ``SANDLOT_DESKTOP_MAX_PIXELS`` the session is refused, and counted."""
    monkeypatch.setenv("SANDLOT_DESKTOP_MAX_PIXELS", "10000")

    async def go() -> None:
        from sandlot.api.bridge import RelayDuplex

        before = records.TALLY.snapshot().get(("desktop", "refused", ""), 0)
        with pytest.raises(RfbError, match=r"screen is 128x128, more than the 10,000 pixels.*MAX_PIXELS"):
            await RfbClient.connect(RelayDuplex(FakeRelay(FakeVncServer((128, 128), PASSWORD))), PASSWORD)  # type: ignore[arg-type]
        assert records.TALLY.snapshot()[("desktop", "refused", "")] == before + 1
        client = await RfbClient.connect(RelayDuplex(FakeRelay(FakeVncServer((64, 64), PASSWORD))), PASSWORD)  # type: ignore[arg-type]
        assert (client.width, client.height) == (64, 64)

    asyncio.run(go())


def test_updates_copy_and_paint_the_framebuffer_and_stay_on_the_screen() -> None:
    client = RfbClient(None, None, 4, 2, "t")  # type: ignore[arg-type]
    client._put(1, 0, 2, 1, bytes([1, 2, 3, 0, 4, 5, 6, 0]))
    client._copy(1, 0, 2, 1, 2, 1)
    assert bytes(client.framebuffer[4:12]) == bytes([1, 2, 3, 0, 4, 5, 6, 0])
    assert bytes(client.framebuffer[16 + 8 : 16 + 16]) == bytes([1, 2, 3, 0, 4, 5, 6, 0])
    desk, rec = desktop((8, 8))

    async def go() -> None:
        await desk.move(0, 0)
        rec.vnc.copies.append((0, 0, 6, 6, 4, 4))  # a copy that leaves the screen
        with pytest.raises(RfbError, match="outside the 8x8 screen"):
            await desk.screenshot()
        await desk.screenshot()  # a new session
        assert len(rec.relays) == 2

    asyncio.run(go())


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
    assert box.calls == [("sh", "-c", VNC_SECRETS)]


def test_screenshots_are_cropped_and_scaled_pngs() -> None:
    desk, rec = desktop((200, 100))

    async def go() -> None:
        image = Image.open(io.BytesIO(await desk.screenshot()))
        assert (image.format, image.size, image.getpixel((5, 5))) == ("PNG", (200, 100), (40, 80, 120))
        assert Image.open(io.BytesIO(await desk.screenshot(region=(10, 10, 50, 20)))).size == (50, 20)
        assert Image.open(io.BytesIO(await desk.screenshot(scale=0.5))).size == (100, 50)
        assert Image.open(io.BytesIO(await desk.screenshot(scale=(64, 64)))).size == (64, 64)
        with pytest.raises(InvalidArgument):
            await desk.screenshot(region=(150, 0, 100, 10))  # off the screen
        rec.vnc.pixels[0:4] = bytes([255, 0, 0, 0])  # the screen changes: the next one shows it
        rec.vnc.new_pointer = True  # and the pointer's shape comes instead of the first answer
        assert Image.open(io.BytesIO(await desk.screenshot())).getpixel((0, 0)) == (255, 0, 0)

    asyncio.run(go())
    assert rec.vnc.requests[-2:] == [(0, 0, 0, 200, 100)] * 2  # the whole screen, asked for again
    assert rec.vnc.encodings == [1, 0, -239]  # the pointer's shape apart: not drawn into screenshots


class FakeBox(Recorder):
    """A box's handle; like AsyncBox's, each handle's desktop is its own."""

    id = "b-1"
    ref = None

    @property
    def desktop(self) -> AsyncDesktop:
        return AsyncDesktop(self)  # type: ignore[arg-type]


def toolkit(box: FakeBox, display: tuple[int, int] | None) -> Toolkit:
    """The computer handler alone, on the fake box (found anew at each call, as by key)."""
    kit = Toolkit.__new__(Toolkit)
    kit.display_size, kit.settle, kit.desktops = display, 0.0, {}

    async def the_box(key: str | None) -> Any:
        return box

    kit.box = the_box  # type: ignore[method-assign]
    return kit


def run_tool(
    screen: tuple[int, int], display: tuple[int, int] | None, args: dict[str, Any]
) -> tuple[Any, list[tuple[str, ...]]]:
    box = FakeBox(screen)
    kit = toolkit(box, display)
    from sandlot.tools import specs

    result = asyncio.run(kit.computer(specs.BY_NAME["computer"].validate(args)))  # type: ignore[arg-type]
    start, *events = box.events()
    assert start == pointer(7, 9)  # the session puts the pointer where it is first
    return result, events


def test_the_computer_tool_takes_both_vendors_shapes_in_the_models_display() -> None:
    # Anthropic's: coordinates of a 1024x640 display on a 2048x1280 screen
    result, events = run_tool((2048, 1280), (1024, 640), {"action": "left_click", "coordinate": [100, 50]})
    assert events == [pointer(200, 100), pointer(200, 100, LEFT), pointer(200, 100)]
    assert result.data == {"action": "left_click", "width": 1024, "height": 640}
    shot = Image.open(io.BytesIO(__import__("base64").b64decode(result.images[0].data)))
    assert shot.size == (1024, 640)  # scaled to what the model was told
    # OpenAI's: the action named by "type", pixels of scroll, keys pressed together
    scroll = {"type": "scroll", "x": 10, "y": 20, "scroll_x": 0, "scroll_y": 250}
    _, events = run_tool((1024, 768), None, scroll)
    assert events == [pointer(10, 20), *[pointer(10, 20, WHEEL_DOWN), pointer(10, 20)] * 2]
    _, events = run_tool((1024, 768), None, {"type": "keypress", "keys": ["CTRL", "L"]})
    assert events == [("key", 0xFFE3, True), *keys(0x6C), ("key", 0xFFE3, False)]
    _, events = run_tool((1024, 768), None, {"type": "drag", "path": [{"x": 1, "y": 2}, {"x": 3, "y": 4}]})
    assert events[:2] == [pointer(1, 2), pointer(1, 2, LEFT)]
    _, events = run_tool((1024, 768), None, {"type": "click", "x": 5, "y": 6, "button": "right"})
    assert events == [pointer(5, 6), pointer(5, 6, RIGHT), pointer(5, 6)]
    for bad in ({"action": "left_click", "coordinate": [1024, 10]}, {"action": "mouse_move"},
                {"action": "type"}, {"action": "left_click_drag", "coordinate": [1, 1]}):  # fmt: skip
        with pytest.raises(ToolInputError):
            run_tool((1024, 768), None, bad)
    assert [scroll_notches(p) for p in (0, 1, -40, 250, -1000)] == [0, 1, -1, 2, -10]


def test_the_computer_tool_keeps_one_vnc_session_a_box() -> None:
    from sandlot.tools import specs

    box = FakeBox((1024, 768))
    kit = toolkit(box, None)

    async def go() -> None:
        for x in (10, 20, 30):
            move = specs.BY_NAME["computer"].validate({"action": "mouse_move", "coordinate": [x, 5]})
            await kit.computer(move)  # type: ignore[arg-type]
        await kit.close_desktops()  # a toolkit dropped (an MCP server's, say) ends its sessions

    asyncio.run(go())
    assert len(box.relays) == 1  # not one relay (and one client of Xvnc) left in the box per call
    assert box.relays[0].returncode is not None and kit.desktops == {}
