"""A shell script the host runs in a guest through its agent, for itself: what it
prints is bounded, whatever the guest makes it print. The flight recorder's process
listings (``core.guestprocs``) and a containers box's readying at boot
(``core.containers``) run theirs so."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..protocol.connection import AgentConnection


class Readable(Protocol):
    async def read(self) -> bytes: ...


async def at_most(stream: Readable, limit: int) -> bytes:
    """All a stream gives, or OSError once it gives more than ``limit`` bytes (what the
    host holds of what a guest prints is bounded)."""
    parts, size = [], 0
    while chunk := await stream.read():
        size += len(chunk)
        if size > limit:
            raise OSError(f"the guest's script printed more than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def shell(
    conn: AgentConnection,
    script: str,
    env: dict[str, str],
    *,
    limit: int,
    user: str | None = None,
    cwd: str | None = None,
) -> tuple[bytes, int | None]:
    """What ``sh -c script`` in the guest printed (at most ``limit`` bytes: past them the
    script is signalled and OSError raised), and its exit status; its standard error is
    read and dropped. SandlotError or OSError where it could not run."""
    from ..protocol.exec import ExecRequest, RemoteProcess

    request = ExecRequest(argv=["/bin/sh", "-c", script], env=env, user=user, cwd=cwd)
    proc = await RemoteProcess.start(conn, request)
    proc.stderr.drain()
    try:
        out = await at_most(proc.stdout, limit)
    except OSError:
        await proc.signal()
        await proc.wait()
        raise
    return out, (await proc.wait()).exit_code
