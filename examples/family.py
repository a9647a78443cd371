"""A parent with two children: a durable function that hands two questions to the demo agent
(``acme-tickets``, an agent loop) as child runs and puts their answers together. Runs with
the offline demo model: ``DAR_AGENT_MODULES=examples.family dar dev``, then
``dar submit --agent family --json '{}'``.

``team`` is the same idea in the agent loop: its model hands the question to the demo agent
as a sub-agent (a tool whose call starts a child run), then answers with its result:
``dar submit --agent team 'Which acme tickets are overdue?'``."""

from __future__ import annotations

from typing import Any

from runtime import Agent, AgentRegistry, Subagent
from runtime.durable import Steps, durable_agent

QUESTIONS = ("Which acme tickets are overdue?", "Which acme tickets are high priority?")


@durable_agent("family")
def family(_: Any, steps: Steps) -> dict[str, Any]:
    # Each child is its own run (parentRunId = this run), started once however this run's
    # workers crash; this run waits for each holding no worker and no lease.
    answers = [steps.child("acme-tickets", q, token_budget=20_000) for q in QUESTIONS]
    return {"answers": answers}


TEAM = Agent(
    name="team",
    system_prompt="You lead a team: hand questions about acme tickets to the ticket agent.",
    subagents=(
        Subagent(
            "acme-tickets",
            name="ask_acme_tickets",
            description="Ask the ticket agent a question about acme's support tickets.",
            token_budget=20_000,
        ),
    ),
)


def register(registry: AgentRegistry) -> None:
    registry.register(family)
    registry.register(TEAM)
