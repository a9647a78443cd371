"""The demo agent: answers questions about acme's support tickets from a real table."""

from __future__ import annotations

from typing import Any, Literal

from db.demo import TicketStore
from runtime.agents import Agent
from runtime.tools import Tool, ToolContext, tool

ACME_SYSTEM_PROMPT = """\
You are the support operations assistant of Acme Inc. You answer questions about Acme's
support tickets. Use the list_tickets tool to look tickets up; never invent tickets. Use
add_comment only when asked to comment on or remind about a ticket. Answer briefly: one
line per ticket with its id, title, priority, assignee and due date, and say which are
overdue."""


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


def add_comment_tool(tickets: TicketStore) -> Tool:
    def add_comment(ticket_id: int, text: str, ctx: ToolContext) -> dict[str, Any]:
        """Add a comment to an acme ticket (for example a reminder on an overdue one).
        Posting the same call twice adds the comment once."""
        comment_id, created = tickets.add_comment(
            ticket_id, text, idempotency_key=ctx.idempotency_key
        )
        return {"ticket_id": ticket_id, "comment_id": comment_id, "created": created}

    # A real side effect, made idempotent by the tool_use id (INSERT ... ON CONFLICT DO
    # NOTHING on the key), so it is safe to run again after a crash.
    result: Tool = tool(add_comment, idempotent=True, timeout_seconds=10)
    return result


def acme_agent(tickets: TicketStore) -> Agent:
    return Agent(
        name="acme-tickets",
        system_prompt=ACME_SYSTEM_PROMPT,
        tools=(list_tickets_tool(tickets), add_comment_tool(tickets)),
    )
