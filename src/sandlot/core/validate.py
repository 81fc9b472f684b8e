"""Checks of user input shared by every front end: each raises ``InvalidArgument``
naming what is wrong, before anything is changed."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidArgument

_ENV_NAME = re.compile(r"^[^=\0]+$")
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?$")


def guest_path(path: str | os.PathLike[str]) -> str:
    """A guest path: absolute, no NUL bytes, shorter than PATH_MAX."""
    p = os.fspath(path)
    if not isinstance(p, str):
        raise InvalidArgument(f"guest path must be text, not {type(p).__name__}")
    if not p.startswith("/"):
        raise InvalidArgument(f"guest path must be absolute: {p!r}")
    if "\0" in p:
        raise InvalidArgument("guest path contains a NUL byte")
    if len(p.encode()) >= 4096:
        raise InvalidArgument("guest path is longer than 4095 bytes")
    return p


def positive(name: str, value: Any, *, integer: bool = False) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        raise InvalidArgument(f"{name} must be a {'whole ' if integer else ''}number, not {value!r}")
    if value <= 0:
        raise InvalidArgument(f"{name} must be positive, not {value!r}")


def check_env(env: Mapping[str, str] | None, what: str = "env") -> dict[str, str]:
    """Environment variables, checked (``what``: the field's name, for the error)."""
    if env is not None and not isinstance(env, Mapping):
        raise InvalidArgument(f"{what} must be a mapping of names to values, not {type(env).__name__}")
    out: dict[str, str] = {}
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise InvalidArgument(f"invalid environment variable name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise InvalidArgument(f"environment value of {k} must be a string without NUL bytes")
        out[k] = v
    return out


def check_user(user: str | None) -> str | None:
    if user is None:
        return None
    if not isinstance(user, str) or not _USER.match(user):
        raise InvalidArgument(f"user must be 'name', 'uid', 'name:group' or 'uid:gid', not {user!r}")
    return user


def argv(args: Sequence[Any]) -> tuple[str, ...]:
    """A command line: at least a program name, strings (or paths) without NUL bytes."""
    if not args:
        raise InvalidArgument("a command needs at least a program name")
    out = []
    for a in args:
        if isinstance(a, os.PathLike):
            a = os.fspath(a)
        if not isinstance(a, str):
            raise InvalidArgument(f"command arguments must be strings, not {type(a).__name__}: {a!r}")
        if "\0" in a:
            raise InvalidArgument("command argument contains a NUL byte")
        out.append(a)
    if not out[0]:
        raise InvalidArgument("empty program name")
    return tuple(out)


MOST_AT_ONCE = 256  # boxes one fork or one start of a snapshot makes, on every transport


def count(n: Any, *, most: int = MOST_AT_ONCE) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise InvalidArgument(f"n must be a whole number in 1..{most}, not {n!r}")
    return n


# -- the command line's KEY=VALUE flags -----------------------------------------------------


def _pairs(items: list[str] | None, alone: Callable[[str], str]) -> dict[str, str]:
    """``KEY=VALUE`` flags as a mapping; ``alone`` gives the value of a ``KEY`` without one."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        out[key] = value if sep else alone(item)
    return out


def env_pairs(items: list[str] | None) -> dict[str, str]:
    """``-e KEY=VALUE``; ``-e NAME`` passes this process's value, as Docker does."""
    return _pairs(items, lambda name: os.environ.get(name, ""))


def label_pairs(items: list[str] | None) -> dict[str, str]:
    """``--label KEY=VALUE`` flags as a mapping."""

    def refused(item: str) -> str:
        raise InvalidArgument(f"--label needs KEY=VALUE, got {item!r}")

    return _pairs(items, refused)
