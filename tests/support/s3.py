"""A real S3-compatible server on 127.0.0.1 for the storage tier's tests: moto's
standalone server (moto[server], it speaks the S3 API over HTTP), started by the test
in a process of its own, never a mocked client. In front of it, ``FaultyProxy``: a
plain HTTP proxy that the test tells to fail requests (a status, a dropped connection,
a delay) or to stop answering at all, in the middle of a push or a pull."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    endpoint_url: str
    bucket: str
    process: subprocess.Popen[bytes]

    def url(self, prefix: str = "sandlot") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip


@contextlib.contextmanager
def s3_server(workdir: Path, bucket: str = "sandlot-tier") -> Iterator[S3Server]:
    """moto's server on a free port of 127.0.0.1, with ``bucket`` made, until the block ends."""
    port = free_port()
    log = open(workdir / f"moto-{port}.log", "wb")  # noqa: SIM115 (closed with the process)
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS})
    server = S3Server(f"http://127.0.0.1:{port}", bucket, proc)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                server.client().create_bucket(Bucket=bucket)
                break
            except Exception as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = (workdir / f"moto-{port}.log").read_text()
                    raise RuntimeError(f"moto's server did not start: {said}") from exc
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()
        log.close()


@dataclass
class Rule:
    method: str
    contains: str
    status: int  # 0: drop the connection without an answer
    times: int
    delay: float = 0.0


@dataclass
class FaultyProxy:
    """HTTP in front of ``upstream``: requests pass through, but those a rule matches."""

    upstream: str
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def fail(self, method: str, contains: str, status: int = 500, times: int = 1, delay: float = 0.0) -> None:
        """The next ``times`` requests of ``method`` whose path holds ``contains`` fail
        with ``status`` (0: the connection is dropped), after ``delay`` seconds."""
        with self.lock:
            self.rules.append(Rule(method, contains, status, times, delay))

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def take(self, method: str, path: str) -> Rule | None:
        with self.lock:
            self.seen.append((method, path))
            for rule in self.rules:
                if rule.times > 0 and rule.method in (method, "*") and rule.contains in path:
                    rule.times -= 1
                    return rule
        return None


@contextlib.contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(upstream)
    host = upstream.split("//", 1)[1]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if proxy.stopped:
                self.close_connection = True
                self.connection.close()
                return
            rule = proxy.take(self.command, self.path)
            if rule is not None:
                time.sleep(rule.delay)
                if rule.status == 0:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                message = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                self.send_response(rule.status)
                self.send_header("Content-Length", str(len(message)))
                self.end_headers()
                self.wfile.write(message)
                return
            conn = http.client.HTTPConnection(host, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            self.send_response(reply.status, reply.reason)
            for k, v in reply.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
