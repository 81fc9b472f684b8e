"""E2B's SDK against sandlot's own remote client, in one run on the same server and
box: ``commands.run("true")`` (envd's Process/Start over the Connect protocol, then
``/bin/bash -l -c true`` as the SDK sends it) beside sandlot's remote ``exec`` of
the same command and of ``true`` alone, interleaved, so the face's own cost shows as
the difference; ``files.write``/``read`` of a small file beside the remote client's;
and ``Sandbox.create`` from a sandlot template, plain and from a warm pool.

    .venv/bin/python benchmarks/e2b_compat.py [--quick]
"""

from __future__ import annotations

import os
import time

import sandlot

import _common  # noqa: F401 - puts the repository on the path
from _common import debian_root, drop_home, emit, host_facts, parser, scratch_home, summary
from tests.support.serve import create_key, serving


def round_trips(sbx: object, far: sandlot.Box, n: int) -> dict:
    from e2b import Sandbox

    assert isinstance(sbx, Sandbox)
    bash = ("/bin/bash", "-l", "-c", "true")
    runs = {
        "sdk_commands_run": lambda: sbx.commands.run("true"),
        "remote_exec_bash": lambda: far.exec(*bash),
        "remote_exec_true": lambda: far.exec("true"),
        "sdk_files_write_read": lambda: (sbx.files.write("/tmp/b", "x"), sbx.files.read("/tmp/b")),
        "remote_files_write_read": lambda: (far.files.write("/tmp/c", b"x"), far.files.read("/tmp/c")),
    }
    for run in runs.values():  # the first of each pays for what is cached after
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(n):
        for kind, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[kind].append(time.perf_counter() - t0)
    out = {f"{k}_ms": summary(v, 1e3) for k, v in times.items()}
    sdk, remote = out["sdk_commands_run_ms"]["median"], out["remote_exec_bash_ms"]["median"]
    out["commands_run_over_remote_exec_p50_ms"] = round(sdk - remote, 2)
    files = out["sdk_files_write_read_ms"]["median"] - out["remote_files_write_read_ms"]["median"]
    out["files_over_remote_p50_ms"] = round(files, 2)
    return out


def creations(template: str, n: int, home: object = None, pooled: bool = False) -> dict:
    from e2b import Sandbox

    times = []
    for _ in range(n):
        while pooled and not all(p.ready == p.size for p in sandlot.pools(home=home)):  # type: ignore[arg-type]
            time.sleep(0.2)  # a claim each time, not a boot once the pool ran dry
        t0 = time.perf_counter()
        sbx = Sandbox.create(template)
        times.append(time.perf_counter() - t0)
        sbx.kill()
    return summary(times, 1e3)


def main() -> None:
    args = parser(__doc__).parse_args()
    q = args.quick
    home = scratch_home("bench-e2b-")
    try:
        with serving(home) as served:
            key = create_key(home, "bench", "--admin", "--e2b")
            os.environ.update({"E2B_API_URL": f"{served.url}/e2b", "E2B_SANDBOX_URL": f"{served.url}/e2b",
                               "E2B_API_KEY": key})  # fmt: skip
            from e2b import Sandbox

            tpl = sandlot.template(rootfs=str(debian_root()), name="bench", memory_mib=512, home=home)
            sbx = Sandbox.create("bench")
            doc: dict = {"benchmark": "e2b_compat", "quick": q,
                         "host": host_facts(sandlot.Box.get(sbx.sandbox_id, home=home).accel)}  # fmt: skip
            with sandlot.connect(served.url, api_key=served.api_key) as remote:
                doc.update(round_trips(sbx, remote.get(sbx.sandbox_id), 10 if q else 200))
            sbx.kill()
            doc["create_from_template_ms"] = creations("bench", 2 if q else 20)
            sandlot.set_pool(tpl, 2, wait=True, home=home)
            try:
                doc["create_from_pool_ms"] = creations("bench", 2 if q else 20, home, pooled=True)
            finally:
                sandlot.set_pool(tpl, 0, wait=True, home=home)
            doc["targets"] = {
                "commands_run_over_remote_exec_ms_at_most": 3.0,
                "create_from_template_ms_at_most": 300.0,
            }
            emit(doc)
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
