"""QMP from synchronous code, for recovery.

Recovery runs inside and outside event loops (a sync API call, an async one,
the CLI), where ``qemu.qmp``'s sync wrapper cannot start a loop of its own; so
this is a few lines of blocking JSON over the socket, under the same file lock
every other QMP client of the VM takes.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from ...config import flock_wait
from ...errors import SavedStateError
from .vm import QMP_LOCK_TIMEOUT


def qmp_sync(
    sock_path: Path, lock_path: Path, commands: list[tuple[str, dict[str, Any] | None]], timeout: float = 5.0
) -> list[Any]:
    """Run QMP commands in order; their return values."""
    fd = flock_wait(lock_path, QMP_LOCK_TIMEOUT, "the VM's monitor")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(sock_path))
            f = s.makefile("rwb")

            def call(cmd: str, args: dict[str, Any] | None) -> Any:
                msg: dict[str, Any] = {"execute": cmd}
                if args:
                    msg["arguments"] = args
                f.write(json.dumps(msg).encode() + b"\n")
                f.flush()
                while True:
                    line = f.readline()
                    if not line:
                        raise SavedStateError("QMP closed")
                    reply = json.loads(line)
                    if "return" in reply:
                        return reply["return"]
                    if "error" in reply:
                        raise SavedStateError(reply["error"].get("desc", "QMP error"))

            json.loads(f.readline())  # greeting
            call("qmp_capabilities", None)
            return [call(c, a) for c, a in commands]
    finally:
        os.close(fd)
