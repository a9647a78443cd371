"""forks: a run's lineage (forked from which run, from which step, replaying the model),
copied and replayed step rows with what the original paid for them kept apart

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

OLD_ACTIONS = "'cancel', 'resume', 'resolve', 'approve', 'reject'"
NEW_ACTIONS = OLD_ACTIONS + ", 'fork'"


def upgrade() -> None:
    op.add_column("run", sa.Column("forked_from_run", pg.UUID(as_uuid=True)))
    op.add_column("run", sa.Column("forked_from_seq", sa.Integer))
    op.add_column(
        "run",
        sa.Column("replay_model", sa.Boolean, nullable=False, server_default=sa.text("false")),
    )
    op.add_column("run_step", sa.Column("origin", sa.Text))
    op.add_column("run_step", sa.Column("original_tokens", sa.BigInteger))
    op.add_column("run_step", sa.Column("original_cost_usd", sa.Numeric(18, 8)))
    op.create_check_constraint(
        "run_step_origin_ck", "run_step", "origin IN ('copied', 'edited', 'replayed')"
    )
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.create_check_constraint("audit_event_action_ck", "audit_event", f"action IN ({NEW_ACTIONS})")


def downgrade() -> None:
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.create_check_constraint("audit_event_action_ck", "audit_event", f"action IN ({OLD_ACTIONS})")
    op.drop_constraint("run_step_origin_ck", "run_step", type_="check")
    op.drop_column("run_step", "original_cost_usd")
    op.drop_column("run_step", "original_tokens")
    op.drop_column("run_step", "origin")
    op.drop_column("run", "replay_model")
    op.drop_column("run", "forked_from_seq")
    op.drop_column("run", "forked_from_run")
