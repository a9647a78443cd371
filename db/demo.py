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
