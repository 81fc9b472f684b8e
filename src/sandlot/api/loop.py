"""The sync facade's engine: one event loop in a daemon thread per process.

Every sync call submits a coroutine of the async core to that loop and waits
for it, so ``Box`` and ``AsyncBox`` share one implementation. Ctrl-C while
waiting cancels the coroutine in the loop, then re-raises KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # its exit hook first: see the end of this module
import contextlib
import queue
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
RECORDS_AHEAD = 256  # items a prefetching iterator of records runs ahead of its caller
SETTLE_AT_EXIT = 60.0  # seconds the exit waits for the flight recorder's last checkpoints

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _loop_thread() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            threading.Thread(target=run, name="sandlot-loop", daemon=True).start()
            started.wait()
            _loop = loop
        return _loop


async def cancel_and_reap(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended, whatever it ended with (its error
    is taken, so none is reported as never retrieved). The caller's own cancellation
    while it waits is not swallowed: it raises, as any await does."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    await asyncio.wait(tasks)
    for t in tasks:
        if not t.cancelled():
            t.exception()


async def with_beats(source: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """``source``'s items, and None after each ``every`` seconds without one (a stream's
    keepalive), never cancelling the wait for its next item; ``source`` is closed at the
    end, whoever ends it."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        closing = getattr(source, "aclose", None)
        if closing is not None:
            with contextlib.suppress(Exception):
                await closing()


def _shutdown() -> None:
    """At exit: end the loop's tasks (agent readers...) quietly, then the loop."""
    loop = _loop
    if loop is None or not loop.is_running():
        return

    async def cancel_all() -> None:
        await cancel_and_reap(t for t in asyncio.all_tasks() if t is not asyncio.current_task())

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=2)
    loop.call_soon_threadsafe(loop.stop)


def _settle_recorders() -> None:
    """At exit, before anything stops: the flight recorder's last checkpoints, so that a
    program that recorded a box ends with its last step kept. This runs among threading's
    exit hooks, the same hook ``concurrent.futures`` uses: after it, executors take no new
    work, and the store runs its calls on one; ``atexit``'s hooks come after that."""
    loop, local = _loop, sys.modules.get("sandlot.api.local")  # none: no local box was reached
    if loop is None or not loop.is_running() or local is None:
        return
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(local.settle_recorders(), loop).result(timeout=SETTLE_AT_EXIT)


atexit.register(_shutdown)
# CPython's hook for what must run before its thread pools stop (no public one runs then);
# where it is missing, atexit's comes too late for the store and the last step is lost.
# Its hooks run last registered first: concurrent.futures.thread, imported at the top of
# this module, has registered the one that stops the pools, so this one runs before it
# whatever else this process imported first.
getattr(threading, "_register_atexit", atexit.register)(_settle_recorders)


def run(coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
    """Run a coroutine on the sandlot loop thread and wait for its result."""
    loop = _loop_thread()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        if isinstance(coro, Coroutine):
            coro.close()
        raise RuntimeError("sync sandlot API called from inside its own event loop; use the async API")
    fut = asyncio.run_coroutine_threadsafe(_as_coroutine(coro), loop)
    try:
        return fut.result()
    except KeyboardInterrupt:
        fut.cancel()
        with contextlib.suppress(concurrent.futures.CancelledError, Exception):
            fut.result(timeout=5)
        raise


async def _as_coroutine(aw: Awaitable[T]) -> T:
    return await aw


def call(fn: Callable[..., T], *args: Any) -> T:
    """Run a plain function on the loop thread (for calls that touch loop-owned state)."""

    async def wrapper() -> T:
        return fn(*args)

    return run(wrapper())


def iterate(agen: AsyncIterator[T], prefetch: int = 0) -> Iterator[T]:
    """Drive an async iterator from sync code, one item per round trip. With
    ``prefetch``, a task on the loop runs up to that many items ahead of the caller,
    which takes them from a queue without a round trip each: for iterators of
    independent records (events), never for a stream whose caller may stop and read
    the rest another way."""
    if prefetch > 0:
        yield from _prefetched(agen, prefetch)
        return
    try:
        while True:
            try:
                yield run(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        # Closing the async generator releases its channel. Skip it while the
        # interpreter shuts down: the loop thread may already be frozen.
        aclose = getattr(agen, "aclose", None)
        if aclose is not None and not sys.is_finalizing() and _loop is not None and _loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(_as_coroutine(aclose()), _loop)
            with contextlib.suppress(Exception):
                fut.result(timeout=5)


_END = object()


def _prefetched(agen: AsyncIterator[T], ahead: int) -> Iterator[T]:
    loop = _loop_thread()
    items: queue.Queue[Any] = queue.Queue()
    room = asyncio.Semaphore(ahead)  # not bound to a loop until first awaited: on the loop thread

    async def produce() -> None:
        try:
            async for item in agen:
                await room.acquire()
                items.put((item, None))
            items.put((_END, None))
        except BaseException as exc:  # handed to the caller (a cancel: the caller stopped)
            items.put((_END, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    task = asyncio.run_coroutine_threadsafe(produce(), loop)
    try:
        while True:
            item, error = items.get()
            if item is _END:
                if error is not None and not isinstance(error, asyncio.CancelledError):
                    raise error
                return
            loop.call_soon_threadsafe(room.release)
            yield item
    finally:
        if not task.done() and not sys.is_finalizing() and loop.is_running():
            task.cancel()  # the generator is closed where it waits
            with contextlib.suppress(Exception):
                task.result(timeout=5)
