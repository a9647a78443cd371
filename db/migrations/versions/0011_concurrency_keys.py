"""concurrency keys and priority: run.concurrency_key, run.priority, and the index the
"runs waiting by concurrency key" gauge counts on

A run's concurrency key (a tenant, a customer, a repository) caps how many of its runs are
inside a step at once (DAR_KEY_CONCURRENCY); its priority orders the runs waiting for a key
slot or a model's rate limit. The slots themselves live in Redis (runtime/keys.py); the
columns are what the workers read from the claimed run and what the API shows.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("run", sa.Column("concurrency_key", sa.Text))
    op.add_column(
        "run", sa.Column("priority", sa.Integer, nullable=False, server_default=sa.text("0"))
    )
    op.create_index(
        "run_concurrency_key_idx",
        "run",
        ["concurrency_key"],
        postgresql_where=sa.text(
            "concurrency_key IS NOT NULL AND status IN ('QUEUED', 'RUNNING')"
        ),
    )


def downgrade() -> None:
    op.drop_index("run_concurrency_key_idx", table_name="run")
    op.drop_column("run", "priority")
    op.drop_column("run", "concurrency_key")
