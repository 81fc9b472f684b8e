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


def main() -> None:
    import sys

    from . import access, boxes, fleet, host, images, livestate, mcp, pools, server  # noqa: F401 - they register on `app`
    from .common import app

    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
