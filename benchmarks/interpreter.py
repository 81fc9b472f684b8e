#!/usr/bin/env python3
"""The code interpreter: a warm ``run_code("1+1")`` round trip, the first
``run_code`` in a new box (the interpreter copied in and started), the first
``run_code`` in a box started from a template that holds a started interpreter,
and a cell whose result is a 1 MB PNG. bash in sandlot's own kernel: its first cell
(the context and its shell started) and a warm ``echo`` cell, beside the same command
as a warm ``exec`` (a fresh shell each time, where the kernel's shell persists).

    python benchmarks/interpreter.py [--quick]
"""

from __future__ import annotations

import asyncio
import time

from sandlot import AsyncBox, template_async

from _common import debian_root, emit, host_facts, parser, summary

PNG_CELL = """
import os
class Picture:
    def _repr_png_(self):
        return b"\\x89PNG\\r\\n\\x1a\\n" + os.urandom(1 << 20)
Picture()
"""


async def main(quick: bool) -> dict[str, object]:
    root = debian_root()
    out: dict[str, object] = {"benchmark": "interpreter", "quick": quick}
    firsts = []
    for _ in range(1 if quick else 3):
        async with AsyncBox(rootfs=root, memory_mib=256) as box:
            t0 = time.perf_counter()
            await box.run_code("1+1")
            firsts.append(time.perf_counter() - t0)
            accel = box.accel
    out["first_run_code_new_box_s"] = summary(firsts, digits=3)

    async with AsyncBox(rootfs=root, memory_mib=256) as box:
        await box.run_code("1+1")
        warm = []
        for _ in range(10 if quick else 200):
            t0 = time.perf_counter()
            ex = await box.run_code("1+1")
            warm.append(time.perf_counter() - t0)
            assert ex.text == "2"
        out["run_code_warm_ms"] = summary(warm, 1000)

        pngs = []
        for _ in range(2 if quick else 10):
            t0 = time.perf_counter()
            ex = await box.run_code(PNG_CELL)
            pngs.append(time.perf_counter() - t0)
            image = ex.results[0].image()
            assert image is not None and len(image) == (1 << 20) + 8
        out["png_1MB_result_ms"] = summary(pngs, 1000)

        t0 = time.perf_counter()
        await box.run_code("cd /tmp", language="bash")
        out["first_bash_cell_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        cells, execs = [], []
        for _ in range(10 if quick else 200):
            t0 = time.perf_counter()
            ex = await box.run_code("echo 2", language="bash")
            cells.append(time.perf_counter() - t0)
            assert ex.stdout == "2\n", ex
            t0 = time.perf_counter()
            await box.exec("sh", "-c", "echo 2")
            execs.append(time.perf_counter() - t0)
        out["bash_cell_warm_ms"] = cell = summary(cells, 1000)
        out["exec_echo_warm_ms"] = exe = summary(execs, 1000)
        out["bash_cell_over_exec"] = round(cell["median"] / exe["median"], 2)

    tmpl = await template_async(rootfs=root, memory_mib=256, code=["import json, os, sys\nready = True"])
    try:
        fromtmpl = []
        for _ in range(2 if quick else 8):
            async with AsyncBox(template=tmpl) as box:
                t0 = time.perf_counter()
                ex = await box.run_code("ready")
                fromtmpl.append(time.perf_counter() - t0)
                assert ex.text == "True", ex
        out["first_run_code_from_template_ms"] = summary(fromtmpl, 1000)
    finally:
        await tmpl.remove()
    out["host"] = host_facts(accel)
    out["targets"] = {"run_code_warm_p50_ms": 15, "first_run_code_from_template_ms": 300}
    return out


if __name__ == "__main__":
    emit(asyncio.run(main(parser(__doc__).parse_args().quick)))
