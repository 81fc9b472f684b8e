"""Image references, as the distribution spec and Docker spell them.

    python                      -> docker.io/library/python:latest
    python:3.12-slim            -> docker.io/library/python:3.12-slim
    ghcr.io/org/tool@sha256:... -> ghcr.io/org/tool@sha256:...
    127.0.0.1:5000/team/app:v1  -> registry 127.0.0.1:5000

A first component is a registry host when it contains "." or ":" or is
"localhost"; otherwise the reference is on Docker Hub.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidArgument

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$")
_HOST = re.compile(
    r"^(?:localhost|(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?$"
)


def valid_digest(digest: str) -> bool:
    return bool(_DIGEST.match(digest))


@dataclass(frozen=True, slots=True)
class Reference:
    registry: str  # "docker.io", "ghcr.io", "127.0.0.1:5000"
    repository: str  # "library/python", "org/tool"
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        if not isinstance(text, str) or not text or len(text) > 4096 or text != text.strip():
            raise InvalidArgument(f"invalid image reference {text!r}")
        rest = text
        digest = None
        if "@" in rest:
            rest, digest = rest.split("@", 1)
            if not _DIGEST.match(digest):
                raise InvalidArgument(f"invalid digest in image reference {text!r}")
        tag = None
        slash = rest.rfind("/")
        colon = rest.rfind(":")
        if colon > slash:
            rest, tag = rest[:colon], rest[colon + 1 :]
            if not _TAG.match(tag):
                raise InvalidArgument(f"invalid tag {tag!r} in image reference {text!r}")
        first, sep, remainder = rest.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
            registry, repository = first, remainder
            if not _HOST.match(registry):
                raise InvalidArgument(f"invalid registry host {registry!r} in {text!r}")
        else:
            registry, repository = DOCKER_HUB, rest
        if registry in ("index.docker.io", "registry-1.docker.io"):
            registry = DOCKER_HUB
        if registry == DOCKER_HUB and "/" not in repository:
            repository = f"library/{repository}"
        if not _REPOSITORY.match(repository) or len(repository) > 255:
            raise InvalidArgument(
                f"invalid repository name {repository!r} in {text!r} (lowercase, [a-z0-9._-/])"
            )
        if tag is None and digest is None:
            tag = "latest"
        return cls(registry, repository, tag, digest)

    @property
    def api_host(self) -> str:
        """Host to talk to for the registry API."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def name(self) -> str:
        """registry/repository, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        out = self.name
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    @property
    def short(self) -> str:
        """As a user would type it: Docker Hub's prefixes dropped."""
        name = self.name.removeprefix(f"{DOCKER_HUB}/").removeprefix("library/")
        if self.tag:
            name += f":{self.tag}"
        if self.digest:
            name += f"@{self.digest}"
        return name

    def is_local_registry(self) -> bool:
        return is_loopback(self.registry)


def is_loopback(registry: str) -> bool:
    """Whether ``host[:port]`` names this machine's loopback (plain HTTP is allowed there)."""
    host = registry[: registry.index("]") + 1] if registry.startswith("[") else registry.rsplit(":", 1)[0]
    return host in ("localhost", "[::1]") or host.startswith("127.")
