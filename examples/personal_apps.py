"""A box per user, asleep while nobody uses it: each user's app runs in a box of its own
behind ``sandlot serve --port-domain``, is put to sleep a few seconds after its last
request (``idle_timeout``: its memory and processes on disk, no VM running), and is
woken by the next request, which waits while it resumes and is then answered by the
same app, with what it held in memory. Runs offline: it starts a server on 127.0.0.1
for a scratch home.

python examples/personal_apps.py [ROOTFS]

Each user's app is busybox's ``httpd`` and a counter the app keeps in memory (a shell
loop that counts its visits): ``/visit`` adds one and answers how many. A request to
``http://8000-{box}.localhost:{content port}/visit`` reaches port 8000 of that user's
box; here it is sent to 127.0.0.1 with that ``Host`` header, which is what a browser
does for ``*.localhost``. A published port of a box on this host does the same with
``Box(..., ports=[8000], wake_on_traffic=True)`` (docs/api.md).
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from _rootfs import rootfs

import sandlot
from sandlot.api import access

USERS = ["ada", "grace", "linus"]
IDLE = 3  # seconds without a request before a user's box sleeps
# the app: httpd runs /www/cgi-bin/visit for /visit; a loop holds the count in its memory
# and hands it out through a FIFO, so the count lives only in the box's running processes
APP = r"""
mkdir -p /www/cgi-bin && mkfifo /tmp/ask /tmp/answer
cat > /www/cgi-bin/visit <<'EOF'
#!/bin/sh
echo x > /tmp/ask; read n < /tmp/answer
printf 'Content-Type: text/plain\r\n\r\nvisit %s\n' "$n"
EOF
chmod +x /www/cgi-bin/visit
(n=0; while read _ < /tmp/ask; do n=$((n+1)); echo $n > /tmp/answer; done) >/dev/null 2>&1 &
httpd -p 8000 -h /www
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(home: str) -> tuple[subprocess.Popen[bytes], str, int, str]:
    """A server for ``home`` with ``--port-domain localhost``: its API's URL, its content
    port, and an admin key (admin: it may boot a local root filesystem)."""
    _, key = access.create_key("apps", admin=True, home=home)
    port, content = free_port(), free_port()
    argv = ["serve", "--port", str(port), "--content-port", str(content), "--port-domain", "localhost"]
    env = {**os.environ, "SANDLOT_HOME": home}
    server = subprocess.Popen([sys.executable, "-m", "sandlot.cli", *argv], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url, content, key
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("sandlot serve did not come up")


def main() -> None:
    home = tempfile.mkdtemp(prefix="sandlot-apps-")
    server, url, content, key = serve(home)
    web = httpx.Client(base_url=f"http://127.0.0.1:{content}", headers={"Authorization": f"Bearer {key}"},
                       timeout=120)  # fmt: skip
    try:
        client = sandlot.connect(url, api_key=key)
        boxes = {}
        for user in USERS:  # each user's app, in a box of its own
            box = client.Box(rootfs=str(rootfs()), memory_mib=256, name=f"app-{user}", idle_timeout=IDLE)
            box.start()
            box.exec("sh", "-c", APP, check=True)
            boxes[user] = box

        def visit(user: str) -> str:
            r = web.get("/cgi-bin/visit", headers={"Host": f"8000-app-{user}.localhost:{content}"})
            if r.status_code != 200:  # the server's error says why
                raise SystemExit(f"{user}: {r.status_code} {r.text}")
            return r.text.strip()

        for user in USERS:
            print(f"{user}: {visit(user)}, {visit(user)}")  # visit 1, visit 2
        for user, box in boxes.items():  # nobody uses them for a while: they sleep
            deadline = time.monotonic() + 120
            while box.refresh() != "suspended":
                assert time.monotonic() < deadline, f"{user}'s box did not sleep"
                time.sleep(0.5)
        print("asleep:", ", ".join(f"{u} {b.state}" for u, b in boxes.items()))
        for user, box in boxes.items():  # the next request wakes the user's box: its app counts on
            t0 = time.monotonic()
            answer = visit(user)
            print(f"{user}: {answer} (woken in {time.monotonic() - t0:.2f} s; now {box.refresh()})")
            assert answer == "visit 3", answer
        for box in boxes.values():
            box.remove(force=True)
    finally:
        web.close()
        server.terminate()
        server.wait(15)
        shutil.rmtree(home, ignore_errors=True)  # its base disks and states: scratch


if __name__ == "__main__":
    main()
