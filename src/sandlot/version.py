"""The version of sandlot (one place: the package, the CLI and the server read it)."""

__version__ = "0.1.0"
