"""The port keeper's parts that need no box (``api/port_keeper.py``): the option's
checks, binding host ports, and the keeper's answers to requests it cannot take. A
real keeper with real boxes: tests/vm/test_wake.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandlot.api import port_hold, port_keeper
from sandlot.core.boxrecord import BoxRecord, store_path
from sandlot.core.spec import BoxSpec
from sandlot.errors import InvalidArgument, InvalidState

from tests.support.rows import plant


def test_wake_on_traffic_is_a_flag_and_brings_ports_in_without_a_network_card(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="wake_on_traffic must be True or False"):
        BoxSpec.build(None, rootfs=tmp_path, wake_on_traffic="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"published ports need a network card.*wake_on_traffic=True"):
        BoxSpec.build(None, rootfs=tmp_path, ports=[80])
    spec = BoxSpec.build(None, rootfs=tmp_path, ports=[80], wake_on_traffic=True)
    assert spec.wake_on_traffic and not spec.policy.has_nic
    assert BoxSpec.from_options(spec.to_options()).wake_on_traffic  # kept in the box's record


def test_a_host_port_in_use_is_named_and_an_ephemeral_one_moves() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(InvalidState, match=f"box web: cannot publish host port 127.0.0.1:{port}: "):
            port_keeper.bind_port("web", "127.0.0.1", port, ephemeral=False)
        # a port the box got for host 0 that another program took since: a new one, said in the record
        moved = port_keeper.bind_port("web", "127.0.0.1", port, ephemeral=True)
        with moved:
            assert moved.getsockname()[1] not in (0, port)


@pytest.mark.parametrize("line", [b"[1, 2]\n", b"5\n", b'{"drop": "x"}\n', b"not json\n"])
def test_the_keeper_answers_a_malformed_request_with_a_typed_error(tmp_path: Path, line: bytes) -> None:
    async def main() -> dict[str, object]:
        keeper = port_keeper.Keeper(tmp_path / "home")
        server = await asyncio.start_unix_server(keeper.answer, path=str(tmp_path / "k.sock"))
        async with server:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "k.sock"))
            writer.write(line)
            await writer.drain()
            answer: dict[str, object] = json.loads(await reader.readline())
            writer.close()
            return answer

    answer = asyncio.run(main())
    assert answer["code"] == "invalid_argument" and "malformed request" in str(answer["error"])


def test_asking_where_no_keeper_runs_without_starting_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConnectionRefusedError, match="no port keeper runs"):
        port_hold.ask(tmp_path / "nowhere", {"release": "x"}, start=False)


def test_the_keeper_reads_the_rows_only_when_the_store_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home whose boxes all sleep costs the keeper a stat of the store's two files a round,
    not a read of every row; a write, a removed store and ``READ_ANYWAY`` each bring a read."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "sandlot.db").write_bytes(b"rows")
    keeper = port_keeper.Keeper(home)
    rows, reads = ["a", "b"], []

    async def listed() -> list[SimpleNamespace]:
        reads.append(list(rows))
        return [SimpleNamespace(id=r) for r in rows]

    db = SimpleNamespace(list=listed)
    keeper.backend = SimpleNamespace(core=lambda: SimpleNamespace(controller=SimpleNamespace(db=db)))  # type: ignore[assignment]
    keeper.held = {b: port_keeper.Held([], []) for b in ("a", "b")}
    asyncio.run(keeper.look())
    asyncio.run(keeper.look())
    assert len(reads) == 1 and set(keeper.held) == {"a", "b"}
    monkeypatch.setattr(port_keeper, "READ_ANYWAY", 0.0)  # from the next read on
    rows.remove("b")  # another process removed b: its row goes in a write to the log
    (home / "sandlot.db-wal").write_bytes(b"a write")
    asyncio.run(keeper.look())
    assert len(reads) == 2 and set(keeper.held) == {"a"}
    asyncio.run(keeper.look())
    asyncio.run(keeper.look())  # the rows read again, the files alike
    assert len(reads) == 4
    for f in home.iterdir():  # the home's store gone: every row with it, and nothing to read
        f.unlink()
    asyncio.run(keeper.look())
    assert len(reads) == 4 and keeper.held == {}


def keeper_pids(home: Path) -> list[int]:
    """The keeper processes of ``home``, by their command line."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"sandlot.api.port_keeper" in argv and str(home).encode() in argv:
                found.append(int(proc.name))
    return found


def test_a_keeper_whose_home_was_made_again_at_its_path_ends_and_the_next_serves_the_new_store(
    tmp_path: Path,
) -> None:
    """Keepers are found by their home's path. A home removed and made again there while
    its keeper still ran (its idle minute) had that keeper answer every box of the new
    home with ``no box``, from the old store it still had open: no box that wakes on
    traffic could start there until it ended. It ends at once instead, answering nothing,
    and the caller's request goes to a keeper of the new store."""
    home = tmp_path / "home"

    def made_again(box_id: str) -> None:
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir()
        now = time.time()
        plant(store_path(home), BoxRecord(id=box_id, name=f"n-{box_id}", state="created", options={},
                                          created_at=now, updated_at=now))  # fmt: skip

    made_again("aaaaaaaaaaaa")
    try:
        assert port_hold.ask(home, {"hold": "aaaaaaaaaaaa"}, start=True) == {"ports": []}  # no port to hold
        [first] = keeper_pids(home)
        made_again("bbbbbbbbbbbb")  # the old keeper still runs, on the old store's file
        assert port_hold.ask(home, {"hold": "bbbbbbbbbbbb"}, start=True) == {"ports": []}
        deadline = time.monotonic() + 30
        while first in keeper_pids(home):
            assert time.monotonic() < deadline, "the old keeper did not end"
            time.sleep(0.05)
        assert len(keeper_pids(home)) == 1  # the new store's
    finally:
        for pid in keeper_pids(home):
            os.kill(pid, signal.SIGKILL)
