"""For the frameworks' end-to-end test, loaded by real worker processes: a Pydantic AI agent
whose Anthropic model talks to the test's fake Messages API (``DAR_TEST_FAKE_URL``), with a
slow idempotent function tool (its calls in ``DAR_TEST_TOOL_LEDGER``)."""

from __future__ import annotations

import json
import os
import time

from pydantic_ai import Agent
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.providers.anthropic import AnthropicProvider

from runtime import AgentRegistry
from runtime.frameworks import idempotency_key

DELAY = 4.0


def register(registry: AgentRegistry) -> None:
    provider = AnthropicProvider(base_url=os.environ["DAR_TEST_FAKE_URL"], api_key="test")
    agent = Agent(AnthropicModel("claude-test-model", provider=provider), name="fw-e2e")

    @agent.tool_plain(metadata={"dar": {"idempotent": True}})
    def pack(order: str) -> str:
        """Pack an order (slowly; safe to repeat with the same key)."""
        path = os.environ["DAR_TEST_TOOL_LEDGER"]
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"tool": "pack", "key": idempotency_key(), "pid": os.getpid()}))
            f.write("\n")
        with open(path + ".calling", "w", encoding="utf-8") as f:
            f.write("pack")
        time.sleep(DELAY)
        return f"{order} packed"

    registry.register(agent)
