"""``box.desktop``: the screen, mouse and keyboard of a desktop box, for computer-use
agents and for people watching them.

A desktop box boots an image with sandlot's desktop in it (``sandlot rootfs desktop
DIR``, ``images/builders.py``): Xvnc (X server and VNC server in one process), openbox,
Chromium, xterm, and the tools this module drives. The desktop starts on first use
(or ``start()``) as the box's user ``agent`` on display ``:0``.

The screen, the pointer and the keys go over VNC: this side speaks RFB (``rfb.py``)
to Xvnc's Unix socket in the box, through the box's relay (``bridge.open_relay``), the
way ``box.connect`` reaches a port. So a click is one message and one round trip, and
a screenshot one framebuffer update, on every transport (local, a server, a fleet),
with no daemon of sandlot's in the box and no port published. Windows, programs and
what VNC has no message for (a keysym name this side does not know, the pointer's
position, the window list) are commands of the box (``xdotool``, ``wmctrl``). A
snapshot, a fork or a rollback carries the desktop as it carries every other process;
a connection the box no longer has (a rollback, a restart) is opened again, once.

>>> with sandlot.Box(rootfs=desktop_dir, memory="2G") as box:        # doctest: +SKIP
...     box.desktop.open("https://example.org")
...     box.desktop.wait_for_window("Chromium")
...     png = box.desktop.screenshot(scale=0.5)
...     box.desktop.click(512, 300)
...     box.desktop.type("héllo")
...     box.desktop.key("ctrl+l")
...     print(box.desktop.stream_url())

Screenshots are cropped, scaled and encoded as PNG on this side with Pillow (``pip
install 'sandlot[desktop]'``): under emulation the host does that work many times
faster than the guest would.
"""

from __future__ import annotations

import asyncio
import errno
import io
import re
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from ..errors import (
    CommandFailed,
    ConnectionLost,
    GuestOSError,
    HostSetupError,
    InvalidArgument,
    InvalidState,
    Unsupported,
)
from .bridge import open_relay
from .rfb import BUTTON_BITS, ConnectionClosed, RfbClient, RfbError

if TYPE_CHECKING:
    from .bridge import Forward
    from .process import AsyncProcess, ExecResult


class DesktopBox(Protocol):
    """What a desktop needs of its box (``AsyncBox`` of any transport)."""

    @property
    def name(self) -> str: ...

    async def exec(self, *argv: str, env: Any = None, user: str | None = None,
                   timeout: float | None = None) -> ExecResult: ...  # fmt: skip

    @property
    def spawn(self) -> Callable[..., Awaitable[AsyncProcess]]: ...

    async def preview_url(self, port: int, ttl: float = 3600) -> str: ...


__all__ = ["AsyncDesktop", "Button", "Window", "check_size", "normalize_key"]

SCRIPT = "/usr/local/bin/sandlot-desktop"
USER = "agent"
DISPLAY = ":0"
ENV = {"DISPLAY": DISPLAY, "LANG": "C.UTF-8"}  # xdotool reads typed text in the locale's encoding
VIEWER_PORT = 6080
# seconds for the desktop, or its viewer, to start: under emulation on a loaded host, a minute or more
START_TIMEOUT = 120.0
DEFAULT_SIZE = (1024, 768)
MAX_COORD = 16384
TYPE_CHUNK = 200  # characters per piece: each piece's new keys are bound before it is typed
# the passwords of Xvnc's VNC authentication (full, view-only), where its socket is, and
# where the pointer is (a session puts it there first, and so owns it: Xvnc draws the
# pointer into the screen of a session that did not put it where it is)
VNC_SECRETS = ('state="$HOME/.cache/sandlot-desktop"; cat "$state/passwords" && echo "$state/vnc.sock" '
               "&& xdotool getmouselocation --shell")  # fmt: skip
VNC_TIMEOUT = 30.0  # seconds for one call's VNC messages and their answer
MULTI_CLICK_GAP = 0.05  # seconds between the clicks of a double click, as a hand makes them
DRAG_STEP_GAP = 0.03  # seconds between the points of a drag, so programs see it move
NO_DISPLAY = re.compile(rb"Can't open display|cannot open display|Error: Can't open display", re.I)

Button = Literal["left", "middle", "right", "back", "forward"]
BUTTONS: dict[str, int] = {"left": 1, "middle": 2, "right": 3, "back": 8, "forward": 9}
APPS: dict[str, tuple[str, ...]] = {
    "browser": ("chromium",),
    "chromium": ("chromium",),
    "terminal": ("xterm",),
    "xterm": ("xterm",),
}

# key names as models write them (Anthropic's xdotool names, OpenAI's, the DOM's) ->
# X keysym names, which xdotool takes
KEY_ALIASES = {
    "ctrl": "ctrl", "control": "ctrl", "alt": "alt", "option": "alt", "shift": "shift",
    "cmd": "super", "command": "super", "meta": "super", "super": "super", "win": "super",
    "windows": "super",
    "enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape",
    "backspace": "BackSpace", "tab": "Tab", "space": "space", "delete": "Delete", "del": "Delete",
    "insert": "Insert", "home": "Home", "end": "End", "pageup": "Prior", "page_up": "Prior",
    "pagedown": "Next", "page_down": "Next", "up": "Up", "down": "Down", "left": "Left",
    "right": "Right", "arrowup": "Up", "arrowdown": "Down", "arrowleft": "Left",
    "arrowright": "Right", "capslock": "Caps_Lock", "printscreen": "Print", "menu": "Menu",
    "minus": "minus", "plus": "plus", "slash": "slash", "backslash": "backslash",
    "comma": "comma", "period": "period", "semicolon": "semicolon",
}  # fmt: skip
KEYSYM = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # F-keys and single characters come before it

# the keysyms of the names normalize_key gives, and of the X names models use most; a
# name not here (XF86AudioMute...) is pressed by xdotool, which knows every name
NAMED_KEYSYMS: dict[str, int] = {
    "ctrl": 0xFFE3, "alt": 0xFFE9, "shift": 0xFFE1, "super": 0xFFEB,
    "Control_L": 0xFFE3, "Control_R": 0xFFE4, "Shift_L": 0xFFE1, "Shift_R": 0xFFE2,
    "Alt_L": 0xFFE9, "Alt_R": 0xFFEA, "Super_L": 0xFFEB, "Super_R": 0xFFEC, "Meta_L": 0xFFE7,
    "Return": 0xFF0D, "Escape": 0xFF1B, "BackSpace": 0xFF08, "Tab": 0xFF09, "space": 0x20,
    "Delete": 0xFFFF, "Insert": 0xFF63, "Home": 0xFF50, "End": 0xFF57, "Prior": 0xFF55,
    "Next": 0xFF56, "Page_Up": 0xFF55, "Page_Down": 0xFF56, "Up": 0xFF52, "Down": 0xFF54,
    "Left": 0xFF51, "Right": 0xFF53, "Caps_Lock": 0xFFE5, "Num_Lock": 0xFF7F, "Print": 0xFF61,
    "Menu": 0xFF67, "Pause": 0xFF13, "Scroll_Lock": 0xFF14, "ISO_Left_Tab": 0xFE20,
    "KP_Enter": 0xFF8D, "KP_Add": 0xFFAB, "KP_Subtract": 0xFFAD, "KP_Multiply": 0xFFAA,
    "KP_Divide": 0xFFAF, "KP_Decimal": 0xFFAE,
    "minus": 0x2D, "plus": 0x2B, "slash": 0x2F, "backslash": 0x5C, "comma": 0x2C, "period": 0x2E,
    "semicolon": 0x3B, "apostrophe": 0x27, "grave": 0x60, "equal": 0x3D, "bracketleft": 0x5B,
    "bracketright": 0x5D,
    **{f"F{n}": 0xFFBE + n - 1 for n in range(1, 36)},
    **{f"KP_{n}": 0xFFB0 + n for n in range(10)},
}  # fmt: skip
TYPED_KEYSYMS = {"\n": 0xFF0D, "\t": 0xFF09}  # what type() presses for a newline and a tab


def normalize_key(combo: str) -> str:
    """One key or combination (``"ctrl+l"``, ``"Return"``, ``"CTRL+SHIFT+T"``, ``"a"``) as
    xdotool names it. A single letter pressed with modifiers is the lower-case key (a
    model's ``ctrl+L`` means ctrl and the L key, not ctrl and shift and L)."""
    if not isinstance(combo, str) or not combo.strip():
        raise InvalidArgument("a key must be a non-empty string such as 'ctrl+l' or 'Return'")
    parts = combo.strip().split("+") if combo.strip() != "+" else ["plus"]
    if any(not p for p in parts):
        raise InvalidArgument(f"key {combo!r}: an empty name between '+' signs")
    names = []
    for part in parts:
        alias = KEY_ALIASES.get(part.lower())
        if alias is not None:
            names.append(alias)
        elif len(part) == 1 and part.isprintable():
            names.append(part)
        elif re.fullmatch(r"[fF][0-9]{1,2}", part):
            names.append(part.upper())
        elif KEYSYM.fullmatch(part):
            names.append(part)  # an X keysym name: XF86AudioMute, KP_Enter, Page_Up...
        else:
            raise InvalidArgument(f"key {combo!r}: {part!r} is not a key name")
    if len(names) > 1:
        names = [n.lower() if len(n) == 1 and n.isalpha() else n for n in names]
    return "+".join(names)


UNICODE_KEYSYMS = (0x1000100, 0x110FFFF)  # X keysyms of Unicode characters: 0x1000000 + code point
NEW_KEYS_PER_CHUNK = 16  # the keymap of Xvnc has 19 keycodes without a keysym


def keysym_of(char: str) -> int:
    """The X keysym of a character: Latin-1's own value, else 0x1000000 + its code point."""
    point = ord(char)
    return point if 0x20 <= point <= 0x7E or 0xA0 <= point <= 0xFF else 0x1000000 + point


def keysyms_of(combo: str) -> list[int] | None:
    """The keysyms of a combination as normalize_key gives it, pressed in this order
    (and released the other way); None where a name's keysym is not known here."""
    out = []
    for name in combo.split("+"):
        sym = keysym_of(name) if len(name) == 1 else NAMED_KEYSYMS.get(name)
        if sym is None:
            return None
        out.append(sym)
    return out


def type_chunks(text: str) -> list[str]:
    """``text`` in pieces of at most TYPE_CHUNK characters, each with at most
    NEW_KEYS_PER_CHUNK characters beyond ASCII (each may need a spare key)."""
    chunks: list[str] = []
    current: list[str] = []
    beyond: set[str] = set()
    for c in text:
        extra = ord(c) > 0x7E
        if len(current) >= TYPE_CHUNK or (extra and c not in beyond and len(beyond) >= NEW_KEYS_PER_CHUNK):
            chunks.append("".join(current))
            current, beyond = [], set()
        current.append(c)
        if extra:
            beyond.add(c)
    if current:
        chunks.append("".join(current))
    return chunks


def parse_keymap(text: str) -> dict[int, list[int]]:
    """``xmodmap -pk`` output: keycode -> its keysyms (NoSymbol left out)."""
    keymap: dict[int, list[int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].isdigit():
            continue
        syms = [int(f, 16) for f in fields[1:] if f.startswith("0x")]
        keymap[int(fields[0])] = [s for s in syms if s]
    return keymap


def _coord(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COORD:
        raise InvalidArgument(f"{name} must be an integer from 0 to {MAX_COORD - 1} (pixels), not {value!r}")
    return value


def _point(value: object) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidArgument(f"a point is (x, y), not {value!r}")
    return _coord("x", value[0]), _coord("y", value[1])


def _button(button: object) -> int:
    if button not in BUTTONS:
        raise InvalidArgument(f"button must be one of {', '.join(BUTTONS)}, not {button!r}")
    return BUTTONS[str(button)]


def check_size(size: object) -> tuple[int, int]:
    """A screen size (width, height) in pixels, each from 64 to 8192; InvalidArgument otherwise."""
    if (
        not isinstance(size, (tuple, list))
        or len(size) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and 64 <= v <= 8192 for v in size)
    ):
        raise InvalidArgument(f"size is (width, height) in pixels, each from 64 to 8192, not {size!r}")
    return int(size[0]), int(size[1])


@dataclass(frozen=True)
class Window:
    """A top-level window of the desktop, as the window manager lists it."""

    id: str  # X window id, 0x...
    title: str
    pid: int  # 0 where the program did not say
    x: int
    y: int
    width: int
    height: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "pid": self.pid, "x": self.x, "y": self.y,
                "width": self.width, "height": self.height}  # fmt: skip


def parse_windows(text: str) -> list[Window]:
    """``wmctrl -lpG`` output: id, desktop, pid, x, y, width, height, host, title."""
    out = []
    for line in text.splitlines():
        fields = line.split(None, 8)
        if len(fields) < 8:
            continue
        title = fields[8] if len(fields) == 9 else ""
        try:
            wid, _, pid, x, y, w, h = fields[0], fields[1], *map(int, fields[2:7])
        except ValueError:
            continue
        out.append(Window(wid, title, max(pid, 0), x, y, w, h))
    return out


def pillow() -> Any:
    """Pillow's Image module, which screenshots need."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - a dependency of sandlot[desktop]
        raise HostSetupError("screenshots need Pillow: pip install 'sandlot[desktop]'") from e
    return Image


T = TypeVar("T")


class AsyncDesktop:
    """The desktop of ``box`` (``box.desktop``). Coordinates are screen pixels from the
    top left; ``size()`` says the screen's. Each method starts the desktop if it is
    not running yet."""

    def __init__(self, box: DesktopBox) -> None:
        self._box = box
        self._started = False
        self._size: tuple[int, int] = DEFAULT_SIZE
        self._forward: Forward | None = None
        self._vnc: RfbClient | None = None
        self._vnc_lock = asyncio.Lock()

    # -- the session ---------------------------------------------------------------------------

    async def start(self, size: tuple[int, int] | None = None, *, timeout: float = START_TIMEOUT) -> None:
        """Start the desktop (X server, VNC server, window manager) if it is not running,
        at ``size`` (width, height; default 1024x768, what computer-use models are tuned
        for). A running desktop keeps its size. Raises Unsupported where the box's
        image has no desktop."""
        if size is not None:
            self._size = check_size(size)
        width, height = self._size
        await self._command(SCRIPT, "start", f"{width}x{height}", timeout=timeout, ensure=False)
        self._started = True

    async def running(self) -> bool:
        """Whether the desktop's X server runs."""
        result = await self._exec(SCRIPT, "status", timeout=30)
        return result.exit_code == 0

    async def _ensure(self) -> None:
        if not self._started:
            await self.start()

    # -- the screen ----------------------------------------------------------------------------

    async def screenshot(
        self,
        *,
        region: tuple[int, int, int, int] | None = None,
        scale: float | tuple[int, int] | None = None,
    ) -> bytes:
        """The screen as PNG bytes. ``region``: (x, y, width, height) of it alone.
        ``scale``: a factor (0.5 halves each side) or the (width, height) to scale to,
        e.g. the display size a model was told."""
        if region is not None:
            if not isinstance(region, (tuple, list)) or len(region) != 4:
                raise InvalidArgument(f"region is (x, y, width, height), not {region!r}")
            x, y = _coord("x", region[0]), _coord("y", region[1])
            w, h = _coord("width", region[2]), _coord("height", region[3])
            if w == 0 or h == 0:
                raise InvalidArgument("a region must be at least one pixel wide and high")
        target: tuple[int, int] | None = None
        factor: float | None = None
        if isinstance(scale, (tuple, list)):
            target = check_size(scale)
        elif scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 4:
                raise InvalidArgument(f"scale is a factor over 0 up to 4, or (width, height), not {scale!r}")
            factor = float(scale)
        image_module = pillow()

        async def frame(vnc: RfbClient) -> Any:  # copied out of the session's framebuffer under its lock
            return image_module.frombytes("RGB", (vnc.width, vnc.height), await vnc.refresh(), "raw", "RGBX")

        image = await self._over_vnc("a screenshot", frame, sync=False, repeatable=True)
        if region is not None:
            if x + w > image.width or y + h > image.height:
                screen = f"{image.width}x{image.height}"
                raise InvalidArgument(f"region {region!r} is not inside the {screen} screen")
            image = image.crop((x, y, x + w, y + h))
        if factor is not None and factor != 1:
            target = (max(1, round(image.width * factor)), max(1, round(image.height * factor)))
        if target is not None and target != image.size:
            image = image.resize(target, image_module.Resampling.LANCZOS, reducing_gap=2.0)
        out = io.BytesIO()
        image.save(out, "PNG", compress_level=1)
        return out.getvalue()

    async def size(self) -> tuple[int, int]:
        """The screen's (width, height) in pixels."""

        async def size(vnc: RfbClient) -> tuple[int, int]:
            return vnc.width, vnc.height

        return await self._over_vnc("the screen's size", size, sync=False, repeatable=True)

    async def cursor(self) -> tuple[int, int]:
        """Where the mouse pointer is: (x, y)."""
        found = dict(
            line.split("=", 1)
            for line in (await self._command("xdotool", "getmouselocation", "--shell")).stdout.splitlines()
            if "=" in line
        )
        return int(found["X"]), int(found["Y"])

    # -- the mouse -----------------------------------------------------------------------------

    async def move(self, x: int, y: int) -> None:
        """Move the pointer to (x, y)."""
        point = _coord("x", x), _coord("y", y)

        async def move(vnc: RfbClient) -> None:
            await vnc.send(vnc.pointer_event(*point, vnc.buttons))

        await self._over_vnc("a move", move, repeatable=True)

    async def click(self, x: int | None = None, y: int | None = None, *, button: Button = "left",
                    count: int = 1) -> None:  # fmt: skip
        """Click ``button`` at (x, y), or where the pointer is; ``count`` clicks in a row
        (2 is a double click)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 3:
            raise InvalidArgument(f"count is 1, 2 or 3 clicks, not {count!r}")
        number, point = _button(button), self._maybe_point(x, y)
        if number not in BUTTON_BITS:  # past what a VNC pointer event holds (forward): xdotool's
            click = ["click", "--delay", "0", str(number)]
            argv = ["mousemove", str(point[0]), str(point[1]), *click] if point else click
            for _ in range(count - 1):
                argv += ["sleep", "0.08", *click]
            await self._xdotool(*argv)
            return
        mask = 1 << BUTTON_BITS[number]

        async def clicks(vnc: RfbClient) -> None:
            at = self._pointer_of(vnc, point)
            await vnc.send(vnc.pointer_event(*at, vnc.buttons))
            for i in range(count):
                if i:
                    await vnc.sync()
                    await asyncio.sleep(MULTI_CLICK_GAP)
                await vnc.send(*vnc.click_events(*at, mask))

        await self._over_vnc("a click", clicks)

    async def double_click(self, x: int | None = None, y: int | None = None) -> None:
        """Two left clicks in a row at (x, y)."""
        await self.click(x, y, count=2)

    async def right_click(self, x: int | None = None, y: int | None = None) -> None:
        """A right click at (x, y)."""
        await self.click(x, y, button="right")

    async def mouse_down(self, button: Button = "left") -> None:
        """Press ``button`` where the pointer is, and hold it."""
        await self._press_button(button, True)

    async def mouse_up(self, button: Button = "left") -> None:
        """Release ``button``."""
        await self._press_button(button, False)

    async def _press_button(self, button: Button, down: bool) -> None:
        number = _button(button)
        if number not in BUTTON_BITS:
            await self._xdotool("mousedown" if down else "mouseup", str(number))
            return
        mask = 1 << BUTTON_BITS[number]

        async def press(vnc: RfbClient) -> None:
            at = self._pointer_of(vnc, None)
            await vnc.send(vnc.pointer_event(*at, vnc.buttons | mask if down else vnc.buttons & ~mask))

        await self._over_vnc("a button", press, repeatable=True)  # a state: held or not

    async def drag(self, *points: tuple[int, int], button: Button = "left") -> None:
        """Press ``button`` at the first point, move through the others, release at the
        last: ``drag((10, 10), (200, 150))``."""
        if len(points) < 2:
            raise InvalidArgument("a drag goes from one point to another: give two points or more")
        path = [_point(p) for p in points]
        number = _button(button)
        if number not in BUTTON_BITS:
            b = str(number)
            argv = ["mousemove", str(path[0][0]), str(path[0][1]), "mousedown", b]
            for px, py in path[1:]:
                argv += ["sleep", "0.03", "mousemove", str(px), str(py)]
            await self._xdotool(*argv, "sleep", "0.03", "mouseup", b)
            return
        mask = 1 << BUTTON_BITS[number]

        async def drag(vnc: RfbClient) -> None:
            start = vnc.pointer_event(*path[0], vnc.buttons)
            await vnc.send(start, vnc.pointer_event(*path[0], vnc.buttons | mask))
            for point in path[1:]:
                await vnc.sync()
                await asyncio.sleep(DRAG_STEP_GAP)
                await vnc.send(vnc.pointer_event(*point, vnc.buttons))
            await vnc.sync()
            await asyncio.sleep(DRAG_STEP_GAP)
            await vnc.send(vnc.pointer_event(*path[-1], vnc.buttons & ~mask))

        await self._over_vnc("a drag", drag, timeout=VNC_TIMEOUT + len(path) * DRAG_STEP_GAP)

    async def scroll(self, x: int | None = None, y: int | None = None, *, dy: int = 0, dx: int = 0) -> None:
        """Scroll at (x, y), or where the pointer is: ``dy`` notches down (negative: up),
        ``dx`` right (negative: left)."""
        for name, value in (("dy", dy), ("dx", dx)):
            if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 100:
                raise InvalidArgument(f"{name} is a number of notches from -100 to 100, not {value!r}")
        if not dx and not dy:
            raise InvalidArgument("scroll by something: dy (down) or dx (right)")
        point = self._maybe_point(x, y)
        # a notch is a click of the wheel's button: 4 up, 5 down, 6 left, 7 right
        wheel = [(5 if dy > 0 else 4, abs(dy)), (7 if dx > 0 else 6, abs(dx))]

        async def scroll(vnc: RfbClient) -> None:
            at = self._pointer_of(vnc, point)
            events = [vnc.pointer_event(*at, vnc.buttons)]
            for number, notches in wheel:
                mask = 1 << BUTTON_BITS[number]
                for _ in range(notches):
                    events += vnc.click_events(*at, mask)
            await vnc.send(*events)

        await self._over_vnc("a scroll", scroll)

    # -- the keyboard --------------------------------------------------------------------------

    async def type(self, text: str, *, delay_ms: int = 12) -> None:
        """Type ``text`` (any Unicode; a newline is Enter) into the focused window,
        ``delay_ms`` between keys. A character that no key of the keymap gives is bound
        to a spare key first, and stays bound (``bind_keys``)."""
        if not isinstance(text, str):
            raise InvalidArgument("text must be a string")
        if any(ord(c) < 32 and c not in "\n\t" for c in text):
            raise InvalidArgument("text may hold newlines and tabs, but no other control characters")
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or not 0 <= delay_ms <= 1000:
            raise InvalidArgument(f"delay_ms is from 0 to 1000, not {delay_ms!r}")
        for chunk in type_chunks(text):
            if any(keysym_of(c) > 0x7E for c in chunk if c not in TYPED_KEYSYMS):
                await self._bind_keys(set(chunk))
            syms = [TYPED_KEYSYMS.get(c) or keysym_of(c) for c in chunk]

            async def keys(vnc: RfbClient, syms: list[int] = syms) -> None:
                for i, sym in enumerate(syms):
                    if i and delay_ms:
                        await asyncio.sleep(delay_ms / 1000)
                    await vnc.send(vnc.key_event(sym, True), vnc.key_event(sym, False))

            await self._over_vnc("typing", keys, timeout=VNC_TIMEOUT + len(chunk) * delay_ms / 1000)

    async def _bind_keys(self, chars: set[str]) -> None:
        """Give each of ``chars`` that no key gives a spare key of its own (a keycode with
        no keysym, or one this did bind before to a character not wanted now). xdotool
        would bind it for one key press and unbind it at once, which a browser reads
        after the unbinding, and the character is lost."""
        keymap = parse_keymap((await self._command("xmodmap", "-pk")).stdout)
        present = {sym for syms in keymap.values() for sym in syms}
        wanted = {keysym_of(c) for c in chars if ord(c) > 0x7E}  # ASCII: on the keymap
        missing = sorted(wanted - present)
        if not missing:
            return
        spare = [code for code, syms in sorted(keymap.items(), reverse=True)
                 if not syms or (all(UNICODE_KEYSYMS[0] <= s <= UNICODE_KEYSYMS[1] for s in syms)
                                 and not wanted & set(syms))]  # fmt: skip
        if len(spare) < len(missing):
            raise CommandFailed(f"desktop: no spare key left to type {len(missing)} more characters", None,
                                box=self._box.name)  # fmt: skip
        argv = []
        for sym, code in zip(missing, spare, strict=False):
            argv += ["-e", f"keycode {code} = {sym:#x} {sym:#x}"]
        await self._command("xmodmap", *argv)

    async def key(self, *keys: str) -> None:
        """Press keys or combinations, one after another: ``key("ctrl+l")``,
        ``key("ctrl+a", "BackSpace")``. Names are X keysyms (``Return``, ``Page_Down``) or
        the names models use (``Enter``, ``PageDown``, ``cmd``)."""
        if not keys:
            raise InvalidArgument("press which key? e.g. key('Return')")
        combos = [normalize_key(k) for k in keys]
        syms = [keysyms_of(c) for c in combos]
        if any(s is None for s in syms):  # a keysym name known to xdotool alone
            await self._xdotool("key", "--clearmodifiers", "--", *combos)
            return

        async def press(vnc: RfbClient) -> None:
            events = []
            for combo in syms:
                assert combo is not None
                events += [vnc.key_event(s, True) for s in combo]
                events += [vnc.key_event(s, False) for s in reversed(combo)]
            await vnc.send(*events)

        await self._over_vnc("a key", press)

    async def key_down(self, key: str) -> None:
        """Press ``key`` (or a combination) and hold it."""
        await self._hold_key(key, True)

    async def key_up(self, key: str) -> None:
        """Release ``key``."""
        await self._hold_key(key, False)

    async def _hold_key(self, key: str, down: bool) -> None:
        combo = normalize_key(key)
        syms = keysyms_of(combo)
        if syms is None:
            await self._xdotool("keydown" if down else "keyup", "--", combo)
            return

        async def hold(vnc: RfbClient) -> None:
            await vnc.send(*(vnc.key_event(s, down) for s in (syms if down else reversed(syms))))

        await self._over_vnc("a key", hold, repeatable=True)  # a state: held or not

    # -- programs and windows ------------------------------------------------------------------

    async def launch(self, app: str | Sequence[str], *args: str) -> int:
        """Start a program on the desktop, detached, and return its pid: ``"browser"``
        (Chromium), ``"terminal"`` (xterm), or a command (a string is split as the
        shell would, a sequence is the argv), with ``args`` after it."""
        if isinstance(app, str):
            argv = list(APPS.get(app) or shlex.split(app))
        elif isinstance(app, Sequence) and app and all(isinstance(a, str) for a in app):
            argv = list(app)
        else:
            raise InvalidArgument(f"launch a program name, a command line or an argv, not {app!r}")
        if not argv or not all(isinstance(a, str) for a in args):
            raise InvalidArgument("launch what? the command is empty")
        result = await self._command(SCRIPT, "launch", *argv, *args)
        return int(result.stdout.split()[-1])

    async def open(self, target: str) -> int:
        """Open a URL or a file of the box in the browser; returns the browser's pid."""
        if not isinstance(target, str) or not target or target.startswith("-"):
            raise InvalidArgument(f"open a URL or a path, not {target!r}")
        return await self.launch("browser", target)

    async def windows(self) -> list[Window]:
        """The desktop's top-level windows, oldest first."""
        result = await self._command("wmctrl", "-lpG", check=False)
        if result.exit_code != 0 and b"Cannot get client list" in result.stderr_bytes:
            return []  # openbox sets the list with its first window
        if result.exit_code != 0:
            self._failed(("wmctrl", "-lpG"), result)
        return parse_windows(result.stdout)

    async def active_window(self) -> Window | None:
        """The window that has the focus, if one has."""
        result = await self._command("xdotool", "getactivewindow", check=False)
        if result.exit_code != 0:
            return None
        wid = int(result.stdout.strip() or 0)
        return next((w for w in await self.windows() if int(w.id, 16) == wid), None)

    async def wait_for_window(
        self, title: str | None = None, *, pid: int | None = None, timeout: float = 60
    ) -> Window:
        """The first window whose title holds ``title`` (case-insensitive) and, with
        ``pid``, that process's (``launch`` returns it), once one is there; raises
        TimeoutError after ``timeout`` seconds, naming the windows seen."""
        if title is None and pid is None:
            raise InvalidArgument("wait for a window by its title, its process (pid=) or both")
        if title is not None and not isinstance(title, str):
            raise InvalidArgument("title must be a string")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
            raise InvalidArgument(f"pid is a process id (a positive int), not {pid!r}")
        wanted = " and ".join(([f"titled {title!r}"] if title is not None else [])
                              + ([f"of process {pid}"] if pid is not None else []))  # fmt: skip
        deadline = time.monotonic() + timeout
        seen: list[Window] = []
        while True:
            seen = await self.windows()
            match = next((w for w in seen if (title is None or title.lower() in w.title.lower())
                          and (pid is None or w.pid == pid)), None)  # fmt: skip
            if match is not None:
                return match
            if time.monotonic() >= deadline:
                titles = ", ".join(repr(w.title) for w in seen) or "none"
                raise TimeoutError(f"no window {wanted} within {timeout:g} s (windows: {titles})")
            await asyncio.sleep(0.2)

    async def activate(self, window: Window | str) -> None:
        """Raise ``window`` (a Window, or a title it holds) and give it the focus."""
        target = window if isinstance(window, Window) else await self.wait_for_window(window, timeout=0)
        await self._command("wmctrl", "-ia", target.id)

    # -- watching ------------------------------------------------------------------------------

    async def stream_url(self, *, view_only: bool = True, ttl: float = 3600) -> str:
        """A URL of a page that shows the desktop live in a browser (noVNC), view-only
        unless ``view_only=False``. On a box of a server it is a preview URL, signed
        and expiring after ``ttl`` seconds; elsewhere this process forwards a port of
        127.0.0.1 to the box while it runs. No VNC port is published either way, and
        a view-only URL carries the view-only password: its session cannot type."""
        await self._command(SCRIPT, "stream", timeout=START_TIMEOUT)
        full, view = (await self._command(SCRIPT, "passwords")).stdout.split()[:2]
        fragment = f"#password={view if view_only else full}" + ("&view_only=1" if view_only else "")
        try:
            base = await self._box.preview_url(VIEWER_PORT, ttl)
        except Unsupported:
            base = await self._local_base()
        return base.rstrip("/") + "/index.html" + fragment

    async def _local_base(self) -> str:
        from .bridge import serve_forward

        if self._forward is None or self._forward.closed:
            self._forward = await serve_forward(self._box.spawn, VIEWER_PORT)
        host, port = self._forward.address
        return f"http://{host}:{port}"

    async def close_stream(self) -> None:
        """Stop forwarding the local stream URL's port (a server's preview ends with its
        ttl, or ``end_previews``)."""
        if self._forward is not None:
            await self._forward.aclose()
            self._forward = None

    # -- the VNC session -----------------------------------------------------------------------

    async def _over_vnc(self, what: str, call: Callable[[RfbClient], Awaitable[T]],
                        timeout: float = VNC_TIMEOUT, *, sync: bool = True,
                        repeatable: bool = False) -> T:  # fmt: skip
        """``call`` on this desktop's VNC session, then (with ``sync``) a round trip, so
        its events have reached the X server when this returns. A session the box has
        lost (a rollback, a restart, a box resumed) is opened again and the call made
        again, once: unless the call is not ``repeatable`` (a click, typed text) and had
        sent part of itself, which could then happen twice."""
        async with self._vnc_lock:
            for attempt in (1, 2):
                vnc: RfbClient | None = None
                sent: int | None = None  # what the session had sent before the call's first event
                try:
                    vnc = await self._vnc_session()
                    if not repeatable:  # a session lost since the last call is found before, not during
                        await vnc.sync()
                    sent = vnc.sent
                    async with asyncio.timeout(timeout):
                        result = await call(vnc)
                        if sync:
                            await vnc.sync()
                        return result
                except TimeoutError:
                    await self._drop_vnc()
                    raise TimeoutError(
                        f"desktop of box {self._box.name}: its VNC server did not answer {what} "
                        f"within {timeout:g} s") from None  # fmt: skip
                except (ConnectionClosed, ConnectionLost, InvalidState, OSError) as e:
                    await self._drop_vnc()  # the box lost the session: another one, once
                    if not repeatable and vnc is not None and sent is not None and vnc.sent > sent:
                        name = self._box.name
                        why = f"its VNC session ended during {what}, part of which had been sent"
                        raise ConnectionLost(f"desktop of box {name}: {why}; not made again", box=name) from e
                    if attempt == 2:
                        raise
                except RfbError:
                    await self._drop_vnc()  # out of step with the server: the next call starts afresh
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _vnc_session(self) -> RfbClient:
        if self._vnc is not None and not self._vnc.closed:
            return self._vnc
        # a desktop that runs (a box of a desktop template, say) is reached at once; only
        # where it does not is it started (its start waits for the window manager too)
        for attempt in (1, 2):
            secrets = await self._exec("sh", "-c", VNC_SECRETS, timeout=30)
            fields = secrets.stdout.split()
            at = dict(f.split("=", 1) for f in fields[3:] if "=" in f)
            duplex = None
            if secrets.exit_code == 0 and "X" in at and "Y" in at:
                try:
                    duplex = await open_relay(self._box.spawn, fields[2], timeout=15)
                except GuestOSError as e:
                    if e.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                        raise
            if duplex is not None:
                try:
                    async with asyncio.timeout(VNC_TIMEOUT):
                        vnc = await RfbClient.connect(duplex, fields[0])
                        await vnc.send(vnc.pointer_event(int(at["X"]), int(at["Y"]), 0))
                except BaseException:
                    await duplex.abort()
                    raise
                self._vnc = vnc
                return vnc
            if attempt == 2:
                raise CommandFailed(f"desktop: its VNC server cannot be reached ({secrets.stderr.strip()})",
                                    secrets, box=self._box.name)  # fmt: skip
            # not started yet, or gone (a rollback to before it started, a restarted box)
            self._started = False
            await self._ensure()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _drop_vnc(self) -> None:
        vnc, self._vnc = self._vnc, None
        if vnc is not None:
            await vnc.aclose()

    async def disconnect(self) -> None:
        """End this side's VNC session with the desktop (the next call opens another)."""
        async with self._vnc_lock:
            await self._drop_vnc()

    def _maybe_point(self, x: int | None, y: int | None) -> tuple[int, int] | None:
        if x is None and y is None:
            return None
        if x is None or y is None:
            raise InvalidArgument("give both x and y, or neither (where the pointer is)")
        return _coord("x", x), _coord("y", y)

    @staticmethod
    def _pointer_of(vnc: RfbClient, point: tuple[int, int] | None) -> tuple[int, int]:
        """``point``, or where the pointer is: where this session last put it (it puts it
        where the X server had it first)."""
        if point is not None:
            return point
        assert vnc.pointer is not None
        return vnc.pointer

    # -- running the tools ---------------------------------------------------------------------

    async def _xdotool(self, *argv: str, timeout: float = 30) -> None:
        await self._command("xdotool", *argv, timeout=timeout)

    async def _exec(self, *argv: str, timeout: float) -> ExecResult:
        # the desktop's script gives up on what does not start a little before the call's
        # timeout, so that its reason (with its log's end) is what the caller reads
        env = {**ENV, "SANDLOT_DESKTOP_WAIT": str(max(1, int(timeout - min(15.0, timeout / 4))))}
        try:
            return await self._box.exec(*argv, user=USER, env=env, timeout=timeout)
        except GuestOSError as e:
            if e.errno == errno.ENOENT:  # the program is not in the box's image
                raise Unsupported(
                    f"box {self._box.name} has no desktop ({argv[0]} is not in its image): boot one "
                    "made by `sandlot rootfs desktop DIR`", box=self._box.name) from e  # fmt: skip
            raise

    async def _command(
        self, *argv: str, timeout: float = 30, check: bool = True, ensure: bool = True
    ) -> ExecResult:
        if ensure:
            await self._ensure()
        result = await self._exec(*argv, timeout=timeout)
        if result.exit_code != 0 and ensure and NO_DISPLAY.search(result.stderr_bytes):
            # the display is gone (a rollback to before it started, a restarted box):
            # start it again, once
            self._started = False
            await self._ensure()
            result = await self._exec(*argv, timeout=timeout)
        if check and result.exit_code != 0:
            self._failed(argv, result)
        return result

    def _failed(self, argv: Sequence[str], result: ExecResult) -> None:
        what = result.stderr.strip().splitlines()[-3:] or [f"exit code {result.exit_code}"]
        raise CommandFailed(f"desktop: {' '.join(argv[:2])} failed: " + " / ".join(what), result,
                            box=self._box.name)  # fmt: skip
