"""indexes for the retention sweep and per-token submit rate limiting

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "run_finished_idx",
        "run",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.create_index(
        "run_submitter_idx",
        "run",
        ["submitted_by", "created_at"],
        postgresql_where=sa.text("submitted_by IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("run_submitter_idx", "run")
    op.drop_index("run_finished_idx", "run")
