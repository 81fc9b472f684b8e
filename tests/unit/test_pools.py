"""Warm pools on the fake engine (the paths in milliseconds; ``tests/vm/test_pools.py``
runs them on real VMs, with kill -9 and several processes): fill, claim with a new
identity, exhaustion falling back to a plain restore, concurrent claims, drain,
the memory cap, and a template's removal taking its pool along."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import sandlot
from sandlot.core.pools import fits
from sandlot.core.service import core_for
from sandlot.core.spec import BoxSpec
from sandlot.core.state import BoxState

from tests.support.fake_engine import FakeEngine, register

register()


@pytest.fixture(autouse=True)
def no_background_refill(monkeypatch: pytest.MonkeyPatch) -> None:
    # the detached refiller is another process, which knows no fake engine
    monkeypatch.setenv("SANDLOT_POOL_REFILL", "0")
    monkeypatch.setenv("SANDLOT_POOL_MEMORY_MIB", "1024")


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


async def template(home: Path, root: Path, pool: int = 0) -> sandlot.AsyncSnapshot:
    return await sandlot.template_async(rootfs=root, engine="fake", home=home, memory_mib=256, name="t",
                                        pool=pool)  # fmt: skip


async def pool_rows(home: Path) -> list[Any]:
    return await core_for(sandlot.Runtime.for_home(home)).pools.rows()


def test_claim_takes_a_ready_vm_with_a_new_identity_and_falls_back_when_empty(home: Path, root: Path) -> None:
    async def main() -> None:
        t = await template(home, root)
        info = await sandlot.set_pool_async("t", 2, wait=True, home=home)
        assert (info.size, info.ready, info.filling) == (2, 2, 0)
        ready = await pool_rows(home)
        assert {r.state for r in ready} == {"pooled"} and len(ready) == 2
        assert await sandlot.AsyncBox.list(home=home) == []  # pool VMs are no boxes
        vms = FakeEngine.of(home).vms
        paused = {pid for pid, vm in vms.items() if vm.status_now == "paused"}
        assert len(paused) == 2

        a = sandlot.AsyncBox(
            template="t", name="a", env={"X": "1"}, labels={"who": "a"}, keep=True, home=home
        )
        await a.start()
        assert a.id in {r.id for r in ready} and a.state == "running"
        assert (await a.exec("hostname")).stdout == "a\n"  # its HELLO named it
        info_a = await a.inspect()
        assert info_a["labels"] == {"who": "a"} and info_a["options"]["env"] == {"X": "1"}
        assert info_a["options"]["pool"] is None and info_a["origin"] == t.id
        assert info_a["machine_id"] not in {r.machine_id for r in ready}

        async with sandlot.AsyncBox(template=t, name="b", home=home) as b:
            assert b.id in {r.id for r in ready} and b.id != a.id
            assert (await b.exec("hostname")).stdout == "b\n"
            async with sandlot.AsyncBox(template=t, name="c", home=home) as c:  # the pool is empty
                assert c.id not in {r.id for r in ready}
                assert (await c.exec("echo", "ok")).stdout == "ok\n"
        assert sorted(x.name for x in await sandlot.AsyncBox.list(home=home)) == ["a"]
        await a.remove(force=True)
        assert (await sandlot.set_pool_async(t, 2, wait=True, home=home)).ready == 2  # refilled

    run(main)


def test_concurrent_claims_never_share_a_vm(home: Path, root: Path) -> None:
    async def main() -> None:
        await template(home, root)
        await sandlot.set_pool_async("t", 3, wait=True, home=home)
        boxes = [sandlot.AsyncBox(template="t", keep=True, home=home) for _ in range(5)]
        await asyncio.gather(*(b.start() for b in boxes))
        ids = [b.id for b in boxes]
        assert len(set(ids)) == 5
        assert len(await pool_rows(home)) == 0  # three claimed, two restored afresh
        for b in boxes:
            assert (await b.exec("echo", "hi")).stdout == "hi\n"
            await b.remove(force=True)

    run(main)


def test_a_claim_reads_a_few_ready_vms_at_a_time_and_the_next_ones_when_others_took_them(
    home: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim decodes ``CLAIM_CANDIDATES`` rows at most per read, whatever the pool's size;
    when claimers of other processes took every one of them between its read and its
    compare-and-swap, it reads the next ones instead of restoring afresh."""
    from sandlot.core.boxrecord import store_path
    from sandlot.core.pools import CLAIM_CANDIDATES, Pools
    from sandlot.core.store import AsyncStore, BoxStore

    monkeypatch.setenv("SANDLOT_POOL_MEMORY_MIB", "4096")
    lost = CLAIM_CANDIDATES + 1
    other = BoxStore(store_path(home))  # another process's claimers, winning the first races
    taken: list[str] = []
    real_take = Pools._take

    async def raced(self: Pools, rec: Any, *args: Any) -> Any:
        if len(taken) < lost:
            assert other.update(rec.id, expect=("pooled",), state="claiming") is not None
            taken.append(rec.id)
        return await real_take(self, rec, *args)

    monkeypatch.setattr(Pools, "_take", raced)
    reads: list[int] = []
    real_pool, real_pooled = AsyncStore.template_pool, AsyncStore.pooled

    async def template_pool(self: AsyncStore, *args: Any, **kw: Any) -> Any:
        snap, ready = await real_pool(self, *args, **kw)
        reads.append(len(ready))
        return snap, ready

    async def pooled(self: AsyncStore, *args: Any, **kw: Any) -> Any:
        ready = await real_pooled(self, *args, **kw)
        reads.append(len(ready))
        return ready

    monkeypatch.setattr(AsyncStore, "template_pool", template_pool)
    monkeypatch.setattr(AsyncStore, "pooled", pooled)

    async def main() -> None:
        await template(home, root)
        await sandlot.set_pool_async("t", lost + 2, wait=True, home=home)
        ready = [r.id for r in await pool_rows(home)]
        launches = FakeEngine.of(home).launches
        async with sandlot.AsyncBox(template="t", home=home) as box:
            assert box.id == ready[lost]  # the oldest one nobody else took: no plain restore
            assert FakeEngine.of(home).launches == launches
            assert (await box.exec("echo", "hi")).stdout == "hi\n"
        assert taken == ready[:lost]
        assert reads == [CLAIM_CANDIDATES, lost + 2 - CLAIM_CANDIDATES]  # the whole pool: 7 rows
        for box_id in taken:
            other.update(box_id, expect=("claiming",), state="pooled")
        other.close()
        await sandlot.set_pool_async("t", 0, wait=True, home=home)

    run(main)


def test_drain_cap_and_template_removal(home: Path, root: Path) -> None:
    async def main() -> None:
        t = await template(home, root, pool=0)
        with pytest.raises(sandlot.InvalidArgument, match="over the cap of 1024 MiB"):
            await sandlot.set_pool_async(t, 5, home=home)
        with pytest.raises(sandlot.InvalidArgument, match="whole number"):
            await sandlot.set_pool_async(t, -1, home=home)
        await sandlot.set_pool_async(t, 2, wait=True, home=home)
        [p] = await sandlot.pools_async(home=home)
        assert (p.template, p.size, p.ready, p.memory_mib) == ("t", 2, 2, 256)
        assert p.to_json()["nominal_mib"] == 512
        info = await sandlot.set_pool_async(t, 0, wait=True, home=home)
        assert (info.size, info.ready) == (0, 0) and await pool_rows(home) == []
        assert not [vm for vm in FakeEngine.of(home).vms.values() if vm.running]
        await sandlot.set_pool_async(t, 1, wait=True, home=home)
        await t.remove()  # its pool goes with it
        assert await pool_rows(home) == [] and await sandlot.pools_async(home=home) == []
        assert not [vm for vm in FakeEngine.of(home).vms.values() if vm.running]

    run(main)


def test_a_claim_that_asks_for_what_a_pool_vm_cannot_become_restores_afresh(home: Path, root: Path) -> None:
    async def main() -> None:
        t = await template(home, root)
        await sandlot.set_pool_async(t, 1, wait=True, home=home)
        pooled = (await pool_rows(home))[0]
        async with sandlot.AsyncBox(template=t, disk_size_gb=16, home=home) as box:  # another disk
            assert box.id != pooled.id
        [still] = await pool_rows(home)
        assert (still.id, still.state) == (pooled.id, BoxState.POOLED)
        with pytest.raises(sandlot.InvalidArgument, match="network card"):  # refused as ever
            await sandlot.AsyncBox(template=t, network="allowlist", home=home).start()
        await sandlot.set_pool_async(t, 2, wait=True, home=home)
        async with sandlot.AsyncBox(template=t, name="taken", home=home):
            with pytest.raises(sandlot.InvalidArgument, match="already exists"):  # at the claim's swap
                await sandlot.AsyncBox(template=t, name="taken", home=home).start()
            [left] = await pool_rows(home)  # the VM it tried is still ready
            assert left.state == BoxState.POOLED

    run(main)


def test_fits_compares_what_a_restore_fixed() -> None:
    base = BoxSpec.build("busybox", memory_mib=256)
    assert fits(base, BoxSpec.build("busybox", memory_mib=256, name="x", env={"A": "1"}, user="nobody"))
    assert not fits(base, BoxSpec.build("busybox", memory_mib=512))
    assert not fits(base, BoxSpec.build("busybox", memory_mib=256, network="allowlist"))


def test_a_specs_options_are_a_plain_copy_that_shares_nothing() -> None:
    """What a row stores of a spec (written twice by every claim): every field, volumes,
    mounts and ports as lists, and nothing mutable shared with the spec."""
    spec = BoxSpec.build(
        "busybox", env={"A": "1"}, labels={"k": "v"}, volumes=["/tmp:/g:ro"], ports=["127.0.0.1:8080:80"],
        network="allowlist", allow=["pypi.org"], memory_mib=512,
    )  # fmt: skip
    spec.image_config = {"env": ["A=1"], "cmd": ["sh"], "workdir": None, "user": "", "entrypoint": []}
    spec.secrets = [{"name": "K", "placeholder": "p", "hosts": ["a.example"]}]
    options = spec.to_options()
    assert set(options) == set(BoxSpec.__dataclass_fields__)
    assert options["volumes"] == [["/tmp", "/g", True]] and options["ports"] == [["127.0.0.1", 8080, 80]]
    assert BoxSpec.from_options(options) == spec
    options["env"]["B"] = "2"
    options["secrets"][0]["hosts"].append("b.example")
    options["image_config"]["env"].append("B=2")
    options["allow"].append("example.org")
    assert spec.env == {"A": "1"} and spec.secrets[0]["hosts"] == ["a.example"]
    assert spec.image_config["env"] == ["A=1"] and spec.allow == ["pypi.org"]
