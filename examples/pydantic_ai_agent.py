"""order-desk: an ordinary Pydantic AI agent, registered as it is, run durably.

    DAR_AGENT_MODULES=examples.pydantic_ai_agent dar demo --agent order-desk \\
        --question "Where is order A-7?"

Every model request and tool call is a step of the run (see docs/frameworks/pydantic-ai.md).
With ANTHROPIC_API_KEY set it talks to Claude; without, to an offline demo model (Pydantic
AI's ``FunctionModel``) that looks the order up and answers from what the tool said, its
answer streamed word by word (``dar follow <run>`` shows it as it comes).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

from runtime import AgentRegistry

ORDERS = {"A-7": "shipped on Monday with DHL", "B-2": "waiting for stock"}


def demo_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Offline: look the order up, then answer with what the tool returned. It decides from
    the conversation alone, so any worker gives the same answer."""
    returned = [
        p for m in messages for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)
    ]
    if returned:
        return ModelResponse(parts=[TextPart(f"Order status: {returned[-1].content}.")])
    prompt = str(getattr(messages[-1].parts[-1], "content", ""))
    order = next((o for o in ORDERS if o in prompt), "A-7")
    return ModelResponse(parts=[ToolCallPart("lookup_order", {"order": order})])


async def demo_stream(
    messages: list[ModelMessage], info: AgentInfo
) -> AsyncIterator[str | DeltaToolCalls]:
    """The same answers, streamed: text a word at a time, as a model types."""
    for part in demo_model(messages, info).parts:
        if isinstance(part, TextPart):
            for piece in re.findall(r"\S+\s*", part.content):
                yield piece
                await asyncio.sleep(0.05)
        elif isinstance(part, ToolCallPart):
            yield {0: DeltaToolCall(name=part.tool_name, json_args=part.args_as_json_str())}


def build() -> Agent[None, str]:
    model: Any = (
        "anthropic:claude-sonnet-4-5"
        if os.environ.get("ANTHROPIC_API_KEY")
        else FunctionModel(demo_model, stream_function=demo_stream, model_name="demo-model")
    )
    agent = Agent(model, name="order-desk", instructions="Answer questions about orders.")

    @agent.tool_plain(metadata={"dar": {"idempotent": True}})  # a read: safe to repeat
    def lookup_order(order: str) -> str:
        """The status of an order."""
        return ORDERS.get(order, "unknown order")

    return agent


def register(registry: AgentRegistry) -> None:
    registry.register(build())
