"""Framework agents for the real-client benchmarks (``DAR_AGENT_MODULES=bench.real_agents``):
``bench-pai``, a Pydantic AI agent on Claude (its provider finds the fake through
``ANTHROPIC_BASE_URL``), and ``bench-oai``, an OpenAI Agents SDK agent (the Responses API,
through ``OPENAI_BASE_URL``). One model call each, answered with text; no tools, so the
figures are the model calls' and the runtime's, not a tool's."""

from __future__ import annotations

from typing import Any

from runtime import AgentRegistry


def pydantic_ai_agent() -> Any:
    from pydantic_ai import Agent

    return Agent("anthropic:claude-sonnet-4-5", name="bench-pai", instructions="Answer briefly.")


def openai_agents_agent() -> Any:
    from agents import Agent

    return Agent(name="bench-oai", instructions="Answer briefly.", model="gpt-4.1-mini")


def register(registry: AgentRegistry) -> None:
    registry.register(pydantic_ai_agent())
    registry.register(openai_agents_agent())
