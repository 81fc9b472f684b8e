"""Secrets on the host: the proxy process (run as QEMU runs it, on one end of a
socket pair) swaps placeholders in over TLS to an HTTPS server on 127.0.0.1
whose CA stands in for a public API's. Boxes using secrets: tests/security/."""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import InvalidArgument, Secret
from sandlot.core.spec import BoxSpec
from sandlot.net.policy import Policy, write_policy
from sandlot.net.secrets import Masker, build_vault, load_vault, swap_in_header, write_vault

from tests.support.servers import LocalServer, QuietHandler

VALUE = "sk-live-0123456789abcdef"


class EchoAPI(LocalServer):
    """An HTTPS API on 127.0.0.1 that answers with what it received (the value included)."""

    def __init__(self, test_ca: Path) -> None:
        seen: list[dict[str, str]] = []

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                got = {
                    "method": self.command,
                    "path": self.path,
                    "authorization": self.headers.get("Authorization", ""),
                    "body": self.rfile.read(length).decode(),
                    "accept-encoding": self.headers.get("Accept-Encoding", ""),
                }
                seen.append(got)
                body = json.dumps(got).encode()
                self.send_response(200)
                self.send_header("X-Echo", got["authorization"])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = answer

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(test_ca / "server.pem", test_ca / "server.key")
        self.seen = seen
        super().__init__(Handler, ctx)


@pytest.fixture(scope="module")
def api(test_ca: Path) -> Iterator[EchoAPI]:
    s = EchoAPI(test_ca)
    yield s
    s.close()


def build_spec(rootfs: Path, **options: Any) -> BoxSpec:
    """A box's options as ``BoxSpec.build`` checks them: this file's defaults, ``options`` over them."""
    defaults: dict[str, Any] = dict(
        rootfs=str(rootfs), name=None, env=None, workdir=None, user=None, volumes=None, labels=None,
        memory_mib=256, cpus=1, disk_size_gb=1, auto_remove=False, accel="tcg", kernel=None, hostname=None,
        boot_timeout=None, request_timeout=30,
    )  # fmt: skip
    return BoxSpec.build(None, **{**defaults, **options})


def box_dir_with(tmp_path: Path, test_ca: Path, api: EchoAPI, *, hosts: list[str] | None = None) -> BoxSpec:
    """A box directory as sandlot leaves it: the policy file and the secrets file."""
    secret = Secret("API_KEY", VALUE, hosts=hosts or [f"localhost:{api.port}"], ca=test_ca / "ca.pem")
    spec = build_spec(tmp_path, network="allowlist", allow=["127.0.0.1"], secrets=[secret])
    write_policy(tmp_path / "egress-policy.json", spec.policy)
    write_vault(tmp_path, build_vault("test", spec.secrets, [secret], None))
    return spec


def tunnel(tmp_path: Path, target: str) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """The guest's end of a CONNECT tunnel through one proxy process."""
    guest, theirs = socket.socketpair()
    policy, log = tmp_path / "egress-policy.json", tmp_path / "log"
    argv = [sys.executable, "-m", "sandlot.net.proxy", str(policy), str(log)]
    proc = subprocess.Popen(argv, stdin=theirs, stdout=theirs, stderr=theirs)
    theirs.close()
    guest.settimeout(20)
    guest.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = guest.recv(1)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return guest, proc


def last_log(tmp_path: Path) -> dict[str, object]:
    return json.loads((tmp_path / "log").read_text().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_proxy_swaps_placeholders_in_and_masks_the_value_coming_back(
    tmp_path: Path, test_ca: Path, api: EchoAPI
) -> None:
    spec = box_dir_with(tmp_path, test_ca, api)
    placeholder = spec.default_env()["API_KEY"]
    assert placeholder.startswith("sandlot-secret-API_KEY-") and VALUE not in json.dumps(spec.to_options())
    vault = load_vault(tmp_path)
    assert vault is not None
    raw, proc = tunnel(tmp_path, f"localhost:{api.port}")
    box_trust = ssl.create_default_context(cadata=vault.ca_cert)  # what the guest trusts
    conn = http.client.HTTPConnection("localhost", api.port)
    conn.sock = box_trust.wrap_socket(raw, server_hostname="localhost")
    body = json.dumps({"key": placeholder, "n": "x" * 100_000})
    conn.request("POST", "/v1/chat", body=body, headers={"Authorization": f"Bearer {placeholder}",
                                                          "Content-Type": "application/json"})  # fmt: skip
    first = conn.getresponse()
    echoed = json.loads(first.read())
    # the server got the value, in the header and the body, with the body's length made anew
    got = api.seen[-1]
    assert got["authorization"] == f"Bearer {VALUE}" and json.loads(got["body"])["key"] == VALUE
    assert got["accept-encoding"] == "identity"
    # and the box got it back masked, same length
    assert echoed["authorization"] == "Bearer " + "*" * len(VALUE)
    assert first.getheader("X-Echo") == "Bearer " + "*" * len(VALUE)
    # the same connection again (keep-alive): the target and Basic credentials
    basic = base64.b64encode(f"user:{placeholder}".encode()).decode()
    conn.request("GET", f"/v1/models?key={placeholder}", headers={"Authorization": f"Basic {basic}"})
    second = conn.getresponse()
    second.read()
    got = api.seen[-1]
    assert got["path"] == f"/v1/models?key={VALUE}"
    assert base64.b64decode(got["authorization"].split()[1]).decode() == f"user:{VALUE}"
    conn.close()
    assert proc.wait(20) == 0
    entry = last_log(tmp_path)
    assert entry["decision"] == "allowed" and entry["secrets"] == ["API_KEY"] and entry["requests"] == 2
    assert VALUE not in (tmp_path / "log").read_text()


def test_a_body_too_large_to_buffer_goes_as_sent(tmp_path: Path, test_ca: Path, api: EchoAPI) -> None:
    from sandlot.net.intercept import BODY_LIMIT

    spec = box_dir_with(tmp_path, test_ca, api)
    placeholder = spec.default_env()["API_KEY"]
    vault = load_vault(tmp_path)
    assert vault is not None
    raw, proc = tunnel(tmp_path, f"localhost:{api.port}")
    conn = http.client.HTTPConnection("localhost", api.port)
    conn.sock = ssl.create_default_context(cadata=vault.ca_cert).wrap_socket(raw, server_hostname="localhost")
    body = placeholder + "x" * BODY_LIMIT  # the placeholder in the part that is buffered first
    conn.request("POST", "/upload", body=body, headers={"Authorization": f"Bearer {placeholder}"})
    assert conn.getresponse().status == 200
    got = api.seen[-1]
    assert got["authorization"] == f"Bearer {VALUE}"  # headers are still swapped
    assert len(got["body"]) == len(body) and got["body"].startswith(placeholder)  # the body is not
    conn.close()
    assert proc.wait(20) == 0


def test_a_secret_goes_only_to_its_hosts(tmp_path: Path, test_ca: Path, api: EchoAPI) -> None:
    # the secret is for another port of the same name: this tunnel is not decrypted,
    # so the box's CA is not what answers and the placeholder would go as it is
    box_dir_with(tmp_path, test_ca, api, hosts=["localhost:1"])
    write_policy(tmp_path / "egress-policy.json", Policy.build("allowlist", ["127.0.0.1", "localhost"]))
    raw, proc = tunnel(tmp_path, f"localhost:{api.port}")
    real = ssl.create_default_context(cafile=test_ca / "ca.pem")  # the API's own certificate
    with real.wrap_socket(raw, server_hostname="localhost") as t:
        t.sendall(b"GET /direct HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        while t.recv(4096):
            pass
    assert proc.wait(20) == 0
    assert "secrets" not in last_log(tmp_path)


def test_a_box_that_does_not_trust_its_ca_gets_nothing(tmp_path: Path, test_ca: Path, api: EchoAPI) -> None:
    box_dir_with(tmp_path, test_ca, api)
    before = len(api.seen)
    raw, proc = tunnel(tmp_path, f"localhost:{api.port}")
    with pytest.raises(ssl.SSLCertVerificationError):
        ssl.create_default_context().wrap_socket(raw, server_hostname="localhost")
    raw.close()
    assert proc.wait(20) == 0
    assert last_log(tmp_path)["decision"] == "failed" and len(api.seen) == before


def test_secret_validation_and_masking() -> None:
    s = Secret("TOKEN", VALUE, hosts="api.example.com")
    assert VALUE not in repr(s) and s.hosts == ["api.example.com"]
    for bad in [
        lambda: Secret("1BAD", VALUE, hosts=["a.com"]),
        lambda: Secret("OK", "short", hosts=["a.com"]),
        lambda: Secret("OK", "line\nbreak-value", hosts=["a.com"]),
        lambda: Secret("OK", VALUE, hosts=[]),
        lambda: Secret("OK", VALUE, hosts=["10.0.0.0/8"]),  # names only: a certificate is made for it
    ]:
        with pytest.raises(InvalidArgument):
            bad()
    m = Masker([VALUE.encode()])
    stream = [b"abc" + VALUE.encode()[:5], VALUE.encode()[5:] + b"def", b"tail"]
    out = b"".join(m.feed(x) for x in stream) + m.flush()
    assert out == b"abc" + b"*" * len(VALUE) + b"deftail"
    swaps = load_vault_like([("K", b"ph-1", b"value-1")])
    assert swap_in_header(b"authorization", b"Basic " + base64.b64encode(b"u:ph-1"), swaps) == (
        b"Basic " + base64.b64encode(b"u:value-1")
    )


def load_vault_like(items: list[tuple[str, bytes, bytes]]) -> list:  # type: ignore[type-arg]
    from sandlot.net.policy import Rule
    from sandlot.net.secrets import Swap

    return [Swap(n, p, v, (Rule.parse("api.example.com"),)) for n, p, v in items]


def test_secrets_need_a_proxied_network_and_values_for_a_saved_state(tmp_path: Path) -> None:
    secret = Secret("API_KEY", VALUE, hosts=["api.example.com"])
    with pytest.raises(InvalidArgument, match="network='allowlist' or 'public'"):
        build_spec(tmp_path, network="open", secrets=[secret])
    with pytest.raises(InvalidArgument, match="both a secret and an env"):
        build_spec(tmp_path, env={"API_KEY": "x"}, network=True, secrets=[secret])
    spec = build_spec(tmp_path, network="allowlist", secrets=[secret])
    assert "api.example.com:443" in [str(r) for r in spec.policy.allow]  # reachable without allow=
    assert spec.allow == []
    # a saved state keeps its placeholders; its values come from secrets= or its box's file
    again = build_spec(tmp_path, network="allowlist", saved_secrets=spec.secrets)
    assert again.secrets == spec.secrets
    with pytest.raises(InvalidArgument, match="API_KEY"):
        build_vault("kid", again.secrets, [], None)


def test_cli_takes_a_secrets_value_from_the_environment_only(tmp_path: Path) -> None:
    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandlot.cli", *args], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=120)  # fmt: skip

    (tmp_path / "root" / "bin").mkdir(parents=True)
    common = ["--rootfs", str(tmp_path / "root"), "--network", "allowlist"]
    r = cli("create", *common, "--secret", "API_KEY@api.example.com")
    assert r.returncode == 2 and "set $API_KEY" in r.stderr
    r = cli("create", *common, "--secret", "API_KEY")
    assert r.returncode == 2 and "NAME@HOST" in r.stderr
    name = f"sec-{os.urandom(3).hex()}"
    r = cli("create", *common, "--name", name, "--secret", "API_KEY@api.example.com,*.example.org",
            API_KEY=VALUE)  # fmt: skip
    assert r.returncode == 0, r.stderr
    try:
        shown = cli("inspect", name).stdout
        record = json.loads(shown)
        assert record["options"]["secrets"][0]["hosts"] == ["api.example.com", "*.example.org"]
        assert VALUE not in shown
    finally:
        cli("rm", "-f", name)
