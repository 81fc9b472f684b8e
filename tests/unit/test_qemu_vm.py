"""QEMU's answers that the engine waits out rather than fails on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from qemu.qmp import ExecuteError
from qemu.qmp.message import Message
from qemu.qmp.models import ErrorResponse

import sandlot
from sandlot.engine.qemu.command import VMConfig
from sandlot.engine.qemu.vm import QemuVM, once_finalized, qmp_deadline


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


class _Session:
    """A QMP session whose migration moves ``steps`` more bytes at each look, then none."""

    def __init__(self, steps: int) -> None:
        self.steps, self.moved, self.cancelled = steps, 0, False

    async def execute(self, command: str, arguments: object = None) -> object:
        if command == "migrate_cancel":
            self.cancelled = True
            return {}
        assert command == "query-migrate"
        if self.steps:
            self.steps -= 1
            self.moved += 1 << 20
        return {"status": "active", "ram": {"transferred": self.moved, "dirty-sync-count": 1}}


class _Events:
    """QEMU's MIGRATION events: none until ``completed_after`` seconds."""

    def __init__(self, completed_after: float) -> None:
        self.at = asyncio.get_running_loop().time() + completed_after

    async def get(self) -> object:
        await asyncio.sleep(max(0.0, self.at - asyncio.get_running_loop().time()))
        return {"data": {"status": "completed"}}


def test_a_migration_fails_on_a_stall_not_on_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's deadline counts the seconds in which QEMU moved nothing: one that goes
    on moving bytes past it completes (a large or emulated guest on a loaded host);
    one that stops moving fails, cancelled, after it; QEMU's exit ends either at once."""
    from sandlot.engine.qemu import vm
    from sandlot.errors import SavedStateError

    monkeypatch.setattr(vm, "PROGRESS_EVERY", 0.05)

    async def go(steps: int, completed_after: float, timeout: float, exits: bool = False) -> _Session:
        q, exited = _Session(steps), asyncio.get_running_loop().create_future()
        if exits:
            exited.set_result(9)
        await vm.migration_done(q, _Events(completed_after), exited, timeout, saving=True)  # type: ignore[arg-type]
        return q

    moving = asyncio.run(go(steps=100, completed_after=1.0, timeout=0.3))  # 1 s of moving, 0.3 s deadline
    assert not moving.cancelled and moving.moved > 0
    with pytest.raises(SavedStateError, match="moved nothing for"):
        asyncio.run(go(steps=3, completed_after=5.0, timeout=0.3))
    with pytest.raises(SavedStateError, match="QEMU exited"):
        asyncio.run(go(steps=100, completed_after=5.0, timeout=10.0, exits=True))


def test_a_monitor_that_stops_answering_is_an_engine_timeout_naming_the_command(tmp_path: Path) -> None:
    """QEMU's monitor greets and takes the capabilities, then answers nothing (a QEMU too
    busy, or stopped): the engine's QMP call ends at its deadline with a typed error that
    says which command went unanswered, never asyncio's bare TimeoutError."""
    run = tmp_path / "run"
    run.mkdir()
    vm = QemuVM(VMConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", disk=tmp_path / "d", run_dir=run,
                         state_dir=tmp_path))  # fmt: skip

    async def monitor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeting = {"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""},
                            "capabilities": []}}  # fmt: skip
        writer.write(json.dumps(greeting).encode() + b"\r\n")
        negotiation = json.loads(await reader.read(4096))  # qemu.qmp ends no message with a newline
        answer = {"return": {}} | ({"id": negotiation["id"]} if "id" in negotiation else {})
        writer.write(json.dumps(answer).encode() + b"\r\n")
        await writer.drain()
        await reader.read()  # every command after it goes unanswered

    async def main() -> None:
        server = await asyncio.start_unix_server(monitor, path=str(vm.cfg.qmp_socket))
        async with server:
            with pytest.raises(sandlot.EngineTimeout, match=r"query-status within 0\.5 s") as caught:
                await vm.qmp("query-status", timeout=0.5)
            assert isinstance(caught.value, TimeoutError) and caught.value.code == "engine_timeout"

    asyncio.run(main())


def test_the_monitors_deadline_is_longer_under_tcg_and_may_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TCG the monitor competes with the emulation for QEMU's lock: a loaded host
    answers slowly, not never. ``$SANDLOT_QMP_TIMEOUT`` sets it, and is checked."""
    monkeypatch.delenv("SANDLOT_QMP_TIMEOUT", raising=False)
    assert qmp_deadline("kvm") == 10.0 and qmp_deadline("tcg") == 30.0
    monkeypatch.setenv("SANDLOT_QMP_TIMEOUT", "45")
    assert qmp_deadline("kvm") == qmp_deadline("tcg") == 45.0
    for wrong in ("soon", "0", "-3", "1e9"):
        monkeypatch.setenv("SANDLOT_QMP_TIMEOUT", wrong)
        with pytest.raises(sandlot.InvalidArgument, match="SANDLOT_QMP_TIMEOUT"):
            qmp_deadline("tcg")
