"""Certificates for the tests' and benchmarks' own HTTPS servers: sandlot's own
CA helpers (EC P-256 with ``cryptography``), made reachable from here."""

from __future__ import annotations

from sandlot.net.secrets import make_ca, make_leaf

__all__ = ["make_ca", "make_leaf"]
