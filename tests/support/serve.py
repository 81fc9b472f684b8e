"""A real ``sandlot serve`` process on 127.0.0.1 for the tests, and keys for it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx


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
    keys = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("sk-sl-")]
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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, key: str | None = None) -> dict[str, str]:
        key = key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self, key: str | None = None, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(key), timeout=120, **kw)  # type: ignore[arg-type]

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def restart(self) -> None:
        """A new server process on the same port and home (after ``kill9`` or a stop)."""
        if self.process.poll() is None:
            self.stop()
        self.process = _start(self.home, self.port, self.args, self.log)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _start(home: Path, port: int, args: tuple[str, ...], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SANDLOT_HOME": str(home)}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sandlot.cli", "serve", "--port", str(port), *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
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
    log = log or home / f"serve-{os.getpid()}.log"
    port = free_port()
    served = Served(home, port, _start(home, port, args, log), key, args, log)
    try:
        yield served
    finally:
        served.stop()
