"""MCP tools, durably: servers an agent declares, their tools offered next to ``@tool``
functions, every call a recorded step (:mod:`runtime.pipeline.mcpcall` runs them).

- :mod:`runtime.mcp.servers`: ``McpServer.stdio`` / ``McpServer.http``, ``ToolPolicy``, the
  ``DAR_MCP_SERVERS`` and ``DAR_MCP_TOOLS`` settings;
- :mod:`runtime.mcp.client`: the sessions of one worker process, on the official SDK;
- :mod:`runtime.mcp.toolset`: the tool set a run offers, namespaced and recorded.
"""

from runtime.mcp.errors import McpError, McpInDoubt, McpRemoteError, McpUnavailable
from runtime.mcp.servers import McpConfigError, McpServer, ToolPolicy

__all__ = [
    "McpConfigError",
    "McpError",
    "McpInDoubt",
    "McpRemoteError",
    "McpServer",
    "McpUnavailable",
    "ToolPolicy",
]
