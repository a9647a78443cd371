"""A plain Pydantic AI agent (a function tool, no MCP), in a module of ``DAR_AGENT_MODULES``
as a user writes it: ``register(registry)`` hands it over as it is. Its Anthropic model talks
to ``DAR_TEST_ANTHROPIC_URL`` (the fake Messages API of the test that started the process)."""

from __future__ import annotations

import os

from pydantic_ai import Agent
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.providers.anthropic import AnthropicProvider

from runtime import AgentRegistry

MODEL = "claude-test-model"


def register(registry: AgentRegistry) -> None:
    provider = AnthropicProvider(base_url=os.environ["DAR_TEST_ANTHROPIC_URL"], api_key="test")
    agent = Agent(AnthropicModel(MODEL, provider=provider), name="plain", instructions="Be terse.")

    @agent.tool_plain
    def lookup(order: str) -> str:
        """Look an order up."""
        return f"{order} shipped"

    registry.register(agent)
