"""ticket-triage: a durable function with an LLM classification, a retried step, a human
approval and a side effect that happens exactly once.

    DAR_AGENT_MODULES=examples.ticket_triage dar demo --agent ticket-triage \\
        --input '{"id": 101, "subject": "Invoice wrong", "body": "VAT is 19%, should be 7%"}'

The run stops WAITING for a `support_lead` decision: approve it with
`curl -X POST localhost:8080/api/approvals/<id>/approve` (`dar demo` approves it for you
with --approve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from db.demo import TicketStore
from runtime import AgentRegistry
from runtime.durable import Model, Steps, current_steps, durable_agent, step


@dataclass
class Ticket:
    id: int
    subject: str
    body: str


@dataclass
class Classification:
    category: str
    priority: str
    summary: str


@dataclass
class SimilarTicket:
    id: int
    title: str


@dataclass
class Resolution:
    ticket_id: int
    action: str
    note: str


KNOWLEDGE_BASE = {
    "billing": [SimilarTicket(101, "Invoice PDF shows wrong VAT rate")],
    "login": [SimilarTicket(102, "SSO login loops on Safari")],
    "other": [],
}

CLASSIFY = """Classify this support ticket. Answer with JSON only:
{{"category": "billing" | "login" | "other", "priority": "low" | "normal" | "high",
  "summary": "<one line>"}}

Subject: {subject}
{body}"""


def classify(model: Model, ticket: Ticket) -> Classification:
    try:
        data = model.complete_json(CLASSIFY.format(subject=ticket.subject, body=ticket.body))
        return Classification(**data)
    except (ValueError, TypeError):
        # The offline demo model does not answer JSON: classify by keywords instead.
        text = f"{ticket.subject} {ticket.body}".lower()
        category = next(
            (
                c
                for c in ("billing", "login")
                if c in text or (c == "billing" and ("invoice" in text or "vat" in text))
            ),
            "other",
        )
        return Classification(category, "normal", ticket.subject)


@step(retry=3, backoff=0.5)
def find_similar(c: Classification) -> list[SimilarTicket]:
    """Look up earlier tickets like this one (a flaky search in real life: retried)."""
    return KNOWLEDGE_BASE.get(c.category, [])


def propose(ticket: Ticket, c: Classification, similar: list[SimilarTicket]) -> Resolution:
    seen = ", ".join(f"#{s.id}" for s in similar) or "none"
    return Resolution(ticket.id, f"route to {c.category}", f"{c.summary} (similar: {seen})")


def build(tickets: TicketStore) -> Any:
    @step
    def apply(resolution: Resolution) -> dict[str, Any]:
        """The side effect: a comment on the ticket, idempotent by the step's idempotency
        key (``<run id>/<step key>``), so a re-execution after a crash adds nothing."""
        steps = current_steps()
        key = f"triage:{steps.key}" if steps else "triage:manual"
        comment_id, created = tickets.add_comment(
            resolution.ticket_id, f"{resolution.action}: {resolution.note}", idempotency_key=key
        )
        return {"comment_id": comment_id, "created": created}

    @durable_agent("ticket-triage", approval_roles=["support_lead"])
    def triage(ticket: Ticket, steps: Steps) -> Resolution:
        c = steps.llm("classify", lambda m: classify(m, ticket), type=Classification)
        similar = find_similar(c)  # a @step: recorded, retried up to 3 times
        resolution = steps.approval("support_lead", 86400).run(
            "propose", propose, ticket, c, similar, type=Resolution
        )
        apply(resolution)
        return resolution

    return triage


def register(registry: AgentRegistry) -> None:
    registry.register(build(registry.resources["tickets"]))
