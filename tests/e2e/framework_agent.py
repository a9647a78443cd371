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

``DAR_TEST_FRAMEWORKS`` (``pydantic_ai``, ``agents_sdk`` or both, comma-separated; unset:
both) says which agents a process registers: each file's stack imports only the framework
its tests run (every process of a stack imports its agents; importing both frameworks cost
~3.7 s of CPU a process, one of them ~1.5-2.8 s).
"""

import json
import os
import sys
import time

from runtime import AgentRegistry
from runtime.frameworks import idempotency_key

DELAY = 4.0
MCP_START_SECONDS = 30.0
"""How long the frameworks wait for the counting MCP server's session (theirs: 5 s). A Python
process importing the MCP SDK took longer than 5 s to answer on CI's loaded two cores, and
the run failed at its first step: a test of kills, not of a server's start-up time."""


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
    wanted = os.environ.get("DAR_TEST_FRAMEWORKS") or "pydantic_ai,agents_sdk"
    for name in wanted.split(","):
        {"pydantic_ai": _register_pydantic_ai, "agents_sdk": _register_agents_sdk}[name.strip()](
            registry
        )


def _register_pydantic_ai(registry: AgentRegistry) -> None:
    from fastmcp.client.transports import StdioTransport
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.mcp import MCPToolset
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    from runtime.frameworks.pydantic_ai import DarDurability
    from tests.mcp.support import COUNTING

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
        StdioTransport(sys.executable, [COUNTING, "--ledger", mcp_ledger]),
        id="notes",
        init_timeout=MCP_START_SECONDS,
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

    writer = Agent(model, name="fw-writer", capabilities=[DarDurability()])
    delegating = Agent(model, name="fw-delegate")

    @delegating.tool(metadata={"dar": {"idempotent": True}})
    async def draft(ctx: RunContext[None], topic: str) -> str:
        """Have the writer draft a paragraph (then slowly file it; safe to repeat)."""
        result = await writer.run(f"Draft a paragraph on {topic}.", usage=ctx.usage)
        _note("draft", slow=True)
        return result.output

    registry.register(delegating)


def _register_agents_sdk(registry: AgentRegistry) -> None:
    from agents import Agent as SdkAgent
    from agents import OpenAIResponsesModel, Runner, function_tool
    from agents.mcp import MCPServerStdio
    from openai import AsyncOpenAI

    from runtime.frameworks.openai_agents import idempotent
    from tests.mcp.support import COUNTING

    mcp_ledger = os.environ.get("DAR_TEST_MCP_LEDGER", os.devnull)
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
        client_session_timeout_seconds=MCP_START_SECONDS,
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
