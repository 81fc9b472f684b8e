"""``sandlot serve``'s application served in this process, over the fake engine: the
real routes, middleware, keys and WebSockets on a real socket of 127.0.0.1 (uvicorn
in a thread of its own), with boxes that are objects in this process. The fast tier
drives it with the real HTTP backend, the MCP SDK client and the tools; the same
paths against a real ``sandlot serve`` process and real VMs are in ``tests/vm``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sandlot.api import access
from sandlot.server.app import create_app
from sandlot.server.state import Settings

from tests.support.fake_engine import register
from tests.support.waiting import deadline_in


@dataclass
class InProcess:
    home: Path
    url: str
    api_key: str | None
    content_url: str = ""  # the listener of boxes' content (server/origins.py)

    def key(self, name: str, **options: object) -> str:
        """A new API key of this server's home (``sandlot keys create``)."""
        return access.create_key(name, home=self.home, **options)[1]  # type: ignore[arg-type]


@contextlib.contextmanager
def serving(home: Path, *, auth: bool = True, mcp: bool = True, **settings: Any) -> Iterator[InProcess]:
    """The server's app for ``home`` on a free port of 127.0.0.1, in a thread with its own
    event loop (the fake engine's VMs live on that loop); an admin key unless ``auth`` is
    off. ``settings``: more of ``Settings``'s fields."""
    import uvicorn

    warnings.filterwarnings("ignore", message=".*`websockets` implementation is deprecated.*")
    register()
    key = access.create_key(f"admin-{time.monotonic_ns()}", admin=True, home=home)[1] if auth else None
    # bound here and handed to uvicorn: a port only looked up, then bound by the server,
    # could be taken by another worker's server in between (and its /health answer ours)
    listener, content = socket.socket(), socket.socket()
    listener.bind(("127.0.0.1", 0))
    content.bind(("127.0.0.1", 0))
    port, content_port = listener.getsockname()[1], content.getsockname()[1]
    try:
        app = create_app(Settings(home=home, auth=auth, mcp=mcp, heir=f"test 127.0.0.1:{port}",
                                  content_port=content_port, **settings))  # fmt: skip
    except BaseException:
        listener.close()
        content.close()
        raise
    config = uvicorn.Config(app, log_level="warning", loop="asyncio", ws="websockets", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener, content])),
                              name="sandlot-test-server", daemon=True)  # fmt: skip
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = deadline_in(30)
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not come up")
        time.sleep(0.02)
    try:
        yield InProcess(home, url, key, f"http://127.0.0.1:{content_port}")
    finally:
        server.should_exit = True
        thread.join(15)
        listener.close()
        content.close()
