"""A sandlot fleet on Ray: boxes placed by Ray's scheduler over the nodes of a Ray
cluster, each node's boxes in its own home, run by one detached sandlot actor per
node; forks spread over nodes, migration, node loss and replicas.

>>> from sandlot import fleet                                   # doctest: +SKIP
>>> f = fleet.connect("auto")                                   # doctest: +SKIP
>>> box = f.create(rootfs="/srv/rootfs", memory_mib=256)        # doctest: +SKIP
>>> box.exec("uname", "-r").stdout       # a sandlot.Box like any # doctest: +SKIP
>>> kids = f.fork(box, 20, spread=True); kids.per_node          # doctest: +SKIP
>>> f.migrate(box, node=other_node_id)                          # doctest: +SKIP

Importing this package imports Ray (``pip install 'sandlot[fleet]'``); nothing
else in sandlot does. See ``docs/fleet.md``.
"""

from .client import Fleet, Spread, connect
from .placement import CPUS, MEMORY

__all__ = ["CPUS", "MEMORY", "Fleet", "Spread", "connect"]
