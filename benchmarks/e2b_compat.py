"""E2B's SDK against sandlot's own remote client, in one run on the same server and
box: ``commands.run("true")`` (envd's Process/Start over the Connect protocol, then
``/bin/bash -l -c true`` as the SDK sends it) beside sandlot's remote ``exec`` of the
same command; Start of ``/bin/true`` by a plain Connect client beside the remote
``exec`` of it; ``files.write``/``read`` of a small file beside the remote client's;
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


def round_trips(sbx: object, far: sandlot.Box, served_url: str, n: int) -> dict:
    """Each kind once an iteration, in a new random order each time (under TCG a command
    runs faster or slower after another, by what it left translated), and the face's
    cost as the median of the paired differences."""
    import random
    import statistics
    import struct

    import httpx
    from e2b import Sandbox

    from sandlot.server.e2b import messages, protobuf

    assert isinstance(sbx, Sandbox)
    bash = ("/bin/bash", "-l", "-c", "true")
    # envd's Start of /bin/true by a plain Connect client: the face's cost without bash's
    # quarter second of TCG noise on top
    start = protobuf.encode(messages.StartRequest, {"process": {"cmd": "/bin/true"}, "stdin": False})
    token = far_token(served_url, sbx.sandbox_id)
    envd = httpx.Client(base_url=f"{served_url}/e2b", headers={
        "E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token,
        "Content-Type": "application/connect+proto"})  # fmt: skip
    body = struct.pack(">BI", 0, len(start)) + start
    runs = {
        "sdk_commands_run": lambda: sbx.commands.run("true"),
        "remote_exec_bash": lambda: far.exec(*bash),
        "connect_start_true": lambda: envd.post("/process.Process/Start", content=body).raise_for_status(),
        "remote_exec_true": lambda: far.exec("/bin/true"),
        "sdk_files_write_read": lambda: (sbx.files.write("/tmp/b", "x"), sbx.files.read("/tmp/b")),
        "remote_files_write_read": lambda: (far.files.write("/tmp/c", b"x"), far.files.read("/tmp/c")),
    }
    for run in runs.values():  # the first of each pays for what is cached after
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    shuffle = random.Random(7).shuffle
    for _ in range(n):
        shuffle(order)
        for kind in order:
            t0 = time.perf_counter()
            runs[kind]()
            times[kind].append(time.perf_counter() - t0)
    out: dict = {f"{k}_ms": summary(v, 1e3) for k, v in times.items()}

    def paired(a: str, b: str) -> float:
        return round(statistics.median(x - y for x, y in zip(times[a], times[b], strict=True)) * 1e3, 2)

    out["commands_run_over_remote_exec_p50_ms"] = paired("sdk_commands_run", "remote_exec_bash")
    out["connect_start_over_remote_exec_p50_ms"] = paired("connect_start_true", "remote_exec_true")
    out["files_over_remote_p50_ms"] = paired("sdk_files_write_read", "remote_files_write_read")
    return out


def far_token(served_url: str, sandbox_id: str) -> str:
    """The sandbox's envd access token, as the control API gives it to any client."""
    import httpx

    key = {"X-API-Key": os.environ["E2B_API_KEY"]}
    r = httpx.get(f"{served_url}/e2b/sandboxes/{sandbox_id}", headers=key)
    r.raise_for_status()
    token: str = r.json()["envdAccessToken"]
    return token


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
    home = scratch_home("bench-e2b-", kept=True)
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
                doc.update(round_trips(sbx, remote.get(sbx.sandbox_id), served.url, 10 if q else 200))
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
