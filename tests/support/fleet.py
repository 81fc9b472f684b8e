"""A real multi-node Ray cluster on this machine for the fleet's tests and benchmarks:
``ray.cluster_utils.Cluster``, each node a raylet of its own with its own
``SANDLOT_HOME`` (sharing the default home's kernel, agent and initramfs, so nothing
is fetched again) and its own sandlot resources. Sized for a small host: one Ray
CPU and a 100 MiB object store per node, no dashboard.

The cluster authenticates with a token of its own, as docs/fleet.md's setup does
(``auth=False``: an open cluster, for the test of a node refusing one): its file is
named by ``RAY_AUTH_TOKEN_PATH`` in this process's environment while the cluster
runs, which its nodes and the drivers this process starts inherit."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import sandlot

# a dead raylet is noticed in about 3 s instead of Ray's default 30
HEALTH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
          "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}  # fmt: skip


def node_home(prefix: str = "fleet-node-") -> Path:
    """A new, empty sandlot home sharing the default home's kernel, agent and initramfs."""
    shared = sandlot.Runtime.for_home().home
    sandlot.Runtime.for_home().prepare()
    home = Path(tempfile.mkdtemp(prefix=prefix, dir=shared.parent))
    for d in ("kernels", "agent", "initramfs"):
        (home / d).symlink_to(shared / d)
    return home


class FleetCluster:
    """Ray nodes on this machine, each a sandlot node of its own home."""

    def __init__(self, auth: bool = True, tls: bool = False) -> None:
        from ray.cluster_utils import Cluster

        from sandlot import clusterauth

        self.secrets = Path(tempfile.mkdtemp(prefix="fleet-auth-"))
        self.token_path = self.secrets / "auth_token"
        self.token = clusterauth.make_token(self.token_path).value if auth else None
        self.saved_env = {k: os.environ.get(k) for k in AUTH_ENV}
        for k in AUTH_ENV:
            os.environ.pop(k, None)
        os.environ["RAY_AUTH_MODE"] = "token" if auth else "disabled"
        if auth:
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        if tls:  # Ray's mutual TLS, from a private CA as docs/fleet.md makes one
            os.environ.update(tls_files(self.secrets))
        refresh_ray_config()
        self.cluster = Cluster(initialize_head=False)
        self.nodes: dict[str, Any] = {}
        self.homes: dict[str, Path] = {}
        self.head: str | None = None
        self.runs: dict[str, Path] = {}  # each node's SANDLOT_RUNTIME_DIR

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, cpus: int, memory_mib: int, env: dict[str, str] | None = None,
            like: str | None = None) -> str:  # fmt: skip
        """Add a node offering ``cpus`` and ``memory_mib`` to boxes; its Ray node id.
        ``like``: a dead node whose host comes back, with its home and run directory."""
        from sandlot.fleet import CPUS, MEMORY

        if like is not None:
            home, run = self.homes[like], self.runs[like]
        else:
            home = node_home()
            run = Path(tempfile.mkdtemp(prefix="sl-"))  # short: unix socket paths live there
            run.chmod(0o700)
        args: dict[str, Any] = {
            "num_cpus": 1,
            "resources": {CPUS: cpus, MEMORY: memory_mib},
            # nodes on one machine: each its own run directory too, as each host has (a box keeps
            # its id when it moves, and the run directory of a box is named by its id)
            "env_vars": {"SANDLOT_HOME": str(home), "SANDLOT_RUNTIME_DIR": str(run), **(env or {})},
            "object_store_memory": 100 << 20,
            "include_dashboard": False,
        }
        if self.head is None:
            args["_system_config"] = HEALTH
        node = self.cluster.add_node(**args)
        node_id = str(node.node_id)
        self.nodes[node_id] = node
        self.homes[node_id] = home
        self.runs[node_id] = run
        if self.head is None:
            self.head = node_id
        return node_id

    def kill(self, node_id: str) -> None:
        """Kill the node's raylet and the processes of its Ray node (its VMs live on, as
        orphans of a dead host would not: ``shutdown`` removes them)."""
        self.cluster.remove_node(self.nodes[node_id], allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            self.cluster.shutdown()
        for home in self.homes.values():
            with contextlib.suppress(Exception):
                for b in sandlot.list(home=home):
                    b.remove(force=True)
            shutil.rmtree(home, ignore_errors=True)
        for run in self.runs.values():
            shutil.rmtree(run, ignore_errors=True)
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(Exception):
            refresh_ray_config()
        shutil.rmtree(self.secrets, ignore_errors=True)


AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_USE_TLS", "RAY_TLS_SERVER_CERT",
            "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")  # fmt: skip


def tls_files(where: Path) -> dict[str, str]:
    """A private CA and one certificate for every Ray process of this machine (its
    address, and loopback), for server and client alike as Ray's mutual TLS uses it:
    Ray's TLS settings naming them."""
    import datetime
    import ipaddress

    import ray
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())  # fmt: skip

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandlot fleet test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    here = ray.util.get_node_ip_address()
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted({here, "127.0.0.1"})]
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # Ray's TLS is mutual
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, here)]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(both), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    files = {"RAY_TLS_CA_CERT": ("ca.crt", ca.public_bytes(serialization.Encoding.PEM)),
             "RAY_TLS_SERVER_CERT": ("node.crt", cert.public_bytes(serialization.Encoding.PEM)),
             "RAY_TLS_SERVER_KEY": ("node.key", pem_key(key))}  # fmt: skip
    out = {"RAY_USE_TLS": "1"}
    for var, (name, data) in files.items():
        (where / name).write_bytes(data)
        (where / name).chmod(0o600)
        out[var] = str(where / name)
    return out


def refresh_ray_config() -> None:
    """This process's Ray reads its authentication settings again (it caches them)."""
    from sandlot.fleet.trust import refresh_ray_config as refresh

    refresh()
