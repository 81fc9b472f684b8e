"""The ``sandlot`` command line, in the Docker idiom.

    sandlot doctor | setup | rootfs busybox|debian DIR          the host
    sandlot pull | images | rmi | load | import | inspect-image  images
    sandlot run | create | start | stop | restart | pause | unpause | rm |
            ls | exec | cp | logs | inspect | stats              boxes
    sandlot snapshot | snapshots | rollback | fork | suspend |
            resume | template                                  live state
    sandlot pool set|ls                                        warm pools of templates
    sandlot serve                                              the HTTP server (and MCP at /mcp)
    sandlot mcp                                                the tools for models, over MCP stdio
    sandlot keys create|ls|revoke, audit                       its API keys, its audit trail
    sandlot fleet join|nodes|ls|migrate                        boxes over the nodes of a Ray cluster

Exit codes: a command's own status for ``run`` and ``exec``; 125 when sandlot
itself failed; 127 when the command does not exist; 2 for usage errors.
"""

from __future__ import annotations

# The module that registers each command. A command imports its own module and
# typer converts that one command, not every face of the package: what a command
# does not need costs it nothing at start (``sandlot ls`` in tens of milliseconds,
# not the ~0.3 s all of them cost). ``tests/unit/test_cli_lean.py`` checks this table
# against what the modules register; a command missing here still works, through
# the slow path that imports them all.
COMMANDS = {
    "audit": "access", "keys": "access",
    "run": "boxes", "create": "boxes", "start": "boxes", "stop": "boxes", "restart": "boxes",
    "pause": "boxes", "unpause": "boxes", "rm": "boxes", "ls": "boxes", "exec": "boxes", "cp": "boxes",
    "logs": "boxes", "port": "boxes", "network": "boxes", "inspect": "boxes", "stats": "boxes",
    "fleet": "fleet",
    "doctor": "host", "setup": "host", "rootfs": "host",
    "pull": "images", "rmi": "images", "load": "images", "import": "images", "inspect-image": "images",
    "images": "images",
    "snapshot": "livestate", "snapshots": "livestate", "rollback": "livestate", "fork": "livestate",
    "suspend": "livestate", "resume": "livestate", "template": "livestate",
    "mcp": "mcp",
    "pool": "pools",
    "serve": "server",
}  # fmt: skip
MODULES = ("access", "boxes", "fleet", "host", "images", "livestate", "mcp", "pools", "server")


def main() -> None:
    import importlib
    import sys

    command = sys.argv[1] if len(sys.argv) > 1 else ""
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
        app()
    except KeyboardInterrupt:
        sys.exit(130)
