"""``sandlot serve``: the library behind HTTP and WebSocket (see docs/server.md).

A front end: it translates requests into calls of the public API (``sandlot.api``)
on the same home as every other sandlot process, so the store stays the one
source of truth and the server keeps nothing a restart could lose.
"""
