"""A real OCI registry for the tests: Debian's docker-registry (distribution v2)
on 127.0.0.1, plain HTTP or TLS with a test CA and htpasswd auth; images pushed
to it with skopeo from OCI layouts the tests build."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.waiting import deadline_in

REGISTRY_BIN = "/usr/bin/docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_ca(d: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for 127.0.0.1 signed by it: (ca.crt, server.crt, server.key)."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = d / "ca.key", d / "ca.crt"
    key, csr, crt, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "ext.cnf"

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=sandlot test CA",
        "-keyout", str(ca_key), "-out", str(ca_crt))  # fmt: skip
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "2", "-extfile", str(ext), "-out", str(crt))  # fmt: skip
    return ca_crt, crt, key


@dataclass
class Registry:
    host: str  # "127.0.0.1:PORT"
    storage: Path
    ca: Path | None = None
    user: str | None = None
    password: str | None = None

    def ref(self, repo_tag: str) -> str:
        return f"{self.host}/{repo_tag}"

    def push(
        self,
        layout: Path,
        name: str,
        dest: str | None = None,
        *,
        all_platforms: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        """skopeo copy an OCI layout image (by its ref name) to this registry (as ``dest``)."""
        cmd = ["skopeo", "copy", "--quiet", *extra]
        if all_platforms:
            cmd.append("--all")
        if self.ca is not None:
            cmd += ["--dest-cert-dir", str(self.ca.parent)]
        else:
            cmd += ["--dest-tls-verify=false"]
        if self.user:
            cmd += ["--dest-creds", f"{self.user}:{self.password}"]
        cmd += [f"oci:{layout}:{name}", f"docker://{self.host}/{dest or name}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"skopeo push failed: {proc.stderr}")

    def blob_data_path(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@contextmanager
def run_registry(tmp: Path, *, tls: bool = False, auth: tuple[str, str] | None = None) -> Iterator[Registry]:
    if not Path(REGISTRY_BIN).exists() or not shutil.which("skopeo"):
        raise RuntimeError("the registry tests need docker-registry and skopeo (scripts/setup installs them)")
    port = free_port()
    storage = tmp / "storage"
    storage.mkdir(parents=True)
    config = [
        "version: 0.1",
        "log:",
        "  level: error",
        "  accesslog:",
        "    disabled: true",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {storage}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: 127.0.0.1:{port}",
    ]
    ca = None
    if tls:
        ca, crt, key = make_ca(tmp / "certs")
        # skopeo's --dest-cert-dir wants the CA as *.crt in a directory of its own
        cadir = tmp / "ca"
        cadir.mkdir()
        shutil.copy(ca, cadir / "ca.crt")
        ca = cadir / "ca.crt"
        config += ["  tls:", f"    certificate: {crt}", f"    key: {key}"]
    if auth:
        import bcrypt

        htpasswd = tmp / "htpasswd"
        hashed = bcrypt.hashpw(auth[1].encode(), bcrypt.gensalt(rounds=4)).decode()
        htpasswd.write_text(f"{auth[0]}:{hashed}\n")
        config += ["auth:", "  htpasswd:", "    realm: sandlot-test", f"    path: {htpasswd}"]
    cfg = tmp / "config.yml"
    cfg.write_text("\n".join(config) + "\n")
    log = open(tmp / "registry.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(cfg)], stdout=log, stderr=log)
    scheme = "https" if tls else "http"
    try:
        deadline = deadline_in(20)
        while True:
            try:
                verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca else False
                httpx.get(f"{scheme}://127.0.0.1:{port}/v2/", verify=verify, timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"registry did not start: {(tmp / 'registry.log').read_text()}"
                    ) from None
                time.sleep(0.05)
        yield Registry(f"127.0.0.1:{port}", storage, ca, *(auth or (None, None)))
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
