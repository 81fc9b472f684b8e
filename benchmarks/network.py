"""Network benchmarks: the same HTTP client and server, placed four ways.

* host -> host: the client on the host, the server on the host's 127.0.0.1 (baseline);
* box -> host through the egress proxy (``network="allowlist"`` listing the server),
  three ways: over the VM's egress port to the home's egress server (no process
  started per connection); through QEMU's user network, which forks for each
  connection a relay that hands it to that server (``SANDLOT_EGRESS_MUX=0``, as before
  the port); and with a Python helper started per connection
  (``SANDLOT_EGRESS_RELAY=0``, as before the server); each with its latency over the
  direct path's;
* box -> host through QEMU's user networking directly (``network="open"``, 10.0.2.2):
  the same guest client without the proxy, to separate the proxy's cost from emulation's;
* host -> box through a published port (``ports=[...]``), the server in the box;
* box -> box (``allow=["box:NAME:8000"]``), the server in the box of the published
  port: straight to the address sandlot's DNS gives NAME.box.internal, and through
  the egress proxy; both go through the home's box link and the server box's agent
  (the first connection also starts the link);
* box -> host over HTTPS through the proxy twice from one box: a tunnel (end-to-end
  TLS) and a host the box's secret is for (decrypted, the placeholder swapped in).

Each: request latency on a new connection per request (median, p99), the same request
read to the connection's end (the close path too: a client without a length, or any
tunnel whose server closes, waits for it), and the throughput of one large download;
ratios against host -> host.

    .venv/bin/python benchmarks/network.py [--runs 20] [--mib 32] [--quick]
"""

from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import sandlot

from _common import CACHE, debian_root, emit, host_facts, parser, summary
from tests.support.tls import make_ca, make_leaf

CLIENT = r"""
import json, socket, sys, time, urllib.parse, urllib.request
url, runs, big = sys.argv[1], int(sys.argv[2]), sys.argv[3]
proxy = sys.argv[4] if len(sys.argv) > 4 else None
handlers = [urllib.request.ProxyHandler({"http": proxy} if proxy else {})]
opener = urllib.request.build_opener(*handlers)
lat = []
for _ in range(runs):
    t = time.perf_counter()
    opener.open(url + "/small", timeout=60).read()
    lat.append(time.perf_counter() - t)
# the same request read to the connection's end, as a client without a length must (and
# as any tunnelled protocol whose server closes): the close path is timed too
u = urllib.parse.urlsplit(url)
via = urllib.parse.urlsplit(proxy) if proxy else u
path = url + "/small" if proxy else "/small"
to_end = []
for _ in range(runs):
    t = time.perf_counter()
    with socket.create_connection((via.hostname, via.port), timeout=60) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {u.netloc}\r\nConnection: close\r\n\r\n".encode())
        while s.recv(65536):
            pass
    to_end.append(time.perf_counter() - t)
t = time.perf_counter()
n = len(opener.open(url + "/big", timeout=300).read())
print(json.dumps({"latency": lat, "to_end": to_end, "bytes": n, "seconds": time.perf_counter() - t}))
"""


TLS_CLIENT = r"""
import json, os, ssl, sys, time, urllib.request
url, runs, cafile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ctx = ssl.create_default_context(cafile=cafile if cafile != "-" else None)
opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx))
auth = {"Authorization": "Bearer " + os.environ["API_KEY"]}
lat = []
for _ in range(runs):
    t = time.perf_counter()
    opener.open(urllib.request.Request(url + "/small", headers=auth), timeout=60).read()
    lat.append(time.perf_counter() - t)
t = time.perf_counter()
n = len(opener.open(urllib.request.Request(url + "/big", headers=auth), timeout=300).read())
print(json.dumps({"latency": lat, "bytes": n, "seconds": time.perf_counter() - t}))
"""


def serve(big: bytes, tls: ssl.SSLContext | None = None) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = big if self.path == "/big" else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "latency_ms": summary(raw["latency"], 1000, 2),
        **({"to_connection_end_ms": summary(raw["to_end"], 1000, 2)} if "to_end" in raw else {}),
        "throughput_mb_s": round(raw["bytes"] / raw["seconds"] / 1e6, 1),
    }


def host_client(url: str, runs: int) -> dict[str, Any]:
    """The box's client program, run on the host."""
    r = subprocess.run([sys.executable, "-c", CLIENT, url, str(runs), "big"], capture_output=True, text=True,
                       timeout=900, env={**os.environ, "NO_PROXY": "*"})  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    result: dict[str, Any] = json.loads(r.stdout)
    return result


def box_client(box: sandlot.Box, url: str, runs: int, proxy: str | None) -> dict[str, Any]:
    args = ["python3", "-c", CLIENT, url, str(runs), "big", *([proxy] if proxy else [])]
    r = box.exec(*args, timeout=900, env={"NO_PROXY": "", "no_proxy": ""})
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    result: dict[str, Any] = json.loads(r.stdout)
    return result


def https_with_secrets(root: Any, big: bytes, runs: int) -> dict[str, Any]:
    """HTTPS from one box to one server (CA made here): tunnelled as 127.0.0.1, and
    decrypted as 'localhost', the name the box's secret is for."""
    work = CACHE / "bench-secrets"
    work.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca("benchmark server")
    cert, key = make_leaf("localhost", ca_cert, ca_key)
    (work / "server.pem").write_text(key + cert + ca_cert)
    (work / "ca.pem").write_text(ca_cert)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(work / "server.pem")
    server = serve(big, tls)
    port = server.server_address[1]
    value = "sk-bench-0123456789"
    key_secret = sandlot.Secret("API_KEY", value, hosts=[f"localhost:{port}"], ca=work / "ca.pem")
    out: dict[str, Any] = {}
    allow = ["127.0.0.1", f"localhost:{port}"]
    url = f"https://localhost:{port}"
    # end to end: the guest checks the server's own certificate through a tunnel
    with sandlot.Box(rootfs=root, memory_mib=512, network="allowlist", allow=allow, template=False,
                     env={"NO_PROXY": "", "no_proxy": "", "API_KEY": value}) as box:  # fmt: skip
        box.files.write("/srv/server-ca.pem", ca_cert)
        r = box.exec("python3", "-c", TLS_CLIENT, url, str(runs), "/srv/server-ca.pem", timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        out["box_to_host_https_tunnel"] = figures(json.loads(r.stdout))
    # decrypted: the guest trusts its box's CA (SSL_CERT_FILE); the proxy swaps the key in
    with sandlot.Box(rootfs=root, memory_mib=512, network="allowlist", allow=allow, secrets=[key_secret],
                     template=False, env={"NO_PROXY": "", "no_proxy": ""}) as box:  # fmt: skip
        r = box.exec("python3", "-c", TLS_CLIENT, url, str(runs), "-", timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        out["box_to_host_https_secret_swapped"] = figures(json.loads(r.stdout))
    tunnel = out["box_to_host_https_tunnel"]["latency_ms"]["median"]
    out["box_to_host_https_secret_swapped"]["latency_ratio_vs_tunnel"] = round(
        out["box_to_host_https_secret_swapped"]["latency_ms"]["median"] / tunnel, 2
    )
    server.shutdown()
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--mib", type=int, default=32)
    args = ap.parse_args()
    if args.quick:
        args.runs, args.mib = 3, 4
    root = debian_root()
    big = bytes(range(256)) * (args.mib * 4096)
    server = serve(big)
    port = server.server_address[1]
    out: dict[str, Any] = {
        "benchmark": "network",
        "quick": args.quick,
        "runs": args.runs,
        "download_mib": args.mib,
    }
    out["host_to_host"] = base = figures(host_client(f"http://127.0.0.1:{port}", args.runs))

    def ratio(f: dict[str, Any]) -> dict[str, Any]:
        f["latency_ratio_vs_host"] = round(f["latency_ms"]["median"] / base["latency_ms"]["median"], 1)
        f["throughput_ratio_vs_host"] = round(f["throughput_mb_s"] / base["throughput_mb_s"], 3)
        return f

    allow = [f"127.0.0.1:{port}"]
    proxied = {
        "box_to_host_via_egress_proxy": {},
        # before the egress port: QEMU forks for each connection, the relay hands it over
        "box_to_host_via_proxy_relay_per_connection": {"SANDLOT_EGRESS_MUX": "0"},
        # before the egress server: QEMU starts a Python helper per connection
        "box_to_host_via_proxy_helper_per_connection": {
            "SANDLOT_EGRESS_RELAY": "0",
            "SANDLOT_EGRESS_MUX": "0",
        },
    }
    for key, env in proxied.items():
        os.environ.update(env)
        try:
            with sandlot.Box(
                rootfs=root, memory_mib=512, network="allowlist", allow=allow, template=False
            ) as b:
                raw = box_client(b, f"http://127.0.0.1:{port}", args.runs, "http://10.0.2.100:3128")
                out[key] = ratio(figures(raw))
        finally:
            for name in env:
                del os.environ[name]
    with sandlot.Box(rootfs=root, memory_mib=512, network="open", template=False) as box:
        raw = box_client(box, f"http://10.0.2.2:{port}", args.runs, None)
        out["box_to_host_direct_open_mode"] = direct = ratio(figures(raw))
    for key in proxied:
        over = out[key]["latency_ms"]["median"] - direct["latency_ms"]["median"]
        out[key]["latency_ms_over_direct_p50"] = round(over, 2)
        over = out[key]["to_connection_end_ms"]["median"] - direct["to_connection_end_ms"]["median"]
        out[key]["to_connection_end_ms_over_direct_p50"] = round(over, 2)
    with sandlot.Box(rootfs=root, memory_mib=512, network="allowlist", ports=[8000], template=False) as box:
        box.files.write("/srv/big", big)
        box.files.write("/srv/small", b"ok")
        box.sh("cd /srv && nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
        address, host_port = box.port(8000)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{address}:{host_port}/small", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        raw = host_client(f"http://{address}:{host_port}", args.runs)
        out["host_to_box_published_port"] = ratio(figures(raw))
        allow_box = [f"box:{box.name}:8000"]
        with sandlot.Box(rootfs=root, memory_mib=512, allow=allow_box, template=False) as other:
            url = f"http://{box.name}.box.internal:8000"
            out["box_to_box_direct"] = ratio(figures(box_client(other, url, args.runs, None)))
            raw = box_client(other, url, args.runs, "http://10.0.2.100:3128")
            out["box_to_box_via_egress_proxy"] = ratio(figures(raw))
    server.shutdown()
    out.update(https_with_secrets(root, big, args.runs))
    out["host"] = host_facts(sandlot.Runtime.for_home().prepare().accel)
    emit(out)


if __name__ == "__main__":
    main()
