"""The benchmark agent: ``DAR_AGENT_MODULES=bench.agents`` registers ``bench``, with the
tools ``noop``, that does nothing and returns at once, and ``digest``, that hashes ``mb`` MB
``rounds`` times: code blocking in C (hashlib releases the GIL, gevent cannot patch it)."""

from __future__ import annotations

import hashlib

from runtime.agents import Agent, AgentRegistry
from runtime.tools import tool


@tool(idempotent=True, timeout_seconds=10)
def noop(i: int = 0) -> str:
    """Does nothing and returns "ok" (benchmarks)."""
    return "ok"


@tool(idempotent=True, timeout_seconds=300)
def digest(mb: int = 50, rounds: int = 1) -> str:
    """SHA-256 of ``mb`` MB of zeros, ``rounds`` times (benchmarks: a tool blocking in C)."""
    return hash_blocking(mb, rounds)


def hash_blocking(mb: int, rounds: int) -> str:
    data = bytes(mb << 20)
    h = hashlib.sha256()
    for _ in range(rounds):
        h.update(data)
    return h.hexdigest()[:16]


def register(registry: AgentRegistry) -> None:
    registry.register(Agent(name="bench", system_prompt="Benchmark agent.", tools=(noop, digest)))
