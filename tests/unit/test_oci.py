"""Pure logic of images: references, manifests and configs parsed strictly, credentials lookup."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

import sandlot
from sandlot.images import auth
from sandlot.images.oci import ImageConfig, Index, Manifest
from sandlot.images.reference import Reference

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("python", "docker.io/library/python:latest"),
        ("python:3.12-slim", "docker.io/library/python:3.12-slim"),
        ("org/tool", "docker.io/org/tool:latest"),
        ("ghcr.io/org/tool:v1", "ghcr.io/org/tool:v1"),
        ("localhost:5000/a/b/c", "localhost:5000/a/b/c:latest"),
        ("127.0.0.1:5000/team/app:v1", "127.0.0.1:5000/team/app:v1"),
        (f"python@{D}", f"docker.io/library/python@{D}"),
        (f"ghcr.io/org/tool:v1@{D}", f"ghcr.io/org/tool:v1@{D}"),
        ("index.docker.io/library/busybox", "docker.io/library/busybox:latest"),
        ("[::1]:5000/x", "[::1]:5000/x:latest"),
    ],
)
def test_reference_normalisation(text: str, expected: str) -> None:
    assert str(Reference.parse(text)) == expected


def test_reference_hosts() -> None:
    assert Reference.parse("python").api_host == "registry-1.docker.io"
    assert Reference.parse("python").short == "python:latest"
    assert Reference.parse("127.0.0.1:5000/x").is_local_registry()
    assert Reference.parse("[::1]:5000/x").is_local_registry()
    assert Reference.parse("localhost/x").is_local_registry()
    assert not Reference.parse("ghcr.io/x").is_local_registry()


@pytest.mark.parametrize(
    "bad", ["", "UPPER", "a b", "x@sha256:12", "x:t@g", "x:" + "t" * 200, "-x", "x//y", " x"]
)
def test_bad_references(bad: str) -> None:
    with pytest.raises(sandlot.InvalidArgument):
        Reference.parse(bad)


def _manifest(**over: object) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": D, "size": 10},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": D, "size": 5}],
    }
    doc.update(over)
    return json.dumps(doc).encode()


def test_manifest_parsing_is_strict() -> None:
    m = Manifest.parse(_manifest())
    assert len(m.layers) == 1 and m.config.size == 10
    for bad in (
        b"not json",
        b"[]",
        _manifest(schemaVersion=1),
        _manifest(layers="nope"),
        _manifest(
            config={"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "md5:x", "size": 1}
        ),
        _manifest(layers=[{"mediaType": "application/x-weird", "digest": D, "size": 1}]),
        _manifest(layers=[{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": D, "size": -1}]),
        _manifest(
            layers=[
                {
                    "mediaType": "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                    "digest": D,
                    "size": 1,
                }
            ]
        ),
        b"{" + b" " * (5 << 20) + b"}",
    ):
        with pytest.raises(sandlot.ImageError):
            Manifest.parse(bad)


def test_index_platform_selection() -> None:
    entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": D, "size": 1}
    idx = Index.parse(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [
                    {**entry, "platform": {"os": "linux", "architecture": "arm64"}},
                    {
                        **entry,
                        "digest": "sha256:" + "b" * 64,
                        "platform": {"os": "linux", "architecture": "amd64"},
                    },
                ],
            }
        ).encode()
    )
    assert idx.select().digest == "sha256:" + "b" * 64
    with pytest.raises(sandlot.ImageError, match="linux/arm64"):
        idx.select(("windows", "amd64"))


def test_image_config() -> None:
    cfg = ImageConfig.parse(
        json.dumps(
            {
                "architecture": "amd64",
                "config": {
                    "Env": ["A=1", "B=x=y"],
                    "Entrypoint": ["/bin/tini", "--"],
                    "Cmd": ["app"],
                    "WorkingDir": "/srv",
                    "User": "app",
                    "Labels": {"k": "v"},
                },
                "rootfs": {"type": "layers", "diff_ids": [D]},
            }
        ).encode()
    )
    assert cfg.env_dict() == {"A": "1", "B": "x=y"}
    assert cfg.argv() == ["/bin/tini", "--", "app"]
    assert cfg.argv(["sh"]) == ["/bin/tini", "--", "sh"]
    for bad in ({"config": {"Env": ["NOEQUALS"]}}, {"config": {"Cmd": [1]}}, {"config": []}):
        with pytest.raises(sandlot.ImageError):
            ImageConfig.parse(json.dumps(bad).encode())


def test_credentials_from_docker_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw").decode()},
                    "reg.example:5000": {"username": "u", "password": "p"},
                    "tok.example": {"identitytoken": "refresh"},
                }
            }
        )
    )
    assert auth.lookup("docker.io", cfg) == auth.Credentials("hub", "pw")
    assert auth.lookup("reg.example:5000", cfg) == auth.Credentials("u", "p")
    assert auth.lookup("tok.example", cfg).identity_token == "refresh"  # type: ignore[union-attr]
    assert auth.lookup("other.example", cfg) is None
    assert "pw" not in repr(auth.lookup("docker.io", cfg))
    cfg.write_text("{not json")
    with pytest.raises(sandlot.ImageError):
        auth.lookup("docker.io", cfg)


def test_registry_mirrors_are_parsed_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlot.images.registry import RegistryClient, mirrors

    monkeypatch.setenv("SANDLOT_REGISTRY_MIRRORS", " docker.io=127.0.0.1:5000/, ghcr.io=https://m.example ")
    assert mirrors() == {"docker.io": (None, "127.0.0.1:5000"), "ghcr.io": ("https", "m.example")}
    client = RegistryClient(Reference.parse("python:3.12-slim"))
    assert client.host == "127.0.0.1:5000" and client.ref.registry == "docker.io"
    assert RegistryClient(Reference.parse("quay.io/a/b")).host == "quay.io"
    for bad in ("docker.io", "=127.0.0.1:5000", "docker.io=ftp://x", "docker.io=a b", "docker.io=h/path"):
        monkeypatch.setenv("SANDLOT_REGISTRY_MIRRORS", bad)
        with pytest.raises(sandlot.ImageError, match="SANDLOT_REGISTRY_MIRRORS"):
            mirrors()
