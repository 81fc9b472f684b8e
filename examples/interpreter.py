"""A stateful Python interpreter in a box: values, streaming output, errors,
contexts, and variables that come back with a rollback and diverge in a fork.

Usage: python examples/interpreter.py [ROOTFS with python3]
"""

from _rootfs import python_rootfs

import sandlot

with sandlot.Box(rootfs=python_rootfs(), memory_mib=256) as box:
    ex = box.run_code("import sys\nx = 41\nprint('python', sys.version.split()[0])\nx + 1")
    print("stdout:", ex.stdout.strip(), "| value:", ex.text, "| cell", ex.execution_count)

    # output streams to the callbacks while the cell runs
    box.run_code(
        "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.2)",
        on_stdout=lambda text: print("  streamed:", text.strip()),
    )

    ex = box.run_code("def f():\n    return undefined_name\nf()")
    assert ex.error is not None
    print("error:", ex.error.name, "-", ex.error.value)

    # rich values: anything with _repr_html_ (a DataFrame, say) comes with its HTML
    ex = box.run_code("class Table:\n    def _repr_html_(self):\n        return '<table></table>'\nTable()")
    print("formats of the value:", ex.results[0].formats())

    try:
        box.run_code("import time\ntime.sleep(60)", timeout=1)
    except sandlot.CodeTimeout as e:
        print("timed out, interrupted; state kept:", not e.state_lost)

    snap = box.snapshot()
    box.run_code("x = 0")
    box.rollback(snap)
    print("after rollback x =", box.run_code("x").text)

    kids = box.fork(2)
    for i, kid in enumerate(kids):
        kid.run_code(f"x = {i * 10}")
    print("children:", [kid.run_code("x").text for kid in kids], "parent:", box.run_code("x").text)
    for kid in kids:
        kid.remove(force=True)

    other = box.create_code_context(cwd="/tmp")
    print("second context cwd:", box.run_code("import os\nos.getcwd()", context=other).text)
    print("contexts:", [c.id for c in box.list_code_contexts()])
for s in sandlot.list_snapshots():
    if s.id == snap.id:
        s.remove()
