"""Registry credentials: given in the API, or found where Docker keeps them.

Lookup order for a registry: an explicit ``(username, password)``; then
``$DOCKER_CONFIG/config.json`` (default ``~/.docker/config.json``): a
``credHelpers`` entry for the host, then ``auths`` (``auth`` as base64
``user:password``, or ``username``/``password``, or ``identitytoken``), then
``credsStore``. Helpers are the ``docker-credential-<name>`` programs Docker uses.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import ImageError
from .reference import DOCKER_HUB

DOCKER_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")


@dataclass(frozen=True, slots=True)
class Credentials:
    username: str
    password: str
    identity_token: str | None = None  # an OAuth refresh token, used instead of the password

    def __repr__(self) -> str:  # never print secrets
        return f"Credentials(username={self.username!r}, password=***)"


def docker_config_path() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def _keys(registry: str) -> tuple[str, ...]:
    if registry == DOCKER_HUB:
        return DOCKER_HUB_KEYS
    return (registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/")


def _helper(name: str, server: str) -> Credentials | None:
    exe = shutil.which(f"docker-credential-{name}")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "get"], input=server, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageError(f"credential helper docker-credential-{name} failed: {exc}") from exc
    if proc.returncode != 0:
        return None  # "credentials not found"
    try:
        doc = json.loads(proc.stdout)
        user, secret = doc["Username"], doc["Secret"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"credential helper docker-credential-{name} gave a malformed answer") from exc
    if user == "<token>":
        return Credentials("", "", identity_token=secret)
    return Credentials(user, secret)


def lookup(registry: str, config_path: Path | None = None) -> Credentials | None:
    path = config_path or docker_config_path()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ImageError(f"cannot read Docker credentials from {path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise ImageError(f"{path} is not a JSON object")
    keys = _keys(registry)
    helpers = doc.get("credHelpers") or {}
    for key in keys:
        if isinstance(helpers, dict) and key in helpers:
            creds = _helper(str(helpers[key]), keys[0])
            if creds:
                return creds
    auths = doc.get("auths") or {}
    for key in keys:
        entry = auths.get(key) if isinstance(auths, dict) else None
        if not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            return Credentials(str(entry.get("username", "")), "", identity_token=str(entry["identitytoken"]))
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError) as exc:
                raise ImageError(f"the auth entry for {key} in {path} is not base64 user:password") from exc
            return Credentials(user, password)
        if entry.get("username"):
            return Credentials(str(entry["username"]), str(entry.get("password", "")))
    store = doc.get("credsStore")
    if isinstance(store, str) and store:
        return _helper(store, keys[0])
    return None
