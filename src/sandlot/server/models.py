"""The JSON bodies the server accepts (unknown fields refused) and the shapes it answers."""

from __future__ import annotations

import base64
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..api.box import AsyncBox, AsyncSnapshot
from ..api.files import FileInfo
from ..api.process import ExecResult
from ..errors import ExecTimeout, SandlotError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PortIn(Strict):
    guest: int = Field(ge=1, le=65535)
    host: int = Field(default=0, ge=0, le=65535)


class SecretIn(Strict):
    name: str
    value: str
    hosts: list[str] = []


class BoxCreate(Strict):
    image: str | None = None
    template: str | None = None
    snapshot: str | None = None
    rootfs: str | None = None  # admin keys only: a host path
    kernel: str | None = None  # admin keys only
    ca_cert: str | None = None  # admin keys only
    name: str | None = None
    env: dict[str, str] | None = None
    workdir: str | None = None
    user: str | None = None
    labels: dict[str, str] | None = None
    memory_mib: int | None = None
    cpus: int | None = None
    disk_size_gb: int | None = None
    network: str | bool | None = None
    allow: list[str] | None = None
    ports: list[PortIn] | None = None
    pids_limit: int | None = None
    hostname: str | None = None
    boot_timeout: float | None = None
    request_timeout: float | None = None
    idle_timeout: float | None = None
    pull: str | None = None
    insecure: bool | None = None
    secrets: list[SecretIn] | None = None
    start: bool = True


class ExecIn(Strict):
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    stdin: str | None = None
    stdin_b64: str | None = None
    timeout: float | None = None


class ExecCall(ExecIn):
    """An exec on the exec channel (``WS /v1/exec``): the REST body, its box and an id
    the answer carries back."""

    id: int = Field(ge=0)
    box: str = Field(min_length=1)


class RunCodeIn(Strict):
    code: str
    language: str = "python"
    context: str | None = None
    timeout: float | None = Field(default=None, gt=0)


class CodeContextIn(Strict):
    language: str = "python"
    cwd: str | None = None
    kernel: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None


class NetworkIn(Strict):
    network: str | bool | None = None
    allow: list[str] | None = None


class SnapshotIn(Strict):
    name: str | None = None


class RollbackIn(Strict):
    snapshot: str


class ForkIn(Strict):
    n: int = Field(default=1, ge=1, le=100)
    name: str | None = None


class SnapshotStartIn(ForkIn):
    """Boxes from a snapshot: how many, their name, and what each may have of its own
    (the rest is the snapshot's: its memory, disk and processes)."""

    env: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    workdir: str | None = None
    user: str | None = None
    idle_timeout: float | None = None
    request_timeout: float | None = None
    network: str | None = None
    allow: list[str] | None = None


class MkdirIn(Strict):
    path: str
    parents: bool = False
    mode: int | None = None
    user: str | None = None


class ChownIn(Strict):
    path: str
    user: str
    follow_symlinks: bool = True


class RenameIn(Strict):
    src: str
    dst: str


class ChmodIn(Strict):
    path: str
    mode: int


def box_json(box: AsyncBox) -> dict[str, Any]:
    rec = box.info
    opts = rec["options"]
    return {
        "id": rec["id"],
        "name": rec["name"],
        "state": box.state,
        "image": rec["image_ref"],
        "labels": rec["labels"],
        "created_at": rec["created_at"],
        "started_at": rec["started_at"],
        "memory_mib": opts.get("memory_mib"),
        "cpus": opts.get("cpus"),
        "disk_size_gb": opts.get("disk_size_gb"),
        "network": opts.get("network"),
        "origin": rec["origin"],
        "reason": rec["reason"],
    }


def snapshot_json(snap: AsyncSnapshot) -> dict[str, Any]:
    return {
        "id": snap.id,
        "name": snap.name,
        "kind": snap.kind,
        "box_id": snap.record.box_id,
        "box_name": snap.box_name,
        "created_at": snap.created_at,
        "size": snap.size,
    }


def file_json(info: FileInfo) -> dict[str, Any]:
    return {
        "path": info.path,
        "name": info.name,
        "type": info.type,
        "size": info.size,
        "mode": info.mode,
        "uid": info.uid,
        "gid": info.gid,
        "mtime": info.mtime.isoformat(),
        "link_target": info.link_target,
    }


def error_json(err: SandlotError) -> dict[str, Any]:
    """The error as every route and stream answers it: ``to_dict()`` plus its class name
    (and the output so far of a command that timed out)."""
    body = {**err.to_dict(), "type": type(err).__name__}
    if isinstance(err, ExecTimeout):
        body["stdout"] = err.stdout.decode("utf-8", "replace")
        body["stderr"] = err.stderr.decode("utf-8", "replace")
    return body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def exec_json(r: ExecResult) -> dict[str, Any]:
    return {
        "argv": list(r.argv),
        "exit_code": r.exit_code,
        "signal": r.signal,
        "oom_killed": r.oom_killed,
        "duration": r.duration,
        "pid": r.pid,
        "stdout": r.stdout,
        "stderr": r.stderr,
        "stdout_b64": b64(r.stdout_bytes),
        "stderr_b64": b64(r.stderr_bytes),
    }
