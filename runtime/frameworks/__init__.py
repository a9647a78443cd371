"""Agents written with other frameworks, run durably by this runtime.

``registry.register(agent)`` accepts a ``pydantic_ai.Agent`` (:mod:`runtime.frameworks.pydantic_ai`)
and an ``agents.Agent`` of the OpenAI Agents SDK (:mod:`runtime.frameworks.openai_agents`) as they
are; :func:`adapt` turns one into the durable function that runs it. The frameworks are
optional dependencies (the ``frameworks`` extra, or your own install within the ranges of
:mod:`runtime.frameworks.versions`): nothing here imports them until an agent of theirs is
registered, and an adapter imports none of its framework's optional features (Pydantic AI's
MCP support, its ``mcp`` extra) that the agent does not use.
"""

from __future__ import annotations

from typing import Any

from runtime.durable.api import DurableAgent
from runtime.frameworks.bridge import idempotency_key
from runtime.frameworks.versions import SUPPORTED, FrameworkVersionError

__all__ = ["FrameworkVersionError", "adapt", "framework_of", "idempotency_key"]


def framework_of(agent: object) -> str | None:
    """``"pydantic_ai"`` / ``"openai_agents"`` for an agent of those frameworks, else ``None``."""
    for cls in type(agent).__mro__:
        module = cls.__module__ or ""
        if module == "pydantic_ai" or module.startswith("pydantic_ai."):
            return "pydantic_ai" if cls.__name__ in ("Agent", "AbstractAgent") else None
        if module == "agents" or module.startswith("agents."):
            return "openai_agents" if cls.__name__ == "Agent" else None
    return None


def adapt(agent: Any, **options: Any) -> DurableAgent | None:
    """The durable function running ``agent`` when it is a framework's agent, else ``None``
    (``options``: the framework adapter's, e.g. ``deps=``). An installed framework version
    outside the supported range raises :class:`FrameworkVersionError`, one line naming it."""
    framework = framework_of(agent)
    if framework is not None:  # checked here too: the adapter may be imported already
        SUPPORTED[framework].require()
    if framework == "pydantic_ai":
        from runtime.frameworks import pydantic_ai

        return pydantic_ai.adapt(agent, **options)
    if framework == "openai_agents":
        from runtime.frameworks import openai_agents

        return openai_agents.adapt(agent, **options)
    if options:
        raise TypeError(f"register() takes options only for a framework's agent: {sorted(options)}")
    return None
