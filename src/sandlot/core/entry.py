"""One box as one event loop of this process knows it (``BoxEntry``).

Every handle of a box (``AsyncBox.get`` twice, a server's thousands of
requests) shares that box's entry: its last known record, its lifecycle lock,
its VM handle and its agent session. The controller keeps the entries of its
loop; everything above it holds them only as handles.
"""

from __future__ import annotations

from pathlib import Path

from ..engine.base import VM
from .locks import BoxLock
from .runtime import AGENT_PORTS
from .sessions import LostHandler, Session
from .spec import BoxSpec
from .state import BoxState
from .store import BoxRecord, Stamp


class BoxEntry:
    """One box, as this process (event loop) knows it."""

    def __init__(
        self, rec: BoxRecord, box_dir: Path, on_agent_lost: LostHandler, takes_over: str | None = None
    ) -> None:
        self.id = rec.id
        self.name = rec.name
        self.record = rec
        self.spec = BoxSpec.from_options(rec.options)
        self.lock = BoxLock(box_dir / "lock", rec.name)
        self.vm: VM | None = None
        self.session = Session(rec.id, rec.name, box_dir / "ports", AGENT_PORTS, on_agent_lost, takes_over)
        self.seen: Stamp | None = None  # the store's stamp when the record was last read or written
        self.boot_seconds: float | None = None  # how long the last start took
        self.last_pause: float | None = None  # seconds the last snapshot or suspend paused the VM
        self.removed = False

    def update(self, rec: BoxRecord) -> BoxRecord:
        self.record = rec
        self.spec = BoxSpec.from_options(rec.options)
        return rec

    @property
    def state(self) -> BoxState:
        return BoxState(self.record.state)

    @property
    def hostname(self) -> str:
        return self.spec.hostname or hostname_for(self.name)

    @property
    def dir(self) -> Path:
        return self.lock.path.parent


def hostname_for(name: str) -> str:
    h = "".join(c if c.isalnum() or c in ".-" else "-" for c in name).strip("-.")[:63]
    return h or "sandlot"
