"""The interpreter's capture of fd 1 and 2 (``sandlot.guest.interpreter.FdCapture``), on
the host: what a cell's child processes write reaches the cell before the cell ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sandlot.guest import interpreter
from sandlot.guest.interpreter import OUT, FdCapture


class Collected:
    def __init__(self) -> None:
        self.text = ""

    def stream(self, name: str, text: str) -> None:
        self.text += text


@pytest.fixture
def capture() -> Iterator[tuple[FdCapture, Collected]]:
    fd = os.open(os.devnull, os.O_WRONLY)  # a descriptor of the test's own, made a pipe
    cell = Collected()
    OUT.cell = cell  # type: ignore[assignment]
    try:
        yield FdCapture(fd, "stdout"), cell
    finally:
        OUT.cell = None
        os.close(fd)


def test_a_finished_child_s_output_is_passed_on_before_settle_returns(
    capture: tuple[FdCapture, Collected],
) -> None:
    cap, cell = capture
    for i in range(50):  # each child's line, every time: an empty pipe is not enough
        subprocess.run([sys.executable, "-c", f"import os; os.write({cap.fd}, b'sub {i}\\n')"],
                       pass_fds=[cap.fd], check=True)  # fmt: skip
        cap.settle(time.monotonic() + 5)
        assert cell.text.endswith(f"sub {i}\n"), cell.text[-40:]
    assert interpreter.FdCapture.MARK not in cell.text.encode()


def test_text_like_the_mark_passes_through_whole(capture: tuple[FdCapture, Collected]) -> None:
    cap, cell = capture
    lookalike = FdCapture.MARK[:-1]  # its start, and then no end: output, held a moment
    os.write(cap.fd, b"a\0b " + lookalike)
    cap.settle(time.monotonic() + 5)
    os.write(cap.fd, b" after\n")
    cap.settle(time.monotonic() + 5)
    assert cell.text == "a\0b " + lookalike.decode() + " after\n"
