"""Agents in several versions for the replay check and upgrades: ``v1``, and the changes a
new deploy may bring (``DAR_TEST_VARIANT`` chooses, for ``dar replay-check``'s own process):

- ``prompt``: the agent loop's system prompt changed (a configuration change: replays);
- ``renamed-tool``: its tool ``lookup_order`` is now ``find_order`` (a recorded step's tool
  is gone: diverges);
- ``refactor``: the durable function rewritten with the same steps (replays);
- ``renamed-step``: the durable function's first step renamed (diverges).
"""

from __future__ import annotations

import os
from typing import Any

from runtime.agents import Agent, AgentRegistry
from runtime.durable.api import DurableAgent, Steps, durable_agent
from runtime.tools import tool


@tool(idempotent=True)
def lookup_order(order_id: str) -> str:
    """Look an order up."""
    return f"order {order_id}: shipped"


@tool(name="find_order", idempotent=True)
def find_order(order_id: str) -> str:
    """Look an order up."""
    return f"order {order_id}: shipped"


@durable_agent("flow")
def flow_v1(value: Any, steps: Steps) -> Any:
    order = steps.run("fetch", lambda: {"id": value})
    steps.sleep(1)
    return steps.run("charge", lambda: order["id"])


@durable_agent("flow")
def flow_refactor(value: Any, steps: Steps) -> Any:
    def fetch() -> dict[str, Any]:
        return {"id": value}

    order = steps.run("fetch", fetch)
    steps.sleep(1)
    charged = steps.run("charge", lambda: order["id"])
    return charged


@durable_agent("flow")
def flow_renamed_step(value: Any, steps: Steps) -> Any:
    order = steps.run("load", lambda: {"id": value})
    steps.sleep(1)
    return steps.run("charge", lambda: order["id"])


@durable_agent("charge-or-fail")
def charge_or_fail(value: Any, steps: Steps) -> Any:
    steps.run("fetch", lambda: {"id": value})
    return steps.run("charge", _declined)


def _declined() -> Any:
    raise RuntimeError("card declined")


def agents(variant: str) -> list[Agent | DurableAgent]:
    support = Agent(
        name="support",
        system_prompt="Be thorough." if variant == "prompt" else "Be brief.",
        tools=(find_order,) if variant == "renamed-tool" else (lookup_order,),
    )
    flow = {"refactor": flow_refactor, "renamed-step": flow_renamed_step}.get(variant, flow_v1)
    return [support, flow, charge_or_fail]


def register(registry: AgentRegistry) -> None:
    for agent in agents(os.environ.get("DAR_TEST_VARIANT", "v1")):
        registry.register(agent)
