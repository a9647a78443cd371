"""Agents for the child-run kill tests: a parent that starts two children, and a child whose
one step takes a few seconds (long enough to kill its worker in the middle of it)."""

from __future__ import annotations

import time
from typing import Any

from runtime import AgentRegistry
from runtime.durable import Steps, durable_agent


def _slow_double(x: int) -> int:
    time.sleep(4)
    return 2 * x


@durable_agent("family-child")
def family_child(x: int, steps: Steps) -> int:
    return steps.run("double", lambda: _slow_double(x), type=int, idempotent=True)


@durable_agent("family-parent")
def family_parent(_: Any, steps: Steps) -> int:
    return steps.child("family-child", 1) + steps.child("family-child", 2)


def register(registry: AgentRegistry) -> None:
    registry.register(family_child)
    registry.register(family_parent)
