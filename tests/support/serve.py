"""A real ``sandlot serve`` process on 127.0.0.1 for the tests, and keys for it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.waiting import deadline_in


def shared_home(parent: Path) -> Path:
    """A fresh, empty home under ``parent`` that shares the default home's kernel, agent
    and initramfs caches (nothing is fetched or built again)."""
    home = parent / "home"
    home.mkdir()
    return sharing_caches(home)


def sharing_caches(home: Path) -> Path:
    """``home`` with the default home's kernel, agent and initramfs linked in (prepared
    first): nothing is fetched or built again for it."""
    import sandlot

    shared = sandlot.Runtime.for_home().home
    sandlot.Runtime.for_home(shared).prepare()
    for d in ("kernels", "agent", "initramfs"):
        if not (home / d).is_symlink():
            (home / d).symlink_to(shared / d)
    return home


def kept_home(path: Path) -> Path:
    """The home at ``path``, kept from one run to the next and emptied of all but its
    images and automatic templates (``empty_but_templates``), sharing the default home's
    caches as ``shared_home`` does: its boxes start as a user's second start of an image
    does, from the template an earlier run saved, where a fresh home would boot and save
    one for each image it starts. For what runs in one home at a time, and is not about
    a home's first start of an image."""
    path.mkdir(parents=True, exist_ok=True)
    empty_but_templates(sharing_caches(path))  # what a run killed half way left
    return path


def empty_but_templates(home: Path) -> None:
    """Every box, pool, snapshot, volume, API key and tier setting of ``home`` removed,
    but for its images and their automatic templates (those unnamed)."""
    import sqlite3

    import sandlot

    for pool in sandlot.pools(home=home):  # warm pools' VMs are no boxes: they go with their pool
        sandlot.set_pool(pool.template_id, 0, wait=True, home=home)
    for box in sandlot.list(all=True, home=home):
        box.remove(force=True)
    for snap in sandlot.Snapshot.list(home=home):
        if not (snap.kind == "template" and snap.name is None):
            with contextlib.suppress(sandlot.SandlotError):  # one a kept template was made from
                snap.remove()
    volumes = sandlot.Volumes(home)
    for volume in volumes.list():
        with contextlib.suppress(sandlot.SandlotError):
            volumes.remove(volume.name)
    (home / "storage.json").unlink(missing_ok=True)
    # a key's name is never used again, even revoked (the audit trail names it), and no
    # call of the API removes one: the rows go here, as they would with a fresh home
    db = sqlite3.connect(home / "sandlot.db", timeout=60)
    try:
        with db:
            db.execute("DELETE FROM previews")
            db.execute("DELETE FROM keys")
    finally:
        db.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sandlot_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SANDLOT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "sandlot.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def create_key(home: Path, name: str, *args: str) -> str:
    """A new API key (``sandlot keys create``), as the command prints it."""
    out = sandlot_cli(home, "keys", "create", "--name", name, *args)
    assert out.returncode == 0, out.stderr
    keys = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith(("sk-sl-", "e2b_"))]
    assert len(keys) == 1, out.stdout
    return keys[0]


@dataclass
class Served:
    home: Path
    port: int
    process: subprocess.Popen[bytes]
    api_key: str | None
    args: tuple[str, ...] = ()
    log: Path = field(default_factory=lambda: Path("/dev/null"))
    content_port: int = 0  # boxes' content: port routes, previews, port hosts (server/origins.py)

    @property
    def url(self) -> str:
        return self._at(self.port)

    @property
    def content_url(self) -> str:
        return self._at(self.content_port)

    def _at(self, port: int) -> str:
        scheme = "https" if "--tls-cert" in self.args else "http"
        return f"{scheme}://localhost:{port}" if scheme == "https" else f"http://127.0.0.1:{port}"

    def headers(self, key: str | None = None) -> dict[str, str]:
        key = key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self, key: str | None = None, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(key), timeout=120, **kw)  # type: ignore[arg-type]

    def content_client(self, key: str | None = None, **kw: object) -> httpx.Client:
        """A client of the content listener: port routes (with a key) and previews."""
        return httpx.Client(base_url=self.content_url, headers=self.headers(key), timeout=120, **kw)  # type: ignore[arg-type]

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def restart(self) -> None:
        """A new server process on the same port and home (after ``kill9`` or a stop)."""
        if self.process.poll() is None:
            self.stop()
        self.process = _start(self.home, self.port, self.content_port, self.args, self.log)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _start(home: Path, port: int, content_port: int, args: tuple[str, ...],
           log: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    env = {**os.environ, "SANDLOT_HOME": str(home)}
    argv = ["serve", "--port", str(port), "--content-port", str(content_port), *args]
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sandlot.cli", *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    deadline = deadline_in(60)
    scheme = "https" if "--tls-cert" in args else "http"
    while True:
        with contextlib.suppress(httpx.TransportError):
            # up is all this asks: the tests check the certificate themselves
            health = httpx.get(f"{scheme}://127.0.0.1:{port}/health", timeout=2, verify=False)
            if health.status_code == 200:
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"sandlot serve did not come up (exit {proc.poll()}):\n{tail}")
        time.sleep(0.1)


@contextlib.contextmanager
def serving(home: Path, *, no_auth: bool = False, args: tuple[str, ...] = (),
            log: Path | None = None) -> Iterator[Served]:  # fmt: skip
    """``sandlot serve`` on a free port of 127.0.0.1 for ``home``, with an admin key
    (``api_key``) unless ``no_auth``; stopped at the end."""
    key = None
    if not no_auth:
        key = create_key(home, f"admin-{os.getpid()}-{time.monotonic_ns() % 10**9}", "--admin")
    args = (*args, "--no-auth") if no_auth else args
    own_log = log is None  # kept only when the test failed, for the reason in it
    port, content_port = free_port(), free_port()
    while content_port == port:
        content_port = free_port()
    log = log or home / f"serve-{os.getpid()}-{port}.log"
    served = Served(home, port, _start(home, port, content_port, args, log), key, args, log, content_port)
    try:
        yield served
    finally:
        served.stop()
    if own_log:
        log.unlink(missing_ok=True)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def load(url: str, key: str | None, boxes: list[str], clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` threads, each with its own connection, doing exec and a file round trip
    in turn (each file its own bytes, read back and compared) for ``seconds``."""
    done, errors = [0], []
    lock = threading.Lock()
    stop = deadline_in(seconds)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def worker(i: int) -> None:
        box = boxes[i % len(boxes)]
        with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
            n = 0
            while time.monotonic() < stop:
                try:
                    if n % 2 == 0:
                        r = c.post(f"/v1/boxes/{box}/exec", json={"argv": ["true"]})
                        r.raise_for_status()
                    else:
                        path = {"path": f"/tmp/load-{i}"}
                        data = f"{i}:{n}:".encode().ljust(1024, b"x")
                        c.put(f"/v1/boxes/{box}/files/content", params=path, content=data).raise_for_status()
                        back = c.get(f"/v1/boxes/{box}/files/content", params=path)
                        back.raise_for_status()
                        assert back.content == data, f"{box}:{path['path']} read back other bytes"
                    n += 1
                except Exception as e:  # counted and reported, never hidden
                    with lock:
                        errors.append(repr(e)[:200])
            with lock:
                done[0] += n

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    rate = round(done[0] / elapsed, 1)
    return {"clients": clients, "boxes": len(boxes), "seconds": round(elapsed, 1), "requests_per_s": rate,
            "errors": len(errors), "first_errors": errors[:3]}  # fmt: skip
