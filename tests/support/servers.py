"""HTTP(S) servers the tests start on the host's 127.0.0.1 (the only address test traffic goes to)."""

from __future__ import annotations

import http.server
import ssl
import threading


class LocalServer:
    """``handler`` served on 127.0.0.1 on a free port, in threads; TLS with ``context``."""

    def __init__(
        self, handler: type[http.server.BaseHTTPRequestHandler], context: ssl.SSLContext | None
    ) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if context is not None:
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass
