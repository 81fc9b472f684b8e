"""``sandlot completion [bash|zsh|fish]``: the script that has a shell complete sandlot.

The script is click's, as typer ships it: at each Tab it runs ``sandlot`` with
``$_SANDLOT_COMPLETE`` set and the words typed so far in the environment, and the
command line answers with what may follow (``main`` loads every command for it).
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from typer._completion_classes import completion_init
from typer._completion_shared import get_completion_script

from .common import app, fail
from .table import COMPLETE_VAR

SHELLS = ("bash", "zsh", "fish")

# typer registers its shells' completion classes only for an app with its own
# --install-completion option, which sandlot leaves out for this command
completion_init()


@app.command()
def completion(
    shell: Annotated[str | None, typer.Argument(help="bash, zsh or fish (default: that of $SHELL).")] = None,
) -> None:
    """Print the script that has SHELL complete sandlot's commands, subcommands and options.

    bash:  sandlot completion bash > ~/.local/share/bash-completion/completions/sandlot
    zsh:   echo 'eval "$(sandlot completion zsh)"' >> ~/.zshrc    (after its compinit)
    fish:  sandlot completion fish > ~/.config/fish/completions/sandlot.fish

    A new shell completes then: sandlot ru<Tab>, sandlot keys <Tab>, sandlot run --<Tab>.
    """
    shell = shell or os.path.basename(os.environ.get("SHELL", ""))
    if shell not in SHELLS:
        raise fail(f"completion is for {', '.join(SHELLS)}: sandlot completion {'|'.join(SHELLS)}", 2)
    print(get_completion_script(prog_name="sandlot", complete_var=COMPLETE_VAR, shell=shell))
