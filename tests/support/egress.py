"""A box's egress log (``<box dir>/egress.log``), as the network tests read it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.waiting import deadline_in

Entry = dict[str, object]


def egress_log(box: Any) -> list[Entry]:
    return _read(_path(box))


def _path(box: Any) -> Path:
    return Path(box.inspect()["paths"]["dir"]) / "egress.log"


def _read(path: Path) -> list[Entry]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def logged(box: Any, until: Callable[[list[Entry]], bool], timeout: float = 30.0) -> list[Entry]:
    """The box's egress log once ``until`` holds of it (as it is at the deadline, else, for
    the caller's assertion to show). The proxy writes a connection's line when it is done
    with the connection, which can be a moment after the client in the box has seen its
    end; a DNS answer's line is written before the answer."""
    path = _path(box)  # asked of the box once, not at each look
    deadline = deadline_in(timeout)
    while True:
        log = _read(path)
        if until(log) or time.monotonic() > deadline:
            return log
        time.sleep(0.05)
