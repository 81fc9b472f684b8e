"""sandlot as a sandbox client of the OpenAI Agents SDK, on the fake engine: a
``SandboxAgent`` driven through ``Runner.run`` by a scripted model (no network, no API
key) uses the shell, the filesystem and apply_patch in a box whose workspace a manifest
made; its session ends suspended, and its state, round-tripped through JSON, resumes the
same box with what lived in its memory; persisting the session saves the box's live state,
from which a session resumes after its box was removed; bad input is refused, named."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from agents import RunConfig, Runner
from agents.run_config import SandboxRunConfig
from agents.sandbox import Manifest, SandboxAgent
from agents.sandbox.capabilities import Filesystem, Shell
from agents.sandbox.entries import Dir, File, LocalDir, LocalFile
from agents.sandbox.errors import ExposedPortUnavailableError
from agents.sandbox.snapshot import LocalSnapshotSpec

import sandlot
from sandlot.errors import BoxNotFound, InvalidArgument
from sandlot.integrations.openai_agents import (
    SandlotSandboxClient,
    SandlotSandboxClientOptions,
    SandlotSandboxSessionState,
)

from tests.support.fake_engine import fake_rootfs, register
from tests.support.scripted_model import ScriptedModel, call, patch, say

IMAGE = "agents:1"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    register()
    monkeypatch.setenv("SANDLOT_ENGINE", "fake")
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    home = tmp_path / "home"
    sandlot.import_image(fake_rootfs(tmp_path), IMAGE, home=home)
    return home


def manifest(tmp_path: Path) -> Manifest:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (tmp_path / "notes.txt").write_text("from the host\n")
    return Manifest(
        root="/workspace",
        entries={
            "README.md": File(content=b"# project\n"),
            "out": Dir(),
            # local sources are read below the working directory (the SDK's base), as relative paths
            "notes.txt": LocalFile(src=Path("notes.txt")),
            "src": LocalDir(src=Path("src")),
        },
    )


def agent(model: ScriptedModel, tmp_path: Path) -> SandboxAgent[Any]:
    return SandboxAgent(
        name="dev", instructions="work in the box", model=model,
        default_manifest=manifest(tmp_path), capabilities=[Shell(), Filesystem()],
    )  # fmt: skip


def test_a_run_uses_shell_files_and_patches_then_suspends_and_resumes(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    options = SandlotSandboxClientOptions(image=IMAGE, exposed_ports=(8000,), on_exit="suspend")
    echo, remember = call("exec_command", cmd="echo hello"), call("exec_command", cmd="remember server up")
    add = patch("*** Begin Patch\n*** Add File: out/answer.txt\n+42\n*** End Patch\n")
    model = ScriptedModel([[echo], [remember, add], [say("all done")]])

    async def first() -> tuple[Any, dict[str, object]]:
        client = SandlotSandboxClient(home=home)
        config = RunConfig(sandbox=SandboxRunConfig(client=client, options=options), tracing_disabled=True)
        result = await Runner.run(agent(model, tmp_path), "go", run_config=config)
        return result, result.to_state().to_json()

    result, saved = asyncio.run(first())
    assert result.final_output == "all done"
    assert {"exec_command", "write_stdin", "apply_patch"} <= set(model.tools)
    out = model.outputs()
    assert "Process exited with code 0\nOutput:\nhello" in out[echo.call_id]
    assert "out/answer.txt" in out[add.call_id]

    payload = saved["sandbox"]["session_state"]  # type: ignore[index]
    assert payload["type"] == "sandlot" and payload["exposed_ports"] == [8000]
    [box] = sandlot.list(home=home)
    assert box.id == payload["box_id"] and box.state == "suspended"  # memory and processes kept
    assert box.files.read_text("/workspace/README.md") == "# project\n"
    assert box.files.read_text("/workspace/notes.txt") == "from the host\n"
    assert box.files.read_text("/workspace/src/pkg/mod.py") == "X = 1\n"
    assert box.files.read_text("/workspace/out/answer.txt") == "42"
    ports = box.inspect()["network"]["ports"]
    assert [p["guest"] for p in ports] == [8000]

    async def resumed() -> None:
        # a new client, the state from JSON: as another process would have it
        client = SandlotSandboxClient(home=home)
        state = client.deserialize_session_state(json.loads(json.dumps(payload)))
        assert isinstance(state, SandlotSandboxSessionState)
        session = await client.resume(state)
        async with session:
            assert await session.running()
            found = await session.exec("recall", "server", shell=False)
            assert found.stdout == b"up\n"  # what lived in the box's memory before the pause
            read = await session.read(Path("out/answer.txt"))
            assert read.read() == b"42"
            with pytest.raises(ExposedPortUnavailableError) as caught:
                await session.resolve_exposed_port(9999)
            assert caught.value.context["reason"] == "not_configured"
        await client.delete(session)

    asyncio.run(resumed())
    assert sandlot.get(payload["box_id"], home=home).state == "suspended"
    sandlot.get(payload["box_id"], home=home).remove(force=True)


def test_a_persisted_session_comes_back_from_its_live_state_when_its_box_is_gone(
    home: Path, tmp_path: Path
) -> None:
    options = SandlotSandboxClientOptions(image=IMAGE, on_exit="remove")
    spec = LocalSnapshotSpec(base_path=tmp_path / "snaps")

    async def main() -> None:
        client = SandlotSandboxClient(home=home)
        session = await client.create(manifest=Manifest(entries={"a.txt": File(content=b"A")}),
                                      options=options, snapshot=spec)  # fmt: skip
        async with session:
            await session.exec("remember", "job", "running", shell=False)
            first_box = session.state.box_id
        with pytest.raises(BoxNotFound):
            await client.client.get(first_box)
        state = session.state
        assert isinstance(state, SandlotSandboxSessionState) and state.live_snapshot_id
        persisted = next((tmp_path / "snaps").iterdir()).read_bytes()
        assert persisted.startswith(b"sandlot-live-state/1\n")  # a reference, not a tar of the files

        again = await client.resume(client.deserialize_session_state(client.serialize_session_state(state)))
        async with again:
            assert again.state.box_id != first_box
            assert (await again.exec("recall", "job", shell=False)).stdout == b"running\n"
            assert (await again.read(Path("a.txt"))).read() == b"A"
            [child] = await client.fork(again)
            async with child:
                assert (await child.exec("recall", "job", shell=False)).stdout == b"running\n"
        assert sandlot.list(home=home) == []

    asyncio.run(main())


def test_bad_input_is_refused_naming_the_problem(home: Path) -> None:
    def refused(f: Any) -> str:
        with pytest.raises(InvalidArgument) as caught:
            f()
        return str(caught.value)

    assert "exposed_ports: 70000" in refused(lambda: SandlotSandboxClientOptions(exposed_ports=(70000,)))
    assert "given twice" in refused(lambda: SandlotSandboxClientOptions(exposed_ports=(80, 80)))
    assert "image or template" in refused(lambda: SandlotSandboxClientOptions(image="a", template="b"))
    assert "on_exit" in refused(lambda: SandlotSandboxClientOptions(on_exit="explode"))
    assert "memory_mib" in refused(lambda: SandlotSandboxClientOptions(memory_mib="lots"))
    assert "not a server's URL" in refused(lambda: SandlotSandboxClient("ftp://x"))
    assert "home names this host's boxes" in refused(lambda: SandlotSandboxClient("http://x", home=home))
    assert "not int" in refused(lambda: SandlotSandboxClient(42))
    assert "sandlot.Secret" in refused(lambda: SandlotSandboxClient(secrets=["k"]))  # type: ignore[list-item]

    client = SandlotSandboxClient(home=home)
    assert "SandlotSandboxClientOptions" in refused(
        lambda: asyncio.run(client.create(options={"image": "x"}))
    )  # type: ignore[arg-type]
    assert "positive number of forks" in refused(lambda: asyncio.run(client.fork(None, 0)))  # type: ignore[arg-type]
    e = refused(
        lambda: asyncio.run(client.create(options=SandlotSandboxClientOptions(image=IMAGE, memory_mib=1)))
    )
    assert "memory_mib" in e  # the box's own checks, before anything is made
    assert sandlot.list(home=home) == []
