"""The engine: replay, guard, driver, model clients, tools and agents.

It imports no Flask and no Celery: the same driver runs under a Celery task, a test, or a
plain loop.
"""

from runtime.agents import Agent, AgentRegistry
from runtime.driver import Driver, Outcome, StepResult
from runtime.mcp import McpServer, ToolPolicy
from runtime.tools import Tool, ToolContext, tool

__all__ = [
    "Agent",
    "AgentRegistry",
    "Driver",
    "McpServer",
    "Outcome",
    "StepResult",
    "Tool",
    "ToolContext",
    "ToolPolicy",
    "tool",
]
