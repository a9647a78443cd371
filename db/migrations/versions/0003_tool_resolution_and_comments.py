"""operator resolution of a STARTED tool step

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("run_step", sa.Column("resolution", sa.Text))
    # The acme demo's comments table was created here in earlier releases: see 0001 and 0021.


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS acme_comment")
    op.drop_column("run_step", "resolution")
