"""Engines run VMs for the core: ``base`` is the interface, ``qemu`` the QEMU engine,
``gvisor`` the gVisor one (runsc).

Engines are found by name. ``register`` adds one (a second engine, gVisor, plugs
in here; the tests register a fake one that runs no VM).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidArgument
from .base import Engine

Factory = Callable[[Path], Engine]


def _qemu(home: Path) -> Engine:
    from .qemu import QemuEngine

    return QemuEngine(home)


def _gvisor(home: Path) -> Engine:
    from .gvisor import GvisorEngine

    return GvisorEngine(home)


_FACTORIES: dict[str, Factory] = {"qemu": _qemu, "gvisor": _gvisor}


def register(name: str, factory: Factory) -> None:
    """Make ``engine=name`` available to boxes, made by ``factory(home)``."""
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def engine_for(name: str, home: Path) -> Engine:
    """The engine called ``name`` for ``home`` (a new instance: callers cache it)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise InvalidArgument(f"engine must be one of {', '.join(_FACTORIES)}, not {name!r}")
    return factory(home)
