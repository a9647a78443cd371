"""run.unrecorded_estimated_tokens: how much of run.unrecorded_tokens is an estimate

A model call lost with its worker (killed mid-call) is billed by the API and recorded
nowhere. Flow control's admission record holds an estimate of each call in flight (from the
request: its input at ~3 characters a token, and its max_tokens); the next admission of the
run finds an estimate its call never settled and adds it to run.unrecorded_tokens, counting
it here too, so a reader knows which part of the unrecorded tokens is an upper bound and
not the API's count.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE run ADD COLUMN unrecorded_estimated_tokens bigint NOT NULL DEFAULT 0")


def downgrade() -> None:
    op.execute("ALTER TABLE run DROP COLUMN unrecorded_estimated_tokens")
