"""Secrets a box uses but never holds: a placeholder inside, the value swapped in on the host.

``Box(secrets=[Secret("API_KEY", value, hosts=["api.example.com"])])``: commands
in the box see ``API_KEY=sandlot-secret-API_KEY-<random>``. When the box sends
that placeholder over HTTPS to a listed host (in a header, the request target or
the body), sandlot's egress proxy replaces it with the value on its way out; a
response that carries the value back has it masked (``*`` of the same length).
To read the request, the proxy terminates the box's TLS with a certificate
signed by a CA made for this box, which sandlot adds to the box's trust store.
Connections to other hosts are never decrypted, and the placeholder goes
anywhere else unchanged: it is worthless outside sandlot.

Where the value lives: in one file in the box's host directory, mode 0600, read
by the proxy per connection. Never in the state store, the guest's memory or
disk, a snapshot, or an export. A box started from a snapshot gets the values
from ``secrets=``, or from the box the snapshot was taken of while that box
exists on this host (``fork()``).
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import InvalidArgument
from .policy import Rule, normalize_host

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SECRETS_FILE = "secrets.json"
DEFAULT_PORT = 443

# Where images keep their CA bundle (Debian/Ubuntu/Alpine, RHEL/Fedora, SUSE):
# sandlot's CA is appended to each that exists, for programs that read the
# system bundle directly; GUEST_BUNDLE is the system bundle plus the CA, which
# the TLS environment variables point at.
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
)
GUEST_CA = "/etc/sandlot/ca.pem"
GUEST_BUNDLE = "/etc/sandlot/ca-bundle.pem"


def trust_env() -> dict[str, str]:
    """What makes OpenSSL, Python (requests, pip, httpx), curl, git and Node trust the box's CA."""
    return {
        "SSL_CERT_FILE": GUEST_BUNDLE,
        "REQUESTS_CA_BUNDLE": GUEST_BUNDLE,
        "CURL_CA_BUNDLE": GUEST_BUNDLE,
        "PIP_CERT": GUEST_BUNDLE,
        "GIT_SSL_CAINFO": GUEST_BUNDLE,
        "NODE_EXTRA_CA_CERTS": GUEST_CA,
    }


class Secret:
    """A value a box may use but never see (see the module's description).

    ``hosts``: where the value may go: names, ``*.domain`` for its subdomains,
    each with an optional ``:PORT`` (443 when none). In ``allowlist`` mode these
    hosts are reachable without listing them in ``allow``. ``ca``: a PEM file of
    CA certificates to trust for these hosts besides the host's own (a private
    API with its own CA).

    >>> s = Secret("API_KEY", "sk-123", hosts=["api.example.com"])
    >>> s
    Secret('API_KEY', hosts=['api.example.com'])
    """

    __slots__ = ("ca_pem", "hosts", "name", "value")

    def __init__(
        self,
        name: str,
        value: str,
        *,
        hosts: Sequence[str] | str,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument(f"a secret's name must be an environment variable name, not {name!r}")
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"secret {name}: the value must be a non-empty string")
        if any(c in value for c in "\0\r\n"):
            raise InvalidArgument(f"secret {name}: the value cannot hold NUL, CR or LF (it goes in headers)")
        if len(value) < 8:
            # a short value would be masked in every response it happens to occur in
            raise InvalidArgument(f"secret {name}: the value must be at least 8 characters")
        if isinstance(hosts, str):
            hosts = [hosts]
        if not hosts:
            raise InvalidArgument(f"secret {name}: hosts= must name where the value may be sent")
        self.name = name
        self.value = value
        self.hosts = [str(host_rule(name, h)) for h in hosts]
        self.ca_pem: str | None = None
        if ca is not None:
            try:
                pem = Path(ca).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidArgument(f"secret {name}: cannot read ca={os.fspath(ca)!r}: {exc}") from None
            if "-----BEGIN CERTIFICATE-----" not in pem:
                raise InvalidArgument(f"secret {name}: {os.fspath(ca)!r} holds no PEM certificate")
            self.ca_pem = pem

    def __repr__(self) -> str:  # never the value
        return f"Secret({self.name!r}, hosts={self.hosts!r})"


def host_rule(name: str, text: str) -> Rule:
    """A secret's host entry: a name or ``*.domain``, with an optional port."""
    rule = Rule.parse(text) if isinstance(text, str) else None
    if rule is None or rule.name is None:
        raise InvalidArgument(f"secret {name}: hosts entries are names (or *.domain), not {text!r}")
    return rule


def new_placeholder(name: str) -> str:
    return f"sandlot-secret-{name}-{os.urandom(12).hex()}"


class Swap(NamedTuple):
    """One secret as the proxy uses it."""

    name: str
    placeholder: bytes
    value: bytes
    hosts: tuple[Rule, ...]

    def applies_to(self, host: str, port: int) -> bool:
        host = normalize_host(host)
        return any(r.matches_name(host, port) and port == (r.port or DEFAULT_PORT) for r in self.hosts)


class Vault(NamedTuple):
    """The contents of a box's secrets file: the values, and the box's CA."""

    swaps: tuple[Swap, ...]
    ca_cert: str
    ca_key: str
    upstream_ca: str  # PEM certificates to trust upstream, besides the host's own

    def for_host(self, host: str, port: int) -> list[Swap]:
        return [s for s in self.swaps if s.applies_to(host, port)]


def build_vault(
    label: str, specs: Sequence[dict[str, Any]], given: Iterable[Secret], source: dict[str, Any] | None
) -> dict[str, Any]:
    """A box's secrets file: ``specs`` (its secrets' records) with their values
    from ``given``, else from ``source`` (the file of the box its saved state was
    taken of), whose CA it keeps too: programs in that state may trust only it."""
    values = {s.name: s for s in given}
    old = {e["name"]: e for e in (source or {}).get("secrets", [])}
    missing = [s["name"] for s in specs if s["name"] not in values and s["name"] not in old]
    if missing:
        raise InvalidArgument(
            f"the saved state uses the secret(s) {', '.join(missing)}, whose values are not on this host: "
            f"pass secrets=[sandlot.Secret({missing[0]!r}, value, hosts=[...])]"
        )
    entries = []
    for s in specs:
        value = values[s["name"]].value if s["name"] in values else old[s["name"]]["value"]
        entries.append({**s, "value": value})
    if source and source.get("ca_cert"):
        ca_cert, ca_key = source["ca_cert"], source["ca_key"]
    else:
        ca_cert, ca_key = make_ca(label)
    extra = [x.ca_pem for x in values.values() if x.ca_pem] + [(source or {}).get("upstream_ca", "")]
    return {"secrets": entries, "ca_cert": ca_cert, "ca_key": ca_key, "upstream_ca": "".join(extra)}


def write_vault(box_dir: Path, data: dict[str, Any]) -> None:
    """Write the secrets file (0600, atomically: a crash leaves the old one or the new one)."""
    from ..config import atomic_write

    atomic_write(box_dir / SECRETS_FILE, json.dumps(data).encode(), mode=0o600)


def read_vault_json(box_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((box_dir / SECRETS_FILE).read_text())
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None


def _swap_fields(e: dict[str, Any]) -> tuple[str, bytes, bytes, tuple[Rule, ...]]:
    return e["name"], e["placeholder"].encode(), e["value"].encode(), tuple(map(Rule.parse, e["hosts"]))


def load_vault(box_dir: Path) -> Vault | None:
    """The box's vault (None if it has no secrets); a damaged file is an error the proxy refuses on."""
    data = read_vault_json(box_dir)
    if data is None:
        return None
    try:
        swaps = tuple(Swap(*_swap_fields(e)) for e in data["secrets"])
        return Vault(swaps, data["ca_cert"], data["ca_key"], data.get("upstream_ca", ""))
    except (KeyError, TypeError, AttributeError, InvalidArgument) as exc:
        raise ValueError(f"damaged secrets file: {exc!r}") from None


# -- substitution -----------------------------------------------------------------------------


def swap_in(data: bytes, swaps: Sequence[Swap]) -> bytes:
    for s in swaps:
        if s.placeholder in data:
            data = data.replace(s.placeholder, s.value)
    return data


def swap_in_header(name: bytes, value: bytes, swaps: Sequence[Swap]) -> bytes:
    """A header value with placeholders replaced, inside Basic credentials too."""
    if name.lower() in (b"authorization", b"proxy-authorization") and value[:6].lower() == b"basic ":
        try:
            decoded = base64.b64decode(value[6:].strip(), validate=True)
        except ValueError:
            return swap_in(value, swaps)
        swapped = swap_in(decoded, swaps)
        if swapped != decoded:
            return value[:6] + base64.b64encode(swapped)
    return swap_in(value, swaps)


class Masker:
    """Masks secret values in a stream that may split them across chunks: the last
    ``longest - 1`` bytes are held back until the next chunk (or ``flush``)."""

    def __init__(self, values: Sequence[bytes]) -> None:
        self.values = sorted(set(values), key=len, reverse=True)
        self.keep = max((len(v) for v in self.values), default=1) - 1
        self.carry = b""

    def mask(self, data: bytes) -> bytes:
        for v in self.values:
            if v in data:
                data = data.replace(v, b"*" * len(v))
        return data

    def feed(self, data: bytes) -> bytes:
        buf = self.mask(self.carry + data)
        cut = max(0, len(buf) - self.keep)
        self.carry = buf[cut:]
        return buf[:cut]

    def flush(self) -> bytes:
        out, self.carry = self.carry, b""
        return out


# -- the box's CA -------------------------------------------------------------------------------


CA_KEY_USAGE = dict.fromkeys(
    ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement", "encipher_only",
     "decipher_only"), False,
) | {"digital_signature": True, "key_cert_sign": True, "crl_sign": True}  # fmt: skip


def make_ca(label: str) -> tuple[str, str]:
    """A new CA (certificate PEM, key PEM) for one box: EC P-256, ten years."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sandlot box {label} CA"[:64])])
    # a day back: a box restored from an older snapshot may run a little behind
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**CA_KEY_USAGE),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_cert(cert), _pem_key(key)


def make_leaf(host: str, ca_cert: str, ca_key: str) -> tuple[str, str]:
    """A server certificate for ``host`` signed by the box's CA (certificate PEM, key PEM)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = x509.load_pem_x509_certificate(ca_cert.encode())
    signer = serialization.load_pem_private_key(ca_key.encode(), password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca.not_valid_before_utc)
        .not_valid_after(ca.not_valid_after_utc)
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), False)
        .sign(signer, hashes.SHA256())
    )
    return _pem_cert(cert), _pem_key(key)


def _pem_cert(cert: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return str(cert.public_bytes(serialization.Encoding.PEM).decode())


def _pem_key(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    return str(pem.decode())
