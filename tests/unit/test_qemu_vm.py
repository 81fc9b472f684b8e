"""QEMU's answers that the engine waits out rather than fails on."""

from __future__ import annotations

import asyncio

import pytest
from qemu.qmp import ExecuteError
from qemu.qmp.message import Message
from qemu.qmp.models import ErrorResponse

from sandlot.engine.qemu.vm import once_finalized


def _refusal(desc: str) -> ExecuteError:
    reply = Message({"error": {"class": "GenericError", "desc": desc}})
    return ExecuteError(ErrorResponse(reply), Message({"execute": "cont"}), reply)


def test_a_command_refused_until_the_last_migration_is_finalized_is_sent_again() -> None:
    """QEMU finalizes a migration a moment after its event (seconds on a busy host), and
    refuses cont and a new migration until then: they are sent again; any other refusal,
    and one past the limit, is the caller's."""

    async def go(refusals: list[str], within: float) -> tuple[object, int]:
        calls = 0

        async def action() -> str:
            nonlocal calls
            calls += 1
            if refusals:
                raise _refusal(refusals.pop(0))
            return "ran"

        return await once_finalized(action, within), calls

    assert asyncio.run(go(["Migration is not finalized yet"] * 3, 5.0)) == ("ran", 4)
    with pytest.raises(ExecuteError, match="has not been activated"):
        asyncio.run(go(["Block node has not been activated"], 5.0))
    with pytest.raises(ExecuteError, match="not finalized"):
        asyncio.run(go(["Migration is not finalized yet"] * 1000, 0.2))
