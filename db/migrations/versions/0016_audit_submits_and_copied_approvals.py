"""audit_event records submits and approvals decided by their timeout; approval.copied_from
labels a decision a fork copied from the run it was forked from

A fork copies the decisions of the approvals whose results it replays (their action ran in
the original, and runs nowhere again); such a row now says which run decided it, so the
fork's approvals never read as a decision someone made for the fork.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

OLD_ACTIONS = "'cancel', 'resume', 'resolve', 'approve', 'reject', 'fork'"
NEW_ACTIONS = OLD_ACTIONS + ", 'submit', 'timeout'"


def upgrade() -> None:
    op.add_column("approval", sa.Column("copied_from", pg.UUID(as_uuid=True)))
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.create_check_constraint("audit_event_action_ck", "audit_event", f"action IN ({NEW_ACTIONS})")


def downgrade() -> None:
    # The trail is append-only (a trigger refuses DELETE): entries already written stay, and
    # the narrower check applies to new rows only (NOT VALID).
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.execute(
        "ALTER TABLE audit_event ADD CONSTRAINT audit_event_action_ck "
        f"CHECK (action IN ({OLD_ACTIONS})) NOT VALID"
    )
    op.drop_column("approval", "copied_from")
