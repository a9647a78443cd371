"""For the MCP end-to-end test, loaded by real worker processes: an agent on the counting
MCP server (``DAR_TEST_MCP_LEDGER``) and a stateless model (``DAR_LLM_FACTORY``) that asks for
a slow destructive call, then a slow read-only one, then ends."""

from __future__ import annotations

import os
import sys
from typing import Any

from db.records import Usage
from runtime import Agent, AgentRegistry, McpServer
from runtime.config import Settings
from runtime.llm.base import LlmRequest, LlmResponse
from tests.mcp.support import COUNTING

DELAY = 4.0


def register(registry: AgentRegistry) -> None:
    ledger = os.environ["DAR_TEST_MCP_LEDGER"]
    registry.register(
        Agent(
            name="mcp-e2e",
            system_prompt="",
            # (a tool made again after its worker was killed answers at once)
            mcp_servers=(
                McpServer.stdio(
                    "notes", [sys.executable, COUNTING, "--ledger", ledger, "--delay-once"]
                ),
            ),
        )
    )


class TwoCalls:
    """Decides from the conversation alone, so any worker gives the same answer."""

    def send(self, request: LlmRequest) -> LlmResponse:
        done = {
            b["tool_use_id"]
            for m in request.messages
            if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"]
            if b.get("type") == "tool_result"
        }
        content: list[dict[str, Any]]
        if "toolu_add" not in done:
            use = ("toolu_add", "notes__add_note", {"text": "pay invoice 7", "delay": DELAY})
        elif "toolu_count" not in done:
            use = ("toolu_count", "notes__count_notes", {"delay": DELAY})
        else:
            content = [{"type": "text", "text": "done"}]
            return LlmResponse(content, "end_turn", Usage(10, 2), "e2e-model")
        content = [{"type": "tool_use", "id": use[0], "name": use[1], "input": use[2]}]
        return LlmResponse(content, "tool_use", Usage(10, 5), "e2e-model")


def build(settings: Settings) -> TwoCalls:
    return TwoCalls()
