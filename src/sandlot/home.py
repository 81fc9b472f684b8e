"""Which home a call means: the directory sandlot keeps a host's boxes and state in.

Its own module, and a small one: ``sandlot ls`` resolves the home before anything else,
and the helpers of ``config`` bring hashing, random numbers and archives with them.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """``$SANDLOT_HOME``, else ``$XDG_DATA_HOME/sandlot``, else ``~/.local/share/sandlot``."""
    env = os.environ.get("SANDLOT_HOME")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return (base / "sandlot").absolute()


def home_path(home: str | os.PathLike[str] | None = None) -> Path:
    """The home a call names (``home=``), else the default one, as an absolute path."""
    return Path(home).expanduser().absolute() if home else default_home()
