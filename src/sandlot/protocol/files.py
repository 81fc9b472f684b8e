"""Files service: streamed read and write, listing, and one-shot requests."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import TypeVar

from . import wire
from .connection import AgentConnection, OutboundStream
from .wire import Fields, FsOp, RawEntry, T, Tag, TreeEntry, WriteFlag

E = TypeVar("E")


async def read_stream(
    conn: AgentConnection, path: str, *, offset: int = 0, length: int | None = None
) -> tuple[int, int, AsyncIterator[bytes]]:
    """Open a guest file: returns (size, mode, chunks). Close the iterator to stop early."""
    payload = wire.tlv(Tag.PATH, path)
    if offset:
        payload += wire.tlv_u64(Tag.OFFSET, offset)
    if length is not None:
        payload += wire.tlv_u64(Tag.LENGTH, length)
    ch = conn.open_channel()
    try:
        ch.send(T.FILE_READ, payload)
        info = Fields((await ch.expect(T.FILE_INFO, timeout=conn.request_timeout)).payload)
    except BaseException:
        ch.close()
        raise
    stream = ch.stream(wire.STREAM_STDOUT)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            # every chunk must arrive within the request deadline: a stuck agent never hangs us
            while chunk := await stream.read(idle_timeout=conn.request_timeout):
                yield chunk
        finally:
            ch.close()

    return info.u64(Tag.SIZE, 0) or 0, info.u32(Tag.MODE, 0) or 0, chunks()


async def write_stream(
    conn: AgentConnection,
    path: str,
    data: bytes | AsyncIterable[bytes],
    *,
    mode: int | None = None,
    user: str | None = None,
    append: bool = False,
    parents: bool = True,
    exclusive: bool = False,
    sync: bool = False,
) -> int:
    """Write a guest file from bytes or an async iterable of chunks; returns its size.

    Whole-file writes are atomic: the agent writes a temporary file beside the
    target and renames it into place only once every byte has arrived.
    """
    flags = (
        (WriteFlag.APPEND if append else 0)
        | (WriteFlag.PARENTS if parents else 0)
        | (WriteFlag.EXCLUSIVE if exclusive else 0)
        | (WriteFlag.SYNC if sync else 0)
    )
    payload = wire.tlv(Tag.PATH, path) + wire.tlv(Tag.FLAGS, flags)
    if mode is not None:
        payload += wire.tlv(Tag.MODE, mode)
    if user is not None:
        payload += wire.tlv(Tag.USER, user)
    ch = conn.open_channel()
    try:
        ch.send(T.FILE_WRITE, payload)
        ready = Fields((await ch.expect(T.FILE_READY, timeout=conn.request_timeout)).payload)
        out = OutboundStream(ch, ready.u32(Tag.WINDOW, wire.WINDOW) or wire.WINDOW)
        ch.outbound = out
        if isinstance(data, bytes | bytearray | memoryview):
            await out.write(data)
        else:
            async for chunk in data:
                ch.raise_if_failed()
                if ch.has_frames:  # the agent gave up early (e.g. ENOSPC): report that now
                    break
                await out.write(chunk)
        if not ch.has_frames:
            await out.close()
        done = Fields((await ch.expect(T.FILE_DONE, timeout=conn.request_timeout)).payload)
        return done.u64(Tag.SIZE, 0) or 0
    finally:
        ch.close()  # after DONE or ERROR the agent has forgotten it; otherwise this aborts it


async def fs_request(
    conn: AgentConnection,
    op: FsOp,
    path: str,
    *,
    path2: str | None = None,
    mode: int | None = None,
    flags: int = 0,
    user: str | None = None,
    target: str | None = None,
    rdev: int | None = None,
    prefix: str | None = None,
    xattrs: Mapping[str, bytes] | None = None,
    timeout: float | None = None,
) -> list[RawEntry]:
    """One file-system request; returns the entries of STAT or LIST. ``target``: a
    SYMLINK's; ``rdev``: a MKNOD's device number (``mode`` then holds the type);
    ``prefix``: the extended attributes meant (those STAT and LIST add with
    ``FsFlag.XATTRS``, those SETXATTRS replaces with ``xattrs``); ``timeout``: seconds for
    the agent's answer (default: the connection's)."""
    payload = wire.tlv(Tag.OP, int(op)) + wire.tlv(Tag.PATH, path) + wire.tlv(Tag.FLAGS, flags)
    if prefix is not None:
        payload += wire.tlv(Tag.PREFIX, prefix)
    for name, value in (xattrs or {}).items():
        raw = name.encode("utf-8", "surrogateescape")
        payload += wire.tlv(Tag.XATTR, struct.pack("<H", len(raw)) + raw + value)
    if path2 is not None:
        payload += wire.tlv(Tag.PATH2, path2)
    if target is not None:
        payload += wire.tlv(Tag.TARGET, target)
    if rdev is not None:
        payload += wire.tlv_u64(Tag.RDEV, rdev)
    if mode is not None:
        payload += wire.tlv(Tag.MODE, mode)
    if user is not None:
        payload += wire.tlv(Tag.USER, user)
    return await _fs_results(conn, payload, Tag.ENTRY, wire.parse_entry, timeout)


async def tree(conn: AgentConnection, path: str, *, self_only: bool = False) -> list[TreeEntry]:
    """The manifest of the tree at ``path`` (a directory), on its own file system only:
    every path under it, relative to it, the root itself as ``""``. ``self_only``: the
    path's own entry alone, whatever it is."""
    flags = wire.FsFlag.SELF if self_only else 0
    payload = wire.tlv(Tag.OP, int(FsOp.TREE)) + wire.tlv(Tag.PATH, path) + wire.tlv(Tag.FLAGS, flags)
    return await _fs_results(conn, payload, Tag.TREE_ENTRY, wire.parse_tree_entry)


async def _fs_results(
    conn: AgentConnection, payload: bytes, tag: Tag, parse: Callable[[bytes], E], timeout: float | None = None
) -> list[E]:
    """Send one FS request; its ``tag`` entries, parsed, from every FS_RESULT frame up to
    the one without MORE (a listing's and a tree's come in batches)."""
    ch = conn.open_channel()
    entries: list[E] = []
    try:
        ch.send(T.FS, payload)
        while True:
            frame = await ch.expect(T.FS_RESULT, timeout=timeout or conn.request_timeout)
            entries.extend(parse(e) for e in Fields(frame.payload).all(tag))
            if not frame.flags & wire.FLAG_MORE:
                return entries
    finally:
        ch.close()
