"""The demo agent: answers questions about acme's support tickets from a real table."""

from __future__ import annotations

from typing import Any, Literal

from db.demo import TicketStore
from runtime.agents import Agent
from runtime.tools import Tool, tool

ACME_SYSTEM_PROMPT = """\
You are the support operations assistant of Acme Inc. You answer questions about Acme's
support tickets. Use the list_tickets tool to look tickets up; never invent tickets. Answer
briefly: one line per ticket with its id, title, priority, assignee and due date, and say
which are overdue."""


def list_tickets_tool(tickets: TicketStore) -> Tool:
    def list_tickets(
        status: Literal["open", "in_progress", "closed"] | None = None,
        priority: Literal["low", "normal", "high", "urgent"] | None = None,
        assignee: str | None = None,
        overdue: bool | None = None,
        limit: int = 20,
    ) -> list[dict[str, Any]]:
        """List acme support tickets, most urgent due date first. Every filter is optional:
        status, priority, assignee, and overdue (true: not closed and due date in the past)."""
        return tickets.list(
            status=status,
            priority=priority,
            assignee=assignee,
            overdue=overdue,
            limit=max(1, min(limit, 100)),
        )

    # Read-only: safe to run again after a crash.
    result: Tool = tool(list_tickets, idempotent=True, timeout_seconds=10)
    return result


def acme_agent(tickets: TicketStore) -> Agent:
    return Agent(
        name="acme-tickets",
        system_prompt=ACME_SYSTEM_PROMPT,
        tools=(list_tickets_tool(tickets),),
    )
