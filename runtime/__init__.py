"""The engine: replay, guard, driver, model clients, tools and agents.

It imports no Flask and no Celery: the same driver runs under a Celery task, a test, or a
plain loop. The names below are imported on first use, so that a light module of this
package (:mod:`runtime.client`, used by ``dar``) loads without SQLAlchemy or the SDKs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.agents import Agent, AgentRegistry, Subagent
    from runtime.engine.driver import Driver, Outcome, StepResult
    from runtime.mcp import McpServer, ToolPolicy
    from runtime.pipeline.usage import record_usage
    from runtime.tools import Tool, ToolContext, tool

_HOME = {
    "Agent": "runtime.agents",
    "AgentRegistry": "runtime.agents",
    "Subagent": "runtime.agents",
    "Driver": "runtime.engine.driver",
    "Outcome": "runtime.engine.driver",
    "StepResult": "runtime.engine.driver",
    "McpServer": "runtime.mcp",
    "ToolPolicy": "runtime.mcp",
    "Tool": "runtime.tools",
    "ToolContext": "runtime.tools",
    "tool": "runtime.tools",
    "record_usage": "runtime.pipeline.usage",
}

__all__ = [
    "Agent",
    "AgentRegistry",
    "Driver",
    "McpServer",
    "Outcome",
    "StepResult",
    "Subagent",
    "Tool",
    "ToolContext",
    "ToolPolicy",
    "record_usage",
    "tool",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
