"""Watch service: the guest's file-system events on one path, as the agent reports them.

The agent sends event records on stream 1 of the channel under the stream's
window, so a host that stops reading stops only this channel; the agent then
keeps at most its own queue's worth and reports what it had to drop as one
overflow record (docs/protocol.md, "Watch"). It sends at most the host's rate
(``SANDLOT_WATCH_RATE``: records a second, and at once), past which what a box's
churn of files makes is dropped and said as one overflow record too: the host
works no faster than that for a watch, whatever the guest does.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
from collections import deque

from .. import records
from ..errors import SandlotError
from ..records import Rate
from . import wire
from .connection import AgentConnection, Channel, InboundStream
from .wire import Fields, RawWatchRecord, T, Tag, WatchEvent, WatchFlag


class WatchStream:
    """A live watch: its records, with paths made absolute."""

    def __init__(self, channel: Channel, base: str, mode: int, watches: int) -> None:
        self._channel = channel
        self._stream: InboundStream = channel.stream(wire.STREAM_STDOUT)
        self.base = base  # the watched directory, or a watched file's directory
        self.mode = mode  # the watched path's st_mode when the watch began
        self.watches = watches  # directories the agent watches for it
        self._partial = bytearray()
        self._ready: deque[RawWatchRecord] = deque()
        self.ended = False
        self._barriers: dict[str, asyncio.Future[None]] = {}
        self._sent = 0  # bytes of barriers sent on stream 0

    @classmethod
    async def start(
        cls, conn: AgentConnection, path: str, *, recursive: bool, rate: Rate | None = None
    ) -> WatchStream:
        """Watch ``path`` (absolute); a missing path raises the guest's FileNotFoundError.
        ``rate``: the records a second the agent may send (default ``SANDLOT_WATCH_RATE``;
        an agent older than it sends them all)."""
        rate = rate or records.bounds().watch
        payload = wire.tlv(Tag.PATH, path) + wire.tlv(Tag.FLAGS, WatchFlag.RECURSIVE if recursive else 0)
        if rate.limited:
            per_s = max(1, min(int(rate.per_s), 1 << 30))
            payload += wire.tlv(Tag.RATE, per_s) + wire.tlv(Tag.BURST, max(1, min(int(rate.burst), 1 << 30)))
        ch = conn.open_channel()
        try:
            ch.send(T.WATCH, payload)
            f = Fields((await ch.expect(T.WATCH_STARTED, timeout=conn.request_timeout)).payload)
        except BaseException:
            ch.close()
            raise
        return cls(ch, f.str(Tag.PATH, path) or path, f.u32(Tag.MODE, 0) or 0, f.u32(Tag.COUNT, 0) or 0)

    def absolute(self, rel: str) -> str:
        return posixpath.join(self.base, rel) if rel else self.base

    async def next(self) -> RawWatchRecord | None:
        """The next record, or None once the watch ended (its path went away).
        Records are acknowledged as they are taken, so the agent's queue holds what
        the caller has not read."""
        while True:
            while not self._ready:
                if self.ended:
                    self._end_barriers()
                    return None
                chunk = await self._stream.read()
                if not chunk:
                    self.ended = True
                    self.close()
                    continue
                self._partial += chunk
                self._ready.extend(wire.parse_watch_records(self._partial))
            record = self._ready.popleft()
            if record.kind != WatchEvent.BARRIER:
                return record
            waiter = self._barriers.pop(record.path, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def barrier(self, timeout: float) -> bool:
        """Wait until the records of every change the guest made before this call have
        been taken by ``next()`` (whoever iterates the stream: it must go on reading), or
        the watch ended; False where ``timeout`` seconds passed first, or it had ended."""
        if self.ended or self.closed:
            return False
        token = secrets.token_hex(8)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers[token] = waiter
        self._channel.send(T.DATA, wire.data_payload(wire.STREAM_STDIN, self._sent, token.encode()))
        self._sent += len(token)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            return False
        finally:
            self._barriers.pop(token, None)
        return True

    def _end_barriers(self) -> None:
        for waiter in self._barriers.values():
            if not waiter.done():
                waiter.set_result(None)
        self._barriers.clear()

    def close(self) -> None:
        """Stop watching: the agent frees the inotify instance."""
        with contextlib.suppress(SandlotError):  # a connection that failed has nothing to tell
            self._channel.close()

    @property
    def closed(self) -> bool:
        return self._channel.closed
