"""An example agent module shipped in its own image (``deploy/your-agents``).

``DAR_AGENT_MODULES=my_agents.support`` makes every process (web, worker, beat) call
``register(registry)`` at start; the image puts this package in the working directory.
"""

from __future__ import annotations

from typing import Any

from runtime import Agent, AgentRegistry, ToolContext, tool

# Stands in for your order system: tools run in worker processes, so real state lives in a
# database or behind an API, never in module globals.
ORDERS: dict[int, dict[str, Any]] = {
    7001: {"status": "shipped", "carrier": "DHL"},
    7002: {"status": "packing", "carrier": None},
}


@tool(idempotent=True, timeout_seconds=5)
def order_status(order_id: int, ctx: ToolContext) -> dict[str, Any]:
    """The status and carrier of an order, by its number."""
    order = ORDERS.get(order_id)
    if order is None:
        raise LookupError(f"no order {order_id}")  # the model sees this as an error result
    return {"order_id": order_id, **order, "idempotency_key": ctx.idempotency_key}


def register(registry: AgentRegistry) -> None:
    registry.register(
        Agent(
            name="support",
            system_prompt="You answer questions about orders. Look the order up first.",
            tools=(order_status,),
            max_steps=8,
        )
    )
