"""The table of the command line's commands: the groups of its help, in order, and the
module that registers each command. The lazy loader (``__init__``) and the root help
(``common``) read it; a module of its own, so that ``common`` need not import the
package that imports it."""

from __future__ import annotations

# Each group of the root help, in order, with its commands in order and the module
# that registers each. A command imports its own module and typer converts that one
# command, not every face of the package: what a command does not need costs it
# nothing at start (``sandlot ls`` in tens of milliseconds, not the ~0.3 s all of them
# cost). ``tests/unit/test_cli_lean.py`` checks this table against what the modules
# register; a command missing here still works, through the slow path that imports
# them all. The root help shows the groups in this order whichever module registered
# its commands first (``common.Root``).
GROUPS: dict[str, dict[str, str]] = {
    "Boxes": {
        "run": "boxes", "create": "boxes", "start": "boxes", "stop": "boxes", "restart": "boxes",
        "pause": "boxes", "unpause": "boxes", "rm": "boxes", "ls": "boxes", "exec": "boxes", "cp": "boxes",
        "logs": "boxes", "port": "boxes", "network": "boxes", "inspect": "boxes", "stats": "boxes",
        "events": "events",
    },
    "Live state": {
        "snapshot": "livestate", "snapshots": "livestate", "rollback": "livestate", "diff": "livestate",
        "fork": "livestate", "record": "timeline", "timeline": "timeline", "rewind": "timeline",
        "fork-at": "timeline", "promote": "timeline", "bisect": "timeline",
        "suspend": "livestate", "resume": "livestate", "template": "livestate", "pool": "pools",
        "volume": "volumes", "storage": "storage",
    },
    "Images": {
        "pull": "images", "images": "images", "rmi": "images", "load": "images", "import": "images",
        "inspect-image": "images",
    },
    "Server": {"serve": "server", "keys": "access", "previews": "access", "audit": "access", "mcp": "mcp"},
    "Fleet": {"fleet": "fleet"},
    "Host": {"doctor": "host", "setup": "host", "rootfs": "host", "completion": "completion"},
}  # fmt: skip
COMMANDS = {command: module for commands in GROUPS.values() for command, module in commands.items()}
MODULES = ("access", "boxes", "completion", "events", "fleet", "host", "images", "livestate", "mcp", "pools",
           "server", "storage", "timeline", "volumes")  # fmt: skip
# what a shell's completion script sets when it asks sandlot what may follow (cli/completion.py)
COMPLETE_VAR = "_SANDLOT_COMPLETE"
