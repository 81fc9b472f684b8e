"""``sandlot serve`` against the library, in one run on the same boxes: exec ``true``
round trips (p50, p99: the library, the remote client, a REST request each), a GET
of a page in the box by its port route and by a preview URL, file upload and
download (MB/s), and exec requests per second from many concurrent clients, with
the server's RSS before and after.

    .venv/bin/python benchmarks/server.py [--quick]
"""

from __future__ import annotations

import os
import time

import httpx

import sandlot

import _common  # noqa: F401 - puts the repository on the path
from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary
from tests.support.serve import load, open_fds, rss_mib, serving


def exec_round_trips(box: sandlot.Box, client: httpx.Client, remote: sandlot.Client, n: int) -> dict:
    """``exec("true")`` three ways, interleaved so all see the same conditions: the
    library, the remote client (its exec channel, one WebSocket), and a plain REST
    request per exec."""
    far = remote.get(box.id)
    box.exec("true")
    far.exec("true")
    client.post(f"/v1/boxes/{box.id}/exec", json={"argv": ["true"]}).raise_for_status()
    times: dict[str, list[float]] = {"local": [], "remote": [], "rest": []}
    rest = f"/v1/boxes/{box.id}/exec"
    for _ in range(n):
        for kind, run in (("local", lambda: box.exec("true")), ("remote", lambda: far.exec("true")),
                          ("rest", lambda: client.post(rest, json={"argv": ["true"]}))):  # fmt: skip
            t0 = time.perf_counter()
            run()
            times[kind].append(time.perf_counter() - t0)
    lo, re, rest = (summary(times[k], 1e3) for k in ("local", "remote", "rest"))
    return {"exec_true_local_ms": lo, "exec_true_remote_ms": re, "exec_true_rest_ms": rest,
            "remote_overhead_p50_ms": round(re["median"] - lo["median"], 2),
            "rest_overhead_p50_ms": round(rest["median"] - lo["median"], 2)}  # fmt: skip


def port_round_trips(box: sandlot.Box, client: httpx.Client, n: int) -> dict:
    """GET of a small page of a web server in the box, through the server: by the port
    route with a key, and by a preview URL (no key: its signature, and its row of the
    store, checked on each request), interleaved; a new connection each, as browsers
    opening a shared link do."""
    client.put(f"/v1/boxes/{box.id}/files/content", params={"path": "/www/index.html"}, content=b"hi\n")
    box.exec("sh", "-c", "httpd -p 127.0.0.1:8080 -h /www").check()
    content = client.get("/v1/info").json()["content_url"]  # port routes: never on the API's origin
    route = f"{content}/v1/boxes/{box.id}/ports/8080/index.html"
    preview = client.post(f"/v1/boxes/{box.id}/previews", json={"port": 8080, "ttl": 600}).json()["url"]
    keyed = dict(client.headers)
    times: dict[str, list[float]] = {"key": [], "preview": []}
    for url, headers in ((route, keyed), (preview + "index.html", {})):  # the first answers start both
        deadline = time.monotonic() + 30
        while httpx.get(url, headers=headers).status_code != 200:
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.1)
    for _ in range(n):
        for kind, url, headers in (("key", route, keyed), ("preview", preview + "index.html", {})):
            t0 = time.perf_counter()
            r = httpx.get(url, headers=headers)
            times[kind].append(time.perf_counter() - t0)
            assert r.text == "hi\n", r.text
    key, pv = summary(times["key"], 1e3), summary(times["preview"], 1e3)
    return {"port_get_key_ms": key, "port_get_preview_ms": pv,
            "preview_overhead_p50_ms": round(pv["median"] - key["median"], 2)}  # fmt: skip


def file_transfer(box: sandlot.Box, client: httpx.Client, size: int, reps: int) -> dict:
    """Up and down, local and remote, to the box's disk (/tmp is in its memory, where a
    file and its atomic replacement at once would not fit)."""
    blob = os.urandom(size)
    out: dict[str, list[float]] = {k: [] for k in ("local_up", "local_down", "remote_up", "remote_down")}
    for _ in range(reps):
        t0 = time.perf_counter()
        box.files.write("/var/bench.bin", blob)
        out["local_up"].append(size / (time.perf_counter() - t0) / 1e6)
        t0 = time.perf_counter()
        assert len(box.files.read("/var/bench.bin")) == size
        out["local_down"].append(size / (time.perf_counter() - t0) / 1e6)

        def chunks() -> object:
            for i in range(0, size, 1 << 20):
                yield blob[i : i + (1 << 20)]

        t0 = time.perf_counter()
        client.put(f"/v1/boxes/{box.id}/files/content", params={"path": "/var/bench.bin"},
                   content=chunks()).raise_for_status()  # fmt: skip
        out["remote_up"].append(size / (time.perf_counter() - t0) / 1e6)
        t0 = time.perf_counter()
        got = 0
        with client.stream(
            "GET", f"/v1/boxes/{box.id}/files/content", params={"path": "/var/bench.bin"}
        ) as r:
            for chunk in r.iter_bytes():
                got += len(chunk)
        assert got == size
        out["remote_down"].append(size / (time.perf_counter() - t0) / 1e6)
    med = {k: summary(v, 1, 1)["median"] for k, v in out.items()}
    return {
        "file_MiB": size >> 20,
        "upload_MBps": {
            "local": med["local_up"],
            "remote": med["remote_up"],
            "ratio": round(med["remote_up"] / med["local_up"], 2),
        },
        "download_MBps": {
            "local": med["local_down"],
            "remote": med["remote_down"],
            "ratio": round(med["remote_down"] / med["local_down"], 2),
        },
    }


def main() -> None:
    args = parser(__doc__).parse_args()
    q = args.quick
    home = scratch_home("bench-server-", kept=True)
    root = busybox_root()
    try:
        with serving(home) as served, httpx.Client(base_url=served.url, headers=served.headers(),
                                                   timeout=120) as client:  # fmt: skip
            boxes = [sandlot.Box(rootfs=root, memory_mib=256, home=home, keep=True).start()
                     for _ in range(2 if q else 10)]  # fmt: skip
            doc: dict = {"benchmark": "server", "quick": q, "host": host_facts(boxes[0].accel)}
            with sandlot.connect(served.url, api_key=served.api_key) as remote:
                doc.update(exec_round_trips(boxes[0], client, remote, 20 if q else 300))
            doc.update(port_round_trips(boxes[0], client, 20 if q else 300))
            doc.update(file_transfer(boxes[0], client, (8 if q else 64) << 20, 1 if q else 3))
            pid = served.process.pid
            rss0 = rss_mib(pid)
            doc["load"] = load(
                served.url, served.api_key, [b.id for b in boxes], 5 if q else 50, 3 if q else 60
            )
            doc["load"]["server_rss_MiB"] = {"before": rss0, "after": rss_mib(pid)}
            doc["load"]["server_fds"] = open_fds(pid)
            emit(doc)
    finally:
        drop_home(home)


if __name__ == "__main__":
    main()
