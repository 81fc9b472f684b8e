"""Attach a local terminal (or plain pipes) to a process running in a box."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator

from ..api.process import AsyncProcess


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """The local terminal in raw mode for the duration (keys go to the box as typed)."""
    old = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
        return size.lines, size.columns
    except OSError:
        return 24, 80


async def attach(proc: AsyncProcess, *, stdin: bool, tty_mode: bool, timeout: float | None = None) -> int:
    """Stream the process's output here, forward our stdin if asked, follow terminal
    resizes when it has a PTY; return its exit code."""
    loop = asyncio.get_running_loop()

    async def pump(stream: object, fd: int) -> None:
        async for chunk in stream:  # type: ignore[attr-defined]
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    await asyncio.sleep(0.005)

    async def feed() -> None:
        if not stdin:
            await proc.close_stdin()
            return
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        fd = sys.stdin.fileno()

        def readable() -> None:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            queue.put_nowait(data)
            if not data:
                loop.remove_reader(fd)

        try:
            loop.add_reader(fd, readable)
        except PermissionError:  # a regular file: epoll cannot watch it, but reads never block
            while data := await asyncio.to_thread(os.read, fd, 65536):
                await proc.write_stdin(data)
            await proc.close_stdin()
            return
        try:
            while data := await queue.get():
                await proc.write_stdin(data)
            await proc.close_stdin()
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

    resizes: set[asyncio.Task[None]] = set()
    if tty_mode:

        def on_winch() -> None:
            rows, cols = terminal_size()
            task = loop.create_task(proc.resize(rows, cols))
            resizes.add(task)
            task.add_done_callback(resizes.discard)

        loop.add_signal_handler(signal.SIGWINCH, on_winch)
    feeder = asyncio.ensure_future(feed())
    try:
        streams = [pump(proc.stdout, sys.stdout.fileno())]
        if not tty_mode:
            streams.append(pump(proc.stderr, sys.stderr.fileno()))
        await asyncio.gather(*streams)
        return await proc.wait(timeout)
    finally:
        feeder.cancel()
        with contextlib.suppress(BaseException):
            await feeder
        if tty_mode:
            loop.remove_signal_handler(signal.SIGWINCH)
