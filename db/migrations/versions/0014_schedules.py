"""Schedules: an agent started on a cron expression, one run per tick

A tick is a row of schedule_tick, unique per (schedule, tick time): whichever beat inserts it
first starts its run in the same transaction; any other beat's insert does nothing. So any
number of beats, and any restart, start exactly one run per tick (Celery beat's own schedule
lives in one process's memory and file, and knows nothing of the others).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE schedule (
            id uuid PRIMARY KEY,
            tenant text NOT NULL DEFAULT '',
            agent text NOT NULL,
            input jsonb NOT NULL,
            model text NOT NULL,
            max_steps integer NOT NULL,
            token_budget bigint NOT NULL,
            timeout_seconds integer NOT NULL,
            cost_budget_usd numeric(18, 8),
            priority integer NOT NULL DEFAULT 0,
            cron text NOT NULL,
            timezone text NOT NULL,
            overlap text NOT NULL,
            catch_up text NOT NULL,
            next_tick_at timestamptz NOT NULL,
            created_by text,
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT schedule_overlap_ck CHECK (overlap IN ('skip', 'queue', 'allow')),
            CONSTRAINT schedule_catch_up_ck CHECK (catch_up IN ('none', 'latest', 'all'))
        )
        """
    )
    op.execute("CREATE INDEX schedule_next_tick_idx ON schedule (next_tick_at)")
    op.execute("CREATE INDEX schedule_tenant_created_idx ON schedule (tenant, created_at)")
    op.execute(
        """
        CREATE TABLE schedule_tick (
            schedule_id uuid NOT NULL REFERENCES schedule (id) ON DELETE CASCADE,
            tick_at timestamptz NOT NULL,
            status text NOT NULL,
            run_id uuid,
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT schedule_tick_uk UNIQUE (schedule_id, tick_at),
            CONSTRAINT schedule_tick_status_ck CHECK (status IN ('STARTED', 'SKIPPED', 'QUEUED'))
        )
        """
    )
    op.execute(
        "CREATE INDEX schedule_tick_queued_idx ON schedule_tick (schedule_id, tick_at) "
        "WHERE status = 'QUEUED'"
    )
    op.execute("ALTER TABLE run ADD COLUMN schedule_id uuid")
    op.execute(
        "CREATE INDEX run_schedule_live_idx ON run (schedule_id) WHERE schedule_id IS NOT NULL "
        "AND status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')"
    )


def downgrade() -> None:
    op.execute("DROP INDEX run_schedule_live_idx")
    op.execute("ALTER TABLE run DROP COLUMN schedule_id")
    op.execute("DROP TABLE schedule_tick")
    op.execute("DROP TABLE schedule")
