"""A fleet's Ray cluster, authenticated: the driver sends the cluster's token, and a node
serves boxes only on a cluster that refuses callers without it.

Ray checks a token on every gRPC call and on the dashboard when ``RAY_AUTH_MODE=token``
(``clusterauth`` finds the token as Ray does). Ray turns that mode on by itself only
for a cluster it starts in ``ray.init()`` or one found with ``address="auto"``; a
driver given an address sends no token unless told to. So ``use_token`` tells it
whenever a token is there to send, and a cluster that then refuses the driver is
``Unauthorized``, saying where the token was looked for.

A node cannot take its own word for the cluster's mode (its own environment says what
it sends, not what the head checks), so ``probe`` asks the cluster's GCS from a
process that sends no token: a cluster that answers it is open to anyone who reaches
its ports, and the node refuses it (``InsecureCluster``) unless its operator allowed
it (``clusterauth.INSECURE_ENV``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray

from .. import clusterauth
from ..errors import ConnectionLost, InsecureCluster, Unauthorized

DRIVER_TIMEOUT = 20.0  # seconds a driver's first call may wait for the GCS
PROBE_TIMEOUT = 60.0  # seconds for the tokenless process to import Ray and ask the GCS once
# the tokenless caller: "open" if the GCS answered it, "token" if the GCS refused it for its token
PROBE = """
import sys
try:
    from ray._raylet import GcsClient
    GcsClient(address=sys.argv[1]).internal_kv_get(b"sandlot-probe", None, timeout=10)
except Exception as exc:
    kind = type(exc).__name__
    print("token" if kind == "AuthenticationError" else f"unknown: {kind}: {str(exc)[:300]}")
else:
    print("open")
"""


def refresh_ray_config() -> None:
    """Make this process's Ray see ``RAY_AUTH_MODE`` as it is now: Ray reads its
    configuration once, and its token loader caches the token it read."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def use_token(address: str | None) -> clusterauth.Token | None:
    """Have this process send the cluster's token, found as Ray finds it. For a local
    cluster (``address`` None) one is made if none exists (mode 0600). An explicit
    ``RAY_AUTH_MODE`` is the operator's and is left alone. The token used, if any."""
    mode = clusterauth.auth_mode()
    token = clusterauth.find_token(strict=address is not None)  # a local cluster's is made where it is named
    if mode is not None and mode != "token":
        return None
    if token is None and address is None:
        token = clusterauth.make_token()
    if token is not None and mode is None:
        os.environ[clusterauth.AUTH_MODE_ENV] = "token"
        refresh_ray_config()
    return token


def check_driver(address: str) -> None:
    """Ask the cluster's GCS once with this driver's token and TLS settings, so that a
    refusal is said at once: ``ray.init`` retries for about 25 s and then says only that
    it could not connect (and a TLS cluster asked without TLS, never). Raises Ray's
    AuthenticationError if refused, ConnectionLost if the GCS does not answer in time;
    anything else (an address Ray Client serves, one Ray cannot parse) is ``ray.init``'s
    to say."""
    if address.startswith("ray://"):
        return
    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    try:
        gcs = canonicalize_bootstrap_address(address)
        if gcs is not None:
            GcsClient(address=gcs).internal_kv_get(b"sandlot-driver", None, timeout=DRIVER_TIMEOUT)
    except ray.exceptions.AuthenticationError:
        raise
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RpcError, TimeoutError) as exc:
        tls = "on" if clusterauth.tls_settings()["on"] else "off"
        raise ConnectionLost(
            f"the Ray cluster at {address} did not answer this driver in {DRIVER_TIMEOUT:g} s: is it up and "
            f"reachable, and does it use TLS as this driver does (TLS is {tls} here: "
            f"{clusterauth.TLS_ENV} and its certificates as on the nodes)? ({type(exc).__name__}: "
            f"{str(exc)[:200]})"
        ) from None
    except Exception:  # not a refusal: ray.init says what it is
        pass


def is_refusal(exc: BaseException) -> bool:
    """Whether a failure to join is the cluster refusing this driver's token."""
    return isinstance(exc, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(exc)


def refused(address: str | None, token: clusterauth.Token | None, exc: BaseException) -> Unauthorized:
    """The error of a cluster that refused this driver's token."""
    if token is None:
        why = (f"this driver has no token (looked in ${clusterauth.TOKEN_ENV}, "
               f"${clusterauth.TOKEN_PATH_ENV} and {clusterauth.default_token_path()})")  # fmt: skip
    else:
        where = f"${clusterauth.TOKEN_ENV}" if token.path is None else str(token.path)
        why = f"the token from {where} is not the cluster's"
    return Unauthorized(
        f"the Ray cluster at {address} refused this driver: {why}. Copy the cluster's token from its "
        f"head (`sandlot fleet token` there) to {clusterauth.token_file()} (mode 0600) or "
        f"${clusterauth.TOKEN_ENV} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    )


def probe(gcs_address: str) -> str:
    """What the cluster's GCS does with a caller that sends no token: "open" (it answers),
    "token" (it refuses it for want of one), or "unknown: ..." (and why)."""
    env = {
        k: v for k, v in os.environ.items() if k not in (clusterauth.TOKEN_ENV, clusterauth.TOKEN_PATH_ENV)
    }
    env[clusterauth.AUTH_MODE_ENV] = "disabled"
    with tempfile.TemporaryDirectory(prefix="sandlot-probe-") as nobody:
        env["HOME"] = nobody  # no ~/.ray/auth_token to send either
        try:
            done = subprocess.run(
                [sys.executable, "-c", PROBE, gcs_address], env=env, capture_output=True, text=True,
                timeout=PROBE_TIMEOUT,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"unknown: no answer within {PROBE_TIMEOUT:g} s"
    said = done.stdout.strip().splitlines()
    if said and (said[-1] in ("open", "token") or said[-1].startswith("unknown")):
        return said[-1]
    return f"unknown: the probe ended with {done.returncode}: {done.stderr.strip()[-300:]}"


def check_cluster(home: Path, node_id: str) -> dict[str, Any]:
    """Whether this node may serve boxes on its cluster: the cluster refuses callers
    without its token, or the operator allowed an open one. Written to the home for
    ``sandlot doctor`` either way; InsecureCluster if not."""
    found = probe(ray.get_runtime_context().gcs_address)
    allowed = clusterauth.insecure_allowed()
    serving = found == "token" or allowed
    facts = {
        "node_id": node_id,
        "cluster_auth": found,
        "insecure_allowed": allowed,
        "serving": serving,
        "tls": clusterauth.tls_settings()["on"],
        "pid": os.getpid(),
    }
    with contextlib.suppress(OSError):
        clusterauth.record_trust(home, facts)
    if not serving:
        what = "answers callers without a token" if found == "open" else f"could not be checked ({found})"
        raise InsecureCluster(
            f"node {node_id[:12]} serves no boxes: its Ray cluster {what}, so anyone who reaches its "
            f"ports would be root on this node. Start Ray with token authentication (`sandlot fleet start`, "
            f"or {clusterauth.AUTH_MODE_ENV}=token and the cluster's token on every node), or allow an "
            f"open cluster on this node: `sandlot fleet start --insecure-cluster` "
            f"({clusterauth.INSECURE_ENV}=1 where Ray starts)"
        )
    return facts
