"""Webhooks: each event of the home (docs/events.md) POSTed to a URL, signed, in order,
at least once.

``sandlot serve --webhook URL`` (repeatable; the signing secret in
``$SANDLOT_WEBHOOK_SECRET`` or ``--webhook-secret-file``) delivers every event of its
home, whichever process made it, as one request each:

    POST URL
    Content-Type: application/json
    X-Sandlot-Event: <kind>
    X-Sandlot-Event-Id: <event id>
    X-Sandlot-Timestamp: <Unix seconds>
    X-Sandlot-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>" with the secret>

    <the event's JSON>

An answer of 2xx is delivery; anything else, or no answer, is tried again with a
backoff that doubles from ``FIRST_RETRY`` up to ``LAST_RETRY`` seconds, for as long as
it takes: events are never skipped and never reordered. How far each URL got is kept
in the store after each delivery, so a restarted server goes on after the last
event delivered (a crash between a delivery and that write sends that one event
again: receivers deduplicate by ``X-Sandlot-Event-Id``). One process of the home
delivers to a URL at a time; another server of the home with the same URL waits
and takes over if that process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from ..api.events import Event, claim_delivery, events_async, mark_delivered
from ..api.loop import cancel_and_reap
from ..version import __version__

log = logging.getLogger("sandlot.webhooks")

FIRST_RETRY = 0.5  # seconds before a failed delivery is tried again; doubled each time
LAST_RETRY = 60.0
CLAIM_EVERY = 5.0  # seconds between two tries to take over a URL another live process delivers to
TIMEOUT = 10.0  # seconds a receiver has to answer


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    """``X-Sandlot-Signature``'s value for a body sent at ``timestamp``."""
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def verify(secret: bytes, headers: Any, body: bytes, *, tolerance: float = 300.0) -> bool:
    """Whether a delivery is genuine and recent (for receivers written in Python):
    its signature matches and its timestamp is within ``tolerance`` seconds of now."""
    stamp = headers.get("x-sandlot-timestamp") or ""
    given = headers.get("x-sandlot-signature") or ""
    if not stamp.isdigit() or abs(time.time() - int(stamp)) > tolerance:
        return False
    return hmac.compare_digest(given, signature(secret, stamp, body))


class Webhook:
    """One URL's delivery loop."""

    def __init__(self, url: str, secret: bytes, home: str | os.PathLike[str] | None) -> None:
        self.url = url
        self.secret = secret
        self.home = home

    async def run(self) -> None:
        async with httpx.AsyncClient(
            timeout=TIMEOUT, headers={"User-Agent": f"sandlot/{__version__}"}
        ) as http:
            while True:
                try:
                    cursor = await claim_delivery(self.url, home=self.home)
                    if cursor is None:  # another live process of the home delivers to it
                        await asyncio.sleep(CLAIM_EVERY)
                        continue
                    async for ev in events_async(after=cursor, home=self.home):
                        await self._deliver(http, ev)
                        await mark_delivered(self.url, ev.id, home=self.home)
                except Exception as exc:  # the store busy, the home's disk full: go on from the cursor
                    log.warning("webhook %s: delivery stopped (%s); going on in %.0fs",
                                self.url, exc, CLAIM_EVERY)  # fmt: skip
                    await asyncio.sleep(CLAIM_EVERY)

    async def _deliver(self, http: httpx.AsyncClient, ev: Event) -> None:
        body = json.dumps(ev.to_json(), separators=(",", ":")).encode()
        wait = FIRST_RETRY
        while True:
            stamp = str(int(time.time()))
            headers = {
                "Content-Type": "application/json",
                "X-Sandlot-Event": ev.kind,
                "X-Sandlot-Event-Id": str(ev.id),
                "X-Sandlot-Timestamp": stamp,
                "X-Sandlot-Signature": signature(self.secret, stamp, body),
            }
            try:
                r = await http.post(self.url, content=body, headers=headers)
                if 200 <= r.status_code < 300:
                    return
                why = f"answered {r.status_code}"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            log.warning("webhook %s: event %d not delivered (%s); again in %.1fs", self.url, ev.id, why, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, LAST_RETRY)


@contextlib.asynccontextmanager
async def delivering(
    urls: Sequence[str], secret: bytes, home: str | os.PathLike[str] | None
) -> AsyncIterator[None]:
    """Deliver the home's events to ``urls`` while the block runs."""
    tasks = [asyncio.ensure_future(Webhook(u, secret, home).run()) for u in urls]
    try:
        yield
    finally:
        await cancel_and_reap(tasks)
