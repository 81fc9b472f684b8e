"""OpenTelemetry spans for box operations (create, start, stop, exec, snapshot, fork and
the other transitions), where the ``opentelemetry`` package is installed: they go to
whatever tracer provider the application set up (``opentelemetry-sdk`` and an
exporter of its choice). Without the package, or before a provider is set, a span
costs a function call. The package is imported on the first span, never by
``import sandlot``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..version import __version__

_tracer: Any = None
_looked = False


def _get_tracer() -> Any:
    global _tracer, _looked
    if not _looked:
        _looked = True
        try:
            from opentelemetry import trace
        except ImportError:
            return None
        _tracer = trace.get_tracer("sandlot", __version__)
    return _tracer


@contextlib.contextmanager
def span(operation: str, /, **attributes: Any) -> Iterator[None]:
    """A span ``sandlot.<operation>`` around the block, with ``attributes``
    (``sandlot.<key>``; None values left out); an exception ends it with an error status."""
    tracer = _get_tracer()
    if tracer is None:
        yield
        return
    attrs = {f"sandlot.{k}": v for k, v in attributes.items() if v is not None}
    with tracer.start_as_current_span(f"sandlot.{operation}", attributes=attrs):
        yield
