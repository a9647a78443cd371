"""Durable functions whose failures quote data, for the worker-log test
(``DAR_AGENT_MODULES=tests.e2e.log_probe_agents``): ``log-probe`` fails to decode an input
that is not an ``Order``, and raises in a step with the order's note in the message."""

from __future__ import annotations

from dataclasses import dataclass

from runtime import AgentRegistry
from runtime.durable import Steps, durable_agent


@dataclass
class Order:
    kind: str
    note: str


def _raise(message: str) -> str:
    raise RuntimeError(message)


@durable_agent("log-probe")
def probe(order: Order, steps: Steps) -> str:
    return steps.run("charge", lambda: _raise(f"card declined: {order.note}"), type=str)


def register(registry: AgentRegistry) -> None:
    registry.register(probe)
