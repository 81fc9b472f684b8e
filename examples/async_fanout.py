"""Run many commands at once in one box, and several boxes at once, with the
async API. Usage: python examples/async_fanout.py [ROOTFS]"""

import asyncio
import time

from _rootfs import rootfs

import sandlot


async def main() -> None:
    root = rootfs()
    async with sandlot.AsyncBox(rootfs=root, memory_mib=256) as box:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(box.exec("sh", "-c", f"echo job {i}; sleep 0.5") for i in range(32)))
        print(f"32 concurrent execs in {time.perf_counter() - t0:.2f}s:", results[0].stdout.strip(), "...")

    async def one(i: int) -> str:
        async with sandlot.AsyncBox(rootfs=root, memory_mib=256) as b:
            return (await b.exec("hostname")).stdout.strip()

    t0 = time.perf_counter()
    names = await asyncio.gather(*(one(i) for i in range(3)))
    print(f"3 boxes booted, used and removed in {time.perf_counter() - t0:.2f}s:", names)


asyncio.run(main())
