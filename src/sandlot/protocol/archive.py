"""Archives service: a guest tree as a tar stream, and a tar stream unpacked into a
guest tree, by the agent's ARCHIVE (docs/protocol.md, "Archives"). The agent does the
work in a child process that the host follows as it follows a command: the tar on its
stdout (READ) or stdin (WRITE), its records on the other stream."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import struct
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from ..errors import ProtocolError, SandlotError, TransferError, guest_os_error
from . import wire
from .connection import AgentConnection, newer_agent_needed
from .exec import ExecRequest, RemoteProcess
from .wire import ArchiveFlag, ArchiveOp, ArchiveRecord, Fields, T, Tag

_RECORD_LEN = struct.Struct("<I")
_AS_EXEC = ExecRequest(argv=("archive",))  # what the process is followed as; its payload is the ARCHIVE's


@dataclass
class ArchiveReport:
    """What a copy moved: its entries, the bytes of its files, and what it left out (the
    entry and why)."""

    entries: int = 0
    bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "skipped": [{"entry": e, "reason": r} for e, r in self.skipped],
        }


def entry_text(raw: bytes | None) -> str:
    """A name from the guest as text: bytes that are not UTF-8 escaped, never lost."""
    return (raw or b"").decode("utf-8", "backslashreplace")


def parse_records(data: bytes) -> list[Fields]:
    out: list[Fields] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < _RECORD_LEN.size:
            raise ProtocolError("an archive's report ends inside a record")
        (n,) = _RECORD_LEN.unpack_from(data, pos)
        pos += _RECORD_LEN.size
        if n > len(data) - pos:
            raise ProtocolError("an archive's report ends inside a record")
        out.append(Fields(data[pos : pos + n]))
        pos += n
    return out


def report_of(records: list[Fields], exit_code: int) -> ArchiveReport:
    """The report of a child that ended with ``exit_code``, or the error it ended with."""
    report = ArchiveReport()
    written: list[str] = []
    for r in records:
        kind = r.u32(Tag.OP, 0)
        if kind == ArchiveRecord.SKIPPED:
            report.skipped.append((entry_text(r.raw(Tag.PATH)), r.str(Tag.MESSAGE, "") or ""))
        elif kind == ArchiveRecord.WRITTEN:
            written.append(entry_text(r.raw(Tag.PATH)))
        elif kind == ArchiveRecord.FAILED:
            raise failure_of(r, written)
        elif kind == ArchiveRecord.DONE:
            report.entries = r.u32(Tag.COUNT, 0) or 0
            report.bytes = r.u64(Tag.SIZE, 0) or 0
            if exit_code == 0:
                return report
    raise TransferError.at(
        "", f"the box's archive process ended with status {exit_code} and said nothing", side="box"
    )


def failure_of(r: Fields, written: list[str] | None = None) -> SandlotError:
    """A FAILED record as the error it stands for: the tree's own path (a record without
    ``PATH``) as the guest's OS error (a path that is not there is a FileNotFoundError),
    anything else as a TransferError naming the entry (``""``: the stream as a whole)."""
    raw = r.raw(Tag.PATH)
    number = r.u32(Tag.ERRNO, errno.EIO) or errno.EIO
    message = r.str(Tag.MESSAGE, "") or ""
    if raw is None and not written:
        return guest_os_error(number, message)
    return TransferError.at(entry_text(raw), message, side="box", errno=number, written=written or None)


def _request(op: ArchiveOp, path: str, flags: int = 0, user: str | None = None) -> bytes:
    payload = wire.tlv(Tag.OP, int(op)) + wire.tlv(Tag.PATH, path) + wire.tlv(Tag.FLAGS, flags)
    if user:
        payload += wire.tlv(Tag.USER, user)
    return payload


async def read_tree(conn: AgentConnection, path: str, *, follow: bool = False) -> AsyncIterator[bytes]:
    """The tree under the guest directory ``path`` as a tar stream (names relative to it),
    made as it is read; links are carried as links unless ``follow``. A failure raises
    after the chunks sent so far, which end with a note naming the entry (a reader of the
    stream alone refuses it too); a missing ``path`` raises before any chunk."""
    payload = _request(ArchiveOp.READ, path, ArchiveFlag.FOLLOW if follow else 0)
    with newer_agent_needed("copy a tree", "upload or download directories"):
        proc = await RemoteProcess.start(conn, _AS_EXEC, kind=T.ARCHIVE, payload=payload)
    finished = False
    try:
        proc.stderr.drain()
        while chunk := await proc.stdout.read(idle_timeout=conn.request_timeout):
            yield chunk
        status = await proc.wait()
        finished = True
        report_of(parse_records(await proc.stderr.read_all()), status.exit_code)
    finally:
        if not finished:
            proc.detach()  # the agent ends the child: its tree is read for nobody


async def write_tree(
    conn: AgentConnection, path: str, chunks: AsyncIterable[bytes], *, user: str | None = None
) -> ArchiveReport:
    """The tar stream ``chunks`` unpacked into the guest directory ``path`` (made if
    needed, merged into if there), owned by ``user`` if given: whole, or the destination
    as it was (see ``TransferError.written``)."""
    with newer_agent_needed("copy a tree", "upload or download directories"):
        proc = await RemoteProcess.start(
            conn, _AS_EXEC, kind=T.ARCHIVE, payload=_request(ArchiveOp.WRITE, path, user=user)
        )
    ended = asyncio.ensure_future(proc.wait())
    finished = False
    try:
        try:
            async for chunk in chunks:
                if ended.done():
                    break  # it stopped early: its records say why
                await proc.write_stdin(chunk)
        except Exception:
            # the stream failed on its way (its source refused an entry): the child sees
            # it end early, clears what it unpacked, and ends; the destination is as it
            # was once this raises
            with contextlib.suppress(Exception):
                await proc.close_stdin()
                await asyncio.wait_for(asyncio.shield(ended), conn.request_timeout)
            raise
        if not ended.done():
            await proc.close_stdin()
        status = await ended
        finished = True
        return report_of(parse_records(await proc.stdout.read_all()), status.exit_code)
    finally:
        if not finished:
            proc.detach()  # its stdin closes: the child sees the archive end early and clears up
            ended.cancel()
            ended.add_done_callback(lambda t: t.cancelled() or t.exception())
