"""The ``sandlot`` command line, in the Docker idiom (docs/cli.md), in the groups of
its help:

    boxes       run | create | start | stop | restart | pause | unpause | rm | ls |
                exec | cp | logs | port | network | inspect | stats | events
    live state  snapshot | snapshots | rollback | fork | suspend | resume | template |
                pool set|ls
    images      pull | images [prune] | rmi | load | import | inspect-image
    server      serve (HTTP, and MCP at /mcp) | keys create|ls|revoke | audit |
                mcp (the tools for models, over MCP stdio)
    fleet       fleet join|nodes|ls|migrate (boxes over the nodes of a Ray cluster)
    host        doctor | setup | rootfs busybox|debian DIR | completion bash|zsh|fish

``-h`` is ``--help``; ``-q`` (``--quiet``) hides the progress of the commands that
draw one (none is drawn off a terminal either). Exit codes: a command's own status
for ``run`` and ``exec``; 125 when sandlot itself failed; 127 when the command does
not exist; 2 for usage errors.
"""

from __future__ import annotations

from .table import COMMANDS, COMPLETE_VAR, GROUPS, MODULES

__all__ = ["COMMANDS", "COMPLETE_VAR", "GROUPS", "MODULES", "main"]


def main() -> None:
    import importlib
    import os
    import sys

    # a completion request names no command (the words are in the environment) and
    # may complete any of them: it loads them all
    completing = COMPLETE_VAR in os.environ
    command = sys.argv[1] if len(sys.argv) > 1 and not completing else ""
    if sys.argv[1:] == ["--version"]:  # typer would load every command to print it
        from ..version import __version__

        print(__version__)
        return
    try:
        if command in ("ls", "exec"):  # their plain forms skip typer (cli/quick.py says why)
            from .quick import run

            code = run(sys.argv[1:])
            if code is not None:
                sys.exit(code)
        module = COMMANDS.get(command)
        for name in [module] if module else MODULES:  # they register on `app`
            importlib.import_module(f".{name}", __name__)
        from .common import app, only

        if module:
            only(app, command)
        # named so also under `python -m sandlot.cli`, in usage lines and for completion scripts
        app(prog_name="sandlot", complete_var=COMPLETE_VAR)
    except KeyboardInterrupt:
        sys.exit(130)
