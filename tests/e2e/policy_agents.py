"""The built-in demo agent (``acme-tickets``) with the upgrade policy ``replay``, for a
version's workers in the versions tests (``DAR_AGENT_MODULES=tests.e2e.policy_agents``): the
runs of a version no live worker serves move to theirs after the replay check. The policy is
not part of the agent's definition: the code and the version's digest stay the same."""

from __future__ import annotations

from dataclasses import replace

from runtime import AgentRegistry


def register(registry: AgentRegistry) -> None:
    registry.replace(replace(registry.get("acme-tickets"), upgrade="replay"))  # type: ignore[type-var]
