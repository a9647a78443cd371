"""What can go wrong talking to an MCP server, sorted by what it means for the step."""

from __future__ import annotations

from db.errors import DarError
from runtime.tools import OutcomeUnknown


class McpError(DarError):
    """An MCP server failed."""


class McpUnavailable(McpError):
    """The MCP server could not be started or reached: the call was never sent."""


class McpRemoteError(McpError):
    """The MCP server answered the call with an error (a JSON-RPC error, or an HTTP status
    that says the call was refused): it did not run."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class McpInDoubt(McpError, OutcomeUnknown):
    """The call was sent and no answer came back (the server died, the call timed out, or the
    server failed with HTTP 5xx): its effect may or may not have happened. The step executor
    treats it as a crash at that point (:mod:`runtime.pipeline.effects`, rule 4)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
