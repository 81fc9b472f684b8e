"""Box to box: how the egress proxy of one box reaches a port of another.

A ``box:NAME:PORT`` rule lets a box connect to that port of box NAME. The bytes
go through NAME's agent (its relay, as ``box.connect(port)`` does), so NAME needs
no network card and its service may listen on its loopback only. Holding an
agent session takes a sandlot process with the core loaded; the proxy is one
short process per guest connection, so it asks a helper that does: the home's
*box link* (``python -m sandlot.api.boxlink``), one per home, listening on a
unix socket under the private runtime directory. The first connection that
needs it starts it; it ends after a minute with nothing to carry. One link holds
one agent session per box it reaches, however many boxes connect to it.

The request is one JSON line, ``{"from": ID, "box": NAME, "port": PORT}``; the
answer one line: ``ok``, after which the socket is the connection; ``denied
REASON`` (the policy or the namespace refuse it); or ``failed REASON`` (the box
or its port could not be reached). The link checks again that ``from``'s policy allows the port and
that both boxes are in one namespace (the proxy's check is not the only one).

``LinkInfo`` is what the launcher writes beside the policy when a box's VM
starts (``egress-link.json``): where the link listens, the box's id, and the
guest addresses sandlot's DNS gives the boxes the policy named then.

Imports nothing heavy: the proxy and the DNS answerer read this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, NamedTuple

from .policy import Denied

LINK_MODULE = "sandlot.api.boxlink"
START_TIMEOUT = 30.0  # the link imports the core first: seconds under TCG on a busy host
ANSWER_TIMEOUT = 30.0  # a box that was asleep is woken first
MAX_LINE = 4096


class LinkInfo(NamedTuple):
    home: str
    box: str  # the id of the box whose egress this is
    socket: str
    python: str
    addresses: dict[str, str]  # box name -> the guest address sandlot's DNS answers for it

    def to_json(self) -> dict[str, Any]:
        return dict(zip(FIELDS, self, strict=True))

    @classmethod
    def read(cls, path: Path) -> LinkInfo | None:
        """The file a launcher wrote; None if it is missing or damaged (a box started by
        an older sandlot: it reaches no other box)."""
        try:
            data = json.loads(path.read_text())
            info = cls(**{f: data[f] for f in FIELDS})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(info.addresses, dict):
            return None
        return info


FIELDS = tuple(LinkInfo.__annotations__)


def link_socket(runtime: Path, home: Path) -> Path:
    """Where a home's box link listens: a short path (unix sockets allow 107 bytes)
    in the private runtime directory, one per home."""
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:16]
    return runtime / f"boxlink-{digest}.sock"


def open_box_port(info: LinkInfo, box: str, port: int) -> socket.socket:
    """A connection to ``port`` of box ``box`` through the home's link, started if
    none runs. Denied with the link's reason if it refuses; ConnectionError if the
    box or its port cannot be reached."""
    sock = _connect(info)
    try:
        sock.settimeout(ANSWER_TIMEOUT)
        sock.sendall(json.dumps({"from": info.box, "box": box, "port": port}).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(1)  # byte by byte: what follows the line is the connection's
            if not chunk or len(answer) > MAX_LINE:
                raise Denied(f"the box link ended the request for {box}:{port}")
            answer += chunk
    except TimeoutError:
        sock.close()
        raise Denied(f"the box link did not answer for {box}:{port} in {ANSWER_TIMEOUT:.0f}s") from None
    except BaseException:
        sock.close()
        raise
    word, _, reason = answer.decode(errors="replace").strip().partition(" ")
    if word == "ok":
        sock.settimeout(None)
        return sock
    sock.close()
    if word == "failed":
        raise ConnectionError(reason)
    raise Denied(reason or "the box link refused")


def _connect(info: LinkInfo) -> socket.socket:
    deadline = time.monotonic() + START_TIMEOUT
    started = False
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(info.socket)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if not started:
            _start(info)
            started = True
        if time.monotonic() > deadline:
            raise Denied(f"the box link did not start within {START_TIMEOUT:.0f}s")
        time.sleep(0.05)


def _start(info: LinkInfo) -> None:
    """Start the home's link, detached; if another is starting, it exits at once."""
    import subprocess  # only connections to boxes pay for it

    with contextlib.suppress(OSError):  # backgrounded by a shell, as config.spawn_unless_locked says why
        subprocess.run(
            ["/bin/sh", "-c", '"$0" -m "$@" &', info.python, LINK_MODULE, info.home, info.socket],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True, cwd="/", env={**os.environ}, check=False,
        )  # fmt: skip
