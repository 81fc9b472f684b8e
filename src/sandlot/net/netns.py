"""Entering a network namespace from a thread (``setns``), which the standard library
has no call for. Shared by the gVisor engine (``engine.gvisor.network``) and the box's
forwarder (``forwarder``), which starts with every sandbox: the standard library only."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter(fd: int, what: str) -> None:
    """Move the calling thread into the network namespace ``fd`` refers to (its other
    threads stay where they are). OSError names ``what``."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into {what}: {os.strerror(err)}")
