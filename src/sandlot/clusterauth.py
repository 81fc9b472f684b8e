"""Who may use a fleet's Ray cluster: its token, its TLS settings, and what a node found
about the cluster it serves. No Ray here: ``sandlot doctor`` and ``sandlot fleet token``
read these without importing it, and the fleet (``fleet/client.py``, ``fleet/node.py``)
builds on them.

Ray (2.52 and later) authenticates every gRPC call and the dashboard with one token
when ``RAY_AUTH_MODE=token``. A process finds the token as Ray's own loader does, first
found wins: ``RAY_AUTH_TOKEN``, then the file ``RAY_AUTH_TOKEN_PATH`` names (an error if
it names none), then ``~/.ray/auth_token``. ``find_token`` is that order, so a driver, a
node and ``sandlot fleet token`` agree with Ray on which token is meant.

A node actor checks that its cluster refuses calls without the token before it serves
a box (a cluster open to anyone who reaches its ports hands root on every node to
them), unless its operator allowed an open cluster (``INSECURE_ENV`` in the
environment where Ray started: ``sandlot fleet start --insecure-cluster``). What it
found is written to its home (``TRUST_FILE``) for ``sandlot doctor``.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidArgument

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
INSECURE_ENV = "SANDLOT_FLEET_INSECURE_CLUSTER"  # "1" where Ray starts: this node may serve an open cluster
TLS_ENV = "RAY_USE_TLS"
TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
TRUST_FILE = Path("fleet") / "trust.json"  # under a node's home: what its actor found of its cluster
TOKEN_BYTES = 32  # 256 bits, as Ray's own generator makes


@dataclass(frozen=True, slots=True)
class Token:
    """A cluster token and where it was found (``RAY_AUTH_TOKEN``, or a file's path)."""

    value: str
    source: str

    @property
    def path(self) -> Path | None:
        return None if self.source == TOKEN_ENV else Path(self.source)


def default_token_path() -> Path:
    """Where Ray keeps a token when nothing names another: ``~/.ray/auth_token``."""
    return Path.home() / ".ray" / "auth_token"


def token_file(environ: Mapping[str, str] | None = None) -> Path:
    """The file a token is read from and written to: ``RAY_AUTH_TOKEN_PATH``'s, else Ray's default."""
    env = os.environ if environ is None else environ
    named = env.get(TOKEN_PATH_ENV)
    return Path(named) if named else default_token_path()


def find_token(environ: Mapping[str, str] | None = None, *, strict: bool = True) -> Token | None:
    """The token this process would send, found as Ray finds it; None if there is none.
    ``RAY_AUTH_TOKEN_PATH`` naming a file that is missing or empty is an error, as for Ray
    (``strict=False``: None, for a caller about to make the token there)."""
    env = os.environ if environ is None else environ
    given = (env.get(TOKEN_ENV) or "").strip()
    if given:
        return Token(given, TOKEN_ENV)
    named = env.get(TOKEN_PATH_ENV)
    path = Path(named) if named else default_token_path()
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        value = ""
    except OSError as exc:
        raise InvalidArgument(f"cannot read the cluster token at {path}: {exc}") from None
    if not value:
        if named and strict:
            raise InvalidArgument(f"{TOKEN_PATH_ENV} names {path}, which is missing or empty")
        return None
    return Token(value, str(path))


def make_token(path: Path | None = None) -> Token:
    """A new random token written to ``path`` (``token_file()`` by default), readable by its
    owner only: whoever reads it owns the cluster. An existing file is never overwritten."""
    path = path or token_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_hex(TOKEN_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidArgument(f"{path} exists already: a cluster's token is never replaced here") from None
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return Token(value, str(path))


def loose_mode(path: Path) -> str | None:
    """Why a token file is readable by others than its owner (None if it is not)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return f"{path} is mode {mode:04o}: others may read the cluster's token (chmod 600 it)"
    return None


def auth_mode(environ: Mapping[str, str] | None = None) -> str | None:
    """``RAY_AUTH_MODE`` as set ("token", "disabled"), or None when unset."""
    env = os.environ if environ is None else environ
    value = env.get(AUTH_MODE_ENV)
    return value.strip().lower() if value else None


def insecure_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this node's operator allowed it to serve a cluster without authentication."""
    env = os.environ if environ is None else environ
    return env.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def tls_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Whether Ray's gRPC runs over TLS here, and the files it uses (a missing one named)."""
    env = os.environ if environ is None else environ
    on = env.get(TLS_ENV, "0").strip().lower() in ("1", "true")
    files = {name: env.get(name) for name in TLS_FILES}
    missing = [f"{n}={p}" if p else n for n, p in files.items() if not p or not Path(p).is_file()]
    return {"on": on, "files": files, "missing": missing if on else []}


def record_trust(home: Path, found: Mapping[str, Any]) -> None:
    """What a node actor found of its cluster, for ``sandlot doctor`` (``read_trust``)."""
    path = home / TRUST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**found, "at": time.time()}, indent=1))
    os.replace(tmp, path)


def read_trust(home: Path) -> dict[str, Any] | None:
    """The last node actor's findings in this home, if one ever ran here."""
    try:
        found: dict[str, Any] = json.loads((home / TRUST_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return found


def report(home: Path, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fleet's security facts of this host and home for ``sandlot doctor``: the token
    this user's processes would send, the TLS settings here, whether an open cluster is
    allowed, and what this home's node actor last found of its cluster."""
    out: dict[str, Any] = {"auth_mode": auth_mode(environ), "insecure_allowed": insecure_allowed(environ)}
    try:
        token = find_token(environ)
        out["token"] = None if token is None else {"source": token.source}
        if token is not None and token.path is not None:
            out["token"]["loose"] = loose_mode(token.path)
    except InvalidArgument as exc:
        out["token"] = {"error": str(exc)}
    out["tls"] = tls_settings(environ)
    out["node"] = read_trust(home)
    return out
