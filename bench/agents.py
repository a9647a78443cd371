"""The benchmark agent: ``DAR_AGENT_MODULES=bench.agents`` registers ``bench``, with one
tool, ``noop``, that does nothing and returns at once."""

from __future__ import annotations

from runtime.agents import Agent, AgentRegistry
from runtime.tools import tool


@tool(idempotent=True, timeout_seconds=10)
def noop(i: int = 0) -> str:
    """Does nothing and returns "ok" (benchmarks)."""
    return "ok"


def register(registry: AgentRegistry) -> None:
    registry.register(Agent(name="bench", system_prompt="Benchmark agent.", tools=(noop,)))
