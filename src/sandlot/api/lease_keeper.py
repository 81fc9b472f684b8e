"""The client's side of leases (``core/leases.py``): a server removes a box that a
remote ``with`` block made once the client stops renewing its lease, so the client
renews the leases of the boxes it holds, every third of the shortest lease, from a
thread of its own. A long blocking call in the caller's code (or a busy event loop)
therefore never costs it a box; the death of its process, or ``aclose``, lets the
leases lapse.

The thread renews with a connection of its own (``httpx.Client``), except where the
client was given an in-process transport (tests): then it hands each renewal to the
client's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

log = logging.getLogger("sandlot.client")

RETRY_EVERY = 1.0  # seconds between tries while renewals fail (the server restarting)
Renew = Callable[[list[str]], dict[str, Any]]  # box ids -> the answer of POST /v1/leases/renew


class LeaseKeeper:
    """Renews the leases of the boxes ``hold`` was told of, until ``let_go`` or ``close``."""

    def __init__(self, renew: Renew, cleanup: Callable[[], None] | None = None) -> None:
        self._renew = renew
        self._cleanup = cleanup  # run by the thread as it ends
        self._boxes: dict[str, float] = {}  # box id -> the length of its lease
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def over_http(cls, base_url: str, headers: dict[str, str], verify: Any, timeout: float) -> LeaseKeeper:
        client = httpx.Client(base_url=base_url, headers=headers, verify=verify, timeout=timeout)

        def renew(box_ids: list[str]) -> dict[str, Any]:
            r = client.post("/leases/renew", json={"boxes": box_ids})
            r.raise_for_status()
            answer: dict[str, Any] = r.json()
            return answer

        return cls(renew, client.close)

    @classmethod
    def on_loop(cls, renew: Callable[[list[str]], Coroutine[Any, Any, dict[str, Any]]],
                loop: asyncio.AbstractEventLoop, timeout: float) -> LeaseKeeper:  # fmt: skip
        def run(box_ids: list[str]) -> dict[str, Any]:
            return asyncio.run_coroutine_threadsafe(renew(box_ids), loop).result(timeout)

        return cls(run)

    def hold(self, box_id: str, seconds: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._boxes[box_id] = seconds
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sandlot-leases", daemon=True)
                self._thread.start()
        self._wake.set()

    def let_go(self, box_id: str) -> None:
        with self._lock:
            self._boxes.pop(box_id, None)

    def close(self) -> None:
        """Stop renewing: the leases held lapse, and the server removes their boxes."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._renew_while_held()
        finally:
            if self._cleanup is not None:
                with contextlib.suppress(Exception):
                    self._cleanup()

    def _renew_while_held(self) -> None:
        due = time.monotonic()
        while True:
            with self._lock:
                if self._closed:
                    return
                boxes = dict(self._boxes)
            if not boxes:
                self._wake.wait()
                self._wake.clear()
                due = time.monotonic() + 1.0
                continue
            every = max(min(boxes.values()) / 3, 1.0)
            due = min(due, time.monotonic() + every)
            if self._wake.wait(max(due - time.monotonic(), 0)):
                self._wake.clear()  # a box more (or the end): look again, keep the time due
                continue
            due = time.monotonic() + (every if self._renew_now(list(boxes)) else RETRY_EVERY)

    def _renew_now(self, box_ids: list[str]) -> bool:
        try:
            renewed = self._renew(box_ids).get("leases") or {}
        except Exception as exc:  # the server away: try again soon, the lease has time left
            log.debug("lease renewal failed: %s", exc)
            return False
        for box_id in box_ids:
            if box_id not in renewed:
                with self._lock:  # one let go meanwhile (removed by its block) lapsed on purpose
                    held = self._boxes.pop(box_id, None) is not None
                if held:
                    log.warning("box %s: its lease lapsed on the server (it will be removed)", box_id)
        return True
