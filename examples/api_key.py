"""A box calls an API with a key it never holds. Runs offline: the "API" is an
HTTPS server this script starts on 127.0.0.1, with a CA of its own standing in
for a public one.

python examples/api_key.py [ROOTFS_WITH_PYTHON3]

The box sees a placeholder in $API_KEY; sandlot's egress proxy swaps the real
key in on HTTPS requests to the API's host only, and masks it in answers.
"""

import http.server
import json
import shutil
import ssl
import sys
import tempfile
import threading
from pathlib import Path

import sandlot
from sandlot.images.builders import debian_rootfs
from sandlot.net.secrets import make_ca, make_leaf  # any CA would do; these make EC certificates

KEY = "sk-example-0123456789abcdef"


class EchoAPI(http.server.BaseHTTPRequestHandler):
    """Answers with the Authorization header it received."""

    def do_GET(self) -> None:
        print(f"the API received: Authorization: {self.headers['Authorization']}")
        body = json.dumps({"you_sent": self.headers["Authorization"]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def python_rootfs() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    dest = Path.home() / ".cache" / "sandlot-examples" / "debian-python3"
    if not (dest / "usr" / "bin" / "python3").exists():
        debian_rootfs(dest, ["python3"])  # mmdebstrap, about 20 s once
    return dest


work = Path(tempfile.mkdtemp())
ca_cert, ca_key = make_ca("example API")
cert, key = make_leaf("localhost", ca_cert, ca_key)
(work / "server.pem").write_text(key + cert)
(work / "ca.pem").write_text(ca_cert)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EchoAPI)
tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
tls.load_cert_chain(work / "server.pem")
server.socket = tls.wrap_socket(server.socket, server_side=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
port = server.server_address[1]

secret = sandlot.Secret("API_KEY", KEY, hosts=[f"localhost:{port}"], ca=work / "ca.pem")
# 127.0.0.1 is listed because 'localhost' resolves there: a private address needs opting in
with sandlot.Box(rootfs=python_rootfs(), memory_mib=256, network="allowlist", allow=["127.0.0.1"],
                 secrets=[secret], env={"NO_PROXY": "", "no_proxy": ""}) as box:  # fmt: skip
    print("the box sees:  API_KEY =", box.exec("sh", "-c", "echo $API_KEY").stdout.strip())
    call = (
        "import os, urllib.request\n"
        f"req = urllib.request.Request('https://localhost:{port}/v1/models',\n"
        "                             headers={'Authorization': 'Bearer ' + os.environ['API_KEY']})\n"
        "print(urllib.request.urlopen(req, timeout=60).read().decode())\n"
    )
    print("the box got back:", box.exec("python3", "-c", call).stdout.strip())
server.shutdown()
shutil.rmtree(work)
