"""The ``sandlot`` command run in this process (typer's runner), for the fast tier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typer.testing import CliRunner

from sandlot.cli import access as _access  # noqa: F401 - the commands it adds to the app
from sandlot.cli.common import app


def in_process() -> Callable[..., Any]:
    """``cli(*args, code=0)``: run ``sandlot ARGS`` and check its exit status; the result
    (``.stdout``, ``.stderr``, ``.output``)."""
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> Any:
        r = runner.invoke(app, list(args))
        assert r.exit_code == code, (args, r.output)
        return r

    return cli
