"""The acme demo's tickets table: seeding and the query its tool runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from db.queries import QUERIES as Q

# (id, title, status, priority, assignee, customer, due in days: negative is overdue)
SEED_TICKETS: tuple[tuple[int, str, str, str, str | None, str, int], ...] = (
    (101, "Invoice PDF shows wrong VAT rate", "open", "high", "maria", "Globex", -6),
    (102, "SSO login loops on Safari", "open", "urgent", "dev", "Initech", -2),
    (103, "Export to CSV drops unicode names", "open", "low", None, "Umbrella", -11),
    (104, "Webhook retries flood endpoint", "in_progress", "high", "sam", "Hooli", 3),
    (105, "Password reset mail lands in spam", "open", "normal", "maria", "Globex", 5),
    (106, "Dashboard slow for 10k projects", "in_progress", "normal", "dev", "Soylent", -1),
    (107, "Typo on pricing page", "closed", "low", "sam", "acme", -20),
    (108, "API rate limit headers missing", "open", "normal", None, "Initech", 9),
)


class TicketStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def seed(self) -> None:
        keys = ("id", "title", "status", "priority", "assignee", "customer", "due_in_days")
        with self.engine.begin() as conn:
            rows = [dict(zip(keys, t, strict=True)) for t in SEED_TICKETS]
            conn.execute(Q["seed_acme_tickets"], rows)

    def add_comment(self, ticket_id: int, body: str, *, idempotency_key: str) -> tuple[int, bool]:
        """Add a comment once per key. Returns ``(comment id, created now)``."""
        with self.engine.begin() as conn:
            if conn.execute(Q["acme_ticket_exists"], {"ticket_id": ticket_id}).first() is None:
                raise LookupError(f"no acme ticket with id {ticket_id}")
            new_id = conn.execute(
                Q["add_acme_comment"],
                {"ticket_id": ticket_id, "body": body, "idempotency_key": idempotency_key},
            ).scalar()
            if new_id is not None:
                return int(new_id), True
            existing = conn.execute(
                Q["get_acme_comment_by_key"], {"idempotency_key": idempotency_key}
            ).scalar_one()
            return int(existing), False

    def count_comments(self, ticket_id: int | None = None) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(Q["count_acme_comments"], {"ticket_id": ticket_id}).scalar_one()
            )

    def list(
        self,
        *,
        status: str | None = None,
        priority: str | None = None,
        assignee: str | None = None,
        overdue: bool | None = None,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        params = {
            "status": status,
            "priority": priority,
            "assignee": assignee,
            "overdue": overdue,
            "limit": limit,
        }
        with self.engine.connect() as conn:
            rows = conn.execute(Q["list_acme_tickets"], params).mappings().all()
        return [{**r, "due_at": r["due_at"].isoformat()} for r in rows]
