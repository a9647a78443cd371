"""The acme demo's tables, their setup, and the queries its tools run.

The demo's tables are not part of the runtime's schema: no migration creates them, so a
production database never holds them. The demo sets them up itself (``dar dev`` seeds them at
start; the demo agent's tools create them on first use wherever that agent runs), and
migration 0021 drops the ones earlier releases created where they hold nothing of the demo's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP
from sqlalchemy.exc import DBAPIError

from db.errors import DatabaseUnavailable, database_unavailable
from db.queries import DEMO_QUERIES as Q

T = TypeVar("T")

TZ = TIMESTAMP(timezone=True)

# Tables of the demo alone: a metadata of their own, apart from db.schema's.
demo_metadata = MetaData()

# The acme demo's tickets: a real table the demo agent's tool reads.
acme_ticket = Table(
    "acme_ticket",
    demo_metadata,
    Column("id", Integer, primary_key=True),
    Column("title", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("priority", Text, nullable=False),
    Column("assignee", Text),
    Column("customer", Text, nullable=False),
    Column("due_at", TZ, nullable=False),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
)

# The acme demo's comments: a tool with a real side effect, idempotent by the tool_use id.
acme_comment = Table(
    "acme_comment",
    demo_metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("ticket_id", Integer, ForeignKey("acme_ticket.id"), nullable=False),
    Column("body", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False, unique=True),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
)

DEMO_TABLES = tuple(demo_metadata.tables)

# An arbitrary 64-bit advisory lock key: "dar demo setup" (processes setting up at once wait).
_SETUP_LOCK_KEY = 0x64_61_72_5F_64_65_6D

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


RETRY_SECONDS = 3.0
"""How long a demo tool keeps trying its statement on new connections while the database is
away (a restart, a failover) before it gives up with :class:`DatabaseUnavailable`: well
within the tools' 10 s timeout."""


class TicketStore:
    """The demo tools' queries, on the runtime's own database.

    The database away (a restart, a failover, a dropped connection: what the store classifies
    as unavailable) is not an answer for the model: each call is tried again on a new
    connection with a short backoff for up to ``retry_seconds`` (safe: reads, and a comment
    added once per key), then :class:`~db.errors.DatabaseUnavailable` is raised, which the
    step pipeline does not record as the tool's error: it takes the step up again later
    (:mod:`runtime.pipeline.effects`, rule 5). Any other error (no such ticket, bad data) is
    the tool's failure, for the model to see."""

    def __init__(self, engine: Engine, *, retry_seconds: float = RETRY_SECONDS) -> None:
        self.engine = engine
        self.retry_seconds = retry_seconds
        self._ready = False

    def _retrying(self, call: Callable[[], T]) -> T:
        give_up = time.monotonic() + self.retry_seconds
        delay = 0.1
        while True:
            try:
                return call()
            except DBAPIError as e:
                if not database_unavailable(e):
                    raise
                left = give_up - time.monotonic()
                if left <= 0:
                    raise DatabaseUnavailable.from_error(e) from e
                time.sleep(min(delay, left))
                delay = min(delay * 2, 1.0)

    def setup(self) -> bool:
        """Create the demo's tables where they are missing and seed the tickets into a table
        created now. Once per store; returns whether it created them."""
        if self._ready:
            return False
        with self.engine.begin() as conn:
            conn.execute(Q["demo_setup_lock"], {"k": _SETUP_LOCK_KEY})
            created = conn.execute(Q["acme_tables_exist"]).scalar_one() is not True
            if created:
                demo_metadata.create_all(conn, checkfirst=True)
                _insert_seed(conn)
        self._ready = True
        return created

    def seed(self) -> None:
        """Set the demo's tables up and put the seed tickets back (those deleted)."""
        self.setup()
        with self.engine.begin() as conn:
            _insert_seed(conn)

    def add_comment(self, ticket_id: int, body: str, *, idempotency_key: str) -> tuple[int, bool]:
        """Add a comment once per key. Returns ``(comment id, created now)``: ``created`` is
        false when the key's comment was already there (an earlier execution of the call, or
        an earlier try whose commit was not seen: the key makes trying again safe)."""
        return self._retrying(
            lambda: self._add_comment(ticket_id, body, idempotency_key=idempotency_key)
        )

    def _add_comment(self, ticket_id: int, body: str, *, idempotency_key: str) -> tuple[int, bool]:
        self.setup()
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
        def count() -> int:
            self.setup()
            with self.engine.connect() as conn:
                return int(
                    conn.execute(Q["count_acme_comments"], {"ticket_id": ticket_id}).scalar_one()
                )

        return self._retrying(count)

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

        def read() -> list[dict[str, Any]]:
            self.setup()
            with self.engine.connect() as conn:
                rows = conn.execute(Q["list_acme_tickets"], params).mappings().all()
            return [{**r, "due_at": r["due_at"].isoformat()} for r in rows]

        return self._retrying(read)


def _insert_seed(conn: Connection) -> None:
    keys = ("id", "title", "status", "priority", "assignee", "customer", "due_in_days")
    rows = [dict(zip(keys, t, strict=True)) for t in SEED_TICKETS]
    conn.execute(Q["seed_acme_tickets"], rows)
