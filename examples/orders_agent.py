"""An agent with two tools, registered from a module of your own.

Run it with the offline demo model (or Claude, with ANTHROPIC_API_KEY set):

    DAR_AGENT_MODULES=examples.orders_agent dar demo --agent orders \\
        --question "Where is order 1042? Email the customer its status."

or, with `dar dev` running under the same DAR_AGENT_MODULES,

    curl -s -X POST localhost:8080/api/runs -H 'Content-Type: application/json' \\
        -d '{"agent": "orders", "input": "Where is order 1042?"}'
"""

from __future__ import annotations

from typing import Any

from runtime import Agent, AgentRegistry, ToolContext, tool

# Stands in for your order system. Tools run in worker processes: keep real state in a
# database or behind an API, never in module globals.
ORDERS: dict[int, dict[str, Any]] = {
    1042: {"status": "shipped", "carrier": "DHL", "eta": "2026-12-03", "email": "ann@example.com"},
    1043: {"status": "packing", "carrier": None, "eta": "2026-12-05", "email": "bo@example.com"},
}


@tool(idempotent=True, timeout_seconds=5)
def get_order(order_id: int) -> dict[str, Any]:
    """Look up an order by its number: status, carrier and expected delivery date."""
    order = ORDERS.get(order_id)
    if order is None:
        raise LookupError(f"no order {order_id}")  # the model sees this as an error result
    return {"order_id": order_id, **{k: v for k, v in order.items() if k != "email"}}


@tool(idempotent=True, timeout_seconds=10)
def send_status_email(order_id: int, ctx: ToolContext) -> str:
    """Email the customer the current status of their order."""
    # A real implementation passes the key downstream, e.g.
    #   httpx.post(MAIL_API, json=..., headers={"Idempotency-Key": ctx.idempotency_key})
    # so that a re-execution after a crash sends one email, not two. That is what makes it
    # honest to declare the tool idempotent.
    if order_id not in ORDERS:
        raise LookupError(f"no order {order_id}")
    return f"status email for order {order_id} queued (idempotency key {ctx.idempotency_key})"


SYSTEM_PROMPT = """\
You answer customers' questions about their orders. Look the order up with get_order before
answering; when the customer asks for it, email them the status with send_status_email."""


def register(registry: AgentRegistry) -> None:
    """Called once at startup for each module named in DAR_AGENT_MODULES."""
    registry.register(
        Agent(
            name="orders",
            system_prompt=SYSTEM_PROMPT,
            tools=(get_order, send_status_email),
            max_steps=12,
        )
    )
