"""order-desk-sdk: an ordinary OpenAI Agents SDK agent with a handoff, registered as it is.

    OPENAI_API_KEY=... DAR_AGENT_MODULES=examples.openai_agents_agent \\
        dar demo --agent order-desk-sdk --question "Where is order A-7?"

Model calls, the function tool and the handoff are steps of the run (see
docs/frameworks/openai-agents.md). The model is given by name, so the SDK's provider resolves it
(``OPENAI_API_KEY``, ``OPENAI_BASE_URL`` for an OpenAI-compatible server).
"""

from __future__ import annotations

from agents import Agent, function_tool

from runtime import AgentRegistry
from runtime.frameworks.openai_agents import idempotent

ORDERS = {"A-7": "shipped on Monday with DHL", "B-2": "waiting for stock"}


@idempotent  # a read: safe to run again after a crash
@function_tool
def lookup_order(order: str) -> str:
    """The status of an order."""
    return ORDERS.get(order, "unknown order")


def build(model: str = "gpt-4.1-mini") -> Agent[None]:
    writer = Agent(name="reply-writer", instructions="Write a short, friendly reply.", model=model)
    return Agent(
        name="order-desk-sdk",
        instructions="Look the order up, then hand off to reply-writer.",
        model=model,
        tools=[lookup_order],
        handoffs=[writer],
    )


def register(registry: AgentRegistry) -> None:
    registry.register(build())
