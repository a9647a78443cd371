"""MCP tools as steps: the run's tool set, and one call of an MCP tool.

An MCP call is a step with an effect like any other (:mod:`runtime.pipeline.effects`): written
``STARTED`` before the call, its key sent as the idempotency key in the request's ``_meta``,
its result (and ``isError``) recorded. Whether it runs again after a crash comes from the
tool's annotations (``readOnlyHint`` or ``idempotentHint``: yes; destructive or unknown: no,
the run stops for a person, or a configured ``reconcile`` is asked), unless the operator says
otherwise per tool (``DAR_MCP_TOOLS``, or ``McpServer(tools={...})``).

The tool set of an agent-loop run is listed once, before its first model step, and recorded
as a ``TOOLSET`` step: every request of the run offers exactly those tools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from db.records import NewStep, RunStatus, StepKind, StepStatus
from runtime.mcp.client import CallResult, McpClients
from runtime.mcp.errors import McpError, McpInDoubt, McpRemoteError, McpUnavailable
from runtime.mcp.servers import McpConfigError, McpServer, Reconcile, ToolPolicy
from runtime.mcp.toolset import TOOLSET_KEY, OfferedTool, Toolset, idempotent, offered, same_schema
from runtime.pipeline.checkpoint import Record, StepResult, Task
from runtime.tools import ToolContext, ToolInputError

log = logging.getLogger(__name__)


class McpToolError(McpError):
    """The MCP tool answered with ``isError``: its result is an error."""


def clients(task: Task) -> McpClients:
    if task.services.mcp is None:
        raise McpUnavailable("this executor was built without MCP clients (Driver(mcp=...))")
    return task.services.mcp


# -- the tool set ---------------------------------------------------------------------------


def recorded_toolset(task: Task) -> Toolset | None:
    row = task.look_up(TOOLSET_KEY).row
    return Toolset.from_json(row.response) if row is not None else None


def list_toolset(task: Task, servers: list[McpServer], seq: int) -> Record | StepResult:
    """List every server's tools, the run's tool set from now on: its row, for the advance to
    record (the agent loop's ``ListToolset``). A server that cannot be reached is waited for
    on a durable timer (the run holds nothing)."""
    mcp = clients(task)
    taken: set[str] = set()
    tools: list[OfferedTool] = []
    try:
        for server in servers:
            tools.extend(offered(server, mcp.tools(server), taken))
    except McpConfigError as e:  # two servers offer one name: no request could be valid
        return task.finish(RunStatus.FAILED, error=str(e))
    except McpUnavailable as e:
        delay = task.settings.mcp_retry_seconds
        log.warning("run=%s %s; trying again in %gs", task.rid, e, delay)
        return task.schedule(delay, f"{e}; trying again in {delay:g}s")
    toolset = Toolset(tuple(tools))
    row = NewStep(
        seq=seq,
        step_key=TOOLSET_KEY,
        kind=StepKind.TOOLSET,
        status=StepStatus.DONE,
        response=toolset.to_json(),
        attempt=1,
        latency_ms=0,
    )
    log.info(
        "run=%s seq=%d TOOLSET %d MCP tools from %s",
        task.rid,
        row.seq,
        len(tools),
        ", ".join(s.name for s in servers),
    )
    return Record([row])


# -- one call -------------------------------------------------------------------------------


@dataclass(frozen=True)
class McpCall:
    """What the step executor needs to run one MCP tool call."""

    fn: Callable[[ToolContext], CallResult]
    idempotent: bool
    reconcile: Reconcile | None
    timeout_seconds: float
    label: str


def policy_for(mcp: McpClients, server: McpServer, tool: str, name: str) -> ToolPolicy:
    """The code's policy for the tool, under the operator's (``DAR_MCP_TOOLS``)."""
    return (server.policy(tool) or ToolPolicy()).merged(mcp.tool_overrides.get(name))


def validate(tool: OfferedTool, arguments: Mapping[str, Any]) -> None:
    validator = Draft202012Validator(tool.input_schema)
    errors = sorted(validator.iter_errors(dict(arguments)), key=lambda e: list(e.path))
    if errors:
        parts = [f"{'/'.join(str(p) for p in e.path) or 'input'}: {e.message}" for e in errors[:5]]
        raise ToolInputError(f"invalid input for tool {tool.name!r}: " + "; ".join(parts))


def prepare(task: Task, server: McpServer, tool: OfferedTool, arguments: dict[str, Any]) -> McpCall:
    """The call of ``tool`` (as recorded in the run) with ``arguments``."""
    mcp = clients(task)
    policy = policy_for(mcp, server, tool.tool, tool.name)
    rerun = idempotent(tool, policy)
    timeout = policy.timeout_seconds or server.timeout_seconds

    def call(ctx: ToolContext) -> CallResult:
        validate(tool, arguments)
        live = next((t for t in mcp.tools(server) if t.name == tool.tool), None)
        if live is None:
            raise McpRemoteError(
                f"tool {tool.name!r} is no longer offered by {server.where} (it was when this "
                "run started); it was not called"
            )
        if not same_schema(dict(live.input_schema), tool.input_schema):
            raise McpRemoteError(
                f"tool {tool.name!r} of {server.where} changed its input schema since this run "
                "started; it was not called"
            )

        def call() -> CallResult:
            return mcp.call(
                server,
                tool.tool,
                arguments,
                key=ctx.idempotency_key,
                run_id=ctx.run_id,
                timeout_seconds=timeout,
            )

        try:
            return call()
        except McpInDoubt as e:
            if not rerun or e.timed_out:
                raise
            # Idempotent, and its server went away: once more, on a fresh session.
            log.info("run=%s %s; calling it again (idempotent)", task.rid, e)
            return call()

    how = "re-runs after a crash" if rerun else "not re-run after a crash"
    return McpCall(
        fn=call,
        idempotent=rerun,
        reconcile=policy.reconcile,
        timeout_seconds=timeout,
        label=f"MCP tool {tool.name!r} ({how})",
    )


def error_text(e: Exception) -> str:
    """An MCP failure as the model reads it in its tool result."""
    if isinstance(e, ToolInputError | McpError):  # their messages say what happened
        return f"error: {e}"
    return f"error: {type(e).__name__}: {e}"
