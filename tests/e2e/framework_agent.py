"""For the frameworks' end-to-end tests, loaded by real worker processes (the shipped gevent
pool). Models talk to the test's fakes: the fake Messages API (``DAR_TEST_FAKE_URL``) for
Pydantic AI's Anthropic model, the fake OpenAI API (``DAR_TEST_OPENAI_URL``) for the Agents
SDK. Tools write what they did to ``DAR_TEST_TOOL_LEDGER``; the MCP servers are the counting
server over stdio, ledger ``DAR_TEST_MCP_LEDGER``.

- ``fw-e2e`` (Pydantic AI): a slow idempotent function tool ``pack``.
- ``fw-mcp`` (Pydantic AI): a function tool ``lookup`` and the MCP toolset ``notes``.
- ``fw-approve`` (Pydantic AI): ``refund``, which needs approval.
- ``oa-e2e`` (OpenAI Agents SDK): a slow idempotent function tool ``pack`` and the MCP
  server ``notes``.
- ``oa-approve`` (OpenAI Agents SDK): ``refund``, which needs approval.
- ``fw-delegate`` (Pydantic AI) and ``oa-delegate`` (OpenAI Agents SDK): an idempotent tool
  ``draft`` that has a writer agent draft (a model call inside the tool), then is slow.
"""

from __future__ import annotations

import json
import os
import sys
import time

from agents import Agent as SdkAgent
from agents import OpenAIResponsesModel, Runner, function_tool
from agents.mcp import MCPServerStdio
from fastmcp.client.transports import StdioTransport
from openai import AsyncOpenAI
from pydantic_ai import Agent, RunContext
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.providers.anthropic import AnthropicProvider

from runtime import AgentRegistry
from runtime.frameworks import idempotency_key
from runtime.frameworks.openai_agents import idempotent
from runtime.frameworks.pydantic_ai import DarDurability
from tests.mcp.support import COUNTING

DELAY = 4.0


def _note(tool: str, slow: bool) -> None:
    path = os.environ["DAR_TEST_TOOL_LEDGER"]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"tool": tool, "key": idempotency_key(), "pid": os.getpid()}))
        f.write("\n")
    if slow:
        with open(path + ".calling", "w", encoding="utf-8") as f:
            f.write(tool)
        time.sleep(DELAY)


def _pack(order: str) -> str:
    _note("pack", slow=True)
    return f"{order} packed"


def register(registry: AgentRegistry) -> None:
    provider = AnthropicProvider(base_url=os.environ["DAR_TEST_FAKE_URL"], api_key="test")
    model = AnthropicModel("claude-test-model", provider=provider)
    mcp_ledger = os.environ.get("DAR_TEST_MCP_LEDGER", os.devnull)

    agent = Agent(model, name="fw-e2e")

    @agent.tool_plain(metadata={"dar": {"idempotent": True}})
    def pack(order: str) -> str:
        """Pack an order (slowly; safe to repeat with the same key)."""
        return _pack(order)

    registry.register(agent)

    notes = MCPToolset(
        StdioTransport(sys.executable, [COUNTING, "--ledger", mcp_ledger]), id="notes"
    )
    with_mcp = Agent(model, name="fw-mcp", toolsets=[notes])

    @with_mcp.tool_plain
    def lookup(order: str) -> str:
        """Look an order up."""
        _note("lookup", slow=False)
        return f"{order} shipped"

    registry.register(with_mcp)

    approving = Agent(model, name="fw-approve")

    @approving.tool_plain(requires_approval=True)
    def refund(order: str) -> str:
        """Refund an order (an approver decides)."""
        _note("refund", slow=False)
        return f"{order} refunded"

    registry.register(approving)

    sdk_client = AsyncOpenAI(
        base_url=os.environ["DAR_TEST_OPENAI_URL"], api_key="test", max_retries=0
    )

    @function_tool(name_override="refund", needs_approval=True)
    def sdk_refund(order: str) -> str:
        """Refund an order (an approver decides)."""
        _note("refund", slow=False)
        return f"{order} refunded"

    registry.register(
        SdkAgent(
            name="oa-approve",
            instructions="Refund.",
            model=OpenAIResponsesModel("gpt-test", openai_client=sdk_client),
            tools=[sdk_refund],
        )
    )

    client = AsyncOpenAI(base_url=os.environ["DAR_TEST_OPENAI_URL"], api_key="test", max_retries=0)
    sdk_notes = MCPServerStdio(
        params={"command": sys.executable, "args": [COUNTING, "--ledger", mcp_ledger]},
        name="notes",
    )
    registry.register(
        SdkAgent(
            name="oa-e2e",
            instructions="Pack and count.",
            model=OpenAIResponsesModel("gpt-test", openai_client=client),
            tools=[idempotent(function_tool(_pack, name_override="pack"))],
            mcp_servers=[sdk_notes],
        )
    )

    writer = Agent(model, name="fw-writer", capabilities=[DarDurability()])
    delegating = Agent(model, name="fw-delegate")

    @delegating.tool(metadata={"dar": {"idempotent": True}})
    async def draft(ctx: RunContext[None], topic: str) -> str:
        """Have the writer draft a paragraph (then slowly file it; safe to repeat)."""
        result = await writer.run(f"Draft a paragraph on {topic}.", usage=ctx.usage)
        _note("draft", slow=True)
        return result.output

    registry.register(delegating)

    sdk_writer = SdkAgent(
        name="oa-writer",
        instructions="Write.",
        model=OpenAIResponsesModel("gpt-test", openai_client=client),
    )

    @idempotent
    @function_tool(name_override="draft")
    async def sdk_draft(topic: str) -> str:
        """Have the writer draft a paragraph (then slowly file it; safe to repeat)."""
        result = await Runner.run(sdk_writer, f"Draft a paragraph on {topic}.")
        _note("draft", slow=True)
        return str(result.final_output)

    registry.register(
        SdkAgent(
            name="oa-delegate",
            instructions="Delegate.",
            model=OpenAIResponsesModel("gpt-test", openai_client=client),
            tools=[sdk_draft],
        )
    )
