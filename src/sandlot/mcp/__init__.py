"""sandlot as an MCP server (the official ``mcp`` SDK): the tools of ``sandlot.tools``
over stdio (``sandlot mcp``: this home's boxes) and over streamable HTTP, mounted
at ``/mcp`` of ``sandlot serve`` behind its API keys. See docs/mcp.md.

The SDK is an optional dependency (``pip install 'sandlot[mcp]'``); nothing here is
imported by ``import sandlot``."""
