"""cost budget, billed-but-unrecorded usage, durable timers' reason

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("run", sa.Column("cost_budget_usd", sa.Numeric(18, 8)))
    op.add_column(
        "run",
        sa.Column("unrecorded_tokens", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.add_column(
        "run",
        sa.Column(
            "unrecorded_cost_usd", sa.Numeric(18, 8), nullable=False, server_default=sa.text("0")
        ),
    )
    op.add_column("run", sa.Column("wait_reason", sa.Text))


def downgrade() -> None:
    op.drop_column("run", "wait_reason")
    op.drop_column("run", "unrecorded_cost_usd")
    op.drop_column("run", "unrecorded_tokens")
    op.drop_column("run", "cost_budget_usd")
