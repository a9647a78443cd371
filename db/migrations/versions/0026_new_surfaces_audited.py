"""The new surfaces inside the audit trail and the quotas: schedules, messages, signals

- ``audit_event.schedule_id`` (and ``run_id`` optional): a schedule's create and delete are
  audited on the schedule (no run); messages and signals on the run they were sent to, with
  the sender, the Idempotency-Key and the size. New actions: ``schedule.create``,
  ``schedule.delete``, ``message``, ``signal``.
- ``audit_event_actor_idx``: a token's recent messages, signals and resumes (its rates and
  in-flight count) read by actor and time, not over the whole trail.
- ``schedule_tick.reason``: why a tick started no run (its creator over a limit, or its token
  revoked or expired), shown with the schedule's recent ticks; ``schedule_tick_created_idx``
  for retention, which now deletes old tick rows as it deletes old runs.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

OLD_ACTIONS = (
    "'cancel', 'resume', 'resolve', 'approve', 'reject', 'fork', 'submit', 'timeout', "
    "'recovery.redispatched', 'recovery.resumed'"
)
NEW_ACTIONS = OLD_ACTIONS + ", 'schedule.create', 'schedule.delete', 'message', 'signal'"


def upgrade() -> None:
    op.add_column("audit_event", sa.Column("schedule_id", pg.UUID(as_uuid=True)))
    op.alter_column("audit_event", "run_id", nullable=True)
    op.create_index(
        "audit_event_schedule_idx",
        "audit_event",
        ["schedule_id", "at"],
        postgresql_where=sa.text("schedule_id IS NOT NULL"),
    )
    op.create_index(
        "audit_event_actor_idx",
        "audit_event",
        ["actor", "action", "at"],
        postgresql_where=sa.text("action IN ('message', 'signal', 'resume')"),
    )
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.create_check_constraint("audit_event_action_ck", "audit_event", f"action IN ({NEW_ACTIONS})")
    op.add_column("schedule_tick", sa.Column("reason", sa.Text))
    op.create_index("schedule_tick_created_idx", "schedule_tick", ["created_at"])


def downgrade() -> None:
    op.drop_index("schedule_tick_created_idx", table_name="schedule_tick")
    op.drop_column("schedule_tick", "reason")
    # The trail is append-only: entries already written stay, the narrower check applies to
    # new rows only (NOT VALID), and run_id stays optional for the schedules' entries.
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.execute(
        "ALTER TABLE audit_event ADD CONSTRAINT audit_event_action_ck "
        f"CHECK (action IN ({OLD_ACTIONS})) NOT VALID"
    )
    op.drop_index("audit_event_actor_idx", table_name="audit_event")
    op.drop_index("audit_event_schedule_idx", table_name="audit_event")
    op.drop_column("audit_event", "schedule_id")
