"""run.wake_floor: the earliest moment a wake may bring a parked run forward to

A run parked on a timer that is a floor (a server's ``retry-after``, a ``steps.retry``
backoff, the grace of a step running past its timeout, ``steps.sleep``) is not brought
forward by a wake (a signal, a message, ``steps.send``, a child's end): the wake of a run
parked on what can arrive (a signal, a child, a key slot) is. NULL: no floor.

Revision ID: 0040
Revises: 0026
Create Date: 2026-12-07
"""

from alembic import op

revision = "0040"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE run ADD COLUMN IF NOT EXISTS wake_floor timestamptz")


def downgrade() -> None:
    op.execute("ALTER TABLE run DROP COLUMN IF EXISTS wake_floor")
